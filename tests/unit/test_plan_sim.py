"""The planner's simulator on cases computable by hand (tandem/planner/sim.py)."""

from __future__ import annotations

import dataclasses
import math
from functools import partial
from typing import Any

import pytest

from tandem.planner.sim import (
    CPU,
    TCP_PAYLOAD_FRACTION,
    Cluster,
    Events,
    Link,
    Machine,
    Resource,
    Strategy,
    Workload,
    allgather_seconds,
    allreduce_seconds,
    simulate,
)

RATE = 32e6  # bits/s: 4e6 bytes/s, so 4e6 bytes take 1 s on a link
NO_COST = Machine(message_s=0.0, byte_s=0.0, server_message_s=0.0, server_byte_s=0.0, entry_s=0.0, server_entry_s=0.0,
                  aggregate_Bps=1e30)  # fmt: skip
FREE = {"machine": NO_COST}  # no CPU cost per message or byte


def at_whole_rate(*args: Any, **options: Any) -> Cluster:
    """A cluster whose links carry message bytes at their whole rate, as the hand computations below
    assume (the TCP/IP framing of real links has a test of its own)."""
    return Cluster(*args, **{"payload_fraction": 1.0, **options})


def one_gradient(nbytes: int = 4_000_000) -> Workload:
    """One parameter: read by the only forward segment (1 s), finished by the only backward one (0.5 s)."""
    return Workload(("w",), (nbytes,), (1.0,), ((0,),), (0.5,), ((0,),))


def two_layers() -> Workload:
    """Forward reads a then b, backward finishes b then a; 1 s per segment, 1 s per gradient on the wire."""
    return Workload(("a", "b"), (4_000_000, 4_000_000), (1.0, 1.0), ((0,), (1,)), (1.0, 1.0), ((1,), (0,)))


@pytest.mark.parametrize("mode", ["baseline", "overlap", "p3"])
def test_one_worker_one_server_one_gradient(mode: str) -> None:
    latency = 0.01
    cluster = at_whole_rate(1, 1, RATE, latency_s=latency, **FREE)
    result = simulate(one_gradient(), cluster, Strategy(mode, slice_size=10**7))
    assert result.iteration_s == pytest.approx(1.5 + 2 * 1.0 + 2 * latency)  # compute + push + pull + latencies
    assert result.compute_s == pytest.approx(1.5)
    assert result.exposed_s + result.idle_s == pytest.approx(2.02)
    assert result.samples_per_s == pytest.approx(1 / 3.52)


def test_links_carry_tcp_ip_framing() -> None:
    """A real link's rate also carries each frame's headers: 1448 bytes of payload per 1514-byte frame at
    MTU 1500, so the push and the pull of 4 MB take 1514 / 1448 s each, not 1 s; 1.0 is the whole rate."""
    real = simulate(one_gradient(), Cluster(1, 1, RATE, latency_s=0.0, **FREE), Strategy("overlap"))
    assert real.iteration_s == pytest.approx(1.5 + 2 * 1514 / 1448)
    assert allreduce_seconds(4_000_000, Cluster(2, 0, RATE, latency_s=0.0, **FREE)) == pytest.approx(1514 / 1448)
    assert Cluster(1, 1, RATE).bytes_per_s == pytest.approx(4e6 * TCP_PAYLOAD_FRACTION)
    with pytest.raises(ValueError, match="payload_fraction"):
        Cluster(1, 1, RATE, payload_fraction=0.0)


def test_cpu_per_message_and_per_byte() -> None:
    """A pushpull costs message_s four times (send, server receive, server reply, receive); the server
    sums the push (bytes / rate) and passes over the sum once more to finish the round. The worker is
    charged its compute and two messages per iteration, the server two messages and both passes."""
    cluster = at_whole_rate(1, 1, RATE, latency_s=0.0, machine=dataclasses.replace(NO_COST, message_s=0.001, server_message_s=0.001, aggregate_Bps=4e7))
    result = simulate(one_gradient(), cluster, Strategy("overlap"))
    assert result.iteration_s == pytest.approx(1.5 + 2.0 + 4 * 0.001 + 2 * 0.1)
    assert (result.worker_cpu_s, result.server_cpu_s) == pytest.approx((1.5 + 2 * 0.001, 2 * 0.001 + 2 * 0.1))


def test_a_message_of_many_requests_costs_its_fixed_part_once() -> None:
    """Baseline, 1 worker, two gradients: the two pushes leave in one message, so do the two pulls
    (TANDEM_PS_COALESCE_BYTES holds them), and the server answers each poll with one message. Per
    iteration the worker sends 2 messages of 2 requests and receives 2 of 2 replies (acks, then the
    sums): 4 message_s + 8 entry_s; the server the same in its own costs."""
    machine = dataclasses.replace(NO_COST, message_s=0.004, entry_s=0.001, server_message_s=0.002, server_entry_s=0.0005)
    cluster = at_whole_rate(1, 1, 1e30, latency_s=0.0, machine=machine)
    two = Workload(("a", "b"), (4, 4), (1.0,), ((0, 1),), (1.0,), ((0, 1),))
    result = simulate(two, cluster, Strategy("baseline"))
    assert result.worker_cpu_s == pytest.approx(2.0 + 4 * 0.004 + 8 * 0.001)
    assert result.server_cpu_s == pytest.approx(4 * 0.002 + 8 * 0.0005)
    # the path: the sender sends the pushes, then the pulls (6 ms each); the server serves the pulls and
    # sends the sums (3 ms each; the acks were served meanwhile); the IO thread receives them (6 ms)
    assert result.iteration_s == pytest.approx(2.0 + 2 * 0.006 + 2 * 0.003 + 0.006)


def test_baseline_waits_for_everything_overlap_starts_during_backward() -> None:
    cluster = at_whole_rate(1, 1, RATE, latency_s=0.0, **FREE)
    baseline = simulate(two_layers(), cluster, Strategy("baseline"))
    overlap = simulate(two_layers(), cluster, Strategy("overlap"))
    # baseline: 4 s compute, then push a, b (2 s), then pull a, b (2 s)
    assert baseline.iteration_s == pytest.approx(8.0)
    # overlap: b leaves as backward finishes it (t=3) and is back at 5; a leaves at 4, back at 6: the
    # next forward starts at 6 (a), reads b at 7, backward ends at 10: 6 s per iteration, 2 exposed
    assert overlap.iteration_s == pytest.approx(6.0)
    assert overlap.exposed_s == pytest.approx(2.0) and overlap.idle_s == pytest.approx(0.0)


def test_a_higher_priority_slice_waits_only_for_the_slice_in_flight() -> None:
    """b (2 slices of 1 s, priority -1) is finished first, a (1 slice, priority 0) a moment later: with water
    mark 1 a overtakes b's second slice; overlap (FIFO, whole tensors) sends it last."""
    workload = Workload(("a", "b"), (400_000, 8_000_000), (1.0,), ((0, 1),), (1.0, 0.01), ((1,), (0,)))
    cluster = at_whole_rate(1, 1, RATE, latency_s=0.0, **FREE)
    p3 = simulate(workload, cluster, Strategy("p3", slice_size=1_000_000, water_mark=1))
    assert [(param, part) for _, param, part in p3.sends[:3]] == [(1, 0), (0, 0), (1, 1)]
    overlap = simulate(workload, cluster, Strategy("overlap"))
    assert [param for _, param, _ in overlap.sends[:2]] == [1, 0]


def test_water_mark_one_serialises_slices() -> None:
    """4 slices of 0.25 s: with a water mark of 1 each slice leaves only once the one before is answered
    (the only worker's round completes as its push arrives, so the reply, not a notice, frees the slot)."""
    latency = 0.1
    cluster = at_whole_rate(1, 1, RATE, latency_s=latency, **FREE)
    free = simulate(one_gradient(), cluster, Strategy("p3", slice_size=250_000, water_mark=10))
    serial = simulate(one_gradient(), cluster, Strategy("p3", slice_size=250_000, water_mark=1))
    assert free.iteration_s == pytest.approx(1.5 + 1.25 + 2 * latency)  # pushes pipelined, the last reply 0.25 s after
    assert serial.iteration_s == pytest.approx(1.5 + 4 * (0.25 + 0.25 + 2 * latency))  # a round trip per slice


def test_a_parked_slice_is_released_by_its_notice() -> None:
    """2 workers, 1 server, 2 slices of 0.25 s each, water mark 1: both workers' first slices reach the
    server's downlink at 1.6 and share it (0.25 s each at half the rate), so both land at 2.1; worker
    0's is served first, parked until worker 1's is summed, and its RECEIVED notice frees the slot at
    2.2, so the second slice leaves then, not after the reply: the replies to both workers share the
    server's uplink (0.5 s), so worker 0's lands at 2.1 + 0.5 + 0.1 = 2.7."""
    latency = 0.1
    cluster = at_whole_rate(2, 1, RATE, latency_s=latency, **FREE)
    result = simulate(one_gradient(2_000_000), cluster, Strategy("p3", slice_size=250_000, water_mark=1))
    assert [(round(t, 9), param, part) for t, param, part in result.sends[:2]] == [(1.5, 0, 0), (2.2, 0, 1)]
    assert result.notices > 0
    assert result.replies[0][0] == pytest.approx(2.7)


def test_no_notices_where_the_cap_never_binds() -> None:
    """p3_sender asks for a notice only for the request that fills the cap or one sent while others
    queue, decided once its group has left the queue: 2 slices under a water mark of 10 ask for none;
    under a water mark of 2 the second fills the cap and asks."""
    cluster = at_whole_rate(2, 1, RATE, latency_s=0.1, **FREE)
    loose = simulate(one_gradient(2_000_000), cluster, Strategy("p3", slice_size=250_000, water_mark=10))
    full = simulate(one_gradient(2_000_000), cluster, Strategy("p3", slice_size=250_000, water_mark=2))
    assert loose.notices == 0 and full.notices > 0


def test_a_small_request_passes_the_water_mark() -> None:
    """A bias of 10 elements (priority 0) and a weight of 4 slices of 0.25 s, both finished by the one
    backward segment, water mark 1: the bias takes no slot, so the weight's first slice leaves with it
    and the weight's slices go as in test_water_mark_one_serialises_slices (a round trip each)."""
    latency = 0.1
    workload = Workload(("b", "w"), (40, 4_000_000), (1.0,), ((0, 1),), (0.5,), ((0, 1),))
    result = simulate(workload, at_whole_rate(1, 1, RATE, latency_s=latency, **FREE), Strategy("p3", slice_size=250_000, water_mark=1))
    assert [(param, part) for _, param, part in result.sends[:2]] == [(0, 0), (1, 0)]
    assert result.sends[0][0] == result.sends[1][0]  # together: the bias did not wait for a slot
    assert result.iteration_s == pytest.approx(1.5 + 4 * (0.25 + 0.25 + 2 * latency), abs=1e-3)  # the bias's bytes: 1e-5 s


def test_a_segments_requests_to_one_server_share_a_message(monkeypatch: pytest.MonkeyPatch) -> None:
    """p3 queues a segment's gradients together: a and b leave in one message (one message_s of the
    sender); with TANDEM_PS_COALESCE_BYTES=0 b leaves one message_s after a."""
    workload = Workload(("a", "b"), (400, 400), (1.0,), ((0, 1),), (0.5,), ((0, 1),))
    machine = dataclasses.replace(NO_COST, message_s=0.001)
    cluster = at_whole_rate(1, 1, 1e30, latency_s=0.0, machine=machine)
    together = simulate(workload, cluster, Strategy("p3", slice_size=10**7)).sends
    assert together[0][0] == together[1][0]
    monkeypatch.setenv("TANDEM_PS_COALESCE_BYTES", "0")
    alone = simulate(workload, cluster, Strategy("p3", slice_size=10**7)).sends
    assert alone[1][0] - alone[0][0] == pytest.approx(0.001)


def test_the_plain_server_answers_a_poll_in_one_message_per_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    """Baseline, 1 worker, free links and server, message_s 1 ms: after backward (4 s) the two pushes
    leave in one message (4.001), the two pulls in another (4.002). The server acknowledges the
    pushes of its first poll in one message (received 4.001-4.002) and answers the pulls of its second in
    one (4.002-4.003). With TANDEM_PS_COALESCE_BYTES=0 every request and reply is a message of its own:
    4 sent (until 4.004) and 4 received one after another, the last reply from 4.004 to 4.005."""
    workload = Workload(("a", "b"), (40, 40), (1.0, 1.0), ((0,), (1,)), (1.0, 1.0), ((1,), (0,)))
    cluster = at_whole_rate(1, 1, 1e30, latency_s=0.0, machine=dataclasses.replace(NO_COST, message_s=0.001))
    assert simulate(workload, cluster, Strategy("baseline")).iteration_s == pytest.approx(4.003)
    monkeypatch.setenv("TANDEM_PS_COALESCE_BYTES", "0")
    assert simulate(workload, cluster, Strategy("baseline")).iteration_s == pytest.approx(4.005)


def test_p3_serves_a_poll_by_priority_and_replies_at_once() -> None:
    """p3, 1 worker, free links, the server 1 s per request and per reply. Backward finishes c (priority
    -2) at 1.1, b (-1) at 1.2, a (0) at 1.3, each sent as its segment ends. c lands first and is
    served alone (1.1-2.1, its reply 2.1-3.1); b and a land meanwhile and are the next poll, served by
    priority: a (3.1-4.1, reply until 5.1), then b (5.1-6.1, reply until 7.1). In arrival order b
    would be back at 5.1 and a at 7.1."""
    workload = Workload(("a", "b", "c"), (40, 40, 40), (1.0,), ((0, 1, 2),), (0.1, 0.1, 0.1), ((2,), (1,), (0,)))
    cluster = at_whole_rate(1, 1, 1e30, latency_s=0.0, machine=dataclasses.replace(NO_COST, server_message_s=1.0))
    replies = simulate(workload, cluster, Strategy("p3", slice_size=10**7)).replies
    assert [(round(t, 9), param) for t, param, _ in replies[:3]] == [(3.1, 2), (5.1, 0), (7.1, 1)]


def test_colocated_servers_share_their_workers_nic() -> None:
    """2 workers + 2 colocated servers, one 1M-element gradient split over both servers (2 MB each): at
    1.5 s each worker's own part lands at once, the other crosses to the other host (0.5 s); each server
    answers its own worker at once and the other over the link it shares with its worker (0.5 s more)."""
    cluster = at_whole_rate(2, 2, RATE, latency_s=0.0, colocated=True, **FREE)
    assert simulate(one_gradient(), cluster, Strategy("overlap")).iteration_s == pytest.approx(1.5 + 0.5 + 0.5)
    with pytest.raises(ValueError, match="at most 2 servers"):
        Cluster(2, 3, RATE, colocated=True)


def test_ring_allreduce_formula() -> None:
    cluster = at_whole_rate(4, 0, RATE, latency_s=0.01, machine=Machine(message_s=0.0007, entry_s=0.0003))  # a step: 1 ms
    assert allreduce_seconds(4_000_000, cluster) == pytest.approx(2 * 3 / 4 * 1.0 + 6 * (0.01 + 2 * 0.001))
    assert allreduce_seconds(4_000_000, at_whole_rate(1, 0, RATE)) == 0.0
    result = simulate(one_gradient(), cluster, Strategy("allreduce"))
    assert result.iteration_s == pytest.approx(1.5 + allreduce_seconds(4_000_000, cluster))
    half = simulate(one_gradient(), cluster, Strategy("allreduce", compression="fp16"))
    assert half.iteration_s == pytest.approx(1.5 + allreduce_seconds(2_000_000, cluster))


def test_allreduce_buckets_overlap_backward() -> None:
    """Bucket b (ready at 3 s) is reduced during a's backward segment; only a's bucket is exposed."""
    cluster = at_whole_rate(2, 0, RATE, latency_s=0.0, machine=Machine(message_s=0.0, entry_s=0.0))
    result = simulate(two_layers(), cluster, Strategy("allreduce", bucket_bytes=1))
    assert result.iteration_s == pytest.approx(4.0 + 1.0)  # each bucket: 2 (W-1)/W x 1 s = 1 s
    assert result.exposed_s == pytest.approx(1.0)


def test_collective_one_gradient_by_hand() -> None:
    """One slice: ordered, the ring all-reduce at once; in rounds, a round (2 (W-1) steps of latency +
    2 message_s) first. The next forward waits for it."""
    cluster = at_whole_rate(2, 0, RATE, latency_s=0.01, machine=dataclasses.replace(NO_COST, message_s=0.001))
    ordered = simulate(one_gradient(), cluster, Strategy("collective", slice_size=10**7, ordered=True))
    assert ordered.iteration_s == pytest.approx(1.5 + allreduce_seconds(4_000_000, cluster))
    # one collective: 2 (W-1) ring steps of a send and a receive
    assert (ordered.worker_cpu_s, ordered.server_cpu_s) == pytest.approx((1.5 + 2 * 2 * 0.001, 0.0))
    result = simulate(one_gradient(), cluster, Strategy("collective", slice_size=10**7, ordered=False))
    assert result.iteration_s == pytest.approx(1.5 + allreduce_seconds(0, cluster) + allreduce_seconds(4_000_000, cluster))
    assert result.exposed_s == pytest.approx(result.iteration_s - 1.5)
    # two collectives (the round, the all-reduce)
    assert (result.worker_cpu_s, result.server_cpu_s) == pytest.approx((1.5 + 2 * 2 * 2 * 0.001, 0.0))


def test_where_the_workers_update_their_update_runs_before_the_next_forward() -> None:
    """One gradient, 0.25 s of update: the collective and allreduce workers run it before each forward
    (after the first), so it adds to their step; servers that update leave the workers' step alone
    unless told ``update_on="workers"``."""
    updating = dataclasses.replace(one_gradient(), update_s=(0.25,))
    cluster = at_whole_rate(2, 0, RATE, latency_s=0.01, machine=dataclasses.replace(NO_COST, message_s=0.001))
    plain = simulate(one_gradient(), cluster, Strategy("collective", slice_size=10**7))
    collective = simulate(updating, cluster, Strategy("collective", slice_size=10**7))
    assert collective.iteration_s == pytest.approx(plain.iteration_s + 0.25)
    assert (collective.compute_s, collective.worker_cpu_s) == pytest.approx((1.75, plain.worker_cpu_s + 0.25))
    allreduce = simulate(updating, cluster, Strategy("allreduce"))
    assert allreduce.iteration_s == pytest.approx(1.5 + allreduce_seconds(4_000_000, cluster) + 0.25)
    servers = at_whole_rate(1, 1, RATE, latency_s=0.0, **FREE)
    on_servers = simulate(updating, servers, Strategy("overlap"))
    assert on_servers.iteration_s == pytest.approx(simulate(one_gradient(), servers, Strategy("overlap")).iteration_s)
    on_workers = simulate(updating, servers, Strategy("overlap", update_on="workers"))
    assert on_workers.iteration_s == pytest.approx(on_servers.iteration_s + 0.25)
    with pytest.raises(ValueError, match="one time per forward segment"):
        dataclasses.replace(one_gradient(), update_s=(0.1, 0.1))


def test_collective_slices_overtake_by_priority_under_the_water_mark() -> None:
    """b (4 slices of 0.5 s, priority -1) is finished at 3 s, a (2 slices, priority 0) at 3.2 s. In rounds
    with water mark 1 a's slices go as soon as b's first completes (3.5 s, its round is free here);
    with 10, b's four were all issued at 3 s and a waits for them. Ordered, a waits behind b's send
    whatever the water mark."""
    layers = Workload(("a", "b"), (4_000_000, 8_000_000), (1.0, 1.0), ((0,), (1,)), (1.0, 0.2), ((1,), (0,)))
    cluster = at_whole_rate(2, 0, RATE, latency_s=0.0, **FREE)
    capped = simulate(layers, cluster, Strategy("collective", slice_size=500_000, water_mark=1, ordered=False))
    assert [(round(t, 6), p, n) for t, p, n in capped.sends[:4]] == [(3.0, 1, 0), (3.5, 0, 0), (4.0, 0, 1), (4.5, 1, 1)]
    loose = simulate(layers, cluster, Strategy("collective", slice_size=500_000, water_mark=10, ordered=False))
    assert [p for _, p, _ in loose.sends[:6]] == [1, 1, 1, 1, 0, 0]
    assert capped.iteration_s < loose.iteration_s  # a is back (and the next forward starts) 1 s earlier
    ordered = simulate(layers, cluster, Strategy("collective", slice_size=500_000, water_mark=1, ordered=True))
    assert [(round(t, 6), p) for t, p, _ in ordered.sends[:6]] == [(3.0, 1), (3.5, 1), (4.0, 1), (4.5, 1), (5.0, 0), (5.5, 0)]
    assert ordered.iteration_s == pytest.approx(loose.iteration_s)


@pytest.mark.parametrize(("cores", "expected"), [(math.inf, 5.0), (1.0, 6.0)])
def test_a_collectives_cpu_slows_the_compute_beside_it(cores: float, expected: float) -> None:
    """b's all-reduce (1 s on the ring, 1 s of CPU) runs beside a's backward segment (1 s). With a core
    to spare both take 1 s (3-4) and a's all-reduce follows (4-5); on one core they share it and both
    end at 5, a's all-reduce at 6: the next forward starts 1 s later each iteration."""
    machine = dataclasses.replace(NO_COST, byte_s=1 / 8e6, cores=cores)  # 2 x 4 MB sent and received: 1 s
    cluster = at_whole_rate(2, 0, RATE, latency_s=0.0, machine=machine)
    each_segment = Strategy("collective", slice_size=10**7, send_bucket_elements=0)  # b leaves as its segment ends
    assert simulate(two_layers(), cluster, each_segment).iteration_s == pytest.approx(expected)


def test_collective_sends_wait_for_a_bucket_of_finished_gradients() -> None:
    """As the trainer does: by default a send waits for one slice's worth of finished gradients, the
    rest leaving when backward ends. With slices of 10M elements b (1M) waits for a, and both leave
    at 4 s in one fused collective of 8 MB (2 s): 6 s, against 5 s where b leaves at 3 s."""
    cluster = at_whole_rate(2, 0, RATE, latency_s=0.0, machine=dataclasses.replace(NO_COST, byte_s=1 / 8e6))
    bucketed = simulate(two_layers(), cluster, Strategy("collective", slice_size=10**7))
    assert [round(t, 6) for t, _, _ in bucketed.sends[:2]] == [4.0, 4.0]
    assert bucketed.iteration_s == pytest.approx(6.0)
    small = simulate(two_layers(), cluster, Strategy("collective", slice_size=10**7, send_bucket_elements=1_000_000))
    assert small.iteration_s == pytest.approx(5.0)  # b alone fills a bucket of 1M: it leaves at 3 s


def test_compressed_collectives_sum_16_bits_and_gather_2_bits() -> None:
    """As the store does: fp16 slices are all-reduced in 16 bits (4 workers: 2 x 3/4 x 2 MB = 0.75 s),
    2-bit and int8 codes all-gathered (each worker decodes and sums them: 3 x 250 kB = 0.1875 s, where
    an all-reduce of them would take 0.09375 s; int8: 3 x 1.0625 MB = 0.797 s).
    Each after 1.5 s of compute."""
    cluster = at_whole_rate(4, 0, RATE, latency_s=0.0, **FREE)
    fp16 = simulate(one_gradient(), cluster, Strategy("collective", slice_size=10**7, compression="fp16"))
    assert allreduce_seconds(2_000_000, cluster) == pytest.approx(0.75)
    assert fp16.iteration_s == pytest.approx(1.5 + 0.75)
    two_bit = simulate(one_gradient(), cluster, Strategy("collective", slice_size=10**7, compression="2bit"))
    assert allgather_seconds(250_000, cluster) == pytest.approx(0.1875)
    assert two_bit.iteration_s == pytest.approx(1.5 + 0.1875)
    int8 = simulate(one_gradient(), cluster, Strategy("collective", slice_size=10**7, compression="int8"))
    # int8 with its scales (4 bytes per 64 elements): 1.0625 MB, 1/16 more than fp16's time with 4 workers
    assert int8.iteration_s == pytest.approx(1.5 + allgather_seconds(1_062_500, cluster)) == pytest.approx(2.296875)


def test_each_refill_waits_for_a_round_unless_ordered() -> None:
    """Water mark 1, 4 slices of 1 MB (0.25 s of wire, 0.1 s of latency), rounds of 0.1 s (2 (W-1)
    latencies of 0.05 s): in rounds, a round agrees on the gradient, then each completion needs a round
    before the next slice goes; ordered, none."""
    cluster = at_whole_rate(2, 0, RATE, latency_s=0.05, **FREE)
    result = simulate(one_gradient(), cluster, Strategy("collective", slice_size=250_000, water_mark=1, ordered=False))
    one_slice = allreduce_seconds(1_000_000, cluster)  # 0.25 s of wire + 0.1 s of latency
    assert result.iteration_s == pytest.approx(1.5 + 4 * (0.1 + one_slice))
    ordered = simulate(one_gradient(), cluster, Strategy("collective", slice_size=250_000, water_mark=1, ordered=True))
    assert ordered.iteration_s == pytest.approx(1.5 + 4 * one_slice)  # ordered: each completion frees its credit here


def test_collective_fuses_small_slices_queued_together() -> None:
    """Two small gradients of one segment share one collective: one fixed cost, not two."""
    pair = Workload(("a", "b"), (400, 400), (1.0,), ((0, 1),), (0.5,), ((0, 1),))
    cluster = at_whole_rate(2, 0, RATE, latency_s=0.01, **FREE)
    result = simulate(pair, cluster, Strategy("collective", slice_size=1000))
    assert result.iteration_s == pytest.approx(1.5 + allreduce_seconds(0, cluster) + allreduce_seconds(800, cluster))
    assert len({t for t, _, _ in result.sends}) == len(result.sends) // 2  # each send time carries both


def test_more_workers_share_the_server_link() -> None:
    one = simulate(one_gradient(), at_whole_rate(1, 1, RATE, latency_s=0.0, **FREE), Strategy("overlap"))
    two = simulate(one_gradient(), at_whole_rate(2, 1, RATE, latency_s=0.0, **FREE), Strategy("overlap"))
    two_servers = simulate(one_gradient(), at_whole_rate(2, 2, RATE, latency_s=0.0, **FREE), Strategy("p3", slice_size=500_000))
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
        simulate(one_gradient(), at_whole_rate(2, 0, RATE), Strategy("p3"))
    simulate(one_gradient(), at_whole_rate(2, 0, RATE), Strategy("allreduce"))  # no servers needed
    with pytest.raises(ValueError, match="mode must be one of"):
        Strategy("ring")  # type: ignore[arg-type]


# -- CPU contention (Machine.cores, Machine.shared_host) -------------------------------------------------


@pytest.mark.parametrize(("cores", "expected"), [(1.0, [2.0, 4.0]), (2.0, [1.0, 3.0]), (math.inf, [1.0, 3.0])])
def test_processor_sharing_by_hand(cores: float, expected: list[float]) -> None:
    """2 jobs of 1 s and 3 s on 1 core: both at half speed until the first ends at 2 s, then the other
    alone: it ends at 2 + 2 = 4 s. On 2 cores (or unlimited) neither is slowed."""
    events = Events()
    ends: list[float] = []
    cpu = CPU(events, cores)
    cpu.run(1.0, lambda: ends.append(events.now))
    cpu.run(3.0, lambda: ends.append(events.now))
    events.run()
    assert ends == pytest.approx(expected)


def test_background_threads_take_their_share() -> None:
    """Jobs of 1 s and 3 s on 1 core beside 1 always-runnable thread of other work: each runs at 1/3 until the
    first ends at 3 s (the other has 2 s left), then at 1/2: it ends at 3 + 4 = 7 s."""
    events = Events()
    ends: list[float] = []
    cpu = CPU(events, 1.0, background=1.0)
    cpu.run(1.0, lambda: ends.append(events.now))
    cpu.run(3.0, lambda: ends.append(events.now))
    events.run()
    assert ends == pytest.approx([3.0, 7.0])


def test_a_job_arriving_later_slows_the_running_one() -> None:
    """A 2 s job alone for 1 s (1 s left), then a 0.5 s job joins on 1 core: both at half speed, the short
    one ends at 1 + 1 = 2 s (the long one has 0.5 s left), the long one at 2.5 s."""
    events = Events()
    ends: dict[str, float] = {}
    cpu = CPU(events, 1.0)
    cpu.run(2.0, lambda: ends.update(long=events.now))
    events.at(1.0, lambda: cpu.run(0.5, lambda: ends.update(short=events.now)))
    events.run()
    assert ends == pytest.approx({"short": 2.0, "long": 2.5})


def test_a_link_shares_its_rate_between_peers_and_keeps_each_peers_order() -> None:
    """Messages of 1 s to two peers leave together: the peers' flows share the rate, so both end at 2 s
    (not 1 and 2, as one FIFO would have it); a second message to peer a waits for the first, then
    has the link to itself: 2 + 1 = 3 s. Each starts when its flow's earlier messages have left. An
    empty message (a notice) to a third peer ends at once and slows no one; one to peer a waits for
    a's earlier messages."""
    events = Events()
    ends: dict[str, float] = {}
    starts: dict[str, float] = {}
    link = Link(events)
    for name, peer, seconds in (("a1", ("worker", 0), 1.0), ("b", ("worker", 1), 1.0), ("a2", ("worker", 0), 1.0),
                                ("c0", ("server", 0), 0.0), ("a0", ("worker", 0), 0.0)):  # fmt: skip
        link.put(peer, seconds, partial(lambda n: ends.update({n: events.now}), name),
                 started=partial(lambda n: starts.update({n: events.now}), name))  # fmt: skip
    events.run()
    assert ends == pytest.approx({"a1": 2.0, "b": 2.0, "a2": 3.0, "c0": 0.0, "a0": 3.0})
    assert starts == pytest.approx({"a1": 0.0, "b": 0.0, "a2": 2.0, "c0": 0.0, "a0": 3.0})


def test_costs_per_byte_at_both_ends() -> None:
    """One 4e6-byte pushpull, no latency: the worker pays byte_s on the push it sends and the reply it
    receives, the server server_byte_s on both and two summing passes (4e6 B / 4e7 B/s = 0.1 s each)."""
    machine = dataclasses.replace(NO_COST, byte_s=1e-8, server_byte_s=2e-8, aggregate_Bps=4e7)
    result = simulate(one_gradient(), at_whole_rate(1, 1, RATE, latency_s=0.0, machine=machine), Strategy("overlap"))
    assert result.iteration_s == pytest.approx(1.5 + 2.0 + 2 * 0.04 + 2 * 0.08 + 2 * 0.1)


def test_a_shared_host_slows_compute_by_its_communication() -> None:
    """1 worker + 1 server on one core. Worker CPU per message 0.5 s (push sent, reply received); the
    server's 0.25 s per message (request, reply); links and summing free. Iteration: forward 1 s, backward
    0.5 s, then one thread at a time: send 0.5, serve 0.25 + 0.25, receive 0.5 = 1.5 s; 3 s in all.
    Two workers on that core take twice as long; with a core per thread they overlap."""
    machine = dataclasses.replace(NO_COST, message_s=0.5, server_message_s=0.25, cores=1, shared_host=True)
    fast = dict(latency_s=0.0, rate_bps=1e30)
    one = simulate(one_gradient(), at_whole_rate(1, 1, machine=machine, **fast), Strategy("overlap"))
    assert one.iteration_s == pytest.approx(3.0)
    # two workers on 1 core: compute is 2 x 1.5 s of work on one core; each worker's messages (1 s) and the
    # server's (4 x 0.25 s) are work on the same core: 3 + 2 + 1 = 6 s per iteration, all of it serialised
    two = simulate(one_gradient(), at_whole_rate(2, 1, machine=machine, **fast), Strategy("overlap"))
    assert two.iteration_s == pytest.approx(6.0)
    spare = dataclasses.replace(machine, cores=math.inf)
    assert simulate(one_gradient(), at_whole_rate(2, 1, machine=spare, **fast), Strategy("overlap")).iteration_s == \
        pytest.approx(1.5 + 0.5 + 2 * 0.25 + 0.25 + 0.5)  # compute, send, the two pushes served in turn, w0's reply, receive
    # (steady state: worker 1 runs 0.25 s behind worker 0, its reply second; its push arrives as the server is free)


def test_small_slices_cost_compute_on_a_shared_host() -> None:
    """Per-message CPU on the shared cores: more slices, slower steps; with a core per thread it hides."""
    machine = dataclasses.replace(NO_COST, message_s=0.01, server_message_s=0.01, cores=2, shared_host=True)
    cluster = at_whole_rate(2, 2, 1e30, latency_s=0.0, machine=machine)
    coarse = simulate(two_layers(), cluster, Strategy("p3", slice_size=1_000_000)).iteration_s
    fine = simulate(two_layers(), cluster, Strategy("p3", slice_size=100_000)).iteration_s
    assert fine > coarse + 0.1


# -- the wake-up fee (Machine.wake) --------------------------------------------------------------------


def test_the_wake_up_fee_is_interpolated_between_measured_gaps() -> None:
    """Linear from (0, 0) to each measured point, flat beyond the last; the server's column for servers."""
    machine = Machine(wake=((1e-3, 10e-6, 20e-6), (5e-3, 30e-6, 60e-6)))
    assert machine.wake_s(0.5e-3) == pytest.approx(5e-6)
    assert machine.wake_s(0.5e-3, server=True) == pytest.approx(10e-6)
    assert machine.wake_s(3e-3) == pytest.approx(20e-6)  # half way from 10 to 30 us
    assert machine.wake_s(3e-3, server=True) == pytest.approx(40e-6)
    assert machine.wake_s(math.inf) == pytest.approx(30e-6)
    assert Machine().wake_s(1.0) == 0.0  # no points: no fee
    assert Machine(wake=[[1e-3, 1e-6, 2e-6]]).wake == ((1e-3, 1e-6, 2e-6),)  # type: ignore[list-item]  # as JSON has it


@pytest.mark.parametrize("wake", [((5e-3, 0, 0), (1e-3, 0, 0)), ((1e-3, -1e-6, 0),), ((0.0, 1e-6, 1e-6),),
                                  ((1e-3, 1e-6),), ((math.inf, 1e-6, 1e-6),), ((1e-3, math.nan, 0),)])  # fmt: skip
def test_a_malformed_wake_up_fee_is_refused(wake: Any) -> None:
    with pytest.raises(ValueError, match="wake: points"):
        Machine(wake=wake)


def test_a_thread_woken_from_idle_pays_the_fee_a_queued_job_does_not() -> None:
    """Fee 0.5 s after more than 1 s idle, else 0.1 s. Two 1 s jobs at 0: the first wakes the thread (never
    busy: the longest fee), 1.5 s; the second was queued, no fee: 2.5 s. A job at 3 s (idle 0.5 s): 4.1 s;
    one at 6 s (idle 1.9 s): 7.5 s."""
    events = Events()
    ends: list[float] = []
    thread = Resource(events, CPU(events), wake=lambda idle: 0.5 if idle > 1.0 else 0.1)
    for start in (0.0, 0.0, 3.0, 6.0):
        events.at(start, lambda: thread.put(1.0, lambda: ends.append(events.now)))
    events.run()
    assert ends == pytest.approx([1.5, 2.5, 4.1, 7.5])
    assert thread.charged == pytest.approx(4 * 1.0 + 0.5 + 0.1 + 0.5)  # the CPU charged counts the fees


def test_a_job_put_as_the_last_one_ends_pays_no_fee() -> None:
    """A job put from the ``done`` of the job before it (a server's reply after its request) finds the
    thread still busy: 1.5 s (woken), then 1 s more: 2.5 s."""
    events = Events()
    ends: list[float] = []
    thread = Resource(events, CPU(events), wake=lambda idle: 0.5)
    thread.put(1.0, lambda: thread.put(1.0, lambda: ends.append(events.now)))
    events.run()
    assert ends == pytest.approx([2.5])


def test_each_message_that_wakes_a_thread_pays_the_fee() -> None:
    """The one-gradient pushpull: the worker's sender and its IO thread are each woken once (0.01 s each);
    the server is woken by the request and sends the reply straight after (one fee, 0.02 s)."""
    machine = dataclasses.replace(NO_COST, wake=((1e-3, 0.01, 0.02),))
    result = simulate(one_gradient(), at_whole_rate(1, 1, RATE, latency_s=0.0, machine=machine), Strategy("overlap"))
    assert result.iteration_s == pytest.approx(1.5 + 2.0 + 2 * 0.01 + 0.02)
    assert (result.worker_cpu_s, result.server_cpu_s) == pytest.approx((1.5 + 2 * 0.01, 0.02))
