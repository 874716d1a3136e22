"""The models, batches and references of the collective kvstore's tests (imported by the test and its job scripts)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from tandem import models

Batch = tuple[Any, ...]


def model_and_batch(name: str, batch_size: int) -> tuple[nn.Module, Callable[..., torch.Tensor], Batch]:
    """A float64 tiny model (seeded: the same weights in every process), its loss and a fixed batch."""
    torch.manual_seed(0)
    if name in models.LIBRARY:  # a transformers LM: dict batches of bytes, the model's own loss
        entry = models.LIBRARY[name]
        module = entry.build(n_positions=16).double()
        tokens = torch.randint(0, 256, (batch_size, 16), generator=torch.Generator().manual_seed(1))
        return module, entry.loss_fn, ({"input_ids": tokens, "attention_mask": torch.ones_like(tokens), "labels": tokens},)
    zoo = models.ZOO[name]
    module = zoo.build(**zoo.tiny).double()
    return module, zoo.loss_fn, zoo.make_batch(batch_size, torch.Generator().manual_seed(1), dtype=torch.float64, **zoo.tiny)


def rows(batch: Batch, rank: int, workers: int) -> Batch:
    """This worker's equal share of every tensor of ``batch`` (dicts too)."""
    size = len(batch[0]["input_ids"]) if isinstance(batch[0], dict) else len(batch[0])
    part = slice(rank * size // workers, (rank + 1) * size // workers)
    return tuple({k: v[part] for k, v in item.items()} if isinstance(item, dict) else item[part] for item in batch)


def train_eagerly(module: nn.Module, loss_fn: Callable[..., torch.Tensor], batch: Batch, steps: int) -> dict[str, torch.Tensor]:
    """``steps`` of torch.optim.SGD (lr 0.1, momentum 0.9) on ``batch`` in plain PyTorch; ``module`` may be a DDP."""
    inner = getattr(module, "module", module)
    optimizer = torch.optim.SGD(inner.parameters(), lr=0.1, momentum=0.9)
    for _ in range(steps):
        optimizer.zero_grad()
        loss_fn(module, *batch).backward()
        optimizer.step()
    return {name: value.detach().clone() for name, value in inner.named_parameters()}
