"""Prints its role and rank, then exits with the code given for that process (for launcher tests)."""

from __future__ import annotations

import os
import sys

role, rank = os.environ["TANDEM_ROLE"], int(os.environ["TANDEM_RANK"])
print(f"hello from {role} {rank} of {os.environ['TANDEM_NUM_WORKERS']}w/{os.environ['TANDEM_NUM_SERVERS']}s "
      f"threads={os.environ['TANDEM_NUM_THREADS']} extra={os.environ.get('EXTRA', '')}")  # fmt: skip
print("second line", flush=True)
if role == "worker" and rank == int(sys.argv[1]):
    sys.exit(3)
if role == "server":
    import time

    time.sleep(60)  # servers of this fake job never finish: the launcher must stop them
