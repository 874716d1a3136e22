"""The compiled-unit index: a unit loaded from it computes what the compiled one did; its key moves
with what decides the kernels; a damaged, foreign or stale entry compiles the unit again."""

from __future__ import annotations

import operator
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.fx as fx

import tandem
from tandem.backends import unit_cache
from tests.conftest import assert_same_step, eager_step, twin, zoo_case

RTOL, ATOL = 1e-4, 1e-5  # float32, against eager


@pytest.fixture
def index_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("TANDEM_UNIT_CACHE", "1")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # inductor's entries too: a cold start
    return tmp_path / "tandem_units"


def _compiled(module: torch.nn.Module, loss_fn: Any, batch: tuple[Any, ...]) -> tuple[tandem.TrainStep, list[Any]]:
    step = tandem.compile(module, loss_fn, *batch, backend="inductor")
    results = []
    for seed in range(2):
        torch.manual_seed(seed)
        results.append(step(*batch))
    return step, results


def test_a_later_compile_loads_every_unit_and_computes_the_same(index_dir: Path) -> None:
    module, loss_fn, batch = zoo_case("mlp", torch.float32)
    reference = twin(module)
    first, first_results = _compiled(twin(module), loss_fn, batch)
    units = len(first.executor.segments)
    assert first.compile_report()["units_loaded"] == 0
    assert len(list(index_dir.iterdir())) == units, "each unit indexed once"
    second, second_results = _compiled(module, loss_fn, batch)
    assert second.compile_report()["units_loaded"] == units and second.compile_report()["fallbacks"] == {}
    for ours, theirs in zip(second_results, first_results):  # the same kernels: bit for bit
        torch.testing.assert_close(ours.loss, theirs.loss, rtol=0, atol=0)
        for name, grad in theirs.grads.items():
            torch.testing.assert_close(ours.grads[name], grad, rtol=0, atol=0, msg=name)
    torch.manual_seed(1)
    assert_same_step(second_results[1], *eager_step(reference, loss_fn, batch, seed=1), rtol=RTOL, atol=ATOL)


class _Scaled(torch.nn.Module):
    """A forward that makes a tensor (``torch.tensor``): its unit holds a constant."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * torch.tensor([0.5, 2.0, 1.0, 1.0, 3.0, 1.0])


def test_a_unit_holding_a_tensor_constant_is_compiled_each_time_and_the_rest_load(index_dir: Path) -> None:
    module, batch = _Scaled(), (torch.randn(4, 6),)

    def loss_fn(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        return model(x).square().mean()

    reference = twin(module)
    first, _ = _compiled(twin(module), loss_fn, batch)
    holding = [s for s in first.executor.segments if any(n.op == "get_attr" for n in s.function._graph()[0].nodes)]
    assert holding and len(holding) < len(first.executor.segments), "the forward holds the constant"
    second, results = _compiled(module, loss_fn, batch)
    assert second.compile_report()["units_loaded"] == len(first.executor.segments) - len(holding)
    torch.manual_seed(1)
    assert_same_step(results[1], *eager_step(reference, loss_fn, batch, seed=1), rtol=RTOL, atol=ATOL)


def test_damaged_untrusted_or_stale_entries_compile_again(index_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    module, loss_fn, batch = zoo_case("mlp", torch.float32)
    expected = eager_step(twin(module), loss_fn, batch)

    def compile_again() -> int:
        step = tandem.compile(module, loss_fn, *batch, backend="inductor")
        assert_same_step(step(*batch), *expected, rtol=RTOL, atol=ATOL)
        assert step.compile_report()["fallbacks"] == {}
        return int(step.compile_report()["units_loaded"])

    _compiled(twin(module), loss_fn, batch)
    first, second = sorted(index_dir.iterdir())
    first.write_bytes(b"not an inductor key\n")  # damaged
    second.chmod(0o664)  # writable by the group: not trusted
    assert compile_again() == 0, "both compiled again (and indexed anew)"
    assert "names no inductor entry" in caplog.text and "writable by no one else" in caplog.text
    first.write_bytes(b"f" * 40)  # names an entry inductor does not hold (its cache emptied, say)
    assert compile_again() == 1, "the other unit loads"


# -- the key (no compiling) -----------------------------------------------------------------------


def _unit(alpha: float = 1.0, constant: torch.Tensor | None = None) -> fx.Graph:
    graph, holder = fx.Graph(), torch.nn.Module()
    inputs = graph.placeholder("inputs")
    x, y = (graph.call_function(operator.getitem, (inputs, k)) for k in range(2))
    total = graph.call_function(torch.ops.aten.add.Tensor, (x, y), {"alpha": alpha})
    if constant is not None:  # as InductorSegment writes a tensor the model made
        holder.register_buffer("_tensor_constant0", constant)
        total = graph.call_function(torch.ops.aten.mul.Tensor, (total, graph.get_attr("_tensor_constant0")))
    graph.output((total,))
    return graph


def test_the_key_moves_with_what_decides_the_kernels() -> None:
    x, y = torch.randn(4, 6), torch.randn(4, 6)
    options = {"fallback_random": True, "cpp_wrapper": False}
    base = unit_cache.key(_unit(), [x, y], options)
    assert base is not None and base == unit_cache.key(_unit(), [x.clone(), y.clone()], options), "values do not count"
    assert unit_cache.key(_unit(alpha=2.0), [x, y], options) != base, "an argument"
    assert unit_cache.key(_unit(alpha=1), [x, y], options) != base, "1 is not 1.0"
    assert unit_cache.key(_unit(), [x.t().contiguous().t(), y], options) != base, "a stride"
    assert unit_cache.key(_unit(), [x, y.double()], options) != base, "a dtype"
    assert unit_cache.key(_unit(), [x, x], options) != unit_cache.key(_unit(), [x, x.clone()], options), "aliasing"
    assert unit_cache.key(_unit(), [x, y], {**options, "cpp_wrapper": True}) != base, "an option"
    assert unit_cache.key(_unit(), [x, torch.randn(25)[1:].view(4, 6)], options) != base, "a storage offset"
    assert unit_cache.key(_unit(), [x, y.clone().requires_grad_()], options) != base, "requires_grad"
    with torch._inductor.config.patch(max_fusion_size=7):
        assert unit_cache.key(_unit(), [x, y], options) != base, "inductor's configuration"
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        assert unit_cache.key(_unit(), [x, y], options) != base, "the kernels' thread count"
    finally:
        torch.set_num_threads(threads)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # a factory op without a dtype makes float64 now
    try:
        assert unit_cache.key(_unit(), [x, y], options) != base, "the default dtype"
    finally:
        torch.set_default_dtype(default)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert unit_cache.key(_unit(), [x, y], options) != base, "autocast"
    assert unit_cache.key(_unit(), [x, y], options) == base


def test_the_key_is_the_same_in_another_process() -> None:
    """Nothing salted per process (string hashes, object ids) reaches the key."""
    script = textwrap.dedent("""
        import torch
        torch.set_num_threads(1)
        from tests.graph.test_unit_cache import _unit
        from tandem.backends import unit_cache
        print(unit_cache.key(_unit(), [torch.zeros(4, 6), torch.zeros(4, 6)], {"fallback_random": True}))
    """)
    keys = {subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=120,
                           cwd=Path(__file__).resolve().parents[2], env={**os.environ, "PYTHONHASHSEED": seed}
                           ).stdout.strip() for seed in ("1", "2")}
    assert len(keys) == 1 and len(next(iter(keys))) == 64, keys


def test_what_the_key_cannot_describe_or_load_is_not_indexed() -> None:
    x = torch.randn(3)
    graph = _unit()
    (add,) = [n for n in graph.nodes if n.target is torch.ops.aten.add.Tensor]
    add.kwargs = {"alpha": object()}
    assert unit_cache.key(graph, [x, x], {}) is None, "an argument without a stable description"
    with torch._inductor.config.patch(post_grad_custom_post_pass=lambda graph: None):
        assert unit_cache.key(_unit(), [x, x], {}) is None, "a custom pass"
    assert unit_cache.key(_unit(constant=torch.ones(3)), [x, x], {}) is None, "a tensor constant"
    assert unit_cache.key(_unit(), [x.to_sparse(), x], {}) is None, "an input it cannot read (no storage)"
