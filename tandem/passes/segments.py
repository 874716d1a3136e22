"""segments_pass: cut the graph into segments, each run as one engine op (MXNet's op bulking).

Walk op nodes in graph (execution) order; a segment closes when it holds ``cap`` counted nodes or
at the forward/backward boundary. Placeholders (parameters, buffers, inputs) are not nodes here at
all, and ``getitem`` (picking one output of a multi-output op) is not counted: neither costs a
kernel, and cutting or counting at them is what kept MXNet's old segments under 2 nodes. Forward
and backward have separate caps because a backward segment's gradients cannot be sent before the
segment ends: smaller backward segments let communication start earlier.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

from tandem.env import is_set, knob
from tandem.graph.train_graph import MetaKey, Phase, TrainGraph

WHOLE = 2**31 - 1  # a cap no graph reaches: each phase becomes one segment


@dataclass(frozen=True)
class BulkCaps:
    forward: int
    backward: int

    def __post_init__(self) -> None:
        for name, value in (("forward", self.forward), ("backward", self.backward)):
            if value < 1:
                raise ValueError(f"{name} bulk cap must be >= 1 op node, got {value}")


def resolve_caps(bulk: bool | None, bulk_fwd: int | None, bulk_bwd: int | None) -> BulkCaps:
    """Explicit options beat TANDEM_BULK_* env knobs; bulking off (or a cap of 0) means one node per segment."""
    enabled = knob("TANDEM_BULK_TRAIN") if bulk is None else bulk
    shared = knob("TANDEM_BULK_MAX_NODE_TRAIN")

    def cap(explicit: int | None, env_name: str) -> int:
        if not enabled:
            return 1
        value = explicit if explicit is not None else (knob(env_name) if is_set(env_name) and knob(env_name) >= 0 else shared)
        return max(int(value), 1)  # 0 means per-op, like MXNet's profiling setting

    return BulkCaps(cap(bulk_fwd, "TANDEM_BULK_MAX_NODE_TRAIN_FWD"), cap(bulk_bwd, "TANDEM_BULK_MAX_NODE_TRAIN_BWD"))


def counts_toward_size(node: object) -> bool:
    return getattr(node, "target", None) is not operator.getitem


def segments_pass(graph: TrainGraph, config: object) -> TrainGraph:
    """Inference graphs are one segment (nothing to overlap), unless TANDEM_BULK_INFERENCE=0."""
    caps = resolve_caps(getattr(config, "bulk", None), getattr(config, "bulk_fwd", None), getattr(config, "bulk_bwd", None))
    if graph.inference and knob("TANDEM_BULK_INFERENCE"):
        caps = BulkCaps(WHOLE, WHOLE)
    segment, size, phase = -1, 0, None
    for node in graph.op_nodes():
        node_phase = graph.phase_of(node)
        cap = caps.forward if node_phase == Phase.FORWARD else caps.backward
        counted = counts_toward_size(node)
        if node_phase != phase or (counted and size >= cap):
            segment, size, phase = segment + 1, 0, node_phase
        node.meta[MetaKey.SEGMENT] = segment
        size += counted
    graph.notes["segments"] = {"forward_cap": caps.forward, "backward_cap": caps.backward, "segments": segment + 1}
    return graph
