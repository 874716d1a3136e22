"""The Adam moment updates shared by AdamW and LAMB, in torch's foreach formula order.

Torch's ``_multi_tensor_adam``: steps += 1; exp_avg.lerp_(grad, 1 - beta1);
exp_avg_sq.mul_(beta2).addcmul_(grad, grad, 1 - beta2); bias corrections as Python floats from
each step; denominator sqrt(exp_avg_sq) / sqrt(1 - beta2^t) + eps. Keeping the same order makes
tandem's results equal to torch's, not merely close.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from tandem.ops.scalars import check_flag, check_number
from tandem.ops.tensor_lists import Group, GroupKey, group_by_device_and_dtype

# One CPU tensor reused for every increment: torch wraps a Python 1 into a new tensor per CPU step.
_ONE = torch.tensor(1.0)


def check_adam_hyperparameters(
    op: str, *, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, fused: bool = False
) -> None:
    check_flag(op, "fused", fused)
    check_number(op, "lr", lr, lambda value: value >= 0, ">= 0")
    check_number(op, "beta1", beta1, lambda value: 0 <= value < 1, "in [0, 1)")
    check_number(op, "beta2", beta2, lambda value: 0 <= value < 1, "in [0, 1)")
    check_number(op, "eps", eps, lambda value: value > 0, "> 0")
    check_number(op, "weight_decay", weight_decay, lambda value: value >= 0, ">= 0")


def adam_groups(
    op: str,
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    steps: Sequence[Tensor],
) -> dict[GroupKey, Group]:
    """Checked (device, dtype) groups; columns are params, grads, exp_avgs, exp_avg_sqs, steps."""
    named = {"params": params, "grads": grads, "exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs, "steps": steps}
    return group_by_device_and_dtype(op, named, counters={"steps"})


def _step_values(steps: list[Tensor]) -> list[float]:
    """All step counts with one host transfer when they share a device, else one per step."""
    if all(step.device == steps[0].device for step in steps):
        return torch.stack(steps).tolist()
    return [step.item() for step in steps]


def increment_steps(steps: list[Tensor]) -> None:
    torch._foreach_add_(steps, _ONE, alpha=1.0)


def steps_on(device: torch.device, steps: list[Tensor]) -> list[Tensor]:
    """The steps as tensors on ``device`` (torch's fused kernels read them there), one copy for all."""
    if all(step.device == device for step in steps):
        return steps
    return list(torch.stack([step.to(device) for step in steps]).unbind())


def advance_moments(
    steps: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor], beta1: float, beta2: float
) -> tuple[list[float], list[float]]:
    """Increment the steps, update both moments in place; return (1 - beta1^t, sqrt(1 - beta2^t)) per tensor."""
    increment_steps(steps)
    torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
    values = _step_values(steps)
    bias_corrections1 = [1 - beta1**step for step in values]
    bias_corrections2_sqrt = [(1 - beta2**step) ** 0.5 for step in values]
    return bias_corrections1, bias_corrections2_sqrt


def denominators(exp_avg_sqs: list[Tensor], bias_corrections2_sqrt: list[float], eps: float) -> list[Tensor]:
    """sqrt(exp_avg_sq) / sqrt(1 - beta2^t) + eps, as new tensors."""
    result = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(result, bias_corrections2_sqrt)
    torch._foreach_add_(result, eps)
    return list(result)
