"""Chrome/Perfetto trace writer shared by every tandem component (the engine's ops, the kvstore's
messages, the trainer's waits): below both the engine and the kvstore, so each records here directly.

Events are kept in memory as tuples (appending to a list is atomic under the GIL, so record() needs no
lock) and written as ``{"traceEvents": [...]}`` with "X" complete events plus thread_name metadata,
which both chrome://tracing and ui.perfetto.dev load. With TANDEM_TRACE=path set, tracing starts at
import and the file is written at process exit; ``{pid}`` in the path is replaced by the process id so
that several processes of one job do not overwrite each other's file.
"""

from __future__ import annotations

import atexit
import json
import os
import threading
import time
from typing import Any

from tandem.env import knob

MAX_EVENTS = 2_000_000  # ~300 MB of tuples at most; later events are counted and dropped


class _State:
    """Module state in one object so the hot check is a single attribute load."""

    __slots__ = ("on", "template", "path", "events", "dropped", "thread_ids", "lock")

    def __init__(self) -> None:
        self.on = False
        self.template = ""  # the path as given; "{pid}" is filled per process
        self.path = ""
        self.events: list[tuple[str, str, float, float, int, dict[str, Any] | None]] = []
        self.dropped = 0
        self.thread_ids: dict[str, int] = {}
        self.lock = threading.Lock()  # guards start/stop/write and new thread ids only


state = _State()
_clock = time.perf_counter


def now_us() -> float:
    """Microseconds on the trace clock (monotonic; only differences and ordering matter)."""
    return _clock() * 1e6


def enabled() -> bool:
    return state.on


def _thread_id(label: str) -> int:
    tid = state.thread_ids.get(label)
    if tid is None:
        with state.lock:
            tid = state.thread_ids.setdefault(label, len(state.thread_ids) + 1)
    return tid


def record(
    name: str,
    start_us: float,
    end_us: float,
    category: str = "op",
    args: dict[str, Any] | None = None,
    thread: str | None = None,
) -> None:
    """Record one complete event. Thread-safe; returns at once when tracing is off.

    ``thread`` labels the row the event appears on (default: the calling thread's name).
    """
    if not state.on:
        return
    if len(state.events) >= MAX_EVENTS:
        state.dropped += 1
        return
    label = thread if thread is not None else threading.current_thread().name
    state.events.append((name, category, start_us, end_us, _thread_id(label), args))


def start(path: str) -> None:
    """Start recording (dropping earlier events); the trace goes to ``path`` on stop() or at exit."""
    if not path:
        raise ValueError("trace.start needs a file path, e.g. trace.start('runs/trace.json')")
    with state.lock:
        state.template = path
        state.path = path.replace("{pid}", str(os.getpid()))
        state.events = []
        state.dropped = 0
        state.on = True


def stop() -> str:
    """Stop recording and write the trace file; returns its path. Raises if tracing was not started."""
    with state.lock:
        if not state.on:
            raise RuntimeError("trace.stop() called but tracing is not running; call trace.start(path) first")
        state.on = False
        events, state.events = state.events, []
        _write(state.path, events, state.dropped, dict(state.thread_ids))
        return state.path


def _write(
    path: str,
    events: list[tuple[str, str, float, float, int, dict[str, Any] | None]],
    dropped: int,
    thread_ids: dict[str, int],
) -> None:
    pid = os.getpid()
    out: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": f"tandem pid {pid}"}}
    ]
    out += [
        {"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": label}}
        for label, tid in thread_ids.items()
    ]
    for name, category, start_us, end_us, tid, args in events:
        event: dict[str, Any] = {
            "name": name,
            "cat": category,
            "ph": "X",
            "pid": pid,
            "tid": tid,
            "ts": round(start_us, 3),
            "dur": round(max(end_us - start_us, 0.0), 3),
        }
        if args:
            event["args"] = args
        out.append(event)
    document: dict[str, Any] = {"traceEvents": out, "displayTimeUnit": "ms"}
    if dropped:
        document["otherData"] = {"dropped_events": dropped, "max_events": MAX_EVENTS}
    directory = os.path.dirname(path)
    if directory:
        os.makedirs(directory, exist_ok=True)
    with open(path, "w") as handle:
        json.dump(document, handle, default=str)


def _write_at_exit() -> None:
    if state.on:
        stop()


def _reset_after_fork() -> None:
    # A forked child inherits the parent's events; writing them again would duplicate the parent's file.
    state.events = []
    state.lock = threading.Lock()
    state.on = state.on and "{pid}" in state.template
    state.path = state.template.replace("{pid}", str(os.getpid()))


if knob("TANDEM_TRACE"):
    start(knob("TANDEM_TRACE"))
atexit.register(_write_at_exit)
os.register_at_fork(after_in_child=_reset_after_fork)
