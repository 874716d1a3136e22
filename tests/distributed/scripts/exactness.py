"""Two workers on half a batch each == one process on the whole batch, after 10 steps (float64 MLP).

The loss is a mean over each worker's half, so each worker pushes grad / num_workers: the servers'
sum is then exactly the mean gradient over the whole batch that one process would compute.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

import tandem.kvstore as kvstore
from tandem.optim import SGD


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).double()


def loss_of(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(model(inputs), targets)  # mean-reduced


generator = torch.Generator().manual_seed(1)
inputs = torch.randn(32, 8, dtype=torch.float64, generator=generator)
targets = torch.randn(32, 4, dtype=torch.float64, generator=generator)
optimizer = SGD(lr=0.1, momentum=0.9, weight_decay=1e-3)
steps = 10

if kvstore.is_server():  # a server of the job: serve until it ends
    sys.exit(kvstore.serve("dist_sync"))
kv = kvstore.create("dist_sync")
model = make_model()
names = [name for name, _ in model.named_parameters()]
params = [param for _, param in model.named_parameters()]
kv.init(names, [param.detach() for param in params])
kv.set_optimizer(optimizer)
kv.pull(names, [param.data for param in params]).wait()  # every worker starts from worker 0's values
rows = slice(kv.rank * 32 // kv.num_workers, (kv.rank + 1) * 32 // kv.num_workers)
for _ in range(steps):
    grads = torch.autograd.grad(loss_of(model, inputs[rows], targets[rows]), params)
    kv.pushpull(names, [grad / kv.num_workers for grad in grads], out=[param.data for param in params]).wait()

reference = make_model()
reference_params = list(reference.parameters())
states = [optimizer.create_state(param.detach()) for param in reference_params]
for _ in range(steps):
    grads = torch.autograd.grad(loss_of(reference, inputs, targets), reference_params)
    with torch.no_grad():
        optimizer.update([param.data for param in reference_params], list(grads), states)
difference = max((a - b).abs().max().item() for a, b in zip(params, reference_params))
moved = max((a.detach() - b.detach()).abs().max().item() for a, b in zip(params, make_model().parameters()))
print(
    f"rank {kv.rank}: max |distributed - single process| = {difference:.3e} after {steps} steps (moved {moved:.3f})"
)
assert difference < 1e-12 and moved > 1e-3, (difference, moved)
print(f"exactness OK rank {kv.rank}")
kv.close()
sys.exit(0)
