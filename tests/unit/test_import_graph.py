"""The package's import graph: no cycles, and each layer imports only its own and lower layers.

Every module under tandem/ is parsed (not imported); every ``import`` counts, at module level or
inside a function, under ``TYPE_CHECKING`` too. ``from a.b import c`` is an edge to the module
``a.b.c`` where that is a module, else to ``a.b``; importing ``a.b.c`` also runs the package
``a.b``, so that is an edge too unless the importer lives inside ``a.b`` (its package is already
running then).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "tandem"

# Lowest first. "a.b.*" names the module a.b and every module under it, "a.b" that module alone; a
# module belongs to the layer of the longest name that matches it (the module alone on a tie).
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    # the root package resolves its attributes lazily (importlib); env and errors import nothing of
    # tandem. torchvision_compat is library code (the models' transformers wrapper needs it) that
    # still lives under testing/, whose package is a docstring: both leaves, here
    ("foundation", ("tandem", "tandem.env", "tandem.errors", "tandem.progress", "tandem.testing", "tandem.testing.torchvision_compat",
                    "tandem.checkpoint",  # atomic files: the trainer and the servers write checkpoints alike
                    "tandem.cache_files")),  # trusted files under inductor's cache directory: capture cache, unit index
    ("trace", ("tandem.trace",)),  # the timeline the engine, the kvstore and the updates record into
    ("engine", ("tandem.engine.*",)),
    ("graph", ("tandem.graph.*",)),
    ("backends", ("tandem.backends.*",)),  # how a segment becomes code (aten, inductor)
    ("passes", ("tandem.passes.*",)),
    ("executor", ("tandem.executor",)),
    ("step", ("tandem.step",)),
    ("ops", ("tandem.ops.*",)),
    ("optim", ("tandem.optim.*",)),
    ("data", ("tandem.data.*",)),
    ("models", ("tandem.models.*",)),
    ("kvstore", ("tandem.kvstore.*",)),
    ("update", ("tandem.update.*",)),
    ("trainer", ("tandem.trainer",)),
    ("netns", ("tandem.netns",)),
    ("launch", ("tandem.launch",)),
    ("planner", ("tandem.planner.*",)),  # tandem plan: profiles a step, simulates a cluster, runs jobs to validate
    ("cli", ("tandem.cli", "tandem.__main__")),
    ("testing", ("tandem.testing.*",)),  # test helpers: nothing in the library imports them
]


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    where: str  # file:line of the import

    def __str__(self) -> str:
        return f"{self.source} -> {self.target} ({self.where})"


def modules(root: Path = PACKAGE) -> dict[str, Path]:
    """Dotted name -> file of every module (a package by its __init__.py)."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _imported(node: ast.Import | ast.ImportFrom, package: str, known: dict[str, Path]) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:  # relative: from the importer's package up
        anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join(anchor + ([base] if base else []))
    return [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]


def _owner(name: str, known: dict[str, Path]) -> str | None:
    """The module ``name`` is, or is an attribute of (the longest known prefix)."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(known: dict[str, Path] | None = None) -> list[Edge]:
    known = known if known is not None else modules()
    edges: dict[tuple[str, str], Edge] = {}
    for module, path in known.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            for name in _imported(node, package, known):
                target = _owner(name, known) if name.split(".")[0] == "tandem" else None
                if target is None:
                    continue
                parts = target.split(".")
                # the target and the packages its import runs that are not already running for the importer
                for depth in range(2, len(parts) + 1):
                    runs = ".".join(parts[:depth])
                    if runs != module and not (module + ".").startswith(runs + "."):
                        where = f"{path.relative_to(PACKAGE.parent)}:{node.lineno}"
                        edges.setdefault((module, runs), Edge(module, runs, where))
    return list(edges.values())


def cycles(edges: list[Edge]) -> list[list[Edge]]:
    """One cycle (as its edges) per strongly connected component of more than one module."""
    graph: dict[str, list[Edge]] = {}
    for edge in edges:
        graph.setdefault(edge.source, []).append(edge)
        graph.setdefault(edge.target, [])
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(node: str) -> None:  # Tarjan's algorithm
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for edge in graph[node]:
            if edge.target not in index:
                visit(edge.target)
                low[node] = min(low[node], low[edge.target])
            elif edge.target in on_stack:
                low[node] = min(low[node], index[edge.target])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            components.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [_cycle_in(component, graph) for component in components if len(component) > 1]


def _cycle_in(component: set[str], graph: dict[str, list[Edge]]) -> list[Edge]:
    """A shortest way from the component's first module back to itself (breadth first)."""
    start = min(component)
    came: dict[str, Edge] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for edge in graph[node]:
                if edge.target == start:
                    path = [edge]
                    while path[0].source != start:
                        path.insert(0, came[path[0].source])
                    return path
                if edge.target in component and edge.target not in came:
                    came[edge.target] = edge
                    following.append(edge.target)
        frontier = following
    raise AssertionError(f"no cycle through {start}")


def layer_of(module: str) -> int | None:
    best: tuple[int, bool, int] | None = None  # (length of the name, names the module alone, layer)
    for layer, (_, names) in enumerate(LAYERS):
        for name in names:
            prefix = name.removesuffix(".*")
            alone = prefix == name
            if module == prefix or (not alone and module.startswith(prefix + ".")):
                if best is None or (len(prefix), alone) > best[:2]:
                    best = (len(prefix), alone, layer)
    return best[2] if best is not None else None


def upward(edges: list[Edge]) -> list[str]:
    """Every import of a higher layer, as a message naming the edge and both layers."""
    found = []
    for edge in edges:
        source, target = layer_of(edge.source), layer_of(edge.target)
        assert source is not None and target is not None
        if target > source:
            found.append(f"{edge}: layer {LAYERS[source][0]!r} imports the higher layer {LAYERS[target][0]!r}")
    return found


def test_every_module_has_a_layer() -> None:
    missing = sorted(module for module in modules() if layer_of(module) is None)
    assert not missing, f"modules in no layer of LAYERS (add them where they belong): {missing}"
    assert layer_of("tandem.testing.real_models") == len(LAYERS) - 1
    assert layer_of("tandem.testing") == layer_of("tandem.testing.torchvision_compat") == 0


def test_the_parser_sees_imports_of_every_kind() -> None:
    edges = {(edge.source, edge.target) for edge in import_graph()}
    assert ("tandem.trainer", "tandem.update") in edges  # module level, from a package
    assert ("tandem.step", "tandem.executor") in edges  # from a module import names
    assert ("tandem.kvstore", "tandem.kvstore.ps.job") in edges  # inside a function
    assert ("tandem.kvstore", "tandem.kvstore.ps") in edges  # the package a submodule's import runs
    assert ("tandem.engine.base", "tandem.engine") not in edges  # its own package is already running


def test_no_import_cycles() -> None:
    found = cycles(import_graph())
    assert not found, "import cycles (break each at one of its edges):\n" + "\n".join(
        " -> ".join([cycle[0].source, *(edge.target for edge in cycle)]) + "\n    " + "\n    ".join(map(str, cycle))
        for cycle in found
    )


def test_layers_import_only_downward() -> None:
    found = upward(import_graph())
    assert not found, "imports against the layer order (LAYERS, lowest first):\n" + "\n".join(found)


def test_the_checks_catch_a_cycle_and_an_upward_import() -> None:
    edges = [Edge("tandem.engine.base", "tandem.engine.bulking", "base.py:1"),
             Edge("tandem.engine.bulking", "tandem.engine.base", "bulking.py:2"),
             Edge("tandem.executor", "tandem.trainer", "executor.py:3")]  # fmt: skip
    assert [[str(edge) for edge in cycle] for cycle in cycles(edges)] == [
        ["tandem.engine.base -> tandem.engine.bulking (base.py:1)", "tandem.engine.bulking -> tandem.engine.base (bulking.py:2)"]
    ]
    assert upward(edges) == [
        "tandem.executor -> tandem.trainer (executor.py:3): layer 'executor' imports the higher layer 'trainer'"
    ]


def test_subpackages_are_attributes_after_import_tandem() -> None:
    import subprocess
    import sys

    code = "import tandem; print(tandem.optim.SGD.__name__, tandem.kvstore.KVStore.__name__, tandem.data.batches.__name__)"
    output = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert output.stdout.split() == ["SGD", "KVStore", "batches"]
