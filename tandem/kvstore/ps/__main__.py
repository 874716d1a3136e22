"""``python -m tandem.kvstore.ps [--kind dist_sync]``: run one kvstore server process.

An alternative to the ps-lite style (the training script itself serving when ``TANDEM_ROLE=server``)
for tools that start servers on their own; the topology comes from the TANDEM_* environment.
"""

from __future__ import annotations

import argparse
import sys

from tandem.kvstore.ps.server import run_server
from tandem.kvstore.ps.topology import KINDS, DistOptions, Topology, set_torch_threads


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tandem.kvstore.ps", description=__doc__.splitlines()[0])
    parser.add_argument("--kind", default="dist_sync", choices=KINDS, help="sync or async server (default dist_sync)")
    args = parser.parse_args(argv)
    topology = Topology.from_env()
    if topology.role != "server":
        parser.error(f"TANDEM_ROLE is {topology.role!r}; this entry point only runs servers")
    set_torch_threads(topology)
    return run_server(topology, DistOptions.from_env(args.kind))


if __name__ == "__main__":
    sys.exit(main())
