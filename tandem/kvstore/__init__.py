"""Key-value stores for data-parallel training: ``local`` (one process) and a parameter server.

``create("local")`` sums per-device values in this process; ``create("dist_sync")`` and
``create("dist_async")`` join a parameter-server job started by ``tandem launch`` or torchrun
(see docs/distributed.md); ``dist_p3`` / ``dist_p3_async`` add priority-based propagation (docs/p3.md).
"""

from __future__ import annotations

from typing import Any

from tandem.env import knob
from tandem.kvstore.base import Handle, KVStore
from tandem.kvstore.errors import KVStoreError, KVStoreTimeout, PeerFailure, ProtocolError, RemoteError
from tandem.kvstore.local import LocalKVStore

KINDS = ("local", "dist_sync", "dist_async", "dist_p3", "dist_p3_async")
P3_FOR = {"dist_sync": "dist_p3", "dist_async": "dist_p3_async"}  # what TANDEM_KVSTORE_P3=1 (launch --p3) makes of a kind


def resolve_kind(kind: str) -> str:
    """The kind ``create(kind)`` makes: under TANDEM_KVSTORE_P3=1 (``tandem launch --p3``) the
    parameter-server kinds become their P3 kinds."""
    return P3_FOR[kind] if kind in P3_FOR and knob("TANDEM_KVSTORE_P3") else kind


def create(kind: str = "local", **options: Any) -> KVStore:
    """A new store of ``kind``; distributed kinds read their topology from the environment.

    Options of distributed kinds (each defaults to its TANDEM_* knob): ``bigarray_bound``,
    ``heartbeat``, ``timeout``, ``secret``, ``bind_addr``, ``rendezvous_timeout``, ``exit_on_failure``;
    ``dist_p3``/``dist_p3_async`` also take ``slice_size`` (or "auto") and ``water_mark`` (docs/p3.md).
    With TANDEM_KVSTORE_P3=1 (``tandem launch --p3``) ``dist_sync``/``dist_async`` become P3 stores.

    Example:
        ```python
        kv = tandem.kvstore.create("local")
        kv.init("w", torch.zeros(3))
        kv.push("w", [torch.ones(3), torch.ones(3)]).wait()   # one value per device: summed
        out = torch.empty(3)
        kv.pull("w", out).wait()                              # out is [2., 2., 2.]

        kv = tandem.kvstore.create("dist_sync")               # a worker of a job (tandem launch, torchrun)
        ```
    In a server process of a distributed job this call serves until the job ends and exits the process.
    """
    if kind == "local":
        if options:
            raise TypeError(f"the local kvstore takes no options, got {sorted(options)}")
        return LocalKVStore()
    kind = resolve_kind(kind)
    if kind in ("dist_sync", "dist_async"):
        from tandem.kvstore.ps import connect  # imported late: zmq is only needed for distributed runs

        return connect(kind, **options)
    if kind in ("dist_p3", "dist_p3_async"):
        from tandem.kvstore.ps.p3 import (
            connect as connect_p3,  # options: slice_size, water_mark, as dist_sync's
        )

        return connect_p3(kind, **options)
    raise ValueError(f"unknown kvstore kind {kind!r}; choose one of {KINDS}")


__all__ = ["KINDS", "Handle", "KVStore", "KVStoreError", "KVStoreTimeout", "LocalKVStore", "PeerFailure",
           "ProtocolError", "RemoteError", "create", "resolve_kind"]  # fmt: skip
