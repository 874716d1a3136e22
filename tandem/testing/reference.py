"""Eager PyTorch training, the reference that tandem's steps are compared against (tests, benches)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn


def eager_train(module: nn.Module, loss_fn: Callable[..., torch.Tensor], batch: tuple[Any, ...],
                optimizer: torch.optim.Optimizer, steps: int) -> list[float]:  # fmt: skip
    """``steps`` eager torch.optim steps on ``batch``; the loss of each."""
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = loss_fn(module, *batch)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses
