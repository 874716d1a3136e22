"""Trains until killed (at most 60 s): the target of the fault tests. Prints its pid first, in every role."""

from __future__ import annotations

import os
import sys
import time

import torch

import tandem.kvstore as kvstore

print(f"{os.environ['TANDEM_ROLE']} {os.environ['TANDEM_RANK']} pid {os.getpid()}", flush=True)
if kvstore.is_server():  # a server of the job: serve until it ends
    sys.exit(kvstore.serve("dist_sync"))
kv = kvstore.create("dist_sync")
kv.init(["a", "b", "c"], [torch.zeros(100)] * 3)  # three keys: every server holds one (for 2-3 servers)
outs = [torch.empty(100) for _ in range(3)]
started = time.monotonic()
step = 0
while time.monotonic() - started < 60:
    kv.pushpull(["a", "b", "c"], [torch.ones(100)] * 3, out=outs).wait()
    step += 1
    if step % 10 == 0:
        print(f"step {step}", flush=True)
    time.sleep(0.01)
kv.close()
