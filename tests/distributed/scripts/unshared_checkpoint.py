"""``Trainer.fit(checkpoint_dir=...)`` where every worker has a directory of its own (as on machines
without a shared filesystem): ``<base>/worker-<rank>``. Arguments: ``<base>`` and the kvstore kind.
The test expects the job to fail with ``CheckpointError``: at the first checkpoint (worker 0 does not
see worker 1's file), or at the resume when the test put a checkpoint in worker 0's directory only.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import tandem
import tandem.kvstore as kvstore

base, kind = Path(sys.argv[1]), sys.argv[2]
if kvstore.is_server():
    sys.exit(kvstore.serve(kind))
torch.manual_seed(0)
trainer = tandem.Trainer(nn.Linear(4, 2), lambda m, x, y: F.cross_entropy(m(x), y), tandem.optim.SGD(lr=0.1),
                         kvstore=kind, batch_size=4, progress=False)  # fmt: skip
data = TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,)))
trainer.fit(data, epochs=1, checkpoint_dir=str(base / f"worker-{trainer.rank}"), checkpoint_every=2)
print(f"worker {trainer.rank} finished at step {trainer.step_count}", flush=True)
trainer.close()
