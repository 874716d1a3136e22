"""The P3 timeline: the next forward starts before the last pull of the previous step is back.

(Slices leaving in priority order is tested in test_p3_dist.py.)
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.distributed.jobs import run_job


def _worker_events(tmp_path: Path) -> list[dict]:
    for path in tmp_path.glob("trace-*.json"):
        events = json.loads(path.read_text())["traceEvents"]
        if any(e.get("name", "").startswith("forward[") for e in events):
            return [e for e in events if e.get("ph") == "X"]
    raise AssertionError(f"no worker trace among {list(tmp_path.iterdir())}")


def test_forward_starts_before_the_last_pull_completes(tmp_path: Path) -> None:
    env = {"TANDEM_TRACE": str(tmp_path / "trace-{pid}.json"), "TANDEM_KVSTORE_SLICE_THRESHOLD": "20000"}
    run_job("p3_timeline.py", 1, 2, "6", env=env)
    events = sorted(_worker_events(tmp_path), key=lambda e: e["ts"])
    first_forwards = [e for e in events if e["name"] == "forward[0]"]
    receives = [e for e in events if e["name"].startswith("receive ")]
    assert len(first_forwards) >= 4 and receives
    backwards = [e for e in events if e["name"].startswith("backward[")]
    overlapped = 0
    for previous, current in zip(first_forwards, first_forwards[1:]):
        # replies to the previous step's gradients arrive before this step's backward produces new ones
        next_backward = min((e["ts"] for e in backwards if e["ts"] > current["ts"]), default=float("inf"))
        replies = [e["ts"] + e["dur"] for e in receives if previous["ts"] < e["ts"] < next_backward]
        overlapped += bool(replies) and current["ts"] < max(replies)
    assert overlapped >= 2, "the next forward should start while the big last layer's slices are still arriving"
