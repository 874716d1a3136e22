"""The distributed kvstore: servers and workers in separate processes talking ZeroMQ.

``connect(kind)`` is what ``tandem.kvstore.create("dist_sync")`` calls. The same script plays
every role (ps-lite style): in a server process the call runs the server loop and then exits the
process; in a worker process it returns a connected ``DistKVStore``.
"""

from __future__ import annotations

import sys
from typing import Any

from tandem.kvstore.ps.server import run_server
from tandem.kvstore.ps.topology import DistOptions, Topology, set_torch_threads
from tandem.kvstore.ps.worker import DistKVStore


def connect(kind: str, **options: Any) -> DistKVStore:
    """Join the job the environment describes: serve and exit (server role) or return the worker's store."""
    settings = DistOptions.from_env(kind, **options)
    topology = Topology.from_env()
    set_torch_threads(topology)
    if topology.role == "server":
        sys.exit(run_server(topology, settings))
    return DistKVStore(topology, settings)


__all__ = ["DistKVStore", "DistOptions", "Topology", "connect", "run_server"]
