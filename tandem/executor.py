"""Runs a planned TrainGraph: one generated Python function per segment, values in numbered slots.

Every node gets a slot; a node's slot is cleared right after its last use, which is where its
memory is freed (unless a caller still holds it). The same program runs two ways:
  - generated code (the fast path): straight-line aten calls, one function per segment;
  - the measuring interpreter: the same calls and frees, counting the bytes of live
    intermediate storages, so ``peak_bytes`` is measured while executing, not estimated.
Segments come from ``node.meta[MetaKey.SEGMENT]`` (the bulking pass); without it the whole graph is
one segment. The executor never re-plans: it runs what the passes decided.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from tandem.graph.train_graph import MetaKey, Phase, TrainGraph

GradientHook = Callable[[str, torch.Tensor], None]


@dataclass
class Instruction:
    slot: int
    node: fx.Node
    frees: list[int]  # slots whose last use is this instruction


@dataclass
class Segment:
    index: int
    phase: str
    instructions: list[Instruction]
    function: Callable[[list[Any]], None] = field(repr=False, default=lambda v: None)
    gradients: list[str] = field(default_factory=list)  # parameters whose gradient this segment finishes

    @property
    def num_nodes(self) -> int:
        return len(self.instructions)


@dataclass
class MemoryStats:
    peak_bytes: int = 0
    saved_bytes: int = 0
    live_bytes_at_end: int = 0


class Executor:
    """Holds the compiled program of one TrainGraph. Not thread-safe: one run at a time."""

    def __init__(self, train_graph: TrainGraph) -> None:
        self.train_graph = train_graph
        placeholders = train_graph.placeholders
        self.num_inputs = len(placeholders)
        self._slot = {node: i for i, node in enumerate(placeholders)}
        op_nodes = train_graph.op_nodes()
        for node in op_nodes:
            self._slot[node] = len(self._slot)
        self.num_slots = len(self._slot)
        outputs = train_graph.outputs()
        self.output_slots = [self._slot[n] for n in outputs]
        self.segments = self._segments(op_nodes, set(outputs))
        grad_names = {node: name for name, node in train_graph.grads.items()}
        for segment in self.segments:
            segment.gradients = [grad_names[i.node] for i in segment.instructions if i.node in grad_names]
            segment.function = _generate(segment, self._slot)
        self.hooks: list[GradientHook] = []

    # -- planning the program ----------------------------------------------------------------
    def _segments(self, op_nodes: list[fx.Node], outputs: set[fx.Node]) -> list[Segment]:
        last_use: dict[fx.Node, fx.Node] = {}
        for node in op_nodes:
            for source in node.all_input_nodes:
                last_use[source] = node
        frees: dict[fx.Node, list[int]] = {}
        for value, user in last_use.items():
            if value.op != "placeholder" and value not in outputs:
                frees.setdefault(user, []).append(self._slot[value])
        segments: list[Segment] = []
        for node in op_nodes:
            index = node.meta.get(MetaKey.SEGMENT, 0)
            phase = node.meta.get(MetaKey.PHASE, Phase.FORWARD)
            if not segments or segments[-1].index != index:
                segments.append(Segment(index=index, phase=phase, instructions=[]))
            unused = [] if node in last_use or node in outputs else [self._slot[node]]  # dead on arrival
            segments[-1].instructions.append(Instruction(self._slot[node], node, frees.get(node, []) + unused))
        return segments

    # -- running -----------------------------------------------------------------------------
    def new_slots(self, inputs: Sequence[torch.Tensor]) -> list[Any]:
        if len(inputs) != self.num_inputs:
            raise ValueError(f"the graph takes {self.num_inputs} inputs, got {len(inputs)}")
        return list(inputs) + [None] * (self.num_slots - self.num_inputs)

    def run_segment(self, segment: Segment, slots: list[Any]) -> None:
        """Run one segment, then announce the gradients it finished (the communication hook)."""
        segment.function(slots)
        self._announce(segment, slots)

    def run(self, inputs: Sequence[torch.Tensor]) -> list[Any]:
        """Run every segment in order on the calling thread; returns the canonical outputs."""
        slots = self.new_slots(inputs)
        with torch.no_grad():
            for segment in self.segments:
                self.run_segment(segment, slots)
        return [slots[i] for i in self.output_slots]

    def run_measured(self, inputs: Sequence[torch.Tensor]) -> tuple[list[Any], MemoryStats]:
        """Like run(), interpreting node by node and counting live intermediate bytes."""
        slots = self.new_slots(inputs)
        meter = _MemoryMeter(inputs)
        held: dict[int, list[int]] = {}
        stats = MemoryStats()
        boundary_done = False
        with torch.no_grad():
            for segment in self.segments:
                if segment.phase == Phase.BACKWARD and not boundary_done:
                    stats.saved_bytes, boundary_done = meter.live_bytes, True
                for instruction in segment.instructions:
                    node = instruction.node
                    args, kwargs = _materialize(node, slots, self._slot)
                    value = node.target(*args, **kwargs)  # type: ignore[operator]
                    slots[instruction.slot] = value
                    held[instruction.slot] = meter.hold(value)
                    for slot in instruction.frees:
                        slots[slot] = None
                        meter.release(held.pop(slot, []))
                self._announce(segment, slots)
        if not boundary_done:
            stats.saved_bytes = meter.live_bytes
        stats.peak_bytes, stats.live_bytes_at_end = meter.peak_bytes, meter.live_bytes
        return [slots[i] for i in self.output_slots], stats

    def _announce(self, segment: Segment, slots: list[Any]) -> None:
        if self.hooks and segment.gradients:
            for name in segment.gradients:
                for hook in self.hooks:
                    hook(name, slots[self._slot[self.train_graph.grads[name]]])

    def segment_sizes(self) -> list[int]:
        return [s.num_nodes for s in self.segments]


class _MemoryMeter:
    """Counts bytes of distinct live storages that are not graph inputs (views share a storage)."""

    def __init__(self, inputs: Sequence[torch.Tensor]) -> None:
        self._inputs = {_storage_key(t) for t in inputs if isinstance(t, torch.Tensor)}
        self._references: dict[int, int] = {}
        self._sizes: dict[int, int] = {}
        self.live_bytes = 0
        self.peak_bytes = 0

    def hold(self, value: Any) -> list[int]:
        keys = []
        for tensor in _tensors(value):
            key = _storage_key(tensor)
            if key in self._inputs or key == 0:
                continue
            if key not in self._references:
                self._references[key] = 0
                self._sizes[key] = tensor.untyped_storage().nbytes()
                self.live_bytes += self._sizes[key]
            self._references[key] += 1
            keys.append(key)
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        return keys

    def release(self, keys: list[int]) -> None:
        for key in keys:
            self._references[key] -= 1
            if self._references[key] == 0:  # the last slot holding this storage let go: freed
                del self._references[key]
                self.live_bytes -= self._sizes.pop(key)


def _storage_key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, list | tuple):
        return [t for t in value if isinstance(t, torch.Tensor)]
    return []


def _materialize(node: fx.Node, slots: list[Any], slot_of: dict[fx.Node, int]) -> tuple[Any, Any]:
    def value(arg: Any) -> Any:
        return slots[slot_of[arg]]

    return fx.node.map_arg(node.args, value), fx.node.map_arg(node.kwargs, value)


# -- code generation ---------------------------------------------------------------------------


def _generate(segment: Segment, slot_of: dict[fx.Node, int]) -> Callable[[list[Any]], None]:
    """Straight-line Python for one segment: ``v[7] = aten_add(v[3], v[5]); v[3] = None``."""
    constants: dict[str, Any] = {}

    def constant(value: Any) -> str:
        name = f"c{len(constants)}"
        constants[name] = value
        return name

    def render(arg: Any) -> str:
        if isinstance(arg, fx.Node):
            return f"v[{slot_of[arg]}]"
        if isinstance(arg, list):
            return "[" + ", ".join(render(a) for a in arg) + "]"
        if isinstance(arg, tuple):
            return "(" + "".join(render(a) + ", " for a in arg) + ")"
        if isinstance(arg, bool | int | str) or arg is None:
            return repr(arg)
        if isinstance(arg, float) and math.isfinite(arg):
            return repr(arg)
        return constant(arg)

    lines = [f"def segment_{segment.index}(v):"]
    for instruction in segment.instructions:
        node = instruction.node
        args = [render(a) for a in node.args] + [f"{k}={render(a)}" for k, a in node.kwargs.items()]
        if node.target is operator.getitem:
            call = f"{args[0]}[{args[1]}]"
        else:
            call = f"{constant(node.target)}({', '.join(args)})"
        lines.append(f"    v[{instruction.slot}] = {call}  # {node.name}")
        lines.extend(f"    v[{slot}] = None" for slot in instruction.frees)
    lines.append("    return None")
    source = "\n".join(lines)
    namespace: dict[str, Any] = dict(constants)
    exec(compile(source, f"<tandem segment {segment.index}>", "exec"), namespace)  # noqa: S102
    function = namespace[f"segment_{segment.index}"]
    function.__tandem_source__ = source
    return function
