"""What AdamW and LAMB share: hyperparameters, state layout and the call into a fused update."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from tandem.ops.moments import check_adam_hyperparameters
from tandem.optim.optimizer import Optimizer

STATE_KEYS = ("exp_avg", "exp_avg_sq", "step")


class AdamFamily(Optimizer):
    """Base of Adam-style rules; subclasses are dataclasses with lr, betas, eps, weight_decay.

    Their config keys (lr, beta1, beta2, eps, weight_decay, ...) are exactly the keyword arguments
    of ``fused_update``, so one dict validates, serialises and drives the update.
    State: ``{"step": 0-dim float32 CPU tensor, "exp_avg": zeros, "exp_avg_sq": zeros}`` as in torch.
    """

    betas: tuple[float, float]
    eps: float
    weight_decay: float
    fused_update: Callable[..., None]

    def __post_init__(self) -> None:
        betas: Any = self.betas
        if not isinstance(betas, tuple | list) or len(betas) != 2:
            raise ValueError(f"{type(self).__name__}: betas must be a pair (beta1, beta2), got {betas!r}")
        self.betas = (betas[0], betas[1])
        check_adam_hyperparameters(type(self).__name__, **self.update_options())

    def update_options(self) -> dict[str, Any]:
        options = self.to_config()
        del options["name"]
        return options

    def create_state(self, param: Tensor) -> dict[str, Tensor]:
        return {
            # On CPU, as torch keeps it when not capturable: bias corrections read it every step.
            "step": torch.tensor(0.0, dtype=torch.float32),
            "exp_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
            "exp_avg_sq": torch.zeros_like(param, memory_format=torch.preserve_format),
        }

    def update(self, params: list[Tensor], grads: list[Tensor], states: list[dict[str, Tensor]]) -> None:
        self.check_states(params, grads, states)
        exp_avgs, exp_avg_sqs, steps = self.state_columns(states, STATE_KEYS)
        type(self).fused_update(params, grads, exp_avgs, exp_avg_sqs, steps, **self.update_options())
