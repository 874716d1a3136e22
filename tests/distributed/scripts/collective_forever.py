"""A collective job's worker that pushes until killed (at most 60 s): the target of the fault tests.

Usage: collective_forever.py [mismatch] (mismatch: worker 1 inits a key of another shape). Prints its pid first.
"""

from __future__ import annotations

import os
import sys
import time

import torch

import tandem.kvstore as kvstore

print(f"worker {os.environ['TANDEM_RANK']} pid {os.getpid()}", flush=True)
kv = kvstore.create("collective", slice_size=37)
rank = kv.rank
wide = 9 if rank == 1 and sys.argv[1:] == ["mismatch"] else 8
kv.init(["a", "w"], [torch.zeros(100), torch.zeros(4, wide)])
out = torch.empty(100)
started, step = time.monotonic(), 0
while time.monotonic() - started < 60:
    kv.pushpull("a", torch.ones(100), out=out).wait()
    step += 1
    if step % 10 == 0:
        print(f"step {step}", flush=True)
    time.sleep(0.01)
kv.close()
