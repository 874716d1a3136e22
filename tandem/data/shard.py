"""Split a data set into disjoint per-rank shards for data-parallel training."""

from __future__ import annotations

from typing import Any

from torch.utils.data import Dataset, Subset, TensorDataset


def shard_bounds(length: int, rank: int, world_size: int) -> tuple[int, int]:
    """[start, end) of ``rank``'s contiguous shard; shard sizes differ by at most one."""
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"shard: world_size={world_size!r} must be a positive int")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"shard: rank={rank!r} must be an int in [0, world_size={world_size})")
    return rank * length // world_size, (rank + 1) * length // world_size


def shard(dataset: Dataset[Any], rank: int, world_size: int) -> Dataset[Any]:
    """The ``rank``-th of ``world_size`` contiguous shards; together they hold every sample exactly once.

    A TensorDataset shards into a TensorDataset of views (no copy, and ``batches`` still works);
    any other sized dataset into a ``Subset``. Shuffle within a shard with ``batches(shuffle=True)``.
    ``Trainer.fit`` shards a Dataset by rank itself in distributed training.

    Example:
        ```python
        mine = tandem.data.shard(tandem.data.digits("train"), rank=0, world_size=2)   # 718 of 1437 samples
        ```
    """
    start, end = shard_bounds(len(dataset), rank, world_size)  # type: ignore[arg-type]
    return contiguous(dataset, start, end)


def contiguous(dataset: Dataset[Any], start: int, end: int) -> Dataset[Any]:
    """Samples ``[start, end)`` of ``dataset``: a TensorDataset of views for a TensorDataset (still
    batched by slicing), a ``Subset`` of anything else."""
    if isinstance(dataset, TensorDataset):
        return TensorDataset(*(tensor[start:end] for tensor in dataset.tensors))
    return Subset(dataset, range(start, end))
