"""The capture cache: a captured TrainGraph kept on disk, so that a new process training the same
model on the same batch shapes loads the graph instead of tracing the step again.

Tracing is most of a warm first call: AOT autograd traces every op of the forward and of
autograd's backward on fake tensors, about 1 ms a node (lstm_lm's 3,900 nodes: 4-7 s), while
inductor's own caches bring compiling the segments down to a few seconds. Loading the pickled
graph rebuilds the fake values instead of tracing them: a fraction of the time.

**What the key holds** (what a trace on fake tensors can depend on; a difference is a miss):
source files (the classes', the loss's, tandem's, and every loaded module outside installed
packages), the defining modules' functions as they are in memory, package versions, each class's
methods (closures, module settings they read) and class attributes, each submodule's attributes,
the loss function (with a bound method's object), parameter and buffer structure (names, shapes,
strides, dtypes, devices, ties; never values), the batch layout, torch's global switches that
pick aten ops, and the capture options. What the key cannot describe is not cached (``bypass``);
docs/capture.md says what it cannot see. A loaded graph is checked against the live parameters
once more.

**Where**: ``tandem_capture/`` under inductor's cache directory (``TORCHINDUCTOR_CACHE_DIR``,
default ``/tmp/torchinductor_$USER``), so clearing one clears both. Entries are pickles, loaded
only from a directory and files this user owns and no one else may write. ``TANDEM_CAPTURE_CACHE=0``
turns the cache off.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import enum
import functools
import hashlib
import importlib.metadata
import logging
import os
import site
import sys
import sysconfig
import types
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from tandem import cache_files
from tandem.env import knob
from tandem.graph.batch import BatchLayout
from tandem.graph.train_graph import TrainGraph

log = logging.getLogger(__name__)

OFF_SWITCH = "TANDEM_CAPTURE_CACHE"
FORMAT = 1  # bump when what an entry holds changes in a way tandem's source hash cannot see (torch's pickler)


def enabled() -> bool:
    return bool(knob(OFF_SWITCH))


def directory() -> Path:
    return cache_files.folder("tandem_capture")


# -- the key ------------------------------------------------------------------------------


class _Uncacheable(Exception):
    """Something the trace may read that the key cannot describe faithfully: trace, do not cache."""


def key(module: nn.Module, loss_fn: Callable[..., Any], layout: BatchLayout, options: dict[str, Any]) -> str | None:
    """The cache key of capturing ``loss_fn(module, *batch)``, or None when it cannot be keyed
    safely (a hook on a module of the tree, an attribute the key cannot describe)."""
    roots = [module, *([loss_fn] if isinstance(loss_fn, nn.Module) else [])]  # a module loss is traced too
    if _has_hooks(roots):
        return None
    try:
        return _Key(roots).digest(loss_fn, layout, options)
    except Exception as error:  # _Uncacheable, or an attribute that fails to describe itself: trace, do not cache
        log.info("tandem: the step is not cached: %s: %s", type(error).__name__, error)
        return None


_MODULE_INTERNALS = frozenset(vars(nn.Module()))  # what every module holds: parameters, hooks, training, ...
_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_UNSTABLE_FIELDS = frozenset({"_original_object_hash"})  # transformers' GenerationConfig: hash(), salted per process
_MAX_DEPTH, _MAX_ITEMS = 8, 10_000  # past these an attribute is not described: the step is not cached
_PLAIN = (bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.memory_format, torch.layout,
          range, slice, type(None), type(Ellipsis))


def _has_hooks(roots: list[nn.Module]) -> bool:
    from torch.nn.modules import module as module_globals

    global_hooks = [getattr(module_globals, f"_global{name}", {}) for name in _HOOK_DICTS]
    return any(global_hooks) or any(getattr(m, name, None) for root in roots for m in root.modules()
                                    for name in _HOOK_DICTS)


def torch_state() -> tuple[Any, ...]:
    """Global switches that change which aten ops a trace records."""
    backends = torch.backends
    return (torch.get_default_dtype(), torch.get_default_device(), torch.is_grad_enabled(),
            [(device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)) for device in ("cpu", "cuda")],
            torch.are_deterministic_algorithms_enabled(), backends.cudnn.enabled, backends.mkldnn.enabled,
            backends.opt_einsum.enabled, backends.cuda.flash_sdp_enabled(), backends.cuda.mem_efficient_sdp_enabled(),
            backends.cuda.math_sdp_enabled(), backends.cuda.cudnn_sdp_enabled())


class _Key:
    """One key's computation: ``roots`` (the module, and the loss when it is a module) by structure,
    everything else the trace may read by description."""

    def __init__(self, roots: list[nn.Module]) -> None:
        self.roots = roots
        self.hash = hashlib.sha256()
        # a module's own parameters and buffers are placeholders of the graph: described by name, never by value
        self.owned = {id(tensor): f"{index}.{name}" for index, root in enumerate(roots)
                      for name, tensor in [*root.named_parameters(remove_duplicate=False),
                                           *root.named_buffers(remove_duplicate=False)]}
        self.active: set[int] = set()  # functions being described: a closure may hold its own function

    def add(self, *parts: Any) -> None:
        for part in parts:
            self.hash.update(repr(part).encode())
            self.hash.update(b"\0")

    def digest(self, loss_fn: Callable[..., Any], layout: BatchLayout, options: dict[str, Any]) -> str:
        self.add(FORMAT, torch.__version__, sys.version_info[:3], sorted(options.items()), torch_state())
        self.add(str(layout.tree), str(layout))
        classes = [cls for root in self.roots for cls in _classes(root)]
        defining = [*classes, type(loss_fn), *([loss_fn] if isinstance(loss_fn, types.FunctionType) else [])]
        for path in sorted({*_source_files(defining), *_user_files()}):
            self.add(path, _file_digest(path))
        self.add(sorted(_package_versions(defining).items()), _live_code(defining))
        for cls in classes:  # methods with their closures and the globals they read; class attributes
            self.add(f"{cls.__module__}.{cls.__qualname__}",
                     [(name, self.describe(value)) for name, value in sorted(vars(cls).items())
                      if isinstance(value, types.FunctionType) or not name.startswith(("__", "_abc_"))])
        for index, root in enumerate(self.roots):
            self.structure(index, root)
        self.add(self.describe(loss_fn))
        return self.hash.hexdigest()

    def structure(self, index: int, root: nn.Module) -> None:
        first = {id(p): name for name, p in reversed(list(root.named_parameters(remove_duplicate=False)))}
        for name, parameter in root.named_parameters(remove_duplicate=False):
            self.add(index, name, tuple(parameter.shape), parameter.stride(), parameter.dtype, parameter.device,
                     parameter.requires_grad, first[id(parameter)], _device_model(parameter.device))
        for name, buffer in root.named_buffers(remove_duplicate=False):
            self.add(index, name, tuple(buffer.shape), buffer.stride(), buffer.dtype, buffer.device)
        for name, submodule in root.named_modules(remove_duplicate=False):
            cls = type(submodule)
            self.add(index, name, f"{cls.__module__}.{cls.__qualname__}", submodule.training,
                     self.describe({k: v for k, v in vars(submodule).items() if k not in _MODULE_INTERNALS}))

    def describe(self, value: Any, depth: int = 0) -> Any:
        """A stable, comparable description of what a trace may branch on or bake in; raises
        _Uncacheable where it cannot give one."""
        if depth > _MAX_DEPTH:
            raise _Uncacheable(f"an attribute nested deeper than {_MAX_DEPTH} levels ({type(value).__name__})")
        if isinstance(value, _PLAIN):
            return (type(value).__name__, repr(value))
        if isinstance(value, torch.Tensor):
            if id(value) in self.owned:
                return ("owned", self.owned[id(value)])
            data = value.detach().cpu().contiguous().reshape(-1).view(torch.uint8)  # a constant: baked in by value
            return ("tensor", tuple(value.shape), value.stride(), str(value.dtype), _bytes_digest(data.numpy()))
        if isinstance(value, nn.Module):  # the tree's modules are described where they sit
            return ("module", f"{type(value).__module__}.{type(value).__qualname__}")
        if isinstance(value, weakref.ref):
            return ("weakref", self.describe(value(), depth + 1))
        if isinstance(value, list | tuple | set | frozenset | dict):
            if len(value) > _MAX_ITEMS:
                raise _Uncacheable(f"a {type(value).__name__} of {len(value)} items")
            if isinstance(value, dict):
                return ("dict", sorted((repr(self.describe(k, depth + 1)), repr(self.describe(v, depth + 1)))
                                       for k, v in value.items()))
            items = [repr(self.describe(item, depth + 1)) for item in value]
            return (type(value).__name__, sorted(items) if isinstance(value, set | frozenset) else items)
        if isinstance(value, types.MethodType):  # a bound method: its function and the object it is bound to
            return ("method", self.describe(value.__func__, depth + 1), self.describe(value.__self__, depth + 1))
        if isinstance(value, types.FunctionType):
            if id(value) in self.active:  # a decorator's wrapper that holds itself: described once
                return ("function", value.__module__, value.__qualname__, "itself")
            self.active.add(id(value))
            try:
                return ("function", value.__module__, value.__qualname__, _code_digest(value.__code__),
                        [self.describe(cell.cell_contents, depth + 1) for cell in value.__closure__ or ()],
                        self.describe(value.__defaults__, depth + 1), self.describe(value.__kwdefaults__, depth + 1),
                        self.describe(_globals_read(value), depth + 1))
            finally:
                self.active.discard(id(value))
        if isinstance(value, functools.partial):
            return ("partial", self.describe(value.func, depth + 1), self.describe(value.args, depth + 1),
                    self.describe(value.keywords, depth + 1))
        if isinstance(value, staticmethod | classmethod):
            return (type(value).__name__, self.describe(value.__func__, depth + 1))
        if isinstance(value, property):
            return ("property", self.describe(value.fget, depth + 1), self.describe(value.fset, depth + 1))
        if isinstance(value, type | types.ModuleType | types.BuiltinFunctionType | torch._ops.OpOverload
                      | torch._ops.OpOverloadPacket):  # by name: their code is in a versioned package or a hashed file
            owner = getattr(value, "__self__", None)
            return ("named", getattr(value, "__module__", None), getattr(value, "__qualname__", None),
                    getattr(value, "__name__", str(value) if isinstance(value, torch._ops.OpOverload) else None),
                    owner.__name__ if isinstance(owner, type | types.ModuleType) else None)
        kind = f"{type(value).__module__}.{type(value).__qualname__}"
        if type(value).__module__ == "numpy" and hasattr(value, "tobytes"):  # reprs elide long arrays
            return (kind, getattr(value, "shape", None), str(getattr(value, "dtype", None)), _bytes_digest(value))
        code = getattr(value, "gi_code", None) or getattr(value, "cr_code", None)
        if isinstance(code, types.CodeType):  # a generator (a context manager's): by the code it runs
            return (kind, _code_digest(code))
        fields = {k: v for k, v in vars(value).items() if k not in _UNSTABLE_FIELDS} if hasattr(value, "__dict__") else {}
        slots = [name for cls in type(value).__mro__ for name in getattr(cls, "__slots__", ())
                 if isinstance(name, str) and name not in ("__dict__", "__weakref__") and hasattr(value, name)]
        if fields or slots:  # an object (a config, a trainer): by its fields
            return (kind, self.describe({**fields, **{name: getattr(value, name) for name in slots}}, depth + 1))
        text = repr(value)
        if " at 0x" in text or hasattr(value, "__dict__"):
            raise _Uncacheable(f"an attribute of type {kind}, which has no fields to describe")
        return (kind, text)  # a value type of its own (a pattern, a decimal): its repr is what it is


def _bytes_digest(array: Any) -> str:
    return hashlib.sha256(array.tobytes()).hexdigest()


def _device_model(device: torch.device) -> Any:
    """The accelerator's model where the trace may depend on it (which attention kernel it picks)."""
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else None


def _globals_read(function: types.FunctionType) -> dict[str, Any]:
    """The module globals ``function``'s code names that hold settings (plain values, namespaces,
    dataclasses, enums): code is covered by the files and _live_code; other objects (loggers,
    registries) are not described."""
    names: set[str] = set()
    pending = [function.__code__]
    while pending:
        code = pending.pop()
        names.update(code.co_names)
        pending.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
    return {name: function.__globals__[name] for name in sorted(names)
            if name in function.__globals__ and _is_setting(function.__globals__[name])}


def _is_setting(value: Any) -> bool:
    if isinstance(value, (*_PLAIN, enum.Enum, argparse.Namespace, types.SimpleNamespace)):
        return True
    if isinstance(value, list | tuple | set | frozenset):
        return all(_is_setting(item) for item in value)
    if isinstance(value, dict):
        return all(_is_setting(k) and _is_setting(v) for k, v in value.items())
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


def _code_digest(code: types.CodeType) -> str:
    """Bytecode, the names it reads (``torch.relu`` and ``torch.tanh`` differ only there) and its
    constants, nested code objects (lambdas, comprehensions) by their own digest: no addresses."""
    return hashlib.sha256(repr((code.co_code, code.co_names, code.co_varnames, code.co_freevars, code.co_argcount,
                                code.co_kwonlyargcount, code.co_flags,
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
    roots = [paths[name] for name in ("stdlib", "platstdlib", "purelib", "platlib")]
    roots += [*site.getsitepackages(), site.getusersitepackages()] if hasattr(site, "getsitepackages") else []
    return tuple(os.path.abspath(root) + os.sep for root in roots)


def _installed(path: str) -> bool:
    parts = Path(path).parts
    return path.startswith(_installed_roots()) or "site-packages" in parts or "dist-packages" in parts


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
            if not _installed(path) and not path.startswith(tandem_root):
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


def load(cache_key: str, module: nn.Module, loss_fn: Callable[..., Any], layout: BatchLayout) -> TrainGraph | None:
    """The TrainGraph stored under ``cache_key``, or None (a miss). Never raises: a broken entry, or
    one whose parameters differ from ``module``'s, is dropped with a warning."""
    path = directory() / f"{cache_key}.pkl"
    data = cache_files.read(path, OFF_SWITCH)
    if data is None:
        return None
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx._graph_pickler import GraphPickler

    try:
        entry = GraphPickler.loads(data, FakeTensorMode())
        if not isinstance(entry, dict):
            raise TypeError(f"the entry holds a {type(entry).__name__}, not a captured graph")
        graph = _train_graph(entry, layout)
        _check_parameters(graph, module, loss_fn)
        return graph
    except Exception as error:  # a torn or stale entry: trace again, and drop it
        log.warning("tandem: ignoring the capture cache entry %s (%s: %s)", path, type(error).__name__, error)
        with contextlib.suppress(OSError):
            path.unlink()
        return None


def store(cache_key: str, graph: TrainGraph) -> bool:
    """Write ``graph`` under ``cache_key``; whether it was stored. Never raises: a graph that cannot
    be pickled, or a directory that cannot be written or trusted, is not stored."""
    if any(node.op == "get_attr" for node in graph.graph.nodes):
        return False  # its attributes live in a module the entry would not hold
    from torch.fx._graph_pickler import GraphPickler, Options

    try:
        data = GraphPickler.dumps(_entry(graph), Options(ops_filter=None))
    except Exception as error:
        log.info("tandem: the captured graph was not cached (%s: %s)", type(error).__name__, error)
        return False
    return cache_files.write(directory() / f"{cache_key}.pkl", data, OFF_SWITCH)


def _check_parameters(graph: TrainGraph, module: nn.Module, loss_fn: Callable[..., Any]) -> None:
    """A last check of a loaded graph against the live model: every parameter and buffer placeholder
    names one of its tensors, of the same shape, strides and dtype."""
    live = {**dict(module.named_parameters(remove_duplicate=False)), **dict(module.named_buffers(remove_duplicate=False))}
    if isinstance(loss_fn, nn.Module):
        live.update((f"loss_fn.{name}", tensor) for name, tensor in
                    [*loss_fn.named_parameters(remove_duplicate=False), *loss_fn.named_buffers(remove_duplicate=False)])
    for name, node in [*graph.param_nodes.items(), *graph.buffer_nodes.items()]:
        tensor, value = live.get(name), node.meta.get("val")
        if tensor is None or not isinstance(value, torch.Tensor):
            raise ValueError(f"the entry's {name} is not a tensor of the model")
        if (tuple(value.shape), value.stride(), value.dtype) != (tuple(tensor.shape), tensor.stride(), tensor.dtype):
            raise ValueError(f"the entry's {name} is {list(value.shape)}:{value.dtype}, the model's "
                             f"{list(tensor.shape)}:{tensor.dtype}")


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
