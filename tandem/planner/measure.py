"""The machine constants of the simulation, measured here (``measure_machine``), cached as JSON (``this_machine``).

CPU costs are measured as CPU time (``time.process_time`` here, the server's threads' run time from
``/proc``), not wall time, so a busy machine slows the measurement but hardly changes its result.
``message_costs``: a real ``dist_sync`` server process on loopback and this process as its only
worker, pushpulls of 4 elements, of ``large`` elements and of ``entries`` keys of 4 elements in one
call, run as a ``tandem launch`` job runs them: every message authenticated (a per-job secret,
launch's default) and the update on the server (SGD with momentum, what the validated jobs run: its
replies are copies). A pushpull of one key is one request and one reply, so the worker's CPU per
pushpull is ``2 (message_s + entry_s + bytes byte_s)`` and the server's ``2 (server_message_s +
server_entry_s + bytes server_byte_s)`` plus the two passes over the bytes the simulator charges as
summing (the push, the round's update); n keys in one call share one message each way, which
separates the per-request part (``entry_s``) from the message's. The update's fixed cost per slot
goes into ``server_entry_s``, so the simulator charges it per request rather than once per round.
Those are the costs of messages back to back; a message after an idle gap costs more (``wake``, at
0.2-20 ms gaps: in a job a thread mostly waits, or computes, between messages).
``aggregate_bytes_per_s``: float32 bytes a server adds per second (``a.add_(b)`` on 64 MB arrays,
beyond the caches as received gradients are, one thread).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import secrets
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from tandem.planner.sim import Machine


def _thread_seconds(pid: int) -> float:
    """CPU seconds run so far by the live threads of process ``pid`` (``/proc/PID/task/*/schedstat``, ns)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            pass  # the thread ended meanwhile
    return total / 1e9


WAKE_GAPS = (0.2e-3, 1e-3, 5e-3, 20e-3)  # seconds the probe sleeps before a message to measure the wake-up fee
WAKE_SECONDS = 0.3  # of idling per gap and repeat (fewer trips at the longer gaps)


def message_costs(large: int = 2**18, small_trips: int = 1000, large_trips: int = 60, repeats: int = 5,
                  authenticated: bool = True, wake_gaps: tuple[float, ...] = WAKE_GAPS,
                  entries: int = 32) -> dict[str, Any]:  # fmt: skip
    """message_s, byte_s, server_message_s, server_byte_s: CPU per message and per byte, worker and
    server, of messages back to back; entry_s, server_entry_s: CPU per request a message carries;
    ``wake``: the extra CPU of a message after an idle gap.

    ``authenticated``: with a secret, as ``tandem launch`` runs a job unless told ``--no-secret``
    (whole-message tags cost CPU per byte on both ends). ``entries``: small keys pushpulled in one
    call, so one message each way carries them all (the client's grouping, the server's held
    replies): what a request costs beyond the first of its message. ``wake``: small pushpulls with
    the worker sleeping each of ``wake_gaps`` before each trip (``wake_points``)."""
    import torch
    import torch.distributed as dist

    from tandem import optim
    from tandem.kvstore.config import DistOptions
    from tandem.kvstore.ps.topology import Topology
    from tandem.kvstore.ps.worker import DistKVStore

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    env = {**os.environ, "TANDEM_NUM_WORKERS": "1", "TANDEM_NUM_SERVERS": "1", "TANDEM_MASTER_ADDR": "127.0.0.1",
           "TANDEM_MASTER_PORT": str(store.port), "TANDEM_ROLE": "server", "TANDEM_RANK": "0",
           "TANDEM_NUM_THREADS": "1", "OMP_NUM_THREADS": "1",
           "TANDEM_PS_SECRET": secrets.token_hex(32) if authenticated else ""}  # fmt: skip
    server = subprocess.Popen([sys.executable, "-m", "tandem.kvstore.ps"], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)  # fmt: skip
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        options = dataclasses.replace(DistOptions.from_env("dist_sync"), secret=env["TANDEM_PS_SECRET"])
        kv = DistKVStore(Topology("worker", 0, 1, 1, "127.0.0.1", store.port, 2), options)
        sizes = ((4, small_trips), (large, large_trips))
        for numel, _ in sizes:
            kv.init(f"probe{numel}", torch.zeros(numel))
        many = [f"entry{i}" for i in range(entries)]
        kv.init(many, [torch.zeros(4) for _ in many])
        kv.set_optimizer(optim.SGD(lr=1e-6, momentum=0.9))  # the server updates and replies with a copy, as in a job
        buffers = {numel: ([f"probe{numel}"], [torch.ones(numel)], [torch.empty(numel)]) for numel, _ in sizes}
        buffers[-entries] = (many, [torch.ones(4) for _ in many], [torch.empty(4) for _ in many])  # -n: n keys of 4
        grouped_trips = max(5, small_trips // 4)
        for numel, trips in (*sizes, (-entries, grouped_trips)):  # warm up, once
            for _ in range(trips // 10):
                kv.pushpull(*buffers[numel][:2], out=buffers[numel][2]).wait()
        # (numel, idle seconds before each trip, trips): back to back for both sizes and the grouped keys,
        # then small ones after gaps
        runs = [(numel, 0.0, trips) for numel, trips in sizes] + [(-entries, 0.0, grouped_trips)]
        runs += [(4, gap, max(5, min(small_trips, round(WAKE_SECONDS / gap)))) for gap in wake_gaps]
        samples: dict[tuple[int, float], list[tuple[float, float, float]]] = {(n, gap): [] for n, gap, _ in runs}
        for _ in range(repeats):  # interleaved, the median of each: one disturbed pass does not decide
            for numel, gap, trips in runs:
                keys, value, out = buffers[numel]
                wall, worker, served = time.perf_counter(), time.process_time(), _thread_seconds(server.pid)
                for _ in range(trips):
                    if gap:
                        time.sleep(gap)
                    kv.pushpull(keys, value, out=out).wait()
                samples[numel, gap].append(((time.perf_counter() - wall) / trips,
                                            (time.process_time() - worker) / trips,
                                            (_thread_seconds(server.pid) - served) / trips))  # fmt: skip
        kv.close()
        per_trip = {run: tuple(statistics.median(sample[i] for sample in found) for i in range(3))
                    for run, found in samples.items()}  # fmt: skip
    finally:
        torch.set_num_threads(threads)
        if not _ended(server):
            server.kill()
            server.wait()
    extra = (large - 4) * 4  # bytes more per message
    (_, worker_small, server_small), (_, worker_large, server_large) = per_trip[4, 0.0], per_trip[large, 0.0]
    (_, worker_many, server_many) = per_trip[-entries, 0.0]
    summing = 2 * extra / aggregate_bytes_per_s()  # what the simulator charges a server as summing
    # a trip is a request and a reply: 2 (message + entry) alone, 2 (message + n entry) grouped
    entry_s = max(0.0, (worker_many - worker_small) / (2 * (entries - 1)))
    server_entry_s = max(0.0, (server_many - server_small) / (2 * (entries - 1)))
    return {"message_s": max(0.0, worker_small / 2 - entry_s), "entry_s": entry_s,
            "byte_s": max(0.0, (worker_large - worker_small) / (2 * extra)),
            "server_message_s": max(0.0, server_small / 2 - server_entry_s), "server_entry_s": server_entry_s,
            "server_byte_s": max(0.0, (server_large - server_small - summing) / (2 * extra)),
            "wake": wake_points(per_trip[4, 0.0], [per_trip[4, gap] for gap in wake_gaps])}  # fmt: skip


def wake_points(back_to_back: tuple[float, ...], after_gaps: list[tuple[float, ...]]) -> tuple[tuple[float, float, float], ...]:
    """``Machine.wake`` from the probe's small pushpulls, each ``(wall, worker CPU, server CPU)`` per trip:
    back to back, and with the worker sleeping before each. A thread's idle time before a message is
    about a trip's wall time (each waits for the other end; back to back that is the costs' own
    case: no fee), and the sleep's on top of it. The CPU per trip beyond the back-to-back trips' is
    the fee: the worker's split over its two messages (the request it sends, the reply it receives,
    as ``sim.Resource`` charges a sender and a receiver thread), the server's all on the request it
    wakes to (its reply follows at once)."""
    wall, worker, server = back_to_back[:3]
    points = [(wall, 0.0, 0.0)]
    for gap_wall, gap_worker, gap_server in (trip[:3] for trip in after_gaps):
        idle = max(gap_wall, points[-1][0] * (1 + 1e-9) + 1e-9)  # increasing, however noisy the clock
        points.append((idle, max(0.0, (gap_worker - worker) / 2), max(0.0, gap_server - server)))
    return tuple(points)


def _ended(process: subprocess.Popen[bytes], timeout: float = 10.0) -> bool:
    """Whether the server exits on its own (its only worker said goodbye) within ``timeout``."""
    try:
        process.wait(timeout=timeout)
        return True
    except subprocess.TimeoutExpired:
        return False


def aggregate_bytes_per_s(numel: int = 2**24, repeats: int = 20) -> float:
    """Bytes of float32 gradient a server sums per second, one thread."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a server process runs one torch thread
    try:
        total, part = torch.zeros(numel), torch.ones(numel)
        seconds = []
        for _ in range(repeats):
            start = time.perf_counter()
            total.add_(part)
            seconds.append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    return numel * 4 / min(seconds)  # the least disturbed pass: other work on the machine only adds time


def cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def background_threads(seconds: float = 2.0, interval: float = 0.02) -> float:
    """Threads of other work competing for this machine's cores now: the mean of the kernel's count of
    runnable threads (``/proc/loadavg``'s 4th field) over ``seconds``, less this one. On a quiet machine 0."""
    samples = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        samples.append(int(Path("/proc/loadavg").read_text().split()[3].split("/")[0]) - 1)
        time.sleep(interval)
    return max(0.0, sum(samples) / len(samples))


def measure_machine(shared_host: bool = True) -> Machine:
    """This machine: its measured costs and cores; ``shared_host``: every worker and server runs on it."""
    return Machine(**message_costs(), aggregate_Bps=aggregate_bytes_per_s(), cores=cores(), shared_host=shared_host)


def dispatch_seconds(ops: int = 20_000, repeats: int = 3) -> float:
    """Seconds per small torch call from Python (``x.add_(1)`` on 1,000 elements, one thread): the
    per-op cost that message costs and small models' steps follow. The least disturbed of ``repeats``."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        x, times = torch.zeros(1000), []
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(ops):
                x.add_(1)
            times.append((time.perf_counter() - start) / ops)
    finally:
        torch.set_num_threads(threads)
    return min(times)


def save(machine: Machine, path: str | Path, dispatch_s: float | None = None) -> Path:
    """``machine`` as JSON, with the ``dispatch_seconds`` measured beside its costs (to tell later
    whether the machine still runs at the speed it was measured at)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    found = dataclasses.asdict(machine) | ({} if dispatch_s is None else {"dispatch_s": dispatch_s})
    path.write_text(json.dumps(found, indent=1))
    return path


MEASURED_SINCE = ("wake", "entry_s", "server_entry_s")  # costs earlier versions did not measure


def _read(path: str | Path) -> tuple[Machine, float | None, list[str]]:
    """The cached machine, the per-op speed it was measured at, and the costs this version measures
    that it lacks (a cache of an earlier version)."""
    found = json.loads(Path(path).read_text())
    dispatch_s = found.pop("dispatch_s", None)
    return Machine(**found), dispatch_s, [name for name in MEASURED_SINCE if name not in found]


def load(path: str | Path) -> Machine:
    return _read(path)[0]


STALE = 0.25  # a cached machine is measured again when its per-op speed moved by more than this (either way)


def stale(then: object, now: float) -> bool:
    """Whether costs cached at per-op speed ``then`` (``dispatch_seconds``; None or nonsense: unknown)
    no longer hold at ``now``: the speed moved by more than ``STALE``, slower or faster alike."""
    if not (isinstance(then, (int, float)) and then > 0 and now > 0):
        return True
    return abs(math.log(now / then)) > math.log(1 + STALE)


def this_machine(cache: str | Path | None = None, refresh: bool = False, dispatch_s: float | None = None) -> Machine:
    """This machine, every process on it: read from ``cache`` if there (and not ``refresh``), else measured
    (about 15 s) and saved there. A cache is measured again when this machine's per-op speed
    (``dispatch_s``: ``dispatch_seconds()`` unless given) is ``stale`` against the speed saved with it,
    or none was saved, or it lacks a cost this version measures (``MEASURED_SINCE``): a
    machine shared with other tenants can run at half its speed for hours, and every cost with it."""
    if cache is not None and dispatch_s is None:
        dispatch_s = dispatch_seconds()
    if cache is not None and Path(cache).exists() and not refresh:
        machine, then, lacking = _read(cache)
        assert dispatch_s is not None
        if lacking:
            print(f"{cache}: written by an earlier version (without {', '.join(lacking)}): measuring this machine's "
                  f"costs again", file=sys.stderr)  # fmt: skip
        elif not stale(then, dispatch_s):
            return machine
        else:
            known = f"{then * 1e6:.2f} us" if isinstance(then, (int, float)) else "an unknown speed"
            print(f"{cache}: measured at {known} per torch call, this machine now takes {dispatch_s * 1e6:.2f} us: "
                  f"measuring its costs again", file=sys.stderr)  # fmt: skip
    machine = measure_machine()
    if cache is not None:
        save(machine, cache, dispatch_s)
    return machine


if __name__ == "__main__":  # python -m tandem.planner.measure [PATH]: print this machine's costs (and save them)
    found = measure_machine()
    print(json.dumps(dataclasses.asdict(found)))
    print(found.describe())
    if len(sys.argv) > 1:
        print(f"saved to {save(found, sys.argv[1], dispatch_seconds())}")
