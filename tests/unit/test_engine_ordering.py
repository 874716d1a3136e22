"""Property test: random programs on the threaded (and naive) engine match a sequential reference.

Each op reads the values of the vars it touches and writes new values derived from its index and
what it read, so any reordering of conflicting ops changes what some op observes. A guard counts
active readers and writers per var and records every violation of "concurrent reads, exclusive writes".
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from tandem import engine

NUM_VARS = 4


@dataclass(frozen=True)
class OpSpec:
    reads: frozenset[int]
    writes: frozenset[int]
    priority: int
    pool: str
    fails: bool = False


op_specs = st.builds(
    OpSpec,
    reads=st.frozensets(st.integers(0, NUM_VARS - 1), max_size=3),
    writes=st.frozensets(st.integers(0, NUM_VARS - 1), max_size=2),
    priority=st.integers(-2, 2),
    pool=st.sampled_from(["compute", "compute", "io"]),
    fails=st.sampled_from([False] * 9 + [True]),
)
programs = st.lists(op_specs, min_size=1, max_size=40)
SKIPPED = ("skipped",)


class Boom(Exception):
    pass


def reference(program: list[OpSpec]) -> tuple[list[tuple[int, ...]], list[int]]:
    """What each op observes and the final values when ops run one by one in push order.

    An op touching a var written by a failed (or skipped) op is skipped; a failing op writes nothing.
    """
    values = [0] * NUM_VARS
    poisoned: set[int] = set()
    observed: list[tuple[int, ...]] = []
    for index, spec in enumerate(program):
        if (spec.reads | spec.writes) & poisoned:
            observed.append(SKIPPED)
            poisoned |= spec.writes
            continue
        seen = tuple(values[v] for v in sorted(spec.reads | spec.writes))
        observed.append(seen)
        if spec.fails:
            poisoned |= spec.writes
            continue
        for v in spec.writes:
            values[v] = hash((index, seen, v)) & 0xFFFFFF
    return observed, values


class Guard:
    """Counts active accesses per var; records any overlap a correct engine forbids."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.readers = [0] * NUM_VARS
        self.writers = [0] * NUM_VARS
        self.violations: list[str] = []

    def enter(self, index: int, spec: OpSpec) -> None:
        with self.lock:
            for v in spec.writes:
                if self.readers[v] or self.writers[v]:
                    self.violations.append(f"op {index} writes var {v} while it is in use")
                self.writers[v] += 1
            for v in spec.reads - spec.writes:
                if self.writers[v]:
                    self.violations.append(f"op {index} reads var {v} during a write")
                self.readers[v] += 1

    def leave(self, spec: OpSpec) -> None:
        with self.lock:
            for v in spec.writes:
                self.writers[v] -= 1
            for v in spec.reads - spec.writes:
                self.readers[v] -= 1


def run_program(eng: engine.Engine, program: list[OpSpec]) -> tuple[list[tuple[int, ...]], list[int], Guard]:
    values = [0] * NUM_VARS
    observed: list[tuple[int, ...]] = [SKIPPED] * len(program)
    guard = Guard()
    variables = [eng.new_var(f"v{i}") for i in range(NUM_VARS)]

    def make(index: int, spec: OpSpec) -> Callable[[], None]:
        def op() -> None:
            guard.enter(index, spec)
            seen = tuple(values[v] for v in sorted(spec.reads | spec.writes))
            observed[index] = seen
            threading.Event().wait(0.0002 if index % 3 == 0 else 0)  # widen the race window
            if not spec.fails:
                for v in spec.writes:
                    values[v] = hash((index, seen, v)) & 0xFFFFFF
            guard.leave(spec)
            if spec.fails:
                raise Boom(f"op{index} fails on purpose")

        return op

    for index, spec in enumerate(program):
        eng.push(
            make(index, spec),
            reads=[variables[v] for v in spec.reads],
            writes=[variables[v] for v in spec.writes],
            priority=spec.priority,
            name=f"op{index}",
            pool=spec.pool,
        )
    try:
        eng.wait_all(timeout=20)
        assert not any(spec.fails for spec in program), "a failure went unreported"
    except engine.EngineError as error:
        assert isinstance(error.__cause__, Boom) and any(spec.fails for spec in program)
    for v, var in enumerate(variables):
        assert var.version == sum(v in spec.writes for spec in program)
    return observed, values, guard


@settings(max_examples=60, deadline=None)
@given(program=programs)
def test_threaded_engine_matches_sequential_reference(program: list[OpSpec]) -> None:
    eng = engine.ThreadedEngine(compute_threads=3, io_threads=2)
    try:
        observed, values, guard = run_program(eng, program)
    finally:
        eng.shutdown(timeout=20)
    expected_observed, expected_values = reference(program)
    assert guard.violations == []
    assert observed == expected_observed
    assert values == expected_values


@settings(max_examples=25, deadline=None)
@given(program=programs)
def test_naive_and_threaded_engines_agree(program: list[OpSpec]) -> None:
    threaded = engine.ThreadedEngine(compute_threads=2)
    try:
        threaded_result = run_program(threaded, program)
    finally:
        threaded.shutdown(timeout=20)
    naive_result = run_program(engine.NaiveEngine(), program)
    assert threaded_result[:2] == naive_result[:2]
    assert naive_result[2].violations == []


def test_pushes_from_several_threads_keep_each_threads_order() -> None:
    eng = engine.ThreadedEngine(compute_threads=2, io_threads=2)
    shared = eng.new_var("shared")
    logs: list[list[int]] = [[] for _ in range(4)]

    def pusher(thread_index: int) -> None:
        own = eng.new_var(f"own{thread_index}")
        for step in range(300):
            eng.push(
                lambda step=step: logs[thread_index].append(step),
                reads=[shared],
                writes=[own],
                pool="io" if step % 4 == 0 else "compute",
            )

    threads = [threading.Thread(target=pusher, args=(index,)) for index in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=20)
    eng.wait_all(timeout=20)
    assert logs == [list(range(300))] * 4
    eng.shutdown(timeout=20)


def test_waiting_on_one_var_sees_all_its_earlier_writes() -> None:
    eng = engine.ThreadedEngine(compute_threads=2)
    x = eng.new_var("x")
    log: list[int] = []
    for i in range(200):
        eng.push(lambda i=i: log.append(i), writes=[x], priority=i % 5)
    eng.wait(x, timeout=20)
    assert log == list(range(200))
    assert x.version == 200
    eng.shutdown(timeout=20)
