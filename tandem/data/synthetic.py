"""Synthetic, learnable data sets of any size and shape, deterministic by seed.

Learnable on purpose: a model that beats chance on them shows that training moves the weights the
right way, which random labels could never show.
"""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset

from tandem.data.rng import generator

MEAN_SCALE = 0.5  # class means ~ N(0, 0.5^2) per pixel against unit noise: separable, not trivial
TOKEN_PERIOD = 16  # length of the repeated token pattern
TOKEN_NOISE = 0.1  # chance that a token is replaced by a random one


def synthetic_images(
    n: int, shape: tuple[int, ...] = (3, 32, 32), num_classes: int = 10, seed: int = 0
) -> TensorDataset:
    """``TensorDataset(images float32 (n, *shape), labels int64 (n,))``: class mean image + unit noise.

    Example:
        ```python
        train = tandem.data.synthetic_images(4096, shape=(3, 32, 32), seed=0)
        test = tandem.data.synthetic_images(512, seed=1)
        ```
    """
    if n < 0 or num_classes < 1 or not shape or min(shape) < 1:
        raise ValueError(
            f"synthetic_images: n={n}, shape={shape}, num_classes={num_classes} must be positive"
        )
    rng = generator(seed)
    means = MEAN_SCALE * torch.randn(num_classes, *shape, generator=rng)
    labels = torch.randint(num_classes, (n,), generator=rng)
    return TensorDataset(means[labels] + torch.randn(n, *shape, generator=rng), labels)


def synthetic_tokens(n: int, seq_len: int = 64, vocab_size: int = 512, seed: int = 0) -> TensorDataset:
    """``TensorDataset(tokens, targets)``, both int64 (n, seq_len), targets = tokens shifted by one.

    Each row walks a fixed pattern of distinct tokens (period 16 or the vocabulary size) from a
    random offset, with 10% of tokens replaced at random: the next token is predictable from the
    context, so a language model's loss falls well below log(vocab_size) as it learns.

    Example:
        ```python
        train = tandem.data.synthetic_tokens(2048, seq_len=64, vocab_size=512)
        tokens, targets = train[0]       # (64,), (64,): targets[:-1] == tokens[1:]
        ```
    """
    if n < 0 or seq_len < 1 or vocab_size < 2:
        raise ValueError(
            f"synthetic_tokens: n={n} must be >= 0, seq_len={seq_len} >= 1 and vocab_size={vocab_size} >= 2"
        )
    rng = generator(seed)
    period = min(TOKEN_PERIOD, vocab_size)
    pattern = torch.randperm(vocab_size, generator=rng)[:period]
    offsets = torch.randint(period, (n, 1), generator=rng)
    stream = pattern[(offsets + torch.arange(seq_len + 1)) % period]
    noisy = torch.rand(n, seq_len + 1, generator=rng) < TOKEN_NOISE
    stream = torch.where(noisy, torch.randint(vocab_size, stream.shape, generator=rng), stream)
    return TensorDataset(stream[:, :-1].contiguous(), stream[:, 1:].contiguous())
