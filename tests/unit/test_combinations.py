"""Every kvstore kind x communication mode x update location either trains correctly or is refused at
``Trainer(...)`` with the reason (issue #31).

``TABLE`` holds one row per combination with an explicit mode: the test that proves it trains (sync:
the parameters equal one process's, float tolerance; async: the loss converges), or ``Refused`` with
a fragment of the error. ``communication="auto"`` is the mode ``resolve_mode`` picks for the kind
(test_communication_modes.py), so its rows are that mode's. Refusals need no processes: they happen
in ``TrainerConfig``, before any job is joined. The proofs are checked to exist (module, function and
parameter set), so the table cannot point at a test that is gone. Under ``tandem launch --p3`` the
parameter-server kinds are their P3 kinds, whose rows then apply.
"""

from __future__ import annotations

import copy
import importlib
import itertools
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tandem
from tandem import cli, optim
from tandem.kvstore import KINDS
from tandem.trainer import TrainerConfig
from tandem.update import MODES, resolve_mode


@dataclass(frozen=True)
class Refused:
    """Refused at Trainer(...), the error containing ``reason``."""

    reason: str


TRAINER = "tests/distributed/test_trainer_dist.py"
COMBINATIONS = "tests/distributed/test_combinations_dist.py"
COLLECTIVE = "tests/distributed/test_collective.py"
ALONE = "tests/unit/test_combinations.py::test_training_alone_ignores_communication_and_update_location"
P3_NEEDS_SLICES = Refused("communication='p3' needs kvstore='dist_p3', 'dist_p3_async' or 'collective'")
ASYNC_ON_WORKERS = Refused("with update_on_kvstore=False (tandem train --update-on workers) would train every worker "
                           "on its own gradients only")  # fmt: skip
SAME_PARAMETERS = f"{TRAINER}::test_baseline_overlap_and_p3_give_the_same_parameters[resnet]"

TABLE: dict[tuple[str, str, bool], str | Refused] = {
    **{("local", mode, update): ALONE for mode in MODES for update in (True, False)},
    ("dist_sync", "baseline", True): f"{TRAINER}::test_two_workers_equal_one_process[dist_sync-baseline-1]",
    ("dist_sync", "baseline", False): f"{TRAINER}::test_two_workers_equal_one_process[dist_sync-baseline-0]",
    ("dist_sync", "overlap", True): f"{TRAINER}::test_two_workers_equal_one_process[dist_sync-overlap-1]",
    ("dist_sync", "overlap", False): f"{TRAINER}::test_two_workers_equal_one_process[dist_sync-overlap-0]",
    ("dist_sync", "p3", True): P3_NEEDS_SLICES,
    ("dist_sync", "p3", False): P3_NEEDS_SLICES,
    ("dist_async", "baseline", True): f"{COMBINATIONS}::test_async_combination_converges[dist_async-baseline]",
    ("dist_async", "baseline", False): ASYNC_ON_WORKERS,
    ("dist_async", "overlap", True): f"{COMBINATIONS}::test_async_combination_converges[dist_async-overlap]",
    ("dist_async", "overlap", False): ASYNC_ON_WORKERS,
    ("dist_async", "p3", True): P3_NEEDS_SLICES,
    ("dist_async", "p3", False): P3_NEEDS_SLICES,
    ("dist_p3", "baseline", True): f"{COMBINATIONS}::test_sync_combination_equals_one_process[dist_p3-baseline-1-1]",
    ("dist_p3", "baseline", False): f"{COMBINATIONS}::test_sync_combination_equals_one_process[dist_p3-baseline-0-1]",
    ("dist_p3", "overlap", True): f"{COMBINATIONS}::test_sync_combination_equals_one_process[dist_p3-overlap-1-1]",
    ("dist_p3", "overlap", False): f"{COMBINATIONS}::test_sync_combination_equals_one_process[dist_p3-overlap-0-1]",
    ("dist_p3", "p3", True): SAME_PARAMETERS,  # its runs include (dist_p3, p3, 1) and (dist_p3, p3, 0)
    ("dist_p3", "p3", False): SAME_PARAMETERS,
    ("dist_p3_async", "baseline", True): f"{COMBINATIONS}::test_async_combination_converges[dist_p3_async-baseline]",
    ("dist_p3_async", "baseline", False): ASYNC_ON_WORKERS,
    ("dist_p3_async", "overlap", True): f"{COMBINATIONS}::test_async_combination_converges[dist_p3_async-overlap]",
    ("dist_p3_async", "overlap", False): ASYNC_ON_WORKERS,
    ("dist_p3_async", "p3", True): f"{TRAINER}::test_async_p3_trainer_trains[p3-auto]",
    ("dist_p3_async", "p3", False): ASYNC_ON_WORKERS,
    # collective: no servers; DistributedUpdate.join sets update_on_kvstore=False whatever was asked (every
    # worker runs the optimizer), so True and False run the same code and share their proofs
    ("collective", "baseline", True): f"{COMBINATIONS}::test_sync_combination_equals_one_process[collective-baseline-1-0]",
    ("collective", "baseline", False): f"{COMBINATIONS}::test_sync_combination_equals_one_process[collective-overlap-0-0]",
    ("collective", "overlap", True): f"{COMBINATIONS}::test_sync_combination_equals_one_process[collective-baseline-1-0]",
    ("collective", "overlap", False): f"{COMBINATIONS}::test_sync_combination_equals_one_process[collective-overlap-0-0]",
    ("collective", "p3", True): f"{COLLECTIVE}::test_two_workers_equal_ddp_and_one_process[resnet-100]",
    ("collective", "p3", False): f"{COLLECTIVE}::test_two_workers_equal_ddp_and_one_process[resnet-100]",
}


def _expected(kind: str, communication: str, update_on_kvstore: bool) -> str | Refused:
    mode = communication if communication != "auto" or kind == "local" else resolve_mode("auto", kind)
    return TABLE[(kind, "baseline" if mode == "auto" else mode, update_on_kvstore)]


EVERY = list(itertools.product(KINDS, ("auto", *MODES), (True, False)))


def test_the_table_covers_every_combination() -> None:
    assert set(TABLE) == {(k, m, u) for k, m, u in EVERY if m != "auto"}
    assert len(EVERY) == 48


def _linear_trainer(**options: Any) -> tandem.Trainer:
    return tandem.Trainer(nn.Linear(3, 2), lambda module, x: module(x).sum(), optim.SGD(lr=0.1), **options)


@pytest.mark.parametrize(("kind", "communication", "update_on_kvstore"),
                         [c for c in EVERY if isinstance(_expected(*c), Refused)])  # fmt: skip
def test_refused_at_construction_with_the_reason(kind: str, communication: str, update_on_kvstore: bool) -> None:
    refusal = _expected(kind, communication, update_on_kvstore)
    assert isinstance(refusal, Refused)
    with pytest.raises(ValueError, match=refusal.reason.replace("(", r"\(").replace(")", r"\)")):
        _linear_trainer(kvstore=kind, communication=communication, update_on_kvstore=update_on_kvstore)


@pytest.mark.parametrize(("kind", "communication", "update_on_kvstore"),
                         [c for c in EVERY if not isinstance(_expected(*c), Refused)])  # fmt: skip
def test_accepted_combination_has_a_proof_that_exists(kind: str, communication: str, update_on_kvstore: bool) -> None:
    proof = _expected(kind, communication, update_on_kvstore)
    assert isinstance(proof, str)
    TrainerConfig.from_options(
        {"kvstore": kind, "communication": communication, "update_on_kvstore": update_on_kvstore}
    )  # accepted: no error before the job is joined
    path, _, test = proof.partition("::")
    name, _, parameters = test.partition("[")
    function = getattr(importlib.import_module(path.removesuffix(".py").replace("/", ".")), name)
    if parameters:
        (mark,) = [mark for mark in getattr(function, "pytestmark", []) if mark.name == "parametrize"]
        ids = [values.id if getattr(values, "id", None) else  # a pytest.param(..., id=...)
               "-".join(map(str, values if isinstance(values, tuple) else (values,))) for values in mark.args[1]]  # fmt: skip
        assert parameters.removesuffix("]") in ids, (proof, ids)


def test_the_cli_refuses_async_updates_on_the_workers_without_a_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as error:
        cli.main(["train", "--kvstore", "dist_async", "--update-on", "workers", "--epochs", "1"])
    assert str(error.value).startswith("tandem train: kvstore='dist_async' with update_on_kvstore=False"), error.value
    assert "Keep update_on_kvstore=True" in str(error.value)


def test_training_alone_ignores_communication_and_update_location() -> None:
    """The local kind sends nothing: every mode and update location trains exactly as torch.optim does."""
    torch.manual_seed(0)
    x, y = torch.randn(8, 5, dtype=torch.float64), torch.randint(0, 3, (8,))
    start = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)).double()

    def loss_fn(module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(module(x), y)

    reference = copy.deepcopy(start)
    torch_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for _ in range(3):
        torch_optimizer.zero_grad()
        loss_fn(reference, x, y).backward()
        torch_optimizer.step()
    for communication, update_on_kvstore in itertools.product(("auto", *MODES), (True, False)):
        module = copy.deepcopy(start)
        trainer = tandem.Trainer(module, loss_fn, optim.SGD(lr=0.1, momentum=0.9), communication=communication,
                                 update_on_kvstore=update_on_kvstore)  # fmt: skip
        for _ in range(3):
            trainer.step(x, y)
        for (name, ours), theirs in zip(module.named_parameters(), reference.parameters()):
            torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12, msg=f"{communication} {update_on_kvstore} {name}")
