"""Which communication mode a Trainer runs on which kvstore kind (tandem launch --p3 included)."""

from __future__ import annotations

import pytest

from tandem.kvstore import resolve_kind
from tandem.update import resolve_mode


@pytest.mark.parametrize("kind, mode", [("dist_sync", "overlap"), ("dist_async", "overlap"), ("dist_p3", "p3"),
                                        ("dist_p3_async", "p3")])  # fmt: skip
def test_auto_is_p3_on_both_p3_kinds(kind: str, mode: str) -> None:
    assert resolve_mode("auto", kind) == mode


def test_launch_p3_makes_the_parameter_server_kinds_p3(monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_kind("dist_async") == "dist_async"
    monkeypatch.setenv("TANDEM_KVSTORE_P3", "1")
    assert [resolve_kind(kind) for kind in ("dist_sync", "dist_async", "local")] == ["dist_p3", "dist_p3_async", "local"]
    assert resolve_mode("auto", resolve_kind("dist_async")) == "p3"


def test_p3_needs_a_p3_kind_and_says_how() -> None:
    with pytest.raises(ValueError, match="dist_p3_async.*tandem launch --p3"):
        resolve_mode("p3", "dist_sync")
    with pytest.raises(ValueError, match="one of"):
        resolve_mode("fast", "dist_p3")
