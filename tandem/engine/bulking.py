"""Imperative bulking: consecutive pushes of one thread grouped into one engine op.

Every engine op costs a few microseconds of scheduling; bulking pays it once per group. Inside
``with engine.bulk(n):`` pushes are collected and handed to the engine as one op named
"ImperativeBulk[k ops]" when n are collected, when this thread waits, or when the block ends. The
group reads the union of the reads and writes the union of the writes (a var in both is a write),
and runs the collected functions in push order on one worker, so their own order is kept.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import TYPE_CHECKING

from tandem.engine.op import check_push, normalize_access
from tandem.engine.var import Var

if TYPE_CHECKING:
    from tandem.engine.base import Engine


class _Local(threading.local):
    collector: BulkCollector | None = None


local = _Local()


def _run_group(functions: list[Callable[[], None]], names: list[str], label: str) -> None:
    for index, function in enumerate(functions):
        try:
            function()
        except BaseException as exc:
            exc.add_note(f"raised by op {names[index]!r} ({index + 1} of {len(functions)}) inside {label}")
            raise


class BulkCollector:
    """The pending group of one thread. Not thread-safe: it lives in a thread-local."""

    __slots__ = ("size", "engine", "pool", "functions", "names", "reads", "writes", "priority", "segment")

    def __init__(self, size: int) -> None:
        self.size = size
        self.engine: Engine | None = None
        self.pool = "compute"
        self._reset()

    def _reset(self) -> None:
        self.functions: list[Callable[[], None]] = []
        self.names: list[str] = []
        self.reads: dict[Var, None] = {}
        self.writes: dict[Var, None] = {}
        self.priority = 0
        self.segment: int | None = None

    def add(
        self,
        engine: Engine,
        fn: Callable[[], None],
        reads: Iterable[Var],
        writes: Iterable[Var],
        priority: int,
        name: str,
        pool: str,
        segment: int | None,
    ) -> None:
        check_push(fn, pool, priority)
        reads, writes = normalize_access(reads, writes)  # validate now, where the caller can see it
        if self.functions and (engine is not self.engine or pool != self.pool):
            self.flush()  # one group runs on one engine and one pool
        if not self.functions:
            self.engine, self.pool, self.priority, self.segment = engine, pool, priority, segment
        self.functions.append(fn)
        self.names.append(name)
        self.reads.update(dict.fromkeys(reads))
        self.writes.update(dict.fromkeys(writes))
        self.priority = max(self.priority, priority)
        if len(self.functions) >= self.size:
            self.flush()

    def flush(self) -> None:
        """Push the collected group as one op (no-op when empty)."""
        if not self.functions or self.engine is None:
            return
        label = f"ImperativeBulk[{len(self.functions)} ops]"
        writes = tuple(self.writes)
        reads = tuple(var for var in self.reads if var not in self.writes)
        group = partial(_run_group, self.functions, self.names, label)
        engine, pool, priority, segment = self.engine, self.pool, self.priority, self.segment
        self._reset()
        saved, local.collector = local.collector, None  # the group itself must reach the engine
        try:
            engine.push(group, reads, writes, priority, label, pool, segment)
        finally:
            local.collector = saved


@contextmanager
def bulk(size: int) -> Iterator[None]:
    """Group this thread's next pushes into engine ops of up to ``size`` ops each.

    Nested blocks flush the outer group first and restore it afterwards. Only the calling thread is
    affected; ops pushed by other threads (or by running ops) are not grouped.
    """
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"engine.bulk(size) needs an int >= 1, got {size!r}")
    outer = local.collector
    if outer is not None:
        outer.flush()
    collector = BulkCollector(size)
    local.collector = collector
    try:
        yield
    finally:
        local.collector = outer
        collector.flush()
