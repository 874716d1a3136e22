"""Helpers for the distributed tests: real processes on 127.0.0.1 started by `tandem launch`."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

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


def first_and_tail_loss(line: str) -> tuple[float, float]:
    """The first step's loss and the mean of the last five from a trainer_modes.py line."""
    found = re.search(r" loss (\S+) -> \S+ tail (\S+) ", line)
    assert found, line
    return float(found[1]), float(found[2])


def start_by_hand(
    tmp_path: Path, workers: int, servers: int, script: str = "train_forever.py", *args: str
) -> tuple[dist.TCPStore, dict[str, subprocess.Popen[bytes]]]:
    """A job's processes started one by one, no launcher: each ``role rank`` logs to tmp_path/<role><rank>.log.
    Keep the returned store alive while they run (it is the rendezvous)."""
    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30)
    )
    base = job_env(**FAST_FAULTS, TANDEM_NUM_WORKERS=str(workers), TANDEM_NUM_SERVERS=str(servers),
                   TANDEM_MASTER_ADDR="127.0.0.1", TANDEM_MASTER_PORT=str(store.port))  # fmt: skip
    processes = {}
    for role, count in (("server", servers), ("worker", workers)):
        for rank in range(count):
            log = open(tmp_path / f"{role}{rank}.log", "wb")  # noqa: SIM115 - closed with the process
            env = {**base, "TANDEM_ROLE": role, "TANDEM_RANK": str(rank), "PYTHONUNBUFFERED": "1"}
            processes[f"{role} {rank}"] = subprocess.Popen(
                [sys.executable, str(SCRIPTS / script), *args],
                cwd=REPO,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
    return store, processes


def process_log(tmp_path: Path, name: str) -> str:
    """What process ``name`` ("worker 0") of a start_by_hand job has logged so far."""
    return (tmp_path / f"{name.replace(' ', '')}.log").read_text(errors="replace")


def kill_mid_training(
    tmp_path: Path, processes: dict[str, subprocess.Popen[bytes]], victim: str, deadline: float
) -> tuple[dict[str, int], float]:
    """SIGKILL ``victim`` once worker 0 has logged step 20; every process's exit code, and the seconds
    from the kill until the last one exited. Whatever is left is killed, even on failure."""
    try:
        started = time.monotonic() + 60
        while "step 20" not in process_log(tmp_path, "worker 0"):
            assert time.monotonic() < started and processes["worker 0"].poll() is None, process_log(
                tmp_path, "worker 0"
            )
            time.sleep(0.05)
        killed_at = time.monotonic()
        processes[victim].send_signal(signal.SIGKILL)
        codes = {name: process.wait(timeout=deadline) for name, process in processes.items()}
        return codes, time.monotonic() - killed_at
    finally:
        for process in processes.values():
            process.kill()


class Lines:
    """Collects a process's output lines in a thread so the test can wait for a marker."""

    def __init__(self, stream: object) -> None:
        self.lines: list[str] = []
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream: object) -> None:
        for line in stream:  # type: ignore[attr-defined]
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, pattern: str, timeout: float = 60) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                match = re.search(pattern, line)
                if match:
                    return match
            time.sleep(0.05)
        raise AssertionError(f"no line matched {pattern!r}:\n" + "\n".join(self.lines))

    def text(self) -> str:
        self._thread.join(timeout=5)
        return "\n".join(self.lines)
