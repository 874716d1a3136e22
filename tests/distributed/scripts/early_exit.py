"""Worker 1 leaves after 5 steps, by an exception ('raise') or by closing its store ('close').

Worker 0 keeps training: it must get an error at once, not wait for pushes that never come.
"""

from __future__ import annotations

import sys

import torch

import tandem.kvstore as kvstore
from tandem.kvstore import KVStoreError

mode = sys.argv[1]
if kvstore.is_server():  # a server of the job: serve until it ends
    sys.exit(kvstore.serve("dist_sync"))
kv = kvstore.create("dist_sync")
kv.init("w", torch.zeros(10))
out = torch.empty(10)
for step in range(1000):
    if kv.rank == 1 and step == 5:
        if mode == "raise":
            raise ValueError("injected failure")
        kv.close()
        sys.exit(0)
    try:
        kv.pushpull("w", torch.ones(10), out=out).wait(timeout=60)
    except KVStoreError as error:
        print(f"worker {kv.rank} stopped at step {step}: {type(error).__name__}: {error}", flush=True)
        if mode == "raise":
            raise
        break
kv.close()
