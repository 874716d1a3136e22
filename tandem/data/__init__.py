"""Data sets for training and testing tandem: real digits, learnable synthetic data, sharding, batching."""

from __future__ import annotations

from tandem.data.batches import Batches, batches, loader
from tandem.data.digits import digits
from tandem.data.shard import shard
from tandem.data.synthetic import synthetic_images, synthetic_tokens

__all__ = ["Batches", "batches", "digits", "loader", "shard", "synthetic_images", "synthetic_tokens"]
