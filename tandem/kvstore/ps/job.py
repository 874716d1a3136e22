"""Joining a parameter-server job in the role the environment gives this process (``tandem launch``
or torchrun; see topology.py): a worker gets its store (``connect``), a server runs its loop
(``serve``). ``tandem.kvstore.create`` and ``tandem.kvstore.serve`` call these.
"""

from __future__ import annotations

from typing import Any

from tandem.kvstore.config import DistOptions, KVStoreConfig, P3Options
from tandem.kvstore.errors import KVStoreError
from tandem.kvstore.kinds import DISTRIBUTED_KINDS
from tandem.kvstore.ps.p3 import P3KVStore, P3Server
from tandem.kvstore.ps.server import Server
from tandem.kvstore.ps.topology import Topology, set_torch_threads
from tandem.kvstore.ps.worker import DistKVStore


def is_server() -> bool:
    """Whether the environment makes this process a server of a job (False outside a job)."""
    try:
        return Topology.from_env().role == "server"
    except KVStoreError:
        return False


def connect(config: KVStoreConfig | str, **options: Any) -> DistKVStore:
    """This worker's store in the job: ``config`` (a ``KVStoreConfig``, or a kind and the options of
    ``tandem.kvstore.create``). A server process is refused: it runs ``serve`` instead."""
    config = KVStoreConfig.of(config, **options)
    topology, settings, p3 = _join(config)
    if topology.role == "server":
        raise KVStoreError(
            f"this process is {topology.name} of the job (TANDEM_ROLE=server, or a server rank under torchrun): "
            f"a server runs `tandem.kvstore.serve({config.kind!r})`, not create(); start the script with `if "
            f"tandem.kvstore.is_server(): sys.exit(tandem.kvstore.serve({config.kind!r}))` (tandem train does this)"
        )
    return P3KVStore(topology, settings, p3) if p3 is not None else DistKVStore(topology, settings)


def serve(config: KVStoreConfig | str, **options: Any) -> int:
    """Run this server process's loop until the job ends; returns its exit status (0: every worker
    said goodbye, 1: the job failed). Config as ``connect``'s (the workers' own are checked, unused)."""
    config = KVStoreConfig.of(config, **options)
    topology, settings, p3 = _join(config)
    if topology.role != "server":
        raise KVStoreError(f"this process is {topology.name} of the job: only a server serves; "
                           f"a worker joins with tandem.kvstore.create({config.kind!r})")  # fmt: skip
    return (P3Server if p3 is not None else Server)(topology, settings).serve()


def _join(config: KVStoreConfig) -> tuple[Topology, DistOptions, P3Options | None]:
    """The topology of the job and ``config``'s settings (P3's own for the P3 kinds); the settings
    were resolved and checked when ``config`` was made, before this touches the job."""
    if config.dist is None:
        raise KVStoreError(f"unknown distributed kvstore kind {config.kind!r}; choose one of {DISTRIBUTED_KINDS}")
    topology = Topology.from_env()
    set_torch_threads(topology)
    return topology, config.dist, config.p3
