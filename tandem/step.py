"""tandem.compile: capture a module's training step once, then run it as a planned graph.

    step = tandem.compile(model, loss_fn, x, y)
    result = step(x, y)          # result.loss, result.grads["fc.weight"], BN stats written back
    step.memory_report()         # measured peak bytes of live intermediates, saved bytes, ...
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from torch import nn

from tandem.errors import BatchMismatchError
from tandem.executor import NO_HOOKS, Executor, GradientHook, MemoryStats, StepHooks
from tandem.graph.batch import BatchLayout
from tandem.graph.capture import LossFn, capture, capture_inference
from tandem.graph.train_graph import TrainGraph
from tandem.passes.manager import plan

log = logging.getLogger("tandem")


@dataclass
class StepConfig:
    """Options of tandem.compile / Trainer; explicit values beat the TANDEM_* env knobs."""

    mirror: str | float | None = None  # backward mirroring policy (None: TANDEM_MIRROR, default "off")
    bulk: bool | None = None  # bulk into segments (None: TANDEM_BULK_TRAIN)
    bulk_fwd: int | None = None  # forward segment cap (None: TANDEM_BULK_MAX_NODE_TRAIN[_FWD]; WHOLE: one segment)
    bulk_bwd: int | None = None  # backward segment cap
    recapture: bool = True  # a batch of new shapes is captured again (False: raise)
    max_captures: int = 8  # graphs kept per step before the oldest is dropped
    measure_memory: bool = False  # measure every step (the first step is always measured)
    checkpoint_regions: bool = True  # recompute what the model wraps in torch.utils.checkpoint (False: ignore)

    def __post_init__(self) -> None:
        for name in ("bulk_fwd", "bulk_bwd"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise ValueError(f"{name} must be an int >= 0 (op nodes per segment; 0 or 1: one per segment), got {value!r}")
        if not isinstance(self.checkpoint_regions, bool):
            raise TypeError(f"checkpoint_regions must be True or False, got {self.checkpoint_regions!r}")
        if self.max_captures < 1:
            raise ValueError(f"max_captures must be >= 1, got {self.max_captures}")

    @staticmethod
    def from_options(options: dict[str, Any]) -> StepConfig:
        known = {f.name for f in fields(StepConfig)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(f"unknown option(s) {unknown}; valid options: {sorted(known)}")
        return StepConfig(**options)


@dataclass
class StepResult:
    loss: torch.Tensor  # 0-dim
    grads: dict[str, torch.Tensor]  # parameter name (first name of a tied parameter) -> gradient


@dataclass
class _Compiled:
    graph: TrainGraph
    executor: Executor
    memory: MemoryStats | None = None


@dataclass
class TrainStep:
    module: nn.Module
    loss_fn: LossFn
    config: StepConfig
    _compiled: dict[BatchLayout, _Compiled] = field(default_factory=dict)
    _last: _Compiled | None = None
    _hooks: list[GradientHook] = field(default_factory=list)

    # -- public ------------------------------------------------------------------------------
    def __call__(self, *batch: Any, hooks: StepHooks = NO_HOOKS) -> Any:
        """Run one captured step on ``batch`` (tensors, or dicts/tuples of tensors, as loss_fn takes them).

        ``hooks`` (executor.StepHooks) is what a parameter update adds to the run: the parameters'
        engine vars and the calls before each segment and before a measured step.
        """
        layout, tensors = BatchLayout.of(batch)
        compiled = self._for_batch(batch, layout)
        graph = compiled.graph
        inputs = graph.inputs(self.module, tensors)
        if compiled.memory is None or self.config.measure_memory:
            outputs, compiled.memory = compiled.executor.run_measured(inputs, hooks)
        else:
            outputs = compiled.executor.run(inputs, hooks=hooks)
        self._last = compiled
        return self._unpack(graph, outputs)

    def memory_report(self) -> dict[str, Any]:
        """Measured memory of the most recent measured step (the first step is always measured)."""
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
            **graph.notes.get("memory", {}),
        }

    @property
    def graph(self) -> TrainGraph:
        """The planned graph of the most recent step (or the example batch's)."""
        compiled = self._last or next(iter(self._compiled.values()))
        return compiled.graph

    @property
    def executor(self) -> Executor:
        compiled = self._last or next(iter(self._compiled.values()))
        return compiled.executor

    def add_gradient_hook(self, hook: GradientHook) -> None:
        """hook(name, grad) runs when the segment that finishes a parameter's gradient ends."""
        self._hooks.append(hook)
        for compiled in self._compiled.values():
            compiled.executor.hooks = self._hooks

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
        return self._capture(batch, key)

    def _capture(self, batch: Sequence[Any], key: BatchLayout) -> _Compiled:
        graph = plan(self._trace(batch), self.config)
        executor = Executor(graph)
        executor.hooks = self._hooks
        compiled = self._compiled[key] = _Compiled(graph, executor)
        return compiled

    def _trace(self, batch: Sequence[Any]) -> TrainGraph:
        return capture(self.module, self.loss_fn, batch, checkpoint_regions=self.config.checkpoint_regions)

    def _unpack(self, graph: TrainGraph, outputs: list[Any]) -> Any:
        loss = outputs[0]
        count = len(graph.grads)
        grads = dict(zip(graph.grads, outputs[1 : 1 + count]))
        buffers = dict(self.module.named_buffers(remove_duplicate=False)) if graph.buffer_updates else {}
        with torch.no_grad():
            for name, value in zip(graph.buffer_updates, outputs[1 + count :]):
                buffers[name].copy_(value)  # BatchNorm running stats: written back like eager
        return StepResult(loss=loss, grads=grads)


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

    def _unpack(self, graph: TrainGraph, outputs: list[Any]) -> Any:
        return EvalResult(loss=outputs[0], output=outputs[-1])


def compile_eval(module: nn.Module, loss_fn: LossFn, *example_batch: Any, **options: Any) -> EvalStep:
    """Capture the eval-mode forward of ``loss_fn(module, *example_batch)`` (loss and module output)."""
    step = EvalStep(module=module, loss_fn=loss_fn, config=StepConfig.from_options(options))
    step._for_batch(example_batch)
    return step


def compile(module: nn.Module, loss_fn: LossFn, *example_batch: Any, **options: Any) -> TrainStep:
    """Capture ``loss_fn(module, *example_batch)`` with its backward and return a TrainStep.

    Batch elements are tensors or dicts/tuples/lists of tensors (``loss_fn(module, batch)`` with a
    transformers collator's dict works); non-tensor leaves are static: a new value captures again.
    Options: see StepConfig (mirror, bulk, bulk_fwd, bulk_bwd, recapture, max_captures,
    measure_memory, checkpoint_regions).
    """
    config = StepConfig.from_options(options)
    step = TrainStep(module=module, loss_fn=loss_fn, config=config)
    step._for_batch(example_batch)
    return step

