"""The threaded dependency engine (after MXNet's ThreadedEngine).

Each var keeps a queue of the accesses not yet granted, in push order. A read is granted at once
unless a write is running or queued ahead of it; a write waits for every earlier access. An op
counts its ungranted accesses; at zero it enters its pool's ready heap, ordered by priority, then
push order. One lock guards all scheduling state: under the GIL a finer scheme would only add cost,
and the critical sections are a handful of attribute updates.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from tandem.engine.base import Engine, check_var, deadline_after
from tandem.engine.bulking import flush_bulk
from tandem.engine.errors import EngineTimeout, Failure
from tandem.engine.op import POOLS, Op, Pool, execute
from tandem.engine.var import Var
from tandem.env import knob


@dataclass(frozen=True)
class ThreadedEngineConfig:
    """Worker counts of the two pools (compute: torch already uses intra-op threads, so 1 by default)."""

    compute_threads: int
    io_threads: int

    def __post_init__(self) -> None:
        for field in ("compute_threads", "io_threads"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(
                    f"{field} (argument or TANDEM_ENGINE_{field.split('_')[0].upper()}_THREADS) must be an int >= 1, got {value!r}"
                )

    @classmethod
    def resolve(
        cls, compute_threads: int | None = None, io_threads: int | None = None
    ) -> ThreadedEngineConfig:
        """Explicit values win; None takes TANDEM_ENGINE_COMPUTE_THREADS / TANDEM_ENGINE_IO_THREADS."""
        return cls(
            compute_threads if compute_threads is not None else knob("TANDEM_ENGINE_COMPUTE_THREADS"),
            io_threads if io_threads is not None else knob("TANDEM_ENGINE_IO_THREADS"),
        )


class _WorkerPool(Pool):
    """Ready heap of (-priority, seq, op) plus the worker threads that drain it."""

    __slots__ = ("size", "heap", "wakeup", "idle", "threads", "running")

    def __init__(self, name: str, size: int, lock: threading.Lock) -> None:
        super().__init__(name)
        self.size = size
        self.heap: list[tuple[int, int, Op]] = []
        self.wakeup = threading.Condition(lock)
        self.idle = 0  # workers blocked in wakeup.wait() and not yet notified
        self.threads: list[threading.Thread] = []
        self.running: list[Op | None] = [None] * size  # what each worker runs now, for timeout messages


class ThreadedEngine(Engine):
    """Runs ops on a compute pool and an io pool of daemon threads (started on first use)."""

    _pools: dict[str, _WorkerPool]

    def __init__(self, compute_threads: int | None = None, io_threads: int | None = None) -> None:
        super().__init__()
        self.config = ThreadedEngineConfig.resolve(compute_threads, io_threads)
        self._lock = threading.Lock()
        # Waiters are woken only when what they wait for is done: a wake-up per completion would make
        # the waiting thread fight the workers for the GIL (torch ops release it) and triple op costs.
        self._done = threading.Condition(self._lock)
        self._all_waiters = 0  # threads in wait_all()
        self._var_targets: dict[Var, list[int]] = {}  # var -> the version each wait(var) needs
        self._outstanding = 0  # pushed ops not finished yet
        self._stopping = False
        self._next_seq = itertools.count().__next__
        sizes = {"compute": self.config.compute_threads, "io": self.config.io_threads}
        self._pools = {name: _WorkerPool(name, sizes[name], self._lock) for name in POOLS}

    def _submit(self, op: Op) -> None:
        """Queue the op; returns at once. Thread-safe, callable from inside a running op."""
        reads, writes = op.reads, op.writes
        with self._lock:
            if self._stopping:
                raise RuntimeError("push() on an engine that was shut down; create a new engine")
            op.seq = self._next_seq()
            pending = 0
            for var in reads:
                if var._writing or var._queue:
                    var._queue.append((op, False))
                    pending += 1
                else:
                    var._readers += 1
                    if var._failure is not None and op.skip is None:
                        op.skip = var._failure
            for var in writes:
                var._writes_pushed += 1
                if var._writing or var._readers or var._queue:
                    var._queue.append((op, True))
                    pending += 1
                else:
                    var._writing = True
                    if var._failure is not None and op.skip is None:
                        op.skip = var._failure
            op.pending = pending
            self._outstanding += 1
            if not pending:
                self._ready(op)

    # Scheduling internals; all run under self._lock.

    def _ready(self, op: Op) -> None:
        worker_pool: _WorkerPool = op.pool  # type: ignore[assignment]
        heapq.heappush(worker_pool.heap, (-op.priority, op.seq, op))
        if worker_pool.idle:
            worker_pool.idle -= 1  # counted here so a burst of pushes sends one wake-up per idle worker
            worker_pool.wakeup.notify()
        elif not worker_pool.threads:
            self._start_workers(worker_pool)

    def _grant(self, op: Op, var: Var) -> None:
        if var._failure is not None and op.skip is None:
            op.skip = var._failure
        op.pending -= 1
        if not op.pending:
            self._ready(op)

    def _grant_queued(self, var: Var) -> None:
        """Grant the reads at the head of the var's queue, or its head write once nothing else runs."""
        queue = var._queue
        while queue:
            op, is_write = queue[0]
            if is_write:
                if not var._readers:
                    queue.popleft()
                    var._writing = True
                    self._grant(op, var)
                return
            queue.popleft()
            var._readers += 1
            self._grant(op, var)

    def _complete(self, op: Op, failure: Failure | None) -> None:
        for var in op.reads:
            var._readers -= 1
            if not var._readers and var._queue:
                self._grant_queued(var)
        if failure is not None:
            self._store_failure(failure, op.writes)
        for var in op.writes:
            var._writing = False
            var.version += 1
            if var._queue:
                self._grant_queued(var)
            if self._var_targets:
                targets = self._var_targets.get(var)
                if targets and var.version >= min(targets):
                    self._done.notify_all()
        self._outstanding -= 1
        if not self._outstanding and self._all_waiters:
            self._done.notify_all()

    def _start_workers(self, worker_pool: _WorkerPool) -> None:
        for slot in range(worker_pool.size):
            thread = threading.Thread(
                target=self._work,
                args=(worker_pool, slot),
                name=f"tandem-{worker_pool.name}-{slot}",
                daemon=True,
            )
            worker_pool.threads.append(thread)
            thread.start()

    def _work(self, worker_pool: _WorkerPool, slot: int) -> None:
        """Worker loop: pop the best ready op, run it unlocked, complete it, repeat."""
        lock, heap, running = self._lock, worker_pool.heap, worker_pool.running
        heappop, complete, wakeup = heapq.heappop, self._complete, worker_pool.wakeup
        thread = threading.current_thread().name
        with lock:
            while True:
                while not heap:
                    if self._stopping:
                        return
                    worker_pool.idle += 1
                    wakeup.wait()
                op = heappop(heap)[2]
                running[slot] = op
                lock.release()
                try:
                    failure = execute(op, thread)
                finally:
                    lock.acquire()
                running[slot] = None
                complete(op, failure)

    # Waiting.

    def _block(self, deadline: float, describe: Callable[[], str]) -> None:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise EngineTimeout(describe())
        self._done.wait(remaining)

    def _describe_pending(self) -> str:
        running = [
            f"{op.name!r} on {worker_pool.name}-{slot}"
            for worker_pool in self._pools.values()
            for slot, op in enumerate(worker_pool.running)
            if op is not None
        ]
        ready = ", ".join(f"{name}: {len(worker_pool.heap)}" for name, worker_pool in self._pools.items())
        return (
            f"{self._outstanding} op(s) unfinished; running now: {', '.join(running) or 'nothing'}; "
            f"ready and waiting for a worker: {ready}. If the work is just slow, pass a larger timeout= "
            "or raise TANDEM_ENGINE_TIMEOUT; otherwise an op is stuck (e.g. it waits on the engine itself)"
        )

    def wait(self, var: Var, timeout: float | None = None) -> None:
        """Block until all writes of ``var`` pushed so far finished. Thread-safe; do not call it from an
        op that one of those writes waits behind (it would time out)."""
        check_var(var)
        flush_bulk()
        deadline = deadline_after(timeout)

        def describe() -> str:
            queued = [f"{op.name!r} ({'write' if is_write else 'read'})" for op, is_write in var._queue]
            return (
                f"wait on var {var.label} timed out after {timeout if timeout is not None else knob('TANDEM_ENGINE_TIMEOUT')} s: "
                f"{var._writes_pushed - var.version} write(s) of it unfinished, queued on it: "
                f"{', '.join(queued) or 'none'}; engine: {self._describe_pending()}"
            )

        with self._lock:
            target = var._writes_pushed
            if var.version < target:
                targets = self._var_targets.setdefault(var, [])
                targets.append(target)
                try:
                    while var.version < target:
                        self._block(deadline, describe)
                finally:
                    targets.remove(target)
                    if not targets:
                        del self._var_targets[var]
            error = self._take_var_failure(var)
        if error is not None:
            raise error

    def wait_all(self, timeout: float | None = None) -> None:
        """Block until every pushed op finished; raise the first unreported failure. Thread-safe."""
        flush_bulk()
        deadline = deadline_after(timeout)

        def describe() -> str:
            limit = timeout if timeout is not None else knob("TANDEM_ENGINE_TIMEOUT")
            return f"wait_all timed out after {limit} s: {self._describe_pending()}"

        with self._lock:
            self._all_waiters += 1
            try:
                while self._outstanding:
                    self._block(deadline, describe)
            finally:
                self._all_waiters -= 1
            error = self._take_first_failure()
        if error is not None:
            raise error

    def shutdown(self, timeout: float | None = None) -> None:
        """Finish every pushed op, then stop the workers. Later pushes raise."""
        try:
            self.wait_all(timeout)
        finally:
            with self._lock:
                self._stopping = True
                for worker_pool in self._pools.values():
                    worker_pool.idle = 0
                    worker_pool.wakeup.notify_all()

    def __repr__(self) -> str:
        return f"ThreadedEngine(compute_threads={self.config.compute_threads}, io_threads={self.config.io_threads})"
