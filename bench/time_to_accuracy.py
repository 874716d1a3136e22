"""Time to accuracy: wall time until the test accuracy first reaches a target, per mode, over a shaped network.

ResNet (zoo ``resnet``, the ``digits`` preset of ``tandem train``: depth 8, width 16, 1 input channel)
on the digits (1437 train / 360 test images), data-parallel on ``--workers`` workers, each process in
its own network namespace with its NIC shaped to the link rate (as bench/p3.py). Modes:
- baseline, overlap, p3: the parameter server (``dist_sync``, ``dist_sync``, ``dist_p3``), 2 servers;
- collective-p3: ``kvstore="collective"``, workers only;
  each of them also with gradient compression (``+fp16``, ``+2bit`` with error feedback);
- ddp, ddp+fp16, ddp+powersgd: torch DistributedDataParallel over gloo, plain and with its
  communication hooks (bench/p3.py's ``ddp_wrap``: fp16_compress_hook; powerSGD_hook, rank 2,
  vanilla all-reduce for the first 2 steps).
The same everywhere: initial weights and sample order (seed 0; ``--seeds N`` runs every mode with
seeds 0..N-1, round-robin over the modes, and reports medians), global batch (``--batch``, split evenly over the
workers), the order of the samples (one permutation per epoch, each global batch cut into one
contiguous piece per worker), SGD with the same learning rate and momentum, gradients averaged over
the workers, the optimizer on the workers (``update_on_kvstore=False``: the parameter-server pulls
carry the round's sum, compressed like the pushes), one torch thread per process.

Timing: each worker's clock starts just before its first training step, after process start-up,
the process group / kvstore rendezvous and model construction; it includes the first step (where
tandem captures and plans the step: the column "first step s" shows what it cost). Every
``--eval-every`` steps both workers drain outstanding communication (``Trainer.sync``; timed), then
stop their clocks, evaluate on the whole test split (untimed) and start them again. Time to target
is rank 0's clock at the first evaluation reaching ``--target``; training goes on to ``--steps``
steps in every mode, and the final accuracy is the last evaluation's. The goal is judged on the
time to target less the first step (capture is paid once per run, whatever its length; DDP's first
step is subtracted alike); the table shows both.

Reproduce: python bench/time_to_accuracy.py   (as root for shaped links; --quick for a smoke run)
Writes bench/out/time_to_accuracy.md and bench/out/time_to_accuracy.png.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from anywhere without installing

from bench.common import OUT, command_line, markdown_table, write_report  # noqa: E402
from bench.p3 import DDP_MODES, KINDS  # noqa: E402  (the mode -> kvstore kind map every bench shares)

MODEL = ("resnet", {"depth": 8, "width": 16, "in_channels": 1, "small_input": True})  # tandem train's digits preset
TANDEM_MODES = ("baseline", "overlap", "p3", "collective-p3")
COMPRESSIONS = ("fp16", "2bit")
SERVERS = 2
JOB_TIMEOUT = 900
MARK = "TTABENCH "


def all_modes(compressions: tuple[str, ...] | list[str]) -> list[str]:
    """Every tandem mode without and with each compression, then DDP and its hooks."""
    return [*(f"{mode}{suffix}" for mode in TANDEM_MODES for suffix in ("", *(f"+{c}" for c in compressions))),
            *DDP_MODES]  # fmt: skip


# ---- what each process runs --------------------------------------------------------------------


def _data() -> tuple[Any, Any]:
    from tandem import data

    return data.digits("train"), data.digits("test")


def _model(seed: int = 0) -> tuple[Any, Any]:
    import torch

    from tandem.models import ZOO

    entry = ZOO[MODEL[0]]
    torch.manual_seed(seed)
    return entry.build(**MODEL[1]), entry.loss_fn


def _batches(train: Any, rank: int, workers: int, batch: int, seed: int = 0) -> Any:
    """This worker's piece of each global batch, forever: one permutation per epoch, full batches only."""
    import torch

    images, labels = train.tensors
    per_worker = batch // workers
    epoch = 0
    while True:
        order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed * 1000 + epoch))
        for start in range(0, len(order) - batch + 1, batch):
            mine = order[start + rank * per_worker: start + (rank + 1) * per_worker]
            yield images[mine], labels[mine]
        epoch += 1


def _accuracy(module: Any, test: Any) -> float:
    import torch

    images, labels = test.tensors
    module.eval()
    with torch.no_grad():
        correct = int((module(images).argmax(dim=-1) == labels).sum())
    module.train()
    return correct / len(labels)


def _train(rank: int, step: Any, drain: Any, evaluate: Any, args: dict[str, Any]) -> None:
    """The timed loop every mode shares; rank 0 reports its curve."""
    train, _ = _data()
    batches = _batches(train, rank, args["workers"], args["batch"], args["seed"])
    curve: list[tuple[int, float, float]] = []
    elapsed, first = 0.0, None
    start = time.perf_counter()
    for number in range(1, args["steps"] + 1):
        step(*next(batches))
        if first is None:
            first = time.perf_counter() - start
        if number % args["eval_every"] == 0 or number == args["steps"]:
            drain()
            elapsed += time.perf_counter() - start
            curve.append((number, elapsed, evaluate()))
            start = time.perf_counter()
    if rank == 0:
        reached = next((seconds for _, seconds, accuracy in curve if accuracy >= args["target"]), None)
        steps = next((number for number, _, accuracy in curve if accuracy >= args["target"]), None)
        print(MARK + json.dumps({"curve": curve, "time_to_target": reached, "steps_to_target": steps,
                                 "final_accuracy": curve[-1][2], "first_step": first, "train_seconds": elapsed}),
              flush=True)  # fmt: skip


def tandem_job(mode: str, args: dict[str, Any]) -> None:
    import torch

    import tandem.optim
    from tandem import kvstore
    from tandem.trainer import Trainer

    base, _, compression = mode.partition("+")
    if kvstore.is_server():
        sys.exit(kvstore.serve(KINDS[base]))
    torch.set_num_threads(1)
    module, loss_fn = _model(args["seed"])
    trainer = Trainer(module, loss_fn, tandem.optim.SGD(lr=args["lr"], momentum=args["momentum"]),
                      kvstore=KINDS[base], communication=base.removeprefix("collective-"),
                      gradient_compression=compression or None, update_on_kvstore=False, progress=False)  # fmt: skip
    _, test = _data()

    def evaluate() -> float:
        return float(trainer.evaluate(test)["accuracy"])

    _train(trainer.kvstore.rank, trainer.step, trainer.sync, evaluate, args)
    trainer.close()


def ddp_job(mode: str, rank: int, master: str, port: int, args: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist

    from bench.p3 import ddp_wrap

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{master}:{port}", rank=rank, world_size=args["workers"])
    module, loss_fn = _model(args["seed"])
    wrapped = ddp_wrap(module, mode.partition("+")[2])
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=args["lr"], momentum=args["momentum"])
    _, test = _data()

    def step(images: Any, labels: Any) -> None:
        optimizer.zero_grad(set_to_none=True)
        loss_fn(wrapped, images, labels).backward()
        optimizer.step()

    _train(rank, step, lambda: None, lambda: _accuracy(module, test), args)
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
    if mode.partition("+")[0] == "ddp":
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
    base = mode.partition("+")[0]
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
    return {"curve": runs[0]["curve"], "runs": len(runs), "reached_runs": len(hits),
            "time_to_target": median(run["time_to_target"] for run in hits) if reached else None,
            "less_first_step": median(run["time_to_target"] - run["first_step"] for run in hits) if reached else None,
            "steps_to_target": median(run["steps_to_target"] for run in hits) if reached else None,
            "final_accuracy": median(run["final_accuracy"] for run in runs),
            "first_step": median(run["first_step"] for run in runs),
            "train_seconds": median(run["train_seconds"] for run in runs)}  # fmt: skip


def _plot(curves: dict[tuple[str, int], dict[str, dict[str, Any]]], target: float) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(curves), figsize=(7 * len(curves), 5), squeeze=False)
    for axis, ((rate, workers), results) in zip(axes[0], curves.items()):
        for mode, result in results.items():
            style = "--" if mode.startswith("ddp") else ":" if mode.startswith("collective") else "-"
            axis.plot([point[1] for point in result["curve"]], [point[2] for point in result["curve"]], style,
                      label=mode)  # fmt: skip
        axis.axhline(target, color="grey", linewidth=0.8)
        axis.set_ylim(max(0.0, target - 0.2), 1.0)
        axis.set_title(f"digits resnet, {workers} workers, link {rate}")
        axis.set_xlabel("training wall time, s (rank 0, evaluation excluded)")
        axis.set_ylabel("test accuracy")
        axis.legend(fontsize="small", ncol=2)
    figure.tight_layout()
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / "time_to_accuracy.png"
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] in ("--job", "--ddp"):
        rest = sys.argv[2:]
        if sys.argv[1] == "--job":
            tandem_job(rest[0], json.loads(rest[1]))
        else:
            ddp_job(rest[0], int(rest[1]), rest[2], int(rest[3]), json.loads(rest[4]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", nargs="+", default=["100mbit"], help="tc rates, or 'none' for unshaped")
    parser.add_argument("--workers", nargs="+", type=int, default=[2])
    parser.add_argument("--modes", nargs="+", default=None, help="default: every mode (see the docstring)")
    parser.add_argument("--compressions", nargs="+", default=list(COMPRESSIONS), choices=list(COMPRESSIONS))
    parser.add_argument("--target", type=float, default=0.97, help="test accuracy to reach")
    parser.add_argument("--steps", type=int, default=200, help="training steps in every mode")
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--batch", type=int, default=64, help="global batch (split evenly over the workers)")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--seeds", type=int, default=1,
                        help="runs per mode, seeds 0..N-1 (initial weights and sample order), medians reported")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 40 steps, ddp and collective-p3 (+fp16) only; not a measurement")
    args = parser.parse_args()
    modes = args.modes or all_modes(args.compressions)
    if args.quick:
        args.steps, args.eval_every = 40, 10
        modes = args.modes or ["collective-p3", "collective-p3+fp16", "ddp", "ddp+fp16"]
    if args.seeds < 1:
        parser.error("--seeds must be at least 1")
    if any(args.batch % workers for workers in args.workers):
        parser.error(f"--batch {args.batch} must split evenly over --workers {args.workers}")
    curves: dict[tuple[str, int], dict[str, dict[str, Any]]] = {}
    rows, goals = [], []
    for workers in args.workers:
        for rate in args.rates:
            job = {"workers": workers, "batch": args.batch, "steps": args.steps, "eval_every": args.eval_every,
                   "lr": args.lr, "momentum": args.momentum, "target": args.target}  # fmt: skip
            runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in modes}
            for seed in range(args.seeds):  # round-robin: a slow phase of the machine hits every mode alike
                for mode in modes:
                    runs[mode].append(result := run_mode(mode, rate, workers, {**job, "seed": seed}))
                    print(f"{workers} workers, {rate}, {mode}, seed {seed}: time to target {result['time_to_target']}, "
                          f"final accuracy {result['final_accuracy']:.4f}, first step {result['first_step']:.2f} s",
                          flush=True)  # fmt: skip
            results = curves.setdefault((rate, workers), {})
            results.update((mode, _aggregate(mode_runs)) for mode, mode_runs in runs.items())
            # the goal's clock: time to target less the first step (capture), for every mode alike
            reached = {mode: result["less_first_step"] for mode, result in results.items()
                       if result["time_to_target"] is not None}  # fmt: skip
            ddp_reached = [mode for mode in reached if mode.startswith("ddp")]
            best_ddp = min(ddp_reached, key=reached.__getitem__) if ddp_reached else None
            ours = [mode for mode in reached if not mode.startswith("ddp")]
            best_ours = min(ours, key=reached.__getitem__) if ours else None
            for mode, result in results.items():
                seconds = result["time_to_target"]
                ratio = reached[mode] / reached[best_ddp] if mode in reached and best_ddp else "-"
                rows.append([workers, rate, mode, "not reached" if seconds is None else seconds,
                             reached.get(mode, "-"), result["steps_to_target"] or "-", result["final_accuracy"], ratio,
                             result["first_step"], result["train_seconds"]]
                            + ([f"{result['reached_runs']}/{result['runs']}"] if args.seeds > 1 else []))  # fmt: skip
            if best_ddp and best_ours:
                ratio = reached[best_ours] / reached[best_ddp]
                gap = (results[best_ours]["final_accuracy"] - results[best_ddp]["final_accuracy"]) * 100
                met = ratio <= 0.8 and abs(gap) <= 0.5
                goals.append(f"{'met' if met else 'MISSED'}{'' if rate == '100mbit' else ' (goal set for 100mbit)'}: "
                             f"{workers} workers at {rate}: tandem's best ({best_ours}, {reached[best_ours]:.1f} s) "
                             f"reaches {args.target:.0%} in {ratio:.2f}x the time of DDP's best ({best_ddp}, "
                             f"{reached[best_ddp]:.1f} s; first step excluded), target <= 0.8x; final accuracy "
                             f"{results[best_ours]['final_accuracy']:.4f} vs {results[best_ddp]['final_accuracy']:.4f}"
                             f" ({gap:+.2f} points, target within 0.5)")  # fmt: skip
            else:
                goals.append(f"MISSED: {workers} workers at {rate}: the target was not reached by "
                             f"{'DDP' if not best_ddp else 'tandem'} in {args.steps} steps")  # fmt: skip
    table = markdown_table(["workers", "link", "mode", "time to target s", "less first step s", "steps to target",
                            "final accuracy", "vs best ddp (less first step)", "first step s", f"{args.steps} steps s"]
                           + (["runs reaching target"] if args.seeds > 1 else []), rows)  # fmt: skip
    note = (f"digits ResNet (depth 8, width 16), global batch {args.batch}, SGD lr {args.lr} momentum {args.momentum}, "
            f"{args.steps} steps, target test accuracy {args.target}, evaluated every {args.eval_every} steps; "
            "training wall time of rank 0 from its first step (first step and drains included, evaluation "
            "excluded); 'less first step': the same less the first step's time (capture), which the goal and the "
            "ratios use; " + ("one run per mode" if args.seeds == 1 else
                              f"medians of {args.seeds} runs per mode (seeds 0-{args.seeds - 1}), the target counted "
                              "as reached where at least half the runs reached it") + (" (--quick: a smoke run, not a measurement)" if args.quick else ""))  # fmt: skip
    goal_text = "\n".join(f"- {line}" for line in goals)
    report = write_report("time_to_accuracy", f"{note}\n\n{table}\n\nGoal:\n\n{goal_text}")
    plot = _plot(curves, args.target)
    print(f"\n{note}\n{table}\n\nGoal:\n{goal_text}\n\nwritten {report} and {plot}\nreproduce: {command_line()}")


if __name__ == "__main__":
    main()
