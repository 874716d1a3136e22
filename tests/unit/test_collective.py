"""The collective kvstore in one process: two workers as two threads over gloo (real collectives, no launcher)."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tandem.kvstore.base import Handle
from tandem.kvstore.collective import group as group_module
from tandem.kvstore.collective.group import Group, listen_address, route_address
from tandem.kvstore.collective.scheduler import Operation, Scheduler
from tandem.kvstore.collective.store import CollectiveKVStore
from tandem.kvstore.config import DistOptions, KVStoreConfig, P3Options
from tandem.kvstore.errors import KVStoreError
from tandem.kvstore.flat import elements, flat_view

_JOBS = itertools.count()


def _each_worker(workers: int, function: Callable[[CollectiveKVStore], Any], slice_size: int = 7,
                 water_mark: int = 2, slice_sizes: list[int] | None = None) -> list[Any]:  # fmt: skip
    """``function(store)`` on each of ``workers`` stores, one thread each; returns the results by rank."""
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    options = DistOptions.from_env("dist_sync", exit_on_failure=False)
    name = f"unit{next(_JOBS)}"

    def run(rank: int) -> Any:
        store = CollectiveKVStore(Group(rank, workers, "127.0.0.1", master.port, workers), options,
                                  P3Options(slice_sizes[rank] if slice_sizes else slice_size, water_mark), name=name)  # fmt: skip
        try:
            return function(store)
        finally:
            store.close()

    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(run, range(workers)))


SIZES = [1, 13, 100, 7, 0, 50]  # slices of 7: most tensors end in a short slice; one is empty


def test_odd_slices_reassemble_exactly() -> None:
    keys = [f"k{i}" for i in range(len(SIZES))]

    def work(kv: CollectiveKVStore) -> list[list[torch.Tensor]]:
        kv.init(keys, [torch.full((size,), float(kv.rank)) for size in SIZES])
        out = [torch.empty(size) for size in SIZES]
        kv.pull(keys, out).wait()
        assert all(bool((value == 0).all()) for value in out), "init: worker 0's values everywhere"
        steps = []
        for step in range(3):  # one pushpull per key, produced last layer first, first layer highest priority
            handles = [kv.pushpull(keys[i], _value(SIZES[i], kv.rank, step), out=out[i], priority=-i)
                       for i in reversed(range(len(SIZES)))]  # fmt: skip
            for handle in handles:
                handle.wait(timeout=30)
            steps.append([value.clone() for value in out])
        return steps

    for result in _each_worker(2, work):
        for step, values in enumerate(result):
            for size, value in zip(SIZES, values):
                assert torch.equal(value, _value(size, 0, step) + _value(size, 1, step)), (size, step)


def test_flat_pieces_are_the_tensor_or_a_view_and_never_track_gradients() -> None:
    bias = torch.zeros(5)
    assert flat_view(bias) is bias and elements(bias, 0, 5) is bias
    assert elements(bias, 1, 3).data_ptr() == bias[1:].data_ptr() and elements(bias, 1, 3).numel() == 2
    weight = torch.zeros(2, 3, requires_grad=True)
    flat = flat_view(weight)
    assert flat.shape == (6,) and not flat.requires_grad and flat.data_ptr() == weight.data_ptr()
    leaf = torch.zeros(4, requires_grad=True)
    assert flat_view(leaf) is not leaf and not flat_view(leaf).requires_grad
    strided = torch.arange(8.0).view(4, 2)[:, 0]  # 1-D but not contiguous: a strided view, in order
    assert flat_view(strided).data_ptr() == strided.data_ptr() and torch.equal(flat_view(strided), strided)
    transposed = torch.arange(6.0).view(2, 3).t()  # no flat view exists: a copy, in order
    assert torch.equal(flat_view(transposed), transposed.reshape(-1)) and flat_view(transposed).is_contiguous()


def _value(size: int, rank: int, step: int) -> torch.Tensor:
    return torch.arange(size, dtype=torch.float32) * (rank + 1) + step + 0.25


def test_push_then_pull_and_lists_of_keys() -> None:
    def work(kv: CollectiveKVStore) -> tuple[torch.Tensor, torch.Tensor]:
        kv.init(["a", "b"], [torch.zeros(3, 5), torch.zeros(20, dtype=torch.float64)])
        kv.push(["a", "b"], [torch.ones(3, 5), torch.arange(20, dtype=torch.float64)])
        a, b = torch.empty(3, 5), torch.empty(20, dtype=torch.float64)
        kv.pull(["a", "b"], [a, b]).wait(timeout=30)  # after the pushes before it
        kv.barrier()
        return a, b

    for a, b in _each_worker(2, work):
        assert torch.equal(a, torch.full((3, 5), 2.0)) and torch.equal(b, 2 * torch.arange(20, dtype=torch.float64))


@pytest.mark.parametrize("kind", ["fp16", "bf16", "2bit:0.5", "int8", "int4"])
def test_compressed_sums_are_the_same_everywhere_and_feed_back_errors(kind: str) -> None:
    """Every worker gets the same sum of the compressed pushes; what a push left out comes in later ones.
    A float64 key too: its 16-bit sums widen into float64 targets, its codes decode to float64."""

    def work(kv: CollectiveKVStore) -> list[list[torch.Tensor]]:
        kv.set_gradient_compression(kind)
        kv.init(["g", "h"], [torch.zeros(30), torch.zeros(30, dtype=torch.float64)])
        grad = torch.linspace(-1, 1, 30) * (kv.rank + 1) * 0.2  # under 2bit's threshold: it keeps up
        sums = []
        for _ in range(8):
            outs = [torch.empty(30), torch.empty(30, dtype=torch.float64)]
            kv.pushpull(["g", "h"], [grad, grad.double()], out=outs).wait(timeout=30)
            sums.append(outs)
        return sums

    first, second = _each_worker(2, work)
    exact = torch.linspace(-1, 1, 30) * 0.6  # the two workers' gradients summed
    for one, other in zip(first, second):
        assert all(torch.equal(mine, theirs) for mine, theirs in zip(one, other))
    for key, dtype in enumerate((torch.float32, torch.float64)):
        sent = torch.stack([sums[key] for sums in first]).mean(0)  # error feedback: on average, the gradient
        assert sent.dtype == dtype
        # each worker's residual stays under the threshold (2bit) or a rounding error (fp16, bf16, int8, int4)
        assert (sent - exact.to(dtype)).abs().max() <= (2 * 0.5 / 8 if kind.startswith("2bit") else 1e-2), (sent, exact)


@pytest.mark.parametrize("kind", ["fp16", "int8", "int4", "2bit:0.5"])
def test_two_pushes_of_a_key_in_one_collective_are_counted_once(kind: str) -> None:
    """Two operations of one key share a residual: encoded in one message they would count it twice,
    so a compressed unit takes one operation per key."""

    def work(kv: CollectiveKVStore) -> tuple[list[float], list[float]]:
        kv.set_gradient_compression(kind)
        kv.init("k", torch.zeros(4))
        first, second = torch.empty(4), torch.empty(4)
        with kv.batched():  # both wait in the queue together, small enough to share a collective
            handles = [kv.pushpull("k", torch.ones(4), out=first), kv.pushpull("k", torch.ones(4), out=second)]
        for handle in handles:
            handle.wait(timeout=30)
        return first.tolist(), second.tolist()

    for first, second in _each_worker(2, work, slice_size=100):
        expected = [1.0] * 4 if kind.startswith("2bit") else [2.0] * 4  # 2bit: 0.5 each, sent once the sum reaches it
        assert first == expected and second == expected, (first, second)


def test_mismatched_shapes_are_refused_naming_both() -> None:
    def work(kv: CollectiveKVStore) -> str:
        with pytest.raises(KVStoreError) as error:
            kv.init("w", torch.zeros(4, 8 + kv.rank))
        return str(error.value)

    for message in _each_worker(2, work):
        assert "key 'w' is (4, 8) torch.float32 on worker 0 but (4, 9) torch.float32 on worker 1" in message


def test_options_and_refusals() -> None:
    config = KVStoreConfig.resolve("collective", slice_size="auto", water_mark=4)
    assert config.p3 == P3Options(0, 4) and config.dist is not None and config.dist.sync
    with pytest.raises(TypeError, match="unknown kvstore option"):
        KVStoreConfig.resolve("collective", nonsense=1)

    def work(kv: CollectiveKVStore) -> None:
        kv.init("w", torch.zeros(2))
        with pytest.raises(KVStoreError, match="no servers"):
            kv.set_optimizer(object())
        with pytest.raises(KVStoreError, match="never initialised"):
            kv.push("nope", torch.zeros(2))
        with pytest.raises(KVStoreError, match=r"got shape \(3,\)"):
            kv.push("w", torch.zeros(3))

    _each_worker(2, work)


def test_init_while_pushes_are_pending_settles_them_first() -> None:
    """An init with pushes in flight waits for them, so every worker's scheduler agrees over the same keys."""

    def work(kv: CollectiveKVStore) -> tuple[torch.Tensor, torch.Tensor]:
        kv.init("a", torch.zeros(50))
        pushed = kv.push("a", torch.ones(50) * (kv.rank + 1))  # not waited for: pending at the next init
        kv.init("b", torch.zeros(9))
        assert pushed.done
        a, b = torch.empty(50), torch.empty(9)
        kv.pushpull(["a", "b"], [torch.ones(50), torch.ones(9)], out=[a, b]).wait(timeout=30)
        return a, b

    for a, b in _each_worker(2, work):
        assert torch.equal(a, torch.full((50,), 2.0)) and torch.equal(b, torch.full((9,), 2.0))


def test_schedulers_with_different_numbers_of_keys_are_an_error() -> None:
    """The agreement carries how many keys each worker has: a difference is an error, never a MIN over
    vectors of different lengths."""

    class OtherHasMoreKeys:  # the control group: the other worker knows one key more
        def allreduce(self, tensors: list[torch.Tensor], options: Any) -> Any:
            tensors[0][1] = -(int(tensors[0][0]) + 1)
            return self

        def wait(self, timeout: Any) -> bool:
            return True

    errors: list[BaseException] = []
    scheduler = Scheduler(0, 2, OtherHasMoreKeys(), None, 5.0, errors.append)
    try:
        scheduler.add_key()
        with pytest.raises(KVStoreError, match=r"different numbers of keys \(1 to 2\)"):
            scheduler._round(torch.tensor([1, -1, 1, 0]))
    finally:
        scheduler.stop(timeout=5)


def test_different_slice_sizes_are_refused_at_init_naming_both() -> None:
    def work(kv: CollectiveKVStore) -> str:
        with pytest.raises(KVStoreError) as error:
            kv.init("w", torch.zeros(4))
        return str(error.value)

    for message in _each_worker(2, work, slice_sizes=[7, 0]):  # 0: "auto"
        assert "the workers' slice sizes differ: 7 on worker 0 but auto on worker 1" in message, message


def test_gloo_listens_on_the_chosen_interface_the_bind_address_or_the_route(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.delenv("TANDEM_BIND_ADDR", raising=False)
    assert listen_address("127.0.0.1", 29500) == "127.0.0.1"  # a loopback route: that address, not gloo's pick
    monkeypatch.setenv("TANDEM_BIND_ADDR", "0.0.0.0")  # a wildcard names no address: the route
    assert listen_address("127.0.0.1", 29500) == "127.0.0.1"
    monkeypatch.setenv("TANDEM_BIND_ADDR", "10.1.2.3")
    assert listen_address("127.0.0.1", 29500) == "10.1.2.3"
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth0")
    assert listen_address("127.0.0.1", 29500) is None  # gloo uses the interface chosen
    assert route_address("::1", 29500) in ("::1", None)  # None where IPv6 is off
    assert route_address("no-such-host.invalid", 29500) is None


def test_an_ipv6_scope_is_stripped(monkeypatch: pytest.MonkeyPatch) -> None:
    class Probe:
        def __init__(self, *args: Any) -> None:
            pass

        def __enter__(self) -> Probe:
            return self

        def __exit__(self, *args: Any) -> None:
            pass

        def connect(self, target: Any) -> None:
            pass

        def getsockname(self) -> tuple[str, int]:
            return ("fe80::1%eth0", 1234)

    monkeypatch.setattr(group_module.socket, "getaddrinfo", lambda *args, **kwargs: [(10, 0, 0, "", ("fe80::2", 1))])
    monkeypatch.setattr(group_module.socket, "socket", Probe)
    assert route_address("fe80::2", 29500) == "fe80::1"


def test_a_round_the_job_failed_during_issues_nothing() -> None:
    failure = KVStoreError("the job failed")

    class FailsDuringTheAgreement:  # the control group: the job fails while the round waits
        def allreduce(self, tensors: list[torch.Tensor], options: Any) -> Any:
            scheduler.fail(failure)
            return self

        def wait(self, timeout: Any) -> bool:
            return True

    scheduler = Scheduler(0, 2, FailsDuringTheAgreement(), None, 5.0, lambda error: None)  # no data group
    scheduler.stop(timeout=5)  # no thread of its own: the round below is the only one
    scheduler.add_key()
    handle = Handle("push", 1)
    scheduler._state.submitted[0] = 1
    scheduler._state.waiting[0].append(Operation(0, "w", torch.ones(4), torch.ones(4), 7, 0, 2, handle))
    scheduler._round(torch.tensor([1, -1, 1, 0]))  # issuing would fail: there is no data group
    assert scheduler._state.issued == 0 and not scheduler._ready


@pytest.mark.parametrize("kind", [None, "fp16", "2bit:0.5", "int8", "int4"])
def test_small_slices_requested_together_share_collectives(kind: str | None) -> None:
    """Keys pushed in one batched() block reach the scheduler together; their slices, queued one behind
    the other, share collectives while they fit in one slice, and every sum still lands in its key."""
    sizes, slice_size = [1, 13, 100, 7, 0, 50, 300], 120  # 300: three slices, each its own collective

    def work(kv: CollectiveKVStore) -> tuple[list[list[torch.Tensor]], int]:
        if kind is not None:
            kv.set_gradient_compression(kind)
        keys = [f"k{i}" for i in range(len(sizes))]
        kv.init(keys, [torch.zeros(size) for size in sizes])
        steps = []
        before = kv.collectives
        for step in range(3):
            out = [torch.empty(size) for size in sizes]
            with kv.batched():
                handles = [kv.pushpull(keys[i], _value(sizes[i], kv.rank, step) / 64, out=out[i], priority=-i)
                           for i in reversed(range(len(sizes)))]  # fmt: skip
            for handle in handles:
                handle.wait(timeout=30)
            steps.append(out)
        return steps, kv.collectives - before

    (first, collectives), (second, _) = _each_worker(2, work, slice_size=slice_size, water_mark=10)
    # 8 slices a step; by priority: k0 k1 k2 (114 elements) | k3 k5 (57) | k6[0:120] | k6[120:240] | k6[240:300]
    assert collectives == 3 * 5, collectives
    for step, (mine, theirs) in enumerate(zip(first, second)):
        for size, one, other in zip(sizes, mine, theirs):
            assert torch.equal(one, other), "every worker gets the same sum"
            exact = (_value(size, 0, step) + _value(size, 1, step)) / 64
            if kind is None:
                assert torch.equal(one, exact), (size, step)
            elif kind == "fp16":
                assert torch.allclose(one, exact, rtol=1e-3, atol=1e-3), (size, step)
            elif kind in ("int8", "int4") and size:  # each block its own scale: within a 127th (a 7th) of the largest value
                levels = 127 if kind == "int8" else 7
                assert (one - exact).abs().max() <= exact.abs().max() / levels * 2, (size, step)


def test_requests_of_a_batched_block_fail_with_the_store_and_waits_inside_it_are_refused() -> None:
    def work(kv: CollectiveKVStore) -> tuple[str, str]:
        kv.init("w", torch.zeros(4))
        with kv.batched():
            with pytest.raises(KVStoreError) as inside:
                kv.barrier()  # would wait for the pushpull below, which leaves only at the block's end
        assert kv._scheduler is not None
        kv._scheduler.stop(timeout=5)  # the store is closing: the block's submission is refused
        with pytest.raises(KVStoreError), kv.batched():
            handle = kv.pushpull("w", torch.ones(4))
        with pytest.raises(KVStoreError) as failed:
            handle.wait(timeout=5)  # failed with the refusal, not left pending
        return str(inside.value), str(failed.value)

    inside, failed = _each_worker(1, work)[0]
    assert "inside kv.batched()" in inside and "closing" in failed


def _jittered_steps(kv: CollectiveKVStore, ordered: Callable[[int], bool], steps: int = 4) -> list[list[torch.Tensor]]:
    """Pushpulls of SIZES' keys, one call per key, last key first; worker 0 calls without pause, the others
    pause after each call (a round then ends between two of their calls, not of worker 0's), so that what
    is ready when differs by worker; ``ordered(call)`` says how each call is issued."""
    import time

    keys = [f"k{i}" for i in range(len(SIZES))]
    kv.init(keys, [torch.zeros(size) for size in SIZES])
    calls, results = itertools.count(), []
    for step in range(steps):
        out, handles = [torch.empty(size) for size in SIZES], []
        for i in reversed(range(len(SIZES))):
            kv.ordered = ordered(next(calls))
            handles.append(kv.pushpull(keys[i], _value(SIZES[i], kv.rank, step), out=out[i], priority=-i))
            time.sleep(0.004 * kv.rank)
        for handle in handles:
            handle.wait(timeout=30)
        results.append(out)
    return results


def _check_sums(results: list[list[list[torch.Tensor]]]) -> None:
    workers = len(results)
    for result in results:
        for step, values in enumerate(result):
            for size, value in zip(SIZES, values):
                assert torch.equal(value, sum(_value(size, rank, step) for rank in range(workers))), (size, step)


@pytest.mark.parametrize("workers", [2, 3])
def test_ordered_calls_are_issued_in_submission_order_without_rounds(workers: int) -> None:
    """Where every worker submits the same calls in the same order, ``ordered`` issues them in that order
    with no agreement round; each worker's own timing and credit do not change what is summed."""

    def work(kv: CollectiveKVStore) -> tuple[list[list[torch.Tensor]], int]:
        kv.init("warm", torch.zeros(1))  # the scheduler exists from the first init
        before = kv.rounds
        results = _jittered_steps(kv, lambda call: True)
        return results, kv.rounds - before

    outcomes = _each_worker(workers, work, water_mark=1)
    _check_sums([results for results, _ in outcomes])
    assert all(rounds == 0 for _, rounds in outcomes), [rounds for _, rounds in outcomes]


def test_ordered_calls_and_calls_in_rounds_may_follow_each_other() -> None:
    """Calls in rounds after an ordered call join the rounds once it is issued here, and an ordered call
    waits for every call in rounds before it: one sequence everywhere, whatever each worker's timing."""

    def work(kv: CollectiveKVStore) -> list[list[torch.Tensor]]:
        return _jittered_steps(kv, lambda call: call % 2 == 0, steps=6)

    _check_sums(_each_worker(3, work, water_mark=2))


def test_ordered_calls_of_many_keys_fuse_by_priority_within_each_call() -> None:
    """A Trainer's send: several keys in one ``batched()`` call, issued ordered by priority, small slices fused
    within the call; with workers pausing differently, every sum still lands in its key."""
    import time

    sizes, slice_size = [1, 13, 100, 7, 50, 300], 120

    def work(kv: CollectiveKVStore) -> tuple[list[list[torch.Tensor]], int]:
        keys = [f"k{i}" for i in range(len(sizes))]
        kv.init(keys, [torch.zeros(size) for size in sizes])
        kv.ordered, steps, before = True, [], kv.rounds
        for step in range(3):
            out, handles = [torch.empty(size) for size in sizes], []
            for group in ([5, 4], [3, 2, 1], [0]):  # as backward segments send: the last layers first
                with kv.batched():
                    handles += [kv.pushpull(keys[i], _value(sizes[i], kv.rank, step), out=out[i], priority=-i)
                                for i in group]  # fmt: skip
                time.sleep(0.003 * kv.rank)
            for handle in handles:
                handle.wait(timeout=30)
            steps.append(out)
        return steps, kv.rounds - before

    outcomes = _each_worker(3, work, slice_size=slice_size, water_mark=1)
    for results, rounds in outcomes:
        assert rounds == 0
        for step, values in enumerate(results):
            for size, value in zip(sizes, values):
                assert torch.equal(value, sum(_value(size, rank, step) for rank in range(3))), (size, step)


def test_ordered_calls_waiting_when_the_job_fails_fail_too() -> None:
    failure = KVStoreError("the job failed")
    scheduler = Scheduler(0, 2, None, None, 5.0, lambda error: None)  # no groups: nothing may be issued
    scheduler.add_key()
    with scheduler._cond:
        scheduler._broken = True  # the scheduler thread issues nothing from here on
    handle = Handle("pushpull", 1)
    scheduler.submit([Operation(0, "w", torch.ones(4), torch.ones(4), 7, 0, 2, handle, None, True)])
    assert scheduler._state.pending and not scheduler.idle()
    scheduler.fail(failure)
    with pytest.raises(KVStoreError, match="the job failed"):
        handle.wait(timeout=5)
    assert not scheduler._state.pending
    scheduler.stop(timeout=5)
    mixed = Scheduler(0, 2, None, None, 5.0, lambda error: None)
    mixed.add_key()
    try:
        with pytest.raises(KVStoreError, match="mixes ordered"):
            mixed.submit([Operation(0, "w", torch.ones(4), torch.ones(4), 7, 0, 2, Handle("a", 1), None, flag)
                          for flag in (True, False)])  # fmt: skip
    finally:
        mixed.stop(timeout=5)


def test_the_tuners_ordered_timing_sends_during_backward_in_order() -> None:
    """Under a Trainer's TANDEM_COLLECTIVE_ORDERED=auto the tuner's timings include ``ordered``: during backward,
    without rounds; ``during`` keeps the rounds (P3's overtaking); ``after`` sends one call, in order."""
    from tandem.kvstore.collective.store import COLLECTIVE_SEND_TIMINGS
    from tandem.kvstore.ps.p3_tuner import Config

    def work(kv: CollectiveKVStore) -> list[tuple[str, bool]]:
        kv.tune_order, seen = True, []
        assert kv.send_timings == COLLECTIVE_SEND_TIMINGS
        for timing in ("ordered", "during", "after", "serial"):
            kv._apply(Config(40_000, 10, timing))
            seen.append((kv.send_timing, kv.ordered))
        return seen

    assert _each_worker(1, work)[0] == [("during", True), ("during", False), ("after", True), ("serial", True)]


def test_a_different_grouping_of_sends_is_named() -> None:
    """At attach the workers compare how they group their sends (``_agree_on_sends``): the error names
    the first setting that differs, else the first send, else the count."""
    from tandem.update.distributed import _first_difference

    def grouping(bucket: int = -1, sends: list[list[str]] | None = None) -> dict[str, Any]:
        return {"TANDEM_COLLECTIVE_ORDERED": "auto", "communication": "overlap", "TANDEM_SEND_BUCKET_ELEMENTS": bucket,
                "TANDEM_PS_BATCH_SEGMENTS": True, "sends": [["fc.weight"], ["conv.weight"]] if sends is None else sends}  # fmt: skip

    assert _first_difference(grouping(), grouping(bucket=0)) == "TANDEM_SEND_BUCKET_ELEMENTS: -1 against 0"
    assert _first_difference(grouping(), grouping(sends=[["fc.weight"], ["conv.bias"]])) == (
        "send 1: ['conv.weight'] against ['conv.bias']")
    assert _first_difference(grouping(), grouping(sends=[["fc.weight"]])) == "2 sends against 1"
