"""Bulked graph execution: segment structure, knobs, and results identical to the unbulked executor."""

from __future__ import annotations

import operator

import pytest
import torch

import tandem
from tandem.engine import NaiveEngine, ThreadedEngine, set_engine
from tandem.graph.train_graph import MetaKey, Phase
from tandem.passes.segments import WHOLE, resolve_caps
from tests.conftest import zoo_case


def _segments(step: tandem.TrainStep) -> list[list]:
    by_segment: dict[int, list] = {}
    for node in step.graph.op_nodes():
        by_segment.setdefault(node.meta[MetaKey.SEGMENT], []).append(node)
    return [by_segment[k] for k in sorted(by_segment)]


@pytest.mark.parametrize("cap", [1, 2, 15, WHOLE])
def test_bulked_results_identical_to_unbulked(zoo_name: str, cap: int) -> None:
    module, loss_fn, batch = zoo_case(zoo_name, torch.float32)
    unbulked = tandem.compile(module, loss_fn, *batch, bulk=False)
    bulked = tandem.compile(module, loss_fn, *batch, bulk_fwd=cap, bulk_bwd=cap)
    for step in (unbulked, bulked):
        step(*batch)  # the first step is the measured one; compare the engine path after it
    torch.manual_seed(3)
    expected = unbulked(*batch)
    torch.manual_seed(3)
    result = bulked(*batch)
    assert torch.equal(result.loss, expected.loss)
    for name, grad in expected.grads.items():
        assert torch.equal(result.grads[name], grad), name
    assert bulked.executor.last_report.engine_ops == len(_segments(bulked))


def test_segments_respect_caps_and_phases() -> None:
    module, loss_fn, batch = zoo_case("lstm_lm", torch.float32)
    step = tandem.compile(module, loss_fn, *batch, bulk_fwd=4, bulk_bwd=9)
    segments = _segments(step)
    for nodes in segments:
        phases = {step.graph.phase_of(n) for n in nodes}
        assert len(phases) == 1, "a segment never spans forward and backward"
        counted = [n for n in nodes if n.target is not operator.getitem]
        assert len(counted) <= (4 if phases == {Phase.FORWARD} else 9)
    counted_sizes = [sum(n.target is not operator.getitem for n in s) for s in segments]
    forward = [size for size, s in zip(counted_sizes, segments) if step.graph.phase_of(s[0]) == Phase.FORWARD]
    assert forward[:-1] == [4] * (len(forward) - 1), "segments fill up: placeholders never cut or count"


def test_whole_graph_is_one_segment_per_phase() -> None:
    module, loss_fn, batch = zoo_case("resnet", torch.float32)
    step = tandem.compile(module, loss_fn, *batch, bulk_fwd=WHOLE, bulk_bwd=WHOLE)
    step(*batch)
    step(*batch)
    assert step.executor.last_report.num_segments == 2


def test_unbulked_is_one_node_per_segment() -> None:
    module, loss_fn, batch = zoo_case("mlp", torch.float32)
    step = tandem.compile(module, loss_fn, *batch, bulk=False)
    assert all(sum(n.target is not operator.getitem for n in s) == 1 for s in _segments(step))


def test_env_knobs_and_explicit_options(monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_caps(None, None, None).forward == 15
    monkeypatch.setenv("TANDEM_BULK_MAX_NODE_TRAIN", "7")
    monkeypatch.setenv("TANDEM_BULK_MAX_NODE_TRAIN_BWD", "3")
    caps = resolve_caps(None, None, None)
    assert (caps.forward, caps.backward) == (7, 3)
    assert resolve_caps(None, 5, None).forward == 5, "explicit options beat env vars"
    monkeypatch.setenv("TANDEM_BULK_TRAIN", "0")
    assert resolve_caps(None, None, None) == resolve_caps(False, 50, 50)
    assert resolve_caps(None, None, None).forward == 1
    monkeypatch.setenv("TANDEM_BULK_TRAIN", "maybe")
    with pytest.raises(ValueError, match="TANDEM_BULK_TRAIN='maybe'"):
        resolve_caps(None, None, None)


def test_step_report_gradient_ready_times_in_backward_order() -> None:
    module, loss_fn, batch = zoo_case("mlp", torch.float32)
    step = tandem.compile(module, loss_fn, *batch, bulk_bwd=1)
    step(*batch)
    seen: list[str] = []
    step.add_gradient_hook(lambda name, grad: seen.append(name))
    step(*batch)
    report = step.executor.last_report
    assert set(report.gradient_ready_s) == set(step.graph.grads) == set(seen)
    ready = sorted(report.gradient_ready_s, key=report.gradient_ready_s.get)
    assert ready == seen
    assert ready[-1].startswith("layers.0") or ready[-1] == next(iter(step.graph.grads)), "the first layer's gradient comes last"


def test_a_segment_hook_gets_each_segments_gradients_at_once() -> None:
    module, loss_fn, batch = zoo_case("gpt", torch.float32)
    step = tandem.compile(module, loss_fn, *batch, bulk_bwd=20)
    step(*batch)
    alone: list[str] = []
    together: list[list[tuple[str, torch.Tensor]]] = []
    step.add_gradient_hook(lambda name, grad: alone.append(name))
    step.add_segment_hook(together.append)
    result = step(*batch)
    expected = [segment.gradients for segment in step.executor.segments if segment.gradients]
    assert [[name for name, _ in group] for group in together] == expected  # one call per segment, in order
    assert [name for group in together for name, _ in group] == alone  # the gradient hooks' order
    assert any(len(group) > 1 for group in together), "bulking put several gradients in one segment"
    for name, grad in (pair for group in together for pair in group):
        assert grad is result.grads[name]  # the step's own gradient, not a copy


def test_naive_and_threaded_engines_agree() -> None:
    module, loss_fn, batch = zoo_case("gpt", torch.float32)
    results = []
    for engine in (NaiveEngine(), ThreadedEngine(compute_threads=2)):
        set_engine(engine)
        try:
            step = tandem.compile(module, loss_fn, *batch, bulk_fwd=3, bulk_bwd=3)
            step(*batch)
            torch.manual_seed(5)
            results.append(step(*batch))
        finally:
            set_engine(None)
    assert torch.equal(results[0].loss, results[1].loss)
    for name in results[0].grads:
        assert torch.equal(results[0].grads[name], results[1].grads[name]), name


def test_segments_name_tied_parameters_by_their_first_name() -> None:
    module, loss_fn, batch = zoo_case("lstm_lm", torch.float32)
    step = tandem.compile(module, loss_fn, *batch, bulk_fwd=2, bulk_bwd=2)
    assert step.graph.aliases == {"decoder.weight": "embedding.weight"}
    readers = [s.index for s in step.executor.segments if "embedding.weight" in s.parameters and s.phase == "forward"]
    assert all("decoder.weight" not in s.parameters for s in step.executor.segments)
    assert len(readers) >= 2, "the embedding lookup and the decoder both wait for the tied weight"


def test_a_large_gradient_ends_its_backward_segment() -> None:
    """``bulk_cut_gradient``: the op that finishes a gradient of that many elements ends its segment (the
    getitems picking its other outputs stay with it), so a hook gets it alone, before the layers below;
    the step computes exactly what it computed uncut."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(32, 300), torch.nn.ReLU(), torch.nn.Linear(300, 300), torch.nn.ReLU(),
                                 torch.nn.Linear(300, 8))  # fmt: skip
    batch = (torch.randn(16, 32), torch.randint(0, 8, (16,)))

    def loss_fn(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(model(x), y)

    whole = tandem.compile(module, loss_fn, *batch, bulk_bwd=WHOLE)
    cut = tandem.compile(module, loss_fn, *batch, bulk_bwd=WHOLE, bulk_cut_gradient=90_000)  # only 2.weight (90k)
    sent: list[list[str]] = []
    cut.add_segment_hook(lambda gradients: sent.append([name for name, _ in gradients]))
    expected, result = whole(*batch), cut(*batch)
    assert torch.equal(result.loss, expected.loss)
    for name, grad in expected.grads.items():
        assert torch.equal(result.grads[name], grad), name
    backward = [nodes for nodes in _segments(cut) if cut.graph.phase_of(nodes[0]) == Phase.BACKWARD]
    assert len(backward) == 2 == len([nodes for nodes in _segments(whole) if whole.graph.phase_of(nodes[0]) == Phase.BACKWARD]) + 1
    gradient = cut.graph.grads["2.weight"]
    first = backward[0]
    assert gradient in first and all(node.target is operator.getitem for node in first[first.index(gradient) + 1 :])
    assert "2.weight" in sent[0] and "0.weight" in sent[-1] and "0.weight" not in sent[0]
    with pytest.raises(ValueError, match="bulk_cut_gradient must be an int >= 0"):
        tandem.compile(module, loss_fn, *batch, bulk_cut_gradient=-1)


def test_a_distributed_trainer_cuts_after_large_gradients_unless_told(monkeypatch: pytest.MonkeyPatch) -> None:
    from tandem.passes.config import DISTRIBUTED_GRADIENT_CUT
    from tandem.step import StepConfig
    from tandem.trainer import TrainerConfig

    assert TrainerConfig().step.plan.gradient_cut == 0  # training alone sends nothing
    assert TrainerConfig(kvstore="dist_sync").step.plan.gradient_cut == DISTRIBUTED_GRADIENT_CUT
    assert TrainerConfig(kvstore="dist_sync", communication="baseline").step.plan.gradient_cut == 0  # sent after backward
    assert TrainerConfig(kvstore="collective", step=StepConfig(bulk_cut_gradient=0)).step.plan.gradient_cut == 0
    monkeypatch.setenv("TANDEM_BULK_CUT_GRADIENT", "1000")
    assert TrainerConfig(kvstore="dist_sync").step.plan.gradient_cut == 1000


def test_a_distributed_trainer_keeps_aten_boundaries_under_inductor_only_where_hooks_need_them() -> None:
    from tandem.step import StepConfig
    from tandem.trainer import TrainerConfig

    caps = resolve_caps(None, None, None)
    inductor = StepConfig(backend="inductor")
    for communication in ("overlap", "p3"):  # each gradient leaves as its segment ends: the caps stay
        step = TrainerConfig(kvstore="collective", communication=communication, step=inductor).step
        assert (step.bulk_fwd, step.bulk_bwd) == (caps.forward, caps.backward), communication
    for kind in ("collective", "dist_p3", "dist_sync"):  # "auto": p3 or overlap, never baseline
        step = TrainerConfig(kvstore=kind, step=inductor).step
        assert (step.bulk_fwd, step.bulk_bwd) == (caps.forward, caps.backward), kind
    for kind in ("collective", "dist_sync"):  # exchanged after backward: units merge as alone
        step = TrainerConfig(kvstore=kind, communication="baseline", step=inductor).step
        assert (step.bulk_fwd, step.bulk_bwd) == (None, None), kind
    assert TrainerConfig(step=inductor).step.bulk_fwd is None  # training alone
