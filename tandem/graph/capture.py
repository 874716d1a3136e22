"""Capture: nn.Module + loss_fn + example batch -> TrainGraph, with PyTorch's own tracing.

We use AOT autograd's joint export (``aot_export_module(..., trace_joint=True)``, traced once:
tandem/graph/joint.py): it functionalizes the step (BatchNorm's running-stat updates become
outputs), traces autograd's backward into aten ops, and records fake values (shape, dtype) on every
node. Nothing here differentiates by hand.

Library code asks "am I being traced?" through ``torch.compiler.is_compiling()`` and, when the
answer is no, runs eager-only checks (``bool(mask.all())``) that no tracer can capture. We trace
under the same compiling state that ``torch.export``'s non-strict tracing sets, so transformers,
timm and friends take the code path they take under ``torch.compile``.
"""

from __future__ import annotations

import contextlib
import operator
import os
import re
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from tandem.errors import CaptureError
from tandem.graph import capture_cache
from tandem.graph.batch import BatchLayout
from tandem.graph.joint import UNUSED_PARAMETER, export_joint
from tandem.graph.train_graph import MetaKey, Phase, TrainGraph

LossFn = Callable[..., Any]
_PREFIX = "module."


class _LossModule(nn.Module):
    """Wraps module + loss_fn so the exported forward takes the batch's tensor leaves and returns
    (loss,), as aot_export needs."""

    def __init__(self, module: nn.Module, loss_fn: LossFn, layout: BatchLayout) -> None:
        super().__init__()
        self.module = module
        self.loss_fn = loss_fn
        self.layout = layout

    def forward(self, *tensors: torch.Tensor) -> tuple[torch.Tensor]:
        loss = self.loss_fn(self.module, *self.layout.unflatten(tensors))
        if not isinstance(loss, torch.Tensor):
            raise CaptureError(
                f"loss_fn must return a scalar tensor, got {type(loss).__name__}; "
                "return e.g. F.cross_entropy(module(x), y) or module(**batch).loss"
            )
        if loss.dim() != 0:
            raise CaptureError(
                f"loss_fn must return a scalar (0-dim) tensor, got shape {list(loss.shape)}; "
                "reduce it, e.g. loss.mean() or reduction='mean'"
            )
        return (loss,)


def capture(module: nn.Module, loss_fn: LossFn, batch: Sequence[Any], checkpoint_regions: bool = True) -> TrainGraph:
    """Trace one training step of ``loss_fn(module, *batch)`` into a TrainGraph.

    ``batch`` holds tensors or pytrees of them (dicts, tuples); the graph takes the tensor leaves.
    With ``checkpoint_regions``, forward nodes that ran inside ``torch.utils.checkpoint`` are marked
    (``MetaKey.CHECKPOINT``), so the mirror pass recomputes them in backward as eager would.
    A graph this or an earlier process captured for the same key is loaded from the capture cache
    instead (``tandem/graph/capture_cache.py``: what the key holds, ``TANDEM_CAPTURE_CACHE=0``).
    """
    layout, tensors = _check_arguments(module, loss_fn, batch)
    caching = capture_cache.enabled()
    cache_key = capture_cache.key(module, loss_fn, layout, {"checkpoint_regions": checkpoint_regions}) \
        if caching else None
    cached = capture_cache.load(cache_key, module, loss_fn, layout) if cache_key is not None else None
    if cached is not None:
        cached.notes["capture_cache"] = "hit"
        return cached
    wrapper = _LossModule(module, loss_fn, layout)
    try:
        graph_module, signature = _export(wrapper, tensors, [])
    except _UnusedParameter:  # rare: probe once which parameters no gradient reaches, export again
        graph_module, signature = _export(wrapper, tensors, _unused_parameters(wrapper, tensors))
    train_graph = _to_train_graph(graph_module, signature, layout, _alias_groups(module),
                                  checkpoint_regions=checkpoint_regions)
    stored = cache_key is not None and capture_cache.store(cache_key, train_graph)
    train_graph.notes["capture_cache"] = "miss" if stored else "bypass" if caching else "off"
    return train_graph


class _EvalModule(_LossModule):
    """For inference capture: returns (loss, the module's own output) in one forward."""

    def forward(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        seen: list[Any] = []
        handle = self.module.register_forward_hook(lambda _m, _i, output: seen.append(output))
        try:
            (loss,) = super().forward(*tensors)
        finally:
            handle.remove()
        output = _main_output(seen[-1]) if seen else None
        if output is None:
            raise CaptureError("inference capture needs loss_fn to call the module once and the module to return "
                               "a tensor (or an output object with .logits)")
        return (loss, output)


def _main_output(output: Any) -> torch.Tensor | None:
    """The tensor a module's result stands for: itself, a transformers output's ``logits``, or its
    first tensor."""
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    return next((leaf for leaf in torch.utils._pytree.tree_leaves(output) if isinstance(leaf, torch.Tensor)), None)


def capture_inference(module: nn.Module, loss_fn: LossFn, batch: Sequence[Any]) -> TrainGraph:
    """Trace the forward of ``loss_fn(module, *batch)`` in eval mode: loss and module output, no backward."""
    from torch._functorch.aot_autograd import aot_export_module

    layout, tensors = _check_arguments(module, loss_fn, batch)
    wrapper = _EvalModule(module, loss_fn, layout)
    was_training = module.training
    module.eval()
    try:
        with _tracing(wrapper, tensors) as stack:
            try:
                graph_module, signature = aot_export_module(wrapper, tuple(tensors), trace_joint=False)
            except CaptureError:
                raise
            except Exception as error:
                raise _explain(error, stack) from error
    finally:
        module.train(was_training)
    return _to_train_graph(graph_module, signature, layout, _alias_groups(module), inference=True)


class _UnusedParameter(Exception):
    pass


def _check_arguments(module: Any, loss_fn: Any, batch: Sequence[Any]) -> tuple[BatchLayout, list[torch.Tensor]]:
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"tandem.compile needs a torch.nn.Module, got {type(module).__name__}; "
            "wrap plain functions in an nn.Module"
        )
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable as loss_fn(module, *batch), got {type(loss_fn).__name__}")
    if not batch:
        raise ValueError("give an example batch: tandem.compile(module, loss_fn, x, y)")
    layout, tensors = BatchLayout.of(batch)
    if not tensors:
        raise TypeError(f"the batch {layout} holds no tensor; pass tensors, or dicts/tuples of tensors")
    if not any(p.requires_grad for p in module.parameters()):
        raise ValueError("the module has no parameter that requires grad: there is nothing to train")
    return layout, tensors


# -- export ------------------------------------------------------------------------------


def _export(wrapper: _LossModule, tensors: Sequence[torch.Tensor], unused: list[str]) -> tuple[Any, Any]:
    with _tracing(wrapper, tensors) as stack, _without_gradient(wrapper, unused):
        try:
            return export_joint(wrapper, tuple(tensors))
        except CaptureError:
            raise
        except AssertionError as error:
            if UNUSED_PARAMETER in str(error) and not unused:
                raise _UnusedParameter() from error
            raise _explain(error, stack) from error
        except Exception as error:  # name the user's line, the module and the op; keep the original
            raise _explain(error, stack) from error


def _unused_parameters(wrapper: _LossModule, tensors: Sequence[torch.Tensor]) -> list[str]:
    """Names (every alias) of trainable parameters the loss does not reach, by one eager step on copies.

    Each name gets its own copy, so a tied parameter's alias no module calls (T5's ``shared``)
    shows up here while its used aliases do not. Copies keep the module's buffers (BN stats)
    untouched; fork_rng keeps the RNG stream untouched.
    """
    params = {n: p.detach().clone().requires_grad_(p.requires_grad)
              for n, p in wrapper.named_parameters(remove_duplicate=False)}
    buffers = {n: b.detach().clone() for n, b in wrapper.named_buffers(remove_duplicate=False)}
    with _forked_rng(tensors), torch.enable_grad(), _compiling():
        (loss,) = torch.func.functional_call(wrapper, {**params, **buffers}, tuple(tensors), tie_weights=False)
        trainable = [n for n, p in params.items() if p.requires_grad]
        grads = torch.autograd.grad(loss, [params[n] for n in trainable], allow_unused=True)
    return [n for n, g in zip(trainable, grads) if g is None]


@contextlib.contextmanager
def _without_gradient(root: nn.Module, names: list[str]) -> Iterator[None]:
    """Export the named parameters as constants: no gradient reaches them, so none is computed (as in eager).

    An untied parameter is frozen. An alias of a tied parameter that other names use is hidden
    from ``named_parameters`` instead (it stays reachable as a plain attribute): freezing it would
    freeze the used aliases too.
    """
    users: dict[int, int] = {}
    for _, parameter in root.named_parameters(remove_duplicate=False):
        users[id(parameter)] = users.get(id(parameter), 0) + 1
    unused: dict[str, nn.Parameter] = {n: root.get_parameter(n) for n in names}
    frozen: list[nn.Parameter] = []
    hidden: list[tuple[nn.Module, str, dict[str, Any]]] = []
    for name, parameter in unused.items():
        aliases_unused = sum(1 for p in unused.values() if p is parameter)
        if users[id(parameter)] > aliases_unused:
            owner_path, _, leaf = name.rpartition(".")
            owner = root.get_submodule(owner_path)
            hidden.append((owner, leaf, dict(owner._parameters)))
        elif parameter.requires_grad:
            frozen.append(parameter)
    for owner, leaf, _ in hidden:
        owner.__dict__[leaf] = owner._parameters.pop(leaf)  # plain attribute: the module's code still finds it
    for parameter in frozen:
        parameter.requires_grad_(False)
    try:
        yield
    finally:
        for parameter in frozen:
            parameter.requires_grad_(True)
        for owner, leaf, saved in hidden:
            del owner.__dict__[leaf]
            owner._parameters.clear()
            owner._parameters.update(saved)  # the original order: named_parameters() is unchanged


@contextlib.contextmanager
def _compiling() -> Iterator[None]:
    """The compiling/exporting state torch.export's non-strict tracing sets (torch._export.utils)."""
    compiling, exporting = torch.compiler._is_compiling_flag, torch.compiler._is_exporting_flag
    torch.compiler._is_compiling_flag = torch.compiler._is_exporting_flag = True
    try:
        yield
    finally:
        torch.compiler._is_compiling_flag, torch.compiler._is_exporting_flag = compiling, exporting


@contextlib.contextmanager
def _tracing(root: nn.Module, tensors: Sequence[torch.Tensor]) -> Iterator[list[str]]:
    """Everything a trace runs under: the compiling state, a fork of the RNG (tracing draws random
    numbers for dropout; the user's stream must not move), the module stack for error messages,
    and the marks of checkpoint regions."""
    with _compiling(), _forked_rng(tensors), _module_stack(root) as stack, _without_stack_traces():
        yield stack


@contextlib.contextmanager
def _without_stack_traces() -> Iterator[None]:
    """Skip recording a Python stack per traced node (``node.meta["stack_trace"]``): tandem reads none,
    and extracting them costs about a tenth of a capture. Capture errors name the user's line from
    the exception's own traceback."""
    if not hasattr(fx.config, "do_not_emit_stack_traces"):  # torch < 2.13 (a GPU image's own torch) records them
        yield
        return
    saved = fx.config.do_not_emit_stack_traces
    fx.config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        fx.config.do_not_emit_stack_traces = saved


def _forked_rng(tensors: Sequence[torch.Tensor]) -> contextlib.AbstractContextManager[Any]:
    """Fork the CPU generator and the generators of the accelerator the batch lives on."""
    accelerators = {t.device for t in tensors if t.device.type != "cpu"}
    device_type = next(iter(accelerators)).type if accelerators else "cuda"
    return torch.random.fork_rng(devices=[d.index or 0 for d in accelerators], device_type=device_type)


@contextlib.contextmanager
def _module_stack(root: nn.Module) -> Iterator[list[str]]:
    """Track which submodule is running, so capture errors can name its path; mark the inputs and
    outputs of each outermost module called inside a non-reentrant ``torch.utils.checkpoint``
    region with ``tandem::checkpoint_mark`` ops."""
    stack: list[str] = []
    regions: list[Any] = []  # the saved-tensor hook of each region seen; its index names the region
    marked: list[tuple[nn.Module, int]] = []  # the outermost module of the region now running, its region
    handles = []

    def enter(name: str) -> Callable[..., Any]:
        def hook(module: nn.Module, args: Any, kwargs: Any) -> Any:
            stack.append(name)
            hook = _checkpoint_hook()
            if marked or hook is None:
                return None
            # one region per checkpoint call: the modules a checkpointed function calls in turn share it
            index = next((i for i, seen in enumerate(regions) if seen is hook), len(regions))
            if index == len(regions):
                regions.append(hook)  # held until the trace ends, so no later region reuses its id
            marked.append((module, index))
            return _mark((args, kwargs), index, begin=True)

        return hook

    def leave(name: str) -> Callable[..., Any]:
        def hook(module: nn.Module, _args: Any, output: Any) -> Any:
            if stack and stack[-1] == name:
                stack.pop()
            if marked and marked[-1][0] is module:
                _, index = marked.pop()
                return _mark(output, index, begin=False)
            return None

        return hook

    for path, sub in root.named_modules():
        if path:
            name = path.removeprefix(_PREFIX) if path != "module" else "<root>"
            handles.append(sub.register_forward_pre_hook(enter(name), with_kwargs=True))
            handles.append(sub.register_forward_hook(leave(name)))
    try:
        yield stack
    finally:
        for handle in handles:
            handle.remove()


def _checkpoint_hook() -> Any:
    """The saved-tensor hook of the non-reentrant checkpoint region running now, or None outside any.

    ``torch.utils.checkpoint(use_reentrant=False)`` runs its function under saved-tensor hooks of
    its own (one pair per call); the export flattens them away (nothing is recomputed), so we mark
    where each region ran.
    """
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(True)
    if hooks is None or "_checkpoint_hook" not in getattr(hooks[0], "__qualname__", ""):
        return None
    return hooks[0]


@torch.library.custom_op("tandem::checkpoint_mark", mutates_args=())
def _checkpoint_mark(x: torch.Tensor, region: int, begin: bool) -> torch.Tensor:
    """Identity that survives tracing: where a checkpoint region begins or ends (removed after capture)."""
    return x.clone()


@_checkpoint_mark.register_fake
def _(x: torch.Tensor, region: int, begin: bool) -> torch.Tensor:
    return torch.empty_like(x)


_checkpoint_mark.register_autograd(lambda _context, grad: (grad, None, None))


def _mark(tree: Any, region: int, begin: bool) -> Any:
    return torch.utils._pytree.tree_map_only(
        torch.Tensor, lambda t: _checkpoint_mark(t, region, begin) if t.is_floating_point() else t, tree)


_MARK = torch.ops.tandem.checkpoint_mark.default
_OP_PATTERN = re.compile(r"\b(aten\.[\w.]+|[a-z_]\w*::\w+)")


def _explain(error: Exception, stack: list[str]) -> CaptureError:
    text = str(error).strip().splitlines()
    first = text[0] if text else type(error).__name__
    ops = _OP_PATTERN.findall(str(error))
    where = f"module '{stack[-1]}'" if stack else "loss_fn (outside any submodule)"
    line = _user_line(error)
    at_line = f" ({line})" if line else ""
    op = f" at op {ops[0]}" if ops else ""
    hint = (
        "tandem captures the step with PyTorch's tracer: data-dependent Python control flow, "
        ".item()/.tolist()/.numpy() and ops without a meta kernel cannot be captured; "
        "make that code shape-static (e.g. torch.where instead of an if on a tensor), guard it with "
        "torch.compiler.is_compiling(), or move it outside the module"
    )
    return CaptureError(f"cannot capture the step in {where}{at_line}{op}: {type(error).__name__}: {first}. {hint}")


_TORCH_DIR = os.path.dirname(torch.__file__)
_TANDEM_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_PYTHON_DIR = os.path.dirname(contextlib.__file__)


def _user_line(error: BaseException) -> str | None:
    """``file:line in function`` of the innermost frame outside torch, tandem and the standard
    library: the user's (or the model library's) code that ran the op."""
    found: str | None = None
    seen: set[int] = set()
    current: BaseException | None = error
    chain = []
    while current is not None and id(current) not in seen:  # the error and what it was raised from
        seen.add(id(current))
        chain.append(current)
        current = current.__cause__ or current.__context__
    for exception in reversed(chain):  # outermost first: the innermost user frame wins
        for frame in traceback.extract_tb(exception.__traceback__):
            path = os.path.abspath(frame.filename)
            if path.startswith((_TORCH_DIR, _TANDEM_DIR, _PYTHON_DIR)) or frame.filename.startswith("<"):
                continue
            found = f"{frame.filename}:{frame.lineno} in {frame.name}"
    return found


# -- TrainGraph ----------------------------------------------------------------------------


def _to_train_graph(graph_module: Any, signature: Any, layout: BatchLayout, aliases: dict[str, list[str]],
                    inference: bool = False, checkpoint_regions: bool = True) -> TrainGraph:
    """Name the exported graph's placeholders and outputs; inference graphs also output the module's result."""
    graph: fx.Graph = graph_module.graph
    _fold_constants(graph_module, graph)
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
        input_specs=layout.tensor_specs,
        loss=by_name[signature.user_outputs[0]],
        grads={_strip(p): grads[p] for p in param_names if p in grads},
        buffer_updates={_strip(b): by_name[n] for n, b in signature.buffers_to_mutate.items()},
        model_output=by_name[signature.user_outputs[1]] if inference else None,
        layout=layout,
    )
    # a mutated buffer is lifted as an input: TrainStep writes its update into that input
    assert set(train_graph.buffer_updates) <= set(train_graph.buffer_names), "a mutated buffer that is not an input"
    train_graph.aliases = {other: first for first, names in aliases.items() for other in names[1:]}
    _merge_tied_gradients(train_graph, aliases)
    _drop_trace_only(graph)
    _record_module_paths(graph)
    train_graph.set_outputs()
    graph.eliminate_dead_code()
    order_by_phase(train_graph)
    _take_checkpoint_marks(train_graph, keep=checkpoint_regions)
    train_graph.graph.lint()
    return train_graph


def _fold_constants(graph_module: Any, graph: fx.Graph) -> None:
    """Tensors the export lifted into attributes (``torch.tensor([])`` of a transformers cache)
    become literal arguments of the ops that read them: the graph then has only placeholders and
    calls, and the executor embeds the values in its generated code."""
    for node in list(graph.nodes):
        if node.op != "get_attr":
            continue
        value = operator.attrgetter(str(node.target))(graph_module)
        def literal(argument: fx.Node, constant: fx.Node = node, folded: Any = value) -> Any:
            return folded if argument is constant else argument

        for user in list(node.users):
            user.args = fx.node.map_arg(user.args, literal)
            user.kwargs = fx.node.map_arg(user.kwargs, literal)
        graph.erase_node(node)


def _take_checkpoint_marks(train_graph: TrainGraph, keep: bool) -> None:
    """Mark the forward nodes of each checkpoint region with it: everything from the region's first
    begin mark to its last end mark (graph order is execution order; a checkpointed function may call
    several modules in turn, with its own ops between them). Then drop the marks: each becomes its
    input again."""
    forward = [n for n in train_graph.op_nodes() if train_graph.phase_of(n) == Phase.FORWARD]
    spans: dict[Any, list[int]] = {}
    for position, node in enumerate(forward):
        if node.target is _MARK:
            span = spans.setdefault(node.args[1], [position, position])
            span[1] = position
    if keep:
        for region, (first, last) in spans.items():
            for node in forward[first:last + 1]:
                if node.target is not _MARK:
                    node.meta[MetaKey.CHECKPOINT] = region
        if spans:
            train_graph.notes["checkpoint_regions"] = len(spans)
    for node in train_graph.op_nodes():
        if node.target is _MARK:
            node.replace_all_uses_with(node.all_input_nodes[0])
            train_graph.graph.erase_node(node)


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
    order = [name for name in train_graph.parameter_keys if name in grads]
    train_graph.grads = {name: grads[name] for name in order}


def _strip(name: str) -> str:
    return name.removeprefix(_PREFIX)


_TRACE_TIME_CHECKS = (torch.ops.aten._assert_tensor_metadata.default,)  # dtype/shape checks the trace already passed


def _drop_trace_only(graph: fx.Graph) -> None:
    """Drop what only served tracing: detach (autograd's business, which the graph no longer uses) and
    metadata asserts (``.to(dtype)`` in T5 leaves them; having no output they would sit at the start of
    backward and keep the values they check alive, checkpoint regions' included)."""
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is torch.ops.aten.detach.default:
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
        elif node.target in _TRACE_TIME_CHECKS and not node.users:
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
