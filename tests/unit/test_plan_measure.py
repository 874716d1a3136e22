"""The cached machine constants of ``tandem plan --here``: read while the machine runs at the speed
they were measured at, measured again when it does not (a real server process measures them)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tandem.planner.measure import load, save, stale, this_machine, wake_points
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
    """A cache without the wake-up fee or the cost per request (written before they were measured) is
    not read at any speed."""
    path = save(BOGUS, tmp_path / "machine.json", 5e-6)
    found = json.loads(path.read_text())
    del found["wake"], found["entry_s"]
    path.write_text(json.dumps(found))
    machine = this_machine(path, dispatch_s=5e-6)
    assert machine.message_s < 0.01 and len(machine.wake) == 5 and machine.wake[0][1:] == (0.0, 0.0)  # back to back: none
    assert 0 < machine.entry_s < machine.message_s and 0 < machine.server_entry_s < 0.01
    assert "without wake, entry_s" in capsys.readouterr().err and load(path) == machine


def test_wake_points_from_the_probes_trips() -> None:
    """Trips of (wall, worker CPU, server CPU): back to back 0.2 ms, 200 us, 220 us. After sleeps the
    trips take 0.5 and 5.2 ms; the worker's extra CPU is split over its two messages, the server's is
    all its request's. A noisy wall time that does not grow is nudged above the point before."""
    points = wake_points((0.2e-3, 200e-6, 220e-6), [(0.5e-3, 260e-6, 250e-6), (5.2e-3, 800e-6, 700e-6),
                                                    (5.1e-3, 190e-6, 100e-6)])  # fmt: skip
    assert [p[0] for p in points[:3]] == pytest.approx([0.2e-3, 0.5e-3, 5.2e-3]) and points[3][0] > points[2][0]
    assert [p[1] for p in points] == pytest.approx([0.0, 30e-6, 300e-6, 0.0])  # cheaper than back to back: none
    assert [p[2] for p in points] == pytest.approx([0.0, 30e-6, 480e-6, 0.0])
