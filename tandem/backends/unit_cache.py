"""The compiled-unit index: which of inductor's cached compilations a compiled unit is, so that a later
process loads the unit's kernels without compiling it again.

Inductor's own caches already make a warm compile skip code generation, but to find its entry
``standalone_compile`` copies the unit's graph, generates its Python code and pickles it for AOT
autograd's cache key: 2-3 s of lstm_lm's warm start, growing with the graph. This index keys a unit
by what decides its kernels, cheaply: the graph inductor is given (each node's op, target and
arguments), the example inputs' layouts and aliasing, tandem's options, inductor's and AOT
autograd's configuration, the process state their keys read, the CPU's instruction set and thread
count (or the GPU and Triton), torch's version and this backend's code (``_environment``). An entry
holds only the name of the AOT autograd cache entry inductor stored for that unit; a hit loads
that entry as ``torch._inductor.CompiledArtifact.load`` does. A miss, an entry inductor no longer
has, or any failure while keying or loading goes through inductor's lookup as before (and indexes
the result). Not indexed: a unit holding a tensor constant the model made (inductor passes such
constants to the compiled code from the graph module, which a loaded entry does not have), one
compiled under a custom pass, and one whose C++ wrapper fell back to the Python one.

**Where**: ``tandem_units/`` under inductor's cache directory, beside the capture cache and
inductor's entries it names: emptying that directory empties all of them. ``TANDEM_UNIT_CACHE=0``
turns the index off; so does inductor's ``fx_graph_cache=False`` (tests that must see a compile).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import platform
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx

from tandem import cache_files
from tandem.env import knob

log = logging.getLogger(__name__)

OFF_SWITCH = "TANDEM_UNIT_CACHE"
FORMAT = 1  # bump when what a key describes changes
_AOT_KEY = re.compile(r"[A-Za-z0-9_\-]{1,200}")  # what inductor names its entries with

CompiledUnit = Callable[[list[Any]], Sequence[Any]]


def enabled() -> bool:
    from torch._inductor import config

    return bool(knob(OFF_SWITCH)) and bool(config.fx_graph_cache) and not config.force_disable_caches


def _path(unit_key: str) -> Path:
    return cache_files.folder("tandem_units") / unit_key


class _Uncacheable(Exception):
    """Something in the unit the key cannot describe faithfully: compile, do not index."""


def key(graph: fx.Graph, example_inputs: Sequence[Any], options: dict[str, Any]) -> str | None:
    """The index key of compiling ``graph`` for ``example_inputs`` with inductor ``options``; None
    where something cannot be described or loaded (a tensor constant: a ``get_attr`` node). Never raises."""
    try:
        digest = hashlib.sha256(f"tandem unit {FORMAT}".encode())
        position: dict[fx.Node, int] = {}
        for node in graph.nodes:
            position[node] = len(position)
            if node.op == "get_attr":  # inductor passes these as inputs its cache entry does not hold
                raise _Uncacheable("it holds a tensor constant")
            entry = (node.op, _describe(node.target, position), _describe(node.args, position),
                     _describe(node.kwargs, position), bool(node.meta.get("steal_arg")))
            digest.update(repr(entry).encode())
        digest.update(repr(_inputs(example_inputs)).encode())
        digest.update(repr(_environment(options, example_inputs)).encode())
        return digest.hexdigest()
    except Exception as error:  # _Uncacheable, or an input the key cannot read (a sparse tensor): compile as before
        log.info("tandem: a unit is not indexed: %s: %s", type(error).__name__, error)
        return None


_PLAIN = (bool, int, float, complex, str, type(None), torch.dtype, torch.device, torch.memory_format, torch.layout)


def _describe(value: Any, position: dict[fx.Node, int]) -> Any:
    """A repr-able description of an argument, equal only for arguments inductor compiles alike."""
    if isinstance(value, fx.Node):
        return ("node", position[value])
    if isinstance(value, _PLAIN):
        return (type(value).__name__, repr(value))  # repr: exact for floats, and 1 differs from 1.0 and True
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, [_describe(item, position) for item in value])
    if isinstance(value, dict):
        return ("dict", sorted((str(k), _describe(v, position)) for k, v in value.items()))
    if isinstance(value, slice):
        return ("slice", _describe((value.start, value.stop, value.step), position))
    if isinstance(value, (torch._ops.OpOverload, torch._ops.OpOverloadPacket, torch._ops.HigherOrderOperator)):
        return ("op", str(value))
    name = getattr(value, "__qualname__", None)
    module = getattr(value, "__module__", None)
    if callable(value) and name and module and "<" not in name:  # operator.getitem, a named function
        return ("function", module, name)
    raise _Uncacheable(f"an argument of type {type(value).__name__}")


def _inputs(example_inputs: Sequence[Any]) -> list[Any]:
    """What inductor specialises a unit on: every tensor's layout and which inputs share storage."""
    first_of_storage: dict[tuple[str, int], int] = {}
    described: list[Any] = []
    for index, value in enumerate(example_inputs):
        if not isinstance(value, torch.Tensor):
            described.append(_describe(value, {}))
            continue
        storage = (str(value.device), value.untyped_storage().data_ptr())
        shared = first_of_storage.setdefault(storage, index)
        described.append((tuple(value.shape), value.stride(), value.storage_offset(), str(value.dtype),
                          str(value.device), value.requires_grad, shared if shared != index else None))
    return described


# inductor settings that hold code (passes, partitioners): a unit compiled under any of them is not indexed
_CUSTOM_CODE = ("post_grad_custom_pre_pass", "post_grad_custom_post_pass", "custom_partitioner_fn",
                "joint_custom_pre_pass", "joint_custom_post_pass", "pre_grad_custom_pass",
                "_pre_fusion_custom_pass", "_post_fusion_custom_pass")


def _environment(options: dict[str, Any], example_inputs: Sequence[Any]) -> tuple[Any, ...]:
    """Everything outside the graph and its inputs that changes the kernels inductor writes: what
    inductor's and AOT autograd's own keys read from the process, for tandem's static-shape units."""
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config
    from torch._inductor.codegen.common import custom_backend_codegen_configs, custom_backend_passes

    from tandem.graph.capture_cache import torch_state

    if any(getattr(inductor_config, name, None) for name in _CUSTOM_CODE) or any(custom_backend_passes.values()) \
            or any(custom_backend_codegen_configs.values()):
        raise _Uncacheable("inductor's configuration holds a custom pass")
    # all of it (the portable subset leaves some out); the trace switches only add misses
    configuration = repr((sorted(options.items()), sorted(inductor_config.get_config_copy().items()),
                          sorted(functorch_config.get_config_copy().items()), torch.compiler.config.cache_key_tag))
    if " at 0x" in configuration:  # a function or object without a stable description
        raise _Uncacheable("inductor's configuration holds an object without a stable description")
    cuda = torch.backends.cuda.matmul
    process = (torch_state(), torch.is_deterministic_algorithms_warn_only_enabled(),
               getattr(torch.utils.deterministic, "fill_uninitialized_memory", None), torch.get_float32_matmul_precision(),
               cuda.allow_tf32, cuda.allow_fp16_reduced_precision_reduction, cuda.allow_bf16_reduced_precision_reduction)
    devices = {value.device for value in example_inputs if isinstance(value, torch.Tensor)}
    machine: list[str] = [platform.machine(), _tandem_source()]
    if not devices or any(device.type == "cpu" for device in devices):
        from torch._inductor import cpu_vec_isa
        from torch._inductor.utils import parallel_num_threads

        # kernels are written for this instruction set and this many threads (OpenMP's count, buffers)
        machine += [str(cpu_vec_isa.pick_vec_isa()), str(parallel_num_threads())]
    cuda_devices = sorted((d for d in devices if d.type == "cuda"), key=str)
    if cuda_devices:
        import triton  # type: ignore[import-not-found,unused-ignore]

        machine.append(f"triton {triton.__version__}")
    for device in cuda_devices:
        machine.append(f"{torch.cuda.get_device_name(device)} {torch.cuda.get_device_capability(device)}")
    return (torch.__version__, torch.version.git_version, configuration, process, machine)


@functools.cache
def _tandem_source() -> str:
    """The code that builds a unit's graph and runs a loaded one: an entry written by other code is not used."""
    here = Path(__file__).resolve().parent
    return hashlib.sha256(b"".join((here / name).read_bytes() for name in ("inductor.py", "unit_cache.py"))).hexdigest()


def load(unit_key: str) -> CompiledUnit | None:
    """The compiled unit indexed under ``unit_key``, called as ``unit(inputs)`` (the list is emptied,
    as inductor's compiled functions do), or None: a miss, a stale entry, any failure. Never raises."""
    data = cache_files.read(_path(unit_key), OFF_SWITCH)
    if data is None:
        return None
    aot_key = data.decode("ascii", errors="replace")
    if not _AOT_KEY.fullmatch(aot_key):
        log.warning("tandem: ignoring the unit index entry %s: it names no inductor entry", _path(unit_key))
        return None
    try:
        compiled = _load_aot_entry(aot_key)
    except Exception as error:  # inductor's entry is damaged or of another torch: compile again
        log.info("tandem: the unit index entry %s did not load (%s: %s)", unit_key, type(error).__name__, error)
        return None
    if compiled is None:
        return None  # inductor's cache no longer holds it
    flatten = torch.utils._pytree.tree_leaves

    def unit(inputs: list[Any]) -> Sequence[Any]:
        flat = flatten(inputs)  # as inductor's wrapper for a graph taking one list does
        inputs.clear()  # the caller's references go: the kernels free each input after its last read
        return compiled(flat)

    return unit


def _load_aot_entry(aot_key: str) -> Callable[[list[Any]], Sequence[Any]] | None:
    """AOT autograd's cache entry ``aot_key`` made callable: ``CompiledArtifact.load``'s steps for an
    entry already in inductor's cache (torch 2.13), without the list-copying wrapper it adds."""
    from torch._functorch._aot_autograd.autograd_cache import AOTAutogradCache
    from torch._inductor.compile_fx import _CompileFxKwargs  # also loads the modules the kernels' code reads
    from torch._inductor.cudagraph_utils import BoxedDeviceIndex
    from torch._inductor.utils import BoxedBool
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.compiler._cache import CacheArtifactManager
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    # with_fresh_cache: inductor would otherwise keep each loaded entry's bytes for the process's life
    with CacheArtifactManager.with_fresh_cache(), torch._inductor.config.patch(unsafe_skip_cache_dynamic_shape_guards=True):
        with torch._functorch.config.patch(strict_autograd_cache=True):
            found = AOTAutogradCache._lookup(aot_key, local=True, remote=False, args=[], cache_info={}, aot_config=None)
        if found is None:
            return None
        entry, _ = found
        fx_config = _CompileFxKwargs(cudagraphs=BoxedBool(False), boxed_forward_device_index=BoxedDeviceIndex(0))
        with torch._guards.tracing(torch._guards.TracingContext(FakeTensorMode(shape_env=ShapeEnv()))):
            return entry.wrap_post_compile([], entry.sanitized_aot_config, fx_config)


def store(unit_key: str, artifact: Any) -> bool:
    """Index the AOT autograd entry ``standalone_compile`` recorded for ``artifact``; whether it was.
    Never raises."""
    recorded = getattr(artifact, "_artifacts", None)  # (bytes, CacheInfo) of what the compile stored or loaded
    names = getattr(recorded[-1], "aot_autograd_artifacts", []) if isinstance(recorded, tuple) and recorded else []
    if len(names) != 1 or not _AOT_KEY.fullmatch(str(names[0])):
        return False
    return cache_files.write(_path(unit_key), str(names[0]).encode("ascii"), OFF_SWITCH)
