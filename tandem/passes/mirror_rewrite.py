"""Turning a mirroring decision into graph nodes, and predicting the memory the result will use.

``insert_recompute`` adds, for each backward read of a mirrored value, a recompute copy just
before that read, so the copy is born late and dies early. ``simulate`` replays the executor's
slot program (free after last use, storages shared by views) without running any op: it is the
estimate plans are compared by; the executor still *measures* the real peak.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import cast

import torch
import torch.fx as fx

from tandem.graph import cost
from tandem.graph.train_graph import MetaKey, Phase, TrainGraph
from tandem.passes.mirror_graph import StorageKey, storage_keys


@dataclass(frozen=True)
class SimulatedMemory:
    peak_bytes: int
    saved_bytes: int  # live bytes when the backward starts


def simulate(graph: TrainGraph) -> SimulatedMemory:
    """Peak and boundary bytes of intermediate storages, as Executor.run_measured would count them."""
    nodes = graph.op_nodes()
    outputs = set(graph.outputs())
    last_use: dict[fx.Node, fx.Node] = {}
    for node in nodes:
        for source in node.all_input_nodes:
            last_use[source] = node
    frees: dict[fx.Node, list[fx.Node]] = {}
    for value, user in last_use.items():
        if value.op != "placeholder" and value not in outputs:
            frees.setdefault(user, []).append(value)
    key_bytes: dict[StorageKey, int] = {}
    keys = {node: storage_keys(node, key_bytes) for node in nodes}
    references: dict[StorageKey, int] = {}
    live = peak = 0
    saved = None

    def release(value: fx.Node) -> int:
        freed = 0
        for key in keys[value]:
            references[key] -= 1
            if references[key] == 0:
                del references[key]
                freed += key_bytes[key]
        return freed

    for node in nodes:
        if saved is None and graph.phase_of(node) == Phase.BACKWARD:
            saved = live
        for key in keys[node]:
            references[key] = references.get(key, 0) + 1
            live += key_bytes[key] if references[key] == 1 else 0
        peak = max(peak, live)
        for value in frees.get(node, []):
            live -= release(value)
        if node not in last_use and node not in outputs:  # dead on arrival
            live -= release(node)
    return SimulatedMemory(peak_bytes=peak, saved_bytes=live if saved is None else saved)


Share = Callable[[fx.Node], bool]
MAX_REDO_DEPTH = 12  # recompute chains deeper than this share their copies: bounds redone work to O(n * depth)


def share_all(node: fx.Node) -> bool:
    """Chen-style: one recompute copy per value, reused by every later backward read."""
    return True


def share_expensive(node: fx.Node) -> bool:
    """Cheap copies are redone per backward read (no copy lives long); costly ones are shared."""
    return cost.is_expensive(node)


def insert_recompute(graph: TrainGraph, mirrored: set[str], share: Share) -> int:
    """Redirect every backward read of a mirrored forward value to a recompute copy; returns flops.

    A copy is placed just before the backward node that first needs it. A value the backward
    reads several times keeps one *direct* copy until its last read (as the original would have
    lived). Copies made only to feed another recompute are redone per read point unless
    ``share`` says the op is worth keeping: sharing a cheap copy would keep it alive from the
    first read of its consumer to its own last read, which can cost more than it saves. A slice of
    a recomputed stack reads the stacked input itself (``_stacked_input``).
    """
    backward = [n for n in graph.op_nodes() if graph.phase_of(n) == Phase.BACKWARD]
    position = {node: i for i, node in enumerate(backward)}
    last_read: dict[str, int] = {}
    for node in backward:
        for source in node.all_input_nodes:
            if source.name in mirrored:
                last_read[source.name] = position[node]
    live: dict[str, tuple[fx.Node, int]] = {}  # name -> (copy, last position it may be reused at)
    flops = 0
    # how many mirrored values a recompute of each runs through; graph order puts inputs first
    # (no recursion: an unrolled recurrence chains thousands of values)
    chain_length: dict[fx.Node, int] = {}
    for node in graph.graph.nodes:
        if node.name in mirrored:
            chain_length[node] = 1 + max((chain_length.get(a, 0) for a in cost.recompute_inputs(node)), default=0)

    def copy_of(root: fx.Node, reader: fx.Node, memo: dict[str, fx.Node]) -> fx.Node:
        """The copy of ``root`` that ``reader`` reads: one made for this reader, a shared one still
        live, or a new one made (its mirrored inputs first, depth first) just before ``reader``."""
        nonlocal flops
        here = position[reader]

        def existing(value: fx.Node) -> fx.Node | None:
            if value.name in memo:
                return memo[value.name]
            held = live.get(value.name)
            return held[0] if held is not None and held[1] >= here else None

        stack: list[tuple[fx.Node, int, bool]] = [(root, 0, False)]  # (value, depth, its inputs made yet)
        while stack:
            value, depth, inputs_made = stack.pop()
            if existing(value) is not None:
                continue
            stacked = _stacked_input(value, mirrored)
            if stacked is not None:  # a slice of a stack is that input: no stack rebuilt for one slice
                if stacked.name not in mirrored:
                    memo[value.name] = stacked
                elif inputs_made:
                    memo[value.name] = cast(fx.Node, existing(stacked))
                else:
                    stack += [(value, depth, True), (stacked, depth + 1, False)]
                continue
            # Deepest input chain first (Sethi-Ullman): a cheap input computed early would wait, alive, for it.
            sources = sorted((a for a in cost.recompute_inputs(value) if a.name in mirrored),
                             key=chain_length.__getitem__, reverse=True)  # fmt: skip
            if not inputs_made:
                stack.append((value, depth, True))
                stack.extend((source, depth + 1, False) for source in reversed(sources))
                continue
            inputs = {source: cast(fx.Node, existing(source)) for source in sources}
            with graph.graph.inserting_before(reader):
                made = (_replay_batch_norm(graph, value, inputs) or _replay_dropout(graph, value, inputs)
                        or [graph.graph.node_copy(value, partial(_copy_or_itself, inputs))])
            copy = made[-1]
            for node in made:
                node.meta = {**node.meta, MetaKey.PHASE: Phase.BACKWARD, MetaKey.RECOMPUTE_OF: value.name}
                flops += cost.flops(node)
            memo[value.name] = copy
            if share(value) or depth >= MAX_REDO_DEPTH:  # a long chain (a recurrence) is redone once, not per read
                live[value.name] = (copy, max(here, last_read.get(value.name, here)))
        return cast(fx.Node, existing(root))

    for reader in backward:
        memo: dict[str, fx.Node] = {}
        for source in list(reader.all_input_nodes):
            if source.name in mirrored:
                copy = copy_of(source, reader, memo)
                live[source.name] = (copy, last_read[source.name])
                reader.replace_input_with(source, copy)
    graph.graph.lint()
    return flops


_STRIDED_READS = {torch.ops.aten.as_strided.default, torch.ops.aten.as_strided_scatter.default}


def _stacked_input(node: fx.Node, mirrored: set[str]) -> fx.Node | None:
    """For ``select(stack(inputs, dim), dim, i)`` of a recomputed stack: ``inputs[i]``, if it can stand
    in for the slice (same dtype and shape, contiguous, no reader that addresses memory by stride),
    else None.

    An RNN stacks its outputs over time and the next layer reads them back one step at a time;
    recomputing the stack once per read would rebuild every step's slice to read one. A kept
    stack's slice is a free view: then nothing changes."""
    if node.target is not torch.ops.aten.select.int or len(node.args) != 3:
        return None
    source, dim, index = node.args
    if not isinstance(source, fx.Node) or source.target is not torch.ops.aten.stack.default or source.name not in mirrored:
        return None
    inputs, stack_dim = source.args[0], source.args[1] if len(source.args) > 1 else source.kwargs.get("dim", 0)
    stacked = source.meta.get("val")
    if not isinstance(inputs, list | tuple) or not isinstance(stacked, torch.Tensor) or not isinstance(index, int):
        return None
    if not isinstance(dim, int) or not isinstance(stack_dim, int) or dim % stacked.dim() != stack_dim % stacked.dim():
        return None
    chosen = inputs[index] if -len(inputs) <= index < len(inputs) else None
    if not isinstance(chosen, fx.Node):
        return None
    wanted, found = node.meta.get("val"), chosen.meta.get("val")
    if not isinstance(wanted, torch.Tensor) or not isinstance(found, torch.Tensor):
        return None
    # a contiguous tensor takes every view its strided twin takes; stack may promote dtypes
    if found.dtype != wanted.dtype or found.shape != wanted.shape or not found.is_contiguous():
        return None
    return None if any(user.target in _STRIDED_READS for user in node.users) else chosen


def _copy_or_itself(copies: dict[fx.Node, fx.Node], node: fx.Node) -> fx.Node:
    return copies.get(node, node)


def _replay_batch_norm(graph: TrainGraph, value: fx.Node, inputs: dict[fx.Node, fx.Node]) -> list[fx.Node] | None:
    """Recompute a training BatchNorm's output from its kept batch statistics, in eval mode.

    Re-running BN in training mode would recompute the batch mean and variance (several passes,
    ~7x the time of one normalisation on CPU). The batch mean and rstd are kept anyway (the BN
    backward reads them), so y = (x - mean) * rstd * weight + bias is one eval-mode BN call with
    var = 1 / rstd^2 - eps. Equal to the training output up to float rounding; running stats are
    untouched (the eval op returns none). Returns the new nodes, the BN tuple last, or None.
    """
    if not cost.is_training_batch_norm(value):
        return None
    stats = {user.args[1]: user for user in value.users if user.target is operator.getitem}
    if 1 not in stats or 2 not in stats:
        return None
    source, weight, bias, _, _, _, momentum, eps = value.args
    mean, rstd = stats[1], stats[2]
    aten = torch.ops.aten
    squared = graph.graph.call_function(aten.mul.Tensor, (rstd, rstd))
    reciprocal = graph.graph.call_function(aten.reciprocal.default, (squared,))
    variance = graph.graph.call_function(aten.sub.Tensor, (reciprocal, eps))
    for node in (squared, reciprocal, variance):
        node.meta["val"] = rstd.meta.get("val")
    replay = graph.graph.call_function(aten._native_batch_norm_legit_no_training.default,
                                       (inputs.get(source, source), weight, bias, mean, variance, momentum, eps))  # type: ignore[arg-type]
    output = value.meta.get("val")
    replay.meta = {**value.meta, "val": (output[0], None, None) if isinstance(output, tuple | list) else output}
    return [squared, reciprocal, variance, replay]


def _replay_dropout(graph: TrainGraph, value: fx.Node, inputs: dict[fx.Node, fx.Node]) -> list[fx.Node] | None:
    """Recompute a training dropout's output from its kept mask: ``input * mask * scale``, no new draw."""
    replay = cost.dropout_replay(value)
    if replay is None:
        return None
    source, mask, scale = replay
    node = graph.graph.call_function(torch.ops.aten.native_dropout_backward.default,
                                     (inputs.get(source, source), mask, scale))
    node.meta = dict(value.meta)
    return [node]
