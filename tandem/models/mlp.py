"""A multilayer perceptron: the smallest zoo model, and (with ``hidden=(32,) * 20``) a deep thin one.

The deep thin variant has many tiny layers, so per-op overhead dominates its step: the case that
op bulking is meant to fix.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn


class MLP(nn.Module):
    """Flatten -> [Linear -> ReLU (-> Dropout)] per hidden width -> Linear.

    Example:
        ```python
        model = tandem.models.mlp(in_features=64, hidden=(128, 128), num_classes=10)   # an MLP
        model(torch.randn(8, 1, 8, 8)).shape          # (8, 10): images are flattened
        ```
    """

    def __init__(self, in_features: int, hidden: Sequence[int], num_classes: int, dropout: float) -> None:
        super().__init__()
        if in_features < 1 or num_classes < 1 or any(width < 1 for width in hidden):
            raise ValueError(
                f"mlp: in_features={in_features}, hidden={tuple(hidden)}, num_classes={num_classes} "
                "must all be positive"
            )
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"mlp: dropout={dropout} must lie in [0, 1)")
        layers: list[nn.Module] = []
        width_in = in_features
        for width in hidden:
            # Dropout only when asked for, so a dropout-free model captures a dropout-free graph.
            extra: list[nn.Module] = [nn.Dropout(dropout)] if dropout > 0 else []
            layers.append(nn.Sequential(nn.Linear(width_in, width), nn.ReLU(), *extra))
            width_in = width
        self.hidden = nn.Sequential(*layers)
        self.head = nn.Linear(width_in, num_classes)

    @property
    def blocks(self) -> list[nn.Module]:
        """The hidden layers in order (each Linear -> ReLU [-> Dropout]).

        Example:
            ```python
            len(tandem.models.mlp(hidden=(128, 128)).blocks)   # 2
            ```
        """
        return list(self.hidden)

    def forward(self, x: Tensor) -> Tensor:
        # Images (N, C, H, W) are flattened here so one model serves flat and image data.
        return self.head(self.hidden(torch.flatten(x, 1)))


def mlp(
    in_features: int = 64, hidden: Sequence[int] = (128, 128), num_classes: int = 10, dropout: float = 0.0
) -> MLP:
    """An MLP over ``in_features`` inputs (images are flattened inside), e.g. 64 for 8x8 digits.

    Example:
        ```python
        model = tandem.models.mlp(in_features=64, hidden=(128, 128))   # digits; hidden=(32,)*20: deep and thin
        ```
    """
    return MLP(in_features, tuple(hidden), num_classes, dropout)
