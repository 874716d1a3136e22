"""What a graph node costs: bytes of its output(s), flops of its op, and how it may be treated.

Pure functions over ``torch.fx`` nodes of a captured TrainGraph (aten ops with ``meta["val"]``
fake tensors). The mirroring pass uses them to weigh bytes kept against work redone; they never
run an op. Flop counts follow the usual convention (one multiply-add = 2 flops) and only need to
rank ops against each other, not to predict time exactly.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx

aten = torch.ops.aten

# Ops whose output differs between two runs on the same inputs: re-running them would change numbers.
RANDOM_OPS = frozenset(
    {
        aten.native_dropout.default,
        aten.bernoulli.default,
        aten.bernoulli.p,
        aten.bernoulli_.float,
        aten.rand.default,
        aten.rand_like.default,
        aten.randn.default,
        aten.randn_like.default,
        aten.randint.default,
        aten.randint_like.default,
        aten.randperm.default,
        aten.normal.Tensor_float,
        aten.uniform.default,
        aten.multinomial.default,
    }
)

# Ops MXNet's rule never re-runs (Convolution, FullyConnected, Embedding, Concat, the loss):
# their time dominates, or their output is what a recompute would have to start from anyway.
EXPENSIVE_OPS = frozenset(
    {
        aten.mm.default,
        aten.addmm.default,
        aten.bmm.default,
        aten.baddbmm.default,
        aten.matmul.default,
        aten.convolution.default,
        aten.convolution_backward.default,
        aten.embedding.default,
        aten.cat.default,
        aten.stack.default,
        aten.nll_loss_forward.default,
        aten._scaled_dot_product_flash_attention_for_cpu.default,
        aten.max_pool2d_with_indices.default,  # its indices output is what the backward needs
    }
)

# Ops that return a view of an input but whose schema does not say so.
_HIDDEN_ALIASES = frozenset({aten._unsafe_view.default, aten.alias.default})

_FLOPS_PER_ELEMENT = {  # a rough count for elementwise and normalisation ops, per output element
    aten.native_batch_norm.default: 8,
    aten._native_batch_norm_legit_functional.default: 8,
    aten._native_batch_norm_legit.default: 8,
    aten.native_layer_norm.default: 8,
    aten._softmax.default: 5,
    aten._log_softmax.default: 5,
    aten.gelu.default: 10,
    aten.tanh.default: 4,
    aten.sigmoid.default: 4,
}


# -- values ------------------------------------------------------------------------------------


def tensor_values(value: Any) -> list[torch.Tensor]:
    """The tensors in a node's value: itself, or the tensors of a tuple/list output."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, list | tuple):
        return [v for v in value if isinstance(v, torch.Tensor)]
    return []


def tensor_bytes(tensor: torch.Tensor) -> int:
    """Bytes a tensor of this shape and dtype occupies (dense, as a fresh output is)."""
    return math.prod(tensor.shape) * tensor.element_size()


def output_bytes(node: fx.Node) -> int:
    """Bytes of every tensor a node outputs (all elements of a tuple output), from meta val."""
    return sum(tensor_bytes(t) for t in tensor_values(node.meta.get("val")))


def _elements(node: fx.Node) -> int:
    return sum(math.prod(t.shape) for t in tensor_values(node.meta.get("val")))


def _shape(node: Any) -> Sequence[int]:
    value = node.meta.get("val") if isinstance(node, fx.Node) else None
    return tuple(value.shape) if isinstance(value, torch.Tensor) else ()


# -- classification ----------------------------------------------------------------------------


def is_random(node: fx.Node) -> bool:
    """True for ops that draw random numbers (dropout, bernoulli, rand*, custom ops tagged so): never re-run them."""
    return node.op == "call_function" and (node.target in RANDOM_OPS or _tagged_random(node.target))


def _tagged_random(target: Any) -> bool:
    """A custom op tagged random (tandem::bernoulli, a user's own). Not aten's: the tag also marks ops
    that draw only sometimes (SDPA, lstm with dropout 0), which RANDOM_OPS leaves recomputable."""
    tagged = torch.Tag.nondeterministic_seeded in getattr(target, "tags", ())
    return tagged and getattr(target, "namespace", "aten") != "aten"


def is_expensive(node: fx.Node) -> bool:
    """True for ops MXNet's rule does not re-run: matmul/conv/embedding/concat/loss/pooling."""
    return node.op == "call_function" and node.target in EXPENSIVE_OPS


def is_training_batch_norm(node: fx.Node) -> bool:
    """Functional BatchNorm in training mode: outputs (y, batch mean, batch rstd, new running stats)."""
    return (node.op == "call_function" and node.target is aten._native_batch_norm_legit_functional.default
            and bool(node.args[5]))


def is_batch_norm_statistic(node: fx.Node) -> bool:
    """A getitem of a training BatchNorm other than its output y (batch or running statistics)."""
    source = node.args[0] if node.target is operator.getitem else None
    return isinstance(source, fx.Node) and is_training_batch_norm(source) and bool(node.args[1] != 0)


def training_dropout(node: fx.Node) -> tuple[fx.Node, float, fx.Node | None, fx.Node | None] | None:
    """(input, p, output getitem, mask getitem) of a training ``native_dropout`` node, else None.

    The getitems are None when nothing reads that element of the (output, mask) tuple.
    """
    if node.target is not aten.native_dropout.default:
        return None
    source, probability, train = node.args
    if not train or not isinstance(source, fx.Node) or not isinstance(probability, float | int):
        return None
    parts = {user.args[1]: user for user in node.users if user.target is operator.getitem}
    return source, float(probability), parts.get(0), parts.get(1)


def dropout_replay(node: fx.Node) -> tuple[fx.Node, fx.Node, float] | None:
    """(input, mask, scale) when ``node`` is a training dropout's output that its kept mask replays.

    Dropout's output is ``input * mask * scale`` once the mask is drawn, so a recompute that reads
    the saved mask replays the RNG exactly without drawing again; ``native_dropout_backward`` with
    the input as its "gradient" computes exactly that (bit-equal to the forward output on CPU).
    """
    tuple_node = node.args[0] if node.target is operator.getitem and node.args[1] == 0 else None
    dropout = training_dropout(tuple_node) if isinstance(tuple_node, fx.Node) else None
    if dropout is None:
        return None
    source, probability, _, mask = dropout
    if mask is None:
        return None
    scale = 0.0 if probability >= 1 else 1.0 / (1.0 - probability)  # autograd's scale for native_dropout
    return source, mask, scale


def recompute_inputs(node: fx.Node) -> list[fx.Node]:
    """The nodes a recompute of ``node`` reads: its inputs, or for a replayed dropout its input
    (the mask it also reads is kept for the dropout's own backward)."""
    replay = dropout_replay(node)
    return [replay[0]] if replay is not None else list(node.all_input_nodes)


def alias_source(node: fx.Node) -> fx.Node | None:
    """The input whose storage this node's output shares (a view), or None for a fresh output.

    Read from the op schema's alias annotations (``Tensor(a) self -> Tensor(a)``), plus the few
    ops that alias without saying so. A getitem of a list-of-views op (split, chunk, unbind)
    aliases that op's input.
    """
    if node.op != "call_function":
        return None
    if node.target is operator.getitem:
        source = node.args[0]
        return alias_source(source) if isinstance(source, fx.Node) else None
    if node.target in _HIDDEN_ALIASES:
        return _first_node(node.args)
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.returns:
        return None
    alias = schema.returns[0].alias_info
    if alias is None or alias.is_write:
        return None
    for argument, value in zip(schema.arguments, node.args):
        if argument.alias_info is not None and set(argument.alias_info.before_set) & set(alias.before_set):
            return value if isinstance(value, fx.Node) else None
    return _first_node(node.args)


def _first_node(args: Sequence[Any]) -> fx.Node | None:
    return next((a for a in args if isinstance(a, fx.Node)), None)


def is_view(node: fx.Node) -> bool:
    return alias_source(node) is not None


def storage_root(node: fx.Node) -> fx.Node:
    """The node that allocated the storage this node's value lives in (follows views)."""
    while (source := alias_source(node)) is not None:
        node = source
    return node


# -- flops -------------------------------------------------------------------------------------


def flops(node: fx.Node) -> int:
    """Approximate floating-point operations of one run of ``node`` (0 for views and getitems)."""
    if dropout_replay(node) is not None:
        return 2 * _elements(node)  # its recompute: input * mask * scale
    if node.op != "call_function" or node.target is operator.getitem or is_view(node):
        return 0
    target = node.target
    if target in (aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default):
        return _matmul_flops(node)
    if target is aten.convolution.default:
        return _convolution_flops(node)
    if target is aten.convolution_backward.default:
        return 2 * _convolution_flops(node)  # input gradient and weight gradient: one conv each
    return _FLOPS_PER_ELEMENT.get(target, 1) * max(_elements(node), _input_elements(node))  # type: ignore[call-overload]


def _input_elements(node: fx.Node) -> int:
    # Reductions touch every input element once even though their output is small.
    return max((math.prod(_shape(a)) for a in node.all_input_nodes if _shape(a)), default=0)


def _matmul_flops(node: fx.Node) -> int:
    first, second = node.args[-2], node.args[-1]
    inner = _shape(first)[-1] if _shape(first) else 0
    out = _shape(node)
    if not _shape(second):
        return 0
    return 2 * math.prod(out) * inner


def _convolution_flops(node: fx.Node) -> int:
    """2 * output elements * (input channels / groups) * kernel elements."""
    weight = node.args[1] if node.target is aten.convolution.default else node.args[2]
    weight_shape = _shape(weight)
    if node.target is aten.convolution.default:
        out = _shape(node)
    else:  # convolution_backward(grad_output, input, weight, ...): grad_output has the output's shape
        out = _shape(node.args[0])
    if len(weight_shape) < 2 or not out:
        return 0
    return 2 * math.prod(out) * math.prod(weight_shape[1:])
