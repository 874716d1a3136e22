"""Optimizers as update rules (SGD, AdamW, LAMB), each one fused multi-tensor call per update.

``create("adamw", lr=1e-3)`` builds one by name; ``Optimizer.from_config(opt.to_config())``
rebuilds it from JSON on a parameter server.
"""

from tandem.optim.adamw import AdamW
from tandem.optim.lamb import LAMB
from tandem.optim.optimizer import Optimizer, create
from tandem.optim.sgd import SGD

__all__ = ["Optimizer", "SGD", "AdamW", "LAMB", "create"]
