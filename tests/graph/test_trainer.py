"""Trainer: optimizers against torch.optim, digits accuracy, exact checkpoint resume."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

import tandem
from tandem import data, models, optim
from tests.conftest import zoo_case


def _torch_reference_run(module: torch.nn.Module, loss_fn, batch, torch_optimizer, steps: int) -> None:
    for _ in range(steps):
        torch_optimizer.zero_grad()
        loss_fn(module, *batch).backward()
        torch_optimizer.step()


@pytest.mark.parametrize(
    "make_ours, make_torch",
    [
        (lambda: optim.SGD(lr=0.1, momentum=0.9, weight_decay=1e-3, nesterov=True),
         lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=1e-3, nesterov=True)),
        (lambda: optim.AdamW(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1),
         lambda p: torch.optim.AdamW(p, lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)),
    ],
)
def test_trainer_matches_torch_optim(make_ours, make_torch) -> None:
    module, loss_fn, batch = zoo_case("resnet")
    reference = copy.deepcopy(module)
    trainer = tandem.Trainer(module, loss_fn, make_ours())
    for _ in range(4):
        trainer.step(*batch)
    _torch_reference_run(reference, loss_fn, batch, make_torch(reference.parameters()), 4)
    for (name, ours), (_, theirs) in zip(module.state_dict().items(), reference.state_dict().items()):
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-9, msg=name)


def test_trainer_accepts_a_torch_optimizer() -> None:
    module, loss_fn, batch = zoo_case("mlp")
    reference = copy.deepcopy(module)
    trainer = tandem.Trainer(module, loss_fn, torch.optim.SGD(module.parameters(), lr=0.1))
    trainer.step(*batch)
    _torch_reference_run(reference, loss_fn, batch, torch.optim.SGD(reference.parameters(), lr=0.1), 1)
    for ours, theirs in zip(module.parameters(), reference.parameters()):
        torch.testing.assert_close(ours, theirs)


def test_clip_grad_norm_matches_torch() -> None:
    module, loss_fn, batch = zoo_case("mlp")
    reference = copy.deepcopy(module)
    tandem.Trainer(module, loss_fn, optim.SGD(lr=1.0), clip_grad_norm=0.01).step(*batch)
    loss_fn(reference, *batch).backward()
    torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.01)
    torch.optim.SGD(reference.parameters(), lr=1.0).step()
    for ours, theirs in zip(module.parameters(), reference.parameters()):
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize(
    "name, config, optimizer, epochs",
    [
        ("mlp", dict(in_features=64, hidden=(128, 128)), lambda: optim.SGD(lr=0.1, momentum=0.9), 8),
        ("resnet", dict(depth=8, width=16, in_channels=1, small_input=True),
         lambda: optim.SGD(lr=0.05, momentum=0.9, weight_decay=5e-4), 5),
    ],
)
def test_digits_reaches_95_percent(name: str, config: dict, optimizer, epochs: int) -> None:
    torch.manual_seed(0)
    trainer = tandem.Trainer(models.build(name, **config), models.classification_loss, optimizer(),
                             batch_size=64, progress=False)
    history = trainer.fit(data.digits("train"), epochs=epochs, eval_data=data.digits("test"))
    assert history[-1]["eval_accuracy"] >= 0.95, history


def test_checkpoint_resume_is_exact(tmp_path: Path) -> None:
    """3 steps + save + load (fresh objects) + 3 steps == 6 steps, bit for bit (dropout included)."""

    def fresh() -> tuple[tandem.Trainer, tuple[torch.Tensor, ...]]:
        module, loss_fn, batch = zoo_case("gpt", torch.float32)
        return tandem.Trainer(module, loss_fn, optim.AdamW(lr=1e-2, weight_decay=0.1)), batch

    straight, batch = fresh()
    torch.manual_seed(123)
    for _ in range(6):
        straight.step(*batch)

    first, _ = fresh()
    torch.manual_seed(123)
    for _ in range(3):
        first.step(*batch)
    first.save(str(tmp_path / "ckpt.pt"))
    assert set(torch.load(tmp_path / "ckpt.pt", weights_only=True)) >= {"model", "optimizer", "step"}
    torch.manual_seed(999)  # whatever happens in between, the checkpoint restores the RNG
    resumed, _ = fresh()
    resumed.load(str(tmp_path / "ckpt.pt"))
    for _ in range(3):
        resumed.step(*batch)
    assert resumed.step_count == 6
    for (name, a), (_, b) in zip(straight.module.state_dict().items(), resumed.module.state_dict().items()):
        assert torch.equal(a, b), name


def test_unknown_trainer_option_is_named() -> None:
    module, loss_fn, _ = zoo_case("mlp")
    with pytest.raises(TypeError, match=r"unknown Trainer option\(s\) \['lr'\]"):
        tandem.Trainer(module, loss_fn, optim.SGD(lr=0.1), lr=0.1)
