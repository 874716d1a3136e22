"""A real English text corpus that ships with Python, as byte-level language-model blocks.

``pydoc_data.topics.topics`` holds the text of Python's interactive ``help()`` topics (the language
reference's statements, operators, types...): about half a megabyte of English prose and code in
every CPython install, so it needs no download. Tokens are the UTF-8 bytes of the text (vocabulary
256, no tokenizer), cut into fixed-length blocks. Each item is a dict in the form a transformers
causal LM takes, ``{"input_ids", "attention_mask", "labels"}`` with ``labels = input_ids`` (the
model shifts the labels inside), so ``loss_fn(module, batch) = module(**batch).loss`` trains on it.
"""

from __future__ import annotations

from functools import lru_cache

import torch
from torch import Tensor
from torch.utils.data import Dataset

from tandem.data.rng import generator

BYTE_VOCAB_SIZE = 256  # byte-level tokens: every UTF-8 byte is one token
"""Vocabulary size of ``pydoc_text``'s byte-level tokens: every UTF-8 byte is one token.

Example:
    ```python
    model = tandem.models.gpt(vocab_size=tandem.data.BYTE_VOCAB_SIZE, block_size=64)   # 256 tokens
    ```
"""
TOPIC_SEPARATOR = "\n\n"  # between the help topics of the corpus


@lru_cache(maxsize=1)
def pydoc_corpus() -> bytes:
    """The corpus: every help topic, in sorted topic order, joined by a blank line, as UTF-8 bytes."""
    from pydoc_data.topics import topics

    return TOPIC_SEPARATOR.join(topics[name] for name in sorted(topics)).encode("utf-8")


class TextBlocks(Dataset[dict[str, Tensor]]):
    """Fixed-length blocks of byte tokens; item ``i`` is ``{"input_ids", "attention_mask", "labels"}``.

    ``tokens`` is an int64 (n, block_size) tensor; every position is real text (attention_mask all
    ones) and predicted (labels = input_ids: a causal LM shifts them by one inside).

    Example:
        ```python
        blocks = tandem.data.pydoc_text("validation")
        blocks[0]["input_ids"].shape, blocks.block_size, blocks.text(0)[:20]
        ```
    """

    def __init__(self, tokens: Tensor) -> None:
        if tokens.dim() != 2 or tokens.dtype != torch.int64:
            raise ValueError(f"TextBlocks needs int64 tokens of shape (n, block_size), got {tokens.dtype} "
                             f"{tuple(tokens.shape)}")  # fmt: skip
        self.tokens = tokens

    @property
    def block_size(self) -> int:
        return int(self.tokens.shape[1])

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        ids = self.tokens[index]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}

    def text(self, index: int) -> str:
        """Block ``index`` decoded back to text (a block may cut a multi-byte character: replaced).

        Example:
            ```python
            tandem.data.pydoc_text("train").text(0)[:22]    # 'The "assert" statement'
            ```
        """
        return decode(self.tokens[index])


def decode(tokens: Tensor) -> str:
    """Byte tokens back to text; a multi-byte character cut at a block edge becomes U+FFFD."""
    return bytes(tokens.tolist()).decode("utf-8", "replace")


def pydoc_text(
    split: str = "train", block_size: int = 64, validation_fraction: float = 0.1, seed: int = 0
) -> TextBlocks:
    """Python's help texts as byte-level LM blocks: a deterministic train / validation split.

    The corpus (``pydoc_corpus()``) is cut into consecutive, non-overlapping blocks of
    ``block_size`` bytes (the tail shorter than a block is dropped). A permutation seeded by
    ``seed`` picks ``round(validation_fraction * blocks)`` of them for ``"validation"``; the rest are
    ``"train"``. Both splits keep the blocks in corpus order (shuffling is the batch iterator's job),
    share no block, and the same (block_size, validation_fraction, seed) always gives the same split.

    Example:
        ```python
        train = tandem.data.pydoc_text("train")             # 6557 blocks of 64 bytes (728 in "validation")
        train[0]["input_ids"].shape, train.text(0)[:22]     # (torch.Size([64]), 'The "assert" statement')
        ```
    """
    if split not in ("train", "validation"):
        raise ValueError(f"pydoc_text: split={split!r} must be 'train' or 'validation'")
    if not isinstance(block_size, int) or block_size < 2:
        raise ValueError(f"pydoc_text: block_size={block_size!r} must be an int >= 2")
    if not 0.0 < validation_fraction < 1.0:
        raise ValueError(f"pydoc_text: validation_fraction={validation_fraction} must lie strictly between 0 and 1")
    validation, train = _split(block_size, validation_fraction, seed)
    return TextBlocks(_blocks(block_size)[validation if split == "validation" else train])


@lru_cache(maxsize=4)
def _blocks(block_size: int) -> Tensor:
    corpus = pydoc_corpus()
    count = len(corpus) // block_size
    stream = torch.frombuffer(bytearray(corpus[: count * block_size]), dtype=torch.uint8)
    return stream.to(torch.int64).reshape(count, block_size)


@lru_cache(maxsize=8)
def _split(block_size: int, validation_fraction: float, seed: int) -> tuple[Tensor, Tensor]:
    """(validation, train) block indices, each sorted."""
    count = len(_blocks(block_size))
    order = torch.randperm(count, generator=generator(seed))
    held_out = round(validation_fraction * count)
    return order[:held_out].sort().values, order[held_out:].sort().values
