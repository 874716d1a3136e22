"""The local kvstore: per-device sums, optimizer updates, errors and checkpoints, all in one process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import tandem.kvstore as kvstore
from tandem.kvstore import KVStoreError
from tandem.kvstore.base import Handle
from tandem.kvstore.errors import RemoteError
from tandem.kvstore.slots import SlotTable
from tandem.optim import LAMB, SGD, AdamW


def test_push_of_a_list_sums_it_and_pull_copies_out() -> None:
    kv = kvstore.create("local")
    kv.init(["w", 3], [torch.zeros(7, 3, 5), torch.zeros(())])
    kv.push("w", [torch.ones(7, 3, 5), torch.full((7, 3, 5), 2.0)]).wait()
    outs = [torch.empty(7, 3, 5), torch.empty(7, 3, 5)]
    kv.pull("w", outs).wait()
    assert all(torch.equal(out, torch.full((7, 3, 5), 3.0)) for out in outs)
    value = torch.tensor(5.0)
    kv.pushpull(3, value).wait()
    assert value.item() == 5.0
    assert (kv.rank, kv.num_workers, kv.num_servers) == (0, 1, 0)


def test_pushed_tensor_may_be_reused_after_push() -> None:
    kv = kvstore.create("local")
    kv.init(1, torch.zeros(4))
    grad = torch.ones(4)
    kv.push(1, grad)
    grad.fill_(100.0)
    out = torch.empty(4)
    kv.pull(1, out).wait()
    assert torch.equal(out, torch.ones(4))


@pytest.mark.parametrize("optimizer", [SGD(lr=0.1, momentum=0.9), AdamW(lr=0.01, weight_decay=0.1)])
def test_optimizer_runs_on_the_summed_gradient(optimizer: object) -> None:
    kv = kvstore.create("local")
    start = torch.linspace(-1, 1, 10)
    kv.init("p", start)
    kv.set_optimizer(optimizer)
    reference, state = start.clone(), optimizer.create_state(start)  # type: ignore[attr-defined]
    for step in range(3):
        grads = [torch.full((10,), 0.1 * step), torch.linspace(0, 1, 10)]
        kv.push("p", grads).wait()
        optimizer.update([reference], [grads[0] + grads[1]], [state])  # type: ignore[attr-defined]
    out = torch.empty(10)
    kv.pull("p", out).wait()
    torch.testing.assert_close(out, reference)


def test_errors_name_the_problem() -> None:
    kv = kvstore.create("local")
    kv.init("w", torch.zeros(3))
    with pytest.raises(KVStoreError, match="already initialised"):
        kv.init("w", torch.zeros(3))
    with pytest.raises(KVStoreError, match=r"got shape \(4,\).*initialised as \(3,\)"):
        kv.push("w", torch.zeros(4))
    with pytest.raises(KVStoreError, match="never initialised"):
        kv.pull("nope", torch.zeros(3))
    with pytest.raises(KVStoreError, match="2 keys need a list of 2 values"):
        kv.push(["w", "v"], torch.zeros(3))
    with pytest.raises(KVStoreError, match="int or str"):
        kv.push(1.5, torch.zeros(3))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown kvstore kind"):
        kvstore.create("dist_magic")
    with pytest.raises(TypeError, match="no options"):
        kvstore.create("local", heartbeat=1.0)
    kv.close()
    with pytest.raises(KVStoreError, match="closed"):
        kv.push("w", torch.zeros(3))


def test_checkpoint_restores_values_and_optimizer_state(tmp_path: Path) -> None:
    def run(kv: kvstore.KVStore, steps: range) -> torch.Tensor:
        for step in steps:
            kv.push("p", torch.full((5,), float(step + 1))).wait()
        out = torch.empty(5)
        kv.pull("p", out).wait()
        return out

    straight = kvstore.create("local")
    straight.init("p", torch.ones(5))
    straight.set_optimizer(SGD(lr=0.1, momentum=0.9))
    expected = run(straight, range(6))

    first = kvstore.create("local")
    first.init("p", torch.ones(5))
    first.set_optimizer(SGD(lr=0.1, momentum=0.9))
    run(first, range(3))
    first.save_server_state(str(tmp_path))
    second = kvstore.create("local")
    second.init("p", torch.zeros(5))
    second.load_server_state(str(tmp_path))
    torch.testing.assert_close(run(second, range(3, 6)), expected)
    with pytest.raises(KVStoreError, match="no kvstore checkpoint"):
        second.load_server_state(str(tmp_path / "missing"))


def test_handle_reports_errors_and_timeouts() -> None:
    handle = Handle("pull of key 'w'", 2)
    assert not handle.done()
    with pytest.raises(kvstore.KVStoreTimeout, match="pull of key 'w' did not finish within 0.0"):
        handle.wait(timeout=0.01)
    handle.fail(KVStoreError("boom"))
    with pytest.raises(KVStoreError, match="boom"):
        handle.wait()
    finished: list[bool] = []
    done = Handle("push", 2, on_complete=lambda: finished.append(True))
    done.part_done()
    done.part_done()
    done.wait(timeout=0)
    assert finished == [True]



def test_server_side_lamb_refuses_a_slice_of_a_tensor() -> None:
    # LAMB's trust ratio uses norms of the whole tensor: a server holding a slice would compute them wrong
    table = SlotTable()
    table.init(("w", 0, 10), (10,), torch.zeros(10))  # a whole tensor
    table.set_optimizer_object(LAMB(lr=0.1))  # fine
    with pytest.raises(RemoteError, match=r"LAMB cannot run on the servers for key 'big' elements \[0, 5\).*update_on_kvstore=False"):
        table.init(("big", 0, 5), (10,), torch.zeros(5))  # half of a tensor, LAMB already set
    table = SlotTable()
    table.init(("big", 0, 5), (10,), torch.zeros(5))
    table.set_optimizer_object(AdamW(lr=0.1))  # elementwise rules update slices exactly
    with pytest.raises(RemoteError, match="needs the whole tensor"):
        table.set_optimizer_object(LAMB(lr=0.1))
