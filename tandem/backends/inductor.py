"""The inductor backend: each segment compiled by PyTorch's inductor into fused kernels.

A segment's nodes become one fx graph, ``inputs -> outputs``: its inputs are the values it reads
from earlier segments (or the step's inputs), its outputs the values a later segment or the step's
result reads. Inductor sees the whole segment, so pointwise chains and the values the mirror pass
recomputes in a backward segment fuse into the kernels that consume them. Segment boundaries, and
with them the gradient-ready hooks, the engine ops and P3's per-segment sends, stay where the
passes put them.

Compiled on first call, from that call's actual inputs: the strides a compiled segment returns
(channels-last activations, say) are the strides the next segment is compiled for. The inputs are
passed as one list that the compiled code empties, so an activation whose last use is inside the
segment is freed as soon as its kernel has read it, not when the segment ends. A small bool
value (a causal mask) crosses the boundary as float32, which inductor's CPU kernels load faster.

A segment inductor cannot compile runs its aten code instead, with one warning naming the op.
"""

from __future__ import annotations

import operator
import os
import platform
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx

from tandem.backends import unit_cache
from tandem.backends.program import Instruction
from tandem.env import knob

SegmentFunction = Callable[[list[Any]], None]

WARM_UP_TIMEOUT_S = 120.0  # a probe per instruction set, each up to a 60 s load; past this, compiling probes itself
_warm_up: threading.Thread | None = None


def warm_up() -> None:
    """Start inductor's per-process CPU setup on a background thread, so that it overlaps capture.

    Before its first CPU kernel, inductor probes which vector instruction sets this CPU runs: per set,
    it compiles a test library (cached) and loads it in a fresh Python subprocess. That takes about
    2 s, mostly waiting on those subprocesses, and would otherwise come after capture, on every
    process's first compile, warm cache or not. Idempotent; the first ``InductorSegment.compile``
    waits for it (``_await_warm_up``). Any failure here is ignored: compiling probes again itself
    and reports what fails.
    """
    global _warm_up
    if _warm_up is not None:
        return
    try:
        # imported here, on the calling thread: importing torch's circularly dependent modules from two
        # threads at once can hand one of them a partly initialised module; these are every module the
        # probe imports, so the thread imports nothing
        import torch._inductor.codecache  # noqa: F401
        import torch._inductor.cpp_builder  # noqa: F401
        import torch.utils.cpp_extension  # noqa: F401
        from torch._inductor import cpu_vec_isa
    except Exception:  # a warm-up only
        return

    def probe() -> None:
        try:
            # inductor probes the candidate sets one after another (a C++ build and a subprocess each:
            # three here); probed side by side, each answer is cached on its set (functools.cache)
            candidates = _candidate_instruction_sets(cpu_vec_isa)
            probes = [threading.Thread(target=bool, args=(isa,), daemon=True) for isa in candidates]
            for thread in probes:
                thread.start()
            for thread in probes:
                thread.join(WARM_UP_TIMEOUT_S)
            cpu_vec_isa.pick_vec_isa()  # from those answers; cached for the process (valid_vec_isa_list)
        except Exception:  # a warm-up only: the compile that needs the answer probes again
            pass

    _warm_up = threading.Thread(target=probe, name="tandem-inductor-warm-up", daemon=True)
    _warm_up.start()


def on_x86() -> bool:
    """Whether this machine is x86-64, the only one whose vector instruction sets tandem names."""
    return platform.machine() in ("x86_64", "AMD64")


def _candidate_instruction_sets(cpu_vec_isa: Any) -> list[Any]:
    """The vector instruction sets inductor would probe on this CPU (x86 only; elsewhere none: it probes itself)."""
    if not on_x86():
        return []
    flags = cpu_vec_isa.x86_isa_checker()
    return [isa for isa in cpu_vec_isa.supported_vec_isa_list if all(flag in flags for flag in str(isa).split())]


def _standalone_compile(name: str, graph_module: Callable[[], fx.GraphModule], example_inputs: list[Any]) -> tuple[Any, bool]:
    """inductor's compiled function for ``graph_module()``, and whether it is the first choice (not
    the fallback below); with TANDEM_INDUCTOR_CPP_WRAPPER, its C++ wrapper.

    inductor's default wrapper is Python calling each kernel, and a CPU kernel holds the GIL while it
    runs: another thread of the process (a kvstore's scheduler or sender) waits for a kernel to end,
    and then for the switch interval (5 ms). The C++ wrapper releases the GIL for the whole segment.
    Where the C++ wrapper does not compile, the Python one is tried before giving up."""
    def compile_with(patches: dict[str, Any]) -> Any:
        boxed_inputs: list[Any] = [list(example_inputs)]  # one argument, the list the compiled code empties
        # donated: each call builds its own graph module, so inductor need not copy it
        return torch._inductor.standalone_compile(graph_module(), boxed_inputs, dynamic_shapes="from_example_inputs",
                                                  options={"config_patches": patches}, donate_graph_module=True)

    first_choice = _options()
    try:
        return compile_with(first_choice), True
    except Exception as error:  # the Python wrapper compiles what the C++ one cannot
        if not first_choice["cpp_wrapper"]:
            raise
        warnings.warn(f"tandem: inductor's C++ wrapper failed for segment {name} ({_first_line(error)}); "
                      "that segment uses its Python wrapper", RuntimeWarning, stacklevel=3)
        return compile_with({**first_choice, "cpp_wrapper": False}), False


def _options() -> dict[str, Any]:
    """The inductor options a unit is compiled with first (the Python wrapper is the fallback)."""
    return {**OPTIONS, "cpp_wrapper": bool(knob("TANDEM_INDUCTOR_CPP_WRAPPER"))}


def _await_warm_up() -> None:
    """Wait for ``warm_up``'s probe, if one runs: compiling would otherwise start the same probe beside it."""
    if _warm_up is not None:
        _warm_up.join(WARM_UP_TIMEOUT_S)


def onednn_below_avx512() -> bool:
    """True where oneDNN's x86 convolutions run AVX2 code (or older): the CPU has no AVX-512, or
    ``ONEDNN_MAX_CPU_ISA`` (oneDNN's own variable, ``DNNL_MAX_CPU_ISA`` before) caps it below.

    There oneDNN's ``jit_1x1:avx2`` weight gradient of a strided 1x1 convolution on channels-last
    tensors writes past its buffer (eager PyTorch 2.13 too: with one torch thread, ``conv2d`` of a
    (4, 4, 8, 8) input with a (8, 4, 1, 1) weight at stride 2, both channels-last, aborts in
    ``free()``), and inductor's layout optimisation makes a ResNet's convolutions channels-last."""
    if not on_x86():
        return False
    cap = (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "ALL").upper()
    capped_below = not (cap in ("ALL", "DEFAULT") or "AVX512" in cap or "AVX10" in cap)
    return capped_below or torch.backends.cpu.get_cpu_capability() != "AVX512"


# fallback_random: random ops call aten (and tandem::bernoulli), so dropout draws eager's numbers from
# eager's generator; only under it does inductor chain the draws (nondeterministic_seeded) in program order.
# keep_output_stride off: a value passed to a later segment keeps the layout inductor chose for it
# (channels-last conv activations: convolution_backward is ~25% faster on them on the CPU).
# layout_optimization off where oneDNN runs AVX2 code: its channels-last 1x1 weight gradient corrupts the heap.
OPTIONS: dict[str, Any] = {"fallback_random": True, "keep_output_stride": False,
                           **({"layout_optimization": False} if onednn_below_avx512() else {})}

# inductor's CPU kernels load a stored bool tensor element by element (``VecMask::from``): a
# causal-masked softmax ran 3x slower than with a float mask. A bool value on the CPU this small
# (by size alone: a causal mask, or a tiny model's dropout mask) crosses a unit's boundary as
# float32, a copy too small to matter; larger ones stay bool.
FLOAT_MASK_MAX_NUMEL = 1 << 16


def _small_mask(node: fx.Node) -> bool:
    value = node.meta.get("val")
    return (isinstance(value, torch.Tensor) and value.dtype == torch.bool and value.device.type == "cpu"
            and value.numel() <= FLOAT_MASK_MAX_NUMEL)  # the slow load is in the CPU kernels inductor writes


class InductorSegment:
    """One segment's compiled kernels, called as ``segment(slots)`` like the aten backend's function.

    Not thread-safe while compiling: the executor compiles every segment on the calling thread
    (``compile_run``) before the engine runs any of them.
    """

    def __init__(self, name: str, instructions: Sequence[Instruction], slot_of: dict[fx.Node, int],
                 needed_after: Callable[[fx.Node], bool], step_outputs: set[fx.Node],
                 aten_function: SegmentFunction) -> None:
        self.name = name
        self.nodes = [i.node for i in instructions]
        inside = set(self.nodes)
        inputs: dict[fx.Node, None] = {}
        for node in self.nodes:
            inputs.update((a, None) for a in node.all_input_nodes if a not in inside)
        self.inputs = list(inputs)
        self.outputs = [n for n in self.nodes if needed_after(n)]
        self.input_slots = [slot_of[n] for n in self.inputs]
        self.output_slots = [slot_of[n] for n in self.outputs]
        freed = {slot for i in instructions for slot in i.frees}
        self.donated = [s for s in self.input_slots if s in freed]  # last read here: the kernels free them
        # a step output (gradient, loss) leaves in eager's contiguous layout
        self.step_output_positions = [k for k, n in enumerate(self.outputs) if n in step_outputs]
        # small bool values pass in and out as float32 (0.0, 1.0): the kernels then load floats
        self.float_mask_inputs = [k for k, n in enumerate(self.inputs) if _small_mask(n)]
        self.float_mask_outputs = [k for k, n in enumerate(self.outputs) if _small_mask(n)]
        self.aten_function = aten_function
        self.compiled: Callable[[list[Any]], Sequence[Any]] | None = None
        self.fallback_reason: str | None = None
        self.compile_seconds = 0.0
        self.loaded = False  # from the unit index, not compiled

    @property
    def is_compiled(self) -> bool:
        return self.compiled is not None or self.fallback_reason is not None

    def __call__(self, slots: list[Any]) -> None:
        if self.fallback_reason is not None:
            self.aten_function(slots)
            return
        args = [slots[s] for s in self.input_slots]
        for k in self.float_mask_inputs:
            args[k] = args[k].to(torch.float32)
        if self.compiled is None:
            self.compile(args)
            if self.fallback_reason is not None:
                self.aten_function(slots)
                return
        assert self.compiled is not None
        for slot in self.donated:
            slots[slot] = None  # the list below holds the only reference (for a mask, its float copy): freed inside
        results = list(self.compiled(args))
        for k in self.float_mask_outputs:
            results[k] = results[k].to(torch.bool)  # exact: the kernels wrote 0.0 or 1.0
        for slot, value in zip(self.output_slots, results):
            slots[slot] = value
        for k in self.step_output_positions:
            value = slots[self.output_slots[k]]
            if isinstance(value, torch.Tensor) and not value.is_contiguous():
                slots[self.output_slots[k]] = value.contiguous()

    def compile(self, example_inputs: list[Any]) -> None:
        """Load this unit's kernels from the unit index, else compile them with inductor for these
        inputs' shapes, strides and dtypes (and index them); on failure fall back to aten."""
        start = time.perf_counter()
        _await_warm_up()
        unit_key = self._unit_key(example_inputs)
        self.compiled = unit_cache.load(unit_key) if unit_key is not None else None
        self.loaded = self.compiled is not None
        if self.compiled is None:
            try:
                # standalone_compile traces under a fake mode with a shape environment, which inductor's
                # FX graph cache and AOTAutograd cache need: torch._inductor.compile bypasses both
                artifact, first_choice = _standalone_compile(self.name, self.graph_module, example_inputs)
            except Exception as error:  # any compiler failure: this segment runs its exact aten code
                self.fallback_reason = f"{_failing_op(self.nodes, error)}: {_first_line(error)}"
                warnings.warn(f"tandem: inductor could not compile segment {self.name} ({self.fallback_reason}); "
                              "that segment runs its aten code instead", RuntimeWarning, stacklevel=2)
            else:
                self.compiled = artifact
                if unit_key is not None and first_choice:  # a fallback's failure may not recur: not remembered
                    unit_cache.store(unit_key, artifact)
        self.compile_seconds = time.perf_counter() - start

    def _unit_key(self, example_inputs: list[Any]) -> str | None:
        """This unit's key in the unit index; None where the index is off or cannot key it. Never raises."""
        try:
            return unit_cache.key(self._graph()[0], example_inputs, _options()) if unit_cache.enabled() else None
        except Exception as error:  # the index is an optimisation: compile as before
            warnings.warn(f"tandem: segment {self.name} is not looked up in the unit index ({_first_line(error)})",
                          RuntimeWarning, stacklevel=3)
            return None

    def graph_module(self) -> fx.GraphModule:
        """The segment as ``forward(inputs: list) -> tuple``; the list is handed over (``steal_arg``)."""
        graph, constants = self._graph()
        return fx.GraphModule(constants, graph)

    def _graph(self) -> tuple[fx.Graph, torch.nn.Module]:
        """``graph_module``'s graph, and the module holding its constants: a tensor in a node's
        arguments (a constant the model made: ``torch.tensor([])`` under ``lift_fresh_copy``) becomes
        an attribute read by a ``get_attr`` node, as the generated code cannot spell a tensor."""
        graph, root, constants = fx.Graph(), torch.nn.Module(), 0
        boxed = graph.placeholder("inputs")
        boxed.meta["steal_arg"] = True  # inductor's wrapper empties the caller's list
        env: dict[fx.Node, fx.Node] = {}
        for k, node in enumerate(self.inputs):
            item = graph.call_function(operator.getitem, (boxed, k))
            if k in self.float_mask_inputs:  # it arrives as float32 (``__call__``): back to bool in the kernels
                env[node] = graph.call_function(torch.ops.aten.ne.Scalar, (item, 0))
            else:
                item.meta = {"val": node.meta["val"]} if "val" in node.meta else {}
                env[node] = item

        def constant(arg: Any) -> Any:
            nonlocal constants
            if not isinstance(arg, torch.Tensor):
                return arg
            name, constants = f"_tensor_constant{constants}", constants + 1
            setattr(root, name, arg)
            return graph.get_attr(name)

        for node in self.nodes:
            copied = graph.node_copy(node, lambda arg: env[arg])
            if copied.target is torch.ops.aten.view.default:
                # inductor re-traces with its decompositions, whose strides may differ from eager's
                # (T5's attention bias): a view eager could take becomes a copy there, not an error
                copied.target = torch.ops.aten.reshape.default
            with graph.inserting_before(copied):
                copied.args = fx.node.map_aggregate(copied.args, constant)
                copied.kwargs = fx.node.map_aggregate(copied.kwargs, constant)
            env[node] = copied
        outputs = [env[n] for n in self.outputs]
        for k in self.float_mask_outputs:  # stored as float32, so the kernels of this unit that read it load floats
            outputs[k] = graph.call_function(torch.ops.aten._to_copy.default, (outputs[k],), {"dtype": torch.float32})
        graph.output(tuple(outputs))
        return graph, root


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"


def _failing_op(nodes: Sequence[fx.Node], error: BaseException) -> str:
    """The op the compiler names in its error (inductor puts the target in the message), else the segment's ops."""
    text = str(error)
    named = [n for n in nodes if n.op == "call_function" and _op_name(n.target) in text]
    if named:
        return f"op {_op_name(named[0].target)} at node {named[0].name}"
    return "ops " + ", ".join(sorted({_op_name(n.target) for n in nodes if n.target is not operator.getitem}))


def _op_name(target: Any) -> str:
    return str(target) if isinstance(target, torch._ops.OpOverload) else getattr(target, "__name__", str(target))
