"""LAMB: AdamW's direction rescaled per tensor by the trust ratio ||w|| / ||update||."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from tandem.ops.lamb import multi_lamb_update
from tandem.optim.adam_family import AdamFamily


@dataclass
class LAMB(AdamFamily):
    name: ClassVar[str] = "lamb"
    elementwise: ClassVar[bool] = False  # the trust ratio needs norms of the whole tensor
    fused_update = staticmethod(multi_lamb_update)
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-6
    weight_decay: float = 0.0
