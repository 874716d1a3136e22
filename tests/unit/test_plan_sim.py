"""The planner's simulator on cases computable by hand (tandem/planner/sim.py)."""

from __future__ import annotations

import pytest

from tandem.planner.sim import Cluster, Strategy, Workload, allreduce_seconds, simulate

RATE = 32e6  # bits/s: 4e6 bytes/s, so 4e6 bytes take 1 s on a link
FREE = {"message_s": 0.0, "aggregate_Bps": 1e30}  # no CPU cost per message or byte


def one_gradient(nbytes: int = 4_000_000) -> Workload:
    """One parameter: read by the only forward segment (1 s), finished by the only backward one (0.5 s)."""
    return Workload(("w",), (nbytes,), (1.0,), ((0,),), (0.5,), ((0,),))


def two_layers() -> Workload:
    """Forward reads a then b, backward finishes b then a; 1 s per segment, 1 s per gradient on the wire."""
    return Workload(("a", "b"), (4_000_000, 4_000_000), (1.0, 1.0), ((0,), (1,)), (1.0, 1.0), ((1,), (0,)))


@pytest.mark.parametrize("mode", ["baseline", "overlap", "p3"])
def test_one_worker_one_server_one_gradient(mode: str) -> None:
    latency = 0.01
    cluster = Cluster(1, 1, RATE, latency_s=latency, **FREE)
    result = simulate(one_gradient(), cluster, Strategy(mode, slice_size=10**7))
    assert result.iteration_s == pytest.approx(1.5 + 2 * 1.0 + 2 * latency)  # compute + push + pull + latencies
    assert result.compute_s == pytest.approx(1.5)
    assert result.exposed_s + result.idle_s == pytest.approx(2.02)
    assert result.samples_per_s == pytest.approx(1 / 3.52)


def test_cpu_per_message_and_per_byte() -> None:
    """A pushpull costs message_s four times (send, server receive, server reply, receive); the server
    sums the push (bytes / rate) and passes over the sum once more to finish the round."""
    cluster = Cluster(1, 1, RATE, latency_s=0.0, message_s=0.001, aggregate_Bps=4e7)
    result = simulate(one_gradient(), cluster, Strategy("overlap"))
    assert result.iteration_s == pytest.approx(1.5 + 2.0 + 4 * 0.001 + 2 * 0.1)


def test_baseline_waits_for_everything_overlap_starts_during_backward() -> None:
    cluster = Cluster(1, 1, RATE, latency_s=0.0, **FREE)
    baseline = simulate(two_layers(), cluster, Strategy("baseline"))
    overlap = simulate(two_layers(), cluster, Strategy("overlap"))
    # baseline: 4 s compute, then push a, b (2 s), then pull a, b (2 s)
    assert baseline.iteration_s == pytest.approx(8.0)
    # overlap: b leaves as backward finishes it (t=3) and is back at 5; a leaves at 4, back at 6: the
    # next forward starts at 6 (a), reads b at 7, backward ends at 10: 6 s per iteration, 2 exposed
    assert overlap.iteration_s == pytest.approx(6.0)
    assert overlap.exposed_s == pytest.approx(2.0) and overlap.idle_s == pytest.approx(0.0)


def test_a_higher_priority_slice_waits_only_for_the_slice_on_the_wire() -> None:
    """b (2 slices of 1 s, priority -1) is finished first, a (1 slice, priority 0) a moment later: with water
    mark 1 a overtakes b's second slice; overlap (FIFO, whole tensors) sends it last."""
    workload = Workload(("a", "b"), (400, 8_000_000), (1.0,), ((0, 1),), (1.0, 0.01), ((1,), (0,)))
    cluster = Cluster(1, 1, RATE, latency_s=0.0, **FREE)
    p3 = simulate(workload, cluster, Strategy("p3", slice_size=1_000_000, water_mark=1))
    assert [(param, part) for _, param, part in p3.sends[:3]] == [(1, 0), (0, 0), (1, 1)]
    overlap = simulate(workload, cluster, Strategy("overlap"))
    assert [param for _, param, _ in overlap.sends[:2]] == [1, 0]


def test_water_mark_one_serialises_slices() -> None:
    """4 slices of 0.25 s: with a water mark each slice leaves only once the one before has arrived."""
    latency = 0.1
    cluster = Cluster(1, 1, RATE, latency_s=latency, **FREE)
    free = simulate(one_gradient(), cluster, Strategy("p3", slice_size=250_000, water_mark=10))
    serial = simulate(one_gradient(), cluster, Strategy("p3", slice_size=250_000, water_mark=1))
    assert free.iteration_s == pytest.approx(1.5 + 1.25 + 2 * latency)  # pushes pipelined, the last reply 0.25 s after
    assert serial.iteration_s == pytest.approx(1.5 + 1.25 + 5 * latency)  # 3 more latencies between slices


def test_ring_allreduce_formula() -> None:
    cluster = Cluster(4, 0, RATE, latency_s=0.01, message_s=0.001)
    assert allreduce_seconds(4_000_000, cluster) == pytest.approx(2 * 3 / 4 * 1.0 + 6 * (0.01 + 2 * 0.001))
    assert allreduce_seconds(4_000_000, Cluster(1, 0, RATE)) == 0.0
    result = simulate(one_gradient(), cluster, Strategy("allreduce"))
    assert result.iteration_s == pytest.approx(1.5 + allreduce_seconds(4_000_000, cluster))
    half = simulate(one_gradient(), cluster, Strategy("allreduce", compression="fp16"))
    assert half.iteration_s == pytest.approx(1.5 + allreduce_seconds(2_000_000, cluster))


def test_allreduce_buckets_overlap_backward() -> None:
    """Bucket b (ready at 3 s) is reduced during a's backward segment; only a's bucket is exposed."""
    cluster = Cluster(2, 0, RATE, latency_s=0.0, message_s=0.0)
    result = simulate(two_layers(), cluster, Strategy("allreduce", bucket_bytes=1))
    assert result.iteration_s == pytest.approx(4.0 + 1.0)  # each bucket: 2 (W-1)/W x 1 s = 1 s
    assert result.exposed_s == pytest.approx(1.0)


def test_more_workers_share_the_server_link() -> None:
    one = simulate(one_gradient(), Cluster(1, 1, RATE, latency_s=0.0, **FREE), Strategy("overlap"))
    two = simulate(one_gradient(), Cluster(2, 1, RATE, latency_s=0.0, **FREE), Strategy("overlap"))
    two_servers = simulate(one_gradient(), Cluster(2, 2, RATE, latency_s=0.0, **FREE), Strategy("p3", slice_size=500_000))
    assert two.iteration_s >= one.iteration_s + 1.0  # the server's downlink carries both pushes
    assert two_servers.iteration_s < two.iteration_s  # slices spread over two servers' links


@pytest.mark.parametrize(("options", "message"), [
    ({"workers": 0, "servers": 1, "rate_bps": 1e9}, "workers must be an int >= 1"),
    ({"workers": 2, "servers": 1, "rate_bps": 0}, "link rate must be > 0"),
    ({"workers": 2, "servers": -1, "rate_bps": 1e9}, "servers must be an int >= 0"),
])  # fmt: skip
def test_impossible_clusters_are_refused(options: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Cluster(**options)  # type: ignore[arg-type]


def test_a_parameter_server_mode_needs_a_server() -> None:
    with pytest.raises(ValueError, match=r"needs servers >= 1"):
        simulate(one_gradient(), Cluster(2, 0, RATE), Strategy("p3"))
    simulate(one_gradient(), Cluster(2, 0, RATE), Strategy("allreduce"))  # no servers needed
    with pytest.raises(ValueError, match="mode must be one of"):
        Strategy("ring")  # type: ignore[arg-type]
