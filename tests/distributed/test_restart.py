"""Fault tolerance beyond fail-fast: checkpoints that survive a kill, and jobs that restart and resume.

- kill -9 while ``Trainer.save`` writes a checkpoint: the previous one still loads, whole;
- kill -9 a worker, and in another run a server, of a ``tandem launch --max-restarts 2`` job that trains
  with ``Trainer.fit(checkpoint_dir=..., checkpoint_every=...)`` (dist_sync, optimizer on the servers):
  the job restarts, resumes from its last checkpoint, exits 0, and ends with the parameters of a run
  never interrupted; the same with a worker of a ``collective`` job (no servers);
- the same under ``torchrun --max-restarts``;
- workers whose checkpoint directories differ (no shared filesystem) fail at the resume, naming each one's step.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.distributed.jobs import FAST_FAULTS, REPO, SCRIPTS, Lines, job_env, launch_command, run_job


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


RESTART_ENV = {**FAST_FAULTS, "TANDEM_NUM_THREADS": "1"}
STEPS = 32  # 2 epochs of 16 steps; a checkpoint every 5
SERVERS = {"dist_sync": 1, "collective": 0}


def _final(tmp_path: Path, name: str) -> dict[str, torch.Tensor]:
    return torch.load(tmp_path / f"{name}.pt", weights_only=True)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], dict[str, torch.Tensor]]:
    """The parameters of a job of ``kind`` never interrupted (with the same checkpoints on the way), by kind."""
    runs: dict[str, dict[str, torch.Tensor]] = {}

    def parameters(kind: str) -> dict[str, torch.Tensor]:
        if kind not in runs:
            tmp_path = tmp_path_factory.mktemp(f"uninterrupted-{kind}")
            result = run_job("restart_train.py", 2, SERVERS[kind], str(tmp_path / "ckpt"), str(tmp_path / "final.pt"),
                             "0", kind, env={**RESTART_ENV, "TANDEM_PS_CHECKPOINT_DIR": str(tmp_path)})  # fmt: skip
            assert result.stdout.count(f"finished at step {STEPS}") == 2, result.stdout
            runs[kind] = _final(tmp_path, "final")
        return runs[kind]

    return parameters


def _assert_same_parameters(final: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], output: str) -> None:
    assert final.keys() == expected.keys(), output
    for name, value in expected.items():
        if not torch.allclose(final[name], value, rtol=1e-5, atol=1e-6):
            raise AssertionError(f"{name}: {(final[name] - value).abs().max()} from the uninterrupted run's\n{output}")


def _kill_once_checkpointed(output: Lines, process: subprocess.Popen[str], victim: str, directory: Path) -> int:
    """SIGKILL ``victim`` (as it printed its pid) once the checkpoint after step 10 is complete; its pid."""
    pid = int(output.wait_for(rf"{victim} pid (\d+)").group(1))
    deadline = time.monotonic() + 90
    while not (directory / "step-000010" / "COMPLETE").exists():
        assert time.monotonic() < deadline and process.poll() is None, output.text()
        time.sleep(0.005)
    os.kill(pid, signal.SIGKILL)
    return pid


@pytest.mark.parametrize(("victim", "kind"), [("worker 1", "dist_sync"), ("server 0", "dist_sync"),
                                             ("worker 1", "collective")])  # fmt: skip
def test_launch_restarts_the_job_and_it_resumes_exactly(
    tmp_path: Path, victim: str, kind: str, uninterrupted: Callable[[str], dict[str, torch.Tensor]]
) -> None:
    command = launch_command("restart_train.py", 2, SERVERS[kind], str(tmp_path / "ckpt"), str(tmp_path / "final.pt"),
                             "0.003", kind, env={**RESTART_ENV, "TANDEM_PS_CHECKPOINT_DIR": str(tmp_path)})  # fmt: skip
    command.insert(command.index("--"), "--max-restarts=2")
    job = subprocess.Popen(command, cwd=REPO, env=job_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = Lines(job.stdout)
    try:
        pid = _kill_once_checkpointed(output, job, victim, tmp_path / "ckpt")
        code = job.wait(timeout=120)
    finally:
        job.kill()
    text = output.text()
    assert code == 0, text
    assert f"attempt 1 of 3: {victim} (pid {pid}) was killed by SIGKILL" in text, text
    assert "restarting every process (attempt 2 of 3)" in text, text
    resumed = re.findall(r"worker (\d) resumes from \S+step-(\d+) ", text)
    assert sorted(rank for rank, _ in resumed) == ["0", "1"] and len({step for _, step in resumed}) == 1, text
    assert int(resumed[0][1]) >= 10 and text.count(f"finished at step {STEPS}") == 2, text
    _assert_same_parameters(_final(tmp_path, "final"), uninterrupted(kind), text)


def test_torchrun_restarts_the_job_and_it_resumes_exactly(
    tmp_path: Path, uninterrupted: Callable[[str], dict[str, torch.Tensor]]
) -> None:
    """torchrun keeps its store across restarts: the restarted servers publish under keys of their own
    (TORCHELASTIC_RESTART_COUNT), so the workers never dial the dead ones."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3", "--max-restarts",
               "2", "--monitor-interval", "0.1", str(SCRIPTS / "restart_train.py"), str(tmp_path / "ckpt"),
               str(tmp_path / "final.pt"), "0.003"]  # fmt: skip
    env = job_env(**RESTART_ENV, TANDEM_NUM_SERVERS="1", TANDEM_PS_CHECKPOINT_DIR=str(tmp_path), OMP_NUM_THREADS="1")
    job = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = Lines(job.stdout)
    try:
        _kill_once_checkpointed(output, job, "worker 1", tmp_path / "ckpt")
        code = job.wait(timeout=120)
    finally:
        job.kill()
    text = output.text()
    assert code == 0, text
    resumed = re.findall(r"worker (\d) resumes from \S+step-(\d+) ", text)
    assert sorted(rank for rank, _ in resumed) == ["0", "1"] and int(resumed[0][1]) >= 10, text
    _assert_same_parameters(_final(tmp_path, "final"), uninterrupted("dist_sync"), text)


@pytest.mark.parametrize("fails_in", [1, 3])
def test_launch_restarts_until_an_attempt_finishes_or_gives_up(fails_in: int, tmp_path: Path) -> None:
    """A job whose worker 1 fails in its first ``fails_in`` attempts, under --max-restarts 2: each attempt
    gets its number; 1 failure: the second attempt finishes (exit 0); 3: all three fail (its exit code)."""
    # worker 1 fails only once worker 0 has printed its attempt: failing first, it would have the
    # launcher stop worker 0 before that line, which the assertions below look for
    script = textwrap.dedent(f"""
        import os, sys, time
        from pathlib import Path
        attempt, rank = int(os.environ["TANDEM_RESTART_ATTEMPT"]), os.environ["TANDEM_RANK"]
        print("attempt", attempt, flush=True)
        printed = Path({str(tmp_path)!r}) / f"worker-0-printed-{{attempt}}"
        if rank == "0":
            printed.touch()
        fails = rank == "1" and attempt < {fails_in}
        deadline = time.monotonic() + 30
        while fails and not printed.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        sys.exit(3 if fails else 0)
    """)
    command = [sys.executable, "-m", "tandem.launch", "-n", "2", "-s", "0", "--grace", "1", "--max-restarts", "2",
               "--", sys.executable, "-c", script]  # fmt: skip
    result = subprocess.run(command, cwd=REPO, env=job_env(), capture_output=True, text=True, timeout=60)
    out = result.stdout
    assert "attempt 1 of 3: worker 1" in out and "exited with code 3" in out, out
    if fails_in == 1:
        assert result.returncode == 0 and "[worker 1] attempt 1" in out and "attempt 3" not in out, out
    else:
        assert result.returncode == 3 and "[worker 0] attempt 2" in out, out
        assert "giving up: all 3 attempts failed (--max-restarts 2)" in out, out


def test_workers_that_do_not_share_the_checkpoint_dir_fail_at_the_resume(tmp_path: Path) -> None:
    """Each worker has a directory of its own and only worker 0's holds a checkpoint: the workers compare
    their newest complete step through the rendezvous store and both fail naming each one's, instead of
    worker 0 resuming at step 4 while worker 1 starts from 0."""
    directory = tmp_path / "worker-0" / "step-000004"
    directory.mkdir(parents=True)
    (directory / "COMPLETE").write_text('{"step": 4, "workers": 2}')
    command = launch_command("unshared_checkpoint.py", 2, 1, str(tmp_path), "dist_sync",
                             env={**FAST_FAULTS, "TANDEM_PS_CHECKPOINT_DIR": str(tmp_path)})  # fmt: skip
    result = subprocess.run(command, cwd=REPO, env=job_env(), capture_output=True, text=True, timeout=60)
    assert result.returncode != 0, result.stdout
    for rank in (0, 1):
        assert re.search(rf"\[worker {rank}\] tandem.checkpoint.CheckpointError: the workers see different newest "
                         r"complete checkpoints under \S+ \(worker 0: step 4, worker 1: none\)", result.stdout), result.stdout
    assert "finished at step" not in result.stdout, result.stdout
