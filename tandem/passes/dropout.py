"""Dropout in eager PyTorch's form when nothing is mirrored: a float noise tensor, not a bool mask.

Capture yields ``native_dropout``, which returns a 1-byte bool mask for the backward. On the CPU
both its forward and ``native_dropout_backward`` convert that mask to float on every use (an
allocation and a pass over the tensor each time): gpt's step spent ~3 % more than eager on it.
Eager's dropout keeps ``noise = bernoulli(1 - p) / (1 - p)`` as a float tensor instead, so its
backward is one multiply. Without mirroring tandem keeps what eager keeps, in eager's form; the
mirroring policies keep the 1-byte mask (3 bytes less per element) and replay dropout outputs
from it, trading those conversions for memory. Same random draw either way: the CPU kernel draws
a float Bernoulli tensor in both forms, so the RNG stream and the mask are those of eager. The draw
is ``tandem::bernoulli`` (``tandem.backends.bernoulli``): eager's noise tensor, in the input's
layout (``aten.bernoulli.p`` would draw a channels-last input's noise in another order), and on
most non-Intel CPUs vectorised.

On CUDA (and the other devices ``at::dropout`` hands to ``native_dropout``: XPU, lazy, PrivateUse1)
eager runs the fused ``native_dropout`` kernel itself, whose draw differs from a Bernoulli tensor's:
there the captured node stays, so the masks are eager's there too.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from tandem.backends import bernoulli
from tandem.graph import cost
from tandem.graph.train_graph import TrainGraph
from tandem.passes.config import PlanConfig

aten = torch.ops.aten
FUSED_DROPOUT_DEVICES = frozenset({"cuda", "xpu", "lazy", "privateuseone"})  # at::dropout's is_fused_kernel_acceptable


def eager_runs_native_dropout(device: torch.device) -> bool:
    """Whether eager's ``F.dropout`` on ``device`` is the fused ``native_dropout`` kernel (not the noise form).

    A PrivateUse1 backend usually renames itself (``rename_privateuse1_backend("npu")``): its tensors
    report that name as their device type."""
    return device.type in FUSED_DROPOUT_DEVICES or device.type == torch._C._get_privateuse1_backend_name()


def dropout_pass(graph: TrainGraph, config: PlanConfig) -> TrainGraph:
    """Rewrite training ``native_dropout`` into eager's noise form when the mirror policy is off."""
    if config.mirror.name != "off":
        return graph
    for node in [n for n in graph.op_nodes() if n.target is aten.native_dropout.default]:
        _to_noise_form(graph, node)
    return graph


def _to_noise_form(graph: TrainGraph, dropout: fx.Node) -> None:
    parts = cost.training_dropout(dropout)
    if parts is None:
        return
    source, probability, output, mask = parts
    backwards = list(mask.users) if mask is not None else []
    if not 0 < probability < 1 or output is None:
        return
    value = source.meta.get("val")
    if not isinstance(value, torch.Tensor):
        return  # no traced value to tell the device by: native_dropout is exact everywhere, only slower on the CPU
    if eager_runs_native_dropout(value.device):
        return  # eager's dropout is native_dropout itself there
    if any(user.target is not aten.native_dropout_backward.default for user in backwards):
        return  # the mask is read some other way: leave this dropout as captured
    keep = 1.0 - probability
    with graph.graph.inserting_before(dropout):
        # eager's noise, empty_like(source).bernoulli_(keep): the source's layout, drawn in memory order
        drawn = _like(graph, dropout, output, bernoulli.OP, (source, keep))
        noise = _like(graph, dropout, output, aten.div.Tensor, (drawn, keep))
        value = _like(graph, dropout, output, aten.mul.Tensor, (source, noise))
    output.replace_all_uses_with(value)
    for backward in backwards:
        with graph.graph.inserting_before(backward):
            gradient = _like(graph, backward, backward, aten.mul.Tensor, (backward.args[0], noise))
        backward.replace_all_uses_with(gradient)
        graph.graph.erase_node(backward)
    for part in (output, mask):  # the draw must go too (a random op is never dead code): one draw per dropout
        if part is not None:
            graph.graph.erase_node(part)
    graph.graph.erase_node(dropout)


def _like(graph: TrainGraph, origin: fx.Node, shaped: fx.Node, target: Any, args: tuple[Any, ...]) -> fx.Node:
    """A new node with ``origin``'s tandem metadata (phase, module path) and ``shaped``'s value."""
    node = graph.graph.call_function(target, args)
    node.meta = {**{k: v for k, v in origin.meta.items() if k.startswith("tandem_")}, "val": shaped.meta.get("val")}
    return node
