"""``multi_adamw_update``: one AdamW step over many parameters (MXNet's ``multi_adamw_update``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from tandem.ops.moments import (
    adam_groups,
    advance_moments,
    check_adam_hyperparameters,
    denominators,
    increment_steps,
    steps_on,
)


@torch.no_grad()
def multi_adamw_update(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    steps: Sequence[Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    fused: bool = False,
) -> None:
    """Update params, both moments and the steps in place, equal to ``torch.optim.AdamW(foreach=True)``.

    Lists are aligned by index; ``steps[i]`` is a 0-dim float tensor (torch's ``state['step']``)
    that is incremented. One foreach call per op per (device, dtype) group. Synchronous on CPU;
    not thread safe against concurrent users of the same tensors. Empty lists are a no-op.

    ``fused=True`` runs torch's single-pass kernel (``torch._fused_adamw_``, as
    ``AdamW(fused=True)``) instead: one read and write of each tensor rather than about eight
    foreach passes, several times faster where memory bandwidth bounds the step (CPU). Results
    then equal the foreach path to a few ulps, not bit for bit (bfloat16 is computed in float32).
    """
    check_adam_hyperparameters(
        "multi_adamw_update", lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, fused=fused
    )
    for (device, _), group in adam_groups("multi_adamw_update", params, grads, exp_avgs, exp_avg_sqs, steps).items():
        group_params, group_grads, group_exp_avgs, group_exp_avg_sqs, group_steps = group.columns
        if fused:
            increment_steps(group_steps)
            torch._fused_adamw_(
                group_params, group_grads, group_exp_avgs, group_exp_avg_sqs, [], steps_on(device, group_steps),
                amsgrad=False, lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps, maximize=False,
            )
            continue
        if weight_decay != 0:
            # Decoupled weight decay: shrink the weights, leave the gradient alone.
            torch._foreach_mul_(group_params, 1 - lr * weight_decay)
        bias_corrections1, bias_corrections2_sqrt = advance_moments(
            group_steps, group_grads, group_exp_avgs, group_exp_avg_sqs, beta1, beta2
        )
        step_sizes = [(lr / correction) * -1 for correction in bias_corrections1]
        denominator = denominators(group_exp_avg_sqs, bias_corrections2_sqrt, eps)
        torch._foreach_addcdiv_(group_params, group_exp_avgs, denominator, step_sizes)
