"""Shared test helpers: eager PyTorch references for tandem's captured steps."""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

torch.set_num_threads(1)  # the CI machine has 2 cores; tests stay predictable and do not oversubscribe
# Every test traces its step (the processes it starts inherit this); tests/graph/test_capture_cache.py
# turns the capture cache on in a directory of its own.
os.environ.setdefault("TANDEM_CAPTURE_CACHE", "0")
os.environ.setdefault("TANDEM_UNIT_CACHE", "0")  # and compiles every unit (tests/graph/test_unit_cache.py: on)


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist (scripts/test.sh: ``-n auto --dist loadgroup``) the multi-process jobs of
    tests/distributed run one at a time on one worker, first (they take longest together), while
    the other workers run the single-process tests. Two jobs at once were slower in all (23.6 min
    against 19.5 on 2 cores): each job fills the cores in bursts."""
    items.sort(key=lambda item: not _multi_process(item))  # stable: the group starts first
    for item in items:
        if _multi_process(item):
            item.add_marker(pytest.mark.xdist_group("distributed"))


def _multi_process(item: pytest.Item) -> bool:
    return "distributed" in item.path.parts


def pytest_collection_finish(session: pytest.Session) -> None:
    """Fail loudly where pytest-xdist would ignore the group and spread the jobs over both workers (it
    names a grouped test ``...@distributed...``; pytest 9.2 broke that: pytest-xdist issue #1386)."""
    if getattr(session.config.option, "loadgroup", False):
        ungrouped = [i.nodeid for i in session.items if _multi_process(i) and "@distributed" not in i.nodeid]
        if ungrouped:
            raise pytest.UsageError(f"pytest-xdist did not group {ungrouped[0]} (pytest-xdist issue #1386): "
                                    f"install the pytest pyproject.toml pins (pip install -e .[dev])")


def eager_step(module: nn.Module, loss_fn: Callable[..., torch.Tensor], batch: tuple[torch.Tensor, ...],
               seed: int = 0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss and gradients by plain eager autograd (the reference every graph pass is held to)."""
    module.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = loss_fn(module, *batch)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in module.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def zoo_case(name: str, dtype: torch.dtype = torch.float64, batch_size: int = 4,
             seed: int = 0) -> tuple[nn.Module, Callable[..., torch.Tensor], tuple[torch.Tensor, ...]]:
    from tandem.models import ZOO

    entry = ZOO[name]
    torch.manual_seed(seed)
    module = entry.build(**entry.tiny).to(dtype)
    batch = entry.make_batch(batch_size, torch.Generator().manual_seed(seed), dtype=dtype, **entry.tiny)
    return module, entry.loss_fn, batch


def twin(module: nn.Module) -> nn.Module:
    return copy.deepcopy(module)


def assert_same_step(step_result: Any, eager_loss: torch.Tensor, eager_grads: dict[str, torch.Tensor],
                     rtol: float, atol: float) -> None:
    torch.testing.assert_close(step_result.loss, eager_loss, rtol=rtol, atol=atol)
    assert set(step_result.grads) == set(eager_grads), (sorted(step_result.grads), sorted(eager_grads))
    for name, grad in eager_grads.items():
        torch.testing.assert_close(step_result.grads[name], grad, rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


def assert_same_state(module: nn.Module, reference: nn.Module, rtol: float, atol: float,
                      device_type: str | None = None) -> None:
    """Every parameter and buffer (BatchNorm's running stats: written back by the step) equal to eager's,
    and, where device_type is given, on that device."""
    ours = module.state_dict()
    for name, expected in reference.state_dict().items():
        assert device_type is None or ours[name].device.type == device_type, (name, ours[name].device)
        torch.testing.assert_close(ours[name], expected, rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


@pytest.fixture(params=["mlp", "resnet", "vgg", "lstm_lm", "gpt"])
def zoo_name(request: pytest.FixtureRequest) -> str:
    return request.param
