"""Moving keys' server slots from one P3 slicing to another, optimizer state included.

Why: the tuner (``slice_size="auto"``) tries several slice sizes, but the servers' slots are cut
by the slicing in use, and with a server-side optimizer they hold the parameters and their
optimizer state (momentum, Adam's moments). So a switch moves every key: the worker TAKEs the old
slots (value and state, removed from their servers), joins them into whole tensors, and PUTs the
new slots. Servers thus hold one copy of each key, whatever the tuner tries. State tensors shaped
like the slot (1-D, one entry per element) are cut and joined with it; any other kind (Adam's
scalar ``step``) is the same in every slot of a key and moves whole.

Callers move only between steps, after every worker's requests are applied (``P3KVStore``
settles first and meets the other workers at a barrier after).
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any, NamedTuple

import torch

from tandem.kvstore.base import Handle
from tandem.kvstore.errors import KVStoreError
from tandem.kvstore.ps.placement import Placement, Slice
from tandem.kvstore.ps.protocol import Command, Header, Message, Role, state_from_payloads, state_payloads
from tandem.kvstore.slots import per_element

BATCH_ELEMENTS = 16 * 1024 * 1024  # per batch of keys in flight: 64 MB of float32 values, plus their state


class Move(NamedTuple):
    """One key to move: its slot key under the old and the new slicing, its shape and dtype."""

    old_key: str
    new_key: str
    shape: tuple[int, ...]
    dtype: torch.dtype


def move_slots(client: Any, rank: int, moves: list[Move], old: Placement, new: Placement,
               batch_elements: int | None = None) -> None:  # fmt: skip
    """Take every move's old slots, then put its new ones; blocks until the servers answered all.

    ``client`` is the worker's ``Client`` (or P3's sender, which passes TAKE and PUT straight on).
    Keys move in batches of about ``batch_elements`` elements (``BATCH_ELEMENTS``), so a worker
    never holds more of the model (and its optimizer state) than that at once.
    """
    limit = BATCH_ELEMENTS if batch_elements is None else batch_elements
    batch: list[Move] = []
    elements = 0
    for move in moves:
        batch.append(move)
        elements += math.prod(move.shape)
        if elements >= limit:
            _move_batch(client, rank, batch, old, new)
            batch, elements = [], 0
    if batch:
        _move_batch(client, rank, batch, old, new)


def _move_batch(client: Any, rank: int, moves: list[Move], old: Placement, new: Placement) -> None:
    taken = [_take(client, rank, move, old.plan(move.old_key, math.prod(move.shape))) for move in moves]
    for move, (handle, _, _, names) in zip(moves, taken):
        handle.wait()
        if len(set(names)) > 1:  # cannot happen: every round updates every slot of a key
            raise KVStoreError(f"the slots of {move.old_key} hold different optimizer state: {sorted(set(names))}")
    handles = [_put(client, rank, move, value, state, new.plan(move.new_key, math.prod(move.shape)))
               for move, (_, value, state, _) in zip(moves, taken)]  # fmt: skip
    for handle in handles:
        handle.wait()


def _header(command: Command, rank: int, key: str, move: Move, part: Slice) -> Header:
    return Header(command, 0, Role.WORKER, rank, key=key, dtype=move.dtype, shape=move.shape,
                  slice_start=part.start, slice_stop=part.stop)  # fmt: skip


Taken = tuple[Handle, torch.Tensor, dict[str, torch.Tensor], list[tuple[str, ...]]]  # ..., state names per slot


def _take(client: Any, rank: int, move: Move, parts: list[Slice]) -> Taken:
    value = torch.empty(math.prod(move.shape), dtype=move.dtype)
    state: dict[str, torch.Tensor] = {}
    names: list[tuple[str, ...]] = []
    handle = Handle(f"take {move.old_key}", len(parts), receiver=client)
    for part in parts:
        client.submit(part.server, _header(Command.TAKE, rank, move.old_key, move, part), [],
                      partial(_taken, value, state, names, part, handle), handle.fail)  # fmt: skip
    return handle, value, state, names


def _taken(value: torch.Tensor, state: dict[str, torch.Tensor], names: list[tuple[str, ...]], part: Slice,
           handle: Handle, message: Message) -> None:  # fmt: skip
    """One old slot's reply (receiving thread): its value and state land in the whole-key tensors."""
    part_value, part_state = state_from_payloads(message.payloads, value.dtype, part.numel)
    value[part.start : part.stop] = part_value
    names.append(tuple(sorted(part_state)))
    for name, tensor in part_state.items():
        if per_element(tensor, part.numel):
            state.setdefault(name, tensor.new_zeros(value.numel()))[part.start : part.stop] = tensor
        else:
            state[name] = tensor.clone()
    handle.part_done()


def _put(client: Any, rank: int, move: Move, value: torch.Tensor, state: dict[str, torch.Tensor],
         parts: list[Slice]) -> Handle:  # fmt: skip
    handle = Handle(f"put {move.new_key}", len(parts), receiver=client)
    for part in parts:
        piece = {name: tensor[part.start : part.stop] if per_element(tensor, value.numel()) else tensor
                 for name, tensor in state.items()}  # fmt: skip
        client.submit(part.server, _header(Command.PUT, rank, move.new_key, move, part),
                      state_payloads(value[part.start : part.stop], piece), lambda _: handle.part_done(),
                      handle.fail)  # fmt: skip
    return handle
