"""Runs a planned TrainGraph: one function per segment (from a backend), values in numbered slots.

Every node gets a slot; a node's slot is cleared right after its last use, which is where its
memory is freed (unless a caller still holds it). The same program runs two ways:
  - segment functions (the fast path), made by a backend (tandem.backends): straight-line aten
    calls (aten), or a segment's compiled kernels (inductor);
  - a measured run: for aten, an interpreter making the same calls and frees while counting the
    bytes of live intermediate storages; for inductor, the kernels under the profiler's
    allocation events. Either way ``peak_bytes`` is measured while executing, not estimated.
Segments come from ``node.meta[MetaKey.SEGMENT]`` (the bulking pass); without it the whole graph is
one segment. The executor never re-plans: it runs what the passes decided.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.fx as fx

from tandem.backends import BACKENDS, aten
from tandem.backends.inductor import InductorSegment
from tandem.backends.program import Instruction
from tandem.engine import Engine, Var, get_engine
from tandem.graph.cost import tensor_values
from tandem.graph.train_graph import MetaKey, Phase, TrainGraph

GradientHook = Callable[[str, torch.Tensor], None]
SegmentHook = Callable[[Sequence[tuple[str, torch.Tensor]]], None]  # every gradient one segment finished, in order


@dataclass
class Segment:
    index: int
    phase: str
    instructions: list[Instruction]
    function: Callable[[list[Any]], None] = field(repr=False, default=lambda v: None)
    gradients: list[str] = field(default_factory=list)  # parameters whose gradient this segment finishes
    parameters: list[str] = field(default_factory=list)  # parameters this segment reads
    inference: bool = False  # a segment of an evaluation graph (``compile_eval``)

    @property
    def name(self) -> str:
        """``forward[0]``, ``backward[3]``; ``eval[0]`` in an evaluation graph, so that a trace tells
        evaluation's forward from training's."""
        return f"{'eval' if self.inference else self.phase}[{self.index}]"

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

    def __init__(self, train_graph: TrainGraph, backend: str = "aten") -> None:
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r}; choose one of {list(BACKENDS)}")
        self.train_graph = train_graph
        self.backend = backend
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
            segment.function = aten.generate(segment.index, segment.instructions, self._slot)
        if backend == "inductor":
            self._compile_segments(set(outputs))
        self.hooks: list[GradientHook] = []
        self.segment_hooks: list[SegmentHook] = []
        self.last_report: RunReport | None = None
        self._done = Var("step")  # every segment writes it: segments run in graph order

    def _compile_segments(self, outputs: set[fx.Node]) -> None:
        segment_of = {i.node: segment.index for segment in self.segments for i in segment.instructions}

        def needed_after(node: fx.Node) -> bool:
            return node in outputs or any(segment_of.get(user) != segment_of[node] for user in node.users)

        for segment in self.segments:
            segment.function = InductorSegment(segment.name, segment.instructions, self._slot, needed_after,
                                               outputs, segment.function)

    @property
    def compiled(self) -> bool:
        """True once every segment has its code: always for aten, after ``compile_run`` for inductor."""
        return all(not isinstance(s.function, InductorSegment) or s.function.is_compiled for s in self.segments)

    def compile_report(self) -> dict[str, Any]:
        """Backend, seconds spent compiling, the units loaded from the unit index (not compiled), and the
        segments that fell back to aten (with why)."""
        compiled = [s.function for s in self.segments if isinstance(s.function, InductorSegment)]
        return {"backend": self.backend, "compile_s": sum(c.compile_seconds for c in compiled),
                "units_loaded": sum(c.loaded for c in compiled),
                "fallbacks": {c.name: c.fallback_reason for c in compiled if c.fallback_reason is not None}}

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
                segments.append(Segment(index=index, phase=phase, instructions=[], inference=self.train_graph.inference))
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

    def run_measured(self, inputs: Sequence[torch.Tensor], hooks: StepHooks = NO_HOOKS,
                     progress: Callable[[int, int, str], None] | None = None) -> tuple[list[Any], MemoryStats]:
        """Like run(), on the calling thread, measuring memory: the aten backend interprets node by node
        counting live intermediate bytes; the inductor backend compiles what is not yet compiled, then
        runs its kernels under the profiler's allocation events, which see the buffers inside them.
        ``progress`` is handed to ``compile_run`` when there is something to compile."""
        if hooks.before_measured_run is not None:
            hooks.before_measured_run()  # the compile run reads the parameters too: they must be final
        if self.backend == "inductor":
            return self._run_compiled_measured(inputs, progress)
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

    def compile_run(self, inputs: Sequence[torch.Tensor], progress: Callable[[int, int, str], None] | None = None) -> None:
        """Compile every segment by running the step once on the calling thread: each segment is
        compiled for the inputs it actually receives (shapes, dtypes, the strides the segment before
        it chose). ``progress(done, total, segment_name)`` runs after each segment."""
        slots = self.new_slots(inputs)
        accelerators = sorted({t.device.type for t in inputs if isinstance(t, torch.Tensor)} - {"cpu"})
        # the random numbers this run draws (dropout) are drawn again by the step it precedes
        with torch.no_grad(), torch.random.fork_rng(device_type=accelerators[0] if accelerators else "cuda",
                                                    devices=[] if not accelerators else None):
            for done, segment in enumerate(self.segments, 1):
                segment.function(slots)
                if progress is not None:
                    progress(done, len(self.segments), segment.name)

    def _run_compiled_measured(self, inputs: Sequence[torch.Tensor],
                               progress: Callable[[int, int, str], None] | None) -> tuple[list[Any], MemoryStats]:
        if not self.compiled:
            self.compile_run(inputs, progress)
        slots = self.new_slots(inputs)
        stats = MemoryStats()
        allocator = _AllocatorPeak(inputs)
        inputs_held = _MemoryMeter(inputs)
        saved: int | None = None
        with torch.no_grad(), _AllocationEvents(inputs) as allocations:
            for segment in self.segments:
                if segment.phase == Phase.BACKWARD and saved is None:  # between kernels: only slots hold memory
                    saved = inputs_held.bytes_of(slots)
                segment.function(slots)
        stats.peak_bytes = allocations.peak_bytes()
        stats.live_bytes_at_end = inputs_held.bytes_of(slots)
        stats.saved_bytes = stats.live_bytes_at_end if saved is None else saved
        stats.allocator_peak_bytes = allocator.peak_bytes()
        for segment in self.segments:  # outside the measurement: what a hook allocates is not the step's
            self._announce(segment, slots)
        return [slots[i] for i in self.output_slots], stats

    def _announce(self, segment: Segment, slots: list[Any]) -> None:
        if not segment.gradients or not (self.hooks or self.segment_hooks):
            return
        gradients = tuple((name, slots[self._slot[self.train_graph.grads[name]]]) for name in segment.gradients)
        for name, gradient in gradients:
            for hook in self.hooks:
                hook(name, gradient)
        for segment_hook in self.segment_hooks:
            segment_hook(gradients)

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

    def bytes_of(self, values: Sequence[Any]) -> int:
        """Bytes of the distinct storages in ``values`` that are not inputs (what these slots hold)."""
        sizes = {_storage_key(t): t.untyped_storage().nbytes() for v in values for t in tensor_values(v)}
        return sum(size for key, size in sizes.items() if key not in self._inputs and key != 0)

    def release(self, keys: list[int]) -> None:
        for key in keys:
            self._references[key] -= 1
            if self._references[key] == 0:  # the last slot holding this storage let go: freed
                del self._references[key]
                self.live_bytes -= self._sizes.pop(key)


class _AllocationEvents:
    """The peak of bytes allocated and not yet freed while inside, from the profiler's allocation
    events: every allocation on the inputs' device counts, the buffers inside compiled kernels too.
    The profiler records the calling thread (the measured run's), not the engine's or kvstore's."""

    def __init__(self, inputs: Sequence[torch.Tensor]) -> None:
        devices = {t.device for t in inputs if isinstance(t, torch.Tensor)}
        self.device = next(iter(devices)) if len(devices) == 1 else torch.device("cpu")
        self.profile = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)

    def __enter__(self) -> _AllocationEvents:
        self.profile.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.profile.__exit__(*exc)

    def peak_bytes(self) -> int:
        from torch._C._profiler import _EventType

        events, pending = [], list(self.profile.profiler.kineto_results.experimental_event_tree())  # type: ignore[union-attr]
        while pending:
            event = pending.pop()
            pending.extend(event.children)
            if event.tag == _EventType.Allocation and event.extra_fields.device.type == self.device.type:
                events.append((event.start_time_ns, event.extra_fields.alloc_size))
        live = peak = 0
        for _, size in sorted(events):  # frees are negative sizes
            live += size
            peak = max(peak, live)
        return peak


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
