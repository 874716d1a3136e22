"""Conformance: tiny real transformers and timm models, captured by tandem, against eager PyTorch.

For every entry of ``tandem.testing.real_models`` (the architectures the suite names, and more of the
same libraries it does not name):

* the captured step's loss and every gradient equal eager autograd's, in float64 and float32;
* memory-aware mirroring's measured peak is never above mirroring off (and its numbers are the same);
* a few ``tandem.Trainer`` steps give the parameters (and buffers) ``torch.optim`` gives on eager.

An entry whose library (the ``models`` extra: ``pip install -e .[models]``) is not installed is
skipped, so the core suite runs without the extras.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import tandem
from tandem import optim
from tandem.testing.real_models import NAMED, REAL_MODELS, UNNAMED
from tandem.testing.reference import eager_train
from tandem.testing.torchvision_compat import ensure_importable
from tests.conftest import assert_same_state, assert_same_step, eager_step, twin

ensure_importable()  # before pytest.importorskip imports timm or transformers (they import torchvision)

TOLERANCE = {torch.float64: dict(rtol=1e-6, atol=1e-9), torch.float32: dict(rtol=1e-4, atol=1e-5)}
BATCH_SIZE = 3
TRAINER_STEPS = 3
LR, WEIGHT_DECAY = 1e-3, 1e-2

ENTRIES = [pytest.param(entry.name, id=entry.name) for entry in NAMED] + [
    pytest.param(entry.name, id=f"unnamed-{entry.name}") for entry in UNNAMED
]

Batch = tuple[Any, ...]
LossFn = Callable[..., torch.Tensor]


def _case(name: str, dtype: torch.dtype, seed: int = 0) -> tuple[nn.Module, LossFn, Batch]:
    entry = REAL_MODELS[name]
    pytest.importorskip(entry.library)
    module = entry.build(seed).to(dtype)
    batch = entry.make_batch(BATCH_SIZE, torch.Generator().manual_seed(seed), dtype)
    return module, entry.loss_fn, batch


def test_registry_names_the_promised_architectures_and_pads_lm_batches() -> None:
    assert {"gpt2", "llama", "mistral", "t5", "bert", "vit", "timm_resnet", "timm_convnext",
            "timm_efficientnet", "timm_vit"} <= {entry.name for entry in NAMED}
    assert not {entry.name for entry in NAMED} & {entry.name for entry in UNNAMED}
    for entry in NAMED + UNNAMED:
        if entry.kind == "lm":
            (batch,) = entry.make_batch(BATCH_SIZE, torch.Generator().manual_seed(0), torch.float32)
            assert set(batch) == {"input_ids", "attention_mask", "labels"}, entry.name
            assert (batch["attention_mask"] == 0).any() and (batch["attention_mask"][:-1] == 1).all(), entry.name
            assert (batch["labels"] == -100).any(), entry.name


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("name", ENTRIES)
def test_step_matches_eager_autograd(name: str, dtype: torch.dtype) -> None:
    module, loss_fn, batch = _case(name, dtype)
    reference = twin(module)
    result = tandem.compile(module, loss_fn, *batch)(*batch)
    eager_loss, eager_grads = eager_step(reference, loss_fn, batch)
    assert_same_step(result, eager_loss, eager_grads, **TOLERANCE[dtype])
    assert_same_state(module, reference, **TOLERANCE[dtype])  # BatchNorm running stats written back


@pytest.mark.parametrize("name", ENTRIES)
def test_memory_aware_mirroring_never_above_off(name: str) -> None:
    # float64: a recomputed forward value may round differently (BatchNorm replays its normalization
    # from saved statistics), and in float32 a few ill-conditioned gradients (timm MobileNetV3's
    # BatchNorm over 1x1 maps of 3 samples) amplify that past 1e-4; the peaks compare the same.
    module, loss_fn, batch = _case(name, torch.float64)
    results, peaks = {}, {}
    for mirror in ("off", "memory-aware"):
        step = tandem.compile(module, loss_fn, *batch, mirror=mirror)
        results[mirror] = step(*batch)
        peaks[mirror] = step.memory_report()["peak_bytes"]
    assert peaks["memory-aware"] <= peaks["off"], peaks
    off = results["off"]
    assert_same_step(results["memory-aware"], off.loss, off.grads, **TOLERANCE[torch.float64])


@pytest.mark.parametrize("name", ENTRIES)
def test_trainer_matches_torch_optim(name: str) -> None:
    module, loss_fn, batch = _case(name, torch.float64)
    reference = copy.deepcopy(module)
    trainer = tandem.Trainer(module, loss_fn, optim.AdamW(lr=LR, weight_decay=WEIGHT_DECAY))
    try:
        for _ in range(TRAINER_STEPS):
            trainer.step(*batch)
    finally:
        trainer.close()
    torch_optimizer = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    for _ in range(TRAINER_STEPS):
        torch_optimizer.zero_grad()
        loss_fn(reference, *batch).backward()
        torch_optimizer.step()
    assert_same_state(module, reference, **TOLERANCE[torch.float64])



INDUCTOR_STEPS = 10
INDUCTOR_RTOL = 1e-4  # float32, relative to each tensor's norm (AdamW: see below)
NOISE = 1e-7  # a gradient this far below the largest is float32 rounding (a key projection's bias)
TRANSFORMERS = [pytest.param(entry.name, id=entry.name) for entry in NAMED if entry.library == "transformers"]


@pytest.mark.parametrize("name", TRANSFORMERS)
def test_inductor_trainer_matches_torch_optim(name: str) -> None:
    """backend="inductor" (each phase one compiled unit): 10 float32 steps within 1e-4 of eager AdamW.

    The transformers models the suite names only: a cold inductor compile takes seconds per model.
    AdamW divides each gradient by its own running size, so an element whose gradient is small moves
    by ``lr`` whatever rounding its gradient carries: the parameters compare as tensors, by norm. A
    parameter element whose exact gradient is zero (the key bias, alone or as the key third of
    GPT-2's fused ``c_attn.bias``: softmax ignores a shift of every score) moves by eager's rounding
    noise alone; it is held to AdamW's bound, ``lr`` a step, not to eager."""
    module, loss_fn, batch = _case(name, torch.float32)
    reference = copy.deepcopy(module)
    _, first_grads = eager_step(twin(module), loss_fn, batch)
    largest = max(float(g.abs().max()) for g in first_grads.values())
    noise = {n: g.abs() < NOISE * largest for n, g in first_grads.items()}  # elements with a zero exact gradient
    start = {n: p.detach().clone() for n, p in module.named_parameters()}
    trainer = tandem.Trainer(module, loss_fn, optim.AdamW(lr=LR, weight_decay=WEIGHT_DECAY), backend="inductor")
    losses = [trainer.step(*batch) for _ in range(INDUCTOR_STEPS)]
    assert trainer.train_step.compile_report()["fallbacks"] == {}
    torch_optimizer = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    expected = eager_train(reference, loss_fn, batch, torch_optimizer, INDUCTOR_STEPS)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), **TOLERANCE[torch.float32])
    ours = module.state_dict()
    for key, value in reference.state_dict().items():
        zero = noise.get(key, torch.zeros_like(value, dtype=torch.bool))
        if zero.any():
            moved = float((ours[key] - start[key])[zero].abs().max())
            assert moved <= 1.01 * LR * INDUCTOR_STEPS + 1e-6, (key, moved)
        if zero.all():
            continue
        kept = ~zero
        error = float((ours[key] - value)[kept].norm()) / max(float(value[kept].norm()), 1e-12)
        assert error <= INDUCTOR_RTOL, (key, error)


_CACHED_STEPS = """
import json, torch
from tandem.testing.torchvision_compat import ensure_importable
ensure_importable()
import tandem
from tandem.testing.real_models import REAL_MODELS
torch.set_num_threads(1)
results = {}
for name, entry in REAL_MODELS.items():
    module = entry.build(0).to(torch.float64)
    batch = entry.make_batch(3, torch.Generator().manual_seed(0), torch.float64)
    step = tandem.compile(module, entry.loss_fn, *batch)
    torch.manual_seed(5)
    result = step(*batch)
    results[name] = [step.compile_report()["capture_cache"], result.loss.item(),
                     [result.grads[n].sum().item() for n in sorted(result.grads)]]
print(json.dumps(results))
"""


def test_a_second_process_loads_every_model_from_the_capture_cache(tmp_path: Any) -> None:
    """Each real model captured in one process is loaded in the next (another string-hash seed) and
    computes bit for bit what the traced step computed: the cache key is stable across processes for
    every architecture, and a loaded graph is the traced one."""
    import json
    import os
    import subprocess
    import sys

    pytest.importorskip("transformers")
    pytest.importorskip("timm")
    environment = {**os.environ, "TANDEM_CAPTURE_CACHE": "1", "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}
    runs = []
    for seed in ("1", "2"):
        done = subprocess.run([sys.executable, "-c", _CACHED_STEPS], capture_output=True, text=True, timeout=600,
                              check=True, env={**environment, "PYTHONHASHSEED": seed})
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    assert set(runs[0]) == set(REAL_MODELS)
    for name, (first_cache, *first) in runs[0].items():
        second_cache, *second = runs[1][name]
        assert (first_cache, second_cache) == ("miss", "hit"), name
        assert first == second, name
