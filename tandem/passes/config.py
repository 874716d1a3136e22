"""PlanConfig: everything the planning passes read, resolved once from arguments and TANDEM_* knobs.

``tandem.compile`` / ``Trainer`` build it when their options are constructed, so a bad ``mirror=``
or segment cap is refused there (naming the valid values), and no pass reads the environment.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from tandem.backends import BACKENDS
from tandem.env import is_set, knob

NAMED_POLICIES = ("off", "all", "sqrt", "memory-aware")
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}
_BYTES = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-z]*)\s*$")


@dataclass(frozen=True)
class MirrorPolicy:
    """A parsed ``mirror=`` option: a named policy, or a budget (fraction of off's peak, or bytes)."""

    name: str  # one of NAMED_POLICIES, or "budget"
    fraction: float | None = None
    budget_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.name not in (*NAMED_POLICIES, "budget"):
            raise ValueError(f"unknown mirroring policy {self.name!r}; {_HELP}")
        if self.name == "budget" and (self.fraction is None) == (self.budget_bytes is None):
            raise ValueError("a budget policy needs exactly one of fraction or budget_bytes")
        if self.fraction is not None and not 0 < self.fraction <= 1:
            raise ValueError(f"mirror={self.fraction}: a fractional budget must lie in (0, 1]; {_HELP}")
        if self.budget_bytes is not None and self.budget_bytes <= 0:
            raise ValueError(f"mirror budget must be a positive number of bytes, got {self.budget_bytes}")

    @staticmethod
    def parse(value: str | float | None) -> MirrorPolicy:
        """None -> TANDEM_MIRROR (default "off"); explicit values beat the env knob."""
        if value is None:
            value = knob("TANDEM_MIRROR")
        if isinstance(value, bool) or not isinstance(value, str | int | float):
            raise TypeError(f"mirror={value!r} has type {type(value).__name__}; {_HELP}")
        if isinstance(value, int | float):
            return MirrorPolicy("budget", fraction=float(value))
        text = value.strip().lower()
        if text in NAMED_POLICIES:
            return MirrorPolicy(text)
        if text in ("", "none", "0", "false"):
            return MirrorPolicy("off")
        match = _BYTES.match(text)
        if match is None or match.group(2) not in _UNITS:
            raise ValueError(f"mirror={value!r} is not a mirroring policy; {_HELP}")
        number, unit = float(match.group(1)), match.group(2)
        if not unit and number <= 1:
            return MirrorPolicy("budget", fraction=number)
        return MirrorPolicy("budget", budget_bytes=int(number * _UNITS[unit]))

    def __str__(self) -> str:
        if self.name != "budget":
            return self.name
        return f"budget {self.fraction:g} of off" if self.fraction is not None else f"budget {self.budget_bytes} bytes"


_HELP = "use 'off', 'all', 'sqrt', 'memory-aware', a fraction of the unmirrored peak like 0.4, or bytes like '300MB'"


WHOLE = 2**31 - 1  # a cap no graph reaches: each phase becomes one segment


@dataclass(frozen=True)
class BulkCaps:
    forward: int
    backward: int

    def __post_init__(self) -> None:
        for name, value in (("forward", self.forward), ("backward", self.backward)):
            if value < 1:
                raise ValueError(f"{name} bulk cap must be >= 1 op node, got {value}")


def resolve_caps(bulk: bool | None, bulk_fwd: int | None, bulk_bwd: int | None, default: int | None = None) -> BulkCaps:
    """Explicit options beat TANDEM_BULK_* env knobs; bulking off (or a cap of 0) means one node per segment.

    ``default`` is the cap where neither an option nor a knob sets one (None: TANDEM_BULK_MAX_NODE_TRAIN's default).
    """
    enabled = knob("TANDEM_BULK_TRAIN") if bulk is None else bulk
    shared = knob("TANDEM_BULK_MAX_NODE_TRAIN") if default is None or is_set("TANDEM_BULK_MAX_NODE_TRAIN") else default

    def cap(explicit: int | None, env_name: str) -> int:
        if not enabled:
            return 1
        value = explicit if explicit is not None else (knob(env_name) if is_set(env_name) and knob(env_name) >= 0 else shared)
        return max(int(value), 1)  # 0 means per-op, like MXNet's profiling setting

    return BulkCaps(cap(bulk_fwd, "TANDEM_BULK_MAX_NODE_TRAIN_FWD"), cap(bulk_bwd, "TANDEM_BULK_MAX_NODE_TRAIN_BWD"))




# where gradients are sent, a backward segment ends after a gradient this large (256 KB of float32,
# 2 ms at 1 Gbit/s), so that it leaves at once (bulk_cut_gradient)
DISTRIBUTED_GRADIENT_CUT = 65_536


def distributed_gradient_cut(explicit: int | None) -> int | None:
    """``bulk_cut_gradient`` for a step whose gradients are sent per segment: ``explicit``, else
    ``TANDEM_BULK_CUT_GRADIENT`` where set (>= 0), else ``DISTRIBUTED_GRADIENT_CUT``."""
    if explicit is not None:
        return explicit
    setting = knob("TANDEM_BULK_CUT_GRADIENT")
    return setting if setting >= 0 else DISTRIBUTED_GRADIENT_CUT


@dataclass(frozen=True)
class PlanConfig:
    mirror: MirrorPolicy = MirrorPolicy("off")  # backward mirroring policy (docs/mirroring.md)
    caps: BulkCaps = BulkCaps(WHOLE, WHOLE)  # op nodes per forward / backward segment
    whole_inference: bool = True  # an inference graph runs as one segment
    checkpoint_regions: bool = True  # recompute what the model wrapped in torch.utils.checkpoint
    backend: str = "aten"  # how segments become code (tandem.backends)
    gradient_cut: int = 0  # a backward segment ends after finishing a gradient of >= this many elements (0: never)

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"unknown backend {self.backend!r}; choose one of {list(BACKENDS)}")
        if self.gradient_cut < 0:
            raise ValueError(f"gradient_cut must be >= 0 elements (0: never cut), got {self.gradient_cut}")

    @staticmethod
    def resolve(mirror: str | float | MirrorPolicy | None = None, bulk: bool | None = None,
                bulk_fwd: int | None = None, bulk_bwd: int | None = None,
                checkpoint_regions: bool = True, backend: str | None = None,
                bulk_cut_gradient: int | None = None) -> PlanConfig:
        """Explicit values beat the knobs (TANDEM_MIRROR, TANDEM_BULK_*, TANDEM_BACKEND); None takes the knob.

        With the inductor backend a phase is one segment unless a cap is given (or recomputation
        cuts the backward: ``segments_pass``): a compiled unit fuses more the larger it is, and only
        gradient hooks (a distributed update) need boundaries, which ``Trainer`` asks for by passing
        the caps.
        """
        policy = mirror if isinstance(mirror, MirrorPolicy) else MirrorPolicy.parse(mirror)
        backend = knob("TANDEM_BACKEND") if backend is None else backend
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r}; choose one of {list(BACKENDS)}")
        caps = resolve_caps(bulk, bulk_fwd, bulk_bwd, default=WHOLE if backend == "inductor" else None)
        cut = knob("TANDEM_BULK_CUT_GRADIENT") if bulk_cut_gradient is None else bulk_cut_gradient
        return PlanConfig(policy, caps, knob("TANDEM_BULK_INFERENCE"), checkpoint_regions, backend, max(cut, 0))
