"""LAMB: AdamW's direction rescaled per tensor by the trust ratio ||w|| / ||update||."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from tandem.ops.lamb import multi_lamb_update
from tandem.optim.adam_family import AdamFamily


@dataclass
class LAMB(AdamFamily):
    """LAMB (You et al. 2019): AdamW's direction rescaled per tensor by the trust ratio
    ``||w|| / ||update||`` (1 where either norm is 0), bias correction on.

    The trust ratio needs whole tensors, so parameter servers cannot run LAMB on keys they hold
    in slices (P3, big arrays): ``set_optimizer`` refuses it there; update on the workers instead
    (``Trainer(..., update_on_kvstore=False)``).

    Example:
        ```python
        trainer = tandem.Trainer(model, loss_fn, tandem.optim.LAMB(lr=1e-3, weight_decay=0.01))
        ```
    """

    name: ClassVar[str] = "lamb"
    elementwise: ClassVar[bool] = False  # the trust ratio needs norms of the whole tensor
    fused_update = staticmethod(multi_lamb_update)
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-6
    weight_decay: float = 0.0
