"""Which forward values to recompute: the naive rule, Chen's sqrt checkpoints, MXNet's
memory-aware rule and a parametric min-cut for byte budgets. Each returns a set of forward nodes;
mirror_rewrite turns the set into recompute copies.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Iterable

import networkx as nx
import torch.fx as fx

from tandem.graph import cost
from tandem.graph.train_graph import MetaKey
from tandem.passes.mirror_graph import ForwardView

Recomputable = Callable[[fx.Node], bool]
TINY_BYTES = 4096  # values this small (BN/LN statistics) are kept: re-running an op for them gains nothing


def rerunnable(view: ForwardView, expensive_ok: bool) -> Recomputable:
    """The candidate filter: never random ops (a dropout output replayed from its kept mask is not
    random), never free values; expensive ops only if allowed."""

    def check(node: fx.Node) -> bool:
        op = _producer(node)
        if view.is_replayable_dropout(node):
            return node not in view.free
        if node in view.free or cost.is_random(op) or cost.is_batch_norm_statistic(node):
            return False  # BN statistics are kept: a BN copy replays y from them (see mirror_rewrite)
        return expensive_ok or not cost.is_expensive(op)

    return check


def closure(view: ForwardView, seeds: Iterable[fx.Node], can_rerun: Recomputable,
            stop: Callable[[fx.Node], bool] = lambda n: False) -> set[fx.Node]:
    """Every rerunnable value the seeds need, walking inputs until a value that must be kept."""
    mirrored: set[fx.Node] = set()
    pending = [n for n in seeds if can_rerun(n) and not stop(n)]
    while pending:
        node = pending.pop()
        if node in mirrored:
            continue
        mirrored.add(node)
        pending.extend(a for a in view.forward_inputs(node) if can_rerun(a) and not stop(a))
    return mirrored


def checkpointed(view: ForwardView) -> set[fx.Node]:
    """What the model wrapped in ``torch.utils.checkpoint``: every value made inside a region,
    except what leaves it (a region's outputs feed later forward ops and are kept, as eager keeps
    the next region's inputs). Random ops stay kept: their outputs are replayed from the mask."""
    region_of = {n: n.meta[MetaKey.CHECKPOINT] for n in view.forward if MetaKey.CHECKPOINT in n.meta}
    can_rerun = rerunnable(view, expensive_ok=True)

    def inside(node: fx.Node) -> bool:
        region = region_of[node]
        return all(region_of.get(user) == region or view.is_backward(user) for user in node.users)

    return {n for n in region_of if inside(n) and can_rerun(n)}


def naive(view: ForwardView) -> set[fx.Node]:
    """MXNet's old rule: recompute everything the backward needs except expensive and random ops."""
    return closure(view, view.needed, rerunnable(view, expensive_ok=False))


def sqrt_checkpoints(view: ForwardView) -> set[fx.Node]:
    """Chen et al. 2016: cut the forward into ~sqrt(n) segments, keep only what crosses a segment
    boundary (plus random ops' outputs) and recompute the rest of each segment in backward."""
    ops = [n for n in view.forward if not cost.is_view(n) and n.target is not operator.getitem]
    if not ops:
        return set()
    size = max(1, math.ceil(len(ops) / math.ceil(math.sqrt(len(ops)))))
    position = {node: i for i, node in enumerate(ops)}
    segment = {node: position.get(_base_op(node), 0) // size for node in view.forward}

    def crosses(node: fx.Node) -> bool:
        return any(u in segment and segment[u] > segment[node] for u in node.users)

    return closure(view, view.needed, rerunnable(view, expensive_ok=True), stop=crosses)


def _producer(node: fx.Node) -> fx.Node:
    """The op that computes a value: the tuple op for a getitem, the node itself otherwise."""
    source = node.args[0] if node.target is operator.getitem else node
    return source if isinstance(source, fx.Node) else node


def _base_op(node: fx.Node) -> fx.Node:
    while cost.is_view(node) or node.target is operator.getitem:
        node = node.args[0]  # type: ignore[assignment]
    return node


# -- memory-aware (MXNet 2020) -------------------------------------------------------------------


def memory_aware(view: ForwardView) -> set[fx.Node]:
    """MXNet's improved rule: start from the naive set and, frontier group by frontier group,
    stop mirroring a group when storing its outputs releases at least as many bytes as it holds.

    The frontier is the mirrored nodes whose inputs are all kept; a group is frontier nodes that
    share an input (their inputs are released together or not at all). Bytes are real storage
    bytes (shape x dtype, views share their base), so an RNN cell's add/tanh stay stored while a
    broadcast add + tanh over shared keys is recomputed. Backward data dependencies are the real
    ones: a matmul's gradient reads its inputs, so those are what the boundary must provide.
    """
    mirrored = naive(view)
    changed = True
    while changed:
        changed = False
        held_bytes = view.bytes_of(view.held(mirrored))
        for group in _frontier_groups(view, mirrored):
            trial = mirrored - group
            trial_bytes = view.bytes_of(view.held(trial))
            if trial_bytes <= held_bytes:  # released >= held: store the group
                mirrored, held_bytes, changed = trial, trial_bytes, True
    return prune(view, mirrored)


def _frontier_groups(view: ForwardView, mirrored: set[fx.Node]) -> list[set[fx.Node]]:
    # Values recomputed from free inputs alone (masks, zeros) keep no bytes: they never block a frontier.
    constant: set[fx.Node] = set()
    for node in view.forward:
        if node in mirrored and all(a in constant for a in view.forward_inputs(node)):
            constant.add(node)
    frontier = [n for n in view.forward if n in mirrored and n not in constant
                and not any(a in mirrored and a not in constant for a in cost.recompute_inputs(n))]
    parent = {n: n for n in frontier}

    def find(node: fx.Node) -> fx.Node:
        while parent[node] is not node:
            parent[node] = parent[parent[node]]
            node = parent[node]
        return node

    first_reader: dict[fx.Node, fx.Node] = {}
    for node in frontier:
        for source in view.forward_inputs(node):
            root = cost.storage_root(source)
            if root in first_reader:
                parent[find(node)] = find(first_reader[root])
            else:
                first_reader[root] = node
    groups: dict[fx.Node, set[fx.Node]] = {}
    for node in frontier:
        groups.setdefault(find(node), set()).add(node)
    return list(groups.values())


def prune(view: ForwardView, mirrored: set[fx.Node]) -> set[fx.Node]:
    """Keep tiny values, then drop mirrored nodes that gain nothing: views of kept values, and
    values that neither the backward nor another recompute reads."""
    mirrored = {n for n in mirrored if not (n in view.needed and view.bytes_of([n]) <= TINY_BYTES)}
    while True:
        used = {a for n in mirrored for a in cost.recompute_inputs(n)}
        # A view of a kept value costs no bytes either way: recomputing it gains nothing.
        keep = {n for n in mirrored if (n in view.needed or n in used) and not _views_kept(n, mirrored)}
        if keep == mirrored:
            return mirrored
        mirrored = keep


def _views_kept(node: fx.Node, mirrored: set[fx.Node]) -> bool:
    source = cost.alias_source(node)
    return source is not None and source not in mirrored


# -- budgets: parametric min-cut ------------------------------------------------------------------

_INFINITE = float("inf")


def min_cut(view: ForwardView, bytes_per_flop: float) -> set[fx.Node]:
    """The set minimising  kept bytes + bytes_per_flop * recompute flops  exactly (an s-t min-cut).

    PyTorch's partitioner graph: each forward value is split in/out; cutting in->out keeps it
    (cost: its bytes); a node whose "in" lands on the sink side is recomputed (cost: the
    source->in edge, its flops times the price). Backward readers tie values to the sink; random
    ops and free values are pinned to the source. Views and tuple nodes cannot be "kept" on
    their own (their base or elements are), so their in->out edge is infinite.
    """
    can_rerun = rerunnable(view, expensive_ok=True)
    flow = nx.DiGraph()
    for node in view.forward:
        if node in view.free:
            continue
        inner, outer = ("in", node.name), ("out", node.name)
        keep_cost = _INFINITE if cost.is_view(node) or len(view.keys[node]) != 1 else view.bytes_of([node])
        flow.add_edge(inner, outer, capacity=keep_cost)
        rerun_cost = bytes_per_flop * cost.flops(node) + 1e-3 if can_rerun(node) else _INFINITE
        flow.add_edge("source", inner, capacity=rerun_cost)
        if any(view.is_backward(user) for user in node.users):
            flow.add_edge(outer, "sink", capacity=_INFINITE)
        for source in view.forward_inputs(node):  # a recompute of node needs these (kept or recomputed)
            flow.add_edge(("out", source.name), inner, capacity=_INFINITE)
    if "sink" not in flow:
        return set()
    _, (_, sink_side) = nx.minimum_cut(flow, "source", "sink")
    by_name = {n.name: n for n in view.forward}
    return {by_name[name] for kind, name in (x for x in sink_side if isinstance(x, tuple)) if kind == "in"}


def price_sweep(points: int = 12) -> list[float]:
    """Prices (bytes per flop) from "memory at any cost" to "hardly any recompute"."""
    return [0.0] + [10 ** (-4 + 7 * i / (points - 1)) for i in range(points)]
