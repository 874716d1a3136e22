"""Helpers for the distributed tests: real processes on 127.0.0.1 started by `tandem launch`."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parent / "scripts"
# short heartbeats so that fault tests finish fast; timeouts stay well above a loaded machine's hiccups
FAST_FAULTS = {"TANDEM_PS_HEARTBEAT": "0.3", "TANDEM_PS_TIMEOUT": "4"}

Launch = Callable[..., subprocess.CompletedProcess[str]]


def job_env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "TANDEM_NUM_THREADS": "1", "TANDEM_PS_WAIT_TIMEOUT": "60"}
    env.update(extra)
    return env


def launch_command(
    script: str, workers: int, servers: int, *args: str, env: dict[str, str] | None = None
) -> list[str]:
    options = [f"--env={name}={value}" for name, value in (env or {}).items()]
    return [sys.executable, "-m", "tandem.launch", "-n", str(workers), "-s", str(servers), "--grace", "2", *options,
            "--", sys.executable, str(SCRIPTS / script), *args]  # fmt: skip


def run_job(script: str, workers: int, servers: int, *args: str, env: dict[str, str] | None = None,
            timeout: float = 120) -> subprocess.CompletedProcess[str]:  # fmt: skip
    """Run a script under `tandem launch`; fails the test with the job's output if it did not succeed."""
    command = launch_command(script, workers, servers, *args, env=env)
    result = subprocess.run(command, cwd=REPO, env=job_env(), capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"job failed ({result.returncode}):\n{result.stdout}\n{result.stderr}"
    return result


def worker_lines(output: str, marker: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("[worker") and marker in line]
