"""``multi_sgd_update``: one SGD (momentum, Nesterov) step over many parameters.

MXNet's ``multi_sgd_mom_update`` with torch.optim.SGD's semantics: the first momentum step sets
the buffer to the gradient itself (no dampening), later steps buf = momentum * buf + (1 - dampening) * grad.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from tandem.ops.scalars import check_flag, check_number
from tandem.ops.tensor_lists import group_by_device_and_dtype


@dataclass(frozen=True)
class SGDHyperparameters:
    """Validated on construction, with ``where`` naming the caller in every message."""

    where: str
    lr: float
    momentum: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False
    dampening: float = 0.0
    fused: bool = False

    def __post_init__(self) -> None:
        check_number(self.where, "lr", self.lr, lambda value: value >= 0, ">= 0")
        check_number(self.where, "momentum", self.momentum, lambda value: value >= 0, ">= 0")
        check_number(self.where, "weight_decay", self.weight_decay, lambda value: value >= 0, ">= 0")
        check_number(self.where, "dampening", self.dampening, lambda value: 0 <= value <= 1, "in [0, 1]")
        check_flag(self.where, "nesterov", self.nesterov)
        check_flag(self.where, "fused", self.fused)
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise ValueError(
                f"{self.where}: nesterov=True needs momentum > 0 and dampening 0 "
                f"(got momentum={self.momentum}, dampening={self.dampening})"
            )


def _advance_buffers(buffers: list[Tensor | None], grads: list[Tensor], momentum: float, dampening: float) -> list[Tensor]:
    """Update the buffers in place, cloning the gradient into missing ones; return them all."""
    present = [buffer for buffer in buffers if buffer is not None]
    if len(present) == len(buffers):
        torch._foreach_mul_(present, momentum)
        torch._foreach_add_(present, grads, alpha=1 - dampening)
        return present
    return [
        grad.detach().clone() if buffer is None else buffer.mul_(momentum).add_(grad, alpha=1 - dampening)
        for buffer, grad in zip(buffers, grads)
    ]


def _foreach_step(params: list[Tensor], grads: list[Tensor], buffers: list[Tensor | None], hyper: SGDHyperparameters) -> list[Tensor]:
    """torch's ``_multi_tensor_sgd`` order for one group; returns the (new) momentum buffers."""
    if hyper.weight_decay != 0:
        grads = list(torch._foreach_add(grads, params, alpha=hyper.weight_decay))
    new_buffers: list[Tensor] = []
    if hyper.momentum != 0:
        new_buffers = _advance_buffers(buffers, grads, hyper.momentum, hyper.dampening)
        # Out of place, unlike torch, so the caller's gradients stay untouched.
        grads = list(torch._foreach_add(grads, new_buffers, alpha=hyper.momentum)) if hyper.nesterov else new_buffers
    torch._foreach_add_(params, grads, alpha=-hyper.lr)
    return new_buffers


def _fused_step(params: list[Tensor], grads: list[Tensor], buffers: list[Tensor | None], hyper: SGDHyperparameters) -> list[Tensor]:
    """One ``torch._fused_sgd_`` over a group; falls back to foreach when only some buffers exist yet."""
    present = [buffer for buffer in buffers if buffer is not None]
    first_step = hyper.momentum != 0 and not present
    if first_step:
        present = [torch.empty_like(grad) for grad in grads]  # the kernel copies the gradient in
    elif len(present) != len(buffers):
        return _foreach_step(params, grads, buffers, hyper)
    torch._fused_sgd_(
        params, grads, present, weight_decay=hyper.weight_decay, momentum=hyper.momentum, lr=hyper.lr,
        dampening=hyper.dampening, nesterov=hyper.nesterov, maximize=False, is_first_step=first_step,
    )
    return present


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
    fused: bool = False,
) -> None:
    """Update params (and momentum buffers) in place, equal to ``torch.optim.SGD(foreach=True)``.

    ``momentum_buffers[i]`` is None before the first momentum step; it is then replaced in the
    list by a new buffer holding the gradient. With momentum 0 the buffers are ignored and may be
    an empty list. Gradients are never modified. Synchronous on CPU; not thread safe against
    concurrent users of the same tensors. Empty lists are a no-op.

    ``fused=True`` runs torch's single-pass kernel (``torch._fused_sgd_``, as ``SGD(fused=True)``):
    equal to the foreach path to a few ulps, not bit for bit (bfloat16 is computed in float32).
    """
    hyper = SGDHyperparameters("multi_sgd_update", lr, momentum, weight_decay, nesterov, dampening, fused)
    named: dict[str, Sequence[Tensor | None]] = {"params": params, "grads": grads}
    if momentum != 0:
        if not isinstance(momentum_buffers, list):
            raise TypeError(
                "multi_sgd_update: momentum_buffers must be a list (new buffers are stored into it), "
                f"got {type(momentum_buffers).__name__}"
            )
        named["momentum_buffers"] = momentum_buffers
    step = _fused_step if fused else _foreach_step
    for group in group_by_device_and_dtype("multi_sgd_update", named, nullable={"momentum_buffers"}).values():
        buffers = group.columns[2] if momentum != 0 else []
        new_buffers = step(group.columns[0], group.columns[1], buffers, hyper)
        for index, buffer in zip(group.indices, new_buffers):
            momentum_buffers[index] = buffer
