"""backend="inductor": each planned segment compiled by PyTorch's inductor (issue #28).

* numerics: 10 ``Trainer`` steps of every zoo model equal eager ``torch.optim`` within float32
  tolerance (dropout draws eager's numbers: the backend keeps inductor's ``fallback_random``);
* structure: a phase is one compiled segment without caps and recomputation, the aten boundaries
  with caps, recompute runs cut the backward, a gradient hook fires once per gradient per step,
  the first (compiling) step included, and a small bool mask crosses units as float32;
* memory: ``peak_bytes`` is measured (profiler allocation events), near the aten backend's, and
  mirroring lowers it;
* bad input: a segment inductor cannot lower runs its aten code, with one warning naming the op.

Compiling is the slow part (seconds per segment, cold): the tests keep to the tiny zoo configs and
few segments.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterator

import pytest
import torch
from torch import nn

import tandem
from tandem import optim
from tandem.backends.inductor import InductorSegment, on_x86
from tandem.graph.train_graph import Phase
from tandem.testing.reference import eager_train
from tandem.trainer import TrainerConfig
from tests.conftest import assert_same_step, eager_step, twin, zoo_case

STEPS = 10
RTOL, ATOL = 1e-4, 1e-5  # float32: the conformance suite's tolerance
LR, MOMENTUM = 0.1, 0.9


def _segment_nodes(step: tandem.TrainStep) -> list[tuple[str, list[str]]]:
    return [(s.phase, [i.node.name for i in s.instructions]) for s in step.executor.segments]


# -- numerics --------------------------------------------------------------------------------


def test_ten_trainer_steps_match_eager(zoo_name: str) -> None:
    module, loss_fn, batch = zoo_case(zoo_name, torch.float32)
    reference = copy.deepcopy(module)
    trainer = tandem.Trainer(module, loss_fn, optim.SGD(lr=LR, momentum=MOMENTUM), backend="inductor", progress=False)
    torch.manual_seed(5)  # gpt's dropout: both sides draw the same masks from the same generator
    losses = [trainer.step(*batch) for _ in range(STEPS)]
    assert trainer.train_step.compile_report()["fallbacks"] == {}, "every segment compiled"

    torch.manual_seed(5)
    expected = eager_train(reference, loss_fn, batch, torch.optim.SGD(reference.parameters(), lr=LR, momentum=MOMENTUM),
                           STEPS)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=RTOL, atol=ATOL)
    ours = module.state_dict()
    for name, value in reference.state_dict().items():  # parameters, and BatchNorm's running stats
        torch.testing.assert_close(ours[name], value, rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"{n}: {m}")


def test_the_cpp_wrapper_matches_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    """TANDEM_INDUCTOR_CPP_WRAPPER: every segment is compiled with inductor's C++ wrapper (one C++ call
    that releases the GIL), dropout still draws eager's masks, and 10 steps still equal eager's."""
    monkeypatch.setenv("TANDEM_INDUCTOR_CPP_WRAPPER", "1")
    patches: list[dict[str, object]] = []
    compile_segment = torch._inductor.standalone_compile

    def recording(*args: object, **kwargs: object) -> object:  # torch's compile, called through
        patches.append(dict(kwargs["options"]["config_patches"]))  # type: ignore[index]
        return compile_segment(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(torch._inductor, "standalone_compile", recording)
    test_ten_trainer_steps_match_eager("gpt")
    assert patches and all(p.get("cpp_wrapper") is True for p in patches), patches


def test_a_segment_the_cpp_wrapper_cannot_compile_uses_the_python_wrapper(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where inductor's C++ wrapper fails (no lowering here fails only there, so torch's compile is made
    to refuse ``cpp_wrapper``), each segment warns once naming itself and runs inductor's Python
    wrapper: still compiled, no aten fallback, eager's numbers."""
    monkeypatch.setenv("TANDEM_INDUCTOR_CPP_WRAPPER", "1")
    compile_segment = torch._inductor.standalone_compile

    def refusing_cpp(*args: object, **kwargs: object) -> object:
        if kwargs["options"]["config_patches"].get("cpp_wrapper"):  # type: ignore[index]
            raise RuntimeError("tandem_test: no C++ wrapper here\nsecond line")
        return compile_segment(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(torch._inductor, "standalone_compile", refusing_cpp)
    module, loss_fn, batch = zoo_case("mlp", torch.float32)
    expected = eager_step(twin(module), loss_fn, batch)
    step = tandem.compile(module, loss_fn, *batch, backend="inductor", bulk_bwd=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = [step(*batch) for _ in range(2)]
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    names = [segment.name for segment in step.executor.segments]
    assert len(names) > 2 and len(messages) == len(names), (names, messages)
    for name, message in zip(names, messages):
        assert f"segment {name} (" in message and "no C++ wrapper here)" in message and "Python wrapper" in message
    assert step.compile_report()["fallbacks"] == {}, "the Python wrapper compiled every segment"
    for result in results:
        assert_same_step(result, *expected, rtol=RTOL, atol=ATOL)


# -- structure -------------------------------------------------------------------------------


def test_a_phase_is_one_segment_without_caps_and_the_aten_boundaries_with_them() -> None:
    module, loss_fn, batch = zoo_case("lstm_lm", torch.float32)
    whole = tandem.compile(module, loss_fn, *batch, backend="inductor")
    assert [phase for phase, _ in _segment_nodes(whole)] == [Phase.FORWARD, Phase.BACKWARD]
    capped = tandem.compile(module, loss_fn, *batch, backend="inductor", bulk_fwd=4, bulk_bwd=9)
    aten = tandem.compile(module, loss_fn, *batch, backend="aten", bulk_fwd=4, bulk_bwd=9)
    assert len(capped.executor.segments) > 2
    assert _segment_nodes(capped) == _segment_nodes(aten)
    assert not capped.executor.compiled, "compiled on the first call, not at capture"


def test_a_distributed_trainer_keeps_the_aten_caps() -> None:
    aten = TrainerConfig.from_options({"kvstore": "dist_sync"}).step.plan.caps
    inductor = TrainerConfig.from_options({"kvstore": "dist_sync", "backend": "inductor"}).step
    assert inductor.plan.backend == "inductor" and inductor.plan.caps == aten
    alone = TrainerConfig.from_options({"backend": "inductor"}).step.plan.caps
    assert alone != aten, "training alone, a phase is one compiled unit"


def test_gradient_hooks_fire_once_per_gradient_per_step_from_the_compiling_step_on() -> None:
    module, loss_fn, batch = zoo_case("mlp", torch.float32)
    step = tandem.compile(module, loss_fn, *batch, backend="inductor", bulk_fwd=3, bulk_bwd=2)
    seen: dict[str, list[torch.Tensor]] = {}
    step.add_gradient_hook(lambda name, grad: seen.setdefault(name, []).append(grad.clone()))
    results = []
    for count in (1, 2, 3):  # the first call compiles, then runs the measured step; then the engine path
        results.append(step(*batch))
        assert sorted(seen) == sorted(results[-1].grads)
        assert all(len(grads) == count for grads in seen.values()), {n: len(g) for n, g in seen.items()}
    assert sum(1 for s in step.executor.segments if s.gradients) > 1, "gradients end in several segments"
    for name, grads in seen.items():
        for result, grad in zip(results, grads):
            assert torch.equal(grad, result.grads[name]), name  # the hook saw the step's gradient


class CausalMixer(nn.Module):
    """nanoGPT's attention in miniature: scores masked by a bool causal buffer, then softmax."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.register_buffer("causal", torch.tril(torch.ones(6, 6, dtype=torch.bool)), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = (self.proj(x) @ x.transpose(-2, -1)).masked_fill(~self.causal, float("-inf"))
        return torch.softmax(scores, dim=-1) @ x


def _mixer_loss(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return module(x).square().mean()


def test_a_small_bool_mask_crosses_units_as_float_and_the_step_matches_eager() -> None:
    module, x = CausalMixer(), torch.randn(4, 6, 8, generator=torch.Generator().manual_seed(0))
    step = tandem.compile(module, _mixer_loss, x, backend="inductor")
    result = step(x)
    forward, backward = (s.function for s in (step.executor.segments[0], step.executor.segments[-1]))
    assert isinstance(forward, InductorSegment) and isinstance(backward, InductorSegment)
    assert forward.float_mask_inputs and forward.float_mask_outputs, "the buffer in, the negated mask out"
    assert backward.float_mask_inputs, "the backward reads the mask the forward saved"
    graph = forward.graph_module().graph
    assert any(n.target is torch.ops.aten.ne.Scalar for n in graph.nodes), "bool again inside the kernels"
    eager_loss, eager_grads = eager_step(copy.deepcopy(module), _mixer_loss, (x,))
    assert_same_step(result, eager_loss, eager_grads, RTOL, ATOL)


def test_compile_report() -> None:
    module, loss_fn, batch = zoo_case("mlp", torch.float32)
    step = tandem.compile(module, loss_fn, *batch, backend="inductor")
    before = step.compile_report()
    assert set(before) == {"backend", "compile_s", "units_loaded", "fallbacks", "capture_s", "plan_s", "capture_cache"}
    assert before["capture_cache"] == "off"  # the test suite traces every step (tests/conftest.py)
    assert before["compile_s"] == 0 and before["fallbacks"] == {}
    step(*batch)
    after = step.compile_report()
    assert after["backend"] == "inductor" and after["compile_s"] > 0 and after["fallbacks"] == {}
    assert tandem.compile(module, loss_fn, *batch).compile_report()["compile_s"] == 0  # aten compiles nothing


def test_inductors_cpu_probe_runs_during_capture_and_compiling_waits_for_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from tandem.backends import inductor

    monkeypatch.setattr(inductor, "_warm_up", None)  # as in a new process: this capture must start it
    module, loss_fn, batch = zoo_case("mlp", torch.float32)
    step = tandem.compile(module, loss_fn, *batch, backend="inductor")
    assert inductor._warm_up is not None, "capture started the probe"
    step(*batch)
    assert not inductor._warm_up.is_alive(), "the first compile waited for it"


def test_the_probes_side_by_side_pick_what_inductor_picks_alone() -> None:
    """The warm-up probes every candidate instruction set at once; inductor's own sequential probe,
    in a fresh process, must pick the same set."""
    import subprocess
    import sys

    alone = "from torch._inductor import cpu_vec_isa; print(cpu_vec_isa.pick_vec_isa())"
    warmed = ("from torch._inductor import cpu_vec_isa; from tandem.backends import inductor; inductor.warm_up(); "
              "inductor._await_warm_up(); print(cpu_vec_isa.pick_vec_isa())")
    picked = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                             timeout=300).stdout.strip() for code in (alone, warmed)]
    assert picked[0] == picked[1], picked


@pytest.mark.skipif(not on_x86(), reason="ONEDNN_MAX_CPU_ISA=AVX2 names an x86 instruction set")
def test_a_resnet_trains_where_onednn_runs_avx2_code() -> None:
    """oneDNN's AVX2 weight gradient of a strided 1x1 convolution on channels-last tensors corrupts
    the heap; where oneDNN runs AVX2 code the backend keeps inductor from choosing channels-last.
    oneDNN reads ``ONEDNN_MAX_CPU_ISA`` once, at load: a fresh process, capped, stands in for such a CPU."""
    import os
    import subprocess
    import sys

    script = ("import torch, tandem; from tandem import optim; from tandem.backends import inductor; "
              "from tests.conftest import zoo_case; torch.set_num_threads(1); "
              "assert inductor.OPTIONS['layout_optimization'] is False, inductor.OPTIONS; "
              "module, loss_fn, batch = zoo_case('resnet', torch.float32); "
              "trainer = tandem.Trainer(module, loss_fn, optim.SGD(lr=0.1, momentum=0.9), backend='inductor', "
              "progress=False); print([trainer.step(*batch) for _ in range(3)])")
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    module, loss_fn, batch = zoo_case("resnet", torch.float32)
    expected = eager_train(module, loss_fn, batch, torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9), 3)
    losses = [float(v) for v in done.stdout.strip().splitlines()[-1].strip("[]").split(",")]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=RTOL, atol=ATOL)


# -- memory ----------------------------------------------------------------------------------


def test_peak_is_measured_and_mirroring_lowers_it() -> None:
    module, loss_fn, batch = zoo_case("gpt", torch.float32, batch_size=32)
    peaks, reports = {}, {}
    # a budget lowering the measured peak: test_recompute_runs_cut_the_backward_so_the_measured_peak_keeps_the_plan
    for backend, mirror in (("aten", "off"), ("inductor", "off"), ("inductor", "memory-aware")):
        step = tandem.compile(module, loss_fn, *batch, backend=backend, mirror=mirror)
        torch.manual_seed(1)
        step(*batch)
        reports[backend, mirror] = step.memory_report()
        peaks[backend, mirror] = reports[backend, mirror]["peak_bytes"]
    off = peaks["inductor", "off"]
    assert off > 0
    assert peaks["aten", "off"] / 4 < off < peaks["aten", "off"] * 4, peaks
    # measured from the kernels' allocations, not the planner's estimate of the aten ops
    assert off != reports["inductor", "off"]["estimated_peak_bytes"], reports["inductor", "off"]
    assert reports["inductor", "memory-aware"]["mirrored"] > 0
    assert peaks["inductor", "memory-aware"] < off, peaks


def test_recompute_runs_cut_the_backward_so_the_measured_peak_keeps_the_plan() -> None:
    """As one unit per phase, inductor computed recomputations early (this gpt at budget 0.4: 1.65x
    the planned peak); with a boundary before each recompute run that follows 40 or more nodes of
    its unit, and under a budget before the backward's first run, the peak stays near the plan, and
    below mirroring off."""
    from tandem.graph.train_graph import MetaKey
    from tandem.passes.segments import RECOMPUTE_UNIT_MIN_NODES, RECOMPUTE_UNITS_MAX, counts_toward_size

    module, loss_fn, batch = zoo_case("gpt", torch.float32, batch_size=32)
    off = tandem.compile(module, loss_fn, *batch, backend="inductor")
    off(*batch)
    step = tandem.compile(module, loss_fn, *batch, backend="inductor", mirror=0.4)
    torch.manual_seed(1)
    result = step(*batch)
    assert_same_step(result, *eager_step(twin(module), loss_fn, batch, seed=1), rtol=RTOL, atol=ATOL)  # cut units: same numbers
    report = step.memory_report()
    assert report["peak_bytes"] <= 1.25 * report["estimated_peak_bytes"], report
    assert report["peak_bytes"] < 0.75 * off.memory_report()["peak_bytes"]
    nodes = step.graph.op_nodes()
    backward = [n for n in nodes if step.graph.phase_of(n) == Phase.BACKWARD and counts_toward_size(n)]
    minimum = max(RECOMPUTE_UNIT_MIN_NODES, len(backward) // RECOMPUTE_UNITS_MAX)
    size, cuts, after_recompute = 0, 0, False  # size: counted nodes of the unit before ``node``
    first_run, head_cut_size = True, None  # under a budget the backward's first run always starts a unit
    for previous, node in zip(nodes, nodes[1:]):
        size += counts_toward_size(previous)
        if counts_toward_size(previous):
            after_recompute = MetaKey.RECOMPUTE_OF in previous.meta
        recomputed = counts_toward_size(node) and MetaKey.RECOMPUTE_OF in node.meta
        run_start = recomputed and not after_recompute
        new_unit = node.meta[MetaKey.SEGMENT] != previous.meta[MetaKey.SEGMENT]
        if step.graph.phase_of(node) == step.graph.phase_of(previous):  # no caps: only the rule cuts
            assert new_unit == (run_start and (size >= minimum or first_run)), (node.name, size)
            cuts += new_unit
            if new_unit and first_run:
                head_cut_size = size
        if recomputed:
            first_run = False
        if new_unit:
            size = 0
    assert cuts > 1, "the backward is cut before recompute runs"
    assert head_cut_size is not None and head_cut_size < minimum, "the first run starts a unit of its own"
    aten = tandem.compile(module, loss_fn, *batch, backend="aten", mirror=0.4, bulk_fwd=10**6, bulk_bwd=10**6)
    assert len({n.meta[MetaKey.SEGMENT] for n in aten.graph.op_nodes()}) == 2, "aten runs nodes in order: no cuts"


# -- a segment inductor cannot compile --------------------------------------------------------


@torch.library.custom_op("tandem_test::shift", mutates_args=())
def shift(x: torch.Tensor) -> torch.Tensor:
    """x + 1 as a custom op: capture traces it through its fake kernel, eager runs this one."""
    return x + 1.0


@shift.register_fake
def _shift_fake(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


@pytest.fixture
def shift_cannot_be_lowered() -> Iterator[torch._ops.OpOverload]:
    """An inductor lowering for tandem_test::shift that fails, as a lowering does for an op it cannot handle."""
    from torch._inductor import lowering

    op = torch.ops.tandem_test.shift.default
    before = dict(lowering.lowerings)

    @lowering.register_lowering(op, type_promotion_kind=None)
    def _refuse(x: object) -> object:
        raise NotImplementedError("tandem_test: no kernel for this op")

    try:
        yield op
    finally:
        for key in set(lowering.lowerings) - set(before):
            del lowering.lowerings[key]


class Shifted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(8, 16), nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.relu(self.first(shift(x))))


def _shifted_loss(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return module(x).pow(2).sum()


def test_a_segment_inductor_cannot_compile_runs_its_aten_code(shift_cannot_be_lowered: torch._ops.OpOverload) -> None:
    torch.manual_seed(0)
    module, x = Shifted(), torch.randn(4, 8)
    aten = tandem.compile(module, _shifted_loss, x, backend="aten")
    expected = aten(x)
    step = tandem.compile(module, _shifted_loss, x, backend="inductor")
    with warnings.catch_warnings(record=True) as caught, torch._inductor.config.patch(fx_graph_cache=False):
        warnings.simplefilter("always")
        results = [step(x) for _ in range(3)]
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1, messages
    assert str(shift_cannot_be_lowered) in messages[0] and "forward[0]" in messages[0], messages
    fallbacks = step.compile_report()["fallbacks"]
    assert list(fallbacks) == ["forward[0]"] and str(shift_cannot_be_lowered) in fallbacks["forward[0]"]
    # nothing else changes: the same segments, the backward compiled, the results aten's
    assert _segment_nodes(step) == _segment_nodes(tandem.compile(module, _shifted_loss, x, backend="inductor"))
    for result in results:
        assert torch.equal(result.loss, expected.loss), "the loss comes from the forward segment's aten code"
        assert set(result.grads) == set(expected.grads)
        for name, grad in expected.grads.items():
            torch.testing.assert_close(result.grads[name], grad, rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"{n}: {m}")
