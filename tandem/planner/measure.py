"""The two machine constants of the simulation, measured here: CPU per message and a server's summing rate.

``message_seconds``: a real ``dist_sync`` server process on loopback and this process as its only
worker; a pushpull of 4 elements is one request and one reply, each costing CPU at both ends, so one
message's share is a round trip / 4. ``aggregate_bytes_per_s``: float32 bytes a server adds per
second (``a.add_(b)`` on 64 MB arrays, beyond the caches as received gradients are, one thread, as a server runs).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from datetime import timedelta

import torch


def message_seconds(round_trips: int = 300) -> float:
    """Median seconds of a tiny pushpull on loopback / 4 (two messages, each paid at both ends)."""
    import torch.distributed as dist

    from tandem.kvstore.config import DistOptions
    from tandem.kvstore.ps.topology import Topology
    from tandem.kvstore.ps.worker import DistKVStore

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    env = {**os.environ, "TANDEM_NUM_WORKERS": "1", "TANDEM_NUM_SERVERS": "1", "TANDEM_MASTER_ADDR": "127.0.0.1",
           "TANDEM_MASTER_PORT": str(store.port), "TANDEM_ROLE": "server", "TANDEM_RANK": "0",
           "TANDEM_NUM_THREADS": "1"}  # fmt: skip
    server = subprocess.Popen([sys.executable, "-m", "tandem.kvstore.ps"], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        kv = DistKVStore(Topology("worker", 0, 1, 1, "127.0.0.1", store.port, 2), DistOptions.from_env("dist_sync"))
        value, out = torch.ones(4), torch.empty(4)
        kv.init("probe", value)
        seconds = []
        for _ in range(round_trips):
            start = time.perf_counter()
            kv.pushpull("probe", value, out=out).wait()
            seconds.append(time.perf_counter() - start)
        kv.close()
    finally:
        if not _ended(server):
            server.kill()
            server.wait()
    return statistics.median(seconds[round_trips // 10 :]) / 4  # the first tenth warms up


def _ended(process: subprocess.Popen[bytes], timeout: float = 10.0) -> bool:
    """Whether the server exits on its own (its only worker said goodbye) within ``timeout``."""
    try:
        process.wait(timeout=timeout)
        return True
    except subprocess.TimeoutExpired:
        return False


def aggregate_bytes_per_s(numel: int = 2**24, repeats: int = 20) -> float:
    """Bytes of float32 gradient a server sums per second, one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a server process runs one torch thread
    try:
        total, part = torch.zeros(numel), torch.ones(numel)
        seconds = []
        for _ in range(repeats):
            start = time.perf_counter()
            total.add_(part)
            seconds.append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    return numel * 4 / statistics.median(seconds)


if __name__ == "__main__":
    print(f"message_s={message_seconds():.3g} aggregate_Bps={aggregate_bytes_per_s():.3g}")
