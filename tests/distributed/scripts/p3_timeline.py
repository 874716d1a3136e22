"""Train a few P3 steps with a big last layer, so that its slices return while the next forward runs."""

from __future__ import annotations

import sys

import torch
from torch import nn

import tandem
from tandem import kvstore, optim

steps = int(sys.argv[1])
torch.manual_seed(0)
# a small first layer (back first: highest priority) and a big last one (its slices return last)
model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4096), nn.ReLU(),
                      nn.Linear(4096, 512))
x, y = torch.randn(16, 32), torch.randint(0, 512, (16,))
if kvstore.is_server():  # a server of the job: serve until it ends
    sys.exit(kvstore.serve("dist_p3"))
trainer = tandem.Trainer(model, lambda m, x, y: nn.functional.cross_entropy(m(x), y), optim.SGD(lr=0.01),
                         kvstore="dist_p3", bulk_fwd=2, bulk_bwd=2)
for _ in range(steps):
    trainer.step(x, y)
trainer.close()
print("p3_timeline OK")
