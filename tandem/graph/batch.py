"""Batches as pytrees: what ``loss_fn(module, *batch)`` receives, and what a captured graph takes.

A batch is whatever positional arguments the user's ``loss_fn`` takes after the module: tensors,
or dicts / tuples / lists of them (a transformers collator's ``{"input_ids", "attention_mask",
"labels"}``). The graph takes the tensor leaves, flattened in pytree order; every other leaf (an
int, a string, None) is static: it is part of the captured shape, and a new value captures again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree

from tandem.graph.train_graph import TensorSpec


@dataclass(frozen=True)
class BatchLayout:
    """The structure of a batch: its tree, and for each leaf its TensorSpec or its static value.

    Hashable and comparable, so it keys the captured graphs of a step.
    """

    tree: pytree.TreeSpec
    leaves: tuple[Any, ...]  # TensorSpec for a tensor leaf, the value itself for a static leaf

    @staticmethod
    def of(batch: Sequence[Any]) -> tuple[BatchLayout, list[torch.Tensor]]:
        """The layout of ``batch`` (the positional arguments after the module) and its tensor leaves."""
        leaves, tree = pytree.tree_flatten(tuple(batch))
        tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
        layout = BatchLayout(tree, tuple(TensorSpec.of(leaf) if isinstance(leaf, torch.Tensor) else _static(leaf)
                                         for leaf in leaves))
        return layout, tensors

    @property
    def tensor_specs(self) -> list[TensorSpec]:
        return [leaf for leaf in self.leaves if isinstance(leaf, TensorSpec)]

    def unflatten(self, tensors: Sequence[torch.Tensor]) -> tuple[Any, ...]:
        """The batch as ``loss_fn`` receives it, with ``tensors`` in the tensor leaves' places."""
        supply = iter(tensors)
        leaves = [next(supply) if isinstance(leaf, TensorSpec) else leaf for leaf in self.leaves]
        return tuple(pytree.tree_unflatten(leaves, self.tree))

    def __str__(self) -> str:
        return str(pytree.tree_unflatten(list(self.leaves), self.tree))


def batch_size_of(batch: Sequence[Any]) -> int:
    """The leading dimension of the batch's first tensor leaf (the number of samples)."""
    for leaf in pytree.tree_leaves(tuple(batch)):
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return int(leaf.shape[0])
    return 1


def as_arguments(batch: Any) -> tuple[Any, ...]:
    """One item of a data loader as ``loss_fn``'s positional arguments: a tuple or list is spread
    (``(x, y)`` -> ``loss_fn(module, x, y)``); a dict or a tensor is one argument."""
    return tuple(batch) if isinstance(batch, tuple | list) else (batch,)


def _static(value: Any) -> Any:
    try:
        hash(value)
    except TypeError:
        raise TypeError(f"a batch leaf of type {type(value).__name__} is neither a tensor nor hashable; "
                        "pass tensors, or plain ints/floats/strings/None as static values") from None
    return value
