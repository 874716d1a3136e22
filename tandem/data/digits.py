"""The UCI handwritten digits shipped inside scikit-learn: a real data set with no download.

1797 images of 8x8 pixels with values 0..16, ten classes. Small enough for tests, real enough that
reaching high accuracy means training works.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch
from torch.utils.data import TensorDataset

PIXEL_MAX = 16.0  # the digits' pixel values run 0..16


@lru_cache(maxsize=1)
def _load() -> tuple[np.ndarray, np.ndarray]:
    # Imported lazily: scikit-learn is slow to import and only this function needs it.
    from sklearn.datasets import load_digits

    bunch = load_digits()
    return (bunch.images / PIXEL_MAX).astype(np.float32), bunch.target.astype(np.int64)


@lru_cache(maxsize=8)
def _split(test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    from sklearn.model_selection import train_test_split

    _, labels = _load()
    train, test = train_test_split(
        np.arange(len(labels)), test_size=test_fraction, stratify=labels, random_state=seed
    )
    # Sorted: a split is a set of samples; shuffling is the batch iterator's job.
    return np.sort(train), np.sort(test)


def digits(
    split: str = "train", test_fraction: float = 0.2, seed: int = 0, flat: bool = False
) -> TensorDataset:
    """A deterministic, stratified split of the sklearn digits as ``TensorDataset(images, labels)``.

    Pixels are scaled to [0, 1] and then standardised with the mean and std of the *train* split
    (so the test split sees no statistics of its own). Images are float32 (N, 1, 8, 8), or (N, 64)
    when ``flat``; labels are int64. The same (test_fraction, seed) always gives the same split.

    Example:
        ```python
        train, test = tandem.data.digits("train"), tandem.data.digits("test")   # 1437 / 360 samples
        images, labels = train.tensors                                          # (1437, 1, 8, 8), (1437,)
        ```
    """
    if split not in ("train", "test"):
        raise ValueError(f"digits: split={split!r} must be 'train' or 'test'")
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"digits: test_fraction={test_fraction} must lie strictly between 0 and 1")
    images, labels = _load()
    train, test = _split(test_fraction, seed)
    mean, std = images[train].mean(), images[train].std()
    chosen = train if split == "train" else test
    normalised = torch.from_numpy((images[chosen] - mean) / std)
    shape = (len(chosen), 64) if flat else (len(chosen), 1, 8, 8)
    return TensorDataset(normalised.reshape(shape).contiguous(), torch.from_numpy(labels[chosen]))
