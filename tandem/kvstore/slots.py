"""Stored values, their optimizer state and checkpoints: what both the local store and a server hold.

A *slot* is one contiguous part ``[start, stop)`` of a key's flattened array. The local store holds
one slot per key; a server holds the slots placement gave it. Keeping update and checkpoint logic
here means the local store and the servers cannot drift apart, which the tests rely on when they
compare a distributed run against a local one.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from tandem.checkpoint import atomic_save
from tandem.kvstore.errors import KVStoreError, RemoteError, second_init

Key = int | str
SlotId = tuple[Key, int, int]  # key, start, stop
CHECKPOINT_FORMAT = 1


def per_element(state: torch.Tensor, numel: int) -> bool:
    """Whether an optimizer state tensor holds one entry per element of a ``numel``-element value
    (momentum, Adam's moments: cut and joined with the value) rather than a scalar (Adam's step)."""
    return state.dim() == 1 and state.numel() == numel


@dataclass
class Slot:
    shape: tuple[int, ...]  # shape of the whole key, for validating pushes and pulls
    value: torch.Tensor  # flat: elements [start, stop) of the key
    state: dict[str, torch.Tensor] = field(default_factory=dict)
    owned: bool = True  # False while ``value`` views a received network buffer
    frame: Any = None  # the received zmq.Frame whose bytes ``value`` views: sent on as is, no copy
    compressed: list[Any] | None = None  # ``value`` as compressed frames, for pulls (a server's compressed round)


def optimizer_to_json(optimizer: Any) -> str:
    """The JSON text of ``optimizer.to_config()`` (a dict, or already a JSON string)."""
    config = optimizer.to_config()
    return config if isinstance(config, str) else json.dumps(config)


def optimizer_from_json(text: str) -> Any:
    """Rebuild an optimizer from JSON (never from pickle) with ``tandem.optim.Optimizer.from_config``."""
    from tandem.optim import Optimizer  # imported late: servers without an optimizer never need it

    try:
        config = json.loads(text)
    except json.JSONDecodeError as error:
        raise RemoteError(f"optimizer config is not valid JSON: {error}") from None
    try:
        return Optimizer.from_config(config)
    except (TypeError, ValueError) as error:
        raise RemoteError(f"cannot rebuild the optimizer from {text!r}: {error}") from None


def describe(slot_id: SlotId, shape: tuple[int, ...]) -> str:
    key, start, stop = slot_id
    return f"key {key!r}" + ("" if _is_whole(slot_id, shape) else f" elements [{start}, {stop})")


def _is_whole(slot_id: SlotId, shape: tuple[int, ...]) -> bool:
    """Does the slot hold all of its key's array (not a split or a P3 slice of it)?"""
    _, start, stop = slot_id
    return start == 0 and stop == _numel(shape)


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


class SlotTable:
    """Slots by id plus the optimizer that updates them.

    Thread safety: none; one thread (the server loop, or the local store's caller) owns a table.
    """

    def __init__(self) -> None:
        self.slots: dict[SlotId, Slot] = {}
        self.optimizer: Any = None
        self.optimizer_json = ""

    def init(self, slot_id: SlotId, shape: tuple[int, ...], value: torch.Tensor) -> None:
        """Store ``value`` as slot ``slot_id`` of a key whose whole array has ``shape``.

        A key split over servers or sliced by P3 arrives as one init per slot, each with the key's
        shape and dtype. Refused with ``RemoteError`` (a server replies with it): the same slot
        again, even with the same shape and dtype (init happens once: a second one would replace the
        value every worker started from), and a slot of a key whose other slots have another shape
        or dtype (the key would hold two values), naming the key and both shapes and dtypes.

        A slot of the same key, shape and dtype with other bounds is not compared with its siblings
        (that would cost a scan of every slot per init): placement cuts a key the same way on every
        worker, and workers refuse a second init of a key before sending it.
        """
        key = slot_id[0]
        known = self.slots.get(slot_id) or next(
            (slot for (other, *_), slot in reversed(self.slots.items()) if other == key), None
        )  # a key's slots arrive together: the newest slots find a sibling at once
        if known is not None and (known.shape != shape or known.value.dtype != value.dtype):
            raise RemoteError(second_init(key, (known.shape, known.value.dtype), (shape, value.dtype)))
        if slot_id in self.slots:
            raise RemoteError(f"{describe(slot_id, shape)} is already initialised as {shape} {value.dtype}; "
                              f"init each key once")  # fmt: skip
        self._check_scope(slot_id, shape, self.optimizer)
        stored = value.detach().to("cpu").reshape(-1).clone()
        self.slots[slot_id] = Slot(shape, stored, self._new_state(stored))

    def put(self, slot_id: SlotId, shape: tuple[int, ...], value: torch.Tensor, state: dict[str, torch.Tensor]) -> None:
        """A new slot holding copies of ``value`` and the optimizer ``state`` (where ``take`` moved them from).

        State tensors must be per element (1-D, the value's length and dtype) or scalars: what
        every elementwise optimizer keeps (names are not checked: SGD creates its momentum lazily).
        """
        where = describe(slot_id, shape)
        if slot_id in self.slots:
            raise RemoteError(f"{where} already exists; a slot is put only where none is")
        sibling = self._any_slot_of(slot_id[0])
        if sibling is not None and (sibling.shape != shape or sibling.value.dtype != value.dtype):
            raise RemoteError(f"{where} {value.dtype}: other slots of the key are {sibling.shape} {sibling.value.dtype}")
        if self.optimizer is None and state:
            raise RemoteError(f"{where}: optimizer state {sorted(state)} sent, but no optimizer is set")
        for name, tensor in state.items():
            if not ((per_element(tensor, value.numel()) and tensor.dtype == value.dtype) or tensor.dim() == 0):
                raise RemoteError(f"{where}: optimizer state {name!r} is {tuple(tensor.shape)} {tensor.dtype}; "
                                  f"expected a scalar or ({value.numel()},) {value.dtype}")  # fmt: skip
        self._check_scope(slot_id, shape, self.optimizer)
        self.slots[slot_id] = Slot(shape, value.clone(), {name: tensor.clone() for name, tensor in state.items()})

    def take(self, slot_id: SlotId) -> Slot:
        """Remove a slot and return it (sends still reading its value keep their own reference)."""
        return self.slots.pop(slot_id)

    def get(self, slot_id: SlotId, shape: tuple[int, ...], dtype: torch.dtype, action: str) -> Slot:
        """The slot, after checking that ``action`` addresses it with the initialised shape and dtype."""
        slot = self.slots.get(slot_id)
        known = slot or self._any_slot_of(slot_id[0])
        if known is None:
            raise RemoteError(
                f"{action} of {describe(slot_id, shape)}: key was never initialised; call init first "
                f"(with the same keys on every worker)"
            )
        if slot is None or known.shape != shape or known.value.dtype != dtype:
            raise RemoteError(
                f"{action} of key {slot_id[0]!r}: got shape {shape} {dtype}, but the key was "
                f"initialised as {known.shape} {known.value.dtype}"
            )
        return slot

    def _any_slot_of(self, key: Key) -> Slot | None:
        """Some slot of ``key`` (all of a key's slots share its shape and dtype), or None."""
        return next((slot for (other, *_), slot in self.slots.items() if other == key), None)

    def set_optimizer(self, optimizer_json: str) -> None:
        self.set_optimizer_object(optimizer_from_json(optimizer_json))

    def set_optimizer_object(self, optimizer: Any) -> None:
        """Update with ``optimizer`` from now on; every slot gets fresh state.

        Values are copied first: zero-copy sends may still read the old tensors, and
        optimizer updates write in place.
        """
        for slot_id, slot in self.slots.items():
            self._check_scope(slot_id, slot.shape, optimizer)
        self.optimizer = optimizer
        self.optimizer_json = optimizer_to_json(optimizer)
        for slot in self.slots.values():
            slot.value, slot.owned, slot.frame, slot.compressed = slot.value.clone(), True, None, None
            slot.state = self._new_state(slot.value)

    @staticmethod
    def _check_scope(slot_id: SlotId, shape: tuple[int, ...], optimizer: Any) -> None:
        """A non-elementwise rule (LAMB) on a slice of a tensor would update it with the slice's norms."""
        if optimizer is None or getattr(optimizer, "elementwise", True) or _is_whole(slot_id, shape):
            return
        raise RemoteError(
            f"{type(optimizer).__name__} cannot run on the servers for {describe(slot_id, shape)}: its update "
            f"needs the whole tensor, but this server holds a slice (TANDEM_KVSTORE_BIGARRAY_BOUND split or "
            f"P3 slicing); update on the workers (Trainer(update_on_kvstore=False)) or raise the bound / "
            f"slice size above {_numel(shape)} elements"
        )

    def _new_state(self, value: torch.Tensor) -> dict[str, torch.Tensor]:
        return {} if self.optimizer is None else dict(self.optimizer.create_state(value))

    def apply(self, slot: Slot, merged: torch.Tensor, merged_owned: bool, frame: Any = None) -> None:
        """Apply an aggregated push: an optimizer step when one is set, else the value becomes ``merged``.

        Without an optimizer the slot just rebinds to ``merged`` (no copy; ``frame``, when given, is
        the received frame ``merged`` views, so pulls can send that frame on); network sends still
        reading the old value keep it alive. With one, the update is in place: pulls are then
        answered with a copy (the server's ``_send_value``), so no send ever reads a value changing.
        """
        slot.compressed = None  # a new value: its compressed frames, if any, are the caller's to set
        if self.optimizer is None:
            slot.value, slot.owned, slot.frame = merged, merged_owned, frame
            return
        if not slot.owned:
            slot.value, slot.owned, slot.frame = slot.value.clone(), True, None
        self.optimizer.update([slot.value], [merged], [slot.state])

    def save(self, path: str, name: str, meta: dict[str, Any], note: str = "") -> str:
        """Write every slot, its optimizer state and the optimizer config to ``path/name``.

        ``note`` is the saving client's own text, handed back by ``load`` (P3 records its slicing there).
        """
        os.makedirs(path, exist_ok=True)
        entries = [
            {"key": key, "start": start, "stop": stop, "shape": list(slot.shape), "value": slot.value,
             "state": slot.state}
            for (key, start, stop), slot in self.slots.items()
        ]  # fmt: skip
        target = os.path.join(path, name)
        document = {
            "format": CHECKPOINT_FORMAT,
            "meta": meta,
            "optimizer": self.optimizer_json,
            "slots": entries,
            "note": note,
        }
        atomic_save(document, target)  # a server killed mid-save leaves the previous checkpoint whole
        return target

    def load(self, path: str, name: str, meta: dict[str, Any]) -> str:
        """Replace all slots and the optimizer with ``path/name``; ``meta`` must match what was saved.

        Returns the note saved with it ("" for a checkpoint written without one).
        """
        target = os.path.join(path, name)
        if not os.path.exists(target):
            raise KVStoreError(f"no kvstore checkpoint at {target}; save_server_state writes one per server")
        document = torch.load(target, weights_only=True)  # tensors and plain containers only, no code
        if document.get("format") != CHECKPOINT_FORMAT or document.get("meta") != meta:
            raise KVStoreError(
                f"checkpoint {target} was written by {document.get('meta')} (format {document.get('format')}); "
                f"this job is {meta}: restore with the same kind and number of servers"
            )
        self.optimizer_json = document["optimizer"]
        self.optimizer = optimizer_from_json(self.optimizer_json) if self.optimizer_json else None
        self.slots = {
            (entry["key"], entry["start"], entry["stop"]): Slot(
                tuple(entry["shape"]), entry["value"], entry["state"]
            )
            for entry in document["slots"]
        }
        return str(document.get("note", ""))
