"""Saves a large Trainer checkpoint over and over (every parameter = the save's number) until killed.

Prints ``saved N`` after each save; the test kills it with SIGKILL while a later save is being written.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn

import tandem

path = sys.argv[1]
torch.set_num_threads(1)
module = nn.Linear(4096, 4096)  # 64 MiB of parameters: each save takes long enough to be caught mid-write
trainer = tandem.Trainer(module, lambda m, x, y: F.mse_loss(m(x), y), tandem.optim.SGD(lr=0.1), progress=False)
for number in range(1, 1000):
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.fill_(float(number))
    trainer.save(path)
    print(f"saved {number}", flush=True)
