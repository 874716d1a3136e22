"""`tandem launch`: prefixed output, the environment of every role, fail-fast exit codes, usage errors."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from tests.distributed.jobs import REPO, job_env, launch_command


def _launch(ready: Path, failing_worker: int) -> tuple[subprocess.CompletedProcess[str], float]:
    command = launch_command("echo_role.py", 2, 2, str(failing_worker), str(ready), env={"EXTRA": "x=1"})
    start = time.monotonic()
    result = subprocess.run(command, cwd=REPO, env=job_env(), capture_output=True, text=True, timeout=60)
    return result, time.monotonic() - start


def test_every_line_is_prefixed_and_a_failing_worker_stops_the_job(tmp_path: Path) -> None:
    result, elapsed = _launch(tmp_path, failing_worker=1)
    lines = result.stdout.splitlines()
    for role, rank in [("server", 0), ("server", 1), ("worker", 0), ("worker", 1)]:
        assert f"[{role} {rank}] hello from {role} {rank} of 2w/2s threads=1 extra=x=1" in lines, (
            result.stdout
        )
        assert f"[{role} {rank}] second line" in lines, result.stdout
    assert result.returncode == 3, result.stdout
    assert any(
        line.startswith("[tandem launch] worker 1 (pid ") and "exited with code 3" in line for line in lines
    )
    assert elapsed < 30, elapsed  # the sleeping servers were stopped, not waited for


def test_usage_errors_name_the_fix() -> None:
    base = [sys.executable, "-m", "tandem.launch"]
    for args, message in [
        (["-n", "2"], "no command"),
        (["-n", "0", "--", "true"], "-n >= 1"),
        (["-n", "1", "--env", "NOEQUALS", "--", "true"], "NAME=VALUE"),
    ]:
        result = subprocess.run(
            base + args, cwd=REPO, env=job_env(), capture_output=True, text=True, timeout=60
        )
        assert result.returncode != 0 and message in result.stderr + result.stdout, (args, result.stderr)


def test_curve_keys_go_to_each_role_and_the_job_runs_encrypted() -> None:
    """`--curve`: every process gets both public keys and only its own role's secret key; a real job
    (pushes, pulls, errors, barriers) runs over the encrypted links."""
    show = ("import os; print(os.environ['TANDEM_ROLE'], sorted(name for name in os.environ "
            "if name.startswith('TANDEM_PS_CURVE')), bool(os.environ.get('TANDEM_PS_SECRET')))")
    command = [sys.executable, "-m", "tandem.launch", "-n", "1", "-s", "1", "--curve", "--", sys.executable, "-c", show]
    result = subprocess.run(command, cwd=REPO, env=job_env(), capture_output=True, text=True, timeout=60)
    public = "'TANDEM_PS_CURVE_SERVER_KEY', 'TANDEM_PS_CURVE_WORKER_KEY'"
    assert ("[server 0] server ['TANDEM_PS_CURVE_SERVER_KEY', 'TANDEM_PS_CURVE_SERVER_SECRET_KEY', "
            "'TANDEM_PS_CURVE_WORKER_KEY'] True") in result.stdout, result.stdout
    assert f"[worker 0] worker [{public}, 'TANDEM_PS_CURVE_WORKER_SECRET_KEY'] True" in result.stdout, result.stdout
    job = launch_command("basic.py", 2, 1)
    job.insert(job.index("--grace"), "--curve")
    result = subprocess.run(job, cwd=REPO, env=job_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("basic OK") == 2, result.stdout
