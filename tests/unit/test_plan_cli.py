"""`tandem plan` and `tandem.plan`: profile a tiny model, save and reuse the profile, refuse bad input."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

import tandem
from tandem.cli import main
from tandem.models import ZOO
from tandem.planner.profile import Profile, ProfileMismatch, SegmentProfile, update_seconds
from tandem.planner.sim import Strategy

CLUSTER = ["--workers", "4", "--servers", "2", "--link", "1gbit"]


@pytest.fixture(scope="module")
def profiled(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`tandem plan` on the mlp: profile written, the table, the recommendation and the plot."""
    out = tmp_path_factory.mktemp("plan")
    assert main(["plan", "--model", "mlp", *CLUSTER, "--runs", "1", "--out", str(out)]) == 0
    assert (out / "plan.png").stat().st_size > 10_000
    return out / "profile.json"


def test_plan_profiles_reports_and_plots(profiled: Path, capsys: pytest.CaptureFixture[str]) -> None:
    profile = Profile.load(profiled)
    assert profile.model == "mlp" and profile.version == tandem.__version__ and profile.batch_size == 32
    assert {s.phase for s in profile.segments} == {"forward", "backward"}
    sent = {name for name, _, _ in profile.parameters}
    assert sent == {g for s in profile.segments for g in s.gradients}  # every parameter's gradient comes from a segment
    assert main(["plan", "--model", "mlp", *CLUSTER, "--profile", str(profiled), "--out", str(profiled.parent)]) == 0
    output = capsys.readouterr().out
    for text in ("baseline", "overlap", "p3 (", "allreduce", "collective (", "+fp16", "+2bit", "recommended:", "servers:",
                 "plan.png"):
        assert text in output


def test_a_scaled_profile_keeps_its_layout(profiled: Path) -> None:
    """A machine twice as slow: every segment twice as long, nothing else changed."""
    profile = Profile.load(profiled)
    slower = profile.scaled(2.0)
    assert [s.seconds for s in slower.segments] == pytest.approx([2 * s.seconds for s in profile.segments])
    assert slower.compute_s == pytest.approx(2 * profile.compute_s)
    assert (slower.parameters, slower.fingerprint, slower.batch_shapes) == (profile.parameters, profile.fingerprint,
                                                                            profile.batch_shapes)  # fmt: skip
    assert slower.update_s == pytest.approx(2 * profile.update_s)


def test_the_profile_times_a_workers_update_on_copies(profiled: Path) -> None:
    """The optimizer update is timed (it is what a worker adds where the workers update), on copies: the
    module keeps its values; the workload spreads it over the forward segments, summing to it."""
    profile = Profile.load(profiled)
    assert profile.update_s > 0
    assert sum(profile.workload().update_s) == pytest.approx(profile.update_s)
    module = ZOO["mlp"].build()
    before = {name: p.clone() for name, p in module.named_parameters()}
    assert update_seconds(module, [[name for name, _ in module.named_parameters()]], runs=1, warmup=0) > 0
    assert all(torch.equal(before[name], p) for name, p in module.named_parameters())


def test_the_update_goes_to_the_segment_that_reads_a_parameter_first() -> None:
    """a (100 B) is read by both forward segments, b (300 B) by the second: 0.4 s split 0.1 / 0.3;
    a profile saved before updates were timed (no update_s) charges none."""
    forward = [SegmentProfile("forward", 1.0, ("a",)), SegmentProfile("forward", 1.0, ("a", "b"))]
    backward = [SegmentProfile("backward", 1.0, (), ("a", "b"))]
    profile = Profile("m", tandem.__version__, "f", 1, (("a", 25, 100), ("b", 75, 300)), (), (*forward, *backward),
                      update_s=0.4)  # fmt: skip
    assert profile.workload().update_s == pytest.approx((0.1, 0.3))
    assert dataclasses.replace(profile, update_s=0.0).workload().update_s == ()


def test_a_profile_of_another_model_or_version_is_refused(profiled: Path, tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match=r"model: the profile is of 'mlp', not 'resnet'.*parameters differ"):
        main(["plan", "--model", "resnet", "--profile", str(profiled), "--out", str(tmp_path)])
    data = json.loads(profiled.read_text())
    old = tmp_path / "old.json"
    old.write_text(json.dumps({**data, "version": "0.0.1"}))
    with pytest.raises(SystemExit, match=r"tandem version: the profile was made by 0.0.1"):
        main(["plan", "--model", "mlp", "--profile", str(old), "--out", str(tmp_path)])


@pytest.mark.parametrize(("options", "message"), [
    (["--workers", "0"], "workers must be an int >= 1"),
    (["--servers", "0"], r"servers must be an int >= 1 for the parameter-server modes"),
    (["--link", "0"], r"link rate must be > 0"),
    (["--link", "fast"], r"is not a rate"),
    (["--colocated", "--workers", "2", "--servers", "3"], r"at most 2 servers"),
    (["--colocated", "--here"], r"--colocated plans a cluster"),
])  # fmt: skip
def test_impossible_configurations_are_clear_errors(options: list[str], message: str, tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match=message):
        main(["plan", "--model", "mlp", *options, "--out", str(tmp_path)])


def test_the_api(profiled: Path) -> None:
    result = tandem.plan(profiled, workers=2, servers=1, rate="100mbit", modes=("baseline", "p3"), sweep=False)
    assert result.best.strategy.mode == "p3" and isinstance(result.best.strategy, Strategy)
    baseline = result.prediction("baseline")
    assert baseline is not None and result.best.samples_per_s > baseline.samples_per_s
    entry, config = ZOO["mlp"], {"in_features": 3 * 32 * 32}  # the CLI's mlp on synthetic images
    batch = entry.make_batch(32, torch.Generator().manual_seed(1), **config)
    with pytest.raises(ProfileMismatch, match="not 'gpt'"):  # a module with a saved profile is checked, not profiled
        tandem.plan(entry.build(**config), entry.loss_fn, batch, name="gpt", saved=profiled, sweep=False)


def test_the_modes_without_servers_plan_with_none(profiled: Path) -> None:
    """0 servers: allreduce and collective alone; the collective mode's knobs are searched as p3's are."""
    result = tandem.plan(profiled, workers=2, servers=0, rate="100mbit", modes=("allreduce", "collective"), sweep=False)
    collective = result.prediction("collective")
    assert collective is not None and collective.samples_per_s > 0 and "(no servers)" in result.report()
    assert collective.strategy.label.startswith("collective (")
    with pytest.raises(ValueError, match="servers must be an int >= 1 for the parameter-server modes"):
        tandem.plan(profiled, workers=2, servers=0, rate="100mbit", modes=("p3", "collective"), sweep=False)


def test_colocated_servers(profiled: Path) -> None:
    """Servers on the workers' machines: the report says so, and the sweep over workers keeps at most one
    server per machine (1 worker: 1 server)."""
    result = tandem.plan(profiled, workers=4, servers=4, rate="1gbit", modes=("overlap",), colocated=True)
    assert "(each on a worker machine)" in result.report()
    assert result.best.cluster.colocated and set(result.server_curve) <= {1, 2, 4}
    assert result.by_workers["overlap"][1] > 0  # planned with 1 server, not refused
