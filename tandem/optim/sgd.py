"""SGD with momentum, dampening, Nesterov and weight decay, equal to ``torch.optim.SGD``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch import Tensor

from tandem.ops.sgd import SGDHyperparameters, multi_sgd_update
from tandem.optim.optimizer import Optimizer


@dataclass
class SGD(Optimizer):
    """SGD with momentum, dampening, Nesterov and weight decay, equal to ``torch.optim.SGD``.

    State: ``{}`` until the first momentum step, then ``{"momentum_buffer": tensor}``.

    The buffer is created by the first update and holds that step's gradient, as torch does, so
    dampening never applies to the first step. With momentum 0 the state stays empty.
    ``fused=True`` runs torch's single-pass kernel (faster; equal to the default to a few ulps).

    Example:
        ```python
        trainer = tandem.Trainer(model, loss_fn, tandem.optim.SGD(lr=0.05, momentum=0.9, weight_decay=5e-4))
        ```
    """

    name: ClassVar[str] = "sgd"
    lr: float
    momentum: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False
    dampening: float = 0.0
    fused: bool = False  # torch's single-pass kernel: faster, equal to the foreach path to a few ulps

    def __post_init__(self) -> None:
        SGDHyperparameters("SGD", self.lr, self.momentum, self.weight_decay, self.nesterov, self.dampening, self.fused)

    def create_state(self, param: Tensor) -> dict[str, Tensor]:
        return {}

    def update(self, params: list[Tensor], grads: list[Tensor], states: list[dict[str, Tensor]]) -> None:
        self.check_states(params, grads, states)
        buffers: list[Tensor | None] = [state.get("momentum_buffer") for state in states] if self.momentum else []
        multi_sgd_update(
            params,
            grads,
            buffers,
            lr=self.lr,
            momentum=self.momentum,
            weight_decay=self.weight_decay,
            nesterov=self.nesterov,
            dampening=self.dampening,
            fused=self.fused,
        )
        for state, buffer in zip(states, buffers):
            if buffer is not None:
                state["momentum_buffer"] = buffer
