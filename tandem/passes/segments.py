"""segments_pass: cut the graph into segments, each run as one engine op (MXNet's op bulking).

Walk op nodes in graph (execution) order; a segment closes when it holds ``cap`` counted nodes or
at the forward/backward boundary, and (``gradient_cut``, distributed training) after the op that
finishes a gradient of at least that many elements: its segment's gradients leave when the
segment ends, and a large layer's backward is worth an engine op of its own (vgg11 x0.25 kept
its three widest convolutions' gradients in one 18 ms segment, sent together at its end).
Placeholders (parameters, buffers, inputs) are not nodes here at all, and ``getitem`` (picking
one output of a multi-output op) is not counted: neither costs a kernel, and cutting or counting
at them is what kept MXNet's old segments under 2 nodes. Forward
and backward have separate caps because a backward segment's gradients cannot be sent before the
segment ends: smaller backward segments let communication start earlier.

With the inductor backend a phase is one compiled unit, and inductor does not keep a unit's node
order: it fuses and reorders kernels, and recomputed values it produced early lived through much of
the backward (gpt at a budget of 0.4 peaked at 34.2 MiB as one unit against 16.5 MiB planned). So
there a run of recomputed nodes (mirrored, or from a ``torch.utils.checkpoint`` region) starts a new
unit if the current unit already holds ``RECOMPUTE_UNIT_MIN_NODES`` counted nodes, and at least a
``RECOMPUTE_UNITS_MAX``-th of the backward's; a run that comes earlier stays in the unit. Nothing is
computed across a boundary early, and the units stay few and large enough to fuse: a boundary
before every run kept the peak too, at up to a third more step time, and lstm_lm's 3,400 backward
nodes cut into 76 units (it kept its plan as one unit) ran 46 % slower, into 11 units 5 %.

When a memory budget was asked for, the first recompute run of the backward always starts a unit
(whichever plan the budget picked): the loss head's gradient (for a language model the logits'
size, the largest value of the step) is then freed before inductor materialises the recomputed
values, where one unit held both (lstm_lm at a budget of 0.8 peaked at 14.52 MiB without the cut,
13.02 MiB with it). ``mirror="memory-aware"`` keeps its head unit whole, since there the cut cost
memory: every value crossing a boundary is materialised, which raised gpt's peak by 0.5 MiB and
hf-gpt2's by 0.9 MiB.
"""

from __future__ import annotations

import operator

import torch

from tandem.graph.train_graph import MetaKey, Phase, TrainGraph
from tandem.passes.config import WHOLE, BulkCaps, PlanConfig, resolve_caps

__all__ = ["WHOLE", "BulkCaps", "counts_toward_size", "resolve_caps", "segments_pass"]

RECOMPUTE_UNIT_MIN_NODES = 40  # inductor: counted nodes a unit holds before a recompute run may start the next
RECOMPUTE_UNITS_MAX = 10  # ... and 1/this of the backward's nodes: a long backward gets at most about this many units


def counts_toward_size(node: object) -> bool:
    return getattr(node, "target", None) is not operator.getitem


def _numel(node: object) -> int:
    value = getattr(node, "meta", {}).get("val")
    return int(value.numel()) if isinstance(value, torch.Tensor) else 0


def segments_pass(graph: TrainGraph, config: PlanConfig) -> TrainGraph:
    """Inference graphs are one segment (nothing to overlap), unless TANDEM_BULK_INFERENCE=0."""
    caps = BulkCaps(WHOLE, WHOLE) if graph.inference and config.whole_inference else config.caps
    segment, size, phase = -1, 0, None
    keep_recompute_in_place = config.backend == "inductor"  # see the module docstring
    backward_size = sum(1 for n in graph.op_nodes() if graph.phase_of(n) == Phase.BACKWARD and counts_toward_size(n))
    recompute_unit_min = max(RECOMPUTE_UNIT_MIN_NODES, backward_size // RECOMPUTE_UNITS_MAX)
    after_recompute = False  # the last counted node was a recomputation
    head_cut = keep_recompute_in_place and config.mirror.name == "budget"  # cut before the first recompute run
    cut = config.gradient_cut
    large_gradients = {node for node in graph.grads.values() if cut and _numel(node) >= cut}
    after_large_gradient = False  # the next counted node starts a segment
    for node in graph.op_nodes():
        node_phase = graph.phase_of(node)
        cap = caps.forward if node_phase == Phase.FORWARD else caps.backward
        counted = counts_toward_size(node)
        cut_after_gradient = counted and after_large_gradient  # not before a getitem: the op's other outputs stay
        if cut_after_gradient:
            after_large_gradient = False
        recompute = MetaKey.RECOMPUTE_OF in node.meta
        cut_before_recompute = (keep_recompute_in_place and counted and recompute and not after_recompute
                                and (size >= recompute_unit_min or head_cut))  # fmt: skip
        if counted and recompute:  # recomputations are backward nodes: this is the backward's first run
            head_cut = False
        if counted:
            after_recompute = recompute
        if node_phase != phase or (counted and size >= cap) or cut_before_recompute or cut_after_gradient:
            segment, size, phase = segment + 1, 0, node_phase
        node.meta[MetaKey.SEGMENT] = segment
        size += counted
        after_large_gradient = after_large_gradient or node in large_gradients
    graph.notes["segments"] = {"forward_cap": caps.forward, "backward_cap": caps.backward, "segments": segment + 1}
    return graph
