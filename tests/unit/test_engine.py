"""Semantics of the threaded and naive engines: failures, timeouts, priorities, nesting, bad input."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from tandem import engine
from tandem.engine import EngineError, EngineTimeout


@pytest.fixture(params=["threaded", "naive"])
def eng(request: pytest.FixtureRequest) -> Iterator[engine.Engine]:
    instance = (
        engine.ThreadedEngine(compute_threads=1) if request.param == "threaded" else engine.NaiveEngine()
    )
    yield instance
    instance.shutdown(timeout=10)


@pytest.fixture
def threaded() -> Iterator[engine.ThreadedEngine]:
    instance = engine.ThreadedEngine(compute_threads=1)
    yield instance
    instance.shutdown(timeout=10)


def explode() -> None:
    raise ValueError("boom in explode")


def test_failure_is_raised_at_wait_of_written_var_with_original_traceback(eng: engine.Engine) -> None:
    x = eng.new_var("x")
    eng.push(explode, writes=[x], name="A")
    with pytest.raises(EngineError) as info:
        eng.wait(x, timeout=10)
    message = str(info.value)
    assert "'A' failed" in message and "boom in explode" in message
    assert "in explode" in message and "Traceback" in message  # the original traceback text
    assert isinstance(info.value.__cause__, ValueError)
    assert info.value.op_name == "A"
    eng.wait(x, timeout=10)  # reported once: the var is clean again
    eng.wait_all(timeout=10)  # and wait_all does not report it a second time


def test_failure_is_raised_at_wait_all_then_cleared(eng: engine.Engine) -> None:
    x, y = eng.new_var("x"), eng.new_var("y")
    eng.push(explode, reads=[y], name="A")  # writes nothing: only wait_all can report it
    eng.push(explode, writes=[x], name="B")
    with pytest.raises(EngineError, match="'A' failed"):
        eng.wait_all(timeout=10)
    eng.wait_all(timeout=10)
    eng.wait(x, timeout=10)  # wait_all cleared every var


def test_dependents_of_a_failed_op_are_skipped_and_engine_keeps_working(eng: engine.Engine) -> None:
    x, y, z = eng.new_var("x"), eng.new_var("y"), eng.new_var("z")
    ran: list[str] = []
    eng.push(explode, writes=[x], name="A")
    eng.push(lambda: ran.append("B"), reads=[x], writes=[y], name="B")
    eng.push(lambda: ran.append("C"), reads=[y], name="C")
    eng.push(lambda: ran.append("D"), writes=[z], name="D")
    with pytest.raises(EngineError, match="'B' was skipped because 'A' failed") as info:
        eng.wait(y, timeout=10)
    assert "boom in explode" in str(info.value)
    with pytest.raises(EngineError, match="'A' failed"):
        eng.wait(x, timeout=10)
    eng.wait_all(timeout=10)  # A was already reported, through its dependent B and at x
    assert ran == ["D"]
    eng.push(lambda: ran.append("E"), reads=[x], writes=[y], name="E")
    eng.wait(y, timeout=10)
    assert ran == ["D", "E"]


def test_wait_times_out_naming_the_var_and_the_stuck_op(threaded: engine.ThreadedEngine) -> None:
    release = threading.Event()
    x = threaded.new_var("x")
    threaded.push(lambda: release.wait(10), writes=[x], name="blocker")
    threaded.push(lambda: None, writes=[x], name="behind")
    start = time.monotonic()
    with pytest.raises(EngineTimeout) as info:
        threaded.wait(x, timeout=0.2)
    assert time.monotonic() - start < 5  # returns soon after the timeout instead of hanging
    assert isinstance(info.value, TimeoutError) and isinstance(info.value, EngineError)
    message = str(info.value)
    assert "'x'" in message and "'blocker'" in message and "'behind'" in message
    with pytest.raises(EngineTimeout, match="wait_all timed out"):
        threaded.wait_all(timeout=0.05)
    release.set()
    threaded.wait(x, timeout=10)
    assert x.version == 2


def test_default_timeout_comes_from_the_knob(
    threaded: engine.ThreadedEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TANDEM_ENGINE_TIMEOUT", "0.1")
    release = threading.Event()
    threaded.push(lambda: release.wait(10), name="blocker")
    with pytest.raises(EngineTimeout):
        threaded.wait_all()
    release.set()


def test_priority_orders_runnable_ops_then_push_order(threaded: engine.ThreadedEngine) -> None:
    release = threading.Event()
    order: list[str] = []
    threaded.push(lambda: release.wait(10), name="blocker")
    time.sleep(0.05)  # let the single compute thread pick the blocker up
    for name, priority in [("a", 0), ("b", 5), ("c", -1), ("d", 5), ("e", 3)]:
        threaded.push(lambda name=name: order.append(name), priority=priority, name=name)
    release.set()
    threaded.wait_all(timeout=10)
    assert order == ["b", "d", "e", "a", "c"]


def test_reads_run_concurrently(monkeypatch: pytest.MonkeyPatch) -> None:
    both = threading.Barrier(2, timeout=10)  # only passes if the two reads overlap
    eng = engine.ThreadedEngine(compute_threads=2)
    x = eng.new_var("x")
    eng.push(both.wait, reads=[x])
    eng.push(both.wait, reads=[x])
    eng.wait_all(timeout=10)
    eng.shutdown()


def test_push_from_inside_an_op_with_one_thread(eng: engine.Engine) -> None:
    x = eng.new_var("x")
    order: list[str] = []

    def outer() -> None:
        eng.push(lambda: order.append("inner"), writes=[x], name="inner")
        order.append("outer")

    eng.push(outer, writes=[x], name="outer")
    eng.wait_all(timeout=10)
    assert order == ["outer", "inner"]
    assert x.version == 2


def test_io_pool_runs_while_compute_is_busy(threaded: engine.ThreadedEngine) -> None:
    release = threading.Event()
    threaded.push(lambda: release.wait(10), name="busy compute")
    threaded.push(release.set, pool="io", name="send")
    threaded.wait_all(timeout=10)


def test_var_in_reads_and_writes_counts_as_write(eng: engine.Engine) -> None:
    x = eng.new_var("x")
    eng.push(lambda: None, reads=[x, x], writes=[x, x])
    eng.wait(x, timeout=10)
    assert x.version == 1


def test_bad_input_gives_clear_errors(eng: engine.Engine) -> None:
    x = eng.new_var("x")
    with pytest.raises(TypeError, match="engine.Var"):
        eng.push(lambda: None, writes=["x"])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="sequence of engine.Var"):
        eng.push(lambda: None, writes="x")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="pool must be one of"):
        eng.push(lambda: None, writes=[x], pool="gpu")
    with pytest.raises(TypeError, match="callable"):
        eng.push(42, writes=[x])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="wait\\(var\\) takes an engine.Var"):
        eng.wait("x")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="timeout"):
        eng.wait(x, timeout=-1)
    eng.push(lambda: None, writes=x)  # a single var is accepted
    eng.wait(x, timeout=10)
    assert x.version == 1


def test_shut_down_engine_refuses_pushes() -> None:
    eng = engine.ThreadedEngine()
    eng.shutdown(timeout=10)
    with pytest.raises(RuntimeError, match="shut down"):
        eng.push(lambda: None)


def test_config_is_validated(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="compute_threads"):
        engine.ThreadedEngine(compute_threads=0)
    monkeypatch.setenv("TANDEM_ENGINE_IO_THREADS", "3")
    assert engine.ThreadedEngine().config.io_threads == 3


def test_get_engine_follows_the_knob(monkeypatch: pytest.MonkeyPatch) -> None:
    previous = engine.get_engine()
    try:
        monkeypatch.setenv("TANDEM_ENGINE", "naive")
        engine.set_engine(None)
        assert isinstance(engine.get_engine(), engine.NaiveEngine)
        assert engine.get_engine() is engine.get_engine()
        monkeypatch.setenv("TANDEM_ENGINE", "bogus")
        engine.set_engine(None)
        with pytest.raises(ValueError, match="TANDEM_ENGINE='bogus'"):
            engine.get_engine()
        with pytest.raises(TypeError):
            engine.set_engine("threaded")  # type: ignore[arg-type]
    finally:
        engine.set_engine(previous)


def test_var_basics() -> None:
    x = engine.Var("weights")
    assert x.name == "weights" and x.version == 0 and "weights" in repr(x)
    assert engine.Var().name == ""
    with pytest.raises(TypeError):
        engine.Var(3)  # type: ignore[arg-type]


def _push_in_child(queue: object) -> None:
    eng = engine.get_engine()
    x = eng.new_var("x")
    eng.push(lambda: None, writes=[x])
    eng.wait(x, timeout=10)
    queue.put(x.version)  # type: ignore[attr-defined]


def test_forked_child_gets_a_fresh_working_engine() -> None:
    import multiprocessing

    parent = engine.get_engine()
    parent.push(lambda: None)  # the parent's workers exist now; a child must not rely on them
    parent.wait_all(timeout=10)
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_push_in_child, args=(queue,))
    child.start()
    assert queue.get(timeout=30) == 1
    child.join(timeout=30)
    assert child.exitcode == 0
