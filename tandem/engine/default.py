"""The process-wide engine, created lazily from TANDEM_ENGINE."""

from __future__ import annotations

import os
import threading

from tandem.engine.base import Engine
from tandem.engine.host_memory import retain_freed_host_memory
from tandem.engine.naive import NaiveEngine
from tandem.engine.threaded import ThreadedEngine
from tandem.env import knob

_KINDS = {"threaded": ThreadedEngine, "naive": NaiveEngine}
_engine: Engine | None = None
_lock = threading.Lock()


def get_engine() -> Engine:
    """The process-wide engine; created on first use as TANDEM_ENGINE says. Thread-safe."""
    engine = _engine
    if engine is not None:
        return engine
    return _create()


def _create() -> Engine:
    global _engine
    with _lock:
        if _engine is None:
            kind = knob("TANDEM_ENGINE")
            if kind not in _KINDS:
                raise ValueError(f"TANDEM_ENGINE={kind!r} is not an engine kind; use one of {sorted(_KINDS)}")
            retain_freed_host_memory()  # before the first step allocates: see host_memory.py
            _engine = _KINDS[kind]()
        return _engine


def set_engine(engine: Engine | None) -> None:
    """Replace the process-wide engine (None: recreate from the environment on next get_engine()).

    The old engine is not shut down: ops already pushed to it still run; call its shutdown() if needed.
    """
    global _engine
    if engine is not None and not isinstance(engine, Engine):
        raise TypeError(f"set_engine takes an engine.Engine or None, got {type(engine).__name__}")
    with _lock:
        _engine = engine


def _forget_after_fork() -> None:
    # The parent's worker threads do not exist in a forked child; it must build its own engine.
    global _engine, _lock
    _engine = None
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_after_fork)
