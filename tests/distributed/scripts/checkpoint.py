"""Save server state mid-run, then restore it in a new job: the new job continues the same trajectory."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

import tandem.kvstore as kvstore
from tandem.optim import AdamW

phase, directory = sys.argv[1], Path(sys.argv[2])
if kvstore.is_server():  # a server of the job: serve until it ends
    sys.exit(kvstore.serve("dist_sync"))
kv = kvstore.create("dist_sync")
rank = kv.rank


def train(steps: range) -> torch.Tensor:
    out = torch.empty(1000)
    for step in steps:
        kv.pushpull("p", torch.linspace(-1, 1, 1000) * (rank + 1) + step, out=out).wait()
    return out


if phase == "first":
    kv.init("p", torch.linspace(0, 1, 1000))
    kv.set_optimizer(AdamW(lr=0.05, weight_decay=0.1))
    train(range(3))
    kv.save_server_state(str(directory))
    expected = train(range(3, 6))
    if rank == 0:
        torch.save(expected, directory / "expected.pt")
else:
    kv.init("p", torch.zeros(1000))  # overwritten by the restore
    kv.set_optimizer(AdamW(lr=0.05, weight_decay=0.1))
    kv.load_server_state(str(directory))
    resumed = train(range(3, 6))
    torch.testing.assert_close(resumed, torch.load(directory / "expected.pt"), rtol=0, atol=0)
    print(f"checkpoint OK rank {rank}")
kv.close()
