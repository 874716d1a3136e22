"""``tandem plan --validate``: run the jobs a plan predicts on this machine and compare samples/s.

The plan it checks is made for this machine (``--validate`` implies ``--here``: every worker and
server shares this host's cores, with the other work running as it was planned).

Each mode that tandem can run (baseline, overlap, p3 and collective at the plan's knobs) runs as a
``tandem launch`` job of the plan's workers and servers (collective: no servers), every process in
its own network namespace with its link shaped to the plan's rate (``--netns-rate``; as root), one
torch thread each, SGD on the servers (collective: on the workers). Each worker times ``runs`` runs
of ``steps`` steps in steady state (as bench/p3.py does: one untimed step
primes the pipeline, the drain after a run is untimed); a run's time is its slowest worker's; the
median run counts. Models are zoo models fed by their ``make_batch``.

Each process also reports the CPU it spends per step (all its threads: ``time.process_time``), a
worker over its timed runs, a server from its own samples every ``SAMPLE_S`` over the same wall-clock
windows: what ``Prediction.worker_cpu_s`` and ``server_cpu_s`` charge. A worker also splits its CPU by
thread (Linux: ``/proc/self/task``), named by their Python names, a native thread (libzmq's) by its own.
"""

from __future__ import annotations

import bisect
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tandem.planner.search import Plan
from tandem.planner.sim import SLICED_MODES, Strategy

MARK = "PLANJOB "
KINDS = {"baseline": "dist_sync", "overlap": "dist_sync", "p3": "dist_p3", "collective": "collective"}
COMMUNICATION = {"collective": "p3"}  # the Trainer's communication of a mode, where it is not the mode's name
JOB_TIMEOUT = 600
SAMPLE_S = 0.01  # a server's CPU sampling period: a run's window is 0.2 s or more, so its edges cost under 5 %


@dataclass(frozen=True)
class Measured:
    """A job's samples/s and the CPU seconds one process spends per step (mean over the workers, the
    servers; median over the runs). ``server_cpu_s`` is None without servers or their reports."""

    samples_per_s: float
    worker_cpu_s: float
    server_cpu_s: float | None
    worker_threads: dict[str, float] = field(default_factory=dict)  # thread name -> CPU seconds per step (mean)


def thread_cpu_seconds() -> dict[str, float]:
    """CPU seconds so far of this process's live threads, by name (Python's, else the kernel's; a
    trailing rank or slot number dropped, so one role has one name on every worker). Empty off Linux."""
    names = {thread.native_id: thread.name for thread in threading.enumerate()}
    found: dict[str, float] = {}
    tasks = Path("/proc/self/task")
    for task in tasks.iterdir() if tasks.exists() else ():
        try:
            nanoseconds = int((task / "schedstat").read_text().split()[0])
            name = names.get(int(task.name)) or (task / "comm").read_text().strip()
        except (OSError, ValueError, IndexError):
            continue  # the thread ended meanwhile
        name = re.sub(r"-\d+$", "", name)
        found[name] = found.get(name, 0.0) + nanoseconds / 1e9
    return found


@dataclass(frozen=True)
class Job:
    model: str  # a zoo model
    config: dict[str, Any]  # its build arguments (make_batch takes them too)
    batch_size: int  # per worker
    mode: str = "p3"
    compression: str = "none"
    runs: int = 5
    steps: int = 4
    warmup: int = 3
    seed: int = 0


def run_job(job: Job) -> None:
    """One process of a launched job: a server serves; a worker trains, times and prints its runs."""
    import torch

    from tandem import kvstore, models, optim
    from tandem.trainer import Trainer

    if kvstore.is_server():
        samples: list[tuple[float, float]] = []
        stop = threading.Event()

        def sample() -> None:  # (wall clock, this process's CPU): the workers' windows are cut from these
            while not stop.wait(SAMPLE_S):
                samples.append((time.time(), time.process_time()))

        threading.Thread(target=sample, daemon=True).start()
        code = kvstore.serve(KINDS[job.mode])
        stop.set()
        print(MARK + json.dumps({"role": "server", "samples": samples}), flush=True)
        sys.exit(code)
    torch.set_num_threads(1)
    entry = models.ZOO[job.model]
    torch.manual_seed(job.seed)
    module = entry.build(**job.config)
    batch = entry.make_batch(job.batch_size, torch.Generator().manual_seed(job.seed + 1), **job.config)
    trainer = Trainer(module, entry.loss_fn, optim.SGD(lr=0.01, momentum=0.9), kvstore=KINDS[job.mode],
                      communication=COMMUNICATION.get(job.mode, job.mode), progress=False,
                      gradient_compression=None if job.compression == "none" else job.compression)  # fmt: skip
    for _ in range(job.warmup):
        trainer.step(*batch)
    trainer.sync()
    seconds, cpu, windows = [], [], []
    threads: dict[str, float] = {}  # name -> CPU seconds per timed step
    for _ in range(job.runs):
        trainer.step(*batch)  # prime: the next step's parameters are on the wire, as in steady state
        start_threads, start_wall, start_cpu, start = thread_cpu_seconds(), time.time(), time.process_time(), time.perf_counter()
        for _ in range(job.steps):
            trainer.step(*batch)
        seconds.append((time.perf_counter() - start) / job.steps)
        cpu.append((time.process_time() - start_cpu) / job.steps)
        windows.append((start_wall, time.time()))
        for name, spent in thread_cpu_seconds().items():
            threads[name] = threads.get(name, 0.0) + (spent - start_threads.get(name, 0.0)) / (job.steps * job.runs)
        trainer.sync()  # the drain is not timed: a long run pays it once
    print(MARK + json.dumps({"role": "worker", "rank": trainer.rank, "seconds": seconds, "cpu": cpu,
                             "windows": windows, "threads": threads}), flush=True)  # fmt: skip
    trainer.close()


def _cpu_between(samples: list[list[float]], start: float, end: float) -> float:
    """CPU seconds a process's (wall, cpu) samples put between two wall-clock times (linear between samples)."""
    walls = [w for w, _ in samples]

    def at(when: float) -> float:
        i = min(max(bisect.bisect_left(walls, when), 1), len(walls) - 1)
        (w0, c0), (w1, c1) = samples[i - 1], samples[i]
        return c0 + (c1 - c0) * (when - w0) / (w1 - w0) if w1 > w0 else c1

    return at(end) - at(start)


def measure(job: Job, workers: int, servers: int, rate: str, env: dict[str, str] | None = None) -> Measured:
    """Samples/s and CPU per step of ``job`` on ``workers`` + ``servers`` local processes whose links are
    shaped to ``rate``."""
    shaping = [] if rate == "none" else ["--netns-rate", rate]
    extra = {"TANDEM_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    command = [sys.executable, "-m", "tandem.launch", "-n", str(workers), "-s", str(servers), *shaping,
               *[f"--env={k}={v}" for k, v in extra.items()], "--",
               sys.executable, "-m", "tandem.planner.validate", json.dumps(asdict(job))]  # fmt: skip
    result = subprocess.run(command, env={**os.environ, **extra}, capture_output=True, text=True, timeout=JOB_TIMEOUT)
    output = result.stdout + result.stderr
    reports = [json.loads(line.split(MARK, 1)[1]) for line in output.splitlines() if MARK in line]
    ranks = [r for r in reports if r["role"] == "worker"]
    if result.returncode != 0 or len(ranks) < workers:
        raise RuntimeError(f"the {job.mode} job failed ({result.returncode}); its output ends:\n{output[-3000:]}")
    slowest = [max(runs) for runs in zip(*(r["seconds"] for r in ranks))]  # a sync step ends with its last worker
    worker_cpu = statistics.median(statistics.fmean(runs) for runs in zip(*(r["cpu"] for r in ranks)))
    windows = [(min(w[0] for w in run), max(w[1] for w in run)) for run in zip(*(r["windows"] for r in ranks))]
    served = [r["samples"] for r in reports if r["role"] == "server" and len(r["samples"]) >= 2]
    server_cpu = statistics.median(statistics.fmean(_cpu_between(s, start, end) for s in served) / job.steps
                                   for start, end in windows) if served else None  # fmt: skip
    names = sorted({name for r in ranks for name in r["threads"]})
    threads = {name: statistics.fmean(r["threads"].get(name, 0.0) for r in ranks) for name in names}
    return Measured(workers * job.batch_size / statistics.median(slowest), worker_cpu, server_cpu, threads)


def knob_env(strategy: Strategy) -> dict[str, str]:
    """The environment that runs a job at ``strategy``'s slice size and water mark (where it has them)."""
    if strategy.mode not in SLICED_MODES:
        return {}
    return {"TANDEM_KVSTORE_SLICE_THRESHOLD": str(strategy.slice_size), "TANDEM_PS_WATER_MARK": str(strategy.water_mark)}


def validate(result: Plan, model: str, config: dict[str, Any], modes: list[str], runs: int = 5,
             steps: int = 4) -> list[tuple[str, float, float]]:  # fmt: skip
    """(mode label, predicted, measured samples/s) of each of ``modes`` that tandem runs."""
    from tandem.models import ZOO

    if model not in ZOO:
        raise ValueError(f"--validate runs zoo models (fed by make_batch): {sorted(ZOO)}; got {model!r}")
    cluster, rows = result.target.cluster(), []
    rate = result.target.rate if isinstance(result.target.rate, str) else f"{int(cluster.rate_bps)}bit"
    for mode in modes:
        predicted = result.prediction(mode)
        if mode not in KINDS or predicted is None:
            continue
        strategy = predicted.strategy
        job = Job(model, config, result.profile.batch_size, mode, runs=runs, steps=steps)
        servers = 0 if mode == "collective" else cluster.servers
        rows.append((strategy.label, predicted.samples_per_s,
                     measure(job, cluster.workers, servers, rate, knob_env(strategy)).samples_per_s))
    return rows


if __name__ == "__main__":
    run_job(Job(**json.loads(sys.argv[1])))
