"""The facts mirroring decisions are made from: which forward values the backward reads, who
consumes what, which storages a value keeps alive, and what they weigh.

Memory is counted per *storage* (a view keeps its base alive; a tuple output holds each element),
exactly as the executor's meter counts it, so a plan's estimate and its measurement agree.
Placeholders (parameters, buffers, batch) and graph outputs (loss, buffer updates) are *free*:
they are held for the whole step anyway, so keeping them costs nothing and recomputing them
gains nothing.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from tandem.graph import cost
from tandem.graph.train_graph import Phase, TrainGraph

StorageKey = tuple[str, int]  # (name of the node that allocated it, output index)


@dataclass
class ForwardView:
    """Read-only analysis of a TrainGraph's forward/backward boundary. Build once per graph."""

    graph: TrainGraph
    forward: list[fx.Node] = field(default_factory=list)  # forward op nodes in execution order
    needed: set[fx.Node] = field(default_factory=set)  # forward values some backward node reads
    free: set[fx.Node] = field(default_factory=set)  # values held all step anyway
    keys: dict[fx.Node, list[StorageKey]] = field(default_factory=dict)
    key_bytes: dict[StorageKey, int] = field(default_factory=dict)
    _forward_inputs: dict[fx.Node, tuple[fx.Node, ...]] = field(default_factory=dict)  # memo: selection asks often

    def __post_init__(self) -> None:
        graph = self.graph
        outputs = set(graph.outputs())
        for node in graph.graph.nodes:
            if node.op == "placeholder":
                self.free.add(node)
            elif node.op == "call_function":
                self.keys[node] = storage_keys(node, self.key_bytes)
                if graph.phase_of(node) == Phase.FORWARD:
                    self.forward.append(node)
        for node in self.forward:
            root = cost.storage_root(node)
            if node in outputs or root in self.free or root in outputs:
                self.free.add(node)
            if any(self.is_backward(user) for user in node.users):
                self.needed.add(node)

    def is_backward(self, node: fx.Node) -> bool:
        return node.op == "call_function" and self.graph.phase_of(node) == Phase.BACKWARD

    def forward_inputs(self, node: fx.Node) -> tuple[fx.Node, ...]:
        """Inputs that are forward op values a recompute would need (free ones excluded)."""
        inputs = self._forward_inputs.get(node)
        if inputs is None:
            inputs = tuple(a for a in cost.recompute_inputs(node) if a.op == "call_function" and a not in self.free)
            self._forward_inputs[node] = inputs
        return inputs

    def is_replayable_dropout(self, node: fx.Node) -> bool:
        """A dropout output that a recompute can replay from a mask the backward keeps anyway."""
        replay = cost.dropout_replay(node)
        return replay is not None and replay[1] in self.needed

    def bytes_of(self, nodes: set[fx.Node] | list[fx.Node]) -> int:
        """Bytes of the distinct storages the given values keep alive."""
        keys = {k for n in nodes if n not in self.free for k in self.keys.get(n, [])}
        return sum(self.key_bytes[k] for k in keys)

    def held(self, mirrored: set[fx.Node]) -> set[fx.Node]:
        """Values kept from forward to backward when ``mirrored`` are recomputed instead.

        A value is kept when the backward reads it, or a recompute starts from it.
        """
        kept = {n for n in self.needed if n not in mirrored}
        for node in mirrored:
            kept.update(a for a in self.forward_inputs(node) if a not in mirrored)
        return kept - self.free

    def recompute_flops(self, mirrored: set[fx.Node]) -> int:
        return sum(cost.flops(n) for n in mirrored)


def storage_keys(node: fx.Node, key_bytes: dict[StorageKey, int]) -> list[StorageKey]:
    """The storages a node's value holds (shared with its base for views), recording their bytes."""
    source = cost.alias_source(node)
    if source is not None:
        return storage_keys(source, key_bytes) if source.op == "call_function" else []
    if node.target is operator.getitem and isinstance(node.args[0], fx.Node):
        index = node.args[1]
        key = (node.args[0].name, int(index))  # type: ignore[arg-type]
        key_bytes[key] = cost.output_bytes(node)
        return [key]
    value = node.meta.get("val")
    items = list(value) if isinstance(value, list | tuple) else [value]
    keys = []
    for index, item in enumerate(items):
        if isinstance(item, torch.Tensor):
            key = (node.name, index)
            key_bytes[key] = cost.tensor_bytes(item)
            keys.append(key)
    return keys
