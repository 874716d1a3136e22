"""Data sets: the digits split, synthetic data, sharding and the batch iterator."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import Subset, TensorDataset

from tandem.data import batches, digits, loader, shard, synthetic_images, synthetic_tokens
from tandem.data.digits import _split

DIGITS_TOTAL = 1797


def test_digits_sizes_shapes_and_normalisation() -> None:
    train, test = digits("train"), digits("test")
    images, labels = train.tensors
    assert len(train) + len(test) == DIGITS_TOTAL and len(test) == 360
    assert images.shape == (len(train), 1, 8, 8) and images.dtype == torch.float32
    assert labels.dtype == torch.int64 and set(labels.tolist()) == set(range(10))
    assert abs(images.mean().item()) < 1e-4 and abs(images.std().item() - 1) < 1e-3
    assert digits("test", flat=True).tensors[0].shape == (360, 64)


def test_digits_split_is_disjoint_stratified_and_deterministic() -> None:
    train_index, test_index = _split(0.2, 0)
    assert not set(train_index) & set(test_index)
    assert len(set(train_index) | set(test_index)) == DIGITS_TOTAL
    test_counts = torch.bincount(digits("test").tensors[1], minlength=10)
    assert int(test_counts.max() - test_counts.min()) <= 2  # digits classes are near-balanced
    for first, second in zip(digits("test").tensors, digits("test").tensors):
        assert torch.equal(first, second)
    assert not torch.equal(digits("test", seed=1).tensors[1], digits("test").tensors[1])


def test_digits_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="'train' or 'test'"):
        digits("validation")
    with pytest.raises(ValueError, match="test_fraction"):
        digits(test_fraction=1.0)


@settings(max_examples=60, deadline=None)
@given(length=st.integers(0, 120), world_size=st.integers(1, 9))
def test_shards_cover_every_sample_once(length: int, world_size: int) -> None:
    dataset = TensorDataset(torch.arange(length))
    shards = [shard(dataset, rank, world_size) for rank in range(world_size)]
    assert torch.equal(torch.cat([s.tensors[0] for s in shards]), torch.arange(length))
    sizes = [len(s) for s in shards]
    assert max(sizes) - min(sizes) <= 1


def test_shard_of_plain_dataset_and_bad_ranks() -> None:
    parts = [shard(list(range(10)), rank, 3) for rank in range(3)]
    assert all(isinstance(part, Subset) for part in parts)
    assert [item for part in parts for item in part] == list(range(10))
    for rank, world_size in ((3, 3), (-1, 2), (0, 0)):
        with pytest.raises(ValueError, match="rank|world_size"):
            shard(TensorDataset(torch.arange(4)), rank, world_size)


def test_batches_in_order_with_len_and_drop_last() -> None:
    dataset = TensorDataset(torch.arange(10), torch.arange(10) * 2)
    plain = batches(dataset, 4)
    assert len(plain) == 3 and [len(x) for x, _ in plain] == [4, 4, 2]
    assert torch.equal(torch.cat([x for x, _ in plain]), torch.arange(10))
    assert len(batches(dataset, 4, drop_last=True)) == len(list(batches(dataset, 4, drop_last=True))) == 2


def test_batches_shuffle_is_deterministic_per_seed_and_epoch() -> None:
    dataset = TensorDataset(torch.arange(50), torch.arange(50) + 100)

    def order(**kwargs: int) -> torch.Tensor:
        return torch.cat([x for x, _ in batches(dataset, 8, shuffle=True, **kwargs)])

    assert torch.equal(order(seed=3, epoch=1), order(seed=3, epoch=1))
    assert torch.equal(order().sort().values, torch.arange(50))
    assert not torch.equal(order(epoch=0), order(epoch=1))
    assert not torch.equal(order(seed=0, epoch=1), order(seed=1, epoch=0))
    for x, y in batches(dataset, 8, shuffle=True):
        assert torch.equal(y, x + 100)  # every tensor is gathered with the same indices


def test_batches_rejects_non_tensor_datasets() -> None:
    with pytest.raises(TypeError, match="TensorDataset"):
        batches(list(range(4)), 2)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="batch_size"):
        batches(TensorDataset(torch.arange(4)), 0)


def test_synthetic_images_deterministic_and_learnable() -> None:
    images, labels = synthetic_images(400, shape=(1, 8, 8), num_classes=4, seed=5).tensors
    assert images.shape == (400, 1, 8, 8) and images.dtype == torch.float32 and labels.dtype == torch.int64
    assert torch.equal(images, synthetic_images(400, shape=(1, 8, 8), num_classes=4, seed=5).tensors[0])
    assert not torch.equal(images, synthetic_images(400, shape=(1, 8, 8), num_classes=4, seed=6).tensors[0])
    # Nearest class mean beats chance (25%) by far: the classes are learnable.
    flat = images.flatten(1)
    means = torch.stack([flat[labels == k].mean(0) for k in range(4)])
    accuracy = (torch.cdist(flat, means).argmin(1) == labels).float().mean()
    assert accuracy > 0.6


def test_synthetic_tokens_shifted_deterministic_and_learnable() -> None:
    tokens, targets = synthetic_tokens(64, seq_len=32, vocab_size=100, seed=2).tensors
    assert tokens.shape == targets.shape == (64, 32) and tokens.dtype == torch.int64
    assert torch.equal(tokens[:, 1:], targets[:, :-1]) and int(tokens.max()) < 100
    assert torch.equal(tokens, synthetic_tokens(64, seq_len=32, vocab_size=100, seed=2).tensors[0])
    assert not torch.equal(tokens, synthetic_tokens(64, seq_len=32, vocab_size=100, seed=3).tensors[0])
    # Predicting each token's most common successor is right far more often than 1/vocab.
    pairs = torch.stack([tokens.flatten(), targets.flatten()], 1)
    table = torch.zeros(100, 100).index_put_(
        (pairs[:, 0], pairs[:, 1]), torch.ones(len(pairs)), accumulate=True
    )
    assert (table.max(1).values.sum() / len(pairs)) > 0.5


class _Pairs(torch.utils.data.Dataset):
    """A map-style data set that is not a TensorDataset: sample ``i`` as a dict."""

    def __len__(self) -> int:
        return 50

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"index": torch.tensor(index), "double": torch.tensor(2 * index)}


def test_loader_shuffle_is_reproducible_per_seed_and_epoch() -> None:
    def order(**kwargs: int) -> torch.Tensor:
        return torch.cat([batch["index"] for batch in loader(_Pairs(), 8, shuffle=True, **kwargs)])

    assert torch.equal(order(seed=3, epoch=1), order(seed=3, epoch=1))
    assert torch.equal(order().sort().values, torch.arange(50))
    assert not torch.equal(order(epoch=0), order(epoch=1))
    assert not torch.equal(order(seed=0), order(seed=1))
    # the same order as batches() of the TensorDataset of the same samples
    fast = torch.cat([x for (x,) in batches(TensorDataset(torch.arange(50)), 8, shuffle=True, seed=3, epoch=1)])
    assert torch.equal(order(seed=3, epoch=1), fast)


def test_loader_is_reiterable_with_the_same_batches() -> None:
    """A DataLoader's own generator advances on every iter(); the loader's order does not."""
    shuffled = loader(_Pairs(), 8, shuffle=True, seed=5, epoch=2)
    first_pass = [batch["index"] for batch in shuffled]
    iter(shuffled)  # an iterator made and dropped (as tqdm.auto does) changes nothing
    assert all(torch.equal(a, b["index"]) for a, b in zip(first_pass, shuffled, strict=True))


def test_loader_collates_dicts_drops_last_and_leaves_the_global_rng() -> None:
    state = torch.get_rng_state()
    plain = list(loader(_Pairs(), 8))
    assert [len(batch["index"]) for batch in plain] == [8] * 6 + [2]
    assert all(torch.equal(batch["double"], 2 * batch["index"]) for batch in plain)
    assert len(list(loader(_Pairs(), 8, shuffle=True, drop_last=True))) == 6
    assert torch.equal(torch.get_rng_state(), state)  # dropout's stream is not advanced by data loading
    with pytest.raises(ValueError, match="batch_size"):
        loader(_Pairs(), 0)
