"""Time to accuracy: wall time until a held-out metric first reaches a target, per mode, over a shaped network.

Two tasks (``--task``):
- digits: ResNet (zoo ``resnet``, the ``digits`` preset of ``tandem train``: depth 8, width 16, 1
  input channel) on the digits (1437 train / 360 test images), SGD with momentum, to a test accuracy;
- text: the real-models example's LM (transformers' ``GPT2LMHeadModel``, ``tandem.models.LIBRARY``'s
  byte-level ``hf-gpt2``) on Python's help texts (``tandem.data.pydoc_text``: 6557 train / 728
  validation blocks of 64 bytes), AdamW as ``scripts/train_lm.sh``, to a validation loss.
Data-parallel on ``--workers`` workers, each process in its own network namespace with its NIC shaped
to the link rate (as bench/p3.py). Modes:
- baseline, overlap, p3: the parameter server (``dist_sync``, ``dist_sync``, ``dist_p3``), 2 servers;
- collective-p3: ``kvstore="collective"``, workers only;
  each of them also with gradient compression (``+fp16``, ``+2bit`` with error feedback);
  ``--modes`` also takes ``collective-baseline`` (one exchange after backward) and
  ``collective-overlap``, and ``+int8`` / ``+int4`` / ``+bf16`` (``--compressions int8`` adds int8 rows);
- ddp, ddp+fp16, ddp+powersgd: torch DistributedDataParallel over gloo, plain and with its
  communication hooks (bench/p3.py's ``ddp_wrap``: fp16_compress_hook; powerSGD_hook, rank 2,
  vanilla all-reduce for the first 2 steps).
Any mode may carry ``@inductor`` (``collective-baseline+int8@inductor``, ``ddp+fp16@inductor``):
tandem's modes then run the inductor segment backend, DDP's ``torch.compile(DDP(model))``; the
goal's "DDP's best" is the best DDP mode of the run, eager or compiled (``--backend inductor`` gives
every mode without a suffix that backend).
The same everywhere: initial weights and sample order (seed 0; ``--seeds N`` runs every mode with
seeds 0..N-1, round-robin over the modes, and reports medians), global batch (``--batch``, split evenly over the
workers), the order of the samples (one permutation per epoch, each global batch cut into one
contiguous piece per worker), the same optimizer and learning rate, gradients averaged over
the workers, the optimizer on the workers (``update_on_kvstore=False``: the parameter-server pulls
carry the round's sum, compressed like the pushes), one torch thread per process.

Timing: each worker's clock starts just before its first training step, after process start-up,
the process group / kvstore rendezvous and model construction; it includes the first step (where
tandem captures and plans the step: the column "first step s" shows what it cost). Every
``--eval-every`` steps both workers drain outstanding communication (``Trainer.sync``; timed), then
stop their clocks, evaluate on the whole held-out split, wait for each other (both untimed) and
start them again. Time to target
is rank 0's clock at the first evaluation reaching ``--target``; training goes on to ``--steps``
steps in every mode, and the final metric is the last evaluation's. The goal is judged on the
time to target less the first step (capture is paid once per run, whatever its length; DDP's first
step is subtracted alike); the table shows both.

Reproduce: python bench/time_to_accuracy.py [--task text]   (as root for shaped links; --quick for a smoke run)
Writes bench/out/time_to_accuracy_<task>.md, .png and _raw.json (every run, written as it ends;
``--report-only`` rewrites the report and plot from it).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from anywhere without installing

from bench.common import OUT, command_line, markdown_table, write_report  # noqa: E402
from bench.p3 import BACKENDS, DDP_HOOKS, DDP_MODES, KINDS, split_mode  # noqa: E402  (the mode -> kvstore kind map every bench shares)

TANDEM_MODES = ("baseline", "overlap", "p3", "collective-p3")
COMPRESSIONS = ("fp16", "2bit")  # the default table's; --compressions may add int8, int4 and bf16
COMPRESSION_CHOICES = (*COMPRESSIONS, "int8", "int4", "bf16")
# the tuned modes (p3-auto...) are bench/p3.py's: the Trainer has no such communication, and tuning needs its warm-up
TANDEM_MODE_CHOICES = tuple(mode for mode in KINDS if not mode.endswith("-auto"))
SERVERS = 2
JOB_TIMEOUT = 900
MARK = "TTABENCH "


@dataclass(frozen=True)
class Task:
    """What is trained to what target, and the defaults of its run."""

    name: str
    title: str  # for the plot and the report
    metric: str  # what an evaluation measures
    higher_is_better: bool
    target: float
    steps: int
    eval_every: int
    batch: int
    lr: float
    band: float  # the goal's "same final metric": |ours - DDP's best| at most this
    band_text: str

    def reached(self, value: float, target: float) -> bool:
        return value >= target if self.higher_is_better else value <= target


TASKS = {
    "digits": Task("digits", "digits ResNet (depth 8, width 16)", "test accuracy", True, target=0.97, steps=200,
                   eval_every=10, batch=64, lr=0.05, band=0.005, band_text="within 0.5 points"),
    # the real-models example's LM: transformers' GPT2LMHeadModel (byte-level, 0.12M parameters) on
    # Python's help texts, AdamW as scripts/train_lm.sh; 2.3 nats is perplexity 10, about 220 steps of
    # one process at batch 32
    "text": Task("text", "transformers GPT-2 (tiny) on pydoc text", "validation loss", False, target=2.3, steps=300,
                 eval_every=20, batch=32, lr=3e-3, band=0.02, band_text="within 0.02 nats"),
}  # fmt: skip
WEIGHT_DECAY = 0.01  # the text task's AdamW, as the README's LM example


def all_modes(compressions: tuple[str, ...] | list[str]) -> list[str]:
    """Every tandem mode without and with each compression, then DDP and its hooks."""
    return [*(f"{mode}{suffix}" for mode in TANDEM_MODES for suffix in ("", *(f"+{c}" for c in compressions))),
            *DDP_MODES]  # fmt: skip


def mode_argument(text: str) -> str:
    """argparse's check of a mode: one of ``TANDEM_MODE_CHOICES`` with an optional ``+<compression>``
    (as ``gradient_compression`` takes it: ``+2bit:0.1``), or ``ddp`` with an optional ``+<hook>``
    (``DDP_HOOKS``); either with an optional ``@<backend>``. Checked before the first job starts."""
    base, backend = split_mode(text)
    mode, plus, option = base.partition("+")
    if mode == "ddp":
        known = not plus or option in DDP_HOOKS
    else:
        known = mode in TANDEM_MODE_CHOICES and (not plus or _compression_known(option))
    if not known or backend not in BACKENDS:
        raise argparse.ArgumentTypeError(
            f"unknown mode {text!r}: one of {', '.join(TANDEM_MODE_CHOICES)} (optionally "
            f"+{'/+'.join(COMPRESSION_CHOICES)}), or ddp (optionally +{'/+'.join(DDP_HOOKS)}), each optionally "
            f"with @{'/@'.join(BACKENDS)}")  # fmt: skip
    return text


def _compression_known(text: str) -> bool:
    from tandem.kvstore.compression import GradientCompression
    from tandem.kvstore.errors import KVStoreError

    try:
        return GradientCompression.parse(text).type != "none"
    except KVStoreError:
        return False


# ---- what each process runs --------------------------------------------------------------------


def _data(task: str) -> tuple[Any, Any]:
    """(train, held out) of the task."""
    from tandem import data

    if task == "text":
        return data.pydoc_text("train"), data.pydoc_text("validation")
    return data.digits("train"), data.digits("test")


def _model(task: str, seed: int = 0) -> tuple[Any, Any]:
    import torch

    from tandem.models import lookup

    entry = lookup("hf-gpt2" if task == "text" else "resnet")
    torch.manual_seed(seed)
    if task == "text":
        return entry.build(), entry.loss_fn
    return entry.build(depth=8, width=16, in_channels=1, small_input=True), entry.loss_fn  # tandem train's digits preset


def _optimizers(task: str, args: dict[str, Any]) -> tuple[Any, Any]:
    """(tandem's update rule, a factory of torch's equal optimizer over some parameters)."""
    import torch

    import tandem.optim

    if task == "text":
        return (tandem.optim.AdamW(lr=args["lr"], weight_decay=WEIGHT_DECAY),
                lambda parameters: torch.optim.AdamW(parameters, lr=args["lr"], weight_decay=WEIGHT_DECAY))  # fmt: skip
    return (tandem.optim.SGD(lr=args["lr"], momentum=args["momentum"]),
            lambda parameters: torch.optim.SGD(parameters, lr=args["lr"], momentum=args["momentum"]))  # fmt: skip


def _batches(task: str, train: Any, rank: int, workers: int, batch: int, seed: int = 0) -> Any:
    """This worker's piece of each global batch (a step's positional arguments), forever: one
    permutation per epoch, full batches only."""
    import torch
    from torch.utils.data import default_collate

    samples = train.tokens if task == "text" else train.tensors[0]
    per_worker = batch // workers
    epoch = 0
    while True:
        order = torch.randperm(len(samples), generator=torch.Generator().manual_seed(seed * 1000 + epoch))
        for start in range(0, len(order) - batch + 1, batch):
            mine = order[start + rank * per_worker: start + (rank + 1) * per_worker]
            if task == "text":  # the data set's own items, stacked: {"input_ids", "attention_mask", "labels"}
                yield (default_collate([train[index] for index in mine.tolist()]),)
            else:
                yield train.tensors[0][mine], train.tensors[1][mine]
        epoch += 1


def _evaluate_eager(task: str, module: Any, held_out: Any) -> float:
    """The metric of a plain module (DDP's), computed as ``Trainer.evaluate`` does: accuracy over
    every sample, or the mean of the per-batch mean losses over its batches, in order."""
    import torch

    from tandem.data import loader
    from tandem.trainer import TrainerConfig

    module.eval()
    with torch.no_grad():
        if task == "text":  # the tandem modes' Trainer.evaluate batches at its default batch_size
            losses = [float(module(**batch).loss) for batch in loader(held_out, TrainerConfig.batch_size)]
            value = sum(losses) / len(losses)
        else:
            images, labels = held_out.tensors
            value = int((module(images).argmax(dim=-1) == labels).sum()) / len(labels)
    module.train()
    return value


def _train(rank: int, step: Any, drain: Any, evaluate: Any, rejoin: Any, args: dict[str, Any]) -> None:
    """The timed loop every mode shares; rank 0 reports its curve. ``rejoin()`` waits for every
    worker, after an evaluation: one that took longer (tandem's first captures its graph) would
    otherwise hold the others' next step back, inside their clocks."""
    task = TASKS[args["task"]]
    train, _ = _data(task.name)
    batches = _batches(task.name, train, rank, args["workers"], args["batch"], args["seed"])
    curve: list[tuple[int, float, float]] = []
    elapsed, first = 0.0, None
    # CPU seconds of every thread of this process from the second step on, evaluation excluded: what
    # the steps cost the shared cores (a step bound by them gains nothing from a faster link)
    cpu, cpu_start = 0.0, 0.0
    start = time.perf_counter()
    for number in range(1, args["steps"] + 1):
        step(*next(batches))
        if first is None:
            first = time.perf_counter() - start
            cpu_start = time.process_time()
        if number % args["eval_every"] == 0 or number == args["steps"]:
            drain()
            elapsed += time.perf_counter() - start
            cpu += time.process_time() - cpu_start
            curve.append((number, elapsed, evaluate()))
            rejoin()
            start, cpu_start = time.perf_counter(), time.process_time()
    if rank == 0:
        hits = [(number, seconds) for number, seconds, value in curve if task.reached(value, args["target"])]
        print(MARK + json.dumps({"curve": curve, "time_to_target": hits[0][1] if hits else None,
                                 "steps_to_target": hits[0][0] if hits else None, "final": curve[-1][2],
                                 "first_step": first, "train_seconds": elapsed,
                                 "cpu_seconds": cpu}), flush=True)  # fmt: skip


def tandem_job(mode: str, args: dict[str, Any]) -> None:
    import torch

    from tandem import kvstore
    from tandem.trainer import Trainer

    name, backend = split_mode(mode, args.get("backend", "aten"))
    base, _, compression = name.partition("+")
    if kvstore.is_server():
        sys.exit(kvstore.serve(KINDS[base]))
    torch.set_num_threads(1)
    task = args["task"]
    module, loss_fn = _model(task, args["seed"])
    trainer = Trainer(module, loss_fn, _optimizers(task, args)[0], kvstore=KINDS[base],
                      communication=base.removeprefix("collective-"), gradient_compression=compression or None,
                      update_on_kvstore=False, progress=False, backend=backend)  # fmt: skip
    _, held_out = _data(task)

    def evaluate() -> float:
        return float(trainer.evaluate(held_out)["loss" if task == "text" else "accuracy"])

    _train(trainer.kvstore.rank, trainer.step, trainer.sync, evaluate, trainer.kvstore.barrier, args)
    trainer.close()


def ddp_job(mode: str, rank: int, master: str, port: int, args: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist

    from bench.p3 import ddp_wrap

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{master}:{port}", rank=rank, world_size=args["workers"])
    task = args["task"]
    module, loss_fn = _model(task, args["seed"])
    # with backend inductor, the like-for-like peer: DDP under torch.compile
    name, backend = split_mode(mode, args.get("backend", "aten"))
    wrapped = ddp_wrap(module, name.partition("+")[2], backend)
    optimizer = _optimizers(task, args)[1](wrapped.parameters())
    _, held_out = _data(task)

    def step(*batch: Any) -> None:
        optimizer.zero_grad(set_to_none=True)
        loss_fn(wrapped, *batch).backward()
        optimizer.step()

    _train(rank, step, lambda: None, lambda: _evaluate_eager(task, module, held_out), dist.barrier, args)
    dist.barrier()  # neither rank tears its connections down while the other still uses them
    dist.destroy_process_group()


# ---- the driver --------------------------------------------------------------------------------


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "TANDEM_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", **extra}


def _report(output: str, what: str) -> dict[str, Any]:
    reports = [json.loads(line.split(MARK, 1)[1]) for line in output.splitlines() if MARK in line]
    if not reports:
        raise RuntimeError(f"{what} reported nothing; its output:\n{output[-4000:]}")
    return reports[0]


def run_mode(mode: str, rate: str, workers: int, job: dict[str, Any]) -> dict[str, Any]:
    from tandem import netns

    encoded, what = json.dumps(job), f"{mode} at {rate}"
    base = split_mode(mode)[0].partition("+")[0]
    if base == "ddp":
        with netns.Network(num_hosts=workers, rate=None if rate == "none" else rate) as net:
            master = net.hosts[0].address
            gloo = {"GLOO_SOCKET_IFNAME": "eth0"} if net.isolated else {}
            processes = [subprocess.Popen(host.command([sys.executable, str(Path(__file__).resolve()), "--ddp", mode,
                                                        str(rank), master, "29732", encoded]),
                                          cwd=ROOT, env=_env(**gloo), stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True)
                         for rank, host in enumerate(net.hosts)]  # fmt: skip
            outputs = [process.communicate(timeout=JOB_TIMEOUT)[0] for process in processes]
        output = "\n".join(outputs)
        if any(process.returncode for process in processes) and MARK not in output:
            raise RuntimeError(f"{what} failed:\n{output[-4000:]}")
        return _report(output, what)
    shaping = [] if rate == "none" else ["--netns-rate", rate]
    servers = 0 if KINDS[base] == "collective" else SERVERS
    command = [sys.executable, "-m", "tandem.launch", "-n", str(workers), "-s", str(servers), *shaping, "--",
               sys.executable, str(Path(__file__).resolve()), "--job", mode, encoded]  # fmt: skip
    result = subprocess.run(command, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=JOB_TIMEOUT)
    output = result.stdout + result.stderr
    if result.returncode != 0:
        raise RuntimeError(f"{what} failed ({result.returncode}):\n{output[-4000:]}")
    return _report(output, what)


def _aggregate(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One mode's runs (one per seed) as one result: medians, and the target as reached only where at
    least half the runs reached it (the medians then over those runs); the curve is the first seed's."""
    from statistics import median

    hits = [run for run in runs if run["time_to_target"] is not None]
    reached = len(hits) * 2 >= len(runs)
    later = [run["curve"][-1][0] - 1 for run in runs]  # steps after the first
    cpu = [run["cpu_seconds"] / steps * 1e3 for run, steps in zip(runs, later) if "cpu_seconds" in run]
    return {"curve": runs[0]["curve"], "runs": len(runs), "reached_runs": len(hits),
            "time_to_target": median(run["time_to_target"] for run in hits) if reached else None,
            "less_first_step": median(run["time_to_target"] - run["first_step"] for run in hits) if reached else None,
            "steps_to_target": median(run["steps_to_target"] for run in hits) if reached else None,
            "final": median(run["final"] for run in runs),
            "first_step": median(run["first_step"] for run in runs),
            "train_seconds": median(run["train_seconds"] for run in runs),
            "ms_per_step": median((run["train_seconds"] - run["first_step"]) / steps * 1e3 for run, steps in zip(runs, later)),
            "cpu_ms_per_step": median(cpu) if cpu else None,
            "steps_by_seed": [run["steps_to_target"] for run in runs]}  # fmt: skip


def _stem(task: Task, settings: dict[str, Any]) -> str:
    """The outputs' name: time_to_accuracy_<task>, and _inductor with that backend."""
    backend = settings.get("backend", "aten")
    return f"time_to_accuracy_{task.name}{'' if backend == 'aten' else '_' + backend}"


def _plot(task: Task, curves: dict[tuple[str, int], dict[str, dict[str, Any]]], settings: dict[str, Any]) -> Path:
    """One panel per (workers, link rate): the metric against rank 0's training wall time, per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    target, backend = settings["target"], settings.get("backend", "aten")
    workers = sorted({count for _, count in curves})
    rates = list(dict.fromkeys(rate for rate, _ in curves))
    figure, axes = plt.subplots(len(workers), len(rates), figsize=(7 * len(rates), 5 * len(workers)), squeeze=False)
    for (rate, count), results in curves.items():
        axis = axes[workers.index(count)][rates.index(rate)]
        for mode, result in results.items():
            style = "--" if mode.startswith("ddp") else ":" if mode.startswith("collective") else "-"
            axis.plot([point[1] for point in result["curve"]], [point[2] for point in result["curve"]], style,
                      label=mode)  # fmt: skip
        axis.axhline(target, color="grey", linewidth=0.8)
        if task.higher_is_better:
            axis.set_ylim(max(0.0, target - 0.2), 1.0)
        else:
            axis.set_ylim(target - 0.5, target + 1.5)
        axis.set_title(f"{task.title}, {count} workers, link {rate}" + ("" if backend == "aten" else f", {backend}"))
        axis.set_xlabel("training wall time, s (rank 0, evaluation excluded)")
        axis.set_ylabel(task.metric)
        axis.legend(fontsize="small", ncol=2)
    figure.tight_layout()
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / f"{_stem(task, settings)}.png"
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def _fp16_wire_ms(parameters: int, workers: int, rate: str) -> float | None:
    """Milliseconds a step's fp16 gradients keep each worker's link busy in a ring all-reduce (each
    worker sends 2(n-1)/n of them: DDP+fp16's and collective+fp16's bytes); None on an unshaped link."""
    from tandem.netns import parse_rate

    return None if rate == "none" else parameters * 2 * 8 * 2 * (workers - 1) / workers / parse_rate(rate) * 1e3


def _goal(task: Task, workers: int, rate: str, results: dict[str, dict[str, Any]], target: float,
          parameters: int) -> str:  # fmt: skip
    """The goal's line for one (workers, rate): tandem's best mode against DDP's best, on the time to
    target less the first step (capture), with the final metric within the task's band; on a shaped
    link, also DDP's best per step against the wire time of fp16 gradients (what bounds every mode
    that sends them)."""
    reached = {mode: result["less_first_step"] for mode, result in results.items() if result["time_to_target"] is not None}
    ddp = [mode for mode in reached if mode.startswith("ddp")]
    ours = [mode for mode in reached if not mode.startswith("ddp")]
    where = f"{workers} workers at {rate}"
    if not ddp or not ours:
        who = "tandem or DDP" if not ddp and not ours else "tandem" if ddp else "DDP"
        return f"MISSED: {where}: the target was not reached by {who}"
    best_ddp, best_ours = min(ddp, key=reached.__getitem__), min(ours, key=reached.__getitem__)
    ratio = reached[best_ours] / reached[best_ddp]
    final_ours, final_ddp = results[best_ours]["final"], results[best_ddp]["final"]
    met = ratio <= 0.8 and abs(final_ours - final_ddp) <= task.band
    wire = _fp16_wire_ms(parameters, workers, rate)
    return (f"{'met' if met else 'MISSED'}{'' if rate == '100mbit' else ' (goal set for 100mbit)'}: {where}: tandem's "
            f"best ({best_ours}, {reached[best_ours]:.1f} s) reaches the target in {ratio:.2f}x the time of DDP's best "
            f"({best_ddp}, {reached[best_ddp]:.1f} s; first step excluded), target <= 0.8x; final {task.metric} "
            f"{final_ours:.4f} vs {final_ddp:.4f} (target {task.band_text}){_wire_text(results[best_ddp], wire)}")  # fmt: skip


def _wire_text(best_ddp: dict[str, Any], wire_ms: float | None) -> str:
    if wire_ms is None or best_ddp["steps_to_target"] <= 1:
        return ""
    per_step = best_ddp["less_first_step"] / (best_ddp["steps_to_target"] - 1) * 1e3
    return (f"; DDP's best took {per_step:.1f} ms a step to the target, and fp16 gradients keep a worker's link busy "
            f"{wire_ms:.1f} ms a step (ring all-reduce), so 0.8x of DDP's best is {0.8 * per_step / wire_ms:.2f}x "
            "that wire time")  # fmt: skip


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] in ("--job", "--ddp"):
        rest = sys.argv[2:]
        if sys.argv[1] == "--job":
            tandem_job(rest[0], json.loads(rest[1]))
        else:
            ddp_job(rest[0], int(rest[1]), rest[2], int(rest[3]), json.loads(rest[4]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="digits", choices=list(TASKS),
                        help="digits: the ResNet to a test accuracy; text: the real-models example's GPT-2 to a "
                             "validation loss")  # fmt: skip
    parser.add_argument("--rates", nargs="+", default=["100mbit"], help="tc rates, or 'none' for unshaped")
    parser.add_argument("--workers", nargs="+", type=int, default=[2])
    parser.add_argument("--modes", nargs="+", type=mode_argument, default=None,
                        help="default: every mode (see the docstring)")
    parser.add_argument("--compressions", nargs="+", default=list(COMPRESSIONS), choices=list(COMPRESSION_CHOICES))
    parser.add_argument("--target", type=float, default=None,
                        help="the metric to reach (digits: test accuracy 0.97; text: validation loss 2.3)")
    parser.add_argument("--steps", type=int, default=None, help="training steps in every mode (digits 200, text 300)")
    parser.add_argument("--eval-every", type=int, default=None, help="digits 10, text 20")
    parser.add_argument("--batch", type=int, default=None,
                        help="global batch, split evenly over the workers (digits 64, text 32)")
    parser.add_argument("--lr", type=float, default=None, help="digits: SGD 0.05; text: AdamW 3e-3")
    parser.add_argument("--momentum", type=float, default=0.9, help="SGD's (digits)")
    parser.add_argument("--seeds", type=int, default=1,
                        help="runs per mode, seeds 0..N-1 (initial weights and sample order), medians reported")
    parser.add_argument("--backend", default="aten", choices=["aten", "inductor"],
                        help="tandem's backend; with inductor the DDP modes run under torch.compile too (a "
                             "mode's own @inductor suffix picks it for that mode alone)")
    parser.add_argument("--report-only", action="store_true",
                        help="rewrite the report and plot from bench/out/time_to_accuracy_<task>_raw.json")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 40 steps, ddp and collective-p3 (+fp16) only; not a measurement")
    args = parser.parse_args()
    task = TASKS[args.task]
    for name in ("target", "steps", "eval_every", "batch", "lr"):
        if getattr(args, name) is None:
            setattr(args, name, getattr(task, name))
    modes = list(dict.fromkeys(args.modes)) if args.modes else all_modes(args.compressions)  # each mode once
    if args.quick:
        args.steps, args.eval_every = 40, 10
        modes = modes if args.modes else ["collective-p3", "collective-p3+fp16", "ddp", "ddp+fp16"]
    if args.seeds < 1:
        parser.error("--seeds must be at least 1")
    if any(args.batch % workers for workers in args.workers):
        parser.error(f"--batch {args.batch} must split evenly over --workers {args.workers}")
    raw_path = OUT / f"{_stem(task, {'backend': args.backend})}_raw.json"
    if args.report_only:
        raw = json.loads(raw_path.read_text())
    else:
        raw = {"settings": {name: getattr(args, name) for name in SETTINGS}, "modes": modes, "runs": {},
               "command": command_line()}  # what --report-only's report names: the run's command, not its own
        OUT.mkdir(parents=True, exist_ok=True)
        for workers in args.workers:
            for rate in args.rates:
                job = {"task": task.name, "workers": workers, "batch": args.batch, "steps": args.steps,
                       "eval_every": args.eval_every, "lr": args.lr, "momentum": args.momentum,
                       "target": args.target, "backend": args.backend}  # fmt: skip
                runs = raw["runs"].setdefault(f"{workers} {rate}", {mode: [] for mode in modes})
                for seed in range(args.seeds):  # round-robin: a slow phase of the machine hits every mode alike
                    for mode in modes:
                        runs[mode].append(result := run_mode(mode, rate, workers, {**job, "seed": seed}))
                        raw_path.write_text(json.dumps(raw))  # after every job: a crash keeps what ran
                        print(f"{workers} workers, {rate}, {mode}, seed {seed}: time to target "
                              f"{result['time_to_target']}, final {task.metric} {result['final']:.4f}, first step "
                              f"{result['first_step']:.2f} s", flush=True)  # fmt: skip
    _write(task, raw)


SETTINGS = ("target", "steps", "eval_every", "batch", "lr", "momentum", "seeds", "quick", "backend")  # what a report states


def _write(task: Task, raw: dict[str, Any]) -> None:
    """The report (per-run table, summary by setting, goal lines) and the plot, from the raw results."""
    settings = raw["settings"]
    parameters = sum(parameter.numel() for parameter in _model(task.name)[0].parameters())
    seeds = settings["seeds"]
    curves: dict[tuple[str, int], dict[str, dict[str, Any]]] = {}
    rows, goals = [], []
    for key, runs in raw["runs"].items():
        workers_text, rate = key.split(" ")
        workers = int(workers_text)
        if any(not mode_runs for mode_runs in runs.values()):
            continue  # a setting a crashed run did not finish
        results = curves.setdefault((rate, workers), {})
        results.update((mode, _aggregate(mode_runs)) for mode, mode_runs in runs.items())
        # the goal's clock: time to target less the first step (capture), for every mode alike
        ddp_times = [result["less_first_step"] for mode, result in results.items()
                     if mode.startswith("ddp") and result["time_to_target"] is not None]  # fmt: skip
        for mode, result in results.items():
            seconds, less_first = result["time_to_target"], result["less_first_step"]
            ratio = less_first / min(ddp_times) if seconds is not None and ddp_times else "-"
            rows.append([workers, rate, mode, "not reached" if seconds is None else seconds,
                         "-" if less_first is None else less_first, result["steps_to_target"] or "-",
                         result["final"], ratio, result["first_step"], result["train_seconds"], result["ms_per_step"],
                         "-" if result["cpu_ms_per_step"] is None else result["cpu_ms_per_step"]]
                        + ([", ".join(str(steps or "-") for steps in result["steps_by_seed"]),
                            f"{result['reached_runs']}/{result['runs']}"] if seeds > 1 else []))  # fmt: skip
        goals.append(_goal(task, workers, rate, results, settings["target"], parameters))
    steps = settings["steps"]
    table = markdown_table(["workers", "link", "mode", "time to target s", "less first step s", "steps to target",
                            f"final {task.metric}", "vs best ddp (less first step)", "first step s",
                            f"{steps} steps s", "ms a step", "CPU ms a step"]
                           + (["steps to target by seed", "runs reaching target"] if seeds > 1 else []), rows)  # fmt: skip
    summary = _summary(curves)
    optimizer = (f"AdamW lr {settings['lr']} weight decay {WEIGHT_DECAY}" if task.name == "text"
                 else f"SGD lr {settings['lr']} momentum {settings['momentum']}")  # fmt: skip
    note = (f"{task.title} ({parameters} parameters), global batch {settings['batch']}, {optimizer}, {steps} steps, "
            f"target {task.metric} {settings['target']}, evaluated every {settings['eval_every']} steps; training "
            "wall time of rank 0 from its first step (first step and drains included, evaluation excluded); 'less "
            "first step': the same less the first step's time (capture), which the goal and the ratios use; 'ms a "
            "step': the training wall time less the first step, per later step; 'CPU ms a step': rank 0's CPU time "
            "(every thread of the process) per later step, evaluation excluded; "
            + ("one run per mode" if seeds == 1 else f"medians of {seeds} runs per mode (seeds 0-{seeds - 1}), the "
               "target counted as reached where at least half the runs reached it")
            + ("" if settings.get("backend", "aten") == "aten" else "; tandem's modes with backend=\"inductor\", "
               "DDP's under torch.compile") + (" (--quick: a smoke run, not a measurement)" if settings["quick"] else ""))  # fmt: skip
    goal_text = "\n".join(f"- {line}" for line in goals)
    text = f"{note}\n\n{table}\n\nSummary (less first step s, steps to target in brackets):\n\n{summary}\n\nGoal:\n\n{goal_text}"
    command = raw.get("command", command_line())
    report = write_report(_stem(task, settings), text, command)
    plot = _plot(task, curves, settings)
    print(f"\n{text}\n\nwritten {report} and {plot}\nreproduce: {command}")


def _summary(curves: dict[tuple[str, int], dict[str, dict[str, Any]]]) -> str:
    """Modes down, (workers, link) across: time to target less the first step, and its steps."""
    columns = list(curves)  # in the order run: workers, then link rate
    modes = list(dict.fromkeys(mode for setting in columns for mode in curves[setting]))
    rows = []
    for mode in modes:
        cells: list[Any] = [mode]
        for setting in columns:
            result = curves[setting].get(mode)
            if result is None:
                cells.append("")
            elif result["time_to_target"] is None:
                cells.append("not reached")
            else:
                cells.append(f"{result['less_first_step']:.3g} ({result['steps_to_target']})")
        rows.append(cells)
    return markdown_table(["mode", *(f"{workers} workers, {rate}" for rate, workers in columns)], rows)

if __name__ == "__main__":
    main()
