"""The optimizer base: an update rule, not bound to parameters (MXNet's ``Optimizer``).

The same object runs inside a worker's trainer and inside a parameter server, so it owns no
parameters and no state: callers keep one state dict per parameter (created by ``create_state``)
and pass params, grads and states aligned by index to ``update``, which makes ONE fused
multi-tensor call. ``to_config``/``from_config`` carry it across processes as plain JSON, never
pickled bytes.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from torch import Tensor

from tandem.ops.tensor_lists import check_lengths

ConfigValue = float | int | bool | str

_REGISTRY: dict[str, type[Optimizer]] = {}


class Optimizer(ABC):
    """Base of the update rules. Subclasses are dataclasses of hyperparameters with a unique ``name``.

    ``lr`` is mutable (schedules change it between steps); the fused op re-checks every
    hyperparameter on each update. Not thread safe: one update at a time per state.

    Example:
        ```python
        opt = tandem.optim.AdamW(lr=1e-3)
        config = opt.to_config()          # {"name": "adamw", "lr": 0.001, "beta1": 0.9, ...}: plain JSON
        same = tandem.optim.Optimizer.from_config(config)
        opt.lr = 5e-4                     # a schedule changes lr between steps
        ```
    """

    name: ClassVar[str]
    # True when an element's update reads only that element, its gradient and its state, so a
    # server holding a slice of a tensor (big-array split, P3 slicing) updates it exactly.
    elementwise: ClassVar[bool] = True
    lr: float

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "name" in cls.__dict__:
            _REGISTRY[cls.name] = cls

    @abstractmethod
    def create_state(self, param: Tensor) -> dict[str, Tensor]:
        """Fresh per-parameter state holding only tensors, so a checkpoint can ``torch.save`` it.

        Example:
            ```python
            opt = tandem.optim.AdamW(lr=1e-3)
            state = opt.create_state(torch.zeros(3))    # {"step": ..., "exp_avg": ..., "exp_avg_sq": ...}
            ```
        """

    @abstractmethod
    def update(self, params: list[Tensor], grads: list[Tensor], states: list[dict[str, Tensor]]) -> None:
        """Apply one step in place (params and states) with one fused call; lists aligned by index.

        Example:
            ```python
            params, grads = [torch.zeros(3), torch.zeros(2)], [torch.ones(3), torch.ones(2)]
            states = [opt.create_state(p) for p in params]
            opt.update(params, grads, states)            # every parameter in one fused call
            ```
        """

    def to_config(self) -> dict[str, ConfigValue]:
        """JSON-safe hyperparameters with ``name``; ``betas`` is flattened to ``beta1``/``beta2``.

        Example:
            ```python
            tandem.optim.AdamW(lr=1e-3).to_config()
            # {"name": "adamw", "lr": 0.001, "beta1": 0.9, "beta2": 0.999, "eps": 1e-08, "weight_decay": 0.01, ...}
            ```
        """
        config: dict[str, ConfigValue] = {"name": self.name}
        for field in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, field.name)
            if field.name == "betas":
                config["beta1"], config["beta2"] = float(value[0]), float(value[1])
            else:
                config[field.name] = value
        return config

    @staticmethod
    def from_config(config: Mapping[str, Any]) -> Optimizer:
        """The optimizer ``to_config`` described; ValueError on an unknown name or field.

        Example:
            ```python
            opt = tandem.optim.Optimizer.from_config({"name": "sgd", "lr": 0.1, "momentum": 0.9})
            tandem.optim.Optimizer.from_config(opt.to_config()) == opt   # True
            ```
        """
        if not isinstance(config, Mapping) or "name" not in config:
            raise ValueError(f"optimizer config must be a mapping with a 'name', got {config!r}")
        hyperparameters = {key: value for key, value in config.items() if key != "name"}
        if "beta1" in hyperparameters or "beta2" in hyperparameters:
            default_betas = _field_defaults(_lookup(config["name"])).get("betas", (None, None))
            betas = (hyperparameters.pop("beta1", default_betas[0]), hyperparameters.pop("beta2", default_betas[1]))
            hyperparameters["betas"] = betas
        return create(config["name"], **hyperparameters)

    def check_states(self, params: Sequence[Tensor], grads: Sequence[Tensor], states: Sequence[Any]) -> None:
        check_lengths(f"{type(self).__name__}.update", {"params": params, "grads": grads, "states": states})

    def state_columns(self, states: Sequence[Mapping[str, Tensor]], keys: Sequence[str]) -> list[list[Tensor]]:
        """``[[state[key] for state in states] for key in keys]``, naming the state index when one lacks a key.

        Example:
            ```python
            exp_avg, exp_avg_sq = opt.state_columns(states, ["exp_avg", "exp_avg_sq"])   # one list per key
            ```
        """
        for index, state in enumerate(states):
            if not isinstance(state, Mapping):
                raise TypeError(f"{type(self).__name__}.update: states[{index}] is a {type(state).__name__}, expected a dict")
            missing = [key for key in keys if key not in state]
            if missing:
                raise ValueError(
                    f"{type(self).__name__}.update: states[{index}] lacks {missing}; "
                    "create each state with optimizer.create_state(param)"
                )
        return [[state[key] for state in states] for key in keys]


def _lookup(name: object) -> type[Optimizer]:
    optimizer_class = _REGISTRY.get(name.lower()) if isinstance(name, str) else None
    if optimizer_class is None:
        raise ValueError(f"unknown optimizer {name!r}; known: {sorted(_REGISTRY)}")
    return optimizer_class


def _field_defaults(optimizer_class: type[Optimizer]) -> dict[str, Any]:
    return {field.name: field.default for field in dataclasses.fields(optimizer_class)}  # type: ignore[arg-type]


def create(name: str, **hyperparams: Any) -> Optimizer:
    """The optimizer called ``name`` ('sgd', 'adamw', 'lamb'); ValueError on an unknown name or field.

    Example:
        ```python
        opt = tandem.optim.create("sgd", lr=0.1, momentum=0.9)
        ```
    """
    optimizer_class = _lookup(name)
    known = _field_defaults(optimizer_class)
    unknown = sorted(set(hyperparams) - set(known))
    if unknown:
        raise ValueError(f"{optimizer_class.__name__} has no hyperparameter(s) {unknown}; known: {sorted(known)}")
    return optimizer_class(**hyperparams)
