"""One joint (forward + backward) trace of a module: ``aot_export_module(..., trace_joint=True)``
without its second trace.

``aot_export_module`` traces the joint graph once (functionalized, on fake tensors, autograd's
backward included), then traces that graph a second time with ``make_fx`` on the caller's real
tensors, only to flatten its calling convention: pytrees ``(primals, tangents)`` in, ``(forward
outputs, one gradient or None per input)`` out. The second trace runs every op on real data and
builds a fake-tensor mode per node for its metadata: about half of the export's time. Here the
flattening is a graph edit and the signature comes from the same ``create_graph_signature``: the
same computation and signature. (The retrace also adds ``detach`` nodes and unused ``getitem``s,
which capture drops anyway, and reads a tied parameter through its last name, where this graph
reads each name's own input.)

Private torch APIs: torch is pinned to one version (pyproject.toml), and
tests/graph/test_capture.py compares this export with ``aot_export_module``'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn

UNUSED_PARAMETER = "did not receive a gradient"  # the text aot_export_module raises for such a parameter


def export_joint(module: nn.Module, args: Sequence[torch.Tensor], loss_index: int = 0) -> tuple[fx.GraphModule, Any]:
    """The joint graph of ``module(*args)`` (which returns a tuple whose ``loss_index`` is a scalar
    loss) and its ``GraphSignature``, as ``aot_export_module(module, args, trace_joint=True,
    output_loss_index=loss_index)`` returns them.

    Raises AssertionError naming ``UNUSED_PARAMETER`` when a trainable parameter gets no gradient.
    """
    from torch._functorch._aot_autograd.graph_capture_wrappers import create_functional_call
    from torch._functorch._aot_autograd.input_output_analysis import create_graph_signature
    from torch._functorch.aot_autograd import _aot_export_function

    named_parameters = dict(module.named_parameters(remove_duplicate=False))
    named_buffers = dict(module.named_buffers(remove_duplicate=False))
    state, state_spec = pytree.tree_flatten({**named_parameters, **named_buffers})
    functional_call = create_functional_call(module, state_spec, len(state), store_orig_mod=True)
    output_counts: list[int] = []

    def forward(*arguments: Any) -> Any:  # aot_export_module's checks on a joint trace's outputs
        outputs = functional_call(*arguments)
        outputs = (outputs,) if isinstance(outputs, torch.Tensor) else outputs
        if not isinstance(outputs, tuple | list):
            raise RuntimeError(f"the module must return a tensor or a tuple of tensors, got {type(outputs).__name__}")
        loss = outputs[loss_index]
        if not loss.requires_grad:
            raise RuntimeError(f"the loss (output {loss_index}) does not require gradients: no parameter reaches it")
        if loss.numel() != 1:
            raise RuntimeError(f"the loss (output {loss_index}) must be a scalar, got shape {list(loss.shape)}")
        others = [k for k, o in enumerate(outputs) if k != loss_index and isinstance(o, torch.Tensor) and o.requires_grad]
        if others:
            raise RuntimeError(f"outputs {others} require gradients; only the loss (output {loss_index}) may")
        output_counts.append(len(outputs))
        return outputs

    inputs = (*state, *args)
    joint, metadata, in_spec, out_spec = _aot_export_function(
        forward, inputs, num_params_buffers=len(state), no_tangents=True, trace_joint=True
    )
    assert isinstance(joint, fx.GraphModule) and out_spec is not None  # what a joint export returns
    if metadata.tokens or metadata.num_backward_tokens:
        raise RuntimeError("the step calls ops with side effects (print, linalg error checks, torchbind "
                           "calls) that AOT autograd orders with tokens; move them out of the module")
    _flatten_calling_convention(joint, inputs, len(state))
    signature = create_graph_signature(
        joint, metadata, in_spec, out_spec,
        user_args_flat=list(args), params_and_buffers_flat=list(state),
        param_names=list(named_parameters), buffer_names=list(named_buffers),
        trace_joint=True, num_user_fw_outs=output_counts[0], loss_index=loss_index,
    )
    return joint, signature


def _flatten_calling_convention(joint: fx.GraphModule, inputs: Sequence[Any], num_state: int) -> None:
    """Make ``joint`` take the inputs flat and return its forward outputs, then the gradients of
    the inputs that require grad: what ``aot_export_module``'s second trace produces.

    The joint's pytree specs say where the primals end and which outputs are gradients; anything
    else than ``(primals, tangents) -> (forward outputs, one gradient per primal)`` is refused."""
    graph = joint.graph
    specs = graph._codegen.pytree_info  # type: ignore[attr-defined]
    primals_spec, _ = specs.in_spec.children()
    if primals_spec.num_leaves != len(inputs):
        raise AssertionError(f"the joint graph takes {primals_spec.num_leaves} primals for {len(inputs)} inputs")
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    tangents = placeholders[len(inputs):]  # the loss's tangent is ones_like inside the graph
    if any(t.users for t in tangents):
        raise AssertionError(f"the joint graph reads its tangents {[t.name for t in tangents if t.users]}")
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    forward_outputs, gradients = pytree.tree_unflatten(list(output.args[0]), specs.out_spec)
    if len(gradients) != len(inputs):
        raise AssertionError(f"the joint graph returns {len(gradients)} gradients for {len(inputs)} inputs")
    kept = []
    for position, (value, gradient) in enumerate(zip(inputs, gradients)):
        requires_grad = isinstance(value, torch.Tensor) and value.requires_grad
        if requires_grad and gradient is None and position < num_state:
            raise AssertionError(f"input {position} is a parameter that {UNUSED_PARAMETER}")
        if requires_grad and gradient is None:  # not the unused-parameter case capture retries
            raise RuntimeError(f"batch tensor {position - num_state} requires grad but the loss does not depend "
                               "on it; pass it detached (x.detach())")
        if not requires_grad and gradient is not None:
            raise AssertionError(f"input {position} does not require grad but has a gradient")
        if requires_grad:
            kept.append(gradient)
    output.args = (tuple(list(forward_outputs) + kept),)
    for tangent in tangents:
        graph.erase_node(tangent)
    graph._codegen = fx.graph.CodeGen()  # plain positional inputs and a tuple out, no pytrees
    joint.recompile()
