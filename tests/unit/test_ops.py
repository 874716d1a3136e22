"""tandem.ops against plain per-tensor references over mixed shapes and dtypes, plus their errors."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from torch import Tensor

from tandem.ops import (
    clip_global_norm,
    global_norm,
    multi_adamw_update,
    multi_lamb_update,
    multi_sgd_update,
    multi_sum_sq,
    reset_arrays,
)

SHAPES = [(3, 4), (5,), (2, 3, 4), (1,), (), (7, 2)]
MIXED = [torch.float32, torch.float64, torch.bfloat16]
# bfloat16 keeps 8 mantissa bits: a few steps of rounding against a float64 reference.
TOLERANCE = {torch.float64: (1e-10, 1e-10), torch.float32: (2e-5, 2e-5), torch.bfloat16: (3e-2, 3e-2)}


def make_tensors(dtypes: list[torch.dtype], seed: int, count: int = len(SHAPES)) -> list[Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shapes = [SHAPES[index % len(SHAPES)] for index in range(count)]
    return [
        torch.randn(shape, generator=generator, dtype=torch.float64).to(dtypes[index % len(dtypes)])
        for index, shape in enumerate(shapes)
    ]


def assert_close_to_reference(actual: list[Tensor], expected: list[Tensor]) -> None:
    for index, (got, want) in enumerate(zip(actual, expected)):
        rtol, atol = TOLERANCE[got.dtype]
        torch.testing.assert_close(got.double(), want, rtol=rtol, atol=atol, msg=lambda m, i=index: f"[{i}] {m}")


DTYPE_CASES = [[torch.float32], [torch.float64], [torch.bfloat16], MIXED]
DTYPE_IDS = ["float32", "float64", "bfloat16", "mixed"]


# ---------------------------------------------------------------- reset_arrays


@pytest.mark.parametrize("dtypes", DTYPE_CASES + [[torch.int64, torch.float32]], ids=DTYPE_IDS + ["int-float"])
def test_reset_arrays_zeroes_every_tensor(dtypes: list[torch.dtype]) -> None:
    tensors = [tensor + 1 for tensor in make_tensors(dtypes, seed=1)]
    reset_arrays(tensors)
    assert all(tensor.count_nonzero() == 0 for tensor in tensors)


def test_reset_arrays_single_empty_and_parameters() -> None:
    reset_arrays([])
    parameter = torch.nn.Parameter(torch.ones(3))
    reset_arrays([parameter])  # runs under no_grad, so a leaf that requires grad is fine
    assert parameter.count_nonzero() == 0 and parameter.requires_grad
    reset_arrays(tensor for tensor in [torch.ones(2)])  # any iterable


def test_reset_arrays_grouped_route_on_non_cpu_devices() -> None:
    # Meta tensors are not on CPU, so they take the (device, dtype) grouping route; no data to check.
    tensors = [torch.empty(3, device="meta"), torch.empty(2, device="meta", dtype=torch.float64)]
    reset_arrays(tensors)
    with pytest.raises(TypeError, match=r"tensors\[1\] is a str"):
        reset_arrays([torch.empty(3, device="meta"), "grad"])  # type: ignore[list-item]


def test_reset_arrays_names_bad_input() -> None:
    with pytest.raises(TypeError, match=r"tensors\[2\] is a NoneType"):
        reset_arrays([torch.ones(1), torch.ones(1), None])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="not a single tensor"):
        reset_arrays(torch.ones(3))
    with pytest.raises(TypeError, match="list of tensors"):
        reset_arrays(3)  # type: ignore[arg-type]


# ---------------------------------------------------------------- norms


@pytest.mark.parametrize("dtypes", DTYPE_CASES, ids=DTYPE_IDS)
def test_sum_sq_and_global_norm_match_reference(dtypes: list[torch.dtype]) -> None:
    tensors = make_tensors(dtypes, seed=2)
    expected = sum(float(tensor.double().square().sum()) for tensor in tensors)
    sum_sq, norm = multi_sum_sq(tensors), global_norm(tensors)
    expected_dtype = torch.float64 if torch.float64 in dtypes else torch.float32
    assert sum_sq.dim() == 0 and sum_sq.dtype == expected_dtype and norm.dtype == expected_dtype
    rtol = 1e-12 if dtypes == [torch.float64] else 1e-5  # float32 and bfloat16 norms accumulate in float32
    assert float(sum_sq) == pytest.approx(expected, rel=rtol)
    assert float(norm) == pytest.approx(math.sqrt(expected), rel=rtol)


def test_norms_of_empty_and_single() -> None:
    for function in (multi_sum_sq, global_norm, lambda tensors: clip_global_norm(tensors, 1.0)):
        result = function([])
        assert result.dim() == 0 and float(result) == 0.0 and result.dtype == torch.float32
    assert float(multi_sum_sq([torch.tensor([3.0, 4.0])])) == 25.0
    assert float(global_norm([torch.tensor([3.0, 4.0])])) == 5.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("max_norm", [0.5, 1e6])
def test_clip_global_norm_matches_torch(dtype: torch.dtype, max_norm: float) -> None:
    tensors = make_tensors([dtype], seed=3)
    holders = [torch.nn.Parameter(torch.empty_like(tensor)) for tensor in tensors]
    for holder, tensor in zip(holders, tensors):
        holder.grad = tensor.clone()  # clip_grad_norm_ clips the .grad of what it is given
    total = clip_global_norm(tensors, max_norm)
    expected_total = torch.nn.utils.clip_grad_norm_(holders, max_norm, foreach=True)
    torch.testing.assert_close(total, expected_total)
    for got, holder in zip(tensors, holders):
        torch.testing.assert_close(got, holder.grad)
    if max_norm < float(total):
        assert float(global_norm(tensors)) == pytest.approx(max_norm, rel=1e-5)


def test_clip_global_norm_mixed_dtypes_scales_all() -> None:
    tensors = make_tensors(MIXED, seed=4)
    before = [tensor.to(torch.float64, copy=True) for tensor in tensors]
    total = clip_global_norm(tensors, 1.0)
    scale = 1.0 / (float(total) + 1e-6)
    assert_close_to_reference(tensors, [tensor * scale for tensor in before])


def test_norm_errors_name_the_problem() -> None:
    with pytest.raises(TypeError, match=r"tensors\[1\] has dtype torch.int64"):
        multi_sum_sq([torch.ones(2), torch.ones(2, dtype=torch.int64)])
    with pytest.raises(TypeError, match=r"tensors\[0\] is a float"):
        global_norm([1.0])  # type: ignore[list-item]
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="max_norm must be > 0"):
            clip_global_norm([torch.ones(2)], bad)
    with pytest.raises(TypeError, match="max_norm must be a number"):
        clip_global_norm([torch.ones(2)], "1")  # type: ignore[arg-type]


# ---------------------------------------------------------------- plain per-tensor references


def reference_sgd(
    param: Tensor, grad: Tensor, buffer: Tensor | None, *, lr: float, momentum: float, weight_decay: float,
    nesterov: bool, dampening: float,
) -> tuple[Tensor, Tensor | None]:
    direction = grad + weight_decay * param
    if momentum:
        buffer = direction.clone() if buffer is None else momentum * buffer + (1 - dampening) * direction
        direction = direction + momentum * buffer if nesterov else buffer
    return param - lr * direction, buffer


def reference_adam_direction(
    grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, step: int, beta1: float, beta2: float, eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    exp_avg = beta1 * exp_avg + (1 - beta1) * grad
    exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * grad * grad
    corrected_avg = exp_avg / (1 - beta1**step)
    corrected_sq = exp_avg_sq / (1 - beta2**step)
    return corrected_avg / (corrected_sq.sqrt() + eps), exp_avg, exp_avg_sq


def reference_adamw(param: Tensor, direction: Tensor, *, lr: float, weight_decay: float) -> Tensor:
    return param * (1 - lr * weight_decay) - lr * direction


def reference_lamb(param: Tensor, direction: Tensor, *, lr: float, weight_decay: float) -> Tensor:
    update = direction + weight_decay * param
    weight_norm, update_norm = float(param.norm()), float(update.norm())
    ratio = weight_norm / update_norm if weight_norm > 0 and update_norm > 0 else 1.0
    return param - lr * ratio * update


# ---------------------------------------------------------------- SGD

SGD_CASES = [
    dict(lr=0.1, momentum=0.0, weight_decay=0.0, nesterov=False, dampening=0.0),
    dict(lr=0.1, momentum=0.9, weight_decay=0.01, nesterov=False, dampening=0.0),
    dict(lr=0.05, momentum=0.9, weight_decay=0.01, nesterov=True, dampening=0.0),
    dict(lr=0.05, momentum=0.5, weight_decay=0.0, nesterov=False, dampening=0.3),
]


@pytest.mark.parametrize("dtypes", DTYPE_CASES, ids=DTYPE_IDS)
@pytest.mark.parametrize("hyper", SGD_CASES, ids=["plain", "momentum-wd", "nesterov", "dampening"])
def test_multi_sgd_update_matches_reference(dtypes: list[torch.dtype], hyper: dict) -> None:
    params = make_tensors(dtypes, seed=5)
    expected = [param.to(torch.float64, copy=True) for param in params]
    buffers: list[Tensor | None] = [None] * len(params)
    expected_buffers: list[Tensor | None] = [None] * len(params)
    for step in range(3):
        grads = make_tensors(dtypes, seed=10 + step)
        grads_before = [grad.clone() for grad in grads]
        multi_sgd_update(params, grads, buffers, **hyper)
        for index, grad in enumerate(grads):
            expected[index], expected_buffers[index] = reference_sgd(
                expected[index], grad.double(), expected_buffers[index], **hyper
            )
        assert all(torch.equal(grad, before) for grad, before in zip(grads, grads_before)), "grads were modified"
    assert_close_to_reference(params, expected)
    if hyper["momentum"]:
        assert_close_to_reference(buffers, expected_buffers)  # type: ignore[arg-type]
    else:
        assert buffers == [None] * len(params)


def test_fused_sgd_first_step_and_partial_buffers() -> None:
    params = make_tensors([torch.float32], seed=8)
    expected = [param.to(torch.float64, copy=True) for param in params]
    buffers: list[Tensor | None] = [None] * len(params)
    expected_buffers: list[Tensor | None] = [None] * len(params)
    hyper = dict(lr=0.05, momentum=0.9, weight_decay=0.01, nesterov=True, dampening=0.0)
    for step in range(3):
        if step == 2:
            buffers[0] = expected_buffers[0] = None  # a parameter that joined late: foreach fallback
        grads = make_tensors([torch.float32], seed=30 + step)
        multi_sgd_update(params, grads, buffers, fused=True, **hyper)
        for index, grad in enumerate(grads):
            expected[index], expected_buffers[index] = reference_sgd(expected[index], grad.double(), expected_buffers[index], **hyper)
    assert_close_to_reference(params, expected)
    assert_close_to_reference(buffers, expected_buffers)  # type: ignore[arg-type]


@pytest.mark.parametrize("dtypes", [[torch.float32], [torch.float64], MIXED], ids=["float32", "float64", "mixed"])
def test_fused_adamw_matches_reference(dtypes: list[torch.dtype]) -> None:
    params = make_tensors(dtypes, seed=9)
    moments = [torch.zeros_like(param) for param in params], [torch.zeros_like(param) for param in params]
    steps = [torch.tensor(0.0) for _ in params]
    expected = [param.to(torch.float64, copy=True) for param in params]
    expected_moments = [(torch.zeros_like(param), torch.zeros_like(param)) for param in expected]
    for step in range(1, 4):
        grads = make_tensors(dtypes, seed=40 + step)
        multi_adamw_update(params, grads, *moments, steps, lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1, fused=True)
        for index, grad in enumerate(grads):
            direction, *new_moments = reference_adam_direction(grad.double(), *expected_moments[index], step, 0.9, 0.99, 1e-8)
            expected_moments[index] = (new_moments[0], new_moments[1])
            expected[index] = reference_adamw(expected[index], direction, lr=1e-2, weight_decay=0.1)
    assert [float(step) for step in steps] == [3.0] * len(params)
    assert_close_to_reference(params, expected)


def test_multi_sgd_update_momentum_zero_accepts_empty_buffers() -> None:
    params, grads = [torch.ones(2)], [torch.ones(2)]
    multi_sgd_update(params, grads, [], lr=0.5)
    assert torch.equal(params[0], torch.full((2,), 0.5))


# ---------------------------------------------------------------- AdamW and LAMB

ADAM_OPS: dict[str, tuple[Callable[..., None], Callable[..., Tensor]]] = {
    "adamw": (multi_adamw_update, reference_adamw),
    "lamb": (multi_lamb_update, reference_lamb),
}


@pytest.mark.parametrize("dtypes", DTYPE_CASES, ids=DTYPE_IDS)
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("op_name", list(ADAM_OPS))
def test_adam_family_updates_match_reference(op_name: str, weight_decay: float, dtypes: list[torch.dtype]) -> None:
    fused, reference = ADAM_OPS[op_name]
    hyper = dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=weight_decay)
    params = make_tensors(dtypes, seed=6)
    exp_avgs = [torch.zeros_like(param) for param in params]
    exp_avg_sqs = [torch.zeros_like(param) for param in params]
    steps = [torch.tensor(0.0) for _ in params]
    expected = [param.to(torch.float64, copy=True) for param in params]
    expected_avgs = [torch.zeros_like(param) for param in expected]
    expected_sqs = [torch.zeros_like(param) for param in expected]
    for step in range(1, 4):
        grads = make_tensors(dtypes, seed=20 + step)
        fused(params, grads, exp_avgs, exp_avg_sqs, steps, **hyper)
        for index, grad in enumerate(grads):
            direction, expected_avgs[index], expected_sqs[index] = reference_adam_direction(
                grad.double(), expected_avgs[index], expected_sqs[index], step, 0.9, 0.99, 1e-8
            )
            expected[index] = reference(expected[index], direction, lr=1e-2, weight_decay=weight_decay)
    assert [float(step) for step in steps] == [3.0] * len(params)
    assert_close_to_reference(exp_avgs, expected_avgs)
    assert_close_to_reference(exp_avg_sqs, expected_sqs)
    assert_close_to_reference(params, expected)


def test_lamb_trust_ratio_is_one_for_zero_weights() -> None:
    params, grads = [torch.zeros(4, dtype=torch.float64)], [torch.ones(4, dtype=torch.float64)]
    state = [torch.zeros(4, dtype=torch.float64)], [torch.zeros(4, dtype=torch.float64)], [torch.tensor(0.0)]
    multi_lamb_update(params, grads, *state, lr=0.1, beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.0)
    # Adam's first step moves by ~lr along -sign(grad); ratio 1 leaves that unchanged.
    torch.testing.assert_close(params[0], torch.full((4,), -0.1, dtype=torch.float64), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fused", [multi_adamw_update, multi_lamb_update])
def test_adam_family_empty_is_noop(fused: Callable[..., None]) -> None:
    fused([], [], [], [], [], lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)


# ---------------------------------------------------------------- errors


def adamw_call(**overrides: object) -> None:
    lists = dict(
        params=[torch.ones(2), torch.ones(3)],
        grads=[torch.ones(2), torch.ones(3)],
        exp_avgs=[torch.zeros(2), torch.zeros(3)],
        exp_avg_sqs=[torch.zeros(2), torch.zeros(3)],
        steps=[torch.tensor(0.0), torch.tensor(0.0)],
    )
    hyper = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
    for key, value in overrides.items():
        (lists if key in lists else hyper)[key] = value
    multi_adamw_update(*lists.values(), **hyper)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "overrides, error, pattern",
    [
        (dict(grads=[torch.ones(2)]), ValueError, "grads has 1 entries but params has 2"),
        (dict(grads=[torch.ones(2), [1.0, 2.0, 3.0]]), TypeError, r"grads\[1\] is a list"),
        (dict(params=[torch.ones(2), None]), TypeError, r"params\[1\] is a NoneType"),
        (dict(grads=[torch.ones(2), torch.ones(3, device="meta")]), ValueError, r"grads\[1\] is on meta but params\[1\] is on cpu"),
        (dict(exp_avgs=[torch.zeros(2, dtype=torch.float64), torch.zeros(3)]), TypeError, r"exp_avgs\[0\] has dtype torch.float64"),
        (dict(exp_avg_sqs=[torch.zeros(2), torch.zeros(4)]), ValueError, r"exp_avg_sqs\[1\] has shape \(4,\)"),
        (dict(steps=[torch.tensor(0.0), torch.zeros(2)]), ValueError, r"steps\[1\] must be a 0-dim floating tensor"),
        (dict(steps=[torch.tensor(0.0), torch.tensor(0.0, device="meta")]), ValueError, r"steps\[1\] is on meta"),
        (dict(lr=-1.0), ValueError, "lr must be >= 0"),
        (dict(beta1=1.0), ValueError, r"beta1 must be in \[0, 1\)"),
        (dict(eps=0.0), ValueError, "eps must be > 0"),
        (dict(weight_decay="0.1"), TypeError, "weight_decay must be a number"),
    ],
)
def test_adamw_errors_name_argument_and_index(overrides: dict, error: type[Exception], pattern: str) -> None:
    with pytest.raises(error, match=pattern):
        adamw_call(**overrides)


def test_sgd_errors_name_argument_and_index() -> None:
    params, grads = [torch.ones(2)], [torch.ones(2)]
    with pytest.raises(ValueError, match="momentum_buffers has 0 entries but params has 1"):
        multi_sgd_update(params, grads, [], lr=0.1, momentum=0.9)
    with pytest.raises(TypeError, match="momentum_buffers must be a list"):
        multi_sgd_update(params, grads, (None,), lr=0.1, momentum=0.9)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"momentum_buffers\[0\] has dtype torch.float64"):
        multi_sgd_update(params, grads, [torch.zeros(2, dtype=torch.float64)], lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match="nesterov=True needs momentum > 0"):
        multi_sgd_update(params, grads, [None], lr=0.1, nesterov=True)
    with pytest.raises(TypeError, match=r"grads\[0\] has dtype torch.bfloat16"):
        multi_sgd_update(params, [torch.ones(2, dtype=torch.bfloat16)], [], lr=0.1)
