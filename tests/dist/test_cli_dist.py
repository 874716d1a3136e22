"""`tandem train` under `tandem launch`: data-parallel digits training converges like one process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.dist.jobs import REPO, job_env

EPOCHS = ["--model", "mlp", "--data", "digits", "--epochs", "6", "--batch-size", "64", "--lr", "0.1", "--no-progress"]


def _accuracy(out: Path, name: str) -> float:
    return json.loads((out / name).read_text())[-1]["eval_accuracy"]


@pytest.mark.parametrize(("kind", "compression", "update_on"),
                         [("dist_sync", None, "servers"), ("dist_p3", None, "servers"), ("dist_p3", "fp16", "servers"),
                          ("dist_p3", "fp16", "workers")])  # fmt: skip
def test_data_parallel_digits_matches_single_process(
    kind: str, compression: str | None, update_on: str, tmp_path: Path
) -> None:
    train = [sys.executable, "-m", "tandem", "train", *EPOCHS, "--threads", "1"]
    single = subprocess.run([*train, "--out", str(tmp_path / "single")], cwd=REPO, env=job_env(),
                            capture_output=True, text=True, timeout=300)
    assert single.returncode == 0, single.stderr
    launch = [sys.executable, "-m", "tandem", "launch", "-n", "2", "-s", "2", *(["--p3"] if kind == "dist_p3" else []),
              "--", *train, "--kvstore", kind, "--out", str(tmp_path / "dist"),
              "--update-on", update_on, *(["--gradient-compression", compression] if compression else [])]
    dist = subprocess.run(launch, cwd=REPO, env=job_env(), capture_output=True, text=True, timeout=300)
    assert dist.returncode == 0, dist.stdout + dist.stderr
    assert "[worker 0] tandem: done" in dist.stdout and "[worker 1] tandem: done" in dist.stdout
    one = _accuracy(tmp_path / "single", "history.json")
    both = [_accuracy(tmp_path / "dist", f"history-rank{rank}.json") for rank in range(2)]
    assert both[0] == both[1], "workers hold the same parameters"
    assert one >= 0.95 and both[0] >= 0.95, (one, both)
    assert abs(both[0] - one) <= 0.02, f"same global batch, same accuracy: single {one}, data-parallel {both[0]}"
