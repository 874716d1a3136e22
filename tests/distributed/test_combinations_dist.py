"""The kvstore kind x communication mode x update location combinations no other test trains (the
table of all of them, with the test proving each: tests/unit/test_combinations.py).

Sync kinds: after 10 steps the parameters equal one process on the whole batch (float64, as
test_trainer_dist). Async kinds have no exact reference (pushes are applied as they arrive): the loss
of each worker, averaged over the last five steps, must fall to under half its first value (they train at
momentum 0.5, trainer_modes.py says why: 2.3 -> 0.2-0.4 in ASYNC_STEPS, room for a worker slowed by a
loaded machine).
Jobs are kept small (one server, the tiny mlp) to hold the added time to about 5 s a job.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.distributed.jobs import first_and_tail_loss, run_job, worker_lines
from tests.distributed.test_trainer_dist import ASYNC_STEPS, single_process

STEPS = 10
SLICED = {"TANDEM_KVSTORE_SLICE_THRESHOLD": "100"}  # P3 kinds: many slices, most not a multiple of the size


@pytest.mark.parametrize(("kind", "mode", "update_on_kvstore", "servers"), [
    ("dist_p3", "baseline", "1", 1), ("dist_p3", "baseline", "0", 1), ("dist_p3", "overlap", "1", 1),
    ("dist_p3", "overlap", "0", 1), ("collective", "baseline", "1", 0), ("collective", "overlap", "0", 0),
])  # fmt: skip
def test_sync_combination_equals_one_process(kind: str, mode: str, update_on_kvstore: str, servers: int,
                                             tmp_path: Path) -> None:  # fmt: skip
    run_job("trainer_modes.py", 2, servers, kind, mode, update_on_kvstore, str(tmp_path), str(STEPS), "mlp", env=SLICED)
    expected = single_process("mlp", STEPS)
    for rank in range(2):
        result = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        for name, value in expected.items():
            torch.testing.assert_close(result[name], value.detach(), rtol=1e-9, atol=1e-11,
                                       msg=f"{kind} {mode} update_on_kvstore={update_on_kvstore}: rank {rank} {name}")  # fmt: skip


@pytest.mark.parametrize(("kind", "mode"), [("dist_async", "baseline"), ("dist_async", "overlap"),
                                            ("dist_p3_async", "baseline"), ("dist_p3_async", "overlap")])  # fmt: skip
def test_async_combination_converges(kind: str, mode: str, tmp_path: Path) -> None:
    """The optimizer on the servers (the only update location an async kind accepts)."""
    job = run_job("trainer_modes.py", 2, 1, kind, mode, "1", str(tmp_path), str(ASYNC_STEPS), "mlp", env=SLICED)
    lines = worker_lines(job.stdout, " OK ")
    assert len(lines) == 2, job.stdout
    for line in lines:
        first, tail = first_and_tail_loss(line)
        assert tail < 0.5 * first, line
