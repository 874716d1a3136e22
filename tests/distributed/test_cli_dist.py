"""`tandem train` under `tandem launch`: data-parallel digits training converges like one process, and the
README's transformers LM example (dict batches) trains over the P3 parameter server."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed.jobs import REPO, job_env

EPOCHS = ["--model", "mlp", "--data", "digits", "--epochs", "6", "--batch-size", "64", "--lr", "0.1", "--no-progress"]
TRAIN = [sys.executable, "-m", "tandem", "train", *EPOCHS, "--threads", "1"]


def _accuracy(out: Path, name: str) -> float:
    return json.loads((out / name).read_text())[-1]["eval_accuracy"]


@pytest.fixture(scope="module")
def single_process_accuracy(tmp_path_factory: pytest.TempPathFactory) -> float:
    """The same training in one process, on the whole batch: the reference of every data-parallel run."""
    out = tmp_path_factory.mktemp("single")
    single = subprocess.run([*TRAIN, "--out", str(out)], cwd=REPO, env=job_env(), capture_output=True, text=True,
                            timeout=300)  # fmt: skip
    assert single.returncode == 0, single.stderr
    return _accuracy(out, "history.json")


@pytest.mark.parametrize(("kind", "compression", "update_on"),
                         [("dist_sync", None, "servers"), ("dist_p3", None, "servers"), ("dist_p3", "fp16", "servers"),
                          ("dist_p3", "fp16", "workers"), ("dist_p3", "int8", "workers")])  # fmt: skip
def test_data_parallel_digits_matches_single_process(
    kind: str, compression: str | None, update_on: str, single_process_accuracy: float, tmp_path: Path
) -> None:
    launch = [sys.executable, "-m", "tandem", "launch", "-n", "2", "-s", "2", *(["--p3"] if kind == "dist_p3" else []),
              "--", *TRAIN, "--kvstore", kind, "--out", str(tmp_path / "dist"),
              "--update-on", update_on, *(["--gradient-compression", compression] if compression else [])]
    dist = subprocess.run(launch, cwd=REPO, env=job_env(), capture_output=True, text=True, timeout=300)
    assert dist.returncode == 0, dist.stdout + dist.stderr
    assert "[worker 0] tandem: done" in dist.stdout and "[worker 1] tandem: done" in dist.stdout
    one = single_process_accuracy
    both = [_accuracy(tmp_path / "dist", f"history-rank{rank}.json") for rank in range(2)]
    assert both[0] == both[1], "workers hold the same parameters"
    assert one >= 0.95 and both[0] >= 0.95, (one, both)
    assert abs(both[0] - one) <= 0.02, f"same global batch, same accuracy: single {one}, data-parallel {both[0]}"


LM_JOB = ["--model", "hf-gpt2", "--data", "pydoc-text", "--epochs", "3", "--batch-size", "32", "--optimizer", "adamw",
          "--lr", "3e-3", "--max-train-samples", "160", "--max-eval-samples", "64", "--threads", "1"]  # fmt: skip


def _lm_job(out: Path, *options: str, p3: bool = True) -> subprocess.CompletedProcess[str]:
    """The README's LM example, cut to 5 steps an epoch: hf-gpt2 on pydoc-text, 2 workers + 2 servers."""
    pytest.importorskip("transformers")
    launch = [sys.executable, "-m", "tandem", "launch", "-n", "2", "-s", "2", *(["--p3"] if p3 else []), "--",
              sys.executable, "-m", "tandem", "train", *LM_JOB, "--out", str(out), *options]  # fmt: skip
    job = subprocess.run(launch, cwd=REPO, env=job_env(), capture_output=True, text=True, timeout=300)
    assert job.returncode == 0, job.stdout + job.stderr
    assert "[worker 0] tandem: done" in job.stdout and "[worker 1] tandem: done" in job.stdout, job.stdout
    return job


@pytest.fixture(scope="module")
def p3_lm_job(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("lm-p3")
    return out, _lm_job(out, "--kvstore", "dist_p3", "--communication", "p3").stdout


def _histories(out: Path) -> list[list[dict[str, float]]]:
    return [json.loads((out / f"history-rank{rank}.json").read_text()) for rank in range(2)]


def test_transformers_lm_trains_data_parallel_with_p3(p3_lm_job: tuple[Path, str]) -> None:
    """Dict batches through the P3 kvstore: finite losses, validation loss never rising, perplexity printed."""
    out, stdout = p3_lm_job
    histories = _histories(out)
    for history in histories:
        losses = [record["eval_loss"] for record in history]
        assert all(math.isfinite(record["train_loss"]) and math.isfinite(loss) for record, loss in zip(history, losses))
        assert all(later <= earlier for earlier, later in zip(losses, losses[1:])), losses
        assert history[-1]["train_loss"] < history[0]["train_loss"] < math.log(256) + 0.5
        assert "eval_accuracy" not in history[-1]
    evaluated = [[(record["eval_loss"], record["eval_perplexity"]) for record in history] for history in histories]
    assert evaluated[0] == evaluated[1], "workers hold the same parameters (each trains on its own shard)"
    assert "[worker 0] epoch 3:" in stdout and "validation perplexity" in stdout
    # the progress bar under tandem launch: whole lines (no carriage returns), each prefixed by its worker
    assert "[worker 0] epoch 1:   0%|" in stdout and "\r" not in stdout, stdout
    assert (out / "training-rank0.png").stat().st_size > 0 and (out / "training-rank1.png").stat().st_size > 0


def test_transformers_lm_p3_matches_the_baseline_exchange(p3_lm_job: tuple[Path, str], tmp_path: Path) -> None:
    """Sync data-parallel: how the dict batch's gradients travel (sliced by priority, or all at once after
    backward) does not change what the workers learn."""
    _lm_job(tmp_path, "--kvstore", "dist_sync", "--communication", "baseline", "--no-progress", p3=False)
    p3, baseline = _histories(p3_lm_job[0])[0], _histories(tmp_path)[0]
    for ours, reference in zip(p3, baseline, strict=True):
        assert ours["eval_loss"] == pytest.approx(reference["eval_loss"], rel=1e-5, abs=1e-6)
