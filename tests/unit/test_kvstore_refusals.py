"""Refused kvstore requests: the local store names no server, and a second init of a key is an error
naming the key and both shapes and dtypes on every store (local, collective, a server's slot table)."""

from __future__ import annotations

import re

import pytest
import torch

import tandem.kvstore as kvstore
from tandem.kvstore.collective.store import CollectiveKVStore
from tandem.kvstore.errors import KVStoreError, RemoteError, RequestRefused
from tandem.kvstore.slots import SlotTable
from tests.unit.test_collective import _each_worker


def test_the_local_store_refuses_without_naming_a_server() -> None:
    kv = kvstore.create("local")
    kv.init("w", torch.zeros(3))
    refusals = [
        (lambda: kv.push("w", torch.zeros(4)), r"push of key 'w': got shape \(4,\) torch.float32, but the key was "
                                               r"initialised as \(3,\) torch.float32"),
        (lambda: kv.pull("never", torch.zeros(2)), "pull of key 'never': key was never initialised"),
        (lambda: kv.init("w", torch.zeros(3)), r"key 'w' is already initialised as \(3,\) torch.float32"),
    ]  # fmt: skip
    for refused, message in refusals:
        with pytest.raises(RequestRefused, match=message) as error:
            refused()
        assert not isinstance(error.value, RemoteError) and "server" not in str(error.value), error.value
    assert issubclass(RemoteError, RequestRefused) and issubclass(RequestRefused, KVStoreError)


@pytest.mark.parametrize(("second", "stored"), [(torch.zeros(4), "(3,) torch.float32"),
                                                (torch.zeros(3, dtype=torch.float64), "(3,) torch.float32")])  # fmt: skip
def test_a_second_init_with_another_shape_or_dtype_names_both_on_the_local_store(second: torch.Tensor, stored: str) -> None:
    kv = kvstore.create("local")
    kv.init("w", torch.ones(3))
    given = f"{tuple(second.shape)} {second.dtype}"
    expected = f"init of key 'w' as {given}: the key is already initialised as {stored}"
    with pytest.raises(RequestRefused, match=re.escape(expected)):
        kv.init("w", second)
    out = torch.empty(3)
    kv.pull("w", out)
    assert torch.equal(out, torch.ones(3))  # one value, the first init's
    with pytest.raises(RequestRefused, match="got shape"):
        kv.pull("w", torch.empty(4))  # the refused init left no second value behind


def test_the_slot_table_refuses_a_second_init_of_a_key_naming_both() -> None:
    """A server's table (a worker refuses a second init itself; this is what another client meets):
    the slots of one key share its shape and dtype; another shape, dtype, or the same slot again is refused."""
    table = SlotTable()
    table.init(("w", 0, 5), (10,), torch.zeros(5))
    table.init(("w", 5, 10), (10,), torch.zeros(5))  # the other slice of a split key: fine
    with pytest.raises(RemoteError, match=r"init of key 'w' as \(2, 5\) torch.float32: the key is already initialised "
                                          r"as \(10,\) torch.float32"):  # fmt: skip
        table.init(("w", 0, 10), (2, 5), torch.zeros(10))
    with pytest.raises(RemoteError, match=r"as \(10,\) torch.float64: the key is already initialised as \(10,\) torch.float32"):
        table.init(("w", 0, 5), (10,), torch.zeros(5, dtype=torch.float64))
    with pytest.raises(RemoteError, match=r"key 'w' elements \[0, 5\) is already initialised"):
        table.init(("w", 0, 5), (10,), torch.zeros(5))
    assert sorted(table.slots) == [("w", 0, 5), ("w", 5, 10)]


def test_the_collective_store_refuses_a_second_init_naming_both() -> None:
    def work(kv: CollectiveKVStore) -> list[str]:
        kv.init("w", torch.zeros(2, 3))
        messages = []
        for again in (torch.zeros(6), torch.zeros(2, 3)):
            with pytest.raises(RequestRefused) as error:
                kv.init("w", again)
            messages.append(str(error.value))
        return messages

    for other_shape, same_shape in _each_worker(2, work):
        assert "init of key 'w' as (6,) torch.float32: the key is already initialised as (2, 3) torch.float32" in other_shape
        assert "already initialised as (2, 3) torch.float32" in same_shape
