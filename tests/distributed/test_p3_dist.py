"""The dist_p3 kvstore with real server and worker processes on 127.0.0.1.

Run as a script, this file is the job every process of those tests runs (``main`` below): a
server process serves (``kvstore.serve``) until the job ends; a worker checks and saves its results.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.distributed.jobs import REPO, job_env, launch_command, run_job, worker_lines

SLICE = {"TANDEM_KVSTORE_SLICE_THRESHOLD": "64"}
SHAPES: dict[str | int, tuple[int, ...]] = {
    "odd": (7, 3, 5),
    0: (),
    1: (1,),
    "w": (1000,),
    7: (3, 4),
    "big": (4_003,),
}


def _run(
    mode: str, kind: str, workers: int, servers: int, out: Path, env: dict[str, str] | None = None
) -> str:
    result = run_job(str(Path(__file__).resolve()), workers, servers, mode, kind, str(out),
                     env={**SLICE, "TANDEM_PS_CHECKPOINT_DIR": str(out), **(env or {})})  # servers save under out
    assert len(worker_lines(result.stdout, f"{mode} OK")) == workers, result.stdout
    return result.stdout


def _results(out: Path, workers: int) -> list[dict[str, torch.Tensor]]:
    return [torch.load(out / f"rank{rank}.pt", weights_only=True) for rank in range(workers)]


@pytest.mark.parametrize(("workers", "servers"), [(3, 2), (2, 3)])
def test_sliced_sums_reassemble_exactly_and_equal_dist_sync(
    workers: int, servers: int, tmp_path: Path
) -> None:
    _run("sums", "dist_p3", workers, servers, tmp_path / "p3")
    _run("sums", "dist_sync", workers, servers, tmp_path / "sync")
    for p3, plain in zip(_results(tmp_path / "p3", workers), _results(tmp_path / "sync", workers)):
        assert p3.keys() == plain.keys()
        for name in p3:
            assert torch.equal(p3[name], plain[name]), name


def test_batched_requests_leave_together_and_sum_exactly(tmp_path: Path) -> None:
    # no heartbeat within the test (each is a message too); no notice where the cap never binds
    _run("batched", "dist_p3", 2, 2, tmp_path,
         {"TANDEM_PS_WATER_MARK": "1000", "TANDEM_PS_HEARTBEAT": "30", "TANDEM_PS_TIMEOUT": "120"})


@pytest.mark.parametrize("kind", ["dist_p3", "dist_p3_async"])
def test_server_side_sgd(kind: str, tmp_path: Path) -> None:
    _run("optimizer", kind, 2, 2, tmp_path)


def test_trace_shows_a_late_high_priority_slice_overtaking_the_backlog(tmp_path: Path) -> None:
    env = {"TANDEM_PS_WATER_MARK": "1", "TANDEM_TRACE": str(tmp_path / "trace-{pid}.json")}
    _run("priority", "dist_p3", 1, 2, tmp_path, env)
    sends, serves = [], []
    for path in tmp_path.glob("trace-*.json"):
        events = [
            event for event in json.loads(path.read_text())["traceEvents"] if event.get("cat") == "comm"
        ]
        sends += [event for event in events if event["name"].startswith("send push")]
        serves += [event for event in events if event["name"].startswith("serve push")]
    sends.sort(key=lambda event: event["ts"])
    keys = [event["args"]["key"] for event in sends]
    assert keys.count("low") == 4003 // 64 + 1 and keys.count("high") == 1, keys
    # the low slices are queued first; the sender may hand a few over before "high" is queued
    assert keys.index("high") < 16, f"high-priority slice sent {keys.index('high')}th of {len(keys)}: {keys}"
    assert {event["args"]["priority"] for event in sends if event["args"]["key"] == "low"} == {-10}
    assert len(serves) == len(sends)  # servers traced every slice too


def test_auto_tuning_agrees_on_every_worker_and_keeps_sums_exact(tmp_path: Path) -> None:
    output = _run("auto", "dist_p3", 2, 2, tmp_path, {"TANDEM_KVSTORE_SLICE_THRESHOLD": "0"})
    chosen = {line.split("result ")[1] for line in worker_lines(output, " tuned ")}
    assert len(worker_lines(output, " tuned ")) == 2, output
    assert len(chosen) == 1, output  # both workers walked the same search path


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_auto_tuning_with_a_server_side_optimizer_moves_values_and_state(optimizer: str, tmp_path: Path) -> None:
    output = _run("auto-optimizer", "dist_p3", 2, 2, tmp_path,
                  {"TANDEM_KVSTORE_SLICE_THRESHOLD": "0", "TEST_OPTIMIZER": optimizer})  # fmt: skip
    assert len(worker_lines(output, " moved ")) == 2, output


@pytest.mark.parametrize(("kind", "compression", "slice_size", "optimizer"),
                         [("dist_sync", "2bit:0.05", "64", "sgd"), ("dist_p3", "fp16", "64", "sgd"),
                          ("dist_p3", "2bit:0.05", "0", "sgd"), ("dist_p3_async", "bf16", "64", "sgd"),
                          ("dist_sync", "2bit:0.05", "64", "none"), ("dist_p3", "fp16", "64", "none")])  # fmt: skip
def test_compressed_pushes_equal_a_local_replay_of_every_workers_quantizer(
    kind: str, compression: str, slice_size: str, optimizer: str, tmp_path: Path
) -> None:
    """With an optimizer on the servers pulls carry parameters, whole; without one (updates on the
    workers) they carry the round's sum, compressed back with the server's own error feedback."""
    env = {"TEST_COMPRESSION": compression, "TANDEM_KVSTORE_SLICE_THRESHOLD": slice_size,
           "TANDEM_KVSTORE_BIGARRAY_BOUND": "100", "TEST_OPTIMIZER": optimizer}  # fmt: skip
    output = _run("compressed", kind, 2, 2, tmp_path, env)
    assert len(worker_lines(output, "== local replay")) == 2, output


def test_malformed_compressed_pushes_give_clear_errors(tmp_path: Path) -> None:
    _run("compressed-errors", "dist_sync", 1, 1, tmp_path)


def test_take_and_put_misused_give_clear_errors(tmp_path: Path) -> None:
    _run("slot-errors", "dist_sync", 2, 1, tmp_path)


def test_auto_tuning_keeps_the_slicing_for_an_optimizer_needing_whole_tensors(tmp_path: Path) -> None:
    _run("auto-lamb", "dist_p3", 1, 1, tmp_path, {"TANDEM_KVSTORE_SLICE_THRESHOLD": "0"})


def _notices(output: str) -> list[int]:
    return [int(line.split("notices ")[1]) for line in worker_lines(output, " notices ")]


def test_workers_sending_in_opposite_orders_do_not_deadlock(tmp_path: Path) -> None:
    # water mark 1: if the cap counted pushpulls until answered, each worker's one slot would wait
    # for the other's push of that slice, which sits behind the other's own occupied slot
    output = _run("opposite", "dist_p3", 2, 2, tmp_path, {"TANDEM_PS_WATER_MARK": "1"})
    assert sum(_notices(output)) > 0, output  # the cap binds: parked requests are announced


def test_no_received_notices_where_the_water_mark_never_binds(tmp_path: Path) -> None:
    output = _run("opposite", "dist_p3", 2, 2, tmp_path, {"TANDEM_PS_WATER_MARK": "1000"})
    assert _notices(output) == [0, 0], output  # no request asked: one message per parked slice saved


def test_small_requests_pass_the_water_mark_without_notices(tmp_path: Path) -> None:
    # keys of 4 elements, slices of 64: each request is at most 1/16 of a slice, so none takes a
    # slot: a water mark of 1 holds nothing back and no request asks for a RECEIVED notice
    output = _run("opposite", "dist_p3", 2, 2, tmp_path, {"TANDEM_PS_WATER_MARK": "1", "TEST_NUMEL": "4"})
    assert _notices(output) == [0, 0], output


def test_launch_p3_turns_dist_sync_into_p3(tmp_path: Path) -> None:
    command = launch_command(str(Path(__file__).resolve()), 2, 1, "launched", "dist_sync", str(tmp_path))
    command.insert(command.index("--"), "--p3")
    result = subprocess.run(
        command, cwd=REPO, env=job_env(**SLICE), capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert len(worker_lines(result.stdout, "launched OK")) == 2, result.stdout


# ---- the job every process runs ---------------------------------------------------------------


def _sums(kv, rank: int) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    keys = list(SHAPES)
    kv.init(keys, [torch.zeros(shape) for shape in SHAPES.values()])
    saved: dict[str, torch.Tensor] = {}
    for step in range(2):
        values = [
            torch.arange(float(torch.Size(s).numel())).reshape(s) * (rank + 1) + step for s in SHAPES.values()
        ]
        outs = [torch.empty(shape) for shape in SHAPES.values()]
        handles = [kv.pushpull(key, value, out=out, priority=-index)
                   for index, (key, value, out) in enumerate(zip(keys, values, outs))]  # fmt: skip
        for handle in handles:
            handle.wait(timeout=60)
        total = kv.num_workers * (kv.num_workers + 1) / 2
        for key, out, shape in zip(keys, outs, SHAPES.values()):
            expected = (
                torch.arange(float(torch.Size(shape).numel())).reshape(shape) * total + step * kv.num_workers
            )
            assert torch.equal(out, expected), (key, out, expected)
            saved[f"pushpull/{step}/{key}"] = out
    kv.push(keys, [torch.full(shape, rank + 1.0) for shape in SHAPES.values()], priority=3).wait(timeout=60)
    pulled = [torch.empty(shape) for shape in SHAPES.values()]
    kv.pull(keys, pulled, priority=-3).wait(timeout=60)  # lower priority than its push: lane order holds
    saved.update({f"pull/{key}": out for key, out in zip(keys, pulled)})
    # every reply with a value (2 pushpulls and a pull per slice) was received straight into its tensor
    client = kv.sender._client if hasattr(kv, "sender") else kv._client
    slices = sum(len(kv.placement.plan(key, torch.Size(shape).numel())) for key, shape in SHAPES.items())
    assert client.landed == 3 * slices, (client.landed, slices)
    return saved


def _batched(kv, rank: int) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    """The same pushpulls alone and in one batched() block: equal sums, and the block's slices leave
    in one message per server (the cap never binds here: all leave at once, and none asks for a notice)."""
    keys = list(SHAPES)
    kv.init(keys, [torch.zeros(shape) for shape in SHAPES.values()])
    slices = sum(len(kv.placement.plan(key, torch.Size(shape).numel())) for key, shape in SHAPES.items())
    sent, results = [], []
    for batched in (False, True, False, True):
        values = [torch.arange(float(torch.Size(s).numel())).reshape(s) * (rank + 1) for s in SHAPES.values()]
        outs = [torch.empty(shape) for shape in SHAPES.values()]
        before = kv.sender._client.transport.sent
        with kv.batched() if batched else contextlib.nullcontext():
            handles = [kv.pushpull(key, value, out=out, priority=-index)
                       for index, (key, value, out) in enumerate(zip(keys, values, outs))]  # fmt: skip
            if batched:
                assert kv.sender._client.transport.sent == before, "a request left inside the block"
        sent.append(kv.sender._client.transport.sent - before)
        for handle in handles:
            handle.wait(timeout=60)
        results.append(outs)
    total = kv.num_workers * (kv.num_workers + 1) / 2
    for outs in results:
        for out, shape in zip(outs, SHAPES.values()):
            assert torch.equal(out, torch.arange(float(torch.Size(shape).numel())).reshape(shape) * total)
    assert sent[1] == sent[3] <= kv.num_servers < sent[0] == sent[2], (sent, slices)  # all fit in 256 KiB
    assert kv.sender.notices == 0, kv.sender.notices
    print(f"rank {rank} messages alone {sent[0]}, batched {sent[1]} ({slices} slices)")
    return {}


def _optimizer(kv, rank: int) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    from tandem.optim import SGD

    start = torch.linspace(-1, 1, 4_003)
    kv.init("w", start)
    kv.set_optimizer(SGD(lr=0.5))
    for _ in range(3):
        kv.push("w", torch.full((4_003,), rank + 1.0)).wait(timeout=60)
    kv.barrier()
    pulled = torch.empty(4_003)
    kv.pull("w", pulled).wait(timeout=60)
    total = kv.num_workers * (kv.num_workers + 1) / 2
    torch.testing.assert_close(pulled, start - 0.5 * 3 * total)
    return {"w": pulled}


def _priority(kv, rank: int) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    kv.init(["low", "high"], [torch.zeros(4_003), torch.zeros(10)])
    low = kv.push("low", torch.ones(4_003), priority=-10)
    high = kv.push("high", torch.ones(10), priority=0)
    high.wait(timeout=60)
    low.wait(timeout=60)
    return {}


def _auto(kv, rank: int) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    sizes = {"a": 50_000, "b": 30_000, "c": 10}
    kv.init(list(sizes), [torch.zeros(size) for size in sizes.values()])
    kv.tuner.min_trial_seconds = 0.0  # millisecond steps: points of 4 steps, so that it settles within the test
    for step in range(100):
        values = [torch.arange(float(size)) * (rank + 1) + step for size in sizes.values()]
        outs = [torch.empty(size) for size in sizes.values()]
        for handle in [kv.pushpull(key, value, out=out, priority=-index)
                       for index, (key, value, out) in enumerate(zip(sizes, values, outs))]:  # fmt: skip
            handle.wait(timeout=60)
        for out, size in zip(outs, sizes.values()):
            assert torch.equal(out, torch.arange(float(size)) * 3 + 2 * step), (step, out)
        if kv.tuner.result is not None:
            break
    assert kv.tuner.result is not None, kv.tuner.history
    print(f"rank {rank} tuned {kv.tuner.history} result {kv.tuner.result}")
    return {}


def _auto_optimizer(kv, rank: int) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    """Parameters on the servers while the tuner switches slicing: each step equals a local update."""
    import os

    from tandem.kvstore.ps import p3_reslice
    from tandem.optim import SGD, AdamW

    shapes = {"a": (100_003,), "b": (300, 401), "c": (50,)}  # 3, 4 and 1 slices of 40k; 2, 2, 1 of 80k...
    make = {"sgd": lambda: SGD(lr=0.1, momentum=0.9), "adamw": lambda: AdamW(lr=0.01)}[os.environ["TEST_OPTIMIZER"]]
    values = {key: torch.linspace(-1, 1, torch.Size(shape).numel()).reshape(shape) for key, shape in shapes.items()}
    kv.init(list(shapes), list(values.values()))
    kv.set_optimizer(make())
    kv.tuner.warmup, kv.tuner.steps_per_trial, kv.tuner.min_trial_seconds = 1, 2, 0.0  # switch often: every switch moves every key
    p3_reslice.BATCH_ELEMENTS = 60_000  # and in batches: worker 0's keys "a" and "c" move one after the other
    reference, states = make(), {key: make().create_state(value.reshape(-1)) for key, value in values.items()}
    expected = {key: value.reshape(-1).clone() for key, value in values.items()}
    checkpoint = Path(sys.argv[3]) / "checkpoint"
    for step in range(41):
        if step == 40 or (kv.tuner.result is not None and step >= 12):  # save and load, then one more step
            start = kv.tuner.start.slice_size
            if kv._live == start:  # the tuner kept 40k: leave it, so that the save and load below differ from it
                kv._move_slots(160_000)
            saved_at = kv._live
            kv.save_server_state(str(checkpoint))  # at the slicing in use: no slot moves
            saved_slots = [entry["key"] for path in checkpoint.glob("server-*.pt")
                           for entry in torch.load(path, weights_only=True)["slots"]]  # fmt: skip
            assert saved_slots and all(slot.startswith(f"p3/{saved_at}/") for slot in saved_slots), saved_slots
            kv._move_slots(start)  # the store now uses another slicing than the checkpoint's
            kv.load_server_state(str(checkpoint))  # the checkpoint's slicing (its note), moved to the one in use
            assert kv._live == start, (kv._live, saved_at)
        outs = {key: torch.empty(shape) for key, shape in shapes.items()}
        grads = [{key: torch.sin(torch.arange(float(torch.Size(shape).numel())) * (worker + 1) + step).reshape(shape)
                  for key, shape in shapes.items()} for worker in range(kv.num_workers)]  # fmt: skip
        for handle in [kv.pushpull(key, grads[rank][key], out=outs[key], priority=-index)
                       for index, key in enumerate(shapes)]:  # fmt: skip
            handle.wait(timeout=60)
        for key in shapes:
            merged = grads[0][key].reshape(-1).clone()  # the server's sum, in rank order
            for other in grads[1:]:
                merged.add_(other[key].reshape(-1))
            reference.update([expected[key]], [merged], [states[key]])
            torch.testing.assert_close(outs[key].reshape(-1), expected[key], rtol=1e-5, atol=1e-6)
        if checkpoint.exists():
            break
    sizes = [config.slice_size for config, _ in kv.tuner.history]
    assert len(set(sizes)) >= 2, kv.tuner.history  # the slicing did change
    print(f"rank {rank} moved through slicings {sizes}, result {kv.tuner.result}")
    return {}


def _compressed(kv, rank: int) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    """Compressed pushes with error feedback and server-side SGD: every step (sync) or the end (async)
    equals a local replay that quantizes each worker's gradient plus residual elementwise. Without an
    optimizer (sync) every pushpull returns the replay's sum quantized again with the server's residual."""
    import os

    from tandem.optim import SGD

    kv.set_gradient_compression(os.environ["TEST_COMPRESSION"])
    config = kv.gradient_compression
    sync, tuned = kv.kind in ("dist_sync", "dist_p3"), getattr(kv, "tuner", None) is not None
    shapes = {"odd": (7, 3, 5), 0: (), "w": (1000,), "big": (4_003,)}
    values = {key: torch.linspace(-1, 1, torch.Size(shape).numel()).reshape(shape) for key, shape in shapes.items()}
    kv.init(list(shapes), list(values.values()))
    make = (lambda: SGD(lr=0.1, momentum=0.9)) if sync else (lambda: SGD(lr=0.1))  # async: order-free
    on_servers = os.environ["TEST_OPTIMIZER"] != "none"
    if on_servers:
        kv.set_optimizer(make())
    if tuned:
        kv.tuner.warmup, kv.tuner.steps_per_trial, kv.tuner.min_trial_seconds = 1, 2, 0.0  # switch slicing often
    reference, states = make(), {key: make().create_state(value.reshape(-1)) for key, value in values.items()}
    expected = {key: value.reshape(-1).clone() for key, value in values.items()}
    residuals = [{key: torch.zeros(torch.Size(shape).numel()) for key, shape in shapes.items()}
                 for _ in range(kv.num_workers + 1)]  # fmt: skip  # the last: the servers' (elementwise too)

    def sent(worker: int, key: object, grad: torch.Tensor) -> torch.Tensor:
        total = grad.reshape(-1) + residuals[worker][key]  # type: ignore[index]
        if config.type == "2bit":  # the servers' quantum is the workers' times their number
            t = config.threshold if worker < kv.num_workers else type(config)("2bit", config.threshold * kv.num_workers).threshold
            quantized = torch.where(total >= t, t, torch.where(total <= -t, -t, 0.0))
        elif config.type == "fp16":
            quantized = total.clamp(-65504, 65504).half().float()
        else:
            quantized = total.bfloat16().float()
        residuals[worker][key] = total - quantized  # type: ignore[index]
        return quantized

    steps = 30 if tuned else 8
    outs = {key: torch.empty(shape) for key, shape in shapes.items()}
    for step in range(steps):
        grads = [{key: 0.1 * torch.sin(torch.arange(float(torch.Size(shape).numel())) * (worker + 1) + step).reshape(shape)
                  for key, shape in shapes.items()} for worker in range(kv.num_workers)]  # fmt: skip
        handles = [kv.pushpull(key, grads[rank][key], out=outs[key], priority=-index) if sync
                   else kv.push(key, grads[rank][key], priority=-index) for index, key in enumerate(shapes)]  # fmt: skip
        for handle in handles:
            handle.wait(timeout=60)
        for key in shapes:
            merged = sent(0, key, grads[0][key])  # the server's sum, in rank order
            for worker in range(1, kv.num_workers):
                merged.add_(sent(worker, key, grads[worker][key]))
            if not on_servers:  # the sum comes back compressed
                torch.testing.assert_close(outs[key].reshape(-1), sent(kv.num_workers, key, merged), rtol=0, atol=0)
                continue
            reference.update([expected[key]], [merged], [states[key]])
            if sync:
                torch.testing.assert_close(outs[key].reshape(-1), expected[key], rtol=1e-5, atol=1e-6)
    if not sync:
        kv.barrier()
        for key in shapes:
            kv.pull(key, outs[key]).wait(timeout=60)
            torch.testing.assert_close(outs[key].reshape(-1), expected[key], rtol=1e-5, atol=1e-5)
    for key in shapes:  # what this worker's pushes left out is what the replay left out (a tuned store's slot names)
        stored = kv._compressor.residual(f"p3/{kv._live}/{key!r}" if tuned else key)
        torch.testing.assert_close(stored, residuals[rank][key], rtol=0, atol=1e-6)
    if tuned:
        sizes = [config.slice_size for config, _ in kv.tuner.history]
        assert len(set(sizes)) >= 2, kv.tuner.history  # the slicing changed: residuals followed the keys
    print(f"rank {rank} compressed {config} == local replay")
    return {}


def _compressed_errors(kv, rank: int) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    """Malformed compressed pushes: each a clear error to the caller, and the server keeps serving (1 worker)."""
    import struct

    from tandem.kvstore.compression import DESCRIPTOR, KINDS
    from tandem.kvstore.errors import RemoteError
    from tandem.kvstore.ps.protocol import Command, Header, Role

    kv.init("w", torch.zeros(10))
    header = Header(Command.PUSH, 0, Role.WORKER, rank, key="w", dtype=torch.float32, shape=(10,), slice_stop=10,
                    compressed=True)  # fmt: skip
    two_bit = DESCRIPTOR.pack(KINDS["2bit"], 0.5)
    int8, int4 = DESCRIPTOR.pack(KINDS["int8"], 0.0), DESCRIPTOR.pack(KINDS["int4"], 0.0)
    cases = {
        "carry 2 bytes, not 3": [two_bit, b"\0\0"],
        "unknown gradient compression code 9": [DESCRIPTOR.pack(9, 0.5), b"\0\0\0"],
        "unused code 3": [two_bit, b"\xff\0\0"],
        "descriptor frame and a data frame": [b"\0\0\0"],
        "int8 values of 10 elements carry 10 bytes, not 14": [int8, b"\0" * 10],
        "int8 values with scale inf": [int8, struct.pack("<f", float("inf")) + b"\0" * 10],
        "int8 values with scale -1.0": [int8, struct.pack("<f", -1.0) + b"\0" * 10],
        "int8 values carry the code -128": [int8, struct.pack("<f", 1.0) + b"\x80" + b"\0" * 9],
        "int4 values of 10 elements carry 10 bytes, not 9": [int4, b"\0" * 10],
        "int4 values carry the code -8": [int4, struct.pack("<f", 1.0) + b"\x80" + b"\0" * 4],
    }
    for problem, frames in cases.items():
        try:
            kv._client.call(0, header, [memoryview(frame) for frame in frames], 30)
        except RemoteError as error:
            assert problem in str(error) and "push of key 'w'" in str(error), (problem, error)
        else:
            raise AssertionError(f"a compressed push with {frames} was accepted; expected {problem!r}")
    for kind, value in (("fp16", 0.5), ("int8", 127.0), ("int4", 7.0)):  # the server still serves: a well-formed push sums
        kv.set_gradient_compression(kind)
        out = torch.empty(10)
        kv.pushpull("w", torch.full((10,), value), out=out).wait(timeout=60)
        assert torch.equal(out, torch.full((10,), value)), (kind, out)  # no optimizer: the sum, exact (int8, int4: scale 1)
    return {}


def _slot_errors(kv, rank: int) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    """TAKE and PUT misused: each a clear error to the caller, and the server keeps serving (2 workers)."""
    from tandem.kvstore.errors import RemoteError
    from tandem.kvstore.ps.protocol import Command, Header, Role, state_payloads
    from tandem.optim import SGD

    kv.init(["w", "p"], [torch.arange(10.0), torch.zeros(10)])

    def request(command: Command, key: str, payloads: list, numel: int = 10) -> list:  # type: ignore[type-arg]
        header = Header(command, 0, Role.WORKER, rank, key=key, dtype=torch.float32, shape=(numel,), slice_stop=numel)
        return kv._client.call(0, header, payloads, 30).payloads

    def refused(match: str, *args: object) -> None:
        try:
            request(*args)  # type: ignore[arg-type]
        except RemoteError as error:
            assert match in str(error), (match, error)
        else:
            raise AssertionError(f"{args[:2]} was accepted; expected an error with {match!r}")

    if rank == 0:
        refused("already exists", Command.PUT, "w", state_payloads(torch.zeros(10), {}))
        refused("no optimizer is set", Command.PUT, "fresh", state_payloads(torch.zeros(10), {"m": torch.zeros(10)}))
        refused("not JSON", Command.PUT, "fresh", [memoryview(b"{"), *state_payloads(torch.zeros(10), {})[1:]])
        refused("never initialised", Command.TAKE, "never", [])
        refused("other slots of the key are (10,)", Command.PUT, "w", state_payloads(torch.zeros(4), {}), 4)
        taken = request(Command.TAKE, "w", [])  # the slot leaves the server with its value...
        assert torch.equal(torch.frombuffer(bytearray(taken[1]), dtype=torch.float32), torch.arange(10.0))
        refused("never initialised", Command.PULL, "w", [])
        request(Command.PUT, "w", state_payloads(torch.arange(10.0) * 2, {}))  # ...and comes back
    # a TAKE while another worker's push waits for its round is refused: the push would be lost
    if rank == 0:
        kv.push("p", torch.ones(10)).wait(timeout=30)
    kv.barrier()
    if rank == 1:
        refused("still pending", Command.TAKE, "p", [])
        kv.push("p", torch.ones(10)).wait(timeout=30)  # completes the round: nothing was lost
    summed = torch.empty(10)
    kv.pull("p", summed).wait(timeout=30)
    assert torch.equal(summed, torch.full((10,), 2.0)), summed
    kv.set_optimizer(SGD(lr=1.0, momentum=0.5))
    if rank == 0:
        refused("expected a scalar or (10,)", Command.PUT, "fresh", state_payloads(torch.zeros(10), {"m": torch.zeros(3)}))
    out = torch.empty(10)
    kv.pull("w", out).wait(timeout=30)
    assert torch.equal(out, torch.arange(10.0) * 2), out
    return {}


def _auto_lamb(kv, rank: int) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    from tandem.optim import LAMB

    kv.init("w", torch.ones(30_000))  # whole under 40k slices, cut under 20k, 10k or 5k
    assert not kv.tuner.slicing_fixed
    kv.set_optimizer(LAMB(lr=0.01))  # needs whole tensors: the slicing must stay
    assert kv.tuner.slicing_fixed, kv.tuner.slice_sizes
    return {}


def _opposite(kv, rank: int) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    import os

    numel = int(os.environ.get("TEST_NUMEL", "200"))
    keys = [f"k{index}" for index in range(12)]
    kv.init(keys, [torch.zeros(numel) for _ in keys])
    order = keys if rank == 0 else keys[::-1]  # worker 1 sends the other way round
    for _ in range(3):
        outs = [torch.empty(numel) for _ in keys]
        handles = [kv.pushpull(key, torch.ones(numel), out=out, priority=(-i if rank == 0 else i))
                   for i, (key, out) in enumerate(zip(order, outs))]  # fmt: skip
        for handle in handles:
            handle.wait(timeout=30)
        assert all(torch.equal(out, torch.full((numel,), 2.0)) for out in outs)
    print(f"rank {rank} notices {kv.sender.notices}")
    return {}


def _launched(kv, rank: int) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    from tandem.kvstore.ps.p3 import P3KVStore

    assert isinstance(kv, P3KVStore) and kv.kind == "dist_p3", type(kv)
    return _opposite(kv, rank)


def main(mode: str, kind: str, out: str) -> None:
    import tandem.kvstore as kvstore

    if kvstore.is_server():  # a server of the job: serve until it ends
        sys.exit(kvstore.serve(kind))
    kv = kvstore.create(kind)
    saved = {
        "sums": _sums,
        "batched": _batched,
        "optimizer": _optimizer,
        "priority": _priority,
        "auto": _auto,
        "auto-optimizer": _auto_optimizer,
        "slot-errors": _slot_errors,
        "compressed": _compressed,
        "compressed-errors": _compressed_errors,
        "auto-lamb": _auto_lamb,
        "opposite": _opposite,
        "launched": _launched,
    }[mode](kv, kv.rank)
    Path(out).mkdir(parents=True, exist_ok=True)
    torch.save(saved, Path(out) / f"rank{kv.rank}.pt")
    print(f"{mode} OK rank {kv.rank}")
    kv.close()


if __name__ == "__main__":
    main(*sys.argv[1:4])
