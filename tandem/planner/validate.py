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
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

from tandem.planner.search import Plan
from tandem.planner.sim import SLICED_MODES, Strategy

MARK = "PLANJOB "
KINDS = {"baseline": "dist_sync", "overlap": "dist_sync", "p3": "dist_p3", "collective": "collective"}
COMMUNICATION = {"collective": "p3"}  # the Trainer's communication of a mode, where it is not the mode's name
JOB_TIMEOUT = 600


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
        sys.exit(kvstore.serve(KINDS[job.mode]))
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
    seconds = []
    for _ in range(job.runs):
        trainer.step(*batch)  # prime: the next step's parameters are on the wire, as in steady state
        start = time.perf_counter()
        for _ in range(job.steps):
            trainer.step(*batch)
        seconds.append((time.perf_counter() - start) / job.steps)
        trainer.sync()  # the drain is not timed: a long run pays it once
    print(MARK + json.dumps({"rank": trainer.rank, "seconds": seconds}), flush=True)
    trainer.close()


def measure(job: Job, workers: int, servers: int, rate: str, env: dict[str, str] | None = None) -> float:
    """Samples/s of ``job`` on ``workers`` + ``servers`` local processes whose links are shaped to ``rate``."""
    shaping = [] if rate == "none" else ["--netns-rate", rate]
    extra = {"TANDEM_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    command = [sys.executable, "-m", "tandem.launch", "-n", str(workers), "-s", str(servers), *shaping,
               *[f"--env={k}={v}" for k, v in extra.items()], "--",
               sys.executable, "-m", "tandem.planner.validate", json.dumps(asdict(job))]  # fmt: skip
    result = subprocess.run(command, env={**os.environ, **extra}, capture_output=True, text=True, timeout=JOB_TIMEOUT)
    output = result.stdout + result.stderr
    reports = [json.loads(line.split(MARK, 1)[1]) for line in output.splitlines() if MARK in line]
    if result.returncode != 0 or len(reports) < workers:
        raise RuntimeError(f"the {job.mode} job failed ({result.returncode}); its output ends:\n{output[-3000:]}")
    slowest = [max(runs) for runs in zip(*(r["seconds"] for r in reports))]  # a sync step ends with its last worker
    return workers * job.batch_size / statistics.median(slowest)


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
                     measure(job, cluster.workers, servers, rate, knob_env(strategy))))
    return rows


if __name__ == "__main__":
    run_job(Job(**json.loads(sys.argv[1])))
