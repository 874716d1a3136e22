"""A kvstore's settings as typed, validated dataclasses, resolved once from arguments and TANDEM_* knobs.

``KVStoreConfig.resolve(kind, **options)`` is what ``tandem.kvstore.create`` / ``serve`` and
``tandem.Trainer(kvstore=..., kvstore_options=...)`` resolve their options into, before any process,
socket or rendezvous work: a bad kind, an unknown option or a value out of range is refused there,
naming the valid set. Explicit options beat the knobs; an unset one takes its knob.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from tandem.env import knob
from tandem.kvstore.errors import KVStoreError
from tandem.kvstore.kinds import DISTRIBUTED_KINDS, KINDS, P3_FOR, resolve_kind

ROUNDS = ("dist_sync", "dist_async")  # how a distributed store's rounds run (DistOptions.kind)
P3_KINDS = {p3: rounds for rounds, p3 in P3_FOR.items()}  # P3 kind -> the rounds it runs
# every kind with P3's options (slices, a cap in flight, the tuner) -> the rounds it runs: the collective
# store's all-reduces are synchronous rounds
SLICED_KINDS = {**P3_KINDS, "collective": "dist_sync"}
AUTO = 0  # slice_size (TANDEM_KVSTORE_SLICE_THRESHOLD) meaning "tune it"


class KVStoreOptionError(KVStoreError, ValueError):
    """A kvstore option has a bad value; the message names the valid range (and the knob it defaults to).

    Example:
        ```python
        tandem.kvstore.create("dist_sync", heartbeat=30.0, timeout=10.0)
        # KVStoreOptionError (also a ValueError): need 0 < heartbeat (30.0) < timeout (10.0): ...
        ```
    """


def _check_type(name: str, value: Any, kinds: tuple[type, ...], what: str) -> None:
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        raise KVStoreOptionError(f"{name} must be {what}, got {value!r} ({type(value).__name__})")


@dataclass(frozen=True)
class DistOptions:
    """Settings of a distributed store; ``from_env`` fills unset ones from the TANDEM_* knobs.

    Example:
        ```python
        dist = DistOptions.from_env("dist_sync", heartbeat=2.0)   # the others from their TANDEM_* knobs
        kv = tandem.kvstore.create(KVStoreConfig("dist_sync", dist))
        ```
    """

    kind: str  # the rounds: "dist_sync" or "dist_async" (a P3 store's too)
    bigarray_bound: int  # arrays of at least this many elements are split over all servers
    heartbeat: float  # seconds between heartbeats
    timeout: float  # seconds without a heartbeat before a peer is declared dead
    secret: str  # shared secret peers must present ("" for none)
    bind_addr: str  # address servers bind to
    max_frame_bytes: int = 64 * 2**20  # a peer sending a bigger frame is dropped before it is buffered
    rendezvous_timeout: float = 120.0  # how long processes wait for each other to start
    exit_on_failure: bool = True  # hard-exit a worker whose job died even if it never waits again

    def __post_init__(self) -> None:
        if self.kind not in ROUNDS:
            raise KVStoreOptionError(f"unknown distributed kvstore kind {self.kind!r}; choose one of {ROUNDS}")
        _check_type("bigarray_bound", self.bigarray_bound, (int,), "an int >= 1 (TANDEM_KVSTORE_BIGARRAY_BOUND)")
        _check_type("max_frame_bytes", self.max_frame_bytes, (int,), "an int >= 1 MiB (TANDEM_PS_MAX_FRAME_BYTES)")
        if self.max_frame_bytes < 2**20:
            raise KVStoreOptionError(f"max_frame_bytes must be >= 1 MiB (control messages need room), got {self.max_frame_bytes}")
        for name in ("heartbeat", "timeout", "rendezvous_timeout"):
            _check_type(name, getattr(self, name), (int, float), "a number of seconds")
        for name in ("secret", "bind_addr"):
            _check_type(name, getattr(self, name), (str,), "a str")
        _check_type("exit_on_failure", self.exit_on_failure, (bool,), "True or False")
        if self.bigarray_bound < 1:
            raise KVStoreOptionError(f"bigarray_bound must be >= 1, got {self.bigarray_bound}")
        if not 0 < self.heartbeat < self.timeout:
            raise KVStoreOptionError(
                f"need 0 < heartbeat ({self.heartbeat}) < timeout ({self.timeout}): TANDEM_PS_HEARTBEAT / TANDEM_PS_TIMEOUT"
            )
        if self.rendezvous_timeout <= 0:
            raise KVStoreOptionError(f"rendezvous_timeout must be > 0, got {self.rendezvous_timeout}")

    @property
    def sync(self) -> bool:
        return self.kind == "dist_sync"

    @property
    def secret_bytes(self) -> bytes:
        return self.secret.encode("utf-8")

    @classmethod
    def from_env(cls, kind: str, **overrides: Any) -> DistOptions:
        unknown = set(overrides) - set(DIST_OPTIONS)
        if unknown:
            raise TypeError(f"unknown kvstore option(s) {sorted(unknown)} for kind {kind!r}; valid: {list(DIST_OPTIONS)}")
        values: dict[str, Any] = {
            "bigarray_bound": knob("TANDEM_KVSTORE_BIGARRAY_BOUND"),
            "heartbeat": knob("TANDEM_PS_HEARTBEAT"),
            "timeout": knob("TANDEM_PS_TIMEOUT"),
            "secret": knob("TANDEM_PS_SECRET"),
            "bind_addr": knob("TANDEM_BIND_ADDR"),
            "max_frame_bytes": knob("TANDEM_PS_MAX_FRAME_BYTES"),
        }
        values.update(overrides)
        return cls(kind=kind, **values)


DIST_OPTIONS = tuple(f.name for f in fields(DistOptions) if f.name != "kind")  # create()'s options of every dist kind


@dataclass(frozen=True)
class P3Options:
    """P3's own settings; ``from_env`` fills unset ones from the knobs. ``slice_size`` 0 means "auto".

    Example:
        ```python
        p3 = P3Options.from_env(slice_size="auto")   # P3Options(slice_size=0, water_mark=10)
        config = KVStoreConfig("dist_p3", DistOptions.from_env("dist_sync"), p3)
        ```
    """

    slice_size: int  # elements per slice (AUTO, 0: tune it)
    water_mark: int  # max pushes in flight per worker

    def __post_init__(self) -> None:
        _check_type("slice_size", self.slice_size, (int,), "an int >= 1, or 0 / 'auto' to tune it")
        _check_type("water_mark", self.water_mark, (int,), "an int >= 1 (TANDEM_PS_WATER_MARK)")
        if self.slice_size < 0:
            raise KVStoreOptionError(
                f"slice_size must be >= 1, or 0 / 'auto' to tune it (TANDEM_KVSTORE_SLICE_THRESHOLD), "
                f"got {self.slice_size}"
            )
        if self.water_mark < 1:
            raise KVStoreOptionError(f"water_mark must be >= 1 (TANDEM_PS_WATER_MARK), got {self.water_mark}")

    @property
    def auto(self) -> bool:
        return self.slice_size == AUTO

    @classmethod
    def from_env(cls, slice_size: int | str | None = None, water_mark: int | None = None) -> P3Options:
        if slice_size == "auto":
            slice_size = AUTO
        if isinstance(slice_size, str):
            raise KVStoreOptionError(f"slice_size must be an int or 'auto', got {slice_size!r}")
        size = knob("TANDEM_KVSTORE_SLICE_THRESHOLD") if slice_size is None else slice_size
        return cls(size, knob("TANDEM_PS_WATER_MARK") if water_mark is None else water_mark)


P3_OPTIONS = tuple(f.name for f in fields(P3Options))  # create()'s further options of the P3 kinds


@dataclass(frozen=True)
class KVStoreConfig:
    """What a kvstore is made from: its kind and, for the distributed kinds, its settings, resolved once.

    Attributes:
        kind: the kind ``create`` makes, one of ``KINDS`` (under ``TANDEM_KVSTORE_P3=1``, i.e.
            ``tandem launch --p3``, ``resolve`` makes ``dist_sync``/``dist_async`` their P3 kinds).
        dist: the settings of a distributed kind (None for ``local``).
        p3: P3's own settings, for ``dist_p3`` / ``dist_p3_async`` and ``collective`` only.

    ``create``, ``serve`` and ``Trainer`` take one in place of a kind and its options.

    Example:
        ```python
        config = KVStoreConfig.resolve("dist_p3", slice_size="auto")   # checked here, before any job
        trainer = tandem.Trainer(model, loss_fn, opt, kvstore=config)
        ```
    """

    kind: str = "local"
    dist: DistOptions | None = None
    p3: P3Options | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown kvstore kind {self.kind!r}; choose one of {KINDS}")
        if self.kind == "local":
            if self.dist is not None or self.p3 is not None:
                raise ValueError("the local kvstore takes no options (dist and p3 must be None)")
            return
        rounds = SLICED_KINDS.get(self.kind, self.kind)
        if self.dist is None or self.dist.kind != rounds:
            raise ValueError(f"a {self.kind} store needs dist=DistOptions(kind={rounds!r}, ...), got {self.dist!r}")
        if (self.p3 is not None) != (self.kind in SLICED_KINDS):
            raise ValueError(f"p3=P3Options(...) goes with the P3 kinds and collective {tuple(SLICED_KINDS)} only; kind is {self.kind!r}")

    @property
    def distributed(self) -> bool:
        return self.kind in DISTRIBUTED_KINDS

    @staticmethod
    def resolve(kind: str = "local", **options: Any) -> KVStoreConfig:
        """The config of ``create(kind, **options)``: the kind as ``resolve_kind`` makes it, every
        option checked, unset ones from their knobs (see ``create`` for the options).

        Example:
            ```python
            config = KVStoreConfig.resolve("dist_sync", heartbeat=2.0)
            config.dist.timeout              # 10.0: TANDEM_PS_TIMEOUT's default
            KVStoreConfig.resolve("dist_sync", slice_size=4)   # TypeError: slice_size goes with the P3 kinds
            ```
        """
        if not isinstance(kind, str) or kind not in KINDS:
            raise ValueError(f"unknown kvstore kind {kind!r}; choose one of {KINDS}")
        if kind == "local":
            if options:
                raise TypeError(f"the local kvstore takes no options, got {sorted(options)}")
            return KVStoreConfig()
        kind = resolve_kind(kind)
        valid = DIST_OPTIONS + (P3_OPTIONS if kind in SLICED_KINDS else ())
        unknown = sorted(set(options) - set(valid))
        if unknown:
            raise TypeError(f"unknown kvstore option(s) {unknown} for kind {kind!r}; valid: {list(valid)}")
        rest = dict(options)
        p3 = None
        if kind in SLICED_KINDS:
            p3 = P3Options.from_env(rest.pop("slice_size", None), rest.pop("water_mark", None))
        return KVStoreConfig(kind, DistOptions.from_env(SLICED_KINDS.get(kind, kind), **rest), p3)

    @staticmethod
    def of(kind: str | KVStoreConfig = "local", **options: Any) -> KVStoreConfig:
        """``kind`` as it is when it is a config already (then no options), else ``resolve(kind, **options)``.

        Example:
            ```python
            KVStoreConfig.of("local")                 # KVStoreConfig(kind="local", dist=None, p3=None)
            KVStoreConfig.of(config) is config        # True
            ```
        """
        if isinstance(kind, KVStoreConfig):
            if options:
                raise TypeError(f"pass options either in the KVStoreConfig or as keywords, not both: {sorted(options)}")
            return kind
        return KVStoreConfig.resolve(kind, **options)
