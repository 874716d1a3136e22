"""The cached machine constants of ``tandem plan --here``: read while the machine runs at the speed
they were measured at, measured again when it does not (a real server process measures them)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tandem.planner.measure import load, save, stale, this_machine
from tandem.planner.sim import Machine

BOGUS = Machine(message_s=1.0, cores=2, shared_host=True)  # no real message costs a second


@pytest.mark.parametrize(("then", "now", "expected"), [
    (1e-6, 1e-6, False), (1e-6, 1.2e-6, False), (1.2e-6, 1e-6, False),  # within 25 %, slower or faster
    (1e-6, 1.3e-6, True), (1.3e-6, 1e-6, True), (1e-6, 3e-6, True),  # beyond it, either way
    (None, 1e-6, True), (0.0, 1e-6, True), ("fast", 1e-6, True), (math.nan, 1e-6, True),  # unknown: measure
])  # fmt: skip
def test_when_cached_costs_are_stale(then: object, now: float, expected: bool) -> None:
    assert stale(then, now) is expected


def test_a_cache_measured_at_this_speed_is_read(tmp_path: Path) -> None:
    path = save(BOGUS, tmp_path / "machine.json", 5e-6)
    assert this_machine(path, dispatch_s=5.5e-6) == BOGUS


def test_a_cache_from_another_speed_is_measured_again(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = save(BOGUS, tmp_path / "machine.json", 5e-6)
    machine = this_machine(path, dispatch_s=15e-6)  # a third of the speed the cache was measured at
    assert 0 < machine.message_s < 0.01 and machine.cores >= 1
    assert "measuring its costs again" in capsys.readouterr().err
    assert load(path) == machine and json.loads(path.read_text())["dispatch_s"] == 15e-6


def test_a_cache_of_an_earlier_version_is_measured_again(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A cache without the wake-up fee (written before it was measured) is not read at any speed."""
    path = save(BOGUS, tmp_path / "machine.json", 5e-6)
    found = json.loads(path.read_text())
    del found["wake"]
    path.write_text(json.dumps(found))
    machine = this_machine(path, dispatch_s=5e-6)
    assert machine.message_s < 0.01 and len(machine.wake) == 4 and all(worker >= 0 for _, worker, _ in machine.wake)
    assert "earlier version" in capsys.readouterr().err and load(path) == machine
