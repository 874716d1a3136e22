"""Atomic checkpoint files, fit's step directories, and fit resuming by itself from one of them."""

from __future__ import annotations

import shutil
from pathlib import Path

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
