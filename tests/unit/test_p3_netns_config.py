"""netns configuration and the loopback fallback (no namespaces needed)."""

from __future__ import annotations

import pytest

from tandem import netns


@pytest.mark.parametrize(("text", "bits"), [("100mbit", 100_000_000), ("1gbit", 1_000_000_000),
                                            ("500kbit", 500_000), ("12.5mbps", 100_000_000), (64_000, 64_000)])  # fmt: skip
def test_parse_rate(text: str | int, bits: int) -> None:
    assert netns.parse_rate(text) == bits


@pytest.mark.parametrize("bad", ["fast", "100 furlongs", "-5mbit", "10bit", ""])
def test_bad_rate_names_the_fix(bad: str) -> None:
    with pytest.raises(ValueError, match="rate"):
        netns.parse_rate(bad)


def test_fallback_is_loopback_and_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(netns, "_probe", (False, "pretend: not root"))
    with pytest.warns(UserWarning, match="pretend: not root; falling back to loopback"):
        net = netns.Network(num_hosts=3, rate="100mbit")
    with net:
        assert not net.shaped and not net.isolated
        assert [host.address for host in net.hosts] == ["127.0.0.1"] * 3
        assert net.hosts[1].command(["python", "x.py"]) == ["python", "x.py"]


def test_bad_host_count() -> None:
    with pytest.raises(ValueError, match="num_hosts"):
        netns.Network(num_hosts=0)
