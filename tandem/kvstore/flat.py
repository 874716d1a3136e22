"""Pieces of flat tensors: the stores cut values into slices of elements ``[start, stop)``."""

from __future__ import annotations

import torch


def elements(flat: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """``flat[start:stop]``; ``flat`` itself when that is all of it (most slices are: a view costs a microsecond)."""
    return flat if start == 0 and stop == flat.numel() else flat[start:stop]


def flat_view(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as one dimension, detached: itself where it already is (a bias, a norm's weight: two
    torch calls saved per key and step), else ``reshape``'s view where one exists, else a copy."""
    if tensor.dim() == 1 and not tensor.requires_grad and tensor.is_contiguous():
        return tensor
    return tensor.detach().reshape(-1)
