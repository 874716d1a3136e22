"""The interface of a parameter update, and the per-parameter engine vars every update shares.

An update is built from the parameters (name -> tensor; a tied parameter under its first name) and
an apply function, ``apply(names, grads)``: the fused optimizer update of those parameters
(``OptimizerApply``). Each parameter has an engine var: an op that writes the parameter writes its
var, and every segment of a step that reads the parameter reads it (``StepHooks.parameter_vars``),
so the engine orders the writes against exactly the segments that need them.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping
from typing import Any

import torch

from tandem.engine import get_engine
from tandem.executor import Segment, StepHooks
from tandem.step import StepResult, TrainStep

Apply = Callable[[list[str], dict[str, torch.Tensor]], None]  # apply(names, grads): update those parameters


class Update(abc.ABC):
    """How a step's gradients become the parameters. Driven by the training thread; the ops it pushes
    run on the engine's.

    The step runs with ``hooks(step)``; ``after_backward(result)`` follows it; ``flush()`` returns once
    every parameter holds its value (before the parameters are read outside a step).
    """

    def __init__(self, params: Mapping[str, torch.Tensor], apply: Apply, store: Any = None) -> None:
        self.params = dict(params)
        self.apply = apply
        self.store = store  # the distributed KVStore, or None when training alone
        self.engine = get_engine()
        self.vars = {name: self.engine.new_var(f"param {name}") for name in self.params}
        self._writes_pushed = False  # engine ops writing parameters may be queued (see write, flush)
        self._step_hooks = StepHooks(parameter_vars=self.vars, before_segment=self._before_segment(),
                                     before_measured_run=self.flush)  # fmt: skip

    # -- what the trainer sees -----------------------------------------------------------------------
    @property
    def rank(self) -> int:
        """This worker's rank in a distributed job (0 when training alone)."""
        return self.store.rank if self.store is not None else 0

    @property
    def num_workers(self) -> int:
        return self.store.num_workers if self.store is not None else 1

    def shard(self, dataset: Any) -> Any:
        """This worker's part of ``dataset`` (all of it when training alone)."""
        return dataset

    def hooks(self, step: TrainStep) -> StepHooks:
        """What this update adds to the runs of ``step``: the parameters' vars, the call before each
        segment, and a flush before a measured run (it bypasses the engine)."""
        return self._step_hooks

    @abc.abstractmethod
    def after_backward(self, result: StepResult) -> None:
        """After a step's run: its gradients go to the parameters (now, or by ops the next step waits for)."""

    def flush(self) -> None:
        """Until every parameter holds its value: no write of one is pending."""
        self.wait_for_writes()

    def close(self) -> None:
        self.flush()

    # -- for the updates -----------------------------------------------------------------------------
    def _before_segment(self) -> Callable[[Segment], None] | None:
        """The call before each segment is pushed (StepHooks.before_segment), if the update needs one."""
        return None

    def write(self, names: list[str], function: Callable[[], None], label: str) -> None:
        """Push an engine op that writes the parameters ``names``: it runs after this step's readers of
        them, and the next step's segments that read them wait for it."""
        self.engine.push(function, writes=tuple(self.vars[name] for name in names), name=label)
        self._writes_pushed = True

    def wait_for_writes(self) -> None:
        """Until every engine op writing a parameter (``write``) has run."""
        for var in self.vars.values():
            self.engine.wait(var)
        self._writes_pushed = False


class OptimizerApply:
    """The fused optimizer update as an apply function: ``apply(names, grads)`` clips the gradients
    (``clip_grad_norm``, one fused op) and applies the optimizer to those parameters in one call.

    ``optimizer`` is a tandem.optim update rule (its per-parameter state in ``states``, created on
    first use) or a torch.optim.Optimizer bound to the parameters (gradients go to ``p.grad``).
    """

    def __init__(self, params: Mapping[str, torch.Tensor], optimizer: Any, clip_grad_norm: float | None = None) -> None:
        self.params = params
        self.optimizer = optimizer
        self.clip_grad_norm = clip_grad_norm
        self.states: dict[str, dict[str, torch.Tensor]] = {}

    @torch.no_grad()
    def __call__(self, names: list[str], grads: dict[str, torch.Tensor]) -> None:
        if self.clip_grad_norm is not None:
            from tandem.ops import clip_global_norm

            clip_global_norm([grads[n] for n in names], self.clip_grad_norm)
        if isinstance(self.optimizer, torch.optim.Optimizer):
            # step() updates every parameter holding a .grad: clear those of earlier calls (a distributed
            # update applies one segment's parameters at a time), or they would be stepped again
            self.optimizer.zero_grad(set_to_none=True)
            for name in names:
                self.params[name].grad = grads[name]
            self.optimizer.step()
            return
        params = [self.params[n] for n in names]
        for name, param in zip(names, params):
            if name not in self.states:
                self.states[name] = self.optimizer.create_state(param)
        self.optimizer.update(params, [grads[n] for n in names], [self.states[n] for n in names])
