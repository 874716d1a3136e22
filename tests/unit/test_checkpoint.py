"""Atomic checkpoint files, fit's step directories, and fit resuming by itself from one of them."""

from __future__ import annotations

import os
import shutil
import stat
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import tandem
from tandem import checkpoint


def test_atomic_save_replaces_the_file_and_leaves_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "sub" / "ckpt.pt"
    checkpoint.atomic_save({"a": torch.ones(3)}, target)
    checkpoint.atomic_save({"a": torch.zeros(3)}, target)
    assert torch.equal(torch.load(target, weights_only=True)["a"], torch.zeros(3))
    assert sorted(p.name for p in target.parent.iterdir()) == ["ckpt.pt"]


def test_a_failed_write_keeps_the_previous_file(tmp_path: Path) -> None:
    target = tmp_path / "ckpt.pt"
    checkpoint.atomic_save({"a": 1}, target)
    with pytest.raises(Exception):  # noqa: B017 - whatever torch.save raises for an unpicklable object
        checkpoint.atomic_save({"a": lambda: 0}, target)
    assert torch.load(target, weights_only=True) == {"a": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt"]


def test_only_complete_directories_count_and_prune_keeps_the_newest_two(tmp_path: Path) -> None:
    for step in (10, 20, 30, 40):
        directory = checkpoint.step_directory(tmp_path, step)
        checkpoint.atomic_save({}, checkpoint.worker_file(directory, 0))
        if step != 40:  # 40: killed before its marker
            checkpoint.mark_complete(directory, {"step": step})
    assert checkpoint.complete_steps(tmp_path) == [10, 20, 30]
    found = checkpoint.latest(tmp_path)
    assert found is not None and found[0] == 30 and found[2] == {"step": 30}
    assert [p.name for p in checkpoint.prune(tmp_path)] == ["step-000010"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000020", "step-000030", "step-000040"]
    assert checkpoint.latest(tmp_path / "missing") is None


def _trainer() -> tandem.Trainer:
    torch.manual_seed(1)
    module = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 3))  # dropout: the RNG resumes too
    return tandem.Trainer(module, lambda m, x, y: F.cross_entropy(m(x), y), tandem.optim.SGD(lr=0.1, momentum=0.9),
                          batch_size=16, progress=False)  # fmt: skip


def test_fit_resumes_mid_epoch_on_the_same_trajectory(tmp_path: Path) -> None:
    """A fit that finds a checkpoint taken mid-epoch continues from it: same batches, same dropout masks, same
    parameters at the end as the run it was taken from (12 batches an epoch; checkpoints every 5 steps)."""
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(200, 8, generator=generator), torch.randint(0, 3, (200,), generator=generator))
    whole = _trainer()
    history = whole.fit(data, epochs=3, checkpoint_dir=str(tmp_path / "a"), checkpoint_every=5)
    assert checkpoint.complete_steps(tmp_path / "a") == [35, 36]  # 35: epoch 3, 11 batches in; 36: the end
    shutil.copytree(tmp_path / "a" / "step-000035", tmp_path / "b" / "step-000035")
    resumed = _trainer()
    tail = resumed.fit(data, epochs=3, checkpoint_dir=str(tmp_path / "b"), checkpoint_every=5)
    assert (resumed.step_count, resumed.epoch) == (36, 3)
    assert len(tail) == 1 and tail[0]["train_loss"] == history[-1]["train_loss"]
    for (name, expected), actual in zip(whole.module.named_parameters(), resumed.module.parameters()):
        assert torch.equal(expected, actual), name
    finished = _trainer()  # a job restarted after its last checkpoint: it resumes at the end, nothing left to do
    assert finished.fit(data, epochs=3, checkpoint_dir=str(tmp_path / "b")) == [] and finished.step_count == 36


def test_checkpoint_every_needs_a_directory() -> None:
    with pytest.raises(ValueError, match="checkpoint_every"):
        _trainer().fit([], checkpoint_every=5)


def test_tandem_train_resumes_from_its_checkpoint_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`tandem train --checkpoint-dir`: a run that finds a mid-epoch checkpoint finishes the epoch with the
    record the uninterrupted run printed; one that finds the final checkpoint has nothing left to train."""
    from tandem.cli import main

    def train(directory: Path) -> str:
        main(["train", "--model", "mlp", "--data", "digits", "--epochs", "2", "--batch-size", "64",
              "--max-train-samples", "256", "--max-eval-samples", "64", "--no-progress", "--threads", "1",
              "--checkpoint-dir", str(directory), "--checkpoint-every", "3", "--out", str(tmp_path / "out")])  # fmt: skip
        return capsys.readouterr().out

    whole = train(tmp_path / "a")  # 4 steps an epoch: checkpoints at 3, 4 (the first fit's end), 6, 8; 6 and 8 kept
    assert checkpoint.complete_steps(tmp_path / "a") == [6, 8]
    shutil.copytree(tmp_path / "a" / "step-000006", tmp_path / "b" / "step-000006")
    resumed = train(tmp_path / "b")
    last_epoch = next(line for line in whole.splitlines() if line.startswith("epoch 2:"))
    assert last_epoch.split(", ")[:3] == next(line for line in resumed.splitlines() if line.startswith("epoch 2:")).split(", ")[:3]
    assert "epoch 1:" not in resumed, resumed
    assert "nothing left to train" in train(tmp_path / "a")


def test_checkpoint_files_respect_the_umask_and_new_directories_are_synced(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    synced: list[Path] = []
    fsync_directory = checkpoint._fsync_directory
    monkeypatch.setattr(checkpoint, "_fsync_directory", lambda directory: (synced.append(directory), fsync_directory(directory)))
    previous = os.umask(0o027)
    try:
        target = checkpoint.worker_file(checkpoint.step_directory(tmp_path / "ckpt", 10), 0)
        checkpoint.atomic_save({"a": 1}, target)
    finally:
        os.umask(previous)
    assert stat.S_IMODE(target.stat().st_mode) == 0o640  # as open() makes it, not mkstemp's 0600
    # the entries of ckpt and step-000010 in their parents, then the file's rename
    assert synced == [tmp_path, tmp_path / "ckpt", target.parent]
    synced.clear()
    checkpoint.atomic_save({"a": 2}, target)  # no new directory: only the rename
    assert synced == [target.parent]


def test_worker_0_refuses_to_mark_a_checkpoint_without_every_workers_file(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """Without a shared filesystem worker 0 sees only its own file: no COMPLETE beside it, an error saying why."""
    monkeypatch.setattr(tandem.Trainer, "num_workers", property(lambda self: 2))
    data = TensorDataset(torch.randn(64, 8), torch.randint(0, 3, (64,)))
    with pytest.raises(checkpoint.CheckpointError, match=r"does not see \S+worker-1\.pt .*shared by all 2 workers"):
        _trainer().fit(data, epochs=1, checkpoint_dir=str(tmp_path), checkpoint_every=2)
    assert checkpoint.complete_steps(tmp_path) == [] and (tmp_path / "step-000002" / "worker-0.pt").exists()


def _worker_files(root: Path, steps: dict[int, int], workers: int = 2) -> None:
    """Complete checkpoints at ``steps`` (step -> a number) whose worker files hold that number."""
    for step, number in steps.items():
        directory = checkpoint.step_directory(root, step)
        for rank in range(workers):
            checkpoint.atomic_save({"number": number}, checkpoint.worker_file(directory, rank))
        checkpoint.mark_complete(directory, {"step": step, "workers": workers})


def _as_workers(roots: list[Path], after: int = 0) -> list[Any]:
    """``resume_point`` on one thread per worker (worker r reads ``roots[r]``), gathering through a
    barrier: each worker's result, or the exception it raised."""
    workers = len(roots)
    slots: list[str] = [""] * workers
    barrier = threading.Barrier(workers, timeout=10)

    def gather(rank: int, text: str) -> list[str]:
        barrier.wait()
        slots[rank] = text
        barrier.wait()
        gathered = list(slots)
        barrier.wait()
        return gathered

    def read(rank: int, directory: Path) -> int:
        try:
            return int(torch.load(checkpoint.worker_file(directory, rank), weights_only=True)["number"])
        except RuntimeError as error:  # torch's for a truncated file; read_checkpoint makes it a ValueError
            raise ValueError(str(error)) from None

    results: list[Any] = [None] * workers

    def run(rank: int) -> None:
        try:
            results[rank] = checkpoint.resume_point(roots[rank], after, lambda d: read(rank, d),
                                                    lambda text: gather(rank, text), rank, workers)  # fmt: skip
        except Exception as error:  # noqa: BLE001 - handed to the test
            results[rank] = error

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(workers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    return results


def test_workers_that_see_different_newest_checkpoints_all_fail_naming_each_ones_step(tmp_path: Path) -> None:
    _worker_files(tmp_path / "a", {10: 10, 20: 20})  # worker 0's machine: the checkpoints
    (tmp_path / "b").mkdir()  # worker 1's: none (no shared filesystem)
    for result in _as_workers([tmp_path / "a", tmp_path / "b"]):
        assert isinstance(result, checkpoint.CheckpointError), result
        assert "(worker 0: step 20, worker 1: none)" in str(result) and "shared by all workers" in str(result)


def test_a_damaged_file_makes_every_worker_fall_back_to_the_previous_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _worker_files(tmp_path, {10: 10, 20: 20, 30: 30})
    damaged = checkpoint.worker_file(checkpoint.step_directory(tmp_path, 30), 1)
    damaged.write_bytes(damaged.read_bytes()[:40])  # truncated: worker 1 cannot read step 30
    results = _as_workers([tmp_path, tmp_path])
    assert [(found.step, found.loaded) for found in results] == [(20, 20), (20, 20)]  # worker 0 too, though it read 30
    warnings = capsys.readouterr().err
    assert f"worker 1 cannot read checkpoint {damaged.parent}" in warnings and "trying the previous one, step-000020" in warnings
    assert "worker 0 resumes from step 20, not 30: worker(s) [1] cannot read a newer checkpoint" in warnings


def test_no_readable_checkpoint_fails_on_every_worker(tmp_path: Path) -> None:
    _worker_files(tmp_path, {10: 10})
    checkpoint.worker_file(checkpoint.step_directory(tmp_path, 10), 0).unlink()
    results = _as_workers([tmp_path, tmp_path])
    assert all(isinstance(result, checkpoint.CheckpointError) for result in results), results
    assert "worker(s) [0] can read none" in str(results[0]) and "worker-0.pt" in str(results[0])
    assert "see their warnings" in str(results[1])


def test_fit_falls_back_to_the_previous_checkpoint_when_the_newest_is_damaged(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A truncated worker file in the newest checkpoint: fit warns naming it, resumes from the previous
    one, and still ends on the uninterrupted trajectory."""
    data = TensorDataset(torch.randn(64, 8), torch.randint(0, 3, (64,)))  # 4 batches an epoch
    whole = _trainer()
    whole.fit(data, epochs=2, checkpoint_dir=str(tmp_path / "a"), checkpoint_every=3)
    assert checkpoint.complete_steps(tmp_path / "a") == [6, 8]
    damaged = checkpoint.worker_file(checkpoint.step_directory(tmp_path / "a", 8), 0)
    damaged.write_bytes(damaged.read_bytes()[:100])
    capsys.readouterr()
    resumed = _trainer()
    resumed.fit(data, epochs=2, checkpoint_dir=str(tmp_path / "a"), checkpoint_every=3)
    err = capsys.readouterr().err
    assert f"cannot read checkpoint {damaged.parent} ({damaged} is not a tandem checkpoint" in err, err
    assert "resumes from" in err and "step-000006 (step 6," in err, err
    assert resumed.step_count == 8
    for (name, expected), actual in zip(whole.module.named_parameters(), resumed.module.parameters()):
        assert torch.equal(expected, actual), name


def test_fit_says_when_the_checkpoint_already_finished_every_epoch(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    data = TensorDataset(torch.randn(64, 8), torch.randint(0, 3, (64,)))
    _trainer().fit(data, epochs=2, checkpoint_dir=str(tmp_path))
    capsys.readouterr()
    again = _trainer()
    assert again.fit(data, epochs=3, checkpoint_dir=str(tmp_path)) == [] and again.step_count == 8
    assert "tandem: checkpoint at step 8 already finished 2 epochs; nothing to train" in capsys.readouterr().err
