"""``multi_sgd_update``: one SGD (momentum, Nesterov) step over many parameters.

MXNet's ``multi_sgd_mom_update`` with torch.optim.SGD's semantics: the first momentum step sets
the buffer to the gradient itself (no dampening), later steps buf = momentum * buf + (1 - dampening) * grad.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from tandem.ops.scalars import check_number
from tandem.ops.tensor_lists import group_by_device_and_dtype


def check_sgd_hyperparameters(
    where: str, *, lr: float, momentum: float, weight_decay: float, nesterov: bool, dampening: float
) -> None:
    check_number(where, "lr", lr, lambda value: value >= 0, ">= 0")
    check_number(where, "momentum", momentum, lambda value: value >= 0, ">= 0")
    check_number(where, "weight_decay", weight_decay, lambda value: value >= 0, ">= 0")
    check_number(where, "dampening", dampening, lambda value: 0 <= value <= 1, "in [0, 1]")
    if not isinstance(nesterov, bool):
        raise TypeError(f"{where}: nesterov must be a bool, got {type(nesterov).__name__}")
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError(f"{where}: nesterov=True needs momentum > 0 and dampening 0 (got {momentum}, {dampening})")


def _advance_buffers(buffers: list[Tensor | None], grads: list[Tensor], momentum: float, dampening: float) -> list[Tensor]:
    """Update the buffers in place, cloning the gradient into missing ones; return them all."""
    if all(buffer is not None for buffer in buffers):
        present = [buffer for buffer in buffers if buffer is not None]
        torch._foreach_mul_(present, momentum)
        torch._foreach_add_(present, grads, alpha=1 - dampening)
        return present
    result = []
    for buffer, grad in zip(buffers, grads):
        if buffer is None:
            result.append(grad.detach().clone())
        else:
            result.append(buffer.mul_(momentum).add_(grad, alpha=1 - dampening))
    return result


@torch.no_grad()
def multi_sgd_update(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    momentum_buffers: list[Tensor | None],
    *,
    lr: float,
    momentum: float = 0.0,
    weight_decay: float = 0.0,
    nesterov: bool = False,
    dampening: float = 0.0,
) -> None:
    """Update params (and momentum buffers) in place, equal to ``torch.optim.SGD(foreach=True)``.

    ``momentum_buffers[i]`` is None before the first momentum step; it is then replaced in the
    list by a new buffer holding the gradient. With momentum 0 the buffers are ignored and may be
    an empty list. Gradients are never modified. Synchronous on CPU; not thread safe against
    concurrent users of the same tensors. Empty lists are a no-op.
    """
    check_sgd_hyperparameters(
        "multi_sgd_update", lr=lr, momentum=momentum, weight_decay=weight_decay, nesterov=nesterov, dampening=dampening
    )
    named: dict[str, Sequence[Tensor | None]] = {"params": params, "grads": grads}
    if momentum != 0:
        if not isinstance(momentum_buffers, list):
            raise TypeError(
                "multi_sgd_update: momentum_buffers must be a list (new buffers are stored into it), "
                f"got {type(momentum_buffers).__name__}"
            )
        named["momentum_buffers"] = momentum_buffers
    for group in group_by_device_and_dtype("multi_sgd_update", named, nullable={"momentum_buffers"}).values():
        group_params, group_grads = group.columns[0], group.columns[1]
        if weight_decay != 0:
            group_grads = list(torch._foreach_add(group_grads, group_params, alpha=weight_decay))
        if momentum != 0:
            buffers = _advance_buffers(group.columns[2], group_grads, momentum, dampening)
            for index, buffer in zip(group.indices, buffers):
                momentum_buffers[index] = buffer
            # Out of place, unlike torch, so the caller's gradients stay untouched.
            group_grads = list(torch._foreach_add(group_grads, buffers, alpha=momentum)) if nesterov else buffers
        torch._foreach_add_(group_params, group_grads, alpha=-lr)
