"""Fault tolerance beyond fail-fast: checkpoints that survive a kill, and jobs that restart and resume.

- kill -9 while ``Trainer.save`` writes a checkpoint: the previous one still loads, whole;
- kill -9 a worker, and in another run a server, of a ``tandem launch --max-restarts 2`` job that trains
  with ``Trainer.fit(checkpoint_dir=..., checkpoint_every=...)`` (dist_sync, optimizer on the servers):
  the job restarts, resumes from its last checkpoint, exits 0, and ends with the parameters of a run
  never interrupted;
- the same under ``torchrun --max-restarts``.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from tests.distributed.jobs import REPO, SCRIPTS, job_env


def test_a_kill_during_save_leaves_the_previous_checkpoint_loadable(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    saver = subprocess.Popen([sys.executable, str(SCRIPTS / "slow_save.py"), str(path)], cwd=REPO, env=job_env(),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        assert saver.stdout is not None
        first = saver.stdout.readline()
        assert first.startswith("saved 1"), first + saver.stdout.read()
        deadline = time.monotonic() + 60
        while not list(tmp_path.glob(".ckpt.pt.*.tmp")):  # the next save has begun writing its temporary file
            assert time.monotonic() < deadline and saver.poll() is None, "no save caught in progress"
            time.sleep(0.001)
        saver.send_signal(signal.SIGKILL)
        saver.wait(timeout=10)
    finally:
        saver.kill()
    assert list(tmp_path.glob(".ckpt.pt.*.tmp")), "killed between saves, not during one"
    state = torch.load(path, weights_only=True)  # the previous checkpoint: complete, every value the same save's
    number = float(state["model"]["weight"][0, 0])
    assert number >= 1 and bool((state["model"]["weight"] == number).all()) and bool((state["model"]["bias"] == number).all())
