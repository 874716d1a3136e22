"""How a step's gradients become the parameters, behind one interface (``Update``), built from the
parameters and an apply function (``OptimizerApply``: the fused optimizer update):

- ``LocalUpdate``: training alone, one engine op applies every gradient;
- ``DistributedUpdate``: data-parallel on the parameter server (baseline / overlap / p3), the
  replies written per parameter as the next forward needs them.
"""

from __future__ import annotations

from tandem.update.base import Apply, OptimizerApply, Update
from tandem.update.distributed import MODES, DistributedUpdate, check_combination, resolve_mode
from tandem.update.local import LocalUpdate

__all__ = ["MODES", "Apply", "DistributedUpdate", "LocalUpdate", "OptimizerApply", "Update", "check_combination",
           "resolve_mode"]
