"""Trainer: optimizers against torch.optim, digits accuracy, exact checkpoint resume, data sources."""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, TensorDataset

import tandem
from tandem import data, models, optim
from tandem.graph.batch import as_arguments
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


def test_step_trains_every_submodule_even_one_added_later_in_eval_mode() -> None:
    module = torch.nn.Sequential(torch.nn.Linear(4, 4))
    trainer = tandem.Trainer(module, lambda m, x, y: F.cross_entropy(m(x), y), optim.SGD(lr=0.1), progress=False)
    module.append(torch.nn.Dropout(0.5).eval())
    trainer.step(torch.randn(8, 4), torch.randint(0, 4, (8,)))
    assert all(submodule.training for submodule in module.modules())
    module.eval()
    trainer.step(torch.randn(8, 4), torch.randint(0, 4, (8,)))
    assert all(submodule.training for submodule in module.modules())


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


# -- data sources: any map-style Dataset, a DataLoader, dict batches ----------------------------------
class _Samples(Dataset):
    """A plain map-style data set (not a TensorDataset): sample ``i`` as ``(x, y)``, or as a dict."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, keys: tuple[str, str] | None = None) -> None:
        self.x, self.y, self.keys = x, y, keys

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> Any:
        if self.keys is None:
            return self.x[index], self.y[index]
        return {self.keys[0]: self.x[index], self.keys[1]: self.y[index]}


def _classifier_case(samples: int = 28) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).double()
    rng = torch.Generator().manual_seed(1)
    x = torch.randn(samples, 6, generator=rng, dtype=torch.float64)
    return module, x, torch.randint(0, 3, (samples,), generator=rng)


def _xy_loss(module: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(module(x), y)


def _dict_loss(module: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(module(batch["x"]), batch["y"])


def _eager_fit(module: torch.nn.Module, loss_fn: Callable[..., torch.Tensor], epochs: Iterable[Iterable[Any]]) -> int:
    """torch.optim.SGD over the same batches, each item spread like the Trainer does. Returns the steps."""
    optimizer, steps = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9), 0
    for batches in epochs:
        for item in batches:
            optimizer.zero_grad()
            loss_fn(module, *as_arguments(item)).backward()
            optimizer.step()
            steps += 1
    return steps


def _assert_same_parameters(ours: torch.nn.Module, theirs: torch.nn.Module) -> None:
    for (name, a), (_, b) in zip(ours.named_parameters(), theirs.named_parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9, msg=lambda m, n=name: f"{n}: {m}")


def test_fit_batches_a_plain_dataset_shuffled_by_seed_and_epoch() -> None:
    module, x, y = _classifier_case()
    reference, dataset = copy.deepcopy(module), _Samples(x, y)
    trainer = tandem.Trainer(module, _xy_loss, optim.SGD(lr=0.1, momentum=0.9), batch_size=8, seed=3, progress=False)
    history = trainer.fit(dataset, epochs=2)
    # the contract: the batches of the TensorDataset of the same tensors, drop_last (28 samples: 3 batches of 8)
    tensors = TensorDataset(x, y)
    steps = _eager_fit(reference, _xy_loss, [data.batches(tensors, 8, shuffle=True, seed=3, epoch=epoch,
                                                          drop_last=True) for epoch in range(2)])
    assert trainer.step_count == steps == 6 and len(history) == 2
    _assert_same_parameters(module, reference)


def test_fit_iterates_a_data_loader_as_is() -> None:
    module, x, y = _classifier_case()
    reference = copy.deepcopy(module)
    loader = DataLoader(_Samples(x, y), batch_size=10)  # batches of 10, 10, 8: the last one captures again
    trainer = tandem.Trainer(module, _xy_loss, optim.SGD(lr=0.1, momentum=0.9), batch_size=64, progress=False)
    trainer.fit(loader, epochs=2)
    steps = _eager_fit(reference, _xy_loss, [loader, loader])
    assert trainer.step_count == steps == 6
    _assert_same_parameters(module, reference)


def test_fit_over_a_dataset_of_dicts() -> None:
    module, x, y = _classifier_case()
    reference, dataset = copy.deepcopy(module), _Samples(x, y, keys=("x", "y"))
    trainer = tandem.Trainer(module, _dict_loss, optim.SGD(lr=0.1, momentum=0.9), batch_size=8, shuffle=False,
                             progress=False)
    trainer.fit(dataset, epochs=2)
    steps = _eager_fit(reference, _dict_loss, [DataLoader(dataset, batch_size=8, drop_last=True)] * 2)
    assert trainer.step_count == steps == 6
    _assert_same_parameters(module, reference)


def test_evaluate_accuracy_of_dict_labels_skips_ignored_positions() -> None:
    module, x, y = _classifier_case(samples=20)
    y[::3] = -100  # transformers' ignore index: neither in the loss nor in the accuracy

    def loss_fn(module: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return F.cross_entropy(module(batch["x"]), batch["labels"])

    trainer = tandem.Trainer(module, loss_fn, optim.SGD(lr=0.1), batch_size=8, progress=False)
    metrics = trainer.evaluate(_Samples(x, y, keys=("x", "labels")))  # batches of 8, 8, 4: every sample
    with torch.no_grad():
        logits = module(x)
        losses = [loss_fn(module, {"x": x[i:i + 8], "labels": y[i:i + 8]}) for i in range(0, 20, 8)]
    counted = y != -100
    assert metrics["accuracy"] == pytest.approx(float((logits.argmax(-1) == y)[counted].float().mean()))
    assert metrics["loss"] == pytest.approx(float(torch.stack(losses).mean()), rel=1e-9)


def test_evaluate_counts_accuracy_only_for_integer_targets() -> None:
    module, x, y = _classifier_case(samples=16)
    trainer = tandem.Trainer(module, _xy_loss, optim.SGD(lr=0.1), batch_size=8, progress=False)
    metrics = trainer.evaluate(_Samples(x, y))
    with torch.no_grad():
        assert metrics["accuracy"] == pytest.approx(float((module(x).argmax(-1) == y).double().mean()))

    def regression(module: torch.nn.Module, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(module(x), target)

    targets = torch.zeros(16, 3, dtype=torch.float64)
    regressor = tandem.Trainer(module, regression, optim.SGD(lr=0.1), batch_size=8, progress=False)
    assert set(regressor.evaluate(_Samples(x, targets))) == {"loss"}


def test_trainer_batches_of_a_dataset_are_reproducible_per_seed_and_epoch() -> None:
    module, x, y = _classifier_case(samples=40)
    dataset = _Samples(torch.arange(40), y)

    def order(seed: int, epoch: int) -> torch.Tensor:
        trainer = tandem.Trainer(module, _xy_loss, optim.SGD(lr=0.1), batch_size=8, seed=seed, progress=False)
        trainer.epoch = epoch
        return torch.cat([as_arguments(item)[0] for item in trainer._batches(dataset, train=True)])

    assert torch.equal(order(3, 1), order(3, 1))
    assert torch.equal(order(3, 0).sort().values, torch.arange(40))
    assert not torch.equal(order(3, 0), order(3, 1))
    assert not torch.equal(order(3, 0), order(4, 0))


def test_trainer_rejects_a_missing_optimizer_at_once() -> None:
    with pytest.raises(TypeError, match=r"Trainer needs an optimizer.*got NoneType"):
        tandem.Trainer(torch.nn.Linear(2, 1), lambda m, x: m(x).sum(), None)


def test_checkpoint_restores_every_optimizer_setting(tmp_path: Any) -> None:
    module = torch.nn.Linear(3, 1)
    loss_fn = lambda m, x: m(x).pow(2).sum()  # noqa: E731
    x = torch.randn(4, 3)
    trainer = tandem.Trainer(module, loss_fn, tandem.optim.AdamW(lr=0.01, betas=(0.8, 0.9), weight_decay=0.1),
                             progress=False)
    trainer.step(x)
    trainer.save(str(tmp_path / "ckpt.pt"))
    other = tandem.Trainer(torch.nn.Linear(3, 1), loss_fn, tandem.optim.AdamW(lr=0.5), progress=False)
    other.load(str(tmp_path / "ckpt.pt"))
    assert other.optimizer.to_config() == trainer.optimizer.to_config()
    assert "resume" in (tandem.Trainer.state_dict.__doc__ or "")


def test_cli_trains_a_transformers_lm_on_python_help_text(tmp_path: Path) -> None:
    """`tandem train --model hf-gpt2 --data pydoc-text`: dict batches, the model's own loss, perplexity."""
    from tandem.testing.torchvision_compat import ensure_importable

    ensure_importable()
    pytest.importorskip("transformers")
    from tandem.cli import main

    assert main(["train", "--model", "hf-gpt2", "--data", "pydoc-text", "--epochs", "2", "--batch-size", "16",
                 "--optimizer", "adamw", "--lr", "3e-3", "--max-train-samples", "128", "--max-eval-samples", "64",
                 "--threads", "1", "--no-progress", "--out", str(tmp_path)]) == 0  # fmt: skip
    history = json.loads((tmp_path / "history.json").read_text())
    assert [record["epoch"] for record in history] == [1, 2]
    for record in history:
        assert "eval_accuracy" not in record  # unshifted labels: no accuracy reported
        assert record["eval_perplexity"] == pytest.approx(math.exp(record["eval_loss"]))
    assert history[1]["eval_perplexity"] < history[0]["eval_perplexity"] < 256
    assert (tmp_path / "training.png").stat().st_size > 0


def test_bad_options_are_refused_at_construction_with_the_valid_set() -> None:
    module, loss = torch.nn.Linear(2, 1), (lambda m, x: m(x).sum())
    with pytest.raises(ValueError, match=r"unknown kvstore 'foo'; choose one of \['local', 'dist_sync'"):
        tandem.Trainer(module, loss, optim.SGD(lr=0.1), kvstore="foo")
    with pytest.raises(ValueError, match=r"unknown communication 'fast'; choose one of \['auto', 'baseline'"):
        tandem.Trainer(module, loss, optim.SGD(lr=0.1), communication="fast")
    with pytest.raises(ValueError, match=r"mirror='bogus' is not a mirroring policy; use 'off', 'all'"):
        tandem.Trainer(module, loss, optim.SGD(lr=0.1), mirror="bogus")  # before any step, not inside a pass
    with pytest.raises(ValueError, match="bogus"):
        tandem.compile(module, loss, torch.ones(1, 2), mirror="bogus")
