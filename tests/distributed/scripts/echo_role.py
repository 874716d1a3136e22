"""Prints its role and rank, then exits with the code given for that process (for launcher tests).

Usage: echo_role.py FAILING_WORKER READY_DIR. Each process marks READY_DIR once it has printed; the
failing worker exits only when every process has (else, on a loaded machine, the launcher could stop
one before it printed).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

role, rank = os.environ["TANDEM_ROLE"], int(os.environ["TANDEM_RANK"])
print(f"hello from {role} {rank} of {os.environ['TANDEM_NUM_WORKERS']}w/{os.environ['TANDEM_NUM_SERVERS']}s "
      f"threads={os.environ['TANDEM_NUM_THREADS']} extra={os.environ.get('EXTRA', '')}")  # fmt: skip
print("second line", flush=True)
ready = Path(sys.argv[2])
(ready / f"{role}{rank}").touch()
if role == "worker" and rank == int(sys.argv[1]):
    processes = int(os.environ["TANDEM_NUM_WORKERS"]) + int(os.environ["TANDEM_NUM_SERVERS"])
    deadline = time.monotonic() + 30  # bounded: a process that never printed fails the test, not hangs it
    while len(list(ready.iterdir())) < processes and time.monotonic() < deadline:
        time.sleep(0.05)
    sys.exit(3)
if role == "server":
    time.sleep(60)  # servers of this fake job never finish: the launcher must stop them
