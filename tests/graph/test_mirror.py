"""Backward mirroring: same numbers as "off" under every policy, MXNet's two structure cases,
measured memory never above "off" for memory-aware, budgets, and the option/env contract."""

from __future__ import annotations

import functools
import operator
import sys
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.fx as fx
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

import tandem
from tandem.executor import Executor
from tandem.graph import cost
from tandem.graph.capture import capture
from tandem.graph.train_graph import MetaKey, Phase, TrainGraph, resolved
from tandem.passes.manager import plan
from tandem.passes.mirror import MirrorPolicy
from tandem.passes.mirror_rewrite import _stacked_input
from tandem.step import StepConfig
from tests.conftest import assert_same_step, twin, zoo_case

POLICIES = ["all", "sqrt", "memory-aware", 0.6]
EXACT = dict(rtol=1e-7, atol=1e-10)
aten = torch.ops.aten
DROPOUT_REPLAY = aten.native_dropout_backward.default  # input * kept mask * scale: no new random draw
BN_REPLAY = {aten._native_batch_norm_legit_no_training.default, aten.mul.Tensor, aten.reciprocal.default, aten.sub.Tensor}


def recomputed(graph: TrainGraph) -> list[fx.Node]:
    return [n for n in graph.op_nodes() if MetaKey.RECOMPUTE_OF in n.meta]


def recomputed_ops(graph: TrainGraph) -> set[str]:
    """Names of the recomputed originals that are real ops (not views or getitems)."""
    return {n.meta[MetaKey.RECOMPUTE_OF] for n in recomputed(graph)
            if n.target is not operator.getitem and not cost.is_view(n)}


@dataclass
class Case:
    graph: TrainGraph  # captured once per model: capture is the slow part, planning is cheap
    inputs: list[torch.Tensor]


@functools.cache
def case(name: str) -> Case:
    module, loss_fn, batch = zoo_case(name, batch_size=8)
    graph = capture(module, loss_fn, batch)
    return Case(graph, graph.inputs(module, batch))


def planned_run(name: str, policy: object) -> tuple[TrainGraph, list[torch.Tensor], int]:
    """Plan the captured step for ``policy`` and run it once: (graph, outputs, measured peak)."""
    graph = plan(case(name).graph.clone(), StepConfig(mirror=policy).plan)
    torch.manual_seed(3)  # same seed for every policy: dropout draws the same masks
    outputs, memory = Executor(graph).run_measured(case(name).inputs)
    return graph, outputs, memory.peak_bytes


@functools.cache
def off_run(name: str) -> tuple[list[torch.Tensor], int]:
    _, outputs, peak = planned_run(name, "off")
    return outputs, peak


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_matches_off(zoo_name: str, policy: object) -> None:
    graph, outputs, peak = planned_run(zoo_name, policy)
    expected, off_peak = off_run(zoo_name)
    assert len(outputs) == len(expected)  # loss, gradients, then BN running stats (updated once, like off)
    for index, (value, reference) in enumerate(zip(outputs, expected)):
        torch.testing.assert_close(value, reference, **EXACT, msg=lambda m, i=index: f"output {i}: {m}")
    check_structure(graph)
    notes = graph.notes["memory"]
    assert notes["estimated_peak_bytes"] == peak, "the plan's simulation matches the measurement"
    if policy == "memory-aware":
        assert peak <= off_peak
    assert set(resolved(notes)["saved_bytes_by_policy"]) == {"off", "all", "sqrt", "memory-aware"}
    assert notes["recompute_flops"] >= 0 and notes["policy"]


def check_structure(graph: TrainGraph) -> None:
    nodes = graph.op_nodes()
    order = {n: i for i, n in enumerate(nodes)}
    by_name = {n.name: n for n in nodes}
    buffer_updates = set(graph.buffer_updates.values())
    for copy in recomputed(graph):
        original = by_name[copy.meta[MetaKey.RECOMPUTE_OF]]
        assert graph.phase_of(copy) == Phase.BACKWARD and graph.phase_of(original) == Phase.FORWARD
        assert (copy.target is original.target or (cost.is_training_batch_norm(original) and copy.target in BN_REPLAY)
                or (cost.dropout_replay(original) is not None and copy.target is DROPOUT_REPLAY))
        assert not cost.is_random(copy) and not (copy.target is operator.getitem and cost.is_random(copy.args[0]))
        assert copy not in buffer_updates and copy is not graph.loss
        assert all(graph.phase_of(u) == Phase.BACKWARD for u in copy.users if u.op == "call_function")
        first_use = min(order[u] for u in copy.users if u.op == "call_function")
        before = [n for n in nodes[order[copy] + 1 : first_use] if MetaKey.RECOMPUTE_OF not in n.meta]
        assert not before, f"{copy.name} is not placed just before its first backward reader"
    for node in nodes:  # no backward node still reads the original of a mirrored value it had a copy for
        if graph.phase_of(node) == Phase.BACKWARD:
            assert all(MetaKey.RECOMPUTE_OF not in a.meta or graph.phase_of(a) == Phase.BACKWARD
                       for a in node.all_input_nodes)


def test_dropout_is_never_redrawn_and_its_output_is_replayed_from_the_kept_mask() -> None:
    # The most aggressive plan (every policy's copies are also checked in check_structure).
    graph, _, _ = planned_run("gpt", 0.2)
    dropouts = [n for n in graph.op_nodes() if cost.is_random(n)]
    assert dropouts and all(MetaKey.RECOMPUTE_OF not in n.meta for n in dropouts)
    for copy in recomputed(graph):
        source = copy.args[0] if copy.target is operator.getitem else copy
        assert not cost.is_random(source), f"{copy.name} re-runs dropout"  # type: ignore[arg-type]
    masks = {n for n in graph.op_nodes() if n.target is operator.getitem and cost.is_random(n.args[0])
             and n.args[1] == 1}  # type: ignore[arg-type]
    replays = [n for n in recomputed(graph) if n.target is DROPOUT_REPLAY]
    assert replays and all(n.args[1] in masks for n in replays), "outputs replayed from the original masks"


def test_memory_aware_replays_attention_dropout_instead_of_keeping_it() -> None:
    module, loss_fn, batch = zoo_case("gpt")
    graph = tandem.compile(module, loss_fn, *batch, mirror="memory-aware").graph
    replayed = {n.meta[MetaKey.RECOMPUTE_OF] for n in recomputed(graph) if n.target is DROPOUT_REPLAY}
    by_name = {n.name: n for n in graph.op_nodes()}
    sources = {cost.dropout_replay(by_name[name])[0].target for name in replayed}  # type: ignore[index]
    assert aten._softmax.default in sources, "the attention weights' dropout output is not kept"


def test_batchnorm_output_is_replayed_from_kept_statistics() -> None:
    module, loss_fn, batch = zoo_case("resnet")
    graph = tandem.compile(module, loss_fn, *batch, mirror="memory-aware").graph
    targets = [n.target for n in recomputed(graph)]
    assert aten._native_batch_norm_legit_no_training.default in targets, "BN y recomputed in eval mode"
    assert aten._native_batch_norm_legit_functional.default not in targets, "batch statistics never recomputed"
    statistics = [n for n in graph.op_nodes() if cost.is_batch_norm_statistic(n)]
    assert statistics and all(MetaKey.RECOMPUTE_OF not in n.meta for n in statistics)


# -- MXNet's two structure cases ------------------------------------------------------------------


class RNNCell(nn.Module):
    """h_t = tanh(W x_t + U h_{t-1} + b): the add and tanh are what the naive rule mirrors."""

    def __init__(self, size: int = 32) -> None:
        super().__init__()
        self.input = nn.Linear(size, size)
        self.hidden = nn.Linear(size, size, bias=False)
        self.head = nn.Linear(size, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.zeros_like(x[:, 0])
        for t in range(x.shape[1]):
            h = torch.tanh(self.input(x[:, t]) + self.hidden(h))
        return self.head(h)


class MLPAttention(nn.Module):
    """Additive attention of several queries over shared keys: score = v . tanh(Wq[:, None] + UK)."""

    def __init__(self, size: int = 32) -> None:
        super().__init__()
        self.query = nn.Linear(size, size, bias=False)
        self.key = nn.Linear(size, size, bias=False)
        self.score = nn.Linear(size, 1, bias=False)

    def forward(self, queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        projected_keys = self.key(keys)  # (N, T, H): shared by every query
        total = queries.new_zeros(())
        for step in range(queries.shape[1]):
            hidden = torch.tanh(self.query(queries[:, step])[:, None, :] + projected_keys)  # broadcast add
            total = total + torch.softmax(self.score(hidden).squeeze(-1), dim=-1).pow(2).sum()
        return total


def loss_sum(module: nn.Module, *batch: torch.Tensor) -> torch.Tensor:
    return module(*batch).sum()


def compiled(module: nn.Module, batch: tuple[torch.Tensor, ...], policy: str) -> tandem.TrainStep:
    step = tandem.compile(twin(module), loss_sum, *batch, mirror=policy)
    step(*batch)
    return step


def test_rnn_cell_mirrors_nothing_and_naive_raises_memory() -> None:
    torch.manual_seed(0)
    module, batch = RNNCell(), (torch.randn(16, 6, 32),)
    off, naive, aware = (compiled(module, batch, p) for p in ("off", "all", "memory-aware"))
    assert recomputed_ops(naive.graph), "the naive rule mirrors the cell's add and tanh"
    assert naive.memory_report()["peak_bytes"] > off.memory_report()["peak_bytes"]
    assert not recomputed_ops(aware.graph), "memory-aware: no benefit in an RNN cell, nothing mirrored"
    assert aware.memory_report()["peak_bytes"] == off.memory_report()["peak_bytes"]


def test_mlp_attention_mirrors_broadcast_add_and_tanh() -> None:
    torch.manual_seed(0)
    module, batch = MLPAttention(), (torch.randn(8, 4, 32), torch.randn(8, 24, 32))
    off, aware = compiled(module, batch, "off"), compiled(module, batch, "memory-aware")
    names = recomputed_ops(aware.graph)
    targets = {n.target for n in aware.graph.op_nodes() if n.name in names}
    assert {torch.ops.aten.add.Tensor, torch.ops.aten.tanh.default} <= targets
    assert aware.memory_report()["peak_bytes"] < off.memory_report()["peak_bytes"]


# -- budgets ----------------------------------------------------------------------------------------


def test_budget_fits_with_least_recompute() -> None:
    _, peak = off_run("gpt")
    loose, _, loose_peak = planned_run("gpt", 0.95)
    tight, _, tight_peak = planned_run("gpt", f"{int(0.7 * peak)}B")
    assert loose.notes["memory"]["budget_met"] and loose_peak <= 0.95 * peak
    assert tight.notes["memory"]["budget_met"] and tight_peak <= 0.7 * peak
    assert loose.notes["memory"]["recompute_flops"] <= tight.notes["memory"]["recompute_flops"]


def test_impossible_budget_warns_and_uses_the_smallest_plan(caplog: pytest.LogCaptureFixture) -> None:
    module, loss_fn, batch = zoo_case("mlp", torch.float32)
    with caplog.at_level("WARNING", logger="tandem"):
        step = tandem.compile(module, loss_fn, *batch, mirror="1KB")
    assert "no mirroring plan fits the budget of 1000 bytes" in caplog.text
    step(*batch)
    assert step.memory_report()["budget_met"] is False


class LongRecurrence(nn.Module):
    """An RNN unrolled over many steps: one chain of thousands of ops, every one mirrorable."""

    def __init__(self) -> None:
        super().__init__()
        self.cell = nn.Linear(8, 8)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        hidden = torch.zeros(inputs.shape[0], 8)
        for step in range(inputs.shape[1]):
            hidden = torch.tanh(self.cell(hidden) + inputs[:, step])
        return hidden


def test_a_long_recurrence_plans_within_pythons_default_recursion_limit() -> None:
    """Recompute copies are made without recursion: a chain of ~1,000 values once overflowed the stack."""
    torch.manual_seed(0)
    module, inputs = LongRecurrence(), torch.randn(4, 250, 8)
    reference = twin(module)
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(1000)  # Python's default (importing inductor raises it)
    try:
        step = tandem.compile(module, loss_sum, inputs, mirror=0.5)  # a budget: min-cut plans chain every step
        result = step(inputs)
    finally:
        sys.setrecursionlimit(limit)
    assert recomputed(step.graph)
    eager_loss = loss_sum(reference, inputs)
    eager_loss.backward()
    eager_grads = {name: parameter.grad for name, parameter in reference.named_parameters()}
    assert_same_step(result, eager_loss.detach(), eager_grads, rtol=1e-5, atol=1e-6)


def test_a_slice_of_a_recomputed_stack_is_its_input_not_a_rebuilt_stack() -> None:
    """lstm_lm stacks layer 1's outputs over time and layer 2 reads them one step at a time: a plan
    that recomputes them reads each step's recomputed output, not a stack rebuilt per read (under
    inductor the rebuilt stacks were all allocated up front: 1.7x the peak of no mirroring)."""
    graph, outputs, _ = planned_run("lstm_lm", 0.8)  # a budget's min-cut plan recomputes the stacked outputs
    assert any(n.target is aten.select.int for n in recomputed(graph))
    stacks = [n for n in recomputed(graph) if n.target is aten.stack.default]
    assert all(user.target is not aten.select.int for stack in stacks for user in stack.users)
    for got, want in zip(outputs, off_run("lstm_lm")[0]):
        torch.testing.assert_close(got, want, **EXACT)


def _select_of_stack(stacked_inputs: Any, dim: int, index: int) -> tuple[fx.Node, dict[str, fx.Node]]:
    """The traced ``select(stack(inputs, dim), dim, index)`` and the traced graph's nodes by name."""
    def slice_of_stack(*inputs: torch.Tensor) -> torch.Tensor:
        return torch.stack([stacked_inputs(x) for x in inputs], dim=dim).select(dim, index)

    traced = make_fx(slice_of_stack)(torch.randn(2, 3), torch.randn(2, 3), torch.randn(2, 3))
    nodes = {n.name: n for n in traced.graph.nodes}
    return next(n for n in traced.graph.nodes if n.target is aten.select.int), nodes


@pytest.mark.parametrize(("dim", "index"), [(0, 1), (1, -1), (-1, 2), (2, 0)])
def test_a_slice_of_a_recomputed_stack_stands_in_only_where_it_is_the_same_value(dim: int, index: int) -> None:
    select, nodes = _select_of_stack(torch.sin, dim, index)
    stack = select.args[0]
    assert isinstance(stack, fx.Node)
    sines = [n for n in nodes.values() if n.target is aten.sin.default]
    assert _stacked_input(select, {stack.name}) is sines[index]
    assert _stacked_input(select, set()) is None  # a kept stack: its slice is a free view of it
    transposed, nodes = _select_of_stack(lambda x: x.t().contiguous().t(), dim, index)  # not contiguous
    assert _stacked_input(transposed, set(nodes)) is None


def test_a_slice_of_a_stack_that_promoted_its_dtype_is_not_its_input() -> None:
    def mixed(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
        return torch.stack([first.half(), second], dim=0).select(0, 0)

    traced = make_fx(mixed)(torch.randn(3), torch.randn(3))
    select = next(n for n in traced.graph.nodes if n.target is aten.select.int)
    assert _stacked_input(select, {n.name for n in traced.graph.nodes}) is None


# -- the option ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, MirrorPolicy("off")),
        ("memory-aware", MirrorPolicy("memory-aware")),
        (" SQRT ", MirrorPolicy("sqrt")),
        (0.4, MirrorPolicy("budget", fraction=0.4)),
        ("0.4", MirrorPolicy("budget", fraction=0.4)),
        ("300MB", MirrorPolicy("budget", budget_bytes=300_000_000)),
        ("1.5GiB", MirrorPolicy("budget", budget_bytes=int(1.5 * 2**30))),
    ],
)
def test_policy_parsing(value: object, expected: MirrorPolicy) -> None:
    assert MirrorPolicy.parse(value) == expected  # type: ignore[arg-type]


@pytest.mark.parametrize(("value", "message"), [("fast", "not a mirroring policy"), (1.5, r"lie in \(0, 1\]"),
                                                ("12 parsecs", "not a mirroring policy"), (True, "has type bool")])
def test_bad_policy_is_named_with_the_fix(value: object, message: str) -> None:
    with pytest.raises((ValueError, TypeError), match=message) as error:
        MirrorPolicy.parse(value)  # type: ignore[arg-type]
    assert "memory-aware" in str(error.value) and "300MB" in str(error.value)


def test_env_knob_fills_in_and_explicit_option_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_MIRROR", "memory-aware")
    module, loss_fn, batch = zoo_case("mlp")
    assert tandem.compile(module, loss_fn, *batch).graph.notes["memory"]["policy"] == "memory-aware"
    assert tandem.compile(module, loss_fn, *batch, mirror="off").graph.notes["memory"]["policy"] == "off"


def test_trainer_passes_mirror_to_its_step() -> None:
    from tandem.trainer import TrainerConfig

    assert TrainerConfig.from_options({"mirror": "memory-aware"}).step.mirror == "memory-aware"
