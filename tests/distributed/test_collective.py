"""kvstore="collective": workers all-reduce among themselves, by priority, no servers (real processes, gloo)."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tandem.kvstore.collective.group import Group
from tandem.kvstore.collective.store import CollectiveKVStore
from tandem.kvstore.config import DistOptions, P3Options
from tests.distributed.collective_models import model_and_batch, train_eagerly
from tests.distributed.jobs import (
    FAST_FAULTS,
    REPO,
    SCRIPTS,
    job_env,
    kill_mid_training,
    launch_command,
    process_log,
    run_job,
    start_by_hand,
    worker_lines,
)

DEADLINE = 30.0


def _results(out: Path, workers: int) -> list[dict[str, dict[str, torch.Tensor]]]:
    return [torch.load(out / f"rank{rank}.pt", weights_only=True) for rank in range(workers)]


def _assert_same(result: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], what: str) -> None:
    for name, value in expected.items():
        torch.testing.assert_close(result[name], value, rtol=1e-9, atol=1e-11, msg=f"{what}: {name}")


@pytest.mark.parametrize(("model", "slice_size", "bucket", "ordered"), [
    pytest.param("resnet", "100", "-1", "1", id="resnet-100"),  # the store's bucket: one slice
    pytest.param("resnet", "100", "-1", "0", id="resnet-100-rounds"),  # agreed in rounds: P3's overtaking
    pytest.param("hf-gpt2", "999", "-1", "1", id="hf-gpt2-999"),
    pytest.param("hf-gpt2", "999", "0", "1", id="hf-gpt2-999-each-segment"),
    pytest.param("hf-gpt2", "999", "3000", "0", id="hf-gpt2-999-bucket-3000-rounds"),
])  # fmt: skip
def test_two_workers_equal_ddp_and_one_process(model: str, slice_size: str, bucket: str, ordered: str,
                                               tmp_path: Path) -> None:  # fmt: skip
    """Sync p3 over all-reduce: the parameters after 10 steps are DDP's (same processes, same rows)
    and, where no batch norm makes half batches differ, one process's on the whole batch; many
    slices, most not a multiple of the size, so every tensor is cut and reassembled. Whether each
    backward segment's gradients leave as it ends or several segments' together (a send bucket,
    the last ones when backward ends), issued in order or agreed in rounds, the sums are the same."""
    steps = 10
    job = run_job("collective.py", 2, 0, str(tmp_path), model, str(steps), "8", "p3",
                  env={"TANDEM_KVSTORE_SLICE_THRESHOLD": slice_size, "TANDEM_SEND_BUCKET_ELEMENTS": bucket,
                       "TANDEM_COLLECTIVE_ORDERED": ordered})  # fmt: skip
    lines = worker_lines(job.stdout, "collective OK")
    assert len(lines) == 2, job.stdout
    rounds = [int(line.split(" rounds ")[1].split()[0]) for line in lines]
    assert all(count == 0 for count in rounds) if ordered == "1" else all(count > 0 for count in rounds), rounds
    module, loss_fn, batch = model_and_batch(model, 8)
    start = {name: value.detach().clone() for name, value in module.named_parameters()}
    whole = train_eagerly(module, loss_fn, batch, steps)
    for rank, result in enumerate(_results(tmp_path, 2)):
        assert any(not torch.equal(result["collective"][n], start[n]) for n in start), "training changed nothing"
        _assert_same(result["collective"], result["ddp"], f"rank {rank} vs DDP")
        if model != "resnet":  # batch norm: statistics of half a batch are not the whole batch's
            _assert_same(result["collective"], whole, f"rank {rank} vs one process")


@pytest.mark.parametrize(("workers", "model"), [(3, "lstm_lm"), (4, "mlp")])
def test_more_workers_equal_one_process(workers: int, model: str, tmp_path: Path) -> None:
    """3 workers under torchrun (every rank a worker), 4 under tandem launch (with gradients held until
    backward ends: the tuner's 'after' timing); the same parameters as DDP and one process."""
    steps, batch = 10, 4 * workers
    args = [str(tmp_path), model, str(steps), str(batch), "p3" if workers == 3 else "p3-after"]
    if workers == 3:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
                   str(SCRIPTS / "collective.py"), *args]  # fmt: skip
        job = subprocess.run(command, cwd=REPO, env=job_env(TANDEM_KVSTORE_SLICE_THRESHOLD="7", OMP_NUM_THREADS="1"),
                             capture_output=True, text=True, timeout=120)  # fmt: skip
        assert job.returncode == 0, f"job failed ({job.returncode}):\n{job.stdout}\n{job.stderr}"
    else:
        run_job("collective.py", workers, 0, *args, env={"TANDEM_KVSTORE_SLICE_THRESHOLD": "7"})
    module, loss_fn, data = model_and_batch(model, batch)
    whole = train_eagerly(module, loss_fn, data, steps)
    for rank, result in enumerate(_results(tmp_path, workers)):
        _assert_same(result["collective"], result["ddp"], f"rank {rank} vs DDP")
        _assert_same(result["collective"], whole, f"rank {rank} vs one process")


def test_compression_trains(tmp_path: Path) -> None:
    """fp16, bf16, int8, int4 and 2-bit with error feedback (one after the other in one job, the mlp on
    a fixed batch): the loss falls to under half, and every worker holds the same parameters."""
    kinds = ("fp16", "bf16", "int8", "int4", "2bit:0.02")
    run_job("collective.py", 2, 0, str(tmp_path), "mlp", "30", "16", "p3", ",".join(kinds),
            env={"TANDEM_KVSTORE_SLICE_THRESHOLD": "50"})  # fmt: skip
    results = _results(tmp_path, 2)
    for kind in kinds:
        losses = results[0][f"losses {kind}"]
        assert losses[-1] < 0.5 * losses[0], (kind, losses)
        _assert_same(results[1][kind], results[0][kind], f"{kind}: rank 1 vs rank 0")


def test_a_dead_peer_ends_the_job_naming_it(tmp_path: Path) -> None:
    """No launcher to stop the job: the survivors learn from the heartbeats which worker died, and exit."""
    store, processes = start_by_hand(tmp_path, 2, 0, "collective_forever.py")
    codes, elapsed = kill_mid_training(tmp_path, processes, "worker 1", DEADLINE)
    del store
    logs = {name: process_log(tmp_path, name) for name in processes}
    assert elapsed < DEADLINE, (elapsed, logs)
    assert all(code != 0 for code in codes.values()), (codes, logs)
    # a silent peer: named by its rank, pid and host
    assert f"worker 1 (pid {processes['worker 1'].pid} on" in logs["worker 0"], logs["worker 0"]


def test_mismatched_shapes_fail_at_init_naming_both() -> None:
    command = launch_command("collective_forever.py", 2, 0, "mismatch", env=FAST_FAULTS)
    job = subprocess.run(command, cwd=REPO, env=job_env(), capture_output=True, text=True, timeout=120)
    assert job.returncode != 0, job.stdout
    assert "key 'w' is (4, 8) torch.float32 on worker 0 but (4, 9) torch.float32 on worker 1" in job.stdout, job.stdout
    assert "step" not in job.stdout, job.stdout



def _two_threads(function: Callable[[CollectiveKVStore], Any], name: str) -> list[Any]:
    """``function(store)`` on two workers, one thread each (fast heartbeats); the results (or the
    errors, as text) with each worker's seconds, by rank."""
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    options = DistOptions.from_env("dist_sync", exit_on_failure=False, heartbeat=0.2, timeout=1.0)

    def run(rank: int) -> Any:
        kv = CollectiveKVStore(Group(rank, 2, "127.0.0.1", master.port, 2), options, P3Options(7, 2), name=name)
        start = time.monotonic()
        try:
            return function(kv), time.monotonic() - start
        except Exception as error:  # noqa: BLE001 - the test reads it
            return f"{type(error).__name__}: {error}", time.monotonic() - start
        finally:
            kv.close()

    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(run, range(2)))


def test_a_long_wait_at_init_does_not_stop_the_heartbeats() -> None:
    """Worker 1 reaches init 3 s late (a slower compile): worker 0 waits in init three times the
    heartbeat timeout, yet its heartbeats go on, no one is called dead, and the job trains."""

    def work(kv: CollectiveKVStore) -> str:
        if kv.rank == 1:
            time.sleep(3)
        kv.init("w", torch.zeros(3))
        kv.barrier()
        summed = torch.empty(3)
        kv.pushpull("w", torch.ones(3), out=summed).wait(timeout=10)
        assert summed.tolist() == [2.0, 2.0, 2.0]
        return "ok"

    assert [result for result, _ in _two_threads(work, "late-init")] == ["ok", "ok"]


def test_a_waiter_ends_with_the_job() -> None:
    """Worker 0 waits at init; worker 1 fails without reaching it: worker 0 raises within a few
    heartbeats, not at the wait's timeout (TANDEM_PS_WAIT_TIMEOUT)."""

    def work(kv: CollectiveKVStore) -> str:
        if kv.rank == 1:
            time.sleep(1)
            kv._close(abort_reason="worker 1 died of RuntimeError: boom")
            return "aborted"
        kv.init("w", torch.zeros(3))
        return "init returned"

    (result, seconds), (other, _) = _two_threads(work, "abort-at-init")
    assert other == "aborted"
    assert result.startswith("PeerFailure") and "boom" in result, result
    assert seconds < 5, seconds
