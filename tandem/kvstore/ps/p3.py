"""Priority-based parameter propagation (P3, SysML 2019): the ``dist_p3`` kvstore.

Why: backward produces the last layers' gradients first, but the next forward needs the first
layers' parameters first. A plain parameter server sends in production order, so the first layer
arrives last and forward waits for the whole model. P3 (1) cuts every array into slices of
``slice_size`` elements spread round-robin over the servers, so that a big layer neither hogs one
server nor blocks the link for long; (2) queues slices by priority (the trainer passes ``-layer
index``) with at most ``water_mark`` pushes in flight, so a later high-priority slice overtakes the
backlog (``p3_sender``); (3) has servers serve what has arrived in priority order too.

Everything else (protocol, sync/async rounds, server-side optimizers, failures) is the plain
parameter server's: ``P3KVStore`` is a ``DistKVStore`` with another placement and send path.
"""

from __future__ import annotations

import itertools
import json
import zlib
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch

from tandem import trace
from tandem.env import knob
from tandem.kvstore.base import Handle, normalize
from tandem.kvstore.config import DistOptions, P3Options
from tandem.kvstore.errors import KVStoreError
from tandem.kvstore.kinds import P3_FOR
from tandem.kvstore.ps.p3_queue import LanePriorityQueue
from tandem.kvstore.ps.p3_reslice import Move, move_slots
from tandem.kvstore.ps.p3_sender import PrioritySender
from tandem.kvstore.ps.p3_tuner import AutoTuner, Config, start_slice_size, tuner_for
from tandem.kvstore.ps.placement import RoundRobinPlacement
from tandem.kvstore.ps.protocol import Command, Key, Message, Role
from tandem.kvstore.ps.server import CONTROL_COMMANDS, Server
from tandem.kvstore.ps.topology import Topology, from_rank_zero, mean_over_workers
from tandem.kvstore.ps.transport import Incoming, ServerTransport
from tandem.kvstore.ps.worker import DistKVStore, Item

_STORES_CREATED = itertools.count()  # names each store's tuner agreements in the rendezvous store


class P3KVStore(DistKVStore):
    """A worker's ``dist_p3`` store: round-robin slices, each its own request, sent by priority.

    Contract as ``DistKVStore`` (drive from one thread; handles may be waited on anywhere); requests
    of one slot keep their order whatever their priorities. With ``slice_size="auto"`` a key's slots
    are named after the slicing (``p3/<size>/<key>``), and when the tuner switches slicing between
    iterations every key moves to the new one, values and optimizer state (``p3_reslice``);
    ``tuner.result`` holds the final choice.
    """

    def __init__(self, topology: Topology, options: DistOptions, p3: P3Options) -> None:
        start = start_slice_size(p3)
        super().__init__(topology, options, RoundRobinPlacement(topology.num_servers, start))
        self.kind = P3_FOR[options.kind]
        self.p3 = p3
        self.sender = PrioritySender(self._client, p3.water_mark, start, topology.rank)
        self._client = self.sender  # type: ignore[assignment]  # same interface; queues tensor requests
        self.tuner: AutoTuner | None = tuner_for(p3, self._apply, self._agree)
        if self.tuner is not None and not options.sync:
            self.tuner.fix_slice_size()  # async workers cannot agree on a slicing
        self._live = start  # the slicing the servers' slots are cut by
        self._keys: dict[Key, tuple[tuple[int, ...], torch.dtype]] = {}  # shape and dtype, to move slots
        self._agreements = 0
        self._loads = 0  # load_server_state calls: names each one's shared answer in the rendezvous store
        # unique per job incarnation (servers' ephemeral ports) and per store (workers create them in step)
        job = zlib.crc32(" ".join(address.endpoint for address in self.addresses).encode())
        self._agreement_prefix = f"p3/tuner/{job:08x}/{next(_STORES_CREATED)}"
        # Read by the trainer each step: when its gradients leave (p3_tuner.SEND_TIMINGS; the tuner's
        # choice: holding them saves CPU where overlap costs more than it saves wire time).
        self.send_timing = "during"

    def batched(self) -> AbstractContextManager[None]:
        """The slices of the requests made inside leave together when it ends (``PrioritySender.batched``)."""
        return self.sender.batched()

    def _apply(self, config: Config) -> None:
        if config.slice_size != self._live:
            self._move_slots(config.slice_size)
        self.sender.slice_size, self.sender.water_mark = config.slice_size, config.water_mark
        self.send_timing = config.send_timing

    def _move_slots(self, size: int) -> None:
        """Every key from the live slicing to ``size``; the workers split the keys between them."""
        self._settle()  # this worker's requests answered, then everyone's: every round is applied
        keys = sorted(self._keys, key=repr)[self.rank :: self.num_workers]
        moves = [Move(_slot_key(self._live, key), _slot_key(size, key), *self._keys[key]) for key in keys]
        move_slots(self._client, self.rank, moves, RoundRobinPlacement(self.num_servers, self._live),
                   RoundRobinPlacement(self.num_servers, size))  # fmt: skip
        if self._compressor is not None:  # residuals are per element: the same under any slicing
            for key in self._keys:
                self._compressor.rename(_slot_key(self._live, key), _slot_key(size, key))
        self._live = size
        self.barrier()  # no worker uses the new slicing before every key is there

    def _agree(self, cost: float) -> float:
        """The mean of ``cost`` over workers, through the rendezvous store (every worker gets the same float)."""
        if not self.options.sync or self.tuner is None or self.tuner.slicing_fixed:
            return cost  # only the water mark is searched: a per-worker choice
        self._agreements += 1
        return mean_over_workers(self.rendezvous, f"{self._agreement_prefix}/{self._agreements}", self.rank,
                                 self.num_workers, cost, knob("TANDEM_PS_WAIT_TIMEOUT"))  # fmt: skip

    def _sliced(self, size: int, command: Command, items: list[Item], priority: int, what: str) -> Handle:
        self.placement = RoundRobinPlacement(self.num_servers, size)
        renamed: list[Item] = [(_slot_key(size, key), value, targets) for key, value, targets in items]
        return super()._send_tensors(command, renamed, priority, what)

    def _send_tensors(self, command: Command, items: list[Item], priority: int, what: str) -> Handle:
        if self.tuner is None:
            return super()._send_tensors(command, items, priority, what)
        if command in (Command.PUSH, Command.PUSHPULL):
            for key, *_ in items:  # the clock key may be anywhere in a call of many (the serial timing's)
                self.tuner.observe(key)  # may switch the slicing, moving every key first
        return self._sliced(self._live, command, items, priority, what)

    def init(self, keys: Key | Sequence[Key], values: Any) -> None:
        super().init(keys, values)
        self._keys.update((key, (tuple(tensors[0].shape), tensors[0].dtype))
                          for key, tensors in normalize(keys, values, "init"))  # fmt: skip

    def set_optimizer(self, optimizer: Any) -> None:
        """As ``DistKVStore``'s; a rule needing whole tensors (LAMB) pins the slicing: its slots cannot be recut."""
        if self.tuner is not None and not getattr(optimizer, "elementwise", True):
            try:
                self.tuner.fix_slice_size()
            except RuntimeError:
                raise KVStoreError(f"with slice_size='auto', set {type(optimizer).__name__} (it needs whole "
                                   f"tensors) before the first push") from None  # fmt: skip
        super().set_optimizer(optimizer)

    def save_server_state(self, path: str) -> None:
        """As ``DistKVStore``'s; a tuned store saves the slicing it uses, recorded in the checkpoint."""
        if self.tuner is None:
            return super().save_server_state(path)
        self._checkpoint(Command.SAVE, path, json.dumps({"p3_slice_size": self._live}))

    def load_server_state(self, path: str) -> None:
        """As ``DistKVStore``'s; a tuned store then moves the checkpoint's slicing to the one it uses now."""
        if self.tuner is None:
            return super().load_server_state(path)
        notes = self._checkpoint(Command.LOAD, path)  # on rank 0: every server's record of the slicing
        self._loads += 1
        found = str(_saved_slicing(notes, self.tuner.start.slice_size, path)) if self.rank == 0 else ""
        saved = from_rank_zero(self.rendezvous, f"{self._agreement_prefix}/loaded/{self._loads}", self.rank, found,
                               knob("TANDEM_PS_WAIT_TIMEOUT"))  # fmt: skip
        wanted, self._live = self._live, int(saved)
        if wanted != self._live:
            self._move_slots(wanted)


def _saved_slicing(notes: list[str], start: int, path: str) -> int:
    """The slicing a checkpoint's slots are cut by, from its servers' notes (none: the start slicing)."""
    sizes = {json.loads(note).get("p3_slice_size") if note else None for note in notes}
    if len(sizes) != 1:
        raise KVStoreError(f"the servers' checkpoints in {path} were saved at different slicings {sizes}; "
                           f"restore from one save_server_state")  # fmt: skip
    size = sizes.pop()
    return start if size is None else int(size)


def _slot_key(slice_size: int, key: Key) -> str:
    """Where a tuned store keeps ``key`` while the slicing is ``slice_size``."""
    return f"p3/{slice_size}/{key!r}"


class PriorityReceive:
    """A server transport whose ``poll`` hands over what arrived in priority order (P3's receive queue).

    Control messages (hello, heartbeats, goodbye, abort) and rejected frames come first, in arrival order;
    data requests follow by priority, FIFO on ties, never reordered within one worker's slot.
    """

    def __init__(self, inner: ServerTransport) -> None:
        self.inner = inner

    def poll(self, timeout: float) -> list[Incoming]:
        first: list[Incoming] = []
        queue: LanePriorityQueue[Incoming] = LanePriorityQueue()
        for item in self.inner.poll(timeout):
            if _is_data(item):
                header = item.message.header  # type: ignore[union-attr]  # _is_data checked it
                queue.put(item, header.priority, (header.sender_rank, header.key, header.slice_start))
            else:
                first.append(item)
        return first + [queue.pop() for _ in range(len(queue))]

    def send(self, peer: bytes, header: Any, payloads: Any = ()) -> None:
        self.inner.send(peer, header, payloads)

    def reply(self, peer: bytes, request: Any, rank: int, payloads: Any = (), error: bool = False,
              compressed: bool = False) -> None:  # fmt: skip
        self.inner.reply(peer, request, rank, payloads, error, compressed)

    def flush(self, peer: bytes | None = None) -> None:
        self.inner.flush(peer)

    def close(self) -> None:
        self.inner.close()


def _is_data(incoming: Incoming) -> bool:
    """A well-formed data request (push, pull, init, barrier...), not a control message or a rejected frame."""
    return incoming.message is not None and incoming.message.header.command not in CONTROL_COMMANDS


class P3Server(Server):
    """A parameter server serving data requests in priority order, with a trace event per slice served."""

    def __init__(self, topology: Topology, options: DistOptions) -> None:
        super().__init__(topology, options)
        # replies leave as each request is served, by priority: held for the end of a poll, the first
        # layers' replies (and the cap slots they free) waited for the rest (+10 % per step, bench/kvstore.py --step)
        self.transport.coalesce_bytes = 0
        self.transport = PriorityReceive(self.transport)  # type: ignore[assignment]
        self._row = f"p3 serve (server {topology.rank})"

    def _pushpull(self, peer: bytes, message: Message) -> None:
        """As the plain server's; a pushpull that must wait for other workers is announced RECEIVED
        at once if the worker asked (``header.receipt``), so that its water mark counts it as delivered
        (see ``p3_sender``)."""
        super()._pushpull(peer, message)
        if not message.header.receipt:
            return
        rounds = self.rounds.get(self._slot_id(message.header)) if self.options.sync else None
        if rounds is not None and any(request is message.header for *_, request in rounds.waiting_pulls):
            self.transport.send(peer, message.header.reply(Role.SERVER, self.rank, command=Command.RECEIVED))

    def _dispatch(self, incoming: Incoming) -> None:
        start = trace.now_us()
        super()._dispatch(incoming)
        if trace.enabled() and _is_data(incoming):
            self._record(incoming.message, start)  # type: ignore[arg-type]  # _is_data checked it

    def _record(self, message: Message, start: float) -> None:
        header = message.header
        trace.record(f"serve {header.command.name.lower()} {header.key}[{header.slice_start}:{header.slice_stop}]",
                     start, trace.now_us(), "comm", {"key": header.key, "slice": [header.slice_start, header.slice_stop],
                     "priority": header.priority, "worker": header.sender_rank}, self._row)  # fmt: skip
