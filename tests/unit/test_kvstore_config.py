"""The kvstore's settings are resolved once into KVStoreConfig (DistOptions, P3Options): a bad kind,
option or value is refused at ``kvstore.create(...)`` / ``Trainer(...)``, naming the valid set, before
anything joins a job (no topology, no socket)."""

from __future__ import annotations

from typing import Any

import pytest
from torch import nn

import tandem
from tandem import kvstore, optim
from tandem.kvstore import DistOptions, KVStoreConfig, KVStoreError, KVStoreOptionError, P3Options
from tandem.kvstore.config import DIST_OPTIONS, P3_OPTIONS


@pytest.fixture(autouse=True)
def _no_job(monkeypatch: pytest.MonkeyPatch) -> None:
    """Reaching the job's topology (the first step of joining) fails the test."""
    from tandem.kvstore.ps.topology import Topology

    def joined() -> None:
        raise AssertionError("the job was joined before the options were checked")

    monkeypatch.setattr(Topology, "from_env", staticmethod(joined))
    monkeypatch.delenv("TANDEM_KVSTORE_P3", raising=False)


def _trainer(**options: Any) -> tandem.Trainer:
    return tandem.Trainer(nn.Linear(2, 2), lambda module, x: module(x).sum(), optim.SGD(lr=0.1), **options)


BAD_VALUES = [
    ("dist_sync", {"heartbeat": 20.0}, KVStoreOptionError, r"0 < heartbeat \(20.0\) < timeout"),
    ("dist_sync", {"bigarray_bound": 0}, KVStoreOptionError, "bigarray_bound must be >= 1"),
    ("dist_async", {"rendezvous_timeout": -1.0}, KVStoreOptionError, "rendezvous_timeout must be > 0"),
    ("dist_sync", {"secret": 7}, KVStoreOptionError, "secret must be a str"),
    ("dist_sync", {"max_frame_bytes": 2**20 - 1}, KVStoreOptionError, "max_frame_bytes must be >= 1 MiB"),
    ("dist_sync", {"max_frame_bytes": 1e9}, KVStoreOptionError, r"max_frame_bytes must be an int >= 1 MiB \(TANDEM_PS_MAX"),
    ("dist_sync", {"exit_on_failure": "yes"}, KVStoreOptionError, "exit_on_failure must be True or False"),
    ("dist_p3", {"water_mark": 0}, KVStoreOptionError, "water_mark must be >= 1"),
    ("dist_p3", {"slice_size": -5}, KVStoreOptionError, "slice_size must be >= 1, or 0 / 'auto'"),
    ("dist_p3_async", {"slice_size": "big"}, KVStoreOptionError, "int or 'auto'"),
    ("dist_sync", {"slice_size": 100}, TypeError, r"unknown kvstore option\(s\) \['slice_size'\].*valid: \['bigarray_bound'"),
    ("dist_p3", {"speed": 1}, TypeError, r"\['speed'\].*'slice_size', 'water_mark'"),
    ("local", {"heartbeat": 1.0}, TypeError, "local kvstore takes no options"),
]


@pytest.mark.parametrize(("kind", "options", "error", "match"), BAD_VALUES)
def test_create_refuses_a_bad_option_before_joining(kind: str, options: dict[str, Any], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        kvstore.create(kind, **options)
    with pytest.raises(error, match=match):
        kvstore.serve(kind, **options)


@pytest.mark.parametrize(("kind", "options", "error", "match"), BAD_VALUES)
def test_trainer_refuses_a_bad_kvstore_option(kind: str, options: dict[str, Any], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        _trainer(kvstore=kind, kvstore_options=options)


def test_bad_values_are_value_errors_and_kvstore_errors() -> None:
    with pytest.raises(ValueError, match="water_mark"):
        P3Options(100, 0)
    with pytest.raises(KVStoreError, match="water_mark"):
        P3Options(100, 0)


def test_unknown_kind_names_the_kinds() -> None:
    for call in (lambda: kvstore.create("dist_magic"), lambda: KVStoreConfig("dist_magic"),
                 lambda: _trainer(kvstore="dist_magic")):  # fmt: skip
        with pytest.raises(ValueError, match="dist_p3_async"):
            call()
    with pytest.raises(ValueError, match="only a distributed kvstore has servers; choose one of"):
        kvstore.serve("local")


def test_a_bad_knob_is_refused_at_trainer_time_naming_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_PS_HEARTBEAT", "often")
    with pytest.raises(ValueError, match="TANDEM_PS_HEARTBEAT='often'"):
        _trainer(kvstore="dist_sync")
    _trainer()  # training alone reads no kvstore knob
    monkeypatch.setenv("TANDEM_PS_HEARTBEAT", "30")
    with pytest.raises(KVStoreOptionError, match="TANDEM_PS_HEARTBEAT"):
        _trainer(kvstore="dist_sync")


def test_resolve_fills_unset_options_from_the_knobs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_PS_WATER_MARK", "3")
    monkeypatch.setenv("TANDEM_PS_TIMEOUT", "20")
    monkeypatch.setenv("TANDEM_PS_MAX_FRAME_BYTES", str(8 * 2**20))
    config = KVStoreConfig.resolve("dist_p3", slice_size="auto", heartbeat=2.0)
    assert config.dist is not None and config.dist.max_frame_bytes == 8 * 2**20
    limited = KVStoreConfig.resolve("dist_sync", max_frame_bytes=2**20).dist  # an option beats its knob
    assert limited is not None and limited.max_frame_bytes == 2**20
    assert config.kind == "dist_p3" and config.distributed
    assert config.p3 == P3Options(0, 3) and config.p3.auto
    assert config.dist is not None and (config.dist.kind, config.dist.heartbeat, config.dist.timeout) == ("dist_sync", 2.0, 20.0)
    assert KVStoreConfig.resolve("dist_async").p3 is None
    assert KVStoreConfig.resolve() == KVStoreConfig() and not KVStoreConfig().distributed


def test_launch_p3_resolves_to_the_p3_kinds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_KVSTORE_P3", "1")
    config = KVStoreConfig.resolve("dist_async", water_mark=4)
    assert config.kind == "dist_p3_async" and config.p3 is not None and config.p3.water_mark == 4


def test_the_config_is_consistent() -> None:
    dist = DistOptions.from_env("dist_sync")
    with pytest.raises(ValueError, match="no options"):
        KVStoreConfig("local", dist=dist)
    with pytest.raises(ValueError, match="needs dist=DistOptions"):
        KVStoreConfig("dist_sync")
    with pytest.raises(ValueError, match="needs dist=DistOptions\\(kind='dist_async'"):
        KVStoreConfig("dist_p3_async", dist=dist, p3=P3Options(0, 1))
    with pytest.raises(ValueError, match="P3 kinds"):
        KVStoreConfig("dist_p3", dist=dist)
    with pytest.raises(ValueError, match="P3 kinds"):
        KVStoreConfig("dist_sync", dist=dist, p3=P3Options(0, 1))


def test_trainer_holds_the_resolved_config_beside_its_step_config() -> None:
    trainer = _trainer(mirror="sqrt")
    assert trainer.config.store == KVStoreConfig() and trainer.config.step.plan.mirror.name == "sqrt"
    config = KVStoreConfig.resolve("dist_p3", water_mark=2)
    with pytest.raises(TypeError, match="not both"):
        _trainer(kvstore=config, kvstore_options={"water_mark": 3})
    with pytest.raises(TypeError, match="not both"):
        kvstore.create(config, water_mark=3)
    with pytest.raises(TypeError, match=r"unknown Trainer option\(s\) \['store'\]"):
        _trainer(store=config)


def test_the_option_lists_are_the_dataclasses_fields() -> None:
    assert set(DIST_OPTIONS) == {"bigarray_bound", "heartbeat", "timeout", "secret", "bind_addr", "max_frame_bytes",
                                 "rendezvous_timeout", "exit_on_failure"}  # fmt: skip
    assert P3_OPTIONS == ("slice_size", "water_mark")
