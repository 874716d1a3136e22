"""tandem.compile: capture a module's training step once, then run it as a planned graph.

    step = tandem.compile(model, loss_fn, x, y)
    result = step(x, y)          # result.loss, result.grads["head.weight"], BN stats written back
    step.memory_report()         # measured peak bytes of live intermediates, saved bytes, ...
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from torch import nn

from tandem.backends import BACKENDS, inductor
from tandem.errors import BatchMismatchError
from tandem.executor import NO_HOOKS, Executor, GradientHook, MemoryStats, SegmentHook, StepHooks
from tandem.graph.batch import BatchLayout
from tandem.graph.capture import LossFn, capture, capture_inference
from tandem.graph.train_graph import StateReader, TrainGraph, resolved
from tandem.passes.config import PlanConfig
from tandem.passes.manager import plan as plan_graph
from tandem.progress import progress_options

log = logging.getLogger("tandem")


@dataclass
class StepConfig:
    """Options of ``tandem.compile``, ``compile_eval`` and ``Trainer``; explicit values beat the TANDEM_* env knobs.

    Attributes:
        mirror: backward mirroring policy: ``"off"``, ``"all"``, ``"sqrt"``, ``"memory-aware"``, a
            budget as a fraction of the off plan's peak (``0.5``) or a size (``"300MB"``);
            None reads ``TANDEM_MIRROR`` (default off).
        bulk: cut the graph into segments of several nodes (None: ``TANDEM_BULK_TRAIN``, on).
        bulk_fwd: forward segment cap in op nodes (None: ``TANDEM_BULK_MAX_NODE_TRAIN[_FWD]``, 15).
        bulk_bwd: backward segment cap in op nodes (None: ``TANDEM_BULK_MAX_NODE_TRAIN[_BWD]``, 15).
        bulk_cut_gradient: a backward segment also ends after the op that finishes a gradient of at least
            this many elements, so that it is sent at once (None: ``TANDEM_BULK_CUT_GRADIENT``; 0: never;
            a distributed Trainer's default is 65536, training alone never).
        recapture: capture again for a batch of new shapes; False raises ``BatchMismatchError`` instead.
        max_captures: captured graphs kept per step; beyond it the oldest is dropped.
        measure_memory: measure every step's memory, not only the first step of each captured shape.
        checkpoint_regions: recompute what the model wraps in ``torch.utils.checkpoint`` (False: ignore the wrapping).
        backend: how segments become code: ``"aten"`` (generated Python over aten ops, exact) or
            ``"inductor"`` (each segment compiled by PyTorch's inductor into fused kernels); None reads
            ``TANDEM_BACKEND`` (default aten).

    Example:
        ```python
        step = tandem.compile(model, loss_fn, x, y, mirror=0.5, bulk_bwd=4, recapture=False)
        step.config.mirror          # 0.5; unknown options raise TypeError listing the valid ones
        ```
    """

    mirror: str | float | None = None  # backward mirroring policy (None: TANDEM_MIRROR, default "off")
    bulk: bool | None = None  # bulk into segments (None: TANDEM_BULK_TRAIN)
    bulk_fwd: int | None = None  # forward segment cap (None: TANDEM_BULK_MAX_NODE_TRAIN[_FWD]; WHOLE: one segment)
    bulk_bwd: int | None = None  # backward segment cap
    bulk_cut_gradient: int | None = None  # backward segments end after large gradients (distributed training)
    recapture: bool = True  # a batch of new shapes is captured again (False: raise)
    max_captures: int = 8  # graphs kept per step before the oldest is dropped
    measure_memory: bool = False  # measure every step (the first step is always measured)
    checkpoint_regions: bool = True  # recompute what the model wraps in torch.utils.checkpoint (False: ignore)
    backend: str | None = field(default=None, metadata={"choices": BACKENDS})  # None: TANDEM_BACKEND, default aten
    plan: PlanConfig = field(init=False, repr=False)  # what the passes read: the options above with the knobs resolved

    def __post_init__(self) -> None:
        for name in ("bulk_fwd", "bulk_bwd"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise ValueError(f"{name} must be an int >= 0 (op nodes per segment; 0 or 1: one per segment), got {value!r}")
        if not isinstance(self.checkpoint_regions, bool):
            raise TypeError(f"checkpoint_regions must be True or False, got {self.checkpoint_regions!r}")
        if self.max_captures < 1:
            raise ValueError(f"max_captures must be >= 1, got {self.max_captures}")
        cut = self.bulk_cut_gradient
        if cut is not None and (not isinstance(cut, int) or cut < 0):
            raise ValueError(f"bulk_cut_gradient must be an int >= 0 (elements; 0: never cut), got {cut!r}")
        # resolved once, here: a bad mirror= is refused at tandem.compile / Trainer(...), and no pass reads the env
        self.plan = PlanConfig.resolve(self.mirror, self.bulk, self.bulk_fwd, self.bulk_bwd, self.checkpoint_regions,
                                       self.backend, self.bulk_cut_gradient)

    def options(self) -> dict[str, Any]:
        """The options this config was made from (what ``from_options`` takes)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.init}

    @staticmethod
    def from_options(options: dict[str, Any]) -> StepConfig:
        known = {f.name for f in fields(StepConfig) if f.init}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(f"unknown option(s) {unknown}; valid options: {sorted(known)}")
        return StepConfig(**options)


@dataclass
class StepResult:
    """What one captured training step returns (gradients are not written to ``p.grad``).

    Attributes:
        loss: the 0-dim loss that ``loss_fn`` returned.
        grads: parameter name -> gradient; a tied parameter's under its first name in
            ``named_parameters()``, none for a parameter no gradient reaches (as in eager).

    Example:
        ```python
        result = step(x, y)
        result.loss.item(), result.grads["head.weight"].shape     # a zoo ResNet's last layer
        ```
    """

    loss: torch.Tensor  # 0-dim
    grads: dict[str, torch.Tensor]  # parameter name (first name of a tied parameter) -> gradient


@dataclass
class _Compiled:
    graph: TrainGraph
    executor: Executor
    state: StateReader  # the module's parameters and buffers, the graph's first inputs
    memory: MemoryStats | None = None
    seconds: dict[str, float] = field(default_factory=dict)  # capture_s, plan_s
    capture_cache: str = "off"  # hit (loaded), miss (traced, stored), bypass (traced, not cacheable), off


@dataclass
class TrainStep:
    """A captured training step, made by ``tandem.compile``: call it on a batch to run forward, loss
    and backward as a planned graph.

    Each new batch layout (shapes, dtypes, static leaves) is captured and planned once and kept (up
    to ``max_captures``). BatchNorm running statistics are written back to the module as in eager.

    Example:
        ```python
        step = tandem.compile(model, loss_fn, x, y)
        result = step(x, y)                          # a StepResult
        step.memory_report()["peak_bytes"]           # measured bytes of live intermediates
        step.add_gradient_hook(lambda name, grad: print(name, grad.norm()))
        ```
    """

    module: nn.Module
    loss_fn: LossFn
    config: StepConfig
    _compiled: dict[BatchLayout, _Compiled] = field(default_factory=dict)
    _last: _Compiled | None = None
    _hooks: list[GradientHook] = field(default_factory=list)
    _segment_hooks: list[SegmentHook] = field(default_factory=list)

    # -- public ------------------------------------------------------------------------------
    def __call__(self, *batch: Any, hooks: StepHooks = NO_HOOKS) -> Any:
        """Run one captured step on ``batch`` (tensors, or dicts/tuples of tensors, as loss_fn takes them).

        ``hooks`` (executor.StepHooks) is what a parameter update adds to the run: the parameters'
        engine vars and the calls before each segment and before a measured step.

        Example:
            ```python
            step = tandem.compile(model, loss_fn, x, y)
            result = step(x, y)                  # a StepResult: result.loss, result.grads
            ```
        """
        layout, tensors = BatchLayout.of(batch)
        compiled = self._for_batch(batch, layout)
        graph = compiled.graph
        inputs = compiled.state.read() + list(tensors)
        if compiled.memory is None or self.config.measure_memory:
            with _compile_progress(compiled.executor) as progress:
                outputs, compiled.memory = compiled.executor.run_measured(inputs, hooks, progress)
        else:
            outputs = compiled.executor.run(inputs, hooks=hooks)
        self._last = compiled
        return self._unpack(graph, outputs, inputs)

    def memory_report(self) -> dict[str, Any]:
        """Measured memory of the most recent measured step (the first step is always measured).

        Keys: ``peak_bytes`` (the measured peak of live intermediate storages; inputs and parameters
        not counted), ``saved_bytes`` (live at the forward/backward boundary),
        ``allocator_peak_bytes`` (an accelerator allocator's peak, None on CPU), ``num_nodes``,
        ``num_segments``, and what the mirroring pass decided: ``policy``, ``mirrored``,
        ``recompute_flops``, ``estimated_peak_bytes`` (and ``_off``), ``saved_bytes_by_policy``,
        with a budget ``budget_bytes`` / ``budget_met``, with checkpointed regions ``checkpointed``.

        Example:
            ```python
            step(x, y)
            report = step.memory_report()
            print(report["peak_bytes"] / 2**20, "MiB at the peak;", report["mirrored"], "values recomputed")
            ```
        """
        compiled = self._last
        if compiled is None or compiled.memory is None:
            raise RuntimeError("memory_report() needs one step first: call step(*batch)")
        graph, memory = compiled.graph, compiled.memory
        return {
            "peak_bytes": memory.peak_bytes,
            "saved_bytes": memory.saved_bytes,
            "allocator_peak_bytes": memory.allocator_peak_bytes,
            "num_nodes": len(graph.op_nodes()),
            "num_segments": len(compiled.executor.segments),
            **resolved(graph.notes.get("memory", {})),
        }

    def compile_report(self) -> dict[str, Any]:
        """Where the first call's time went, for the most recent batch layout.

        Keys: ``backend``; ``capture_s`` (tracing the module and its backward, or loading that
        graph from the capture cache); ``plan_s`` (the passes); ``compile_s`` (the inductor
        backend compiling its segments, or loading them; 0 for aten); ``units_loaded`` (compiled
        units loaded through the unit index instead of compiled); ``fallbacks`` (segment -> why it runs its
        aten code: inductor could not compile it); ``capture_cache``: ``hit`` (the graph came from
        the capture cache), ``miss`` (traced, then stored), ``bypass`` (traced, not stored: hooks,
        an attribute the key cannot describe, a directory it cannot use) or ``off``.

        Example:
            ```python
            step = tandem.compile(model, loss_fn, x, y, backend="inductor")
            step(x, y)
            print(step.compile_report())   # {'backend': 'inductor', 'capture_s': 1.2, 'compile_s': 9.8, ...}
            ```
        """
        compiled = self._last or next(iter(self._compiled.values()))
        return {**compiled.executor.compile_report(), **compiled.seconds, "capture_cache": compiled.capture_cache}

    @property
    def graph(self) -> TrainGraph:
        """The planned graph of the most recent step (or the example batch's).

        Example:
            ```python
            step.graph.summary()      # "TrainGraph: 4 parameters, ..., 28 op nodes (10 forward, 18 backward)"
            step.graph.graph          # the torch.fx Graph of aten ops
            ```
        """
        compiled = self._last or next(iter(self._compiled.values()))
        return compiled.graph

    @property
    def executor(self) -> Executor:
        compiled = self._last or next(iter(self._compiled.values()))
        return compiled.executor

    def add_gradient_hook(self, hook: GradientHook) -> None:
        """hook(name, grad) runs when the segment that finishes a parameter's gradient ends.

        Example:
            ```python
            norms = {}
            step.add_gradient_hook(lambda name, grad: norms.__setitem__(name, grad.norm().item()))
            step(x, y)                           # norms["head.weight"] is set during the backward
            ```
        """
        self._hooks.append(hook)
        for compiled in self._compiled.values():
            compiled.executor.hooks = self._hooks

    def add_segment_hook(self, hook: SegmentHook) -> None:
        """hook(gradients) runs once when a segment that finishes gradients ends, with all of them as
        (name, grad) pairs in order (after the gradient hooks): where sending them together pays, as
        a kvstore sending one message per server rather than one per parameter. Runs on the engine's
        thread, as gradient hooks do.

        Example:
            ```python
            sizes = []
            step.add_segment_hook(lambda gradients: sizes.append(len(gradients)))
            step(x, y)                           # one entry per backward segment that finished gradients
            ```
        """
        self._segment_hooks.append(hook)
        for compiled in self._compiled.values():
            compiled.executor.segment_hooks = self._segment_hooks

    # -- internals ---------------------------------------------------------------------------
    def _for_batch(self, batch: Sequence[Any], layout: BatchLayout | None = None) -> _Compiled:
        key = layout if layout is not None else BatchLayout.of(batch)[0]
        compiled = self._compiled.get(key)
        if compiled is not None:
            return compiled
        if self._compiled and not self.config.recapture:
            captured = next(iter(self._compiled))
            raise BatchMismatchError(
                f"batch {key} differs from the captured batch {captured}; "
                "pass batches of the captured shapes (e.g. drop_last=True) or compile with recapture=True"
            )
        if self._compiled:
            log.info("tandem: capturing the step again for batch %s", key)
        if len(self._compiled) >= self.config.max_captures:
            self._compiled.pop(next(iter(self._compiled)))
        with _older_objects_frozen():
            return self._capture(batch, key)

    def _capture(self, batch: Sequence[Any], key: BatchLayout) -> _Compiled:
        start = time.perf_counter()
        if self.config.plan.backend == "inductor" and _on_cpu(self.module):
            inductor.warm_up()  # inductor's CPU probe runs while capture traces
        traced = self._trace(batch)
        captured = time.perf_counter()
        graph = plan_graph(traced, self.config.plan)
        executor = Executor(graph, self.config.plan.backend)
        executor.hooks, executor.segment_hooks = self._hooks, self._segment_hooks
        state = StateReader(self.module, graph.param_names, graph.buffer_names)
        compiled = self._compiled[key] = _Compiled(graph, executor, state)
        compiled.seconds = {"capture_s": captured - start, "plan_s": time.perf_counter() - captured}
        compiled.capture_cache = traced.notes.get("capture_cache", "off")
        return compiled

    def _trace(self, batch: Sequence[Any]) -> TrainGraph:
        return capture(self.module, self.loss_fn, batch, checkpoint_regions=self.config.checkpoint_regions)

    def _unpack(self, graph: TrainGraph, outputs: list[Any], inputs: list[torch.Tensor]) -> Any:
        loss = outputs[0]
        count = len(graph.grads)
        grads = dict(zip(graph.grads, outputs[1 : 1 + count]))
        first = len(graph.param_names)  # a mutated buffer is an input: this step's, found without walking the module
        buffers = dict(zip(graph.buffer_names, inputs[first : first + len(graph.buffer_names)]))
        if graph.buffer_updates:  # BatchNorm running stats: written back like eager, in one op
            with torch.no_grad():
                torch._foreach_copy_([buffers[name] for name in graph.buffer_updates], list(outputs[1 + count : 1 + count + len(graph.buffer_updates)]))
        return StepResult(loss=loss, grads=grads)


@contextmanager
def _older_objects_frozen() -> Iterator[None]:
    """Garbage collections inside skip the objects made before (the model, torch, every library):
    capture makes many objects, and each full collection would walk all of them (a fifth of a small
    model's first step). Where the program froze objects itself, its freeze is left alone."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()  # what capture left unreachable is collected as before


def _on_cpu(module: nn.Module) -> bool:
    """Whether the module's parameters are all on the CPU (where inductor writes C++ kernels)."""
    return all(parameter.device.type == "cpu" for parameter in module.parameters())


@contextmanager
def _compile_progress(executor: Executor) -> Iterator[Callable[[int, int, str], None] | None]:
    """A progress bar while the measured run compiles the segments (cold, seconds to minutes); None
    when there is nothing to compile."""
    if executor.compiled:
        yield None
        return
    from tqdm import tqdm

    with tqdm(total=len(executor.segments), desc=f"tandem: compiling segments ({executor.backend})", unit="segment",
              leave=False, **progress_options()) as bar:
        def advance(done: int, total: int, name: str) -> None:
            bar.set_postfix_str(name)
            bar.update()

        yield advance
    log.info("tandem: compiled %d segments with %s in %.1f s", len(executor.segments), executor.backend,
             executor.compile_report()["compile_s"])


@dataclass
class EvalResult:
    loss: torch.Tensor  # 0-dim
    output: torch.Tensor  # what the module returned (e.g. logits)


class EvalStep(TrainStep):
    """A captured inference step (eval mode, no backward): ``step(*batch) -> EvalResult``.

    The whole graph is one segment unless TANDEM_BULK_INFERENCE=0 (then the forward cap applies).
    """

    def _trace(self, batch: Sequence[Any]) -> TrainGraph:
        return capture_inference(self.module, self.loss_fn, batch)

    def _unpack(self, graph: TrainGraph, outputs: list[Any], inputs: list[torch.Tensor]) -> Any:
        return EvalResult(loss=outputs[0], output=outputs[-1])


def compile_eval(module: nn.Module, loss_fn: LossFn, *example_batch: Any, **options: Any) -> EvalStep:
    """Capture the eval-mode forward of ``loss_fn(module, *example_batch)`` (loss and module output).

    The whole forward runs as one segment unless TANDEM_BULK_INFERENCE=0. ``Trainer.evaluate`` uses it.

    Example:
        ```python
        evaluate = tandem.compile_eval(model, loss_fn, x, y)
        out = evaluate(x, y)             # out.loss, out.output (what the module returned: the logits)
        ```
    """
    step = EvalStep(module=module, loss_fn=loss_fn, config=StepConfig.from_options(options))
    step._for_batch(example_batch)
    return step


def compile(module: nn.Module, loss_fn: LossFn, *example_batch: Any, **options: Any) -> TrainStep:
    """Capture ``loss_fn(module, *example_batch)`` with its backward and return a TrainStep.

    Batch elements are tensors or dicts/tuples/lists of tensors (``loss_fn(module, batch)`` with a
    transformers collator's dict works); non-tensor leaves are static: a new value captures again.
    Options: see StepConfig (mirror, bulk, bulk_fwd, bulk_bwd, bulk_cut_gradient, recapture, max_captures,
    measure_memory, checkpoint_regions, backend).

    Example:
        ```python
        import torch.nn.functional as F
        import tandem
        from tandem import data, models

        model = models.resnet(depth=8, width=16, in_channels=1, small_input=True)
        loss_fn = lambda module, x, y: F.cross_entropy(module(x), y)
        x, y = next(iter(data.batches(data.digits("train"), 64)))
        step = tandem.compile(model, loss_fn, x, y, mirror="memory-aware")
        result = step(x, y)              # result.loss, result.grads["head.weight"]
        ```
    """
    config = StepConfig.from_options(options)
    step = TrainStep(module=module, loss_fn=loss_fn, config=config)
    step._for_batch(example_batch)
    return step

