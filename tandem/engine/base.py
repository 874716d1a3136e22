"""The engine interface and the failure bookkeeping both engines share.

Failure rules (same for every engine): an op that raises leaves a :class:`Failure` on each var it
writes. Later ops touching such a var are skipped and pass the failure on to the vars they write, so
nothing runs on garbage. ``wait(var)`` reports (raises) and clears the failure of that var;
``wait_all()`` raises the first failure no wait has reported yet and clears every var, after which
the engine is clean.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Callable, Iterable, Mapping

from tandem.engine.bulking import local as _bulk_local
from tandem.engine.errors import EngineError, Failure
from tandem.engine.op import Op, Pool, admit
from tandem.engine.var import Var
from tandem.env import knob


def resolve_timeout(timeout: float | None) -> float:
    """Seconds a wait may block: the explicit value, else TANDEM_ENGINE_TIMEOUT."""
    value = knob("TANDEM_ENGINE_TIMEOUT") if timeout is None else timeout
    if not isinstance(value, (int, float)) or value < 0:
        raise ValueError(f"wait timeout must be a number of seconds >= 0, got {value!r}")
    return float(value)


def check_var(var: Var) -> None:
    if var.__class__ is not Var:
        raise TypeError(f"wait(var) takes an engine.Var, got {type(var).__name__}")


class Engine(abc.ABC):
    """Runs pushed ops as soon as their var dependencies allow.

    Every public method is thread-safe. ``push`` never blocks on other ops (an op may push more ops);
    ``wait``/``wait_all`` block the caller, flush the calling thread's ``bulk()`` first, and raise
    :class:`EngineTimeout` instead of hanging.
    """

    _pools: Mapping[str, Pool]  # pool name (op.POOLS) -> this engine's pool; set by each engine

    def __init__(self) -> None:
        self._failures: list[Failure] = []  # root failures in the order they happened
        self._failed_vars: set[Var] = set()

    def new_var(self, name: str = "") -> Var:
        """A fresh var (same as ``Var(name)``)."""
        return Var(name)

    def push(
        self,
        fn: Callable[[], None],
        reads: Iterable[Var] = (),
        writes: Iterable[Var] = (),
        priority: int = 0,
        name: str = "op",
        pool: str = "compute",
        segment: int | None = None,
    ) -> None:
        """Queue ``fn`` to run after every earlier op that conflicts with it on a var. Asynchronous.

        Inside ``bulk()`` the op joins the calling thread's group instead (one engine op per group).
        """
        collector = _bulk_local.collector
        if collector is not None:
            collector.add(self, fn, reads, writes, priority, name, pool, segment)
            return
        reads, writes = admit(fn, reads, writes, priority, pool)
        self._submit(Op(fn, reads, writes, priority, name, self._pools[pool], segment, 0))

    @abc.abstractmethod
    def _submit(self, op: Op) -> None:
        """Schedule a validated op (its ``seq`` is given here, under the engine's lock)."""

    @abc.abstractmethod
    def wait(self, var: Var, timeout: float | None = None) -> None:
        """Block until every op pushed so far that writes ``var`` has finished; raise its failure."""

    @abc.abstractmethod
    def wait_all(self, timeout: float | None = None) -> None:
        """Block until every pushed op has finished; raise the first unreported failure, then reset."""

    def shutdown(self, timeout: float | None = None) -> None:  # noqa: B027 - optional hook
        """Finish pending work and release threads; the engine must not be used afterwards."""

    # Failure bookkeeping; callers hold the engine's lock.

    def _store_failure(self, failure: Failure, writes: tuple[Var, ...]) -> None:
        if failure.root is None:
            self._failures.append(failure)
        for var in writes:
            var._failure = failure
            self._failed_vars.add(var)

    def _take_var_failure(self, var: Var) -> EngineError | None:
        failure = var._failure
        if failure is None:
            return None
        var._failure = None
        self._failed_vars.discard(var)
        failure.mark_reported()
        return failure.to_error()

    def _take_first_failure(self) -> EngineError | None:
        unreported = [failure for failure in self._failures if not failure.reported]
        self._failures.clear()
        for var in self._failed_vars:
            var._failure = None
        self._failed_vars.clear()
        if not unreported:
            return None
        unreported[0].mark_reported()
        return unreported[0].to_error()


def deadline_after(timeout: float | None) -> float:
    return time.monotonic() + resolve_timeout(timeout)
