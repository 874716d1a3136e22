"""``tandem.plan(...)``: profile (or read) one step, simulate the cluster, recommend a mode and knobs."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torch import nn

from tandem.passes.config import distributed_gradient_cut
from tandem.planner.profile import Profile, describe, profile
from tandem.planner.search import Plan, Target, search
from tandem.planner.sim import MODES, Machine


def plan(model: nn.Module | Profile | str | Path, loss_fn: Any = None, batch: Sequence[Any] | None = None, *,
         name: str = "model", saved: str | Path | None = None, workers: int = 16, servers: int = 4,
         rate: str | float = "10gbit", latency_s: float = 50e-6, modes: Sequence[str] = MODES,
         machine: Machine | None = None, measure: bool = False, sweep: bool = True, runs: int = 5,
         colocated: bool = False, **step_options: Any) -> Plan:  # fmt: skip
    """Predict samples/s of data-parallel training on ``workers`` workers and ``servers`` servers whose
    links move ``rate`` each way, per communication mode, and recommend one with its knobs.

    ``model``: a module (with ``loss_fn`` and one worker's ``batch``: profiled here, with
    ``step_options`` for ``tandem.compile``), a ``Profile``, or the path of a saved one. ``saved``: a
    saved profile to use for ``model`` instead of profiling it, refused (``ProfileMismatch``, naming
    what differs) unless it is of this ``name``, model and tandem version. ``machine``: the hosts' CPU
    costs, cores and placement (default ``Machine()``: measured costs, a spare core for every thread;
    ``tandem.planner.measure.this_machine()``: this machine running every worker and server).
    ``measure``: measure the CPU costs on this machine instead of ``machine``'s (keeping its cores
    and placement). ``colocated``: each server runs on a worker's machine, sharing its link and
    cores (MXNet's ``launch.py``, BytePS): at most ``workers`` servers.

    Example:
        ```python
        result = tandem.plan(model, loss_fn, (x, y), name="vgg", workers=16, servers=4, rate="10gbit")
        print(result.report())                 # the table, the recommendation
        result.plot("plan.png")                # samples/s vs workers and vs link rate
        result.best.strategy                   # Strategy(mode='p3', slice_size=..., water_mark=...)
        ```
    """
    target = Target(workers, servers, rate, latency_s, tuple(modes), machine=machine or Machine(),
                    sweep=sweep, colocated=colocated)  # checked before any profiling
    if isinstance(model, Profile):
        found = model
    elif isinstance(model, str | Path):
        found = Profile.load(model)
    else:
        if loss_fn is None or batch is None:
            raise TypeError("tandem.plan(module, loss_fn, batch): a module needs its loss_fn and one worker's batch")
        if saved is not None:
            found = Profile.load(saved)
            parameters, shapes, fingerprint = describe(model, batch)
            found.check(name, fingerprint, parameters, shapes)
        else:
            # segments as a distributed Trainer cuts them (every mode the planner weighs sends gradients)
            cut = distributed_gradient_cut(step_options.pop("bulk_cut_gradient", None))
            found = profile(model, loss_fn, batch, name, runs=runs, bulk_cut_gradient=cut, **step_options)
    if measure:  # else machine's costs
        from tandem.planner.measure import measure_machine

        here = dataclasses.replace(measure_machine(), cores=target.machine.cores, shared_host=target.machine.shared_host)
        target = dataclasses.replace(target, machine=here)
    return search(found, target)
