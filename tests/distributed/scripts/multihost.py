"""`python -m tandem ARGS` under torchrun, after printing where this process was told to meet the job.

torchrun sets MASTER_ADDR/PORT (with the c10d backend its agents choose them); tandem reads them, and
TANDEM_BIND_ADDR, to find the rendezvous store and to bind its servers. test_multihost checks them.
"""

from __future__ import annotations

import os
import runpy
import sys

print(f"multihost: rank {os.environ['RANK']} master {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']} "
      f"bind {os.environ.get('TANDEM_BIND_ADDR', '-')}", flush=True)  # fmt: skip
sys.argv = ["tandem", *sys.argv[1:]]
runpy.run_module("tandem", run_name="__main__", alter_sys=True)
