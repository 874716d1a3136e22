"""The dropout pass: eager's float-noise form without mirroring, the 1-byte mask with it."""

from __future__ import annotations

import operator

import pytest
import torch
from torch import nn

import tandem
from tests.conftest import eager_step, twin

aten = torch.ops.aten


class Dropped(nn.Module):
    """Dropout on a hidden layer and on the output: both gradients flow through a mask."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(16, 32), nn.Linear(32, 8)
        self.drop = nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.second(self.drop(torch.relu(self.first(x)))))


def loss_sum(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return module(x).pow(2).sum()


def targets(step: tandem.TrainStep) -> list[object]:
    return [node.target for node in step.graph.op_nodes()]


@pytest.mark.parametrize("fast", [True, False], ids=["tandem-draw", "aten-draw"])
def test_without_mirroring_dropout_takes_eagers_form_and_eagers_numbers(fast: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    from tandem.backends import bernoulli

    monkeypatch.setenv("TANDEM_FAST_BERNOULLI", "1" if fast else "0")
    if fast and bernoulli.unavailable_reason() is not None:
        pytest.skip(f"tandem's fast draw is not used here: {bernoulli.unavailable_reason()}")
    torch.manual_seed(0)
    module, x = Dropped(), torch.randn(64, 16)
    reference = twin(module)
    step = tandem.compile(module, loss_sum, x)
    found = targets(step)
    assert aten.native_dropout.default not in found and aten.native_dropout_backward.default not in found
    assert found.count(torch.ops.tandem.bernoulli.default) == 2, "one draw per dropout, as eager"
    torch.manual_seed(7)
    result = step(x)
    after_step = torch.random.get_rng_state()
    loss, grads = eager_step(reference, loss_sum, (x,), seed=7)
    assert torch.equal(torch.random.get_rng_state(), after_step), "the same random numbers were drawn"
    assert torch.equal(result.loss, loss)  # bit for bit: the same draw, the same float ops as eager
    for name, grad in grads.items():
        assert torch.equal(result.grads[name], grad), name


@pytest.mark.parametrize("policy", ["memory-aware", "all", 0.6])
def test_mirroring_keeps_the_one_byte_mask(policy: object) -> None:
    torch.manual_seed(0)
    module, x = Dropped(), torch.randn(64, 16)
    step = tandem.compile(module, loss_sum, x, mirror=policy)
    masks = [n for n in step.graph.op_nodes() if n.target is operator.getitem
             and getattr(n.args[0], "target", None) is aten.native_dropout.default and n.args[1] == 1]
    assert len(masks) == 2 and all(n.meta["val"].dtype == torch.bool for n in masks)


def test_where_eager_runs_the_fused_kernel_native_dropout_stays() -> None:
    """On CUDA eager's dropout is native_dropout's fused kernel, whose draw is not a Bernoulli tensor's:
    the pass leaves it (a graph traced for CUDA, made here by giving the dropout inputs fake CUDA values)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from tandem.graph.capture import capture
    from tandem.passes.config import PlanConfig
    from tandem.passes.dropout import dropout_pass, eager_runs_native_dropout

    assert eager_runs_native_dropout(torch.device("cuda")) and not eager_runs_native_dropout(torch.device("cpu"))
    torch.manual_seed(0)
    graph = capture(Dropped(), loss_sum, (torch.randn(4, 16),))
    dropouts = [n for n in graph.op_nodes() if n.target is aten.native_dropout.default]
    assert len(dropouts) == 2
    with FakeTensorMode(allow_non_fake_inputs=True):
        for node in dropouts:
            source = node.args[0]
            source.meta["val"] = torch.empty(source.meta["val"].shape, device="cuda")
    dropout_pass(graph, PlanConfig())
    assert [n for n in graph.op_nodes() if n.target is aten.native_dropout.default] == dropouts
    assert torch.ops.tandem.bernoulli.default not in {n.target for n in graph.op_nodes()}


class TwiceDropped(nn.Module):
    """Two dropouts of one tensor with one rate: two draws, never merged into one (a CSE pass would)."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.drop = nn.Linear(16, 32), nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.relu(self.first(x))
        return self.drop(hidden) * self.drop(hidden)


@pytest.mark.parametrize("backend", ["aten", "inductor"])
def test_two_draws_of_one_tensor_stay_two_draws(backend: str) -> None:
    torch.manual_seed(0)
    module, x = TwiceDropped(), torch.randn(8, 16)
    reference = twin(module)
    step = tandem.compile(module, loss_sum, x, backend=backend)
    torch.manual_seed(3)
    result = step(x)
    after_step = torch.random.get_rng_state()
    loss, grads = eager_step(reference, loss_sum, (x,), seed=3)
    assert torch.equal(torch.random.get_rng_state(), after_step), "as many numbers drawn as eager draws"
    torch.testing.assert_close(result.loss, loss, rtol=1e-5, atol=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(result.grads[name], grad, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


class StridedDropped(nn.Module):
    """Dropout of a transposed (dense, not contiguous) value: eager's noise takes its layout."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.drop = nn.Linear(16, 24), nn.Dropout(0.4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.first(x).t()).sum(0)


@pytest.mark.parametrize("fast", [True, False], ids=["tandem-draw", "aten-draw"])
def test_a_strided_input_gets_eagers_mask(fast: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The noise is drawn in memory order of the input's layout, as eager's empty_like(x).bernoulli_."""
    monkeypatch.setenv("TANDEM_FAST_BERNOULLI", "1" if fast else "0")
    torch.manual_seed(0)
    module, x = StridedDropped(), torch.randn(32, 16)
    reference = twin(module)
    step = tandem.compile(module, loss_sum, x)
    torch.manual_seed(9)
    result = step(x)
    loss, grads = eager_step(reference, loss_sum, (x,), seed=9)
    assert torch.equal(result.loss, loss)
    for name, grad in grads.items():
        assert torch.equal(result.grads[name], grad), name
