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
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.fx as fx

from tandem.engine import Engine, Var, get_engine
from tandem.graph.cost import tensor_values
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
    parameters: list[str] = field(default_factory=list)  # parameters this segment reads

    @property
    def name(self) -> str:
        return f"{self.phase}[{self.index}]"

    @property
    def num_nodes(self) -> int:
        return len(self.instructions)


@dataclass(frozen=True)
class StepHooks:
    """What the caller of a run adds to it (a parameter update does: tandem.update). Every field is optional.

    - ``parameter_vars``: parameter name -> its engine var. A segment also reads the vars of the
      parameters it uses, so an op that writes a parameter holds back exactly the segments that need it.
    - ``before_segment(segment)``: runs on the calling thread just before a segment is pushed: the
      place to wait for that segment's parameters and push the ops that write them, while the
      segments pushed before it already run.
    - ``before_measured_run()``: runs before the measuring interpreter, which bypasses the engine:
      every parameter must be final when it returns.
    """

    parameter_vars: Mapping[str, Var] = field(default_factory=dict)
    before_segment: Callable[[Segment], None] | None = None
    before_measured_run: Callable[[], None] | None = None


NO_HOOKS = StepHooks()


@dataclass
class RunReport:
    """What one step did: its segments, the engine ops it pushed, when each gradient was ready."""

    nodes_per_segment: list[int]
    engine_ops: int = 0
    gradient_ready_s: dict[str, float] = field(default_factory=dict)  # seconds after the step began

    @property
    def num_segments(self) -> int:
        return len(self.nodes_per_segment)


@dataclass
class MemoryStats:
    peak_bytes: int = 0
    saved_bytes: int = 0
    live_bytes_at_end: int = 0
    # on an accelerator with allocator statistics (cuda, xpu, ...): the allocator's own peak during
    # the step above what was allocated before it (block rounding and workspaces included); None on the CPU
    allocator_peak_bytes: int | None = None


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
        param_names = {node: name for name, node in train_graph.param_nodes.items()}
        for segment in self.segments:
            segment.gradients = [grad_names[i.node] for i in segment.instructions if i.node in grad_names]
            read = {train_graph.canonical(param_names[a]) for i in segment.instructions
                    for a in i.node.all_input_nodes if a in param_names}
            segment.parameters = [n for n in train_graph.parameter_keys if n in read]  # tied: under the first name
            segment.function = _generate(segment, self._slot)
        self.hooks: list[GradientHook] = []
        self.last_report: RunReport | None = None
        self._done = Var("step")  # every segment writes it: segments run in graph order

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

    def run(self, inputs: Sequence[torch.Tensor], engine: Engine | None = None, timeout: float | None = None,
            hooks: StepHooks = NO_HOOKS) -> list[Any]:
        """Push one engine op per segment and wait for the last; returns the canonical outputs.

        ``hooks`` (StepHooks) give the segments the parameters' vars to read and run a call before
        each segment is pushed. Gradient hooks run on the engine's thread when their segment ends.
        """
        engine = engine if engine is not None else get_engine()
        slots = self.new_slots(inputs)
        report = RunReport(self.segment_sizes(), engine_ops=len(self.segments))
        start = time.perf_counter()
        parameter_vars, before_segment = hooks.parameter_vars, hooks.before_segment
        for segment in self.segments:
            if before_segment is not None:
                before_segment(segment)
            reads = [parameter_vars[n] for n in segment.parameters if n in parameter_vars] if parameter_vars else []
            engine.push(partial(self._run_segment, segment, slots, report, start), reads=reads,
                        writes=(self._done,), name=segment.name, segment=segment.index)
        engine.wait(self._done, timeout)  # sync point: every segment of this step has finished
        self.last_report = report
        return [slots[i] for i in self.output_slots]

    def _run_segment(self, segment: Segment, slots: list[Any], report: RunReport, start: float) -> None:
        with torch.no_grad():  # grad mode is per thread: engine workers must not record autograd
            segment.function(slots)
        if segment.gradients:
            now = time.perf_counter() - start
            report.gradient_ready_s.update((name, now) for name in segment.gradients)
            self._announce(segment, slots)

    def run_measured(self, inputs: Sequence[torch.Tensor], hooks: StepHooks = NO_HOOKS) -> tuple[list[Any], MemoryStats]:
        """Like run(), interpreting node by node and counting live intermediate bytes."""
        if hooks.before_measured_run is not None:
            hooks.before_measured_run()
        slots = self.new_slots(inputs)
        meter = _MemoryMeter(inputs)
        held: dict[int, list[int]] = {}
        stats = MemoryStats()
        allocator = _AllocatorPeak(inputs)
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
        stats.allocator_peak_bytes = allocator.peak_bytes()
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
        for tensor in tensor_values(value):
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


class _AllocatorPeak:
    """The device allocator's peak over a measured step, where the inputs live on an accelerator whose
    torch module keeps allocator statistics (``torch.cuda``, ``torch.xpu``, ...)."""

    def __init__(self, inputs: Sequence[torch.Tensor]) -> None:
        devices = {t.device for t in inputs if isinstance(t, torch.Tensor) and t.device.type != "cpu"}
        self.device = next(iter(devices)) if len(devices) == 1 else None
        backend = getattr(torch, self.device.type, None) if self.device is not None else None
        self.backend = backend if hasattr(backend, "max_memory_allocated") else None
        if self.backend is not None:
            self.backend.reset_peak_memory_stats(self.device)
            self.base = self.backend.memory_allocated(self.device)

    def peak_bytes(self) -> int | None:
        if self.backend is None:
            return None
        return int(self.backend.max_memory_allocated(self.device) - self.base)


def _storage_key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def _materialize(node: fx.Node, slots: list[Any], slot_of: dict[fx.Node, int]) -> tuple[Any, Any]:
    def value(arg: Any) -> Any:
        return slots[slot_of[arg]]

    return fx.node.map_arg(node.args, value), fx.node.map_arg(node.kwargs, value)


# -- code generation ---------------------------------------------------------------------------


def _direct_callable(target: Any) -> Any:
    """An aten OpOverload's C++ entry point: calling it skips one Python frame (~0.3 us) per node."""
    return getattr(target, "_op", target) if isinstance(target, torch._ops.OpOverload) else target


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
            call = f"{constant(_direct_callable(node.target))}({', '.join(args)})"
        lines.append(f"    v[{instruction.slot}] = {call}  # {node.name}")
        lines.extend(f"    v[{slot}] = None" for slot in instruction.frees)
    lines.append("    return None")
    source = "\n".join(lines)
    namespace: dict[str, Any] = dict(constants)
    exec(compile(source, f"<tandem segment {segment.index}>", "exec"), namespace)  # noqa: S102
    function = namespace[f"segment_{segment.index}"]
    function.__tandem_source__ = source
    return function
