"""How close `tandem plan`'s predictions come to real runs on this machine (issue #30).

For every (model, workers + servers, link rate) of the grid: plan for this machine (every worker and
server on this one host, sharing its cores; ``tandem.planner.measure.this_machine``, its costs
measured once and cached), then run baseline, overlap and p3 (a config ``WxS``, S >= 1) or the
collective mode (``Wx0``: no servers) at the plan's knobs as real `tandem launch` jobs
(``tandem.planner.validate.measure``: ``--netns-rate`` shaping, one torch thread per process, SGD
on the servers or, collective, on the workers, median of ``--runs`` runs of ``--steps`` steady-state
steps, the slowest worker's) and compare samples/s. Models and batches are bench/p3.py's. "none" is unshaped (loopback,
planned as 100 Gbit/s links: the per-byte CPU is the limit there).

The constants come from ``measure.py`` and the profile alone; nothing here is fitted to the measured
runs. This machine's speed drifts by tens of percent over minutes (it is shared), so just before each
job the profiled step's segments are timed again (``segment_seconds``, as the profile timed them) and
the plan is made at that speed: ``compute_scale`` = now / when profiled, the same for every segment.
The step is timed again right after the job (``compute_scale_after``); the report also predicts each
job at the speed around it (the geometric mean of the two), which tells the simulator's error from
the machine's drift during the job, and at the profile's speed (no re-timing at all).
Each measured job is appended to ``OUT/jobs.jsonl`` as it ends (with the load average around it), so a
stopped run resumes, and the table is written from whatever has been measured.

Reproduce: python bench/plan_accuracy.py   (options: --models, --configs 2x2 2x1 3x2 3x1 2x0 3x0, --rates, --runs;
--sweep: the recommendation against a p3 knob sweep; --repeat N: one configuration's jobs N times, their spread)
Writes bench/out/plan_accuracy.md and bench/out/plan_accuracy.png.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from anywhere without installing

from bench.common import OUT, command_line, markdown_table, write_report  # noqa: E402
from bench.p3 import MODELS  # noqa: E402
from tandem.planner.sim import PS_MODES  # noqa: E402

MODES: tuple[str, ...] = (*PS_MODES, "collective")  # a config WxS with S >= 1 runs PS_MODES, Wx0 collective
UNSHAPED = "100gbit"  # what the plan assumes for "none" (loopback)


def _profile(model: str, cache: Path) -> Any:
    """The model's profiled step (bench/p3.py's model and batch), cached; profiled again when the cache
    is older than the machine's costs beside it (measured again: the machine's speed moved)."""
    from tandem.planner.profile import Profile, profile

    machine = cache.parent / "machine.json"
    if cache.exists() and not (machine.exists() and machine.stat().st_mtime > cache.stat().st_mtime):
        return Profile.load(cache)
    import torch

    from tandem.models import ZOO

    entry_name, config, batch_size = MODELS[model]
    entry = ZOO[entry_name]
    torch.manual_seed(0)
    module = entry.build(**config)
    batch = entry.make_batch(batch_size, torch.Generator().manual_seed(1), **config)
    found = profile(module, entry.loss_fn, batch, model, runs=20)
    found.save(cache)
    return found


_STEPS: dict[str, tuple[Any, Any]] = {}  # model -> (its compiled step, its batch), built once


def compute_now(model: str, runs: int = 20) -> float:
    """Seconds of the model's step (bench/p3.py's model and batch) on one thread now: its segments timed as
    ``profile`` times them."""
    import torch

    from tandem.models import ZOO
    from tandem.planner.profile import segment_seconds
    from tandem.step import compile as compile_step

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        if model not in _STEPS:
            entry_name, config, batch_size = MODELS[model]
            entry = ZOO[entry_name]
            torch.manual_seed(0)
            batch = entry.make_batch(batch_size, torch.Generator().manual_seed(1), **config)
            step = compile_step(entry.build(**config), entry.loss_fn, *batch)
            step(*batch)  # capture and plan
            _STEPS[model] = (step, batch)
        return sum(segment_seconds(*_STEPS[model], runs=runs, warmup=1))
    finally:
        torch.set_num_threads(previous)


def _key(model: str, workers: int, servers: int, rate: str, mode: str) -> str:
    return f"{model} {workers}x{servers} {rate} {mode}"


def run_grid(args: argparse.Namespace, out: Path) -> list[dict[str, Any]]:
    from tandem.planner.measure import background_threads, this_machine
    from tandem.planner.search import Target, search
    from tandem.planner.validate import Job, knob_env, measure

    machine = this_machine(out / "machine.json")
    print(f"machine: {machine.describe()}", flush=True)
    log = out / "jobs.jsonl"
    done = {}
    if log.exists():
        for line in log.read_text().splitlines():
            row = json.loads(line)
            done[_key(row["model"], row["workers"], row["servers"], row["rate"], row["mode"])] = row
    costs = dataclasses.asdict(machine)
    elsewhere = [row for row in done.values() if row.get("machine", costs) != costs]
    if elsewhere:  # a resumed grid after the machine's costs were measured again
        print(f"warning: {log} holds {len(elsewhere)} jobs planned with other machine costs (another state of "
              f"the machine); each keeps its own costs, but to validate in one state delete {log} and run again",
              flush=True)  # fmt: skip
    configs = [tuple(int(n) for n in c.split("x")) for c in args.configs]
    for workers, servers in configs:
        for model in args.models:
            found = _profile(model, out / f"profile_{model}.json")
            entry_name, config, batch_size = MODELS[model]
            modes = PS_MODES if servers else ("collective",)
            for rate in args.rates:
                for mode in modes:
                    key = _key(model, workers, servers, rate, mode)
                    if key in done:
                        continue
                    background = background_threads()  # other work on the machine, just before the job
                    scale = compute_now(model) / found.compute_s  # the machine's speed now against the profile's
                    target = Target(workers, servers, UNSHAPED if rate == "none" else rate, modes=modes,
                                    compressions=(), machine=dataclasses.replace(machine, background=background),
                                    sweep=False)  # fmt: skip
                    predicted = search(found.scaled(scale), target).prediction(mode)
                    assert predicted is not None
                    strategy = predicted.strategy
                    env = knob_env(strategy)
                    job = Job(entry_name, config, batch_size, mode, runs=args.runs, steps=args.steps)
                    start, load = time.time(), os.getloadavg()[0]
                    try:
                        measured = measure(job, workers, servers, rate, env)
                    except (RuntimeError, OSError) as error:  # one failed job does not end the grid
                        print(f"{key}: failed: {str(error)[-500:]}", flush=True)
                        continue
                    row = {"model": model, "workers": workers, "servers": servers, "rate": rate, "mode": mode,
                           "machine": costs, "label": strategy.label, "predicted": predicted.samples_per_s,
                           "measured": measured.samples_per_s, "worker_cpu": measured.worker_cpu_s,
                           "server_cpu": measured.server_cpu_s, "worker_threads": measured.worker_threads,
                           "compute_scale": scale, "profile_compute_s": found.compute_s,
                           "seconds": time.time() - start, "load_before": load, "load_after": os.getloadavg()[0],
                           "background": background, "background_after": background_threads(),
                           "ordered": strategy.ordered}  # fmt: skip
                    row["compute_scale_after"] = compute_now(model) / found.compute_s  # and its speed right after
                    done[key] = row
                    with log.open("a") as f:
                        f.write(json.dumps(row) + "\n")
                    print(f"{key}: {strategy.label} predicted {row['predicted']:.1f} measured {row['measured']:.1f} "
                          f"({row['predicted'] / row['measured']:.2f}) in {row['seconds']:.0f} s, background {background:.1f} "
                          f"-> {row['background_after']:.1f}, compute x{scale:.2f} -> x{row['compute_scale_after']:.2f} "
                          f"of the profile's",
                          flush=True)  # fmt: skip
    return list(done.values())


def sweep(args: argparse.Namespace, out: Path) -> str:
    """P3 at the plan's recommended knobs vs a sweep of slice size and water mark, all as the same jobs."""
    from tandem.planner.measure import background_threads, this_machine
    from tandem.planner.search import Target, search
    from tandem.planner.validate import Job, measure

    model, rate = args.sweep_model, args.sweep_rate
    workers, servers = (int(n) for n in args.sweep_config.split("x"))
    entry_name, config, batch_size = MODELS[model]
    target = Target(workers, servers, UNSHAPED if rate == "none" else rate, modes=("p3",), compressions=(),
                    machine=dataclasses.replace(this_machine(out / "machine.json"), background=background_threads()),
                    sweep=False)  # fmt: skip
    plan = search(_profile(model, out / f"profile_{model}.json"), target)
    chosen = plan.prediction("p3")
    assert chosen is not None
    knobs = (chosen.strategy.slice_size, chosen.strategy.water_mark)
    points = [(size, 10) for size in (5_000, 10_000, 20_000, 40_000, 160_000)] + [(40_000, m) for m in (1, 4, 40)]
    rows: list[list[Any]] = []
    best = 0.0
    for size, mark in [knobs, *(p for p in points if p != knobs)]:
        env = {"TANDEM_KVSTORE_SLICE_THRESHOLD": str(size), "TANDEM_PS_WATER_MARK": str(mark)}
        measured = measure(Job(entry_name, config, batch_size, "p3", runs=args.runs, steps=args.steps), workers,
                           servers, rate, env).samples_per_s  # fmt: skip
        best = max(best, measured)
        rows.append([size, mark, "recommended" if (size, mark) == knobs else "", measured])
        print(rows[-1], flush=True)
    text = markdown_table(["slice size", "water mark", "", "measured samples/s"], rows)
    return (f"p3 on {model}, {workers} workers + {servers} servers at {rate}: the plan recommends {knobs[0]} "
            f"elements, water mark {knobs[1]} ({chosen.samples_per_s:.0f} samples/s predicted); measured "
            f"{rows[0][3]:.1f} samples/s, {float(rows[0][3]) / best:.0%} of the best point swept\n\n{text}")


def repeat(args: argparse.Namespace) -> str:
    """The same jobs measured again and again (modes interleaved), with this machine's speed per small
    torch call before and after each: how far one job's measurement moves on its own."""
    from tandem.planner.measure import dispatch_seconds
    from tandem.planner.validate import Job, measure

    model, rate = args.sweep_model, args.sweep_rate
    workers, servers = (int(n) for n in args.sweep_config.split("x"))
    entry_name, config, batch_size = MODELS[model]
    env = {"p3": {"TANDEM_KVSTORE_SLICE_THRESHOLD": "320000", "TANDEM_PS_WATER_MARK": "160"}}  # the unshaped plan's
    found: dict[str, list[float]] = {mode: [] for mode in PS_MODES}
    rows: list[list[Any]] = []
    for number in range(args.repeat):
        for mode in PS_MODES:  # the --sweep-config's servers: the parameter-server modes
            before = dispatch_seconds()
            measured = measure(Job(entry_name, config, batch_size, mode, runs=args.runs, steps=args.steps), workers,
                               servers, rate, env.get(mode, {})).samples_per_s  # fmt: skip
            after = dispatch_seconds()
            found[mode].append(measured)
            rows.append([number + 1, mode, f"{measured:.1f}", f"{before * 1e6:.2f} / {after * 1e6:.2f}"])
            print(rows[-1], flush=True)
    spread = [[mode, f"{min(v):.1f}", f"{max(v):.1f}", f"{max(v) / min(v):.2f}"] for mode, v in found.items()]
    return (f"{model}, {workers} workers + {servers} servers at {rate}, each job {args.repeat} times (modes "
            f"interleaved; p3 at 320k elements, water mark 160):\n\n"
            + markdown_table(["mode", "lowest samples/s", "highest", "highest / lowest"], spread) + "\n\n"
            + markdown_table(["pass", "mode", "measured samples/s", "us per torch call before / after"], rows))


def resimulate(row: dict[str, Any], out: Path, background: float = 0.0, costs: Any = None,
               scale: float | None = None) -> Any:  # fmt: skip
    """The current simulator's prediction of ``row``'s job at its knobs, with ``background`` threads of
    other work (0: had the machine had no other work), at the costs it was planned with (or ``costs``,
    a ``Machine``) and the compute speed measured before it (or the profile's times ``scale``)."""
    from tandem.planner.measure import load
    from tandem.planner.profile import Profile
    from tandem.planner.search import parse_rate
    from tandem.planner.sim import Cluster, Machine, Strategy, simulate

    if costs is None:
        costs = Machine(**row["machine"]) if "machine" in row else load(out / "machine.json")  # as it was planned
    machine = dataclasses.replace(costs, background=background)
    knobs = re.match(r"(?:p3|collective) \((\d+)k, wm (\d+)\)", row["label"])
    # a job recorded without "ordered" ran before the collective store's ordered sends: in rounds
    ordered = bool(row.get("ordered", False))
    strategy = (Strategy(row["mode"], int(knobs[1]) * 1000, int(knobs[2]), ordered=ordered) if knobs
                else Strategy(row["mode"], ordered=ordered))  # fmt: skip
    cluster = Cluster(row["workers"], row["servers"], parse_rate(UNSHAPED if row["rate"] == "none" else row["rate"]),
                      machine=machine)  # fmt: skip
    scale = row.get("compute_scale", 1.0) if scale is None else scale
    profiled = Profile.load(out / f"profile_{row['model']}.json")
    # the scales are against the profile the job was planned with: a profile taken since is rescaled to it
    workload = profiled.scaled(scale * row.get("profile_compute_s", profiled.compute_s) / profiled.compute_s).workload()
    return simulate(workload, cluster, strategy)


def _stats(errors: list[float]) -> list[str]:
    absolute = [abs(e) for e in errors]
    return [f"{statistics.median(absolute):.0%}", f"{max(absolute):.0%}"]


def report(rows: list[dict[str, Any]], args: argparse.Namespace, out: Path, costs: Any = None) -> str:
    order = {m: i for i, m in enumerate(MODES)}
    rows = sorted(rows, key=lambda r: (r["model"], r["workers"], r["servers"], args.rates.index(r["rate"])
                                       if r["rate"] in args.rates else 9, order[r["mode"]]))  # fmt: skip
    errors = [r["predicted"] / r["measured"] - 1 for r in rows]
    around = [resimulate(r, out, r["background"], costs, scale=around_scale(r)) for r in rows]
    arounds = [p.samples_per_s for p in around]
    around_errors = [a / r["measured"] - 1 for r, a in zip(rows, arounds)]
    stale = [resimulate(r, out, r["background"], costs, scale=1.0).samples_per_s / r["measured"] - 1 for r in rows]
    table = markdown_table(["model", "workers + servers", "link", "mode", "predicted samples/s", "measured",
                            "error", "compute speed before / after (x profile)", "other threads before / after",
                            "predicted at the speed around the job", "its error"],
                           [[r["model"], f"{r['workers']} + {r['servers']}", r["rate"], r["label"], r["predicted"],
                             r["measured"], f"{e:+.0%}", _speeds(r),
                             f"{r['background']:.1f} / {r['background_after']:.1f}", a, f"{ae:+.0%}"]
                            for r, e, a, ae in zip(rows, errors, arounds, around_errors)])  # fmt: skip
    groups = [(m, [i for i, r in enumerate(rows) if r["mode"] == m]) for m in MODES]
    groups += [(f"{m} (all modes)", [i for i, r in enumerate(rows) if r["model"] == m]) for m in MODELS]
    groups += [(f"at {rate}", [i for i, r in enumerate(rows) if r["rate"] == rate]) for rate in args.rates]
    groups.append(("all", list(range(len(rows)))))
    summary = [[name, len(index), *_stats([errors[i] for i in index]), *_stats([around_errors[i] for i in index]),
                *_stats([stale[i] for i in index])] for name, index in groups if index]  # fmt: skip
    return (markdown_table(["cases", "jobs", "median abs. error", "worst abs. error",
                            "median, at the speed around the job", "worst, at the speed around the job",
                            "median, at the profile's speed", "worst, at the profile's speed"],
                           summary) + "\n\n" + drift(rows, around) + "\n\n" + table + cpu_table(rows, out, costs))  # fmt: skip


def drift(rows: list[dict[str, Any]], around: list[Any]) -> str:
    """How far the machine's speed moved under the jobs: the step timed right before and right after each
    job, and a worker's compute thread's CPU per step in the job against the profiled step at the
    speed around it (``around``: each row's prediction at that speed; the same step's work, by mode)."""
    timed = [(r, p) for r, p in zip(rows, around) if "compute_scale_after" in r]
    if not timed:
        return ""
    moves = [r["compute_scale_after"] / r["compute_scale"] for r, _ in timed]
    moved = sum(abs(m - 1) > 0.2 for m in moves)
    text = (f"The machine's speed under the jobs: the step timed right after a job took x{min(moves):.2f} to "
            f"x{max(moves):.2f} the time it took right before it; in {moved} of {len(timed)} jobs it moved by more "
            f"than 20 %.")  # fmt: skip
    ratios: dict[str, list[float]] = {}
    for r, predicted in timed:
        in_job = r.get("worker_threads", {}).get("tandem-compute")
        if in_job:
            ratios.setdefault(r["mode"], []).append(in_job / predicted.compute_s)
    if ratios:
        text += (" A worker's compute thread spent, per step, this many times the profiled step at the speed "
                 "around the job (median, range): " + "; ".join(
                     f"{mode} {statistics.median(v):.2f} ({min(v):.2f}-{max(v):.2f})" for mode, v in ratios.items()) + ".")
    return text


def around_scale(row: dict[str, Any]) -> float:
    """The compute speed around ``row``'s job (x the profile's time): the geometric mean of the speeds
    timed just before and just after it (before only, for rows that lack the after)."""
    before = row.get("compute_scale", 1.0)
    return math.sqrt(before * row.get("compute_scale_after", before))


def _speeds(row: dict[str, Any]) -> str:
    before = row.get("compute_scale")
    after = row.get("compute_scale_after")
    return "-" if before is None else f"{before:.2f} / " + ("-" if after is None else f"{after:.2f}")


def cpu_table(rows: list[dict[str, Any]], out: Path, costs: Any = None) -> str:
    """Per job that recorded it, the CPU one worker and one server spent per step against what the
    simulator charges them (at the job's knobs and other work): where a samples/s error comes from."""
    rows = [r for r in rows if "worker_cpu" in r]
    if not rows:
        return ""
    found = [resimulate(r, out, r["background"], costs) for r in rows]

    def pair(predicted: float, measured: float | None) -> list[Any]:
        return ["-", "-"] if measured is None or not predicted else [f"{predicted * 1e3:.1f} / {measured * 1e3:.1f}",
                                                                     f"{predicted / measured - 1:+.0%}"]  # fmt: skip

    def threads(row: dict[str, Any]) -> str:  # a worker's threads that spent at least 0.1 ms per step
        spent = sorted(row.get("worker_threads", {}).items(), key=lambda item: -item[1])
        return ", ".join(f"{name} {seconds * 1e3:.1f}" for name, seconds in spent if seconds >= 1e-4)

    table = markdown_table(["model", "workers + servers", "link", "mode", "profiled compute ms",
                            "worker CPU ms/step, predicted / measured", "error", "server CPU ms/step", "error",
                            "a worker's threads, ms/step"],
                           [[r["model"], f"{r['workers']} + {r['servers']}", r["rate"], r["label"],
                             f"{p.compute_s * 1e3:.1f}", *pair(p.worker_cpu_s, r["worker_cpu"]),
                             *pair(p.server_cpu_s, r["server_cpu"]), threads(r)] for r, p in zip(rows, found)])  # fmt: skip
    return ("\n\nCPU per step (all threads of a process; worker: mean over the workers, server: over the servers; "
            "median over the runs) against the simulator's charge:\n\n" + table)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(5.5, 5))
    markers = {"vgg": "o", "resnet": "s"}
    for mode in MODES:
        for model, marker in markers.items():
            points = [(r["measured"], r["predicted"]) for r in rows if r["mode"] == mode and r["model"] == model]
            if points:
                axis.scatter(*zip(*points), marker=marker, label=f"{mode} ({model})", alpha=0.8)
    low = min(min(r["measured"], r["predicted"]) for r in rows) * 0.8
    high = max(max(r["measured"], r["predicted"]) for r in rows) * 1.2
    axis.plot([low, high], [low, high], color="gray")
    for share, style in ((0.1, "--"), (0.2, ":")):
        for sign in (1, -1):
            axis.plot([low, high], [low * (1 + sign * share), high * (1 + sign * share)], color="gray",
                      linestyle=style, linewidth=0.8)  # fmt: skip
    axis.set(xscale="log", yscale="log", xlim=(low, high), ylim=(low, high), xlabel="measured samples/s",
             ylabel="predicted samples/s", title="tandem plan on this machine (lines: 0, 10, 20 %)")  # fmt: skip
    axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--configs", nargs="+", default=["2x2", "2x1", "3x2", "3x1", "2x0", "3x0"],
                        help="WORKERSxSERVERS (x0: the collective mode, no servers)")
    parser.add_argument("--rates", nargs="+", default=["100mbit", "1gbit", "none"], help="tc rates, or 'none'")
    parser.add_argument("--runs", type=int, default=5, help="runs per job (median; >= 5)")
    parser.add_argument("--steps", type=int, default=4, help="steps per run")
    parser.add_argument("--sweep", action="store_true", help="instead: the recommendation vs a p3 knob sweep")
    parser.add_argument("--sweep-model", default="vgg", choices=list(MODELS))
    parser.add_argument("--sweep-rate", default="100mbit")
    parser.add_argument("--sweep-config", default="2x2")
    parser.add_argument("--repeat", type=int, default=0, metavar="N",
                        help="instead: measure the --sweep-model/-config/-rate jobs N times each (their spread)")
    parser.add_argument("--report-only", action="store_true", help="write the table from OUT/plan_accuracy/jobs.jsonl")
    parser.add_argument("--repredict", action="store_true",
                        help="with --report-only: predict each recorded job again with the current simulator, at "
                             "the knobs it ran (the planner may now choose others) and its recorded other work")  # fmt: skip
    parser.add_argument("--machine", type=Path, default=None, metavar="PATH",
                        help="with --repredict: every job at the costs saved in PATH (python -m "
                             "tandem.planner.measure PATH measures them), not the ones it was planned with")  # fmt: skip
    args = parser.parse_args()
    if args.runs < 5:
        parser.error("--runs must be >= 5 (medians of at least 5 runs)")
    if args.repredict and not args.report_only:
        parser.error("--repredict re-predicts recorded jobs: use it with --report-only")
    if args.machine is not None and not args.repredict:
        parser.error("--machine gives --repredict its costs: use it with --report-only --repredict")
    out = OUT / "plan_accuracy"
    for directory in (out, OUT / "plan_sweep"):
        directory.mkdir(parents=True, exist_ok=True)
    if args.repeat:
        text = repeat(args)
        print(f"\n{text}\n\nwritten {write_report('plan_repeat', text)}\nreproduce: {command_line()}")
        return
    if args.sweep:  # its own caches: a sweep in another state of the machine leaves the grid's profiles as they were
        text = sweep(args, OUT / "plan_sweep")
        print(f"\n{text}\n\nwritten {write_report('plan_sweep', text)}\nreproduce: {command_line()}")
        return
    from tandem.planner.measure import load
    from tandem.planner.sim import Machine

    costs = None if args.machine is None else load(args.machine)  # --repredict --machine: every job at these
    if args.report_only:
        rows = [json.loads(line) for line in (out / "jobs.jsonl").read_text().splitlines()]
        if args.repredict:
            rows = [{**row, "predicted": resimulate(row, out, row["background"], costs).samples_per_s} for row in rows]
    else:
        rows = run_grid(args, out)
    planned = {json.dumps(row["machine"], sort_keys=True) for row in rows if "machine" in row}
    machine = costs or (Machine(**json.loads(planned.pop())) if len(planned) == 1 else load(out / "machine.json"))
    text = report(rows, args, out, costs)
    note = (f"`tandem plan` predicted vs measured samples/s on this machine ({machine.describe()}); error = "
            f"predicted / measured - 1; other threads: runnable threads of other work on the machine in the 2 s "
            f"before the job (the plan's Machine.background) and after it")  # fmt: skip
    path = write_report("plan_accuracy", f"{note}\n\n{text}")
    plot(rows, OUT / "plan_accuracy.png")
    print(f"\n{note}\n\n{text}\n\nwritten {path} and {OUT / 'plan_accuracy.png'}\nreproduce: {command_line()}")


if __name__ == "__main__":
    main()
