"""The text data set: Python's help texts as byte-level causal-LM blocks, split deterministically."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.data import Subset

from tandem.data import BYTE_VOCAB_SIZE, TextBlocks, loader, pydoc_text, shard
from tandem.data.text import _split, decode, pydoc_corpus


def test_corpus_is_python_help_text_in_english() -> None:
    corpus = pydoc_corpus()
    assert len(corpus) > 300_000  # about half a megabyte in every CPython 3.11+
    text = corpus.decode("utf-8")
    assert 'The "if" statement' in text and text.count(" the ") > 1000


def test_blocks_are_causal_lm_dicts_of_bytes() -> None:
    train = pydoc_text("train", block_size=32)
    item = train[0]
    assert set(item) == {"input_ids", "attention_mask", "labels"}
    assert item["input_ids"].shape == (32,) and item["input_ids"].dtype == torch.int64
    assert torch.equal(item["labels"], item["input_ids"])  # the model shifts them inside
    assert item["labels"].data_ptr() != item["input_ids"].data_ptr()
    assert torch.equal(item["attention_mask"], torch.ones(32, dtype=torch.int64))
    assert int(train.tokens.min()) >= 0 and int(train.tokens.max()) < BYTE_VOCAB_SIZE
    assert train.block_size == 32 and train.text(0) == decode(item["input_ids"])


def test_split_is_disjoint_complete_and_deterministic() -> None:
    train, validation = pydoc_text("train"), pydoc_text("validation")
    blocks = len(pydoc_corpus()) // 64
    assert len(train) + len(validation) == blocks
    assert len(validation) == round(0.1 * blocks)
    held_out, kept = _split(64, 0.1, 0)
    assert not set(held_out.tolist()) & set(kept.tolist())
    # the blocks, put back in corpus order, are the corpus (less the tail shorter than a block)
    everything = torch.empty(blocks, 64, dtype=torch.int64)
    everything[held_out], everything[kept] = validation.tokens, train.tokens
    assert decode(everything.flatten()) == pydoc_corpus()[: blocks * 64].decode("utf-8", "replace")
    assert torch.equal(pydoc_text("validation").tokens, validation.tokens)
    assert not torch.equal(pydoc_text("validation", seed=1).tokens, validation.tokens)
    assert len(pydoc_text("validation", validation_fraction=0.25)) == round(0.25 * blocks)


def test_validation_text_is_predictable_from_train_statistics() -> None:
    """Real language: byte bigrams counted on train predict validation far better than chance (log 256)."""
    train, validation = pydoc_text("train").tokens, pydoc_text("validation").tokens
    counts = torch.ones(BYTE_VOCAB_SIZE, BYTE_VOCAB_SIZE)  # add-one smoothing
    counts.index_put_((train[:, :-1].flatten(), train[:, 1:].flatten()), torch.ones(train[:, 1:].numel()),
                      accumulate=True)  # fmt: skip
    log_probs = (counts / counts.sum(1, keepdim=True)).log()
    loss = -log_probs[validation[:, :-1], validation[:, 1:]].mean()
    assert float(loss) < 0.5 * math.log(BYTE_VOCAB_SIZE), float(loss)


def test_loader_collates_dict_batches_and_shards_by_rank() -> None:
    train = pydoc_text("train")
    batch = next(iter(loader(train, 8, shuffle=True)))
    assert {name: tuple(value.shape) for name, value in batch.items()} == {
        "input_ids": (8, 64), "attention_mask": (8, 64), "labels": (8, 64)}  # fmt: skip
    parts = [shard(train, rank, 2) for rank in range(2)]
    assert all(isinstance(part, Subset) for part in parts) and sum(map(len, parts)) == len(train)


def test_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="'train' or 'validation'"):
        pydoc_text("test")
    with pytest.raises(ValueError, match="block_size"):
        pydoc_text(block_size=1)
    with pytest.raises(ValueError, match="validation_fraction"):
        pydoc_text(validation_fraction=1.0)
    with pytest.raises(ValueError, match="int64"):
        TextBlocks(torch.zeros(4, 8, dtype=torch.uint8))
