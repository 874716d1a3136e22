"""The distributed kvstore with real server and worker processes on 127.0.0.1."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed.jobs import REPO, SCRIPTS, job_env, run_job, worker_lines


@pytest.mark.parametrize("workers, servers", [(1, 1), (2, 3), (3, 2)])
def test_sums_shapes_splitting_and_errors(workers: int, servers: int) -> None:
    # a 20 s heartbeat: undriven replies must arrive without waiting for the IO thread's heartbeat
    env = {"TANDEM_KVSTORE_BIGARRAY_BOUND": "100", "TANDEM_PS_HEARTBEAT": "20", "TANDEM_PS_TIMEOUT": "120"}
    result = run_job("basic.py", workers, servers, env=env)
    assert len(worker_lines(result.stdout, "basic OK")) == workers, result.stdout


BOUND = {"TANDEM_KVSTORE_BIGARRAY_BOUND": "100"}


@pytest.mark.parametrize("kind", ["dist_sync", "dist_async"])
def test_server_side_optimizer_equals_local_update(kind: str) -> None:
    result = run_job("optimizer.py", 2, 2, kind, env=BOUND)
    assert len(worker_lines(result.stdout, "optimizer OK")) == 2, result.stdout


def test_pulls_answered_under_an_optimizer_are_snapshots() -> None:
    result = run_job("snapshot.py", 2, 1)
    assert len(worker_lines(result.stdout, "snapshot OK")) == 2, result.stdout


def test_two_workers_on_half_batches_equal_one_process_on_the_whole() -> None:
    result = run_job("exactness.py", 2, 2)
    assert len(worker_lines(result.stdout, "exactness OK")) == 2, result.stdout


def test_restored_servers_continue_the_same_trajectory(tmp_path: Path) -> None:
    env = {**BOUND, "TANDEM_PS_CHECKPOINT_DIR": str(tmp_path)}  # where servers may write
    run_job("checkpoint.py", 2, 2, "first", str(tmp_path), env=env)
    assert sorted(path.name for path in tmp_path.glob("server-*")) == ["server-0-of-2.pt", "server-1-of-2.pt"]
    result = run_job("checkpoint.py", 2, 2, "resume", str(tmp_path), env=env)
    assert len(worker_lines(result.stdout, "checkpoint OK")) == 2, result.stdout


def test_hostile_frames_are_rejected_and_servers_keep_serving() -> None:
    result = run_job("malformed.py", 1, 2, env={"TANDEM_PS_SECRET": "tandem-test-secret"})
    assert len(worker_lines(result.stdout, "malformed OK")) == 1, result.stdout
    for server in (0, 1):
        rejected = [
            line
            for line in result.stdout.splitlines()
            if line.startswith(f"[server {server}]") and "rejected" in line
        ]
        assert len(rejected) >= 9, result.stdout  # 8 hostile frames and a request from a peer that never said hello


def test_runs_under_torchrun() -> None:
    """torchrun's agent hosts the store; ranks [0, TANDEM_NUM_SERVERS) serve, the rest are workers."""
    torchrun = Path(sys.executable).with_name("torchrun")
    command = [str(torchrun), "--standalone", "--nproc-per-node", "3", str(SCRIPTS / "basic.py")]
    env = job_env(TANDEM_NUM_SERVERS="1", **BOUND)
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("basic OK") == 2, result.stdout
