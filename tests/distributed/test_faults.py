"""Killing a server or a worker mid-training ends the whole job fast, with a message naming the dead node.

Twice each: under `tandem launch` (the launcher notices the exit and stops the rest) and with
processes started by hand (the processes notice by themselves, through heartbeats and ABORT).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.distributed.jobs import (
    FAST_FAULTS,
    REPO,
    Lines,
    job_env,
    kill_mid_training,
    launch_command,
    process_log,
    run_job,
    start_by_hand,
)

DEADLINE = 30.0


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"  # a zombie is dead too


@pytest.mark.parametrize("victim", ["server 1", "worker 1"])
def test_launcher_stops_the_job_when_a_process_dies(victim: str) -> None:
    command = launch_command("train_forever.py", 2, 2, env=FAST_FAULTS)
    launcher = subprocess.Popen(
        command, cwd=REPO, env=job_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    output = Lines(launcher.stdout)
    try:
        pids = {name: int(output.wait_for(rf"\[{name}\] {name} pid (\d+)").group(1))
                for name in ("server 0", "server 1", "worker 0", "worker 1")}  # fmt: skip
        output.wait_for(r"\[worker 0\] step 20")
        killed_at = time.monotonic()
        os.kill(pids[victim], signal.SIGKILL)
        code = launcher.wait(timeout=DEADLINE)
        elapsed = time.monotonic() - killed_at
    finally:
        launcher.kill()
    text = output.text()
    assert code != 0 and elapsed < DEADLINE, (code, elapsed, text)
    assert f"{victim} (pid {pids[victim]}) was killed by SIGKILL" in text, text
    assert all(_gone(pid) for pid in pids.values()), text


@pytest.mark.parametrize(
    "victim, survivor_says",
    [
        ("server 1", r"server 1 \(tcp://127\.0\.0\.1:\d+\) stopped answering: no heartbeat for 4\.0 s"),
        ("worker 1", r"worker 1 \(pid \d+ on [^)]+\) stopped answering: no heartbeat for 4\.0 s"),
    ],
)
def test_processes_notice_a_dead_peer_without_a_launcher(
    tmp_path: Path, victim: str, survivor_says: str
) -> None:
    store, processes = start_by_hand(tmp_path, workers=2, servers=2)
    codes, elapsed = kill_mid_training(tmp_path, processes, victim, DEADLINE)
    del store
    logs = {name: process_log(tmp_path, name) for name in processes}
    assert elapsed < DEADLINE, (elapsed, logs)
    for name, code in codes.items():
        assert code != 0, (name, code, logs[name])
        if name != victim:
            assert re.search(survivor_says, logs[name]), (name, logs[name])


def test_a_worker_dying_of_an_exception_stops_the_job_at_once(tmp_path: Path) -> None:
    """The dying worker sends ABORT (not a goodbye): nobody waits for a heartbeat timeout."""
    store, processes = start_by_hand(tmp_path, 2, 2, "early_exit.py", "raise")
    try:
        codes = {name: process.wait(timeout=DEADLINE) for name, process in processes.items()}
    finally:
        for process in processes.values():
            process.kill()
        del store
    logs = {name: process_log(tmp_path, name) for name in processes}
    assert all(code != 0 for code in codes.values()), (codes, logs)
    for name in ("server 0", "server 1", "worker 0"):
        assert "worker 1 died of ValueError: injected failure" in logs[name], (name, logs[name])


def test_a_worker_closing_early_fails_the_others_requests_instead_of_hanging() -> None:
    result = run_job("early_exit.py", 2, 1, "close", env=FAST_FAULTS)
    assert "[worker 0] worker 0 stopped at step 5: RemoteError" in result.stdout, result.stdout
    assert "worker(s) [1] closed their kvstore" in result.stdout, result.stdout
