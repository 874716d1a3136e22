"""Joining a parameter-server job in the role the environment gives this process (``tandem launch``
or torchrun; see topology.py): a worker gets its store (``connect``), a server runs its loop
(``serve``). ``tandem.kvstore.create`` and ``tandem.kvstore.serve`` call these.
"""

from __future__ import annotations

from typing import Any

from tandem.kvstore.errors import KVStoreError
from tandem.kvstore.kinds import DISTRIBUTED_KINDS
from tandem.kvstore.ps.p3 import P3_KINDS, P3KVStore, P3Options, P3Server
from tandem.kvstore.ps.server import Server
from tandem.kvstore.ps.topology import DistOptions, Topology, set_torch_threads
from tandem.kvstore.ps.worker import DistKVStore


def is_server() -> bool:
    """Whether the environment makes this process a server of a job (False outside a job)."""
    try:
        return Topology.from_env().role == "server"
    except KVStoreError:
        return False


def connect(kind: str, **options: Any) -> DistKVStore:
    """This worker's store of ``kind`` in the job; options as ``tandem.kvstore.create``'s. A server
    process is refused: it runs ``serve`` instead."""
    topology, settings, p3 = _join(kind, options)
    if topology.role == "server":
        raise KVStoreError(
            f"this process is {topology.name} of the job (TANDEM_ROLE=server, or a server rank under torchrun): "
            f"a server runs `tandem.kvstore.serve({kind!r})`, not create(); start the script with `if "
            f"tandem.kvstore.is_server(): sys.exit(tandem.kvstore.serve({kind!r}))` (tandem train does this)"
        )
    return P3KVStore(topology, settings, p3) if p3 is not None else DistKVStore(topology, settings)


def serve(kind: str, **options: Any) -> int:
    """Run this server process's loop until the job ends; returns its exit status (0: every worker
    said goodbye, 1: the job failed). Options as ``connect``'s (the workers' own are checked, unused)."""
    topology, settings, p3 = _join(kind, options)
    if topology.role != "server":
        raise KVStoreError(f"this process is {topology.name} of the job: only a server serves; "
                           f"a worker joins with tandem.kvstore.create({kind!r})")  # fmt: skip
    return (P3Server if p3 is not None else Server)(topology, settings).serve()


def _join(kind: str, options: dict[str, Any]) -> tuple[Topology, DistOptions, P3Options | None]:
    """The topology and settings of a job's store of ``kind``; P3's own options for the P3 kinds."""
    if kind not in DISTRIBUTED_KINDS:
        raise KVStoreError(f"unknown distributed kvstore kind {kind!r}; choose one of {DISTRIBUTED_KINDS}")
    p3 = None
    if kind in P3_KINDS:  # options: slice_size, water_mark, as dist_sync's
        p3 = P3Options.from_env(options.pop("slice_size", None), options.pop("water_mark", None))
    settings = DistOptions.from_env(P3_KINDS.get(kind, kind), **options)
    topology = Topology.from_env()
    set_torch_threads(topology)
    return topology, settings, p3
