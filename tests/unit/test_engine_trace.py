"""The Chrome/Perfetto trace: valid JSON with complete events, thread names and op metadata."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tandem import engine, trace


def load(path: str) -> list[dict]:
    document = json.loads(Path(path).read_text())
    assert set(document) >= {"traceEvents"}
    return document["traceEvents"]


def test_engine_ops_and_custom_events_are_recorded(tmp_path: Path) -> None:
    if trace.enabled():
        pytest.skip("TANDEM_TRACE is set for this test run")
    eng = engine.ThreadedEngine(compute_threads=1, io_threads=1)
    x = eng.new_var("x")
    trace.start(str(tmp_path / "sub" / "trace.json"))
    assert trace.enabled()
    eng.push(lambda: None, writes=[x], name="fill", priority=2, segment=7)
    eng.push(lambda: None, reads=[x], name="send", pool="io")
    eng.wait_all(timeout=10)
    start = trace.now_us()
    trace.record("push key 3", start, start + 5.0, category="kvstore", args={"bytes": 40}, thread="kv-sender")
    path = trace.stop()
    assert not trace.enabled()
    events = load(path)
    complete = {event["name"]: event for event in events if event["ph"] == "X"}
    assert set(complete) == {"fill", "send", "push key 3"}
    fill = complete["fill"]
    assert fill["pid"] == os.getpid() and fill["dur"] >= 0 and fill["ts"] > 0
    assert fill["args"] == {"pool": "compute", "priority": 2, "segment": 7, "seq": 0}
    assert complete["send"]["args"]["pool"] == "io"
    assert complete["push key 3"]["cat"] == "kvstore" and complete["push key 3"]["args"] == {"bytes": 40}
    thread_names = {event["tid"]: event["args"]["name"] for event in events if event["name"] == "thread_name"}
    assert thread_names[fill["tid"]] == "tandem-compute-0"
    assert thread_names[complete["send"]["tid"]] == "tandem-io-0"
    assert thread_names[complete["push key 3"]["tid"]] == "kv-sender"
    eng.shutdown(timeout=10)


def test_record_is_a_no_op_when_off_and_stop_needs_start() -> None:
    if trace.enabled():
        pytest.skip("TANDEM_TRACE is set for this test run")
    trace.record("ignored", 0.0, 1.0)
    with pytest.raises(RuntimeError, match="trace.start"):
        trace.stop()
    with pytest.raises(ValueError, match="path"):
        trace.start("")


def test_tandem_trace_env_writes_the_file_at_exit(tmp_path: Path) -> None:
    target = tmp_path / "exit-{pid}.json"
    program = (
        "from tandem import engine\n"
        "e = engine.get_engine()\n"
        "x = e.new_var('x')\n"
        "e.push(lambda: None, writes=[x], name='at-exit-op')\n"
        "e.wait_all()\n"
    )
    env = {**os.environ, "TANDEM_TRACE": str(target)}
    result = subprocess.run(
        [sys.executable, "-c", program],
        env=env,
        cwd=Path(__file__).resolve().parents[2],
        timeout=60,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    written = list(tmp_path.glob("exit-*.json"))
    assert len(written) == 1 and "{pid}" not in written[0].name
    assert [event["name"] for event in load(str(written[0])) if event["ph"] == "X"] == ["at-exit-op"]


def test_a_traced_step_is_summarized_by_kind_and_per_step(tmp_path: Path) -> None:
    # bench/trace_summary.py reads what a real captured step writes: every forward and backward
    # segment grouped by kind, steps counted between the starts of the named event
    if trace.enabled():
        pytest.skip("TANDEM_TRACE is set for this test run")
    import tandem
    from bench.trace_summary import kind, summarize
    from tests.conftest import zoo_case

    module, loss_fn, batch = zoo_case("mlp")
    step, evaluate = tandem.compile(module, loss_fn, *batch), tandem.compile_eval(module, loss_fn, *batch)
    step(*batch)
    evaluate(*batch)
    trace.start(str(tmp_path / "trace.json"))
    for number in range(4):
        step(*batch)
        if number == 1:
            evaluate(*batch)  # its segment is eval[0]: not a training step's forward
    text = summarize(Path(trace.stop()), "forward[0]", skip=1)
    assert kind("forward[0]") == "forward" and kind("issue stem.0.weight[0] + 20 fused") == "issue"
    rows = {row.split("|")[2].strip(): int(row.split("|")[3]) for row in text.splitlines() if row.startswith("| tandem")}
    assert rows["forward"] == 2 and rows["eval"] == 1 and rows["backward"] >= 2, text
    assert "2 steps (from one forward[0] to the next)" in text
    with pytest.raises(SystemExit, match="fewer than 2 'nothing' events"):
        summarize(tmp_path / "trace.json", "nothing", skip=0)
