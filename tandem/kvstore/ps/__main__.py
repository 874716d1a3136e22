"""``python -m tandem.kvstore.ps [--kind dist_sync]``: run one kvstore server process.

The server role's entry point for tools that start servers on their own (a training script can call
``tandem.kvstore.serve(kind)`` itself, as ``tandem train`` does); the topology comes from the
TANDEM_* environment.
"""

from __future__ import annotations

import argparse
import logging
import sys

from tandem.kvstore.kinds import DISTRIBUTED_KINDS
from tandem.kvstore.ps.job import serve
from tandem.kvstore.ps.topology import Topology


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tandem.kvstore.ps", description=__doc__.splitlines()[0])
    parser.add_argument("--kind", default="dist_sync", choices=DISTRIBUTED_KINDS,
                        help="sync or async server, plain or P3 (default dist_sync)")  # fmt: skip
    args = parser.parse_args(argv)
    topology = Topology.from_env()
    if topology.role != "server":
        parser.error(f"TANDEM_ROLE is {topology.role!r}; this entry point only runs servers")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    return serve(args.kind)


if __name__ == "__main__":
    sys.exit(main())
