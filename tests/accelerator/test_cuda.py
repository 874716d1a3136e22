"""tandem on a CUDA device: the CPU suite's main checks against eager PyTorch, on the GPU.

CI has no GPU, so this module skips there; it runs wherever ``torch.cuda.is_available()``
(``pytest tests/accelerator``). What it holds to eager autograd on the device:

* a captured step (aten backend): loss, every gradient and BatchNorm's running stats, zoo models in
  float64 and float32, and tiny transformers / timm models in float32;
* backend="inductor" (Triton kernels on the GPU): 10 ``Trainer`` steps of every zoo model;
* memory: ``peak_bytes`` measured on the device (the profiler's CUDA allocation events), the CUDA
  allocator's own peak reported beside it, and memory-aware mirroring never above mirroring off;
* a ``Trainer`` with the local kvstore and a fused optimizer gives torch.optim's parameters.

TF32 is turned off: it rounds matmul and convolution inputs to 10-bit mantissas, far outside 1e-4.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

import tandem
from tandem import optim
from tandem.testing.reference import eager_train
from tests.conftest import assert_same_state, assert_same_step, eager_step, twin, zoo_case

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

DEVICE = torch.device("cuda")
TOLERANCE = {torch.float64: dict(rtol=1e-6, atol=1e-9), torch.float32: dict(rtol=1e-4, atol=1e-5)}
REAL = ["gpt2", "llama", "timm_resnet"]  # a decoder LM of each attention style, and a timm CNN
LR, MOMENTUM = 0.1, 0.9


@pytest.fixture(autouse=True)
def _full_float32() -> Iterator[None]:
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def on_device(batch: Any) -> Any:
    return torch.utils._pytree.tree_map(lambda t: t.to(DEVICE) if isinstance(t, torch.Tensor) else t, batch)


def device_zoo_case(name: str, dtype: torch.dtype) -> tuple[nn.Module, Any, tuple[Any, ...]]:
    module, loss_fn, batch = zoo_case(name, dtype)
    return module.to(DEVICE), loss_fn, on_device(batch)


def device_real_case(name: str) -> tuple[nn.Module, Any, tuple[Any, ...]]:
    from tandem.testing.real_models import REAL_MODELS
    from tandem.testing.torchvision_compat import ensure_importable

    ensure_importable()
    entry = REAL_MODELS[name]
    pytest.importorskip(entry.library)
    module = entry.build(0).to(DEVICE)
    return module, entry.loss_fn, on_device(entry.make_batch(3, torch.Generator().manual_seed(0), torch.float32))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
def test_zoo_step_matches_eager_on_cuda(zoo_name: str, dtype: torch.dtype) -> None:
    module, loss_fn, batch = device_zoo_case(zoo_name, dtype)
    reference = twin(module)
    step = tandem.compile(module, loss_fn, *batch)
    torch.manual_seed(7)  # seeds the CUDA generator too: dropout draws the same masks in both
    result = step(*batch)
    eager_loss, eager_grads = eager_step(reference, loss_fn, batch, seed=7)
    assert all(grad.device.type == "cuda" for grad in result.grads.values())
    assert_same_step(result, eager_loss, eager_grads, **TOLERANCE[dtype])
    assert_same_state(module, reference, **TOLERANCE[dtype], device_type="cuda")  # BatchNorm's running stats


@pytest.mark.parametrize("name", REAL)
def test_library_model_step_matches_eager_on_cuda(name: str) -> None:
    module, loss_fn, batch = device_real_case(name)
    reference = twin(module)
    result = tandem.compile(module, loss_fn, *batch)(*batch)
    eager_loss, eager_grads = eager_step(reference, loss_fn, batch)
    assert_same_step(result, eager_loss, eager_grads, **TOLERANCE[torch.float32])


def test_inductor_trainer_matches_eager_on_cuda(zoo_name: str) -> None:
    module, loss_fn, batch = device_zoo_case(zoo_name, torch.float32)
    reference = copy.deepcopy(module)
    trainer = tandem.Trainer(module, loss_fn, optim.SGD(lr=LR, momentum=MOMENTUM), backend="inductor", progress=False)
    torch.manual_seed(5)
    losses = [trainer.step(*batch) for _ in range(10)]
    assert trainer.train_step.compile_report()["fallbacks"] == {}, "every segment compiled"
    torch.manual_seed(5)
    expected = eager_train(reference, loss_fn, batch, torch.optim.SGD(reference.parameters(), lr=LR, momentum=MOMENTUM), 10)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), **TOLERANCE[torch.float32])
    assert_same_state(module, reference, **TOLERANCE[torch.float32], device_type="cuda")


@pytest.mark.parametrize("backend", ["aten", "inductor"])
def test_peak_bytes_measured_on_the_device(backend: str) -> None:
    module, loss_fn, batch = device_zoo_case("gpt", torch.float32)
    reports = {}
    for mirror in ("off", "memory-aware"):
        step = tandem.compile(module, loss_fn, *batch, backend=backend, mirror=mirror)
        step(*batch)  # the first step is measured (and, for inductor, compiles)
        reports[mirror] = step.memory_report()
    off = reports["off"]
    gradient_bytes = sum(p.numel() * p.element_size() for p in module.parameters())  # a floor: the gradients alone
    assert off["peak_bytes"] >= gradient_bytes, off
    assert off["allocator_peak_bytes"] is not None and off["allocator_peak_bytes"] >= gradient_bytes, off
    assert reports["memory-aware"]["peak_bytes"] <= off["peak_bytes"], reports


def test_trainer_with_local_kvstore_matches_torch_optim_on_cuda() -> None:
    module, loss_fn, batch = device_zoo_case("resnet", torch.float64)
    reference = copy.deepcopy(module)
    trainer = tandem.Trainer(module, loss_fn, optim.AdamW(lr=1e-3, weight_decay=1e-2), kvstore="local", progress=False)
    try:
        for _ in range(3):
            trainer.step(*batch)
    finally:
        trainer.close()
    eager_train(reference, loss_fn, batch, torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=1e-2), 3)
    assert_same_state(module, reference, **TOLERANCE[torch.float64], device_type="cuda")
