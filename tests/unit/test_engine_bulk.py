"""engine.bulk(): grouping, and the three flush points (size reached, a wait, leaving the block)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tandem import engine
from tandem.engine import EngineError, trace


@pytest.fixture
def eng() -> Iterator[engine.ThreadedEngine]:
    instance = engine.ThreadedEngine(compute_threads=1)
    yield instance
    instance.shutdown(timeout=10)


def test_group_is_flushed_when_size_is_reached(eng: engine.ThreadedEngine) -> None:
    ran: list[int] = []
    third = threading.Event()
    x = eng.new_var("x")
    with engine.bulk(3):
        eng.push(lambda: ran.append(1), writes=[x])
        eng.push(lambda: ran.append(2), reads=[x])
        time.sleep(0.05)
        assert ran == []  # still collected on this thread: the engine has never seen them
        eng.push(lambda: (ran.append(3), third.set()), writes=[x])
        assert third.wait(10)  # the third push flushed the group
        assert ran == [1, 2, 3]
        eng.push(lambda: ran.append(4), writes=[x])
        time.sleep(0.05)
        assert ran == [1, 2, 3]
    eng.wait_all(timeout=10)
    assert ran == [1, 2, 3, 4]
    assert x.version == 2  # two groups, each one write of x


def test_group_is_flushed_by_a_wait(eng: engine.ThreadedEngine) -> None:
    ran: list[str] = []
    x, y = eng.new_var("x"), eng.new_var("y")
    with engine.bulk(100):
        eng.push(lambda: ran.append("a"), writes=[x])
        eng.push(lambda: ran.append("b"), reads=[x], writes=[y])
        eng.wait(y, timeout=10)
        assert ran == ["a", "b"]
        eng.push(lambda: ran.append("c"), writes=[x])
        eng.wait_all(timeout=10)
        assert ran == ["a", "b", "c"]


def test_group_is_flushed_when_the_block_ends_even_on_error(eng: engine.ThreadedEngine) -> None:
    done = threading.Event()
    with pytest.raises(KeyError), engine.bulk(10):
        eng.push(done.set)
        raise KeyError("user code failed")
    assert done.wait(10)


def test_groups_are_named_and_traced(eng: engine.ThreadedEngine, tmp_path: Path) -> None:
    trace.start(str(tmp_path / "bulk.json"))
    try:
        with engine.bulk(3):
            for _ in range(7):
                eng.push(lambda: None)
        eng.wait_all(timeout=10)
    finally:
        path = trace.stop()
    names = [
        event["name"] for event in json.loads(Path(path).read_text())["traceEvents"] if event["ph"] == "X"
    ]
    assert names == ["ImperativeBulk[3 ops]", "ImperativeBulk[3 ops]", "ImperativeBulk[1 ops]"]


def test_failure_inside_a_group_names_the_inner_op(eng: engine.ThreadedEngine) -> None:
    x = eng.new_var("x")
    ran: list[str] = []

    def bad() -> None:
        raise RuntimeError("inner failure")

    with engine.bulk(5):
        eng.push(lambda: ran.append("ok"), writes=[x], name="fine")
        eng.push(bad, writes=[x], name="bad")
        eng.push(lambda: ran.append("after"), writes=[x], name="after")
    with pytest.raises(EngineError) as info:
        eng.wait(x, timeout=10)
    assert "ImperativeBulk[3 ops]" in str(info.value) and "raised by op 'bad' (2 of 3)" in str(info.value)
    assert ran == ["ok"]


def test_nested_blocks_and_other_engines_split_groups(eng: engine.ThreadedEngine) -> None:
    naive = engine.NaiveEngine()
    ran: list[str] = []
    with engine.bulk(10):
        eng.push(lambda: ran.append("threaded"))
        naive.push(lambda: ran.append("naive"))  # another engine: the threaded group is flushed first
        with engine.bulk(2):
            naive.push(lambda: ran.append("inner1"))
            naive.push(lambda: ran.append("inner2"))
        assert ran[-2:] == ["inner1", "inner2"]
        naive.push(lambda: ran.append("outer again"))
    eng.wait_all(timeout=10)
    assert sorted(ran) == sorted(["threaded", "naive", "inner1", "inner2", "outer again"])
    assert ran.index("naive") < ran.index("inner1")


def test_bulk_rejects_bad_sizes_and_bad_pushes(eng: engine.ThreadedEngine) -> None:
    for size in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="bulk"):
            with engine.bulk(size):  # type: ignore[arg-type]
                pass
    with engine.bulk(4), pytest.raises(TypeError, match="engine.Var"):
        eng.push(lambda: None, writes=[object()])  # type: ignore[list-item]
