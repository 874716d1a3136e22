"""The single-process store: sums per-device values, optionally runs the optimizer, all in the caller's thread.

It is MXNet's ``local`` kvstore and the reference the distributed store is tested against: both keep
their values in a ``SlotTable``, so an update here is the same code a server runs.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from tandem.kvstore.base import Handle, Key, KVStore, normalize, reduce_sum
from tandem.kvstore.errors import KVStoreError, RemoteError, RequestRefused
from tandem.kvstore.slots import Slot, SlotTable

CHECKPOINT_NAME = "local.pt"


class LocalKVStore(KVStore):
    """Operations run synchronously; the returned handles are already done (errors raise at the call).

    A bad request (wrong shape or dtype, a key never initialised, a second init) raises
    ``RequestRefused``, the same message a server would reply with, never ``RemoteError``: no server
    is involved.

    Example:
        ```python
        kv = tandem.kvstore.create("local")            # a LocalKVStore
        kv.init("w", torch.zeros(3))
        kv.push("w", torch.ones(3)).done()             # True at once
        ```
    """

    kind = "local"

    def __init__(self) -> None:
        self._table = SlotTable()
        self._closed = False

    @property
    def rank(self) -> int:
        return 0

    @property
    def num_workers(self) -> int:
        return 1

    @property
    def num_servers(self) -> int:
        return 0  # no server processes: values live in this one

    def _slot(self, key: Key, tensor: torch.Tensor, action: str) -> Slot:
        self._check_open()
        with _refused_here():
            return self._table.get((key, 0, tensor.numel()), tuple(tensor.shape), tensor.dtype, action)

    def init(self, keys: Key | Sequence[Key], values: Any) -> None:
        self._check_open()
        for key, tensors in normalize(keys, values, "init"):
            shape = tuple(tensors[0].shape)
            with _refused_here():
                self._table.init((key, 0, tensors[0].numel()), shape, tensors[0])

    def push(self, keys: Key | Sequence[Key], values: Any, priority: int = 0) -> Handle:
        for key, tensors in normalize(keys, values, "push"):
            slot = self._slot(key, tensors[0], "push")
            self._table.apply(slot, reduce_sum(tensors).reshape(-1).clone(), merged_owned=True)
        return Handle.completed("push")

    def pull(self, keys: Key | Sequence[Key], out: Any, priority: int = 0) -> Handle:
        for key, targets in normalize(keys, out, "pull"):
            slot = self._slot(key, targets[0], "pull")
            for target in targets:
                target.copy_(slot.value.view(target.shape))
        return Handle.completed("pull")

    def pushpull(self, keys: Key | Sequence[Key], values: Any, out: Any = None, priority: int = 0) -> Handle:
        self.push(keys, values, priority)
        return self.pull(keys, values if out is None else out, priority)

    def set_optimizer(self, optimizer: Any) -> None:
        self._check_open()
        with _refused_here():
            self._table.set_optimizer_object(optimizer)

    def barrier(self) -> None:
        self._check_open()

    def save_server_state(self, path: str) -> None:
        self._check_open()
        self._table.save(path, CHECKPOINT_NAME, {"kind": self.kind, "num_servers": 1})

    def load_server_state(self, path: str) -> None:
        self._check_open()
        self._table.load(path, CHECKPOINT_NAME, {"kind": self.kind, "num_servers": 1})

    def close(self) -> None:
        self._closed = True

    def _check_open(self) -> None:
        if self._closed:
            raise KVStoreError("this kvstore is closed; create a new one")


@contextmanager
def _refused_here() -> Iterator[None]:
    """The slot table raises ``RemoteError``, which a server's loop turns into its error reply; in this
    process the same refusal is the store's own: ``RequestRefused`` (RemoteError's base), same message."""
    try:
        yield
    except RemoteError as error:
        raise RequestRefused(str(error)) from None
