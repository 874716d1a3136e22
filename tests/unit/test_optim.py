"""tandem.optim against torch.optim (SGD, AdamW) and a plain reference (LAMB); configs and validation."""

from __future__ import annotations

import io
import json
from collections.abc import Callable

import pytest
import torch
from torch import Tensor

from tandem import optim
from tandem.optim import LAMB, SGD, AdamW, Optimizer
from tests.unit.test_ops import (
    MIXED,
    assert_close_to_reference,
    make_tensors,
    reference_adam_direction,
    reference_lamb,
)

TorchFactory = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]

CASES: dict[str, tuple[Callable[[], Optimizer], TorchFactory]] = {
    "sgd": (lambda: SGD(lr=0.1), lambda ps: torch.optim.SGD(ps, lr=0.1, foreach=True)),
    "sgd-momentum-wd": (
        lambda: SGD(lr=0.1, momentum=0.9, weight_decay=0.01),
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01, foreach=True),
    ),
    "sgd-nesterov": (
        lambda: SGD(lr=0.05, momentum=0.9, weight_decay=0.01, nesterov=True),
        lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=0.01, nesterov=True, foreach=True),
    ),
    "sgd-dampening": (
        lambda: SGD(lr=0.05, momentum=0.5, dampening=0.3),
        lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.5, dampening=0.3, foreach=True),
    ),
    "adamw": (AdamW, lambda ps: torch.optim.AdamW(ps, foreach=True)),
    "adamw-wd": (
        lambda: AdamW(lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1),
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1, foreach=True),
    ),
}


def run_side_by_side(
    optimizers: list[Optimizer], make_torch: TorchFactory, dtypes: list[torch.dtype], seed: int, steps: int
) -> tuple[list[list[Tensor]], list[list[dict[str, Tensor]]], list[torch.nn.Parameter], torch.optim.Optimizer]:
    """Run each tandem optimizer and a torch one from the same start on the same gradients."""
    initial = make_tensors(dtypes, seed=seed, count=9)
    params = [[param.clone() for param in initial] for _ in optimizers]
    states = [[optimizer.create_state(param) for param in initial] for optimizer in optimizers]
    torch_params = [torch.nn.Parameter(param.clone()) for param in initial]
    reference = make_torch(torch_params)
    for step in range(steps):
        grads = make_tensors(dtypes, seed=seed + 100 + step, count=9)
        for holder, grad in zip(torch_params, grads):
            holder.grad = grad.clone()
        for optimizer, own_params, own_states in zip(optimizers, params, states):
            optimizer.update(own_params, grads, own_states)
        reference.step()
    return params, states, torch_params, reference


@pytest.mark.parametrize("dtypes", [[torch.float64], [torch.float32], MIXED], ids=["float64", "float32", "mixed"])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_torch_optimizer(case: str, dtypes: list[torch.dtype]) -> None:
    make_ours, make_torch = CASES[case]
    ([params], [states], torch_params, reference) = run_side_by_side([make_ours()], make_torch, dtypes, seed=1, steps=4)
    # Same foreach formula order as torch: equal, not merely close (float64 at torch's tight tolerance).
    for ours_param, torch_param in zip(params, torch_params):
        torch.testing.assert_close(ours_param, torch_param.detach())
    for state, holder in zip(states, torch_params):
        torch_state = reference.state[holder]
        assert set(state) == {key for key, value in torch_state.items() if value is not None}
        for key, value in state.items():
            torch.testing.assert_close(value, torch_state[key])


FUSED_CASES: dict[str, tuple[Callable[[], Optimizer], TorchFactory]] = {
    "sgd-nesterov": (
        lambda: SGD(lr=0.05, momentum=0.9, weight_decay=0.01, nesterov=True, fused=True),
        lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=0.01, nesterov=True, fused=True),
    ),
    "sgd-plain": (lambda: SGD(lr=0.1, fused=True), lambda ps: torch.optim.SGD(ps, lr=0.1, fused=True)),
    "adamw-wd": (
        lambda: AdamW(lr=1e-2, weight_decay=0.1, fused=True),
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True),
    ),
}


@pytest.mark.parametrize("case", list(FUSED_CASES))
def test_fused_kernels_match_torch_fused_and_foreach(case: str) -> None:
    make_ours, make_torch = FUSED_CASES[case]
    ours = make_ours()
    foreach = type(ours).from_config({**ours.to_config(), "fused": False})
    ([params, foreach_params], _, torch_params, _) = run_side_by_side([ours, foreach], make_torch, MIXED, seed=7, steps=3)
    for ours_param, torch_param, foreach_param in zip(params, torch_params, foreach_params):
        torch.testing.assert_close(ours_param, torch_param.detach())  # the same kernel as torch's fused=True
        if ours_param.dtype != torch.bfloat16:  # the kernel computes bfloat16 in float32: more exact than foreach
            torch.testing.assert_close(ours_param, foreach_param)


@pytest.mark.parametrize("weight_decay", [0.0, 0.05])
def test_lamb_matches_plain_reference(weight_decay: float) -> None:
    lamb = LAMB(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=weight_decay)
    params = make_tensors(MIXED, seed=2, count=9)
    states = [lamb.create_state(param) for param in params]
    expected = [param.to(torch.float64, copy=True) for param in params]
    moments = [(torch.zeros_like(param), torch.zeros_like(param)) for param in expected]
    for step in range(1, 4):
        grads = make_tensors(MIXED, seed=200 + step, count=9)
        lamb.update(params, grads, states)
        for index, grad in enumerate(grads):
            direction, *new_moments = reference_adam_direction(grad.double(), *moments[index], step, 0.9, 0.99, 1e-8)
            moments[index] = (new_moments[0], new_moments[1])
            expected[index] = reference_lamb(expected[index], direction, lr=1e-2, weight_decay=weight_decay)
    assert_close_to_reference(params, expected)


def test_sgd_state_empty_without_momentum_and_first_buffer_is_grad() -> None:
    param, grad = torch.ones(3), torch.full((3,), 2.0)
    plain = SGD(lr=0.1)
    state = plain.create_state(param)
    plain.update([param], [grad], [state])
    assert state == {}
    with_momentum = SGD(lr=0.1, momentum=0.9, dampening=0.5)
    state = with_momentum.create_state(param)
    with_momentum.update([param], [grad], [state])
    assert torch.equal(state["momentum_buffer"], grad) and state["momentum_buffer"] is not grad


@pytest.mark.parametrize("optimizer", [SGD(lr=0.1, momentum=0.9), AdamW(), LAMB()], ids=["sgd", "adamw", "lamb"])
def test_state_is_tensors_only_and_survives_torch_save(optimizer: Optimizer) -> None:
    params = make_tensors([torch.float32], seed=3)
    states = [optimizer.create_state(param) for param in params]
    optimizer.update(params, make_tensors([torch.float32], seed=4), states)
    checkpoint = {f"p{index}": state for index, state in enumerate(states)}
    assert all(isinstance(value, Tensor) for state in states for value in state.values())
    buffer = io.BytesIO()
    torch.save(checkpoint, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    for name, state in checkpoint.items():
        assert loaded[name].keys() == state.keys()
        assert all(torch.equal(loaded[name][key], state[key]) for key in state)


def test_adam_state_layout_matches_torch() -> None:
    state = AdamW().create_state(torch.ones(2, 3, dtype=torch.float64))
    assert state["step"].dtype == torch.float32 and state["step"].dim() == 0 and state["step"].is_cpu
    assert state["exp_avg"].shape == (2, 3) and state["exp_avg_sq"].dtype == torch.float64


def test_lr_is_mutable_for_schedules() -> None:
    sgd = SGD(lr=1.0)
    param = torch.zeros(1)
    sgd.lr = 0.25
    sgd.update([param], [torch.ones(1)], [{}])
    assert float(param) == -0.25
    sgd.lr = -1.0
    with pytest.raises(ValueError, match="lr must be >= 0"):
        sgd.update([param], [torch.ones(1)], [{}])


@pytest.mark.parametrize("optimizer", [SGD(lr=0.1, momentum=0.9, nesterov=True), AdamW(betas=(0.8, 0.9)), LAMB(weight_decay=0.1)])
def test_config_round_trips_through_json(optimizer: Optimizer) -> None:
    config = optimizer.to_config()
    assert all(isinstance(value, float | int | bool | str) for value in config.values())
    rebuilt = Optimizer.from_config(json.loads(json.dumps(config)))
    assert rebuilt == optimizer and type(rebuilt) is type(optimizer)


def test_create_by_name() -> None:
    assert optim.create("adamw", lr=0.5) == AdamW(lr=0.5)
    assert optim.create("SGD", lr=0.1, momentum=0.9) == SGD(lr=0.1, momentum=0.9)
    assert optim.create("lamb") == LAMB()
    assert AdamW().to_config() == {
        "name": "adamw", "lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 1e-2, "fused": False
    }


@pytest.mark.parametrize(
    "call, error, pattern",
    [
        (lambda: optim.create("adagrad"), ValueError, r"unknown optimizer 'adagrad'; known: \['adamw', 'lamb', 'sgd'\]"),
        (lambda: optim.create("sgd", lr=0.1, betas=(0.9, 0.9)), ValueError, r"SGD has no hyperparameter\(s\) \['betas'\]"),
        (lambda: Optimizer.from_config({"lr": 0.1}), ValueError, "must be a mapping with a 'name'"),
        (lambda: Optimizer.from_config({"name": "adamw", "momentum": 0.9}), ValueError, r"no hyperparameter\(s\) \['momentum'\]"),
        (lambda: SGD(lr=-0.1), ValueError, "SGD: lr must be >= 0"),
        (lambda: SGD(lr=0.1, nesterov=True), ValueError, "nesterov=True needs momentum > 0 and dampening 0"),
        (lambda: SGD(lr=0.1, momentum=0.9, nesterov=True, dampening=0.1), ValueError, "nesterov=True needs"),
        (lambda: AdamW(betas=(0.9, 1.0)), ValueError, r"AdamW: beta2 must be in \[0, 1\)"),
        (lambda: AdamW(betas=(0.9,)), ValueError, "betas must be a pair"),
        (lambda: AdamW(eps=0.0), ValueError, "AdamW: eps must be > 0"),
        (lambda: LAMB(lr="fast"), TypeError, "LAMB: lr must be a number"),
        (lambda: LAMB(weight_decay=-1.0), ValueError, "LAMB: weight_decay must be >= 0"),
        (lambda: AdamW(fused=1), TypeError, "AdamW: fused must be a bool"),
        (lambda: SGD(lr=0.1, nesterov="yes"), TypeError, "SGD: nesterov must be a bool"),
    ],
)
def test_bad_hyperparameters_and_configs_raise_clearly(call: Callable[[], object], error: type[Exception], pattern: str) -> None:
    with pytest.raises(error, match=pattern):
        call()


def test_update_names_bad_states() -> None:
    adamw, params, grads = AdamW(), [torch.ones(2), torch.ones(2)], [torch.ones(2), torch.ones(2)]
    with pytest.raises(ValueError, match="states has 1 entries but params has 2"):
        adamw.update(params, grads, [adamw.create_state(params[0])])
    with pytest.raises(ValueError, match=r"states\[1\] lacks \['exp_avg', 'exp_avg_sq', 'step'\]"):
        adamw.update(params, grads, [adamw.create_state(params[0]), {}])
    with pytest.raises(TypeError, match=r"states\[0\] is a list"):
        adamw.update(params, grads, [[], {}])  # type: ignore[list-item]


def test_empty_update_is_noop() -> None:
    for optimizer in (SGD(lr=0.1, momentum=0.9), AdamW(), LAMB()):
        optimizer.update([], [], [])


def test_a_torch_optimizer_applied_a_few_parameters_at_a_time_steps_each_once() -> None:
    """A distributed update applies one segment's parameters per call: earlier calls' gradients must
    not be stepped again by a later call's optimizer.step()."""
    from tandem.update.base import OptimizerApply

    params = {"a": torch.nn.Parameter(torch.zeros(3)), "b": torch.nn.Parameter(torch.zeros(2))}
    apply = OptimizerApply(params, torch.optim.SGD(params.values(), lr=1.0))
    apply(["a"], {"a": torch.ones(3)})
    apply(["b"], {"b": torch.ones(2)})
    assert torch.equal(params["a"].detach(), -torch.ones(3)) and torch.equal(params["b"].detach(), -torch.ones(2))
