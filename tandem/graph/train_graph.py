"""TrainGraph: one training step (forward, loss, backward) as a functional graph of aten ops.

It is a torch.fx Graph plus the bookkeeping tandem needs: which placeholders are parameters,
buffers and batch inputs, which node is the loss, which nodes are gradients and buffer updates,
and each node's phase. Passes annotate nodes through ``node.meta`` (keys in ``MetaKey``) and may
reorder or add nodes; graph order is execution order.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx


class Phase:
    FORWARD = "forward"
    BACKWARD = "backward"


class MetaKey:
    PHASE = "tandem_phase"  # Phase.FORWARD / Phase.BACKWARD
    SEGMENT = "tandem_segment"  # int: the engine op (segment) this node runs in
    RECOMPUTE_OF = "tandem_recompute_of"  # name of the forward node this node recomputes
    MODULE_PATH = "tandem_module_path"  # dotted path of the module that produced this node
    CHECKPOINT = "tandem_checkpoint"  # int: the torch.utils.checkpoint region a forward node ran in


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of a batch tensor: what a captured graph is specialised to."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: str

    @staticmethod
    def of(tensor: torch.Tensor) -> TensorSpec:
        return TensorSpec(tuple(tensor.shape), tensor.dtype, str(tensor.device))

    def __str__(self) -> str:
        return f"{list(self.shape)}:{str(self.dtype).removeprefix('torch.')}"


@dataclass
class TrainGraph:
    graph: fx.Graph
    param_names: list[str]  # one placeholder each, in placeholder order
    buffer_names: list[str]
    input_specs: list[TensorSpec]
    loss: fx.Node
    grads: dict[str, fx.Node]  # parameter name -> gradient node (parameters without gradient absent)
    buffer_updates: dict[str, fx.Node]  # buffer name -> node holding its new value
    notes: dict[str, Any] = field(default_factory=dict)  # what passes decided (policy, budgets, ...)
    model_output: fx.Node | None = None  # inference graphs: the module's own output (logits)
    aliases: dict[str, str] = field(default_factory=dict)  # tied parameter's other name -> its first name
    layout: Any = None  # the batch's BatchLayout (tandem.graph.batch): how tensor inputs map to loss_fn's arguments

    def canonical(self, param_name: str) -> str:
        """The name a parameter's gradient, engine var and kvstore key go by (first of tied names)."""
        return self.aliases.get(param_name, param_name)

    @property
    def inference(self) -> bool:
        return self.model_output is not None

    # -- views ---------------------------------------------------------------------------
    @property
    def placeholders(self) -> list[fx.Node]:
        return [n for n in self.graph.nodes if n.op == "placeholder"]

    @property
    def param_nodes(self) -> dict[str, fx.Node]:
        return dict(zip(self.param_names, self.placeholders[: len(self.param_names)]))

    @property
    def buffer_nodes(self) -> dict[str, fx.Node]:
        start = len(self.param_names)
        return dict(zip(self.buffer_names, self.placeholders[start : start + len(self.buffer_names)]))

    @property
    def input_nodes(self) -> list[fx.Node]:
        return self.placeholders[len(self.param_names) + len(self.buffer_names) :]

    @property
    def output_node(self) -> fx.Node:
        return next(n for n in reversed(self.graph.nodes) if n.op == "output")

    def op_nodes(self) -> list[fx.Node]:
        """Nodes that run an op (not placeholders, not the output)."""
        return [n for n in self.graph.nodes if n.op == "call_function"]

    @property
    def parameter_keys(self) -> list[str]:
        """Each trainable parameter once, under the name its gradient, engine var and kvstore key go
        by (a tied parameter's first name, even where that alias is never called), in graph order."""
        return list(dict.fromkeys(self.canonical(n) for n in self.param_names))

    def inputs(self, module: torch.nn.Module, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The graph's inputs in placeholder order: parameters (a tied one under each of its names),
        buffers, then the batch's tensor leaves."""
        return module_state(module, self.param_names, self.buffer_names) + list(tensors)

    def phase_of(self, node: fx.Node) -> str:
        return node.meta.get(MetaKey.PHASE, Phase.FORWARD)

    def outputs(self) -> list[fx.Node]:
        """The canonical output layout: loss, gradients (param order), buffer updates (buffer order),
        and for inference graphs the module's output."""
        extra = [self.model_output] if self.model_output is not None else []
        return [self.loss, *self.grads.values(), *self.buffer_updates.values(), *extra]

    def set_outputs(self) -> None:
        """Rewrite the graph's output node to the canonical layout (after a pass replaced nodes)."""
        self.output_node.args = (tuple(self.outputs()),)

    def clone(self) -> TrainGraph:
        """A deep copy whose nodes are new objects, so a pass can rewrite it freely."""
        mapping: dict[fx.Node, fx.Node] = {}
        graph = fx.Graph()
        graph.graph_copy(self.graph, mapping)  # copies every node but the output
        clone = TrainGraph(
            graph=graph,
            param_names=list(self.param_names),
            buffer_names=list(self.buffer_names),
            input_specs=list(self.input_specs),
            loss=mapping[self.loss],
            grads={k: mapping[v] for k, v in self.grads.items()},
            buffer_updates={k: mapping[v] for k, v in self.buffer_updates.items()},
            notes=copy.deepcopy(self.notes),
            model_output=mapping[self.model_output] if self.model_output is not None else None,
            aliases=dict(self.aliases),
            layout=self.layout,
        )
        for old, new in mapping.items():
            new.meta = dict(old.meta)
        graph.output(tuple(clone.outputs()))
        return clone

    def summary(self) -> str:
        ops = self.op_nodes()
        backward = sum(1 for n in ops if self.phase_of(n) == Phase.BACKWARD)
        return (
            f"TrainGraph: {len(self.param_names)} parameters, {len(self.buffer_names)} buffers, "
            f"{len(self.input_specs)} inputs, {len(ops)} op nodes ({len(ops) - backward} forward, "
            f"{backward} backward)"
        )


class Deferred:
    """A note computed when first read (``resolved``): planning does not pay for an estimate that
    only a report shows."""

    def __init__(self, compute: Callable[[], Any]) -> None:
        self._compute: Callable[[], Any] | None = compute
        self._value: Any = None

    def __deepcopy__(self, memo: dict[int, Any]) -> Deferred:
        return self  # a copied graph's notes share it: computed once, and what it reads is not copied

    def get(self) -> Any:
        if self._compute is not None:
            self._value, self._compute = self._compute(), None  # what it held (a graph view) is released
        return self._value


def resolved(notes: dict[str, Any]) -> dict[str, Any]:
    """``notes`` with every Deferred value computed."""
    return {key: value.get() if isinstance(value, Deferred) else value for key, value in notes.items()}


def node_value(node: fx.Node) -> Any:
    """The fake value tracing recorded for a node (a FakeTensor, a tuple of them, or a scalar)."""
    return node.meta.get("val")


def module_state(module: torch.nn.Module, param_names: Sequence[str], buffer_names: Sequence[str]) -> list[torch.Tensor]:
    """``module``'s parameters, then buffers, of these (dotted) names, a tied one under each of its names."""
    params = dict(module.named_parameters(remove_duplicate=False))
    buffers = dict(module.named_buffers(remove_duplicate=False))
    return [params[n] for n in param_names] + [buffers[n] for n in buffer_names]


_ModuleRef = weakref.ReferenceType[torch.nn.Module]


class StateReader:
    """``module_state`` each step without walking the module (two walks of every submodule cost a
    resnet's step ~0.1 ms): each name's owning submodule is found once, and read again only after a
    check that every submodule on the way is still where it was (a replaced layer is followed).

    Submodules are held weakly: a layer the user replaced is freed with its parameters, even when
    the reader belongs to a batch layout that never runs again (``TrainStep`` keeps one per layout)."""

    __slots__ = ("module", "param_names", "buffer_names", "_resolved")

    def __init__(self, module: torch.nn.Module, param_names: Sequence[str], buffer_names: Sequence[str]) -> None:
        self.module, self.param_names, self.buffer_names = module, list(param_names), list(buffer_names)
        self._resolved = self._resolve()

    def _resolve(self) -> tuple[list[tuple[int, str, _ModuleRef]], list[tuple[int, str, str]]] | None:
        """(every (parent, name, child) on the names' paths, the child held weakly and the parent as a
        position in ``_owners``' list, which it precedes; each name's owner (a position too), table and
        key); None where a submodule on a path is gone (the walk then names what is missing)."""
        path: list[tuple[int, str, _ModuleRef]] = []
        positions: dict[tuple[int, str], int] = {}  # (parent's id, name) -> the child's position
        slots: list[tuple[int, str, str]] = []
        for names, table in ((self.param_names, "_parameters"), (self.buffer_names, "_buffers")):
            for name in names:
                owner, position = self.module, 0  # position 0: the module itself
                *prefix, attribute = name.split(".")
                for part in prefix:
                    child = owner._modules.get(part)
                    if child is None:
                        return None
                    key = (id(owner), part)
                    if key not in positions:
                        path.append((position, part, weakref.ref(child)))
                        positions[key] = len(path)
                    owner, position = child, positions[key]
                slots.append((position, table, attribute))
        return path, slots

    def _owners(self, path: list[tuple[int, str, _ModuleRef]]) -> list[torch.nn.Module] | None:
        """The module, then each child on ``path``, held for the read; None once any moved or died."""
        owners = [self.module]
        for parent, name, child_ref in path:
            child = child_ref()
            if child is None or owners[parent]._modules.get(name) is not child:
                return None
            owners.append(child)
        return owners

    def read(self) -> list[torch.Tensor]:
        resolved = self._resolved  # one load: another thread may swap in a new resolution
        owners = self._owners(resolved[0]) if resolved is not None else None
        if owners is None:  # a submodule was replaced since: find the owners again
            resolved = self._resolved = self._resolve()
            owners = self._owners(resolved[0]) if resolved is not None else None
        if resolved is None or owners is None:  # gone (the walk names it), or replaced again meanwhile
            return module_state(self.module, self.param_names, self.buffer_names)
        values = [getattr(owners[position], table).get(attribute) for position, table, attribute in resolved[1]]
        if any(value is None for value in values):  # deleted, or set to None: the walk names it
            return module_state(self.module, self.param_names, self.buffer_names)
        return values  # type: ignore[return-value]  # None was refused above
