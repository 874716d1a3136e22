"""Training alone: the step's gradients are applied in one engine op, and the step waits for it."""

from __future__ import annotations

from functools import partial

from tandem.step import StepResult
from tandem.update.base import Update


class LocalUpdate(Update):
    """One engine op runs the fused update of every parameter; segments reading a parameter wait on
    its var. ``after_backward`` returns once the parameters are written (like torch's ``step()``)."""

    def after_backward(self, result: StepResult) -> None:
        names = list(result.grads)
        self.write(names, partial(self.apply, names, result.grads), "fused optimizer update")
        self.flush()  # sync point: like torch, parameters are updated when step() returns
