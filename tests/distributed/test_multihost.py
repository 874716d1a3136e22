"""Multi-host for real: two "hosts" (network namespaces, each with its own address on a shaped link),
torchrun on each, meeting at the first host's address as docs/tutorials/multi-host.md shows.

Each namespace has its own loopback, so nothing reaches the other host through 127.0.0.1: a job
that finishes has found the store, the servers and its peers by the hosts' addresses. Both modes
run ``tandem train`` (the digits MLP, a few steps): ``collective`` (every rank a worker; torchrun's
c10d rendezvous) and ``dist_p3`` (global rank 0 serves on the first host; static rendezvous).
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tandem import netns
from tests.distributed.jobs import REPO, SCRIPTS, job_env

pytestmark = pytest.mark.skipif(
    not netns.available()[0], reason=f"no network namespaces: {netns.available()[1]}"
)
RATE = "200mbit"  # each host's link, both ways
PORT = 29500  # every namespace has ports of its own: no clash with other jobs on this machine
TIMEOUT = 100.0  # seconds for the whole job; a hung rendezvous fails the test with both hosts' logs
BATCH = 48  # global batch: divides by 2 (collective) and by 3 (parameter server) workers
Command = Callable[[int, str, str], list[str]]  # (node rank, its address, host 0's address) -> its torchrun
TRAIN = ["train", "--model", "mlp", "--data", "digits", "--epochs", "1", "--batch-size", str(BATCH),
         "--max-train-samples", str(6 * BATCH), "--max-eval-samples", "100", "--no-progress", "--threads", "1"]  # fmt: skip


def _torchrun(node: int, nproc: int, rendezvous: list[str], *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
            "--nproc-per-node", str(nproc), *rendezvous, "--tee", "3", str(SCRIPTS / "multihost.py"), *args]  # fmt: skip


def _run_on_two_hosts(tmp_path: Path, command: Command, env: dict[str, str]) -> tuple[list[str], list[str]]:
    """Run ``command(k, host k's address, host 0's address)`` in host k's namespace, with TANDEM_BIND_ADDR
    that host's address, until both end; returns the hosts' addresses and logs. Whatever still runs
    at the end (a failed test) is killed with the network."""
    with netns.Network(num_hosts=2, rate=RATE) as network, contextlib.ExitStack() as files:
        assert network.isolated, "two namespaces with their own addresses"
        addresses = [host.address for host in network.hosts]
        processes: list[subprocess.Popen[bytes]] = []
        codes: list[int | None] = []
        try:
            for host in network.hosts:
                log = files.enter_context(open(tmp_path / f"host{host.index}.log", "wb"))
                host_env = job_env(TANDEM_BIND_ADDR=host.address, OMP_NUM_THREADS="1", **env)
                argv = host.command(command(host.index, host.address, addresses[0]))
                processes.append(subprocess.Popen(argv, cwd=REPO, env=host_env, stdout=log,
                                                  stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))  # fmt: skip
            deadline = time.monotonic() + TIMEOUT
            for process in processes:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(timeout=max(0.1, deadline - time.monotonic()))
                codes.append(process.poll())
        finally:
            for process in processes:
                if process.poll() is None:
                    process.kill()
                    process.wait(timeout=10)
    logs = [(tmp_path / f"host{index}.log").read_text(errors="replace") for index in range(2)]
    assert codes == [0, 0], f"exit codes {codes} (None: still running after {TIMEOUT:.0f} s)\n" + "\n".join(
        f"--- host {index} ({addresses[index]}) ---\n{log[-6000:]}" for index, log in enumerate(logs)
    )
    return addresses, logs


def _meetings(log: str) -> dict[int, tuple[str, str]]:
    """rank -> (MASTER_ADDR:MASTER_PORT, TANDEM_BIND_ADDR) as each process of a host's log was told."""
    found = re.findall(r"multihost: rank (\d+) master (\S+) bind (\S+)", log)
    return {int(rank): (master, bind) for rank, master, bind in found}


def _assert_workers_agree(out: Path, workers: int) -> None:
    """Every worker evaluates the same test set: the same parameters give the very same loss and accuracy."""
    histories = [json.loads((out / f"history-rank{rank}.json").read_text()) for rank in range(workers)]
    finals = [(history[-1]["eval_loss"], history[-1]["eval_accuracy"]) for history in histories]
    assert all(final == finals[0] for final in finals), f"the workers' parameters differ: {finals}"
    assert math.isfinite(finals[0][0]) and finals[0][0] < math.log(10) - 0.1, f"nothing learnt: {finals[0]}"


def test_collective_across_two_hosts(tmp_path: Path) -> None:
    """One worker per host, c10d rendezvous at host 0's address. torchrun's agents tell the workers where
    to meet (MASTER_ADDR): ``--local-addr``, since the host name here resolves to 127.0.0.1; and host 0
    is told it hosts the rendezvous (``is_host``), which it cannot tell from its host name either."""
    out = tmp_path / "out"

    def command(node: int, address: str, master: str) -> list[str]:
        rendezvous = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"{master}:{PORT}", "--rdzv-id", "multihost",
                      "--local-addr", address, *(["--rdzv-conf", "is_host=1"] if node == 0 else [])]  # fmt: skip
        return _torchrun(node, 1, rendezvous, *TRAIN, "--kvstore", "collective", "--out", str(out))

    addresses, logs = _run_on_two_hosts(tmp_path, command, {})
    met = {rank: seen for log in logs for rank, seen in _meetings(log).items()}
    assert sorted(met) == [0, 1], logs
    assert all(master.split(":")[0] == addresses[0] for master, _ in met.values()), (met, addresses)
    for log in logs:
        assert len(_meetings(log)) == 1 and "tandem: done" in log, log
    _assert_workers_agree(out, 2)


def test_parameter_server_across_two_hosts(tmp_path: Path) -> None:
    """Two processes per host, TANDEM_NUM_SERVERS=1, static rendezvous: global rank 0 (host 0) serves,
    bound to host 0's address; worker 0 runs beside it and workers 1-2 on host 1 (the tutorial's layout)."""
    out = tmp_path / "out"

    def command(node: int, address: str, master: str) -> list[str]:
        rendezvous = ["--rdzv-backend", "static", "--master-addr", master, "--master-port", str(PORT)]
        return _torchrun(node, 2, rendezvous, *TRAIN, "--kvstore", "dist_p3", "--out", str(out))

    addresses, logs = _run_on_two_hosts(tmp_path, command, {"TANDEM_NUM_SERVERS": "1"})
    master = f"{addresses[0]}:{PORT}"
    assert _meetings(logs[0]) == {0: (master, addresses[0]), 1: (master, addresses[0])}, logs[0]
    assert _meetings(logs[1]) == {2: (master, addresses[1]), 3: (master, addresses[1])}, logs[1]
    # the server listens on (and publishes) host 0's address: the workers on host 1 reached it there
    assert re.search(rf"server 0 \(tcp://{re.escape(addresses[0])}:\d+\) serving ", logs[0]), logs[0]
    assert logs[0].count("tandem: done") == 1 and logs[1].count("tandem: done") == 2, logs
    _assert_workers_agree(out, 3)
