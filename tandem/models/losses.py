"""The losses a zoo model is trained with, as ``loss_fn(module, *batch) -> scalar``.

Taking the module as an argument lets capture wrap "model + loss" as one traceable function.
"""

from __future__ import annotations

from torch import Tensor, nn
from torch.nn import functional as F


def classification_loss(module: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    """Mean cross entropy of ``module(x)`` (N, classes) against integer labels ``y`` (N,).

    Example:
        ```python
        trainer = tandem.Trainer(tandem.models.mlp(), tandem.models.classification_loss, tandem.optim.SGD(lr=0.05))
        ```
    """
    return F.cross_entropy(module(x), y)


def lm_loss(module: nn.Module, tokens: Tensor, targets: Tensor) -> Tensor:
    """Mean next-token cross entropy: logits (N, T, V) and targets (N, T) flattened over N*T.

    Example:
        ```python
        loss = tandem.models.lm_loss(model, tokens, targets)   # a batch of synthetic_tokens
        ```
    """
    logits = module(tokens)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
