"""The capture cache: a step loaded from it runs as the traced one does; its key moves with
everything the trace reads; bad or foreign entries are traced again."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

import tandem
from tandem.graph import capture_cache
from tandem.graph.batch import BatchLayout
from tandem.graph.train_graph import MetaKey, TrainGraph
from tests.conftest import assert_same_step, eager_step, twin, zoo_case

TOLERANCE = dict(rtol=1e-6, atol=1e-9)  # float64: a loaded graph computes what the traced one does


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("TANDEM_CAPTURE_CACHE", "1")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    return tmp_path / "tandem_capture"


def _structure(graph: TrainGraph) -> list[tuple[str, ...]]:
    return [(node.name, node.op, str(node.target), str(node.args), str(node.kwargs),
             str(getattr(node.meta.get("val"), "shape", None)), str(node.meta.get(MetaKey.PHASE)),
             str(node.meta.get(MetaKey.CHECKPOINT)), str(node.meta.get(MetaKey.SEGMENT)))
            for node in graph.graph.nodes]


@pytest.mark.parametrize("name", ["gpt", "resnet", "lstm_lm"])
def test_a_loaded_step_matches_the_traced_step_and_eager(name: str, cache_dir: Path) -> None:
    module, loss_fn, batch = zoo_case(name)
    reference = twin(module)
    traced = tandem.compile(twin(module), loss_fn, *batch)
    assert traced.compile_report()["capture_cache"] == "miss"
    assert len(list(cache_dir.glob("*.pkl"))) == 1
    loaded = tandem.compile(module, loss_fn, *batch)
    assert loaded.compile_report()["capture_cache"] == "hit"
    assert _structure(loaded.graph) == _structure(traced.graph)  # same nodes, same plan
    assert loaded.graph.notes.keys() == traced.graph.notes.keys()
    for _ in range(2):  # BatchNorm's buffer updates written back as well
        torch.manual_seed(3)
        result = loaded(*batch)
        eager_loss, eager_grads = eager_step(reference, loss_fn, batch, seed=3)
        assert_same_step(result, eager_loss, eager_grads, **TOLERANCE)
    for (buffer_name, buffer), (_, expected) in zip(module.named_buffers(), reference.named_buffers()):
        torch.testing.assert_close(buffer, expected, **TOLERANCE, msg=buffer_name)


def test_a_library_model_with_tied_weights_loads(cache_dir: Path) -> None:
    pytest.importorskip("transformers")
    entry = tandem.models.LIBRARY["hf-gpt2"]
    torch.manual_seed(0)
    module = entry.build()
    tokens = torch.randint(0, 256, (2, 16))
    batch = ({"input_ids": tokens, "labels": tokens},)  # what a causal-LM collator gives
    reference = twin(module)
    assert tandem.compile(twin(module), entry.loss_fn, *batch).compile_report()["capture_cache"] == "miss"
    loaded = tandem.compile(module, entry.loss_fn, *batch)
    assert loaded.compile_report()["capture_cache"] == "hit"
    assert loaded.graph.aliases == {"lm_head.weight": "transformer.wte.weight"}
    result = loaded(*batch)
    eager_loss, eager_grads = eager_step(reference, entry.loss_fn, batch)
    assert_same_step(result, eager_loss, eager_grads, rtol=1e-4, atol=1e-5)


def test_a_new_process_loads_what_another_stored(cache_dir: Path) -> None:
    script = textwrap.dedent("""
        import json, torch
        import tandem
        from tests.conftest import zoo_case
        from tests.graph.test_capture_cache import Recurrent, recurrent_loss
        torch.set_num_threads(1)
        results = {}
        cases = {name: zoo_case(name) for name in ("gpt", "resnet")}
        torch.manual_seed(0)
        cases["recurrent"] = (Recurrent().double(), recurrent_loss, (torch.randn(2, 3, 4, dtype=torch.float64),))
        for name, (module, loss_fn, batch) in cases.items():
            step = tandem.compile(module, loss_fn, *batch)
            torch.manual_seed(5)
            result = step(*batch)
            results[name] = [step.compile_report()["capture_cache"], result.loss.item(),
                             sum(g.double().sum().item() for g in result.grads.values())]
        print(json.dumps(results))
    """)
    runs = []
    for seed in ("1", "2"):  # string hashing differs between the processes, as it does between runs
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=300,
                              env={**os.environ, "PYTHONHASHSEED": seed})
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    for name in ("gpt", "resnet", "recurrent"):
        (first_cache, *first), (second_cache, *second) = runs[0][name], runs[1][name]
        assert (first_cache, second_cache) == ("miss", "hit"), name
        assert first == second, name  # float64, the same graph: bit for bit


class Recurrent(nn.Module):
    """nn.LSTM keeps plain (and weak) references to its own parameters; ``act`` is a builtin."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm, self.act = nn.LSTM(4, 4, batch_first=True), torch.tanh

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.lstm(x)[0])


def recurrent_loss(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return module(x).square().mean()


def _key(module: nn.Module, loss_fn: object, batch: tuple[torch.Tensor, ...], **options: bool) -> str | None:
    return capture_cache.key(module, loss_fn, BatchLayout.of(batch)[0],  # type: ignore[arg-type]
                             {"checkpoint_regions": True, **options})


def test_the_key_moves_with_what_the_trace_reads() -> None:
    module, loss_fn, batch = zoo_case("gpt")
    base = _key(module, loss_fn, batch)
    assert base is not None and _key(twin(module), loss_fn, batch) == base
    with torch.no_grad():
        next(module.parameters()).add_(1.0)
    assert _key(module, loss_fn, batch) == base  # values: the trace runs on fake tensors, never reads them
    assert _key(module, loss_fn, tuple(t[:2] for t in batch)) != base  # batch shapes
    assert _key(module, loss_fn, batch, checkpoint_regions=False) != base  # capture options
    assert _key(module, lambda m, x, y: loss_fn(m, x, y) * 2, batch) != base  # the loss function
    module.eval()
    assert _key(module, loss_fn, batch) != base  # dropout's training flag
    module.train()
    dropout = next(m for m in module.modules() if isinstance(m, nn.Dropout))
    probability, dropout.p = dropout.p, dropout.p + 0.25
    assert _key(module, loss_fn, batch) != base  # a module's attribute
    dropout.p = probability
    assert _key(module, loss_fn, batch) == base
    assert _key(module, lambda m, x, y: loss_fn(m, x.relu(), y), batch) != \
        _key(module, lambda m, x, y: loss_fn(m, x.tanh(), y), batch)  # same bytecode, other names
    handle = module.register_forward_hook(lambda *_: None)
    assert _key(module, loss_fn, batch) is None  # hooks are code the key cannot name: not cached
    handle.remove()


LABEL_SCALE = 1.0  # a module-level setting a loss function reads


class LossHolder:
    def __init__(self, scale: float) -> None:
        self.scale = scale

    def loss(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return recurrent_loss(module, x) * self.scale * LABEL_SCALE


def test_the_key_moves_with_state_outside_the_module(monkeypatch: pytest.MonkeyPatch) -> None:
    module, batch = Recurrent(), (torch.ones(2, 3, 4),)
    base = _key(module, LossHolder(1.0).loss, batch)
    assert _key(module, LossHolder(1.0).loss, batch) == base
    assert _key(module, LossHolder(2.0).loss, batch) != base  # the object a bound method is bound to
    monkeypatch.setattr(sys.modules[__name__], "LABEL_SCALE", 3.0)
    assert _key(module, LossHolder(1.0).loss, batch) != base  # a global setting the code reads
    monkeypatch.undo()
    monkeypatch.setattr(Recurrent, "flag", True, raising=False)
    assert _key(module, LossHolder(1.0).loss, batch) != base  # a class attribute
    monkeypatch.undo()
    with torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.MATH]):
        assert _key(module, LossHolder(1.0).loss, batch) != base  # which attention kernels may be traced
    loss_module = nn.Linear(4, 1)
    with_module_loss = _key(module, loss_module, batch)
    loss_module.weight.requires_grad_(False)
    assert _key(module, loss_module, batch) != with_module_loss  # a module loss is traced with the step


def test_the_key_moves_with_parameter_strides() -> None:
    module = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten())
    batch = (torch.ones(2, 3, 5, 5),)

    def loss_fn(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return model(x).sum()

    base = _key(module, loss_fn, batch)
    assert _key(module.to(memory_format=torch.channels_last), loss_fn, batch) != base


def test_the_key_moves_with_the_attention_implementation() -> None:
    pytest.importorskip("transformers")
    module = tandem.models.LIBRARY["hf-llama"].build()
    tokens = torch.zeros(2, 8, dtype=torch.long)
    batch = ({"input_ids": tokens, "labels": tokens},)
    base = _key(module, tandem.models.LIBRARY["hf-llama"].loss_fn, batch)
    module.config._attn_implementation = "eager"  # one attention class serves every implementation
    assert _key(module, tandem.models.LIBRARY["hf-llama"].loss_fn, batch) != base


def test_the_key_moves_with_a_monkeypatched_method(monkeypatch: pytest.MonkeyPatch) -> None:
    from tandem.models.gpt import FeedForward

    module, loss_fn, batch = zoo_case("gpt")
    base = _key(module, loss_fn, batch)
    original = FeedForward.forward
    monkeypatch.setattr(FeedForward, "forward", lambda self, x: original(self, x) * 2)  # the file is unchanged
    assert _key(module, loss_fn, batch) != base


def test_the_key_moves_with_a_constant_tensor_and_ties() -> None:
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first, self.second = nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False)
            self.scale = torch.ones(4)  # a plain attribute: the trace bakes its value in
            self.temperature = torch.tensor(2.0)  # 0-dim, too

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.second(self.first(x) * self.scale) / self.temperature

    def loss_fn(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return module(x).sum()

    module, batch = Scaled(), (torch.ones(2, 4),)
    base = _key(module, loss_fn, batch)
    module.scale = torch.full((4,), 2.0)
    assert _key(module, loss_fn, batch) != base
    module.scale = torch.ones(4)
    assert _key(module, loss_fn, batch) == base
    module.temperature = torch.tensor(3.0)
    assert _key(module, loss_fn, batch) != base
    module.temperature = torch.tensor(2.0)
    module.second.weight = module.first.weight  # tied: one gradient, one placeholder name
    assert _key(module, loss_fn, batch) != base


def test_the_key_moves_with_the_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = tmp_path / "cache_key_model.py"
    body = "import torch\nclass Model(torch.nn.Module):\n    def __init__(self):\n        super().__init__()\n" \
           "        self.linear = torch.nn.Linear(3, 3)\n    def forward(self, x):\n        return {}\n"
    source.write_text(body.format("self.linear(x).relu()"))
    monkeypatch.syspath_prepend(str(tmp_path))
    model_module = importlib.import_module("cache_key_model")

    def loss_fn(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return module(x).sum()

    batch = (torch.ones(2, 3),)
    before = _key(model_module.Model(), loss_fn, batch)
    source.write_text(body.format("self.linear(x).tanh()"))
    model_module = importlib.reload(model_module)
    assert _key(model_module.Model(), loss_fn, batch) != before
    sys.modules.pop("cache_key_model")


def test_broken_and_foreign_entries_are_traced_again(cache_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    module, loss_fn, batch = zoo_case("mlp")
    tandem.compile(twin(module), loss_fn, *batch)
    (entry,) = cache_dir.glob("*.pkl")
    entry.write_bytes(b"not a pickle")
    step = tandem.compile(twin(module), loss_fn, *batch)
    assert step.compile_report()["capture_cache"] == "miss"  # traced, and stored again whole
    assert "ignoring the capture cache entry" in caplog.text
    assert tandem.compile(twin(module), loss_fn, *batch).compile_report()["capture_cache"] == "hit"
    cache_dir.chmod(0o777)  # others may write here: its pickles are not loaded, nothing is stored
    caplog.clear()
    assert tandem.compile(twin(module), loss_fn, *batch).compile_report()["capture_cache"] == "bypass"
    assert "writable by no one else" in caplog.text
    cache_dir.chmod(0o700)


def test_a_cache_directory_that_cannot_be_made_is_a_bypass(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("TANDEM_CAPTURE_CACHE", "1")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(blocker))
    module, loss_fn, batch = zoo_case("mlp")
    result = tandem.compile(module, loss_fn, *batch)
    assert result.compile_report()["capture_cache"] == "bypass"  # traced; nothing raised


def test_an_entry_of_another_model_under_the_key_is_refused(cache_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    module, loss_fn, batch = zoo_case("mlp")
    tandem.compile(twin(module), loss_fn, *batch)
    (entry,) = cache_dir.glob("*.pkl")
    stored_key = capture_cache.key(module, loss_fn, BatchLayout.of(batch)[0], {"checkpoint_regions": True})
    assert stored_key is not None and entry.stem == stored_key
    first = next(module.parameters())  # the entry's shapes no longer fit this model: as a key collision would
    first.data = torch.zeros(first.shape[0] + 1, *first.shape[1:], dtype=first.dtype)
    assert capture_cache.load(stored_key, module, loss_fn, BatchLayout.of(batch)[0]) is None
    assert "the model's" in caplog.text
    assert not entry.exists()


def test_off_traces_and_stores_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_CAPTURE_CACHE", "0")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    module, loss_fn, batch = zoo_case("mlp")
    assert tandem.compile(module, loss_fn, *batch).compile_report()["capture_cache"] == "off"
    assert not (tmp_path / "tandem_capture").exists()
