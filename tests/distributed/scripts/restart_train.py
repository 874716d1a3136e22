"""Trains a small MLP with ``Trainer.fit(checkpoint_dir=..., checkpoint_every=5)`` in a dist_sync job with
AdamW on the servers: the target of the restart tests (tandem launch or torchrun, --max-restarts).

Arguments: the checkpoint directory, where worker 0 writes the final parameters, the seconds each
sample takes to load (slows the steps so that a test can kill a process mid-training), and optionally
the kvstore kind (default dist_sync; "collective": no servers, AdamW on the workers).
Every process first prints ``<role> <rank> pid <pid>``.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

import tandem
import tandem.kvstore as kvstore
from tandem.kvstore.ps.topology import Topology

checkpoint_dir, result, delay = sys.argv[1], sys.argv[2], float(sys.argv[3])
kind = sys.argv[4] if len(sys.argv) > 4 else "dist_sync"
name = f"{os.environ['TANDEM_ROLE']} {os.environ['TANDEM_RANK']}" if "TANDEM_ROLE" in os.environ else Topology.from_env().name
print(f"{name} pid {os.getpid()}", flush=True)
if kvstore.is_server():
    sys.exit(kvstore.serve(kind))
torch.set_num_threads(1)


class SlowSamples(Dataset[Any]):
    """Fixed random samples (the same in every process), each taking ``delay`` seconds to load."""

    def __init__(self, count: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(count, 16, generator=generator)
        self.y = torch.randint(0, 4, (count,), generator=generator)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(delay)
        return self.x[index], self.y[index]


torch.manual_seed(0)
module = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
trainer = tandem.Trainer(module, lambda m, x, y: F.cross_entropy(m(x), y), tandem.optim.AdamW(lr=0.01),
                         kvstore=kind, batch_size=8, progress=False)  # fmt: skip
trainer.fit(SlowSamples(256), epochs=2, checkpoint_dir=checkpoint_dir, checkpoint_every=5)  # 16 steps an epoch
if trainer.rank == 0:
    torch.save({name: value.detach().clone() for name, value in module.state_dict().items()}, result)
print(f"worker {trainer.rank} finished at step {trainer.step_count}", flush=True)
trainer.close()
