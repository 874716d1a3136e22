"""Backward mirroring: recompute some forward values during backward instead of keeping them.

    tandem.compile(model, loss_fn, x, y, mirror="memory-aware")   # or TANDEM_MIRROR=memory-aware

Policies (see docs/mirroring.md):
  off           keep everything the backward reads (the default)
  all           the naive rule: recompute every value not produced by an expensive or random op
  sqrt          Chen et al. 2016: keep ~sqrt(n) segment boundaries, recompute the rest
  memory-aware  MXNet's improved rule: mirror a group only if that lowers the bytes kept
  0.4 / "300MB" a budget (fraction of the off plan's peak, or bytes): the least recompute flops
                whose peak fits, chosen from a parametric min-cut sweep by simulated peak

The pass only plans. Recompute copies are backward nodes placed just before their first reader,
marked ``MetaKey.RECOMPUTE_OF``; the executor then measures the real peak. What was decided goes
to ``graph.notes["memory"]`` (and from there into ``TrainStep.memory_report()``; the estimate
under every policy, ``saved_bytes_by_policy``, is computed there, when first read).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch.fx as fx

from tandem.graph.train_graph import Deferred, TrainGraph
from tandem.passes import mirror_select as select
from tandem.passes.config import MirrorPolicy, PlanConfig
from tandem.passes.mirror_graph import ForwardView
from tandem.passes.mirror_rewrite import (
    Share,
    SimulatedMemory,
    insert_recompute,
    share_all,
    share_expensive,
    simulate,
)

log = logging.getLogger("tandem")



@dataclass
class Plan:
    """One candidate: the values to recompute, and what recomputing them costs and saves."""

    graph: TrainGraph
    mirrored: set[str]
    recompute_flops: int
    memory: SimulatedMemory


def mirror_pass(graph: TrainGraph, config: PlanConfig) -> TrainGraph:
    """Plan recomputation for ``config.mirror``; returns a new graph (the input is not changed).

    Checkpoint regions the capture marked are recomputed whatever the policy (the user asked for
    it); the policy plans the rest. "off" then means: nothing beyond the regions.
    """
    policy = config.mirror
    view = ForwardView(graph)
    regions = select.checkpointed(view)
    base = build(graph, regions, share_all)  # no regions: the graph as it is
    notes: dict[str, Any] = {"policy": str(policy), "estimated_peak_bytes_off": base.memory.peak_bytes}
    if regions:
        notes["checkpointed"] = len(regions)
    if policy.name == "off":
        plan = base
    elif policy.name == "budget":
        plan = _fit_budget(graph, view, policy, base, regions, notes)
    else:
        plan = _named(graph, view, policy.name, regions)
        if policy.name == "memory-aware" and plan.memory.peak_bytes > base.memory.peak_bytes:
            notes["fell_back_to_off"] = True  # the rule's byte check is local; the peak is global
            plan = base
    notes.update(
        recompute_flops=plan.recompute_flops,
        mirrored=len(plan.mirrored),
        estimated_peak_bytes=plan.memory.peak_bytes,
        # runs every policy's selection: only on request. Until then it keeps the unplanned graph (its nodes and fake
        # values, no data) alive where mirroring copied it
        saved_bytes_by_policy=Deferred(lambda: _saved_by_policy(view)),
    )
    plan.graph.notes["memory"] = {**plan.graph.notes.get("memory", {}), **notes}
    return plan.graph


def _named(graph: TrainGraph, view: ForwardView, name: str, regions: set[fx.Node]) -> Plan:
    if name == "all":
        return build(graph, select.naive(view) | regions, share_all)
    if name == "sqrt":
        return build(graph, select.sqrt_checkpoints(view) | regions, share_all)
    return build(graph, select.memory_aware(view) | regions, share_expensive)


def build(graph: TrainGraph, mirrored: set[fx.Node], share: Share) -> Plan:
    """Apply a decision to a copy of the graph and simulate its memory."""
    names = {n.name for n in mirrored}
    if not names:
        return Plan(graph, names, 0, simulate(graph))
    planned = graph.clone()
    flops = insert_recompute(planned, names, share)
    return Plan(planned, names, flops, simulate(planned))


def _fit_budget(graph: TrainGraph, view: ForwardView, policy: MirrorPolicy, off: Plan, regions: set[fx.Node],
                notes: dict[str, Any]) -> Plan:
    """The least recompute whose simulated peak fits; candidates from a parametric min-cut sweep.

    Min-cut is exact for "kept bytes + price x flops"; sweeping the price traces the trade-off
    curve, and simulating each point checks the real objective (the peak, which is not additive).
    Each cut is tried with recompute copies shared (Chen-style) and redone per reader; the
    memory-aware and sqrt plans join the pool, so a budget is never worse than either. Every
    candidate recomputes the checkpoint regions too; the budget is a fraction of ``off``'s peak.
    """
    budget = policy.budget_bytes if policy.budget_bytes is not None else int(policy.fraction * off.memory.peak_bytes)  # type: ignore[operator]
    cuts = [select.min_cut(view, price) for price in select.price_sweep()]
    decisions: list[tuple[set[fx.Node], Share]] = [(set(), share_all), (select.memory_aware(view), share_expensive),
                                                   (select.sqrt_checkpoints(view), share_all)]
    decisions += [(cut, share) for cut in cuts for share in (share_expensive, share_all)]
    plans: dict[tuple[frozenset[str], Share], Plan] = {}
    for decision, share in decisions:
        decision = decision | regions
        key = (frozenset(n.name for n in decision), share)
        if key not in plans:
            plans[key] = build(graph, decision, share)
    fitting = [p for p in plans.values() if p.memory.peak_bytes <= budget]
    if fitting:
        plan = min(fitting, key=lambda p: (p.recompute_flops, p.memory.peak_bytes))
    else:
        plan = min(plans.values(), key=lambda p: (p.memory.peak_bytes, p.recompute_flops))
        log.warning("tandem: no mirroring plan fits the budget of %d bytes; the smallest peak found is %d bytes "
                    "(raise the budget or the batch is too large)", budget, plan.memory.peak_bytes)
    notes.update(budget_bytes=budget, budget_met=bool(fitting), plans_considered=len(plans))
    return plan


def _saved_by_policy(view: ForwardView) -> dict[str, int]:
    """Estimated activation bytes kept from forward to backward under each named policy."""
    decisions = {
        "off": set(),
        "all": select.naive(view),
        "sqrt": select.sqrt_checkpoints(view),
        "memory-aware": select.memory_aware(view),
    }
    return {name: view.bytes_of(view.held(decision)) for name, decision in decisions.items()}
