"""``multi_lamb_update``: one LAMB step over many parameters (MXNet's ``multi_lamb_update``).

LAMB (You et al., 2019) takes Adam's bias-corrected direction plus weight decay and rescales it
per tensor by the trust ratio ||w|| / ||update||, so every layer moves by a similar relative amount
whatever its gradient scale. The ratio is 1 when either norm is 0 (fresh zero weights, zero update).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from tandem.ops.moments import adam_groups, advance_moments, check_adam_hyperparameters, denominators
from tandem.ops.norm import accumulation_dtype


def trust_ratios(weights: list[Tensor], updates: list[Tensor], dtype: torch.dtype) -> list[Tensor]:
    """||w|| / ||update|| per tensor as 0-dim tensors (1 where either is 0), with no host sync."""
    accumulate = accumulation_dtype(dtype)
    weight_norms = torch.stack(torch._foreach_norm(weights, 2, dtype=accumulate))
    update_norms = torch.stack(torch._foreach_norm(updates, 2, dtype=accumulate))
    usable = (weight_norms > 0) & (update_norms > 0)
    ratios = torch.where(usable, weight_norms / update_norms, torch.ones_like(weight_norms))
    return list(ratios.unbind())


@torch.no_grad()
def multi_lamb_update(
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
) -> None:
    """Update params, both moments and the steps in place with LAMB (bias correction on).

    update = m_hat / (sqrt(v_hat) + eps) + weight_decay * w;  w -= lr * ratio * update, with
    ratio = ||w|| / ||update|| per tensor (1 when either norm is 0). Lists and steps as in
    ``multi_adamw_update``. Synchronous on CPU; not thread safe against concurrent users of the
    same tensors. Empty lists are a no-op.
    """
    check_adam_hyperparameters("multi_lamb_update", lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay)
    groups = adam_groups("multi_lamb_update", params, grads, exp_avgs, exp_avg_sqs, steps)
    for (_, dtype), group in groups.items():
        group_params, group_grads, group_exp_avgs, group_exp_avg_sqs, group_steps = group.columns
        bias_corrections1, bias_corrections2_sqrt = advance_moments(
            group_steps, group_grads, group_exp_avgs, group_exp_avg_sqs, beta1, beta2
        )
        updates = torch._foreach_div(group_exp_avgs, denominators(group_exp_avg_sqs, bias_corrections2_sqrt, eps))
        torch._foreach_div_(updates, bias_corrections1)
        if weight_decay != 0:
            torch._foreach_add_(updates, group_params, alpha=weight_decay)
        torch._foreach_mul_(updates, trust_ratios(group_params, list(updates), dtype))
        torch._foreach_add_(group_params, updates, alpha=-lr)
