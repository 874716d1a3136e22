"""AdamW (decoupled weight decay), equal to ``torch.optim.AdamW(foreach=True)``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from tandem.ops.adamw import multi_adamw_update
from tandem.optim.adam_family import AdamFamily


@dataclass
class AdamW(AdamFamily):
    """AdamW (decoupled weight decay), equal to ``torch.optim.AdamW(foreach=True)``.

    State per parameter: ``{"step", "exp_avg", "exp_avg_sq"}`` (``step`` a 0-dim float32 CPU tensor).
    ``fused=True`` runs torch's single-pass kernel: about 3x faster on CPU, equal to the default to
    a few ulps rather than bit for bit.

    Example:
        ```python
        opt = tandem.optim.AdamW(lr=3e-3, weight_decay=0.01)
        states = [opt.create_state(p) for p in params]
        opt.update(params, grads, states)      # one fused multi-tensor call, in place
        ```
    """

    name: ClassVar[str] = "adamw"
    fused_update = staticmethod(multi_adamw_update)
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 1e-2
    fused: bool = False  # torch's single-pass kernel: faster, equal to the foreach path to a few ulps
