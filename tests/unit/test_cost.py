"""tandem.graph.cost: bytes, flops and op classes of aten nodes, on graphs traced with fake tensors."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from tandem.graph import cost

aten = torch.ops.aten


def traced(function: Callable[..., object], *args: torch.Tensor) -> dict[str, fx.Node]:
    """The call_function nodes of ``function`` traced to aten ops, by op name (first of each)."""
    graph = make_fx(function, tracing_mode="fake")(*args).graph
    nodes: dict[str, fx.Node] = {}
    for node in graph.nodes:
        if node.op == "call_function":
            nodes.setdefault(getattr(node.target, "__name__", str(node.target)), node)
    return nodes


def test_bytes_follow_shape_and_dtype() -> None:
    nodes = traced(lambda x: (x * 2).to(torch.float16), torch.randn(3, 5))
    assert cost.output_bytes(nodes["mul.Tensor"]) == 3 * 5 * 4
    assert cost.output_bytes(nodes["_to_copy.default"]) == 3 * 5 * 2


def test_tuple_output_bytes_sum_every_element() -> None:
    nodes = traced(lambda x, w, b: F.layer_norm(x, (8,), w, b), torch.randn(4, 8), torch.randn(8), torch.randn(8))
    layer_norm = nodes["native_layer_norm.default"]
    assert cost.output_bytes(layer_norm) == 4 * 8 * 4 + 4 * 4 + 4 * 4  # output, mean, rstd


def test_matmul_flops_are_two_per_multiply_add() -> None:
    nodes = traced(lambda a, b, c: (a @ b, torch.addmm(c, a, b), torch.bmm(a[None], b[None])),
                   torch.randn(3, 4), torch.randn(4, 5), torch.randn(5))
    assert cost.flops(nodes["mm.default"]) == 2 * 3 * 4 * 5
    assert cost.flops(nodes["addmm.default"]) == 2 * 3 * 4 * 5
    assert cost.flops(nodes["bmm.default"]) == 2 * 3 * 4 * 5


def test_convolution_flops_and_its_backward() -> None:
    x, w = torch.randn(2, 3, 8, 8), torch.randn(6, 3, 3, 3)
    forward = traced(lambda x, w: F.conv2d(x, w, padding=1), x, w)["convolution.default"]
    assert cost.flops(forward) == 2 * (2 * 6 * 8 * 8) * (3 * 3 * 3)

    def backward(x: torch.Tensor, w: torch.Tensor, g: torch.Tensor) -> object:
        return aten.convolution_backward(g, x, w, [0], [1, 1], [1, 1], [1, 1], False, [0, 0], 1, [True, True, False])

    node = traced(backward, x, w, torch.randn(2, 6, 8, 8))["convolution_backward.default"]
    assert cost.flops(node) == 2 * cost.flops(forward)
    assert cost.is_expensive(node)


def test_elementwise_flops_and_views_cost_nothing() -> None:
    nodes = traced(lambda x: torch.tanh(x + 1).t(), torch.randn(6, 7))
    assert cost.flops(nodes["add.Tensor"]) == 42
    assert cost.flops(nodes["tanh.default"]) > cost.flops(nodes["add.Tensor"])
    assert cost.flops(nodes["t.default"]) == 0


def test_random_and_expensive_classification() -> None:
    nodes = traced(lambda x, w: aten.native_dropout(F.relu(x @ w), 0.5, True), torch.randn(3, 4), torch.randn(4, 4))
    assert cost.is_random(nodes["native_dropout.default"])
    assert not cost.is_random(nodes["relu.default"])
    assert cost.is_expensive(nodes["mm.default"])
    assert not cost.is_expensive(nodes["relu.default"])


def test_alias_source_follows_views_splits_and_unsafe_view() -> None:
    def function(x: torch.Tensor) -> object:
        y = x * 2
        a, b = y.split(2, dim=1)
        return a.t(), b, aten._unsafe_view(y, [12]), y.clone()

    graph = make_fx(function, tracing_mode="fake")(torch.randn(3, 4)).graph
    nodes = [n for n in graph.nodes if n.op == "call_function"]
    mul = next(n for n in nodes if n.target is aten.mul.Tensor)
    for node in nodes:
        if node.target in (aten.t.default, aten.split.Tensor, aten._unsafe_view.default) or node.target.__name__ == "getitem":
            assert cost.storage_root(node) is mul, node.name
    clone = next(n for n in nodes if n.target is aten.clone.default)
    assert cost.alias_source(clone) is None and cost.storage_root(clone) is clone
    assert cost.alias_source(mul) is None
