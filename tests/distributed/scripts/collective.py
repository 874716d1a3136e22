"""Trainer(kvstore="collective") on real processes, then DDP on the same data in the same processes.

Usage: collective.py OUT_DIR MODEL STEPS BATCH MODE [COMPRESSIONS] (MODE ``p3``, ``p3-<timing>``,
``overlap``, ``baseline``; COMPRESSIONS e.g. ``fp16,2bit:0.05``: a run with each, no DDP run).
Each worker trains on its equal share of the batch; writes OUT_DIR/rank{r}.pt holding the
parameters after training under "collective" (or the compression's name) and "ddp", and the
losses under "losses <compression>".
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import tandem
from tandem import optim
from tandem.kvstore.collective.group import Group
from tandem.kvstore.ps.topology import connect_store
from tests.distributed.collective_models import model_and_batch, rows, train_eagerly

out, model, steps, batch_size, mode = sys.argv[1:6]
compression = sys.argv[6] if len(sys.argv) > 6 else None
mode, _, timing = mode.partition("-")
group = Group.from_env()
torch.set_num_threads(1)
result: dict[str, dict[str, torch.Tensor]] = {}
for kind in compression.split(",") if compression else [None]:  # a compressed run per kind, each from the start
    module, loss_fn, batch = model_and_batch(model, int(batch_size))
    trainer = tandem.Trainer(module, loss_fn, optim.SGD(lr=0.1, momentum=0.9), kvstore="collective",
                             communication=mode, gradient_compression=kind, bulk_fwd=3, bulk_bwd=2)  # fmt: skip
    if timing:
        trainer.kvstore.send_timing = timing
    rank, workers = trainer.rank, trainer.num_workers
    mine = rows(batch, rank, workers)
    losses = [trainer.step(*mine) for _ in range(int(steps))]
    rounds = trainer.kvstore.rounds
    trainer.close()
    result[kind or "collective"] = {name: value.detach().clone() for name, value in module.named_parameters()}
    result[f"losses {kind}"] = losses  # type: ignore[assignment]
if compression is None:  # the reference: DDP over gloo, the same processes, the same rows
    store = connect_store(group, 60)
    dist.init_process_group("gloo", store=dist.PrefixStore("ddp/", store), rank=rank, world_size=workers)
    module, loss_fn, batch = model_and_batch(model, int(batch_size))
    result["ddp"] = train_eagerly(DistributedDataParallel(module), loss_fn, rows(batch, rank, workers), int(steps))
    dist.destroy_process_group()
torch.save(result, Path(out) / f"rank{rank}.pt")
print(f"collective OK rank {rank} rounds {rounds} last loss {losses[0]:.4f} -> {losses[-1]:.4f}")
