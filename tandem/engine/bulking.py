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
from itertools import chain
from typing import Protocol

from tandem.engine.op import admit
from tandem.engine.var import Var


class Engine(Protocol):
    """What a group is handed to: ``engine.Engine`` (whose ``push`` collects into this module's groups)."""

    def push(self, fn: Callable[[], None], reads: Iterable[Var], writes: Iterable[Var], priority: int, name: str,
             pool: str, segment: int | None) -> None: ...  # fmt: skip


class _Local(threading.local):
    collector: BulkCollector | None = None


local = _Local()


def flush_bulk() -> None:
    """Waits flush the calling thread's bulk: its ops must be in the engine before anyone waits on them."""
    collector = local.collector
    if collector is not None:
        collector.flush()


_Item = tuple[Callable[[], None], str, tuple[Var, ...], tuple[Var, ...]]  # fn, name, reads, writes


def _run_group(items: list[_Item], label: str) -> None:
    for index, (function, name, _, _) in enumerate(items):
        try:
            function()
        except BaseException as exc:
            exc.add_note(f"raised by op {name!r} ({index + 1} of {len(items)}) inside {label}")
            raise


class BulkCollector:
    """The pending group of one thread. Not thread-safe: it lives in a thread-local.

    add() appends one tuple (the var unions are built once, at flush) so that a bulked push costs a
    fraction of an engine op.
    """

    __slots__ = ("size", "engine", "pool", "items", "priority", "segment")

    def __init__(self, size: int) -> None:
        self.size = size
        self.engine: Engine | None = None
        self.pool = "compute"
        self.items: list[_Item] = []
        self.priority: int | None = None  # the highest priority in the group
        self.segment: int | None = None  # the first segment named in the group

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
        reads, writes = admit(fn, reads, writes, priority, pool)  # now, where the caller can see a mistake
        if engine is not self.engine or pool != self.pool:
            if self.items:
                self.flush()  # one group runs on one engine and one pool
            self.engine, self.pool = engine, pool
        if self.priority is None or priority > self.priority:
            self.priority = priority
        if self.segment is None:
            self.segment = segment
        items = self.items
        items.append((fn, name, reads, writes))
        if len(items) >= self.size:
            self.flush()

    def flush(self) -> None:
        """Push the collected group as one op (no-op when empty)."""
        items, engine = self.items, self.engine
        if not items or engine is None:
            return
        priority, segment = self.priority or 0, self.segment
        self.items, self.priority, self.segment = [], None, None
        write_set = dict.fromkeys(chain.from_iterable([item[3] for item in items]))
        read_set = dict.fromkeys(chain.from_iterable([item[2] for item in items]))
        label = f"ImperativeBulk[{len(items)} ops]"
        reads_only = tuple(var for var in read_set if var not in write_set)
        saved, local.collector = local.collector, None  # the group itself must reach the engine
        try:
            engine.push(
                partial(_run_group, items, label),
                reads_only,
                tuple(write_set),
                priority,
                label,
                self.pool,
                segment,
            )
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
