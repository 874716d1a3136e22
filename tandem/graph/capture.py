"""Capture: nn.Module + loss_fn + example batch -> TrainGraph, with PyTorch's own tracing.

We use ``aot_export_module(..., trace_joint=True)``: it functionalizes the step (BatchNorm's
running-stat updates become outputs), traces autograd's backward into aten ops, and records fake
values (shape, dtype) on every node. Nothing here differentiates by hand.
"""

from __future__ import annotations

import contextlib
import operator
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from tandem.errors import CaptureError
from tandem.graph.train_graph import MetaKey, Phase, TensorSpec, TrainGraph

LossFn = Callable[..., torch.Tensor]
_PREFIX = "module."


class _LossModule(nn.Module):
    """Wraps module + loss_fn so the exported forward returns (loss,), as aot_export needs."""

    def __init__(self, module: nn.Module, loss_fn: LossFn) -> None:
        super().__init__()
        self.module = module
        self.loss_fn = loss_fn

    def forward(self, *batch: torch.Tensor) -> tuple[torch.Tensor]:
        loss = self.loss_fn(self.module, *batch)
        if not isinstance(loss, torch.Tensor):
            raise CaptureError(
                f"loss_fn must return a scalar tensor, got {type(loss).__name__}; "
                "return e.g. F.cross_entropy(module(x), y)"
            )
        if loss.dim() != 0:
            raise CaptureError(
                f"loss_fn must return a scalar (0-dim) tensor, got shape {list(loss.shape)}; "
                "reduce it, e.g. loss.mean() or reduction='mean'"
            )
        return (loss,)


def capture(module: nn.Module, loss_fn: LossFn, batch: Sequence[torch.Tensor]) -> TrainGraph:
    """Trace one training step of ``loss_fn(module, *batch)`` into a TrainGraph."""
    _check_arguments(module, loss_fn, batch)
    wrapper = _LossModule(module, loss_fn)
    try:
        graph_module, signature = _export(wrapper, batch, frozen=[])
    except _UnusedParameter:  # rare: probe once which parameters no gradient reaches, export again
        graph_module, signature = _export(wrapper, batch, frozen=_unused_parameters(wrapper, batch))
    return _to_train_graph(graph_module, signature, batch, _alias_groups(module))


class _EvalModule(_LossModule):
    """For inference capture: returns (loss, the module's own output) in one forward."""

    def forward(self, *batch: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        seen: list[Any] = []
        handle = self.module.register_forward_hook(lambda _m, _i, output: seen.append(output))
        try:
            (loss,) = super().forward(*batch)
        finally:
            handle.remove()
        if not seen or not isinstance(seen[-1], torch.Tensor):
            raise CaptureError("inference capture needs loss_fn to call the module once and the module to return a tensor")
        return (loss, seen[-1])


def capture_inference(module: nn.Module, loss_fn: LossFn, batch: Sequence[torch.Tensor]) -> TrainGraph:
    """Trace the forward of ``loss_fn(module, *batch)`` in eval mode: loss and module output, no backward."""
    from torch._functorch.aot_autograd import aot_export_module

    _check_arguments(module, loss_fn, batch)
    wrapper = _EvalModule(module, loss_fn)
    was_training = module.training
    module.eval()
    try:
        with _module_stack(wrapper) as stack, torch.random.fork_rng(devices=[]):
            try:
                graph_module, signature = aot_export_module(wrapper, tuple(batch), trace_joint=False)
            except CaptureError:
                raise
            except Exception as error:
                raise _explain(error, stack) from error
    finally:
        module.train(was_training)
    return _to_train_graph(graph_module, signature, batch, _alias_groups(module), inference=True)


class _UnusedParameter(Exception):
    pass


def _check_arguments(module: Any, loss_fn: Any, batch: Sequence[Any]) -> None:
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"tandem.compile needs a torch.nn.Module, got {type(module).__name__}; "
            "wrap plain functions in an nn.Module"
        )
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable as loss_fn(module, *batch), got {type(loss_fn).__name__}")
    if not batch:
        raise ValueError("give an example batch: tandem.compile(module, loss_fn, x, y)")
    for i, item in enumerate(batch):
        if not isinstance(item, torch.Tensor):
            raise TypeError(f"batch element {i} is a {type(item).__name__}; every batch element must be a tensor")
    if not any(p.requires_grad for p in module.parameters()):
        raise ValueError("the module has no parameter that requires grad: there is nothing to train")


# -- export ------------------------------------------------------------------------------


def _export(wrapper: _LossModule, batch: Sequence[torch.Tensor], frozen: list[nn.Parameter]) -> tuple[Any, Any]:
    from torch._functorch.aot_autograd import aot_export_module

    # fork_rng: tracing draws random numbers (dropout); the user's RNG stream must not move.
    with _module_stack(wrapper) as stack, _frozen(frozen), torch.random.fork_rng(devices=[]):
        try:
            return aot_export_module(wrapper, tuple(batch), trace_joint=True, output_loss_index=0)
        except CaptureError:
            raise
        except AssertionError as error:
            if "did not receive a gradient" in str(error):
                raise _UnusedParameter() from error
            raise _explain(error, stack) from error
        except Exception as error:  # name the module and the op, keep the original for the details
            raise _explain(error, stack) from error


def _unused_parameters(wrapper: _LossModule, batch: Sequence[torch.Tensor]) -> list[nn.Parameter]:
    """Trainable parameters the loss does not depend on, found by one eager step on copies.

    Copies keep the module's buffers (BN stats) untouched; fork_rng keeps the RNG stream untouched.
    """
    params = {n: p.detach().clone().requires_grad_(p.requires_grad) for n, p in wrapper.named_parameters()}
    buffers = {n: b.detach().clone() for n, b in wrapper.named_buffers()}
    with torch.random.fork_rng(devices=[]), torch.enable_grad():
        (loss,) = torch.func.functional_call(wrapper, {**params, **buffers}, tuple(batch))
        trainable = [n for n, p in params.items() if p.requires_grad]
        grads = torch.autograd.grad(loss, [params[n] for n in trainable], allow_unused=True)
    live = dict(wrapper.named_parameters())
    return [live[n] for n, g in zip(trainable, grads) if g is None]


@contextlib.contextmanager
def _frozen(parameters: list[nn.Parameter]) -> Iterator[None]:
    """Parameters no gradient reaches are exported as constants (their grad stays absent, as in eager)."""
    for p in parameters:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p in parameters:
            p.requires_grad_(True)


@contextlib.contextmanager
def _module_stack(root: nn.Module) -> Iterator[list[str]]:
    """Track which submodule is running, so capture errors can name its path."""
    stack: list[str] = []
    handles = []

    def enter(name: str) -> Callable[..., None]:
        return lambda *_: stack.append(name)  # list.append returns None: the input is unchanged

    def leave(name: str) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            if stack and stack[-1] == name:
                stack.pop()

        return hook

    for path, sub in root.named_modules():
        if path:
            name = path.removeprefix(_PREFIX) if path != "module" else "<root>"
            handles.append(sub.register_forward_pre_hook(enter(name)))
            handles.append(sub.register_forward_hook(leave(name)))
    try:
        yield stack
    finally:
        for handle in handles:
            handle.remove()


_OP_PATTERN = re.compile(r"\b(aten\.[\w.]+|[a-z_]\w*::\w+)")


def _explain(error: Exception, stack: list[str]) -> CaptureError:
    text = str(error).strip().splitlines()
    first = text[0] if text else type(error).__name__
    ops = _OP_PATTERN.findall(str(error))
    where = f"module '{stack[-1]}'" if stack else "loss_fn (outside any submodule)"
    op = f" at op {ops[0]}" if ops else ""
    hint = (
        "tandem captures the step with PyTorch's tracer: data-dependent Python control flow, "
        ".item()/.tolist()/.numpy() and ops without a meta kernel cannot be captured; "
        "make the code shape-static or move that work outside the module"
    )
    return CaptureError(f"cannot capture the step in {where}{op}: {type(error).__name__}: {first}. {hint}")


# -- TrainGraph ----------------------------------------------------------------------------


def _to_train_graph(graph_module: Any, signature: Any, batch: Sequence[torch.Tensor],
                    aliases: dict[str, list[str]], inference: bool = False) -> TrainGraph:
    """Name the exported graph's placeholders and outputs; inference graphs also output the module's result."""
    graph: fx.Graph = graph_module.graph
    by_name = {n.name: n for n in graph.nodes}
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    param_names = [signature.inputs_to_parameters[n.name] for n in placeholders if n.name in signature.inputs_to_parameters]
    buffer_names = [signature.inputs_to_buffers[n.name] for n in placeholders if n.name in signature.inputs_to_buffers]
    backward = signature.backward_signature
    grads = {p: by_name[n] for n, p in backward.gradients_to_parameters.items()} if backward is not None else {}
    train_graph = TrainGraph(
        graph=graph,
        param_names=[_strip(n) for n in param_names],
        buffer_names=[_strip(n) for n in buffer_names],
        input_specs=[TensorSpec.of(t) for t in batch],
        loss=by_name[signature.user_outputs[0]],
        grads={_strip(p): grads[p] for p in param_names if p in grads},
        buffer_updates={_strip(b): by_name[n] for n, b in signature.buffers_to_mutate.items()},
        model_output=by_name[signature.user_outputs[1]] if inference else None,
    )
    _merge_tied_gradients(train_graph, aliases)
    train_graph.aliases = {other: first for first, names in aliases.items() for other in names[1:]}
    _drop_detach(graph)
    _record_module_paths(graph)
    train_graph.set_outputs()
    graph.eliminate_dead_code()
    return order_by_phase(train_graph)


def _alias_groups(module: nn.Module) -> dict[str, list[str]]:
    """First name of each tied parameter -> all its names (export feeds each name separately)."""
    first: dict[int, str] = {}
    groups: dict[str, list[str]] = {}
    for name, parameter in module.named_parameters(remove_duplicate=False):
        groups.setdefault(first.setdefault(id(parameter), name), []).append(name)
    return {name: names for name, names in groups.items() if len(names) > 1}


def _merge_tied_gradients(train_graph: TrainGraph, aliases: dict[str, list[str]]) -> None:
    """A tied parameter's gradient is the sum of what each of its names received; keep the first name."""
    grads = train_graph.grads
    for first, names in aliases.items():
        parts = [grads.pop(name) for name in names if name in grads]
        if not parts:
            continue
        total = parts[0]
        for part in parts[1:]:
            with train_graph.graph.inserting_before(train_graph.output_node):
                total = train_graph.graph.call_function(torch.ops.aten.add.Tensor, (total, part))
            total.meta["val"] = parts[0].meta.get("val")
        grads[first] = total
    order = [name for name in train_graph.param_names if name in grads]
    train_graph.grads = {name: grads[name] for name in order}


def _strip(name: str) -> str:
    return name.removeprefix(_PREFIX)


def _drop_detach(graph: fx.Graph) -> None:
    # detach only matters to autograd, which the captured graph no longer uses.
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is torch.ops.aten.detach.default:
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)


def _record_module_paths(graph: fx.Graph) -> None:
    for node in graph.nodes:
        stack = node.meta.get("nn_module_stack")
        if stack:
            path = list(stack.values())[-1][0]
            node.meta[MetaKey.MODULE_PATH] = _strip(str(path).removeprefix("L['self'].").removeprefix("self."))


def order_by_phase(train_graph: TrainGraph) -> TrainGraph:
    """Mark each node forward or backward and put all forward nodes first (stable order).

    Forward is what the loss, the buffer updates (and an inference graph's module output) need;
    everything else serves the gradients.
    """
    graph = train_graph.graph
    forward: set[fx.Node] = set()
    extra = [train_graph.model_output] if train_graph.model_output is not None else []
    pending = [train_graph.loss, *train_graph.buffer_updates.values(), *extra]
    while pending:
        node = pending.pop()
        if node in forward or node.op == "placeholder":
            continue
        forward.add(node)
        pending.extend(node.all_input_nodes)
    for node in graph.nodes:  # a tuple lives until its last getitem: take them all out in forward
        if node.target is operator.getitem and node.args[0] in forward:
            forward.add(node)
    for node in graph.nodes:
        if node.op == "call_function":
            node.meta[MetaKey.PHASE] = Phase.FORWARD if node in forward else Phase.BACKWARD
    backward = [n for n in graph.nodes if n.op == "call_function" and n not in forward]
    anchor = train_graph.output_node
    for node in backward:  # move in order to just before the output: forward nodes end up first
        anchor.prepend(node)
    graph.lint()
    return train_graph
