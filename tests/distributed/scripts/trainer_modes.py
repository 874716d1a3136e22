"""Trainer(kvstore=...) on real processes: each worker trains on its half of every batch.

Usage: trainer_modes.py KIND MODE UPDATE_ON_KVSTORE OUT_DIR STEPS MODEL [CAPS]
(CAPS ``trainer``: the Trainer's own segment caps; else bulk_fwd=3, bulk_bwd=2)
(MODE ``p3-<timing>``: p3 at that send timing (``after``, ``serial``: gradients held until backward
ends, as the tuner may choose); ``p3-auto``: the tuner at work, switching often, so the slots move
between slicings, and the send timing changes, while training)
Writes OUT_DIR/rank{r}.pt with the final parameters and OUT_DIR/report{r}.txt with the step report;
prints the first and the last step's loss (of this worker's rows), the mean of the last five (an async
worker's loss jumps step to step as other workers' pushes land) and every step's.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

import tandem
from tandem import kvstore, models, optim

kind, mode, update_on_kvstore, out, steps, model_name = sys.argv[1:7]
caps = {} if sys.argv[7:] == ["trainer"] else {"bulk_fwd": 3, "bulk_bwd": 2}
mode, _, timing = mode.partition("-")
torch.manual_seed(0)
entry = models.ZOO[model_name]
module = entry.build(**entry.tiny).double()
batch = entry.make_batch(8, torch.Generator().manual_seed(1), dtype=torch.float64, **entry.tiny)
# Asynchrony adds momentum of its own (each push lands on parameters other workers moved since its
# pull; Mitliagkas et al. 2016, "Asynchrony begets momentum"): 0.9 on top of it overshoots, a converged
# worker's loss jumps back towards its first value when one worker runs ahead on a loaded machine.
MOMENTUM = 0.5 if kind.endswith("_async") else 0.9  # 30 async steps at 0.5: loss 2.3 -> 0.2-0.4
if kvstore.is_server():  # a server of the job: serve until it ends
    sys.exit(kvstore.serve(kind))
trainer = tandem.Trainer(module, entry.loss_fn, optim.SGD(lr=0.1, momentum=MOMENTUM), kvstore=kind, communication=mode,
                         update_on_kvstore=update_on_kvstore == "1", **caps)
if timing == "auto":
    tuner = trainer.kvstore.tuner  # type: ignore[union-attr]
    tuner.warmup, tuner.steps_per_trial, tuner.min_trial_seconds = 1, 2, 0.0
    tuner.timings = ("during", "serial")  # two timings: 10 steps then reach the slice sizes' walk
elif timing:
    trainer.kvstore.send_timing = timing  # type: ignore[union-attr]
rank, workers = trainer.rank, trainer.num_workers
rows = slice(rank * 8 // workers, (rank + 1) * 8 // workers)
losses = [trainer.step(*(t[rows] for t in batch)) for _ in range(int(steps))]
trainer.close()
torch.save(dict(module.named_parameters()), Path(out) / f"rank{rank}.pt")
report = trainer.train_step.executor.last_report
Path(out, f"report{rank}.txt").write_text(f"{report.num_segments} {len(report.gradient_ready_s)}")
slicings = [config.slice_size for config, _ in tuner.history] if timing == "auto" else []
backend = trainer.train_step.compile_report()["backend"]
print(f"trainer_modes OK rank {rank} mode {mode} backend {backend} loss {losses[0]:.6f} -> {losses[-1]:.6f} "
      f"tail {sum(losses[-5:]) / len(losses[-5:]):.6f} all {','.join(f'{loss:.3f}' for loss in losses)} "
      f"slicings {','.join(map(str, slicings))}")  # slicings last: test_trainer_dist reads the rest of the line
