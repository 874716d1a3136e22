"""Server-side SGD/AdamW (sync) and SGD (async) equal the same optimizer applied locally to the summed gradient."""

from __future__ import annotations

import sys

import torch

import tandem.kvstore as kvstore
from tandem.optim import SGD, AdamW

kind = sys.argv[1]
if kvstore.is_server():  # a server of the job: serve until it ends
    sys.exit(kvstore.serve(kind))
kv = kvstore.create(kind)
rank, workers = kv.rank, kv.num_workers
start = torch.linspace(0, 1, 1000)  # split over the servers: TANDEM_KVSTORE_BIGARRAY_BOUND=100
steps = 5


def grad(step: int, worker: int) -> torch.Tensor:
    return torch.linspace(-1, 1, 1000) * (worker + 1) + 0.01 * step


def local_reference(optimizer: object) -> torch.Tensor:
    param, state = start.clone(), optimizer.create_state(start)  # type: ignore[attr-defined]
    for step in range(steps):
        total = grad(step, 0).clone()
        for worker in range(1, workers):
            total.add_(grad(step, worker))  # rank order, as the servers sum
        optimizer.update([param], [total], [state])  # type: ignore[attr-defined]
    return param


out = torch.empty(1000)
if kind == "dist_sync":
    optimizers = {
        "sgd": SGD(lr=0.1, momentum=0.9, weight_decay=0.01),
        "adamw": AdamW(lr=0.01, weight_decay=0.1),
    }
    for key, optimizer in optimizers.items():
        kv.set_optimizer(optimizer)
        kv.init(key, start)
        for step in range(steps):
            kv.pushpull(key, grad(step, rank), out=out).wait()
        torch.testing.assert_close(out, local_reference(optimizer), rtol=1e-6, atol=1e-7)
        print(f"{key} on servers == local, rank {rank}")
else:  # async: every push is applied on arrival; plain SGD makes the final value order-independent
    kv.set_optimizer(SGD(lr=0.1))
    kv.init("p", start)
    for step in range(steps):
        kv.push("p", grad(step, rank)).wait()
    kv.barrier()
    kv.pull("p", out).wait()
    expected = start - 0.1 * sum(grad(step, worker) for step in range(steps) for worker in range(workers))
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    print(f"async sgd == local, rank {rank}")
print(f"optimizer OK rank {rank}")
kv.close()
