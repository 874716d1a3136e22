"""The cached machine constants of ``tandem plan --here``: read while the machine runs at the speed
they were measured at, measured again when it does not (a real server process measures them)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tandem.planner.measure import dispatch_seconds, load, save, this_machine
from tandem.planner.sim import Machine

BOGUS = Machine(message_s=1.0, cores=2, shared_host=True)  # no real message costs a second


def test_a_cache_measured_at_this_speed_is_read(tmp_path: Path) -> None:
    path = save(BOGUS, tmp_path / "machine.json", dispatch_seconds())
    assert this_machine(path) == BOGUS


@pytest.mark.parametrize("speed", [3.0, None])  # measured at a third of today's speed; by a version that did not say
def test_a_cache_from_another_speed_is_measured_again(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                      speed: float | None) -> None:  # fmt: skip
    path = save(BOGUS, tmp_path / "machine.json", None if speed is None else dispatch_seconds() * speed)
    machine = this_machine(path)
    assert 0 < machine.message_s < 0.01 and machine.cores >= 1
    assert "measuring it again" in capsys.readouterr().err
    assert load(path) == machine and json.loads(path.read_text())["dispatch_s"] > 0
