"""``tandem plan``'s work once the CLI has built the model and a batch: plan, print, plot, validate."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

from torch import nn

from tandem.planner.profile import ProfileMismatch
from tandem.planner.search import Plan
from tandem.planner.sim import MODES, Machine


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The cluster, search and output options (the CLI adds the model's own)."""
    parser.add_argument("--workers", type=int, default=16, help="workers (>= 1)")
    parser.add_argument("--servers", type=int, default=4, help="parameter servers (>= 1; 0 only with --modes allreduce collective)")
    parser.add_argument("--link", default="10gbit", help="every host's link rate, each way: 100mbit, 10gbit, 12.5mbps, ...")
    parser.add_argument("--latency-us", type=float, default=50.0, help="one-way latency between two hosts, microseconds")
    parser.add_argument("--colocated", action="store_true",
                        help="each server runs on a worker's machine, sharing its link and cores (MXNet's launch.py, "
                             "BytePS); at most --workers servers")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES, help="the modes to simulate")
    parser.add_argument("--profile", default=None, metavar="JSON",
                        help="use this saved profile instead of profiling (refused if of another model or version)")
    parser.add_argument("--runs", type=int, default=5, help="timed runs of the step when profiling (median per segment)")
    parser.add_argument("--here", action="store_true",
                        help="plan for this machine running every worker and server, sharing its cores with each "
                             "other and with the other work running now (its CPU costs measured once, cached in "
                             "OUT/machine.json, measured again when its speed per torch call moved by > 25%%); "
                             "implied by --validate")
    parser.add_argument("--cores", type=float, default=None,
                        help="cores per host (default: a spare core for every thread; with --here: this machine's)")
    parser.add_argument("--measure", action="store_true",
                        help="measure the CPU costs per message and per byte here (default: measured constants; "
                             "with --here: measure again instead of reading OUT/machine.json)")
    parser.add_argument("--validate", action="store_true",
                        help="also run the predicted baseline/overlap/p3/collective jobs here (tandem launch --netns-rate) "
                             "and compare")
    parser.add_argument("--validate-runs", type=int, default=5, help="--validate: timed runs per job (median)")
    parser.add_argument("--out", default="runs/plan", help="directory for profile.json and plan.png")


def run(args: argparse.Namespace, module: nn.Module, loss_fn: Any, batch: tuple[Any, ...], config: dict[str, Any],
        step_options: dict[str, Any]) -> int:  # fmt: skip
    from tandem.planner.api import plan

    out = Path(args.out)
    if args.colocated and (args.here or args.validate):
        raise SystemExit("tandem plan: --colocated plans a cluster; --here and --validate plan this machine, where "
                         "tandem launch gives every worker and server a link of its own")  # fmt: skip
    machine, measure = None, args.measure
    if args.here or args.validate:
        from tandem.planner.measure import background_threads, this_machine

        here = this_machine(out / "machine.json", refresh=args.measure)  # costs: measured once, cached
        machine, measure = dataclasses.replace(here, background=background_threads()), False  # load: now
    try:
        if args.cores is not None:
            machine = dataclasses.replace(machine or Machine(), cores=args.cores)
        result: Plan = plan(module, loss_fn, batch, name=args.model, saved=args.profile, workers=args.workers,
                            servers=args.servers, rate=args.link, latency_s=args.latency_us * 1e-6, modes=args.modes,
                            machine=machine, measure=measure, runs=args.runs, colocated=args.colocated,
                            **step_options)  # fmt: skip
    except (ProfileMismatch, ValueError, TypeError) as error:
        raise SystemExit(f"tandem plan: {error}") from None
    if args.profile is None:
        print(f"profile written to {result.profile.save(out / 'profile.json')}")
    print(result.report())
    print(f"plot: {result.plot(out / 'plan.png')}")
    if args.validate:
        from tandem.planner.validate import validate

        print(f"\nvalidating: {args.workers} worker(s) + {args.servers} server(s) (collective: none) at {args.link} "
              "on this machine ...",
              flush=True)
        rows = validate(result, args.model, config, args.modes, runs=args.validate_runs)
        print(f"{'mode':<32}{'predicted':>10}{'measured':>10}{'pred/meas':>10}")
        for label, predicted, measured in rows:
            print(f"{label:<32}{predicted:>10.1f}{measured:>10.1f}{predicted / measured:>10.2f}")
    return 0
