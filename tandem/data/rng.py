"""Deterministic random generators derived from integer keys such as (seed, epoch)."""

from __future__ import annotations

import numpy as np
import torch


def generator(*keys: int) -> torch.Generator:
    """A CPU generator seeded from ``keys``; distinct key tuples give unrelated streams.

    SeedSequence mixes the keys, so (seed=1, epoch=0) and (seed=0, epoch=1) do not collide the way
    ``seed + epoch`` would.
    """
    if any(key < 0 for key in keys):
        raise ValueError(f"seeds must be non-negative integers, got {keys}")
    state = np.random.SeedSequence(list(keys)).generate_state(1, dtype=np.uint64)[0]
    return torch.Generator().manual_seed(int(state))
