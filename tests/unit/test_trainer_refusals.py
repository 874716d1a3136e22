"""Trainer inputs that cannot train or resume are refused up front, naming what is wrong: fit with
no batch at all, a checkpoint that does not fit the trainer, a file that is not a checkpoint."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import tandem
from tandem import optim
from tandem.trainer import read_checkpoint


def _model(hidden: int = 3, extra: bool = False) -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.Linear(4, hidden), nn.ReLU(), nn.Linear(hidden, 2)] + ([nn.Linear(2, 2)] if extra else [])
    return nn.Sequential(*layers)


def _loss(module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(module(x), y)


def _data(samples: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(samples, 4, generator=generator), torch.randint(0, 2, (samples,), generator=generator))


def _trainer(module: nn.Module, optimizer: Any, **options: Any) -> tandem.Trainer:
    return tandem.Trainer(module, _loss, optimizer, progress=False, **options)


@pytest.mark.parametrize(("data", "message"), [
    (_data(10), "the data set has 10 samples, and batch_size is 16 with drop_last=True"),
    (_data(0), "the data set has 0 samples, and batch_size is 16"),
    (DataLoader(_data(10), batch_size=16, drop_last=True), "DataLoader given has none, batch_size 16 of a data set of 10"),
    ([], "the list given has none"),
])  # fmt: skip
def test_fit_with_no_batch_is_an_error_naming_batch_and_data_size(data: Any, message: str) -> None:
    trainer = _trainer(_model(), optim.SGD(lr=0.1), batch_size=16)
    with pytest.raises(ValueError, match=message):
        trainer.fit(data)
    assert trainer.step_count == 0 and trainer.epoch == 0  # refused before any step


def test_fit_keeps_a_batch_smaller_than_batch_size_without_drop_last() -> None:
    trainer = _trainer(_model(), optim.SGD(lr=0.1), batch_size=16, drop_last=False)
    assert trainer.fit(_data(10))[0]["train_loss"] > 0 and trainer.step_count == 1


def _saved(tmp_path: Path, module: nn.Module, optimizer: Any) -> Path:
    trainer = _trainer(module, optimizer)
    x, y = _data(8).tensors
    trainer.step(x, y)
    path = tmp_path / "ckpt.pt"
    trainer.save(str(path))
    return path


def _refused_unchanged(trainer: tandem.Trainer, path: Path, *messages: str) -> None:
    """``trainer.load(path)`` raises naming each of ``messages``, and leaves the trainer as it was."""
    before = {name: value.clone() for name, value in trainer.module.state_dict().items()}
    settings = trainer.optimizer.to_config() if hasattr(trainer.optimizer, "to_config") else None
    with pytest.raises(ValueError) as error:
        trainer.load(str(path))
    for message in messages:
        assert message in str(error.value), str(error.value)
    assert all(torch.equal(before[name], value) for name, value in trainer.module.state_dict().items())
    assert trainer.step_count == 0 and (settings is None or trainer.optimizer.to_config() == settings)


def test_a_checkpoint_of_another_optimizer_type_fails_at_load(tmp_path: Path) -> None:
    sgd = _saved(tmp_path, _model(), optim.SGD(lr=0.1, momentum=0.9))
    _refused_unchanged(_trainer(_model(), optim.AdamW(lr=0.1)), sgd, "its optimizer is 'sgd', this Trainer's 'adamw'")
    module = _model()
    _refused_unchanged(_trainer(module, torch.optim.SGD(module.parameters(), lr=0.1)), sgd,
                       "its optimizer is tandem.optim's 'sgd', this Trainer's torch.optim.SGD")  # fmt: skip


def test_a_torch_optimizer_checkpoint_of_another_type_fails_at_load(tmp_path: Path) -> None:
    module = _model()
    sgd = _saved(tmp_path, module, torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9))
    other = _model()
    _refused_unchanged(_trainer(other, torch.optim.AdamW(other.parameters(), lr=0.1)), sgd,
                       "its torch optimizer has the settings ['dampening', 'momentum', 'nesterov']",
                       "of this Trainer's torch.optim.AdamW: another optimizer type")  # fmt: skip
    _refused_unchanged(_trainer(_model(), optim.SGD(lr=0.1)), sgd, "its optimizer is a torch.optim optimizer")


def test_a_checkpoint_of_another_model_names_the_first_differences(tmp_path: Path) -> None:
    path = _saved(tmp_path, _model(), optim.SGD(lr=0.1, momentum=0.9))
    _refused_unchanged(_trainer(_model(hidden=5, extra=True), optim.SGD(lr=0.1, momentum=0.9)), path,
                       "the model's '3.weight', '3.bias' are not in the checkpoint",
                       "model shapes differ: '0.weight' is (3, 4) there, (5, 4) here, '0.bias' is (3,) there, (5,) here",
                       "the optimizer state of '0.weight' has momentum_buffer (3, 4) for a (5, 4) parameter")  # fmt: skip
    _refused_unchanged(_trainer(nn.Sequential(nn.Linear(4, 2)), optim.SGD(lr=0.1, momentum=0.9)), path,
                       "the checkpoint's model has '2.weight', '2.bias', which this model has not")  # fmt: skip


def test_a_checkpoint_whose_optimizer_state_lacks_what_the_optimizer_needs_fails_at_load(tmp_path: Path) -> None:
    trainer = _trainer(_model(), optim.AdamW(lr=0.1))
    trainer.step(*_data(8).tensors)
    state = trainer.state_dict()
    del state["optimizer"]["state"]["0.weight"]["exp_avg_sq"]
    path = tmp_path / "broken.pt"
    torch.save(state, path)
    _refused_unchanged(_trainer(_model(), optim.AdamW(lr=0.1)), path,
                       "the optimizer state of '0.weight' lacks ['exp_avg_sq']")  # fmt: skip


def test_a_fitting_checkpoint_still_loads(tmp_path: Path) -> None:
    path = _saved(tmp_path, _model(), optim.AdamW(lr=0.1))
    trainer = _trainer(_model(), optim.AdamW(lr=0.1))
    trainer.load(str(path))
    assert trainer.step_count == 1


def test_a_file_that_is_not_a_checkpoint_says_so_naming_it(tmp_path: Path) -> None:
    noise, model_only, empty = tmp_path / "noise.bin", tmp_path / "model.pt", tmp_path / "empty.pt"
    noise.write_bytes(os.urandom(4096))
    torch.save(_model().state_dict(), model_only)
    empty.write_bytes(b"")
    for path in (noise, empty):
        with pytest.raises(ValueError, match=rf"{path} is not a tandem checkpoint: torch.load cannot read it") as error:
            read_checkpoint(str(path))
        assert "weights_only" not in str(error.value)
    with pytest.raises(ValueError, match=rf"{model_only} is not a tandem checkpoint: it holds a dict of 4 entries "
                                         r"\('0.weight', '0.bias', '2.weight' and 1 more; a model's state_dict"):  # fmt: skip
        _trainer(_model(), optim.SGD(lr=0.1)).load(str(model_only))
    with pytest.raises(FileNotFoundError):
        read_checkpoint(str(tmp_path / "missing.pt"))
