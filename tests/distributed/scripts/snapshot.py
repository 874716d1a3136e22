"""Async, server-side SGD: a pull answered while another worker's push updates the value is never torn.

Worker 1 pushes ones again and again (each push lowers every element by 1, in place on the server);
worker 0 pulls a big array meanwhile. A reply sharing the server's buffer instead of copying it
could leave with part old and part new values; every pulled array must hold one value only.
"""

from __future__ import annotations

import sys

import torch

import tandem.kvstore as kvstore
from tandem.optim import SGD

NUMEL = 4_000_000  # 16 MB: a reply takes long enough on the wire for a push to land meanwhile
if kvstore.is_server():  # a server of the job: serve until it ends
    sys.exit(kvstore.serve("dist_async"))
kv = kvstore.create("dist_async")
rank = kv.rank
kv.set_optimizer(SGD(lr=1.0))
kv.init("big", torch.zeros(NUMEL))
kv.barrier()
torn = 0
if rank == 0:
    out = torch.empty(NUMEL)
    for _ in range(30):
        kv.pull("big", out).wait()
        torn += int(out.min() != out.max())
else:
    gradient = torch.ones(NUMEL)
    for _ in range(60):
        kv.push("big", gradient).wait()
kv.barrier()
print(f"snapshot torn={torn} rank {rank}")
assert torn == 0, f"{torn} of 30 pulls mixed values from two updates"
print(f"snapshot OK rank {rank}")
kv.close()
