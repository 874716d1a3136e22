"""Pieces of flat tensors: the stores cut values into slices of elements ``[start, stop)``."""

from __future__ import annotations

import torch


def elements(flat: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """``flat[start:stop]``; ``flat`` itself when that is all of it (most slices are: a view costs a microsecond)."""
    return flat if start == 0 and stop == flat.numel() else flat[start:stop]
