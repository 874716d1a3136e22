"""A fast mini-batch iterator over a TensorDataset.

Indexing whole tensors by a slice or an index vector costs one op per tensor per batch, where a
DataLoader pays a Python call and a collate per sample: for small models that overhead would
otherwise dominate the step being measured.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor
from torch.utils.data import TensorDataset

from tandem.data.rng import generator


class Batches:
    """Re-iterable batches of a TensorDataset; each iteration yields the same batches in the same order.

    Not thread safe to share one iterator, but the object itself is immutable, so several threads
    may each iterate it. Shuffled order depends only on (seed, epoch): pass the epoch number to get
    a fresh but reproducible order every epoch.
    """

    def __init__(
        self,
        dataset: TensorDataset,
        batch_size: int,
        shuffle: bool = False,
        seed: int = 0,
        epoch: int = 0,
        drop_last: bool = False,
    ) -> None:
        if not isinstance(dataset, TensorDataset):
            raise TypeError(
                f"batches needs a torch.utils.data.TensorDataset, got {type(dataset).__name__}; "
                "wrap your tensors in TensorDataset (shard() of a TensorDataset stays one)"
            )
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batches: batch_size={batch_size!r} must be a positive int")
        self.tensors = dataset.tensors
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = epoch
        self.drop_last = drop_last
        self.num_samples = len(dataset.tensors[0]) if dataset.tensors else 0

    def __len__(self) -> int:
        if self.drop_last:
            return self.num_samples // self.batch_size
        return -(-self.num_samples // self.batch_size)

    def __iter__(self) -> Iterator[tuple[Tensor, ...]]:
        order = (
            torch.randperm(self.num_samples, generator=generator(self.seed, self.epoch))
            if self.shuffle
            else None
        )
        for index in range(len(self)):
            start = index * self.batch_size
            end = min(start + self.batch_size, self.num_samples)
            if order is None:
                yield tuple(tensor[start:end] for tensor in self.tensors)
            else:
                yield tuple(tensor[order[start:end]] for tensor in self.tensors)


def batches(
    dataset: TensorDataset,
    batch_size: int,
    *,
    shuffle: bool = False,
    seed: int = 0,
    epoch: int = 0,
    drop_last: bool = False,
) -> Batches:
    """Mini-batches of ``dataset`` as tuples of tensors; ``len()`` gives the number of batches.

    Unshuffled batches are views (slices); shuffled ones are gathered copies. The last batch is
    smaller unless ``drop_last``.
    """
    return Batches(dataset, batch_size, shuffle, seed, epoch, drop_last)
