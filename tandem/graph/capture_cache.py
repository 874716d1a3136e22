"""The capture cache: a captured TrainGraph kept on disk, so that a new process training the same
model on the same batch shapes loads the graph instead of tracing the step again.

Tracing is most of a warm first call: AOT autograd traces every op of the forward and of
autograd's backward on fake tensors, about 1 ms a node (lstm_lm's 3,900 nodes: 4-7 s), while
inductor's own caches bring compiling the segments down to a few seconds. Loading the pickled
graph rebuilds the fake values instead of tracing them: a fraction of the time.

**What the key holds** (what a trace on fake tensors can depend on; a difference is a miss): the
source of every file that defines a class of the module tree or the loss function, of tandem,
and of every other loaded module outside the standard library and installed packages; the
functions and methods of the modules defining those classes as they are in memory
(monkeypatches); the versions of torch, Python and the packages those classes come from; each
submodule's class, training flag and attributes (configs, functions by their code, tensor
constants by value); parameter and buffer names, shapes, dtypes, devices and ties; the batch's
layout; default dtype, grad and autocast modes; the capture options. Parameter and buffer
*values* are not in it: the trace never reads them. A module tree with hooks is not cached
(hooks are code the key cannot name). docs/capture.md says what the key cannot see.

**Where**: ``tandem_capture/`` under inductor's cache directory (``TORCHINDUCTOR_CACHE_DIR``,
default ``/tmp/torchinductor_$USER``), so clearing one clears both. Entries are pickles, loaded
only from a directory and files this user owns and no one else may write. ``TANDEM_CAPTURE_CACHE=0``
turns the cache off.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import logging
import os
import stat
import sys
import sysconfig
import tempfile
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from tandem.env import knob
from tandem.graph.batch import BatchLayout
from tandem.graph.train_graph import TrainGraph

log = logging.getLogger(__name__)

FORMAT = 1  # bump when TrainGraph or capture's output changes meaning: old entries then miss
_DESCRIBE_DEPTH = 4  # how deep plain objects (configs) are described before only their type counts


def enabled() -> bool:
    return bool(knob("TANDEM_CAPTURE_CACHE"))


def directory() -> Path:
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    return Path(os.environ.get("TORCHINDUCTOR_CACHE_DIR") or default_cache_dir()).absolute() / "tandem_capture"


# -- the key ------------------------------------------------------------------------------


def key(module: nn.Module, loss_fn: Callable[..., Any], layout: BatchLayout, options: dict[str, Any]) -> str | None:
    """The cache key of capturing ``loss_fn(module, *batch)``, or None when it cannot be keyed
    safely (a hook on a module of the tree, an attribute that cannot be described)."""
    if _has_hooks(module):
        return None
    try:
        return _digest(module, loss_fn, layout, options)
    except Exception as error:  # an exotic attribute (a sparse tensor, a failing property): trace, do not cache
        log.info("tandem: the step is not cached: its key failed (%s: %s)", type(error).__name__, error)
        return None


def _digest(module: nn.Module, loss_fn: Callable[..., Any], layout: BatchLayout, options: dict[str, Any]) -> str:
    digest = hashlib.sha256()

    def add(*parts: Any) -> None:
        for part in parts:
            digest.update(repr(part).encode())
            digest.update(b"\0")

    add(FORMAT, torch.__version__, sys.version_info[:3], sorted(options.items()))
    add(torch.get_default_dtype(), torch.is_grad_enabled(), torch.is_autocast_enabled("cpu"),
        torch.is_autocast_enabled("cuda"), torch.are_deterministic_algorithms_enabled())
    add(str(layout.tree), str(layout))
    defining = [*_classes(module), type(loss_fn), *([loss_fn] if isinstance(loss_fn, types.FunctionType) else [])]
    for path in sorted({*_source_files(defining), *_user_files()}):
        add(path, _file_digest(path))
    add(sorted(_package_versions(defining).items()), _live_code(defining))
    identity = {id(p): name for name, p in reversed(list(module.named_parameters(remove_duplicate=False)))}
    for name, parameter in module.named_parameters(remove_duplicate=False):
        add(name, tuple(parameter.shape), parameter.dtype, parameter.device, parameter.requires_grad,
            identity[id(parameter)])
    for name, buffer in module.named_buffers(remove_duplicate=False):
        add(name, tuple(buffer.shape), buffer.dtype, buffer.device)
    for name, submodule in module.named_modules(remove_duplicate=False):
        add(name, type(submodule).__qualname__, submodule.training, _describe(_attributes(submodule)))
    add(_describe(loss_fn))
    return digest.hexdigest()


_MODULE_INTERNALS = frozenset({"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set", "training",
                               "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
                               "_load_state_dict_post_hooks", "_is_full_backward_hook"})
_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def _has_hooks(module: nn.Module) -> bool:
    from torch.nn.modules import module as module_globals

    global_hooks = [getattr(module_globals, f"_global{name}", {}) for name in _HOOK_DICTS]
    return any(global_hooks) or any(getattr(m, name, None) for m in module.modules() for name in _HOOK_DICTS)


def _attributes(module: nn.Module) -> dict[str, Any]:
    return {name: value for name, value in vars(module).items()
            if name not in _MODULE_INTERNALS and not name.endswith("_hooks") and not name.endswith("_hooks_with_kwargs")
            and not name.endswith("_hooks_always_called")}


def _describe(value: Any, depth: int = 0) -> Any:
    """A stable, comparable description of an attribute: what a trace may branch on or bake in."""
    if value is None or isinstance(value, bool | int | float | str | bytes | torch.dtype | torch.device):
        return value
    if isinstance(value, torch.Tensor):  # a plain tensor attribute is baked into the graph by value
        data = value.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        return ("tensor", tuple(value.shape), str(value.dtype), hashlib.sha256(data.numpy().tobytes()).hexdigest())
    if isinstance(value, nn.Module):  # described where it sits in the module tree
        return ("module", type(value).__qualname__)
    if isinstance(value, list | tuple | set | frozenset):
        items = [_describe(item, depth + 1) for item in value]
        return (type(value).__name__, sorted(map(repr, items)) if isinstance(value, set | frozenset) else items)
    if isinstance(value, dict):
        return ("dict", sorted((repr(k), repr(_describe(v, depth + 1))) for k, v in value.items()))
    if isinstance(value, types.FunctionType | types.MethodType):
        function = value.__func__ if isinstance(value, types.MethodType) else value
        closure = [_describe(cell.cell_contents, depth + 1) for cell in function.__closure__ or ()]
        return ("function", function.__module__, function.__qualname__, _code_digest(function.__code__),
                closure, _describe(function.__defaults__, depth + 1))
    if isinstance(value, functools.partial):
        return ("partial", _describe(value.func, depth + 1), _describe(value.args, depth + 1),
                _describe(value.keywords, depth + 1))
    if isinstance(value, type) or (callable(value) and not hasattr(value, "__dict__")):  # a class, torch.relu
        return ("named", getattr(value, "__module__", None), getattr(value, "__qualname__", None), repr(value))
    kind = f"{type(value).__module__}.{type(value).__qualname__}"
    as_dict = getattr(value, "to_dict", None)  # a config's own view of its fields (transformers: no object hashes)
    if depth < _DESCRIBE_DEPTH and callable(as_dict):
        try:
            fields = as_dict()
        except Exception:  # not a config's to_dict after all
            fields = None
        if isinstance(fields, dict):
            return (kind, _describe(fields, depth + 1))
    if depth < _DESCRIBE_DEPTH and hasattr(value, "__dict__"):  # a config object: by its fields
        return (kind, _describe(dict(vars(value)), depth + 1))
    return (kind, repr(value))  # a repr with an address differs in every process: a miss, never a wrong hit


def _code_digest(code: types.CodeType) -> str:
    """Bytecode, the names it reads (``torch.relu`` and ``torch.tanh`` differ only there) and its
    constants, nested code objects (lambdas, comprehensions) by their own digest: no addresses."""
    return hashlib.sha256(repr((code.co_code, code.co_names, code.co_varnames,
                                [_constant(c) for c in code.co_consts])).encode()).hexdigest()


def _constant(value: Any) -> Any:
    if isinstance(value, types.CodeType):
        return _code_digest(value)
    if isinstance(value, tuple):
        return tuple(_constant(item) for item in value)
    if isinstance(value, frozenset):  # `x in {"a", "b"}`: its repr's order moves with the string hash seed
        return sorted(repr(_constant(item)) for item in value)
    return repr(value)


def _live_code(objects: list[Any]) -> list[tuple[str, str, str]]:
    """The functions and methods of the modules defining ``objects`` as they are now: a monkeypatch
    of an installed library (a method or helper replaced at run time) is not in its file."""
    described = []
    for name in sorted({getattr(obj, "__module__", "") or "" for obj in objects}):
        for attribute, value in sorted(vars(sys.modules[name]).items()) if name in sys.modules else []:
            if isinstance(value, type):
                described += [(name, f"{attribute}.{method}", _code_digest(function.__code__))
                              for method, function in sorted(vars(value).items())
                              if isinstance(function, types.FunctionType)]
            elif isinstance(value, types.FunctionType):
                described.append((name, attribute, _code_digest(value.__code__)))
    return described


def _classes(module: nn.Module) -> list[type]:
    """Every class of the module tree and its bases up to nn.Module."""
    seen: list[type] = []
    for submodule in module.modules():
        for cls in type(submodule).__mro__:
            if cls is nn.Module:
                break
            if cls not in seen:
                seen.append(cls)
    return seen


def _source_files(objects: list[Any]) -> set[str]:
    files = set()
    for obj in objects:
        file = getattr(sys.modules.get(getattr(obj, "__module__", "") or ""), "__file__", None)
        if file and file.endswith(".py"):
            files.add(os.path.abspath(file))
    return files


@functools.cache
def _installed_roots() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    return tuple(os.path.abspath(paths[name]) + os.sep for name in ("stdlib", "platstdlib", "purelib", "platlib"))


@functools.cache
def _tandem_files() -> frozenset[str]:
    """All of tandem's own source: it shapes the captured graph, and its modules load lazily."""
    root = Path(__file__).resolve().parents[1]
    return frozenset(str(path) for path in root.rglob("*.py"))


def _user_files() -> set[str]:
    """Source files of loaded modules outside the standard library and installed packages, and tandem's."""
    files = set(_tandem_files())
    tandem_root = str(Path(__file__).resolve().parents[1]) + os.sep
    for loaded in list(sys.modules.values()):
        file = getattr(loaded, "__file__", None)
        if file and file.endswith(".py"):
            path = os.path.abspath(file)
            if not path.startswith(_installed_roots()) and not path.startswith(tandem_root):
                files.add(path)
    return files


def _file_digest(path: str) -> str:
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return "unreadable"


def _package_versions(objects: list[Any]) -> dict[str, str]:
    versions = {}
    for obj in objects:
        package = (getattr(obj, "__module__", "") or "").partition(".")[0]
        if package and package not in versions:
            try:
                versions[package] = importlib.metadata.version(package)
            except (importlib.metadata.PackageNotFoundError, ValueError):
                versions[package] = "unversioned"
    return versions


# -- load and store --------------------------------------------------------------------------


def load(cache_key: str, layout: BatchLayout) -> TrainGraph | None:
    """The TrainGraph stored under ``cache_key``, or None. A broken entry is removed (a miss)."""
    path = directory() / f"{cache_key}.pkl"
    if not path.exists() or not _trusted(path.parent) or not _trusted(path):
        return None
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx._graph_pickler import GraphPickler

    try:
        entry = GraphPickler.loads(path.read_bytes(), FakeTensorMode())
        if not isinstance(entry, dict):
            raise TypeError(f"the entry holds a {type(entry).__name__}, not a captured graph")
        return _train_graph(entry, layout)
    except Exception as error:  # a torn or stale entry: trace again, and drop it
        log.warning("tandem: ignoring the capture cache entry %s (%s: %s)", path, type(error).__name__, error)
        path.unlink(missing_ok=True)
        return None


def store(cache_key: str, graph: TrainGraph) -> None:
    """Write ``graph`` under ``cache_key``; best effort (a graph that cannot be pickled is not stored)."""
    if any(node.op == "get_attr" for node in graph.graph.nodes):
        return  # its attributes live in a module the entry would not hold
    from torch.fx._graph_pickler import GraphPickler, Options

    folder = directory()
    try:
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        if not _trusted(folder):
            return
        data = GraphPickler.dumps(_entry(graph), Options(ops_filter=None))
        # written whole, then renamed: a process reading at the same time sees all of it or nothing
        handle, temporary = tempfile.mkstemp(dir=folder, suffix=".tmp")
        try:
            with os.fdopen(handle, "wb") as file:
                file.write(data)
            os.replace(temporary, folder / f"{cache_key}.pkl")
        finally:
            Path(temporary).unlink(missing_ok=True)  # gone already once renamed
    except Exception as error:
        log.info("tandem: the captured graph was not cached (%s: %s)", type(error).__name__, error)


def _trusted(path: Path) -> bool:
    """Owned by this user and writable by no one else: only then may its pickles be loaded."""
    try:
        info = path.stat()
    except OSError:  # removed meanwhile (another process dropped a broken entry): a miss
        return False
    if info.st_uid != os.getuid() or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        log.warning("tandem: not using the capture cache at %s: it must belong to this user and be writable "
                    "by no one else (fix its owner and mode, or set TANDEM_CAPTURE_CACHE=0)", path)
        return False
    return True


def _entry(graph: TrainGraph) -> dict[str, Any]:
    def name(node: fx.Node | None) -> str | None:
        return node.name if node is not None else None

    owner = graph.graph.owning_module
    try:
        holder = fx.GraphModule(nn.Module(), graph.graph)  # what GraphPickler pickles; it adopts the graph
    finally:
        graph.graph.owning_module = owner
    return {
        "graph_module": holder,
        "param_names": graph.param_names, "buffer_names": graph.buffer_names,
        "loss": name(graph.loss), "model_output": name(graph.model_output),
        "grads": {parameter: node.name for parameter, node in graph.grads.items()},
        "buffer_updates": {buffer: node.name for buffer, node in graph.buffer_updates.items()},
        "aliases": graph.aliases, "notes": graph.notes,
    }


def _train_graph(entry: dict[str, Any], layout: BatchLayout) -> TrainGraph:
    graph: fx.Graph = entry["graph_module"].graph
    by_name = {node.name: node for node in graph.nodes}
    loss = by_name[entry["loss"]]
    return TrainGraph(
        graph=graph, param_names=entry["param_names"], buffer_names=entry["buffer_names"],
        input_specs=layout.tensor_specs, loss=loss,
        grads={parameter: by_name[node] for parameter, node in entry["grads"].items()},
        buffer_updates={buffer: by_name[node] for buffer, node in entry["buffer_updates"].items()},
        model_output=by_name[entry["model_output"]] if entry["model_output"] is not None else None,
        notes=entry["notes"], aliases=entry["aliases"], layout=layout,
    )
