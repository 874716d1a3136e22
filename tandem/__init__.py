"""tandem: a training engine for PyTorch models.

It captures one training step (forward, loss, backward) of an ``nn.Module`` as a graph of aten ops,
plans it (bulking, mirroring) and runs it on a dependency engine, alone or data-parallel on a
parameter server with priority-based propagation (P3).
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

# Lazy attributes: `import tandem.engine` must not pay for capture machinery and vice versa.
_LAZY = {
    "compile": ("tandem.step", "compile"),
    "compile_eval": ("tandem.step", "compile_eval"),
    "TrainStep": ("tandem.step", "TrainStep"),
    "StepResult": ("tandem.step", "StepResult"),
    "Trainer": ("tandem.trainer", "Trainer"),
    "plan": ("tandem.planner.api", "plan"),  # the package is tandem.planner: a tandem.plan package would shadow this
}
_SUBPACKAGES = ("data", "engine", "kvstore", "models", "ops", "optim")  # `tandem.optim` works after `import tandem`


def __getattr__(name: str) -> Any:
    import importlib

    if name in _LAZY:
        module_name, attribute = _LAZY[name]
        return getattr(importlib.import_module(module_name), attribute)
    if name in _SUBPACKAGES:
        return importlib.import_module(f"tandem.{name}")
    raise AttributeError(f"module 'tandem' has no attribute {name!r}")


__all__ = ["compile", "compile_eval", "TrainStep", "StepResult", "Trainer", "plan", "__version__"]
