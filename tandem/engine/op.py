"""One pushed unit of work, the normalisation of its var lists, and running it.

Shared by the threaded and the naive engine so both skip, fail and trace ops identically.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Iterable

from tandem import trace
from tandem.engine.errors import Failure
from tandem.engine.var import Var

POOLS = ("compute", "io")
_trace_state = trace.state


class Pool:
    """A named pool of workers; the threaded engine's pools add a ready queue and threads."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name


class Op:
    """A pushed op. ``pending`` counts the var accesses not yet granted; at zero the op is runnable.

    ``skip`` holds the failure of an earlier writer of one of its vars: the op then does not run.
    """

    __slots__ = ("fn", "reads", "writes", "priority", "name", "pool", "segment", "pending", "skip", "seq")

    def __init__(
        self,
        fn: Callable[[], None],
        reads: tuple[Var, ...],
        writes: tuple[Var, ...],
        priority: int,
        name: str,
        pool: Pool,
        segment: int | None,
        seq: int,
    ) -> None:
        self.fn = fn
        self.reads = reads
        self.writes = writes
        self.priority = priority
        self.name = name
        self.pool = pool
        self.segment = segment
        self.pending = 0
        self.skip: Failure | None = None
        self.seq = seq

    def __repr__(self) -> str:
        return f"Op({self.name!r}, seq={self.seq})"


def _as_vars(value: Iterable[Var] | Var, role: str) -> tuple[Var, ...]:
    if isinstance(value, Var):
        return (value,)
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise TypeError(f"push({role}=...) takes a sequence of engine.Var, got {type(value).__name__}")
    items = tuple(value)
    for item in items:
        if item.__class__ is not Var:
            raise TypeError(
                f"push({role}=...) takes engine.Var objects, got a {type(item).__name__}; "
                "create one var per piece of state with engine.Var(name) or engine.new_var(name)"
            )
    return items


def normalize_access(
    reads: Iterable[Var] | Var, writes: Iterable[Var] | Var
) -> tuple[tuple[Var, ...], tuple[Var, ...]]:
    """Validated, de-duplicated var tuples; a var named as both read and write counts as a write only."""
    writes = _as_vars(writes, "writes")
    reads = _as_vars(reads, "reads")
    if len(writes) > 1:
        writes = tuple(dict.fromkeys(writes))
    if reads:
        if len(reads) > 1:
            reads = tuple(dict.fromkeys(reads))
        if writes:
            reads = tuple(var for var in reads if var not in writes)
    return reads, writes


def admit(
    fn: Callable[[], None], reads: Iterable[Var], writes: Iterable[Var], priority: int, pool: str
) -> tuple[tuple[Var, ...], tuple[Var, ...]]:
    """push()'s checks, one place for both engines and the bulk collector: the validated var tuples.

    Fast path: no reads (an empty tuple or list) and a tuple of exactly one var written skip
    normalisation, and the slow checks run only when something looks off.
    """
    if (reads or reads.__class__ not in _EMPTY_READS or writes.__class__ is not tuple or len(writes) != 1  # type: ignore[attr-defined]
            or writes[0].__class__ is not Var):  # type: ignore[index]  # fmt: skip
        reads, writes = normalize_access(reads, writes)
    else:
        reads = ()
    if priority.__class__ is not int or pool not in POOLS or not callable(fn):
        check_push(fn, pool, priority)
    return reads, writes  # type: ignore[return-value]


_EMPTY_READS = (tuple, list)


def check_push(fn: Callable[[], None], pool: str, priority: int) -> None:
    """The slow checks of push(), run only when something looks off (keeps the fast path short)."""
    if not callable(fn):
        raise TypeError(f"push(fn=...) needs a callable taking no arguments, got {type(fn).__name__}")
    if pool not in POOLS:
        raise ValueError(f"push(pool={pool!r}): pool must be one of {POOLS} ('io' is for communication)")
    if not isinstance(priority, int):
        raise TypeError(f"push(priority=...) must be an int, got {type(priority).__name__}")


def execute(op: Op, thread: str) -> Failure | None:
    """Run ``op.fn`` (unless a var it touches is poisoned); the failure it leaves, if any."""
    if op.skip is not None:
        return op.skip.skipped(op.name)
    tracing = _trace_state.on
    if tracing:
        start = trace.now_us()
    try:
        op.fn()
        failure = None
    except BaseException as exc:  # an op's failure must never kill the worker thread
        failure = Failure(op.name, exc, traceback.format_exc())
    if tracing:
        args = {"pool": op.pool.name, "priority": op.priority, "segment": op.segment, "seq": op.seq}
        if failure is not None:
            args["failed"] = True
        trace.record(op.name, start, trace.now_us(), "op", args, thread)
    return failure
