"""A fast mini-batch iterator over a TensorDataset, and a reproducible DataLoader for any other.

Indexing whole tensors by a slice or an index vector costs one op per tensor per batch, where a
DataLoader pays a Python call and a collate per sample: for small models that overhead would
otherwise dominate the step being measured. Other map-style data sets (samples as tuples or dicts)
go through ``loader``: a DataLoader whose order, like ``batches``', depends only on (seed, epoch).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, Sampler, TensorDataset

from tandem.data.rng import generator


def shuffled_order(length: int, seed: int, epoch: int) -> Tensor:
    """The sample order of a shuffled epoch: depends only on (seed, epoch), never on the global RNG."""
    return torch.randperm(length, generator=generator(seed, epoch))


class Batches:
    """Re-iterable batches of a TensorDataset; each iteration yields the same batches in the same order.

    Not thread safe to share one iterator, but the object itself is immutable, so several threads
    may each iterate it. Shuffled order depends only on (seed, epoch): pass the epoch number to get
    a fresh but reproducible order every epoch. Made by ``batches``.

    Example:
        ```python
        train = tandem.data.batches(tandem.data.digits("train"), 64)
        len(train), [x.shape for x, y in train][0]     # (23, torch.Size([64, 1, 8, 8]))
        ```
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
                "wrap your tensors in TensorDataset (shard() of a TensorDataset stays one), "
                "or batch any other map-style Dataset with tandem.data.loader"
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
        order = shuffled_order(self.num_samples, self.seed, self.epoch) if self.shuffle else None
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

    Example:
        ```python
        for epoch in range(3):
            for x, y in tandem.data.batches(tandem.data.digits("train"), 64, shuffle=True, epoch=epoch):
                ...                      # x (64, 1, 8, 8) float32, y (64,) int64; 23 batches
        ```
    """
    return Batches(dataset, batch_size, shuffle, seed, epoch, drop_last)


class Permutation(Sampler[int]):
    """The sample indices of one epoch: ``range(length)``, or its permutation by ``(seed, epoch)``.

    Every iteration yields the same order (a DataLoader's own ``generator`` advances with each
    ``iter()``, so a loader iterated twice, or once more by a progress bar, would change order). The
    shuffled order is exactly ``batches``': a data set and the TensorDataset of its tensors batch alike.
    """

    def __init__(self, length: int, shuffle: bool = False, seed: int = 0, epoch: int = 0) -> None:
        self.length, self.shuffle, self.seed, self.epoch = length, shuffle, seed, epoch

    def __len__(self) -> int:
        return self.length

    def __iter__(self) -> Iterator[int]:
        if not self.shuffle:
            return iter(range(self.length))
        return iter(shuffled_order(self.length, self.seed, self.epoch).tolist())


def loader(
    dataset: Dataset[Any],
    batch_size: int,
    *,
    shuffle: bool = False,
    seed: int = 0,
    epoch: int = 0,
    drop_last: bool = False,
) -> DataLoader[Any]:
    """A single-process ``DataLoader`` over any map-style ``dataset`` (``__len__`` and ``__getitem__``).

    Default collate: samples ``(x, y)`` give batches ``[X, Y]``, dict samples a dict of stacked
    tensors. Like ``batches``, it is re-iterable with the same batches every time, the shuffled
    order (the same as ``batches``') depends only on ``(seed, epoch)``, and it never draws from the
    global RNG, so data loading leaves dropout's stream alone.

    Example:
        ```python
        for batch in tandem.data.loader(tandem.data.pydoc_text("train"), 32, shuffle=True, epoch=0):
            batch["input_ids"].shape     # (32, 64); also "attention_mask" and "labels"
        ```
    """
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"loader: batch_size={batch_size!r} must be a positive int")
    order = Permutation(len(dataset), shuffle, seed, epoch)  # type: ignore[arg-type]
    # every iter() draws a worker base seed (unused: no workers) from this generator, not the global RNG
    return DataLoader(dataset, batch_size=batch_size, sampler=order, drop_last=drop_last,
                      generator=generator(seed, epoch))
