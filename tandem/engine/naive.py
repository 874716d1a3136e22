"""The naive engine: every op runs synchronously inside push(), on the pushing thread.

For debugging: a failing op's traceback points straight at the push, and no thread interleaving can
hide an ordering bug. Failure, skip and trace rules are those of the threaded engine. An op pushed
from inside a running op is queued and runs right after it, as a write would on the threaded engine.
"""

from __future__ import annotations

import threading
from collections import deque

from tandem.engine.base import Engine, check_var, resolve_timeout
from tandem.engine.bulking import flush_bulk
from tandem.engine.op import POOLS, Op, Pool, execute
from tandem.engine.var import Var


class NaiveEngine(Engine):
    """Synchronous engine. Thread-safe: pushes from several threads run one at a time."""

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.RLock()  # re-entrant: an op may push
        self._queue: deque[Op] = deque()
        self._draining = False
        self._seq = 0
        self._pools = {name: Pool(name) for name in POOLS}

    def _submit(self, op: Op) -> None:
        """Run the op now (after the op that pushed it, when called from inside an op)."""
        with self._lock:
            self._seq += 1
            op.seq = self._seq
            for var in op.writes:
                var._writes_pushed += 1
            self._queue.append(op)
            if self._draining:
                return
            self._draining = True
            try:
                while self._queue:
                    self._run(self._queue.popleft())
            finally:
                self._draining = False

    def _run(self, op: Op) -> None:
        for var in op.reads + op.writes:
            if var._failure is not None:
                op.skip = var._failure
                break
        failure = execute(op, threading.current_thread().name)
        if failure is not None:
            self._store_failure(failure, op.writes)
        for var in op.writes:
            var.version += 1

    def wait(self, var: Var, timeout: float | None = None) -> None:
        """Nothing to wait for (ops already ran); raises the var's unreported failure."""
        check_var(var)
        resolve_timeout(timeout)
        flush_bulk()
        with self._lock:
            error = self._take_var_failure(var)
        if error is not None:
            raise error

    def wait_all(self, timeout: float | None = None) -> None:
        """Raises the first unreported failure, then clears every failure."""
        resolve_timeout(timeout)
        flush_bulk()
        with self._lock:
            error = self._take_first_failure()
        if error is not None:
            raise error

    def __repr__(self) -> str:
        return "NaiveEngine()"
