"""Every environment knob tandem reads, declared in one place.

Explicit arguments always beat these; an env var only fills in what the caller left unset.
Read a knob with ``knob("NAME")``; it parses, validates and names the variable in any error.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Knob:
    name: str
    kind: type  # int, float, str or bool
    default: Any
    help: str


_KNOBS: dict[str, Knob] = {}


def _declare(name: str, kind: type, default: Any, help: str) -> None:
    _KNOBS[name] = Knob(name, kind, default, help)


# engine
_declare("TANDEM_ENGINE", str, "threaded", "dependency engine: 'threaded' or 'naive' (synchronous, for debugging)")
_declare("TANDEM_ENGINE_COMPUTE_THREADS", int, 1, "worker threads of the threaded engine's compute pool")
_declare("TANDEM_ENGINE_IO_THREADS", int, 2, "worker threads of the threaded engine's communication/IO pool")
_declare("TANDEM_ENGINE_TIMEOUT", float, 300.0, "seconds any engine wait may block before it raises")
_declare("TANDEM_RETAIN_HOST_MEMORY", bool, True,
         "keep memory freed by a step for the next one (glibc malloc: no trimming, 32 MiB mmap threshold)")
_declare("TANDEM_TRACE", str, "", "write a Chrome/Perfetto trace of every engine op to this path")
# bulking
_declare("TANDEM_BULK_TRAIN", bool, True, "bulk training graphs into segments (0: one engine op per node)")
_declare("TANDEM_BULK_INFERENCE", bool, True, "run inference graphs as one segment (0: bulk like training)")
_declare("TANDEM_BULK_MAX_NODE_TRAIN", int, 15, "max op nodes per training segment (placeholders do not count)")
_declare("TANDEM_BULK_MAX_NODE_TRAIN_FWD", int, -1, "forward cap; overrides TANDEM_BULK_MAX_NODE_TRAIN when >= 0")
_declare("TANDEM_BULK_MAX_NODE_TRAIN_BWD", int, -1, "backward cap; overrides TANDEM_BULK_MAX_NODE_TRAIN when >= 0")
_declare("TANDEM_BULK_CUT_GRADIENT", int, -1,
         "a backward segment also ends after the op that finishes a gradient of at least this many elements, so that "
         "it can be sent at once (0: never; -1: 65536 in distributed training, never alone)")
# backend
_declare("TANDEM_BACKEND", str, "aten",
         "how segments become code: 'aten' (generated Python over aten ops) or 'inductor' (compiled kernels)")
_declare("TANDEM_INDUCTOR_CPP_WRAPPER", bool, False,
         "inductor backend: each compiled segment runs as one C++ call that releases the GIL (threads that send "
         "gradients run beside it) instead of Python calling its kernels one by one; compiles slower")
_declare("TANDEM_FAST_BERNOULLI", bool, True,
         "CPU dropout draws its masks with tandem's vectorised mt19937 (the same numbers as torch's; compiled with "
         "the system C compiler on first use, where a self-test matches torch): 0 keeps aten's bernoulli")
# capture
_declare("TANDEM_CAPTURE_CACHE", bool, True,
         "keep captured step graphs on disk (under inductor's cache directory) and load them in later processes "
         "instead of tracing the same model and batch shapes again (0: always trace)")
_declare("TANDEM_UNIT_CACHE", bool, True,
         "inductor backend: remember which of inductor's cached compilations each compiled unit is, so that a later "
         "process loads its kernels without inductor hashing the unit's graph again (0: look them up through "
         "inductor's caches)")
# mirroring
_declare("TANDEM_MIRROR", str, "off", "backward mirroring policy: off, all, sqrt, memory-aware, a fraction, or '300MB'")
# kvstore
_declare("TANDEM_ROLE", str, "", "role of this process in a distributed job: 'server' or 'worker'")
_declare("TANDEM_NUM_WORKERS", int, 1, "number of worker processes in the job")
_declare("TANDEM_NUM_SERVERS", int, 1, "number of server processes in the job")
_declare("TANDEM_RANK", int, 0, "rank of this process within its role")
_declare("TANDEM_MASTER_ADDR", str, "127.0.0.1", "address of the rendezvous store (torch TCPStore)")
_declare("TANDEM_MASTER_PORT", int, 29500, "port of the rendezvous store")
_declare("TANDEM_BIND_ADDR", str, "127.0.0.1", "address servers bind to; set 0.0.0.0 only on a trusted network")
_declare("TANDEM_KVSTORE_BIGARRAY_BOUND", int, 1_000_000, "arrays of at least this many elements are split over all servers")
_declare("TANDEM_KVSTORE_SLICE_THRESHOLD", int, 40_000, "P3 slice size in elements (0: tune it automatically)")
_declare("TANDEM_KVSTORE_P3", bool, False, "make dist_sync/dist_async stores P3 stores (set by `tandem launch --p3`)")
_declare("TANDEM_PS_WATER_MARK", int, 10, "P3: max pushes in flight (sent, not yet acknowledged) per worker")
_declare("TANDEM_PS_BATCH_SEGMENTS", bool, True,
         "P3: a backward segment's gradients leave together (one message per server where they fit), not one "
         "request per parameter as each gradient is announced")
_declare("TANDEM_SEND_BUCKET_ELEMENTS", int, -1,
         "overlap and p3: backward segments' gradients leave together once at least this many elements are "
         "finished (what is left when backward ends leaves then); fewer, larger sends cost the store fewer "
         "collectives (rounds) and messages per step. 0: each segment's gradients leave as it ends; -1: the store's "
         "choice (collective: one slice, so small gradients share a collective; parameter server: 0)")
_declare("TANDEM_COLLECTIVE_ORDERED", str, "auto",
         "collective store under a Trainer: 1 issues each step's sends in the order they are made, without agreement "
         "rounds; 0 agrees in rounds, where a slice sent later may overtake earlier ones (P3); auto: in order for "
         "communication='overlap', rounds for 'p3', and with slice_size='auto' the tuner chooses")
_declare("TANDEM_PS_HEARTBEAT", float, 1.0, "seconds between heartbeats")
_declare("TANDEM_PS_COALESCE_BYTES", int, 256 * 1024,
         "data requests to one server (and a server's replies to one worker) sent together in one message, "
         "up to this many payload bytes (0: every request its own message)")
_declare("TANDEM_PS_TIMEOUT", float, 10.0, "seconds without a heartbeat before a peer is declared dead")
_declare("TANDEM_PS_WAIT_TIMEOUT", float, 300.0, "seconds a kvstore wait (pull, barrier, init) may block before it raises")
_declare("TANDEM_PS_SECRET", str, "",
         "shared secret: every message is tagged with keys derived from it, and unsigned or replayed ones are "
         "dropped (`tandem launch` makes one per job when unset)")
_declare("TANDEM_PS_MAX_FRAME_BYTES", int, 64 * 2**20,
         "largest frame a kvstore socket accepts (bigger: the sender is dropped before the frame is buffered); "
         "slots are cut to fit it")
_declare("TANDEM_PS_CHECKPOINT_DIR", str, "",
         "directory a server's SAVE/LOAD stay inside (unset: the server's working directory)")
_declare("TANDEM_PS_CURVE_SERVER_KEY", str, "", "CURVE: the servers' public key (Z85; `tandem launch --curve` sets it)")
_declare("TANDEM_PS_CURVE_SERVER_SECRET_KEY", str, "", "CURVE: the servers' secret key (servers only)")
_declare("TANDEM_PS_CURVE_WORKER_KEY", str, "", "CURVE: the workers' public key")
_declare("TANDEM_PS_CURVE_WORKER_SECRET_KEY", str, "", "CURVE: the workers' secret key (workers only)")
_declare("TANDEM_RESTART_ATTEMPT", int, 0,
         "which start of the job this is (`tandem launch --max-restarts` sets it: 0, then 1, ...); "
         "names the rendezvous keys so that a restarted job never reads the last one's")
_declare("TANDEM_NUM_THREADS", int, 0, "torch threads per process in multi-process runs (0: cores / processes)")


def knob(name: str) -> Any:
    """The value of a declared knob: the env var parsed to its type, or its default."""
    spec = _KNOBS.get(name)
    if spec is None:
        raise KeyError(f"{name} is not a declared tandem knob; declare it in tandem/env.py")
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return spec.default
    try:
        if spec.kind is bool:
            if raw.lower() in ("1", "true", "yes", "on"):
                return True
            if raw.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        return spec.kind(raw)
    except ValueError:
        raise ValueError(
            f"environment variable {name}={raw!r} is not a valid {spec.kind.__name__}: {spec.help}"
        ) from None


def is_set(name: str) -> bool:
    if name not in _KNOBS:
        raise KeyError(f"{name} is not a declared tandem knob; declare it in tandem/env.py")
    return os.environ.get(name, "") != ""


def all_knobs() -> list[Knob]:
    return list(_KNOBS.values())
