"""tandem.compile: structure of the captured graph and its numbers against eager autograd."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tandem
from tandem.errors import BatchMismatchError, CaptureError
from tandem.graph.train_graph import MetaKey, Phase
from tests.conftest import assert_same_step, eager_step, twin, zoo_case

TOLERANCE = {torch.float64: dict(rtol=1e-6, atol=1e-9), torch.float32: dict(rtol=1e-4, atol=1e-5)}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_zoo_matches_eager_autograd(zoo_name: str, dtype: torch.dtype) -> None:
    module, loss_fn, batch = zoo_case(zoo_name, dtype)
    reference = twin(module)
    step = tandem.compile(module, loss_fn, *batch)
    torch.manual_seed(7)  # same seed: dropout draws the same masks in both
    result = step(*batch)
    eager_loss, eager_grads = eager_step(reference, loss_fn, batch, seed=7)
    assert_same_step(result, eager_loss, eager_grads, **TOLERANCE[dtype])
    for (name, buffer), (_, expected) in zip(module.named_buffers(), reference.named_buffers()):
        torch.testing.assert_close(buffer, expected, rtol=1e-6, atol=1e-9, msg=name)


def test_batchnorm_stats_follow_eager_over_steps() -> None:
    module, loss_fn, batch = zoo_case("resnet")
    reference = twin(module)
    step = tandem.compile(module, loss_fn, *batch)
    for _ in range(3):
        step(*batch)
        eager_step(reference, loss_fn, batch)
    stats = dict(module.named_buffers())
    for name, expected in reference.named_buffers():
        torch.testing.assert_close(stats[name], expected, rtol=1e-6, atol=1e-9, msg=name)
    assert any(name.endswith("num_batches_tracked") and int(v) == 3 for name, v in stats.items())


def test_dropout_zero_matches_without_seed() -> None:
    from tandem.models import ZOO

    entry = ZOO["gpt"]
    torch.manual_seed(0)
    module = entry.build(**{**entry.tiny, "dropout": 0.0}).double()
    batch = entry.make_batch(3, torch.Generator().manual_seed(1), dtype=torch.float64, **entry.tiny)
    reference = twin(module)
    result = tandem.compile(module, entry.loss_fn, *batch)(*batch)
    assert_same_step(result, *eager_step(reference, entry.loss_fn, batch), **TOLERANCE[torch.float64])


def test_graph_structure() -> None:
    module, loss_fn, batch = zoo_case("mlp")
    graph = tandem.compile(module, loss_fn, *batch).graph
    assert graph.param_names == [n for n, _ in module.named_parameters()]
    assert list(graph.grads) == graph.param_names
    phases = [graph.phase_of(n) for n in graph.op_nodes()]
    assert phases == sorted(phases, key=lambda p: p == Phase.BACKWARD), "forward nodes come first"
    assert all(n.target is not torch.ops.aten.detach.default for n in graph.op_nodes())
    assert graph.phase_of(graph.loss) == Phase.FORWARD
    assert all(graph.phase_of(g) == Phase.BACKWARD for g in graph.grads.values())
    assert all(MetaKey.SEGMENT not in n.meta or isinstance(n.meta[MetaKey.SEGMENT], int) for n in graph.op_nodes())


@pytest.mark.parametrize("name", ["resnet", "gpt"])  # BatchNorm buffers updated; tied parameters
def test_joint_export_is_aot_export_modules_graph(name: str) -> None:
    """tandem's one-trace joint export returns what aot_export_module returns: the same signature,
    output for output, and the same outputs on the same inputs."""
    from torch._functorch.aot_autograd import aot_export_module

    from tandem.graph import capture as capture_module
    from tandem.graph.joint import export_joint

    module, loss_fn, batch = zoo_case(name)
    layout, tensors = capture_module._check_arguments(module, loss_fn, batch)
    wrapper = capture_module._LossModule(module, loss_fn, layout)
    with capture_module._tracing(wrapper, tensors):
        ours = export_joint(wrapper, tuple(tensors))
        theirs = aot_export_module(wrapper, tuple(tensors), trace_joint=True, output_loss_index=0)

    def by_position(graph_module: torch.fx.GraphModule, signature: object) -> dict[str, object]:
        nodes = list(graph_module.graph.nodes)
        inputs = [n.name for n in nodes if n.op == "placeholder"]
        outputs = [n.name for n in nodes[-1].args[0]]
        backward = signature.backward_signature  # type: ignore[attr-defined]
        return {
            "parameters": [signature.inputs_to_parameters.get(n) for n in inputs],  # type: ignore[attr-defined]
            "buffers": [signature.inputs_to_buffers.get(n) for n in inputs],  # type: ignore[attr-defined]
            "user outputs": [outputs.index(n) for n in signature.user_outputs],  # type: ignore[attr-defined]
            "mutated buffers": {outputs.index(n): b for n, b in signature.buffers_to_mutate.items()},  # type: ignore[attr-defined]
            "gradients": {outputs.index(n): p for n, p in backward.gradients_to_parameters.items()},
        }

    assert by_position(*ours) == by_position(*theirs)
    state = [*dict(wrapper.named_parameters(remove_duplicate=False)).values(),
             *dict(wrapper.named_buffers(remove_duplicate=False)).values()]
    values = [t.detach().clone() for t in (*state, *tensors)]
    results = []
    for graph_module, _ in (ours, theirs):
        torch.manual_seed(0)
        results.append(graph_module(*[v.clone() for v in values]))
    assert len(results[0]) == len(results[1])
    for position, (mine, expected) in enumerate(zip(*results)):
        torch.testing.assert_close(mine, expected, rtol=0, atol=0, msg=f"output {position}")


def test_tied_parameter_appears_once_under_first_name() -> None:
    module, loss_fn, batch = zoo_case("lstm_lm")
    names = [n for n, _ in module.named_parameters()]
    result = tandem.compile(module, loss_fn, *batch)(*batch)
    assert list(result.grads) == names
    assert len(names) == len({id(p) for p in module.parameters()})


def test_step_reads_parameters_and_layers_replaced_after_capture() -> None:
    # a step reads the module's state from owners found once: a reassigned parameter, a replaced
    # layer are read where they are now, as a walk over the module would find them
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Linear(3, 2))
    module[2].weight = nn.Parameter(torch.randn(2, 3))
    x, y = torch.randn(5, 4), torch.randint(0, 2, (5,))
    step = tandem.compile(module, lambda m, x, y: F.cross_entropy(m(x), y), x, y)
    step(x, y)
    module[0].weight = nn.Parameter(torch.randn(3, 4))  # a new parameter in the same layer
    module[2] = nn.Linear(3, 2)  # a new layer
    result = step(x, y)
    expected = eager_step(module, lambda m, x, y: F.cross_entropy(m(x), y), (x, y))
    torch.testing.assert_close(result.loss, expected[0])
    for name, grad in result.grads.items():
        torch.testing.assert_close(grad, expected[1][name], msg=name)
    module[2].bias = None
    with pytest.raises(KeyError, match="2.bias"):
        step(x, y)
    module[2] = None  # a layer gone: named as the walk names it
    with pytest.raises(KeyError, match="2.weight"):
        step(x, y)


def test_a_replaced_layer_is_freed_though_the_layout_that_read_it_never_runs_again() -> None:
    # a step keeps one state reader per batch layout; one that does not run again must not keep a
    # layer the user replaced (and its parameters) alive
    import gc
    import weakref

    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    loss_fn = lambda m, x, y: F.cross_entropy(m(x), y)  # noqa: E731
    wide, narrow = (torch.randn(5, 4), torch.randint(0, 2, (5,))), (torch.randn(3, 4), torch.randint(0, 2, (3,)))
    step = tandem.compile(module, loss_fn, *wide, recapture=True)
    step(*wide)
    step(*narrow)
    replaced = weakref.ref(module[2])
    module[2] = nn.Linear(3, 2)
    result = step(*narrow)  # the wide layout's reader still points at the old layer's place
    gc.collect()
    assert replaced() is None
    torch.testing.assert_close(result.loss, eager_step(module, loss_fn, narrow)[0])
    torch.testing.assert_close(step(*wide).loss, eager_step(module, loss_fn, wide)[0])  # it follows the new one


def test_capture_leaves_the_programs_garbage_collector_as_it_was() -> None:
    # capture freezes the older objects so that collections skip them, and unfreezes them after;
    # a program's own freeze (before a fork, say) is left alone
    import gc

    module, loss_fn, batch = zoo_case("mlp")
    tandem.compile(module, loss_fn, *batch)(*batch)
    assert gc.get_freeze_count() == 0 and gc.isenabled()
    gc.freeze()
    try:
        tandem.compile(module, loss_fn, *batch)(*batch)
        assert gc.get_freeze_count() > 0, "the program's frozen objects stay frozen"
    finally:
        gc.unfreeze()


def test_unused_parameter_has_no_gradient_like_eager() -> None:
    module = nn.ModuleDict({"used": nn.Linear(4, 2), "unused": nn.Linear(4, 2)})
    x, y = torch.randn(3, 4), torch.randint(0, 2, (3,))
    result = tandem.compile(module, lambda m, x, y: F.cross_entropy(m["used"](x), y), x, y)(x, y)
    assert set(result.grads) == {"used.weight", "used.bias"}
    assert all(p.requires_grad for p in module.parameters()), "capture restores requires_grad"


def test_unused_batch_tensor_that_requires_grad_is_named() -> None:
    module = nn.Linear(4, 2)
    x, y, extra = torch.randn(3, 4), torch.randint(0, 2, (3,)), torch.randn(3, requires_grad=True)
    with pytest.raises(CaptureError, match="batch tensor 2 requires grad but the loss does not depend on it"):
        tandem.compile(module, lambda m, x, y, extra: F.cross_entropy(m(x), y), x, y, extra)


def test_memory_report_is_measured() -> None:
    module, loss_fn, batch = zoo_case("resnet", torch.float32, batch_size=8)
    step = tandem.compile(module, loss_fn, *batch)
    with pytest.raises(RuntimeError, match="one step first"):
        step.memory_report()
    step(*batch)
    report = step.memory_report()
    assert report["num_nodes"] == len(step.graph.op_nodes())
    assert 0 < report["saved_bytes"] <= report["peak_bytes"]
    bigger = tandem.compile(module, loss_fn, *zoo_case("resnet", torch.float32, batch_size=32)[2])
    bigger(*zoo_case("resnet", torch.float32, batch_size=32)[2])
    assert bigger.memory_report()["peak_bytes"] > 2 * report["peak_bytes"], "activations scale with the batch"


def test_new_batch_shape_is_recaptured_or_refused() -> None:
    module, loss_fn, batch = zoo_case("mlp")
    step = tandem.compile(module, loss_fn, *batch)
    small = tuple(t[:2] for t in batch)
    assert step(*small).loss.dim() == 0  # recaptured for the new shape
    strict = tandem.compile(module, loss_fn, *batch, recapture=False)
    with pytest.raises(BatchMismatchError, match=r"differs from the captured batch.*recapture=True"):
        strict(*small)


def test_loss_must_be_scalar() -> None:
    module, _, batch = zoo_case("mlp")
    with pytest.raises(CaptureError, match=r"scalar \(0-dim\) tensor, got shape \[4\]"):
        tandem.compile(module, lambda m, x, y: F.cross_entropy(m(x), y, reduction="none"), *batch)


class _DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(4, 4), _Branchy())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


class _Branchy(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2 if x.sum().item() > 0 else x


def test_uncapturable_op_names_module_path_and_op() -> None:
    module = _DataDependent()
    x = torch.randn(2, 4)
    with pytest.raises(CaptureError, match=r"module 'inner\.1'.*aten\._local_scalar_dense"):
        tandem.compile(module, lambda m, x: m(x).sum(), x)


def test_bad_arguments_are_named() -> None:
    x = torch.randn(2, 4)
    with pytest.raises(TypeError, match="needs a torch.nn.Module"):
        tandem.compile(lambda x: x, lambda m, x: x.sum(), x)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['bulk_size'\]"):
        tandem.compile(nn.Linear(4, 1), lambda m, x: m(x).sum(), x, bulk_size=3)
    with pytest.raises(TypeError, match="neither a tensor nor hashable"):
        tandem.compile(nn.Linear(4, 1), lambda m, x, k: m(x).sum(), x, bytearray(b"3"))
    with pytest.raises(TypeError, match="holds no tensor"):
        tandem.compile(nn.Linear(4, 1), lambda m, k: m(torch.ones(1, 4)).sum(), 3)


def test_capture_leaves_the_rng_stream_alone() -> None:
    module, loss_fn, batch = zoo_case("gpt", torch.float32)
    before = torch.get_rng_state()
    tandem.compile(module, loss_fn, *batch)
    assert torch.equal(before, torch.get_rng_state()), "compile must not draw from the user's RNG"


def test_inference_capture_matches_eager_eval(zoo_name: str) -> None:
    module, loss_fn, batch = zoo_case(zoo_name)
    reference = twin(module).eval()
    step = tandem.compile_eval(module, loss_fn, *batch)
    result = step(*batch)
    with torch.no_grad():
        torch.testing.assert_close(result.loss, loss_fn(reference, *batch), **TOLERANCE[torch.float64])
        torch.testing.assert_close(result.output, reference(*batch[:-1]), **TOLERANCE[torch.float64])
    assert module.training, "capturing in eval mode restores the module's mode"
    assert all(graph_phase == Phase.FORWARD for graph_phase in map(step.graph.phase_of, step.graph.op_nodes()))
    assert len(step.executor.segments) == 1, "inference runs as one segment"


def test_inference_bulking_can_be_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_BULK_INFERENCE", "0")
    module, loss_fn, batch = zoo_case("resnet")
    step = tandem.compile_eval(module, loss_fn, *batch, bulk_fwd=3)
    assert len(step.executor.segments) > 1
