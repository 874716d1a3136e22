"""The pass manager: runs planning passes in order, linting the graph after each.

A pass is a plain function ``name_pass(graph, config) -> graph``. When one fails or leaves an
invalid graph, the error names it and the passes that ran before it.
"""

from __future__ import annotations

from collections.abc import Callable

from tandem.errors import PassError
from tandem.graph.train_graph import TrainGraph
from tandem.passes.config import PlanConfig

Pass = Callable[[TrainGraph, PlanConfig], TrainGraph]


def lint(graph: TrainGraph) -> None:
    """Structural checks every pass must preserve."""
    graph.graph.lint()  # fx: topological order, nodes owned by this graph
    outputs = graph.outputs()
    if graph.output_node.args[0] != tuple(outputs):
        raise PassError("the output node does not list loss, gradients and buffer updates in order")
    for node in outputs:
        if node.graph is not graph.graph:
            raise PassError(f"output {node.name} belongs to another graph")


def run_passes(graph: TrainGraph, passes: list[tuple[str, Pass]], config: PlanConfig) -> TrainGraph:
    done: list[str] = []
    for name, function in passes:
        try:
            graph = function(graph, config)
            lint(graph)
        except Exception as error:
            before = ", ".join(done) or "none"
            raise PassError(f"pass '{name}' failed (passes run before it: {before}): {error}") from error
        done.append(name)
    graph.notes["passes"] = done
    return graph


def default_passes(config: PlanConfig) -> list[tuple[str, Pass]]:
    """The planning pipeline, in order. Each pass reads only its own part of the config.

    Dropout's form is chosen first (it depends only on the mirror policy); segments come last:
    recompute nodes that mirroring inserts belong to backward segments.
    """
    from tandem.passes.dropout import dropout_pass
    from tandem.passes.mirror import mirror_pass
    from tandem.passes.segments import segments_pass

    return [("dropout", dropout_pass), ("mirror", mirror_pass), ("segments", segments_pass)]


def plan(graph: TrainGraph, config: PlanConfig) -> TrainGraph:
    return run_passes(graph, default_passes(config), config)
