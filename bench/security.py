"""What whole-message authentication and CURVE encryption cost, against no security, side by side.

Three settings of a parameter-server job:
- ``none``: no secret (``tandem launch --no-secret``): messages unauthenticated;
- ``auth``: a shared secret (``tandem launch``'s default): every message tagged (ChaCha20-Poly1305
  under session keys) and checked, replays refused (docs/security.md);
- ``auth+curve``: the secret and ZeroMQ CURVE on every link (``tandem launch --curve``).

Two measurements:
- **pushpull**: one ``dist_sync`` server process per setting, one worker each in this process; a
  pushpull of 1 MB and of 16 MB (float32) timed ``--repeats`` times per setting, the settings
  interleaved repeat by repeat (the machine is shared and noisy); medians.
- **training**: P3 training throughput of ``bench/p3.py``'s resnet (2 workers + 2 servers,
  ``dist_p3``), one job per setting per round (the settings' order rotating round by round),
  ``--rounds`` rounds; median samples/s, and the cost of a secret round by round (1 - auth / none
  of the same round: jobs vary by tens of percent, and the same round's pair shares the machine's state).
  Per link of ``--rates``: ``none`` is loopback (4 processes on this machine's cores, no wire to
  wait for: what security costs in CPU shows in full), a rate runs every process in its own network
  namespace shaped to it (``tandem launch --netns-rate``), as on a cluster.

Reproduce: .venv/bin/python bench/security.py   (options: --repeats, --rounds, --steps, --rates)
Writes bench/out/security.md and bench/out/security.png.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from anywhere without installing

from bench.common import OUT, markdown_table, write_report  # noqa: E402

SETTINGS: dict[str, tuple[str, ...]] = {"none": ("--no-secret",), "auth": (), "auth+curve": ("--curve",)}
SECRET = "bench-security-secret"
SIZES = {"1 MB": 2**18, "16 MB": 2**22}  # float32 elements


def _pushpull_jobs() -> dict[str, Any]:
    """Per setting: a server process and a connected worker store (its environment set while it connects)."""
    import torch.distributed as dist

    from tandem.kvstore.config import DistOptions
    from tandem.kvstore.ps.curve import new_job_keys
    from tandem.kvstore.ps.topology import Topology
    from tandem.kvstore.ps.worker import DistKVStore

    jobs = {}
    for name in SETTINGS:
        secret = "" if name == "none" else SECRET
        keys = new_job_keys() if name.endswith("curve") else {"server": {}, "worker": {}}
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
        env = {**os.environ, "PYTHONPATH": str(ROOT), "TANDEM_ROLE": "server", "TANDEM_RANK": "0",
               "TANDEM_NUM_WORKERS": "1", "TANDEM_NUM_SERVERS": "1", "TANDEM_MASTER_ADDR": "127.0.0.1",
               "TANDEM_MASTER_PORT": str(store.port), "TANDEM_PS_SECRET": secret, "TANDEM_NUM_THREADS": "1",
               **keys["server"]}  # fmt: skip
        server = subprocess.Popen([sys.executable, "-m", "tandem.kvstore.ps", "--kind", "dist_sync"], env=env,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        saved = dict(os.environ)
        os.environ.update(keys["worker"])  # the worker's transport reads its CURVE keys as it connects
        try:
            options = DistOptions.from_env("dist_sync", secret=secret, exit_on_failure=False)
            worker = DistKVStore(Topology("worker", 0, 1, 1, "127.0.0.1", store.port, 2), options)
        finally:
            os.environ.clear()
            os.environ.update(saved)
        jobs[name] = (store, server, worker)
    return jobs


def pushpull(repeats: int) -> dict[str, dict[str, float]]:
    """Median seconds of a pushpull per setting and size."""
    import torch

    torch.set_num_threads(1)
    jobs = _pushpull_jobs()
    times: dict[str, dict[str, list[float]]] = {name: {size: [] for size in SIZES} for name in SETTINGS}
    try:
        for _, _, worker in jobs.values():
            for size, numel in SIZES.items():
                worker.init(size, torch.zeros(numel))
        values = {size: torch.randn(numel) for size, numel in SIZES.items()}
        outs = {size: torch.empty(numel) for size, numel in SIZES.items()}
        for repeat in range(repeats + 2):  # the first two warm up
            for name, (_, _, worker) in jobs.items():
                for size in SIZES:
                    start = time.perf_counter()
                    worker.pushpull(size, values[size], outs[size]).wait()
                    if repeat >= 2:
                        times[name][size].append(time.perf_counter() - start)
    finally:
        for _, server, worker in jobs.values():
            worker.close()
            server.wait(timeout=30)
    return {name: {size: statistics.median(seconds) for size, seconds in by_size.items()}
            for name, by_size in times.items()}  # fmt: skip


def training(rounds: int, steps: int, rate: str) -> dict[str, list[float]]:
    """Samples/s of P3 training (bench/p3.py's resnet at link ``rate``) per setting, one per round, rounds
    interleaved (so round i of two settings ran minutes apart at most: their ratio is a paired sample)."""
    from bench import p3

    batch = 2 * p3.MODELS["resnet"][2]
    speeds: dict[str, list[float]] = {name: [] for name in SETTINGS}
    names = list(SETTINGS)
    for round_index in range(rounds):
        turn = round_index % len(names)  # each setting goes first, second, third in turn: no order effect
        for name in names[turn:] + names[:turn]:
            result = p3.run_tandem("resnet", "p3", rate, 3, steps, {}, SETTINGS[name])
            speeds[name].append(batch / result["seconds"])
    return speeds


def _paired(speeds: dict[str, list[float]]) -> str:
    """The cost of authentication round by round (1 - auth / none of the same round): median and range."""
    costs = sorted(1 - auth / none for auth, none in zip(speeds["auth"], speeds["none"]))
    return f"round by round: median {statistics.median(costs):+.1%}, from {costs[0]:+.1%} to {costs[-1]:+.1%}"


def _plot(seconds: dict[str, dict[str, float]], speeds: dict[str, dict[str, float]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2 + len(speeds), figsize=(4.5 * (2 + len(speeds)), 4))
    for axis, size in zip(axes[:2], SIZES):
        axis.bar(list(SETTINGS), [seconds[name][size] * 1000 for name in SETTINGS])
        axis.set_title(f"pushpull of {size}")
        axis.set_ylabel("ms (median)")
    for axis, (rate, speed) in zip(axes[2:], speeds.items()):
        axis.bar(list(SETTINGS), [speed[name] for name in SETTINGS])
        axis.set_title(f"P3 training, resnet, link {'loopback' if rate == 'none' else rate}")
        axis.set_ylabel("samples/s (median)")
    figure.tight_layout()
    OUT.mkdir(parents=True, exist_ok=True)
    figure.savefig(OUT / "security.png", dpi=120)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30, help="pushpulls per setting and size")
    parser.add_argument("--rounds", type=int, default=5, help="training jobs per setting")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per run of a training job")
    parser.add_argument("--rates", nargs="+", default=["none", "1gbit"],
                        help="links of the training jobs: 'none' (loopback) or a rate per host (e.g. 1gbit)")  # fmt: skip
    args = parser.parse_args()
    seconds = pushpull(args.repeats)
    samples = {rate: training(args.rounds, args.steps, rate) for rate in args.rates}
    speeds = {rate: {name: statistics.median(values) for name, values in by_name.items()}
              for rate, by_name in samples.items()}  # fmt: skip
    rows = [[name, f"{seconds[name]['1 MB'] * 1000:.2f}", f"{seconds[name]['1 MB'] / seconds['none']['1 MB']:.2f}x",
             f"{seconds[name]['16 MB'] * 1000:.1f}", f"{seconds[name]['16 MB'] / seconds['none']['16 MB']:.2f}x",
             *(f"{speed[name]:.0f} ({speed[name] / speed['none']:.3f}x)" for speed in speeds.values())]
            for name in SETTINGS]  # fmt: skip
    links = [f"P3 training, {'loopback' if rate == 'none' else rate} (samples/s, vs none)" for rate in args.rates]
    table = markdown_table(["setting", "pushpull 1 MB (ms)", "vs none", "pushpull 16 MB (ms)", "vs none", *links], rows)
    goals = [f"goal: authentication costs <= 5% of training throughput at {rate}: "
             f"{'met' if loss <= 0.05 else 'missed'} ({loss:+.1%} of the medians; {_paired(samples[rate])})"
             for rate, loss in ((rate, 1 - speed["auth"] / speed["none"]) for rate, speed in speeds.items())]  # fmt: skip
    note = (f"medians: pushpull {args.repeats} per setting and size, settings interleaved; training "
            f"{args.rounds} jobs per setting and link, interleaved, each the median of 3 runs of {args.steps} steps")
    print(table, note, *goals, sep="\n\n")
    write_report("security", "\n\n".join([table, note, *goals]))
    _plot(seconds, speeds)


if __name__ == "__main__":
    main()
