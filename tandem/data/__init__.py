"""Data sets for training and testing tandem: real digits and text, learnable synthetic data, sharding, batching."""

from __future__ import annotations

from tandem.data.batches import Batches, batches, loader
from tandem.data.digits import digits
from tandem.data.shard import shard
from tandem.data.synthetic import synthetic_images, synthetic_tokens
from tandem.data.text import BYTE_VOCAB_SIZE, TextBlocks, pydoc_text

__all__ = [
    "BYTE_VOCAB_SIZE",
    "Batches",
    "TextBlocks",
    "batches",
    "digits",
    "loader",
    "pydoc_text",
    "shard",
    "synthetic_images",
    "synthetic_tokens",
]
