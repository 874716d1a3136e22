"""A parameter server: holds its slots, merges workers' pushes, answers pulls, watches workers' heartbeats.

One thread runs the whole loop, so slot state needs no locks. Sync mode (ps-lite's ``KVStoreDist``):
a slot's pushes are queued per worker and merged in rank order once every worker has one queued,
then the optimizer runs on the sum (or the sum becomes the value); a pull waits until every round
the puller has pushed into is applied. Async mode applies each push on arrival.

Faults: every message from every peer goes through one guard (``_dispatch``): a malformed,
unauthenticated, replayed or unexpected message is logged with the peer's identity and dropped; a
bad request (wrong shape, key never initialised, double init) gets an error response; nothing a
peer sends can end the loop. A worker silent for ``timeout`` seconds ends the job: the server tells
every other worker (ABORT) and exits nonzero.

Workers: with a secret, a worker's HELLO opens a *pending* session for its connection; the rank
is bound to that connection only when the first message tagged with the session key arrives from
it, which only the holder of the secret can send. So a replayed hello, or a stranger claiming a
rank, can neither take a rank nor lock the real worker out (``docs/security.md``).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import zmq

from tandem.env import knob
from tandem.kvstore import compression
from tandem.kvstore.compression import GradientCompression
from tandem.kvstore.config import DistOptions
from tandem.kvstore.errors import PeerFailure, ProtocolError, RemoteError
from tandem.kvstore.ps.auth import HELLO_FRESH_SECONDS, NONCE_BYTES, new_nonce
from tandem.kvstore.ps.curve import CurveKeys
from tandem.kvstore.ps.protocol import (
    Command,
    Header,
    Message,
    Role,
    state_from_payloads,
    state_payloads,
    tensor_bytes,
    tensor_from_bytes,
)
from tandem.kvstore.ps.topology import (
    ServerAddress,
    Topology,
    connect_store,
    public_endpoint,
    publish_server,
)
from tandem.kvstore.ps.transport import Incoming, ServerTransport, snapshot_frame
from tandem.kvstore.slots import Slot, SlotId, SlotTable

log = logging.getLogger("tandem.kvstore.server")
CONTROL_COMMANDS = frozenset({Command.HELLO, Command.HEARTBEAT, Command.BYE, Command.ABORT})
PENDING_PER_RANK = 4  # hellos awaiting their first tagged message, per rank (a replayed hello never completes)
REJECTION_PEERS_KEPT = 4096  # peers whose rejections are counted at once
LOG_BURST, LOG_RATE = 50, 5.0  # rejection lines logged at once, and per second after that
LOGGED_PER_PEER = 20  # rejections logged in full per peer; after that one line per 1000 (a flood must not fill disks)
_ACTIONS = {command: command.name.lower() for command in Command}  # for error messages, named once


@dataclass
class _WorkerState:
    peer: bytes
    description: str  # "worker 1 (pid 123 on host)", for failure messages
    last_heard: float
    gone: bool = False  # said goodbye: silence is expected now


# a pushed value, the received frame it views (None if not one), how it was compressed (None if not)
_Push = tuple[torch.Tensor, Any, GradientCompression | None]


@dataclass
class _Rounds:
    """Sync-mode bookkeeping for one slot."""

    queued: dict[int, deque[_Push]] = field(default_factory=dict)  # worker -> pushes not merged yet
    pushed: dict[int, int] = field(default_factory=dict)  # worker -> pushes received in total
    applied: int = 0
    waiting_pulls: list[tuple[int, bytes, Header]] = field(
        default_factory=list
    )  # (round needed, peer, request)


class Server:
    """Serve until every worker said goodbye (exit code 0) or the job failed (exit code 1)."""

    def __init__(self, topology: Topology, options: DistOptions) -> None:
        self.topology, self.options = topology, options
        self.rank = topology.rank
        self.table = SlotTable()
        self.checkpoint_root = os.path.realpath(knob("TANDEM_PS_CHECKPOINT_DIR") or os.getcwd())  # SAVE/LOAD stay inside
        # replies to the requests of one poll go out together, per worker (TANDEM_PS_COALESCE_BYTES)
        self.wire = ServerTransport(options.secret_bytes, options.bind_addr, knob("TANDEM_PS_COALESCE_BYTES"),
                                    options.max_frame_bytes, CurveKeys.from_env("server"))  # fmt: skip
        self.transport = self.wire  # what requests are read from and answered on (P3 puts a priority queue in front)
        self.address = ServerAddress(public_endpoint(options.bind_addr, self.wire.port))
        self.workers: dict[int, _WorkerState] = {}
        # peer -> (rank, worker) its hello claimed, until it proves the session key (then: self.workers)
        self.pending: dict[bytes, tuple[int, _WorkerState]] = {}
        self.rejections: Counter[bytes] = Counter()  # per peer
        self.seen_nonces: dict[bytes, float] = {}  # valid hellos' nonces, while their stamp could pass as fresh
        self._log_tokens, self._log_refilled, self._unlogged = float(LOG_BURST), time.monotonic(), 0
        self.rounds: dict[SlotId, _Rounds] = {}
        self.residuals: dict[SlotId, torch.Tensor] = {}  # see _compress_value
        self.barrier: dict[int, tuple[bytes, Header]] = {}
        self.rejected = 0
        self._handlers: dict[Command, Callable[[bytes, Message], None]] = {  # requests a worker may send
            Command.HEARTBEAT: self._heartbeat,
            Command.BYE: self._bye,
            Command.INIT: self._init,
            Command.PUSH: self._push,
            Command.PULL: self._pull,
            Command.PUSHPULL: self._pushpull,
            Command.SET_OPTIMIZER: self._set_optimizer,
            Command.BARRIER: self._barrier,
            Command.SAVE: self._save,
            Command.LOAD: self._load,
            Command.ABORT: self._abort,
            Command.TAKE: self._take,
            Command.PUT: self._put,
        }

    def serve(self) -> int:
        """Publish the endpoint, then run the loop; returns the process exit code."""
        store = connect_store(self.topology, self.options.rendezvous_timeout)
        publish_server(store, self.rank, self.address, self.options.secret_bytes)
        log.info("server %d (%s) serving %s", self.rank, self.address, self.options.kind)
        started = time.monotonic()
        try:
            while not self._finished():
                for incoming in self.transport.poll(self.options.heartbeat):
                    self._dispatch(incoming)
                self._flush()
                self._check_workers(started)
            return 0
        except PeerFailure as failure:
            log.error("server %d: %s; stopping the job", self.rank, failure)
            self._broadcast_abort(str(failure))
            return 1
        finally:
            self.transport.close()

    def _finished(self) -> bool:
        everyone = len(self.workers) == self.topology.num_workers
        return everyone and all(worker.gone for worker in self.workers.values())

    def _flush(self) -> None:
        """Send the replies held for this poll, under the guard: a reply that cannot be sealed is dropped."""
        try:
            self.transport.flush()
        except (ProtocolError, zmq.ZMQError) as error:
            log.warning("server %d dropped held replies: %s", self.rank, error)

    def _check_workers(self, started: float) -> None:
        now = time.monotonic()
        for worker in self.workers.values():
            if not worker.gone and now - worker.last_heard > self.options.timeout:
                raise PeerFailure(
                    f"{worker.description} stopped answering: no heartbeat for {self.options.timeout:.1f} s"
                )
        if len(self.workers) < self.topology.num_workers and now - started > self.options.rendezvous_timeout:
            missing = sorted(set(range(self.topology.num_workers)) - set(self.workers))
            raise PeerFailure(
                f"worker(s) {missing} never connected within {self.options.rendezvous_timeout:.0f} s"
            )

    def _dispatch(self, incoming: Incoming) -> None:
        """The one guard every received message passes: answered, or logged and dropped; never raised
        out of the loop (a ``PeerFailure`` is the job ending, not a message's fault)."""
        try:
            self._route(incoming)
        except PeerFailure:
            raise
        except Exception as error:  # a bug a hostile message found: drop the message, keep serving
            log.exception("server %d: a message from peer %s broke the dispatch", self.rank, incoming.peer.hex())
            self._reject(incoming, f"internal error: {type(error).__name__}: {error}")

    def _route(self, incoming: Incoming) -> None:
        message = incoming.message
        if message is None:
            self._reject(incoming, str(incoming.error))
            return
        header = message.header
        if header.response or header.sender_role is not Role.WORKER:
            self._reject(
                incoming, f"unexpected {header.command.name} {'response' if header.response else 'request'}"
            )
            return
        if header.command is Command.HELLO:
            self._guarded(incoming.peer, header, self._hello, message)
            return
        handler = self._handlers.get(header.command)
        if handler is None:  # RECEIVED, BATCH (split already) ...: never a worker's request
            self._reject(incoming, f"{header.command.name} is not a request a worker sends")
            return
        if incoming.peer in self.pending:
            self._confirm(incoming.peer)
        worker = self.workers.get(header.sender_rank)
        if worker is None or worker.gone or incoming.peer != worker.peer:
            self._reject(
                incoming, f"{header.command.name} from worker {header.sender_rank}, which did not say hello"
            )
            return
        worker.last_heard = time.monotonic()
        self._guarded(worker.peer, header, handler, message)

    def _confirm(self, peer: bytes) -> None:
        """``peer`` sent its first message tagged with its session key: it is the worker its hello named."""
        rank, state = self.pending.pop(peer)
        known = self.workers.get(rank)
        if known is not None and known.peer != peer and not known.gone:
            self.wire.close_session(peer)  # the rank is taken by a connection that proved itself first
            return
        self.workers[rank] = state
        for other in self._claims(rank):
            self._forget_pending(other)  # hellos that claimed the same rank (replays) can never complete now

    def _forget_old_nonces(self) -> None:
        """A nonce is kept while a replay of its hello could still pass the freshness check (both ways)."""
        oldest = time.monotonic() - 2 * HELLO_FRESH_SECONDS
        for nonce in [nonce for nonce, seen in self.seen_nonces.items() if seen < oldest]:
            del self.seen_nonces[nonce]

    def _claims(self, rank: int) -> list[bytes]:
        """The peers whose pending hello claims ``rank``, oldest first."""
        return [peer for peer, (claimed, _) in self.pending.items() if claimed == rank]

    def _forget_pending(self, peer: bytes) -> None:
        self.pending.pop(peer, None)
        self.wire.close_session(peer)

    def _guarded(self, peer: bytes, header: Header, handler: Callable[[bytes, Message], None],
                 message: Message) -> None:  # fmt: skip
        """Run ``handler(peer, message)``; a bad request becomes an error response, never a dead server."""
        try:
            handler(peer, message)
        except RemoteError as error:
            self._reply_error(peer, header, str(error))
        except PeerFailure:
            raise
        except Exception as error:  # a bug or a hostile request: report it, keep serving
            log.exception("server %d: %s failed", self.rank, header.describe())
            self._reply_error(
                peer, header, f"internal error on server {self.rank}: {type(error).__name__}: {error}"
            )

    def _reject(self, incoming: Incoming, reason: str) -> None:
        self.rejected += 1
        peer = incoming.peer
        if len(self.rejections) >= REJECTION_PEERS_KEPT:  # every connection is a new peer: bound the table
            self.rejections.clear()
        count = self.rejections[peer] = self.rejections[peer] + 1
        now = time.monotonic()  # a token bucket over all peers: every new connection is a new peer
        self._log_tokens = min(float(LOG_BURST), self._log_tokens + (now - self._log_refilled) * LOG_RATE)
        self._log_refilled = now
        if (count > LOGGED_PER_PEER and count % 1000) or self._log_tokens < 1:
            self._unlogged += 1
            return
        self._log_tokens -= 1
        if self._unlogged:
            log.warning("server %d rejected %d more message(s) it did not log one by one", self.rank, self._unlogged)
            self._unlogged = 0
        log.warning("server %d rejected message %d from peer %s (%s): %s", self.rank, count, peer.hex(),
                    self._peer_name(peer), reason)  # fmt: skip

    def _peer_name(self, peer: bytes) -> str:
        """Who a peer is, as far as this server knows: its worker, a pending hello, or a stranger."""
        for worker in self.workers.values():
            if worker.peer == peer:
                return worker.description
        pending = self.pending.get(peer)
        return f"unconfirmed hello as {pending[1].description}" if pending is not None else "never said hello"

    def _reply(self, peer: bytes, request: Header, payloads: list[Any] | None = None) -> None:
        self.transport.reply(peer, request, self.rank, payloads or ())

    def _reply_error(self, peer: bytes, request: Header, text: str) -> None:
        self.transport.reply(peer, request, self.rank, [memoryview(text.encode("utf-8"))], error=True)

    def _heartbeat(self, peer: bytes, message: Message) -> None:
        self._reply(peer, message.header)

    def _hello(self, peer: bytes, message: Message) -> None:
        header = message.header
        info = _json_payload(message)
        expected = {"kind": self.options.kind, "num_workers": self.topology.num_workers,
                    "num_servers": self.topology.num_servers, "max_frame_bytes": self.options.max_frame_bytes}  # fmt: skip
        seen = {name: info.get(name) for name in expected}
        if seen != expected:
            raise RemoteError(
                f"worker {header.sender_rank} runs {seen} but server {self.rank} runs {expected}"
            )
        if not 0 <= header.sender_rank < self.topology.num_workers:
            raise RemoteError(f"worker rank {header.sender_rank} is outside [0, {self.topology.num_workers})")
        known = self.workers.get(header.sender_rank)
        if known is not None and known.peer != peer:
            raise RemoteError(f"worker rank {header.sender_rank} is already connected from another process")
        where = f"pid {info.get('pid')} on {info.get('host')}"
        state = _WorkerState(peer, f"worker {header.sender_rank} ({where})", time.monotonic())
        if not self.options.secret:  # nothing to prove: the rank is this connection's from now on
            self.workers[header.sender_rank] = state
            self._reply(peer, header)
            return
        worker_nonce = _nonce(info.get("nonce"))
        skew = time.time() - header.timestamp  # the stamp is under the hello's tag: a replay keeps its old one
        if abs(skew) > HELLO_FRESH_SECONDS:
            raise RemoteError(f"hello stamped {skew:+.0f} s from server {self.rank}'s clock (at most "
                              f"{HELLO_FRESH_SECONDS:.0f} s allowed): a replayed hello, or clocks apart (sync them: NTP)")  # fmt: skip
        self._forget_old_nonces()
        if worker_nonce in self.seen_nonces:
            raise RemoteError("a replayed hello: its nonce was seen already")
        self.seen_nonces[worker_nonce] = time.monotonic()
        claims = self._claims(header.sender_rank)
        if len(claims) >= PENDING_PER_RANK and peer not in claims:
            self._forget_pending(claims[0])  # the oldest claim: bounded, and a live worker retries nothing
        server_nonce = new_nonce()
        self.wire.open_session(peer, worker_nonce, server_nonce, header.sender_rank)
        self.pending[peer] = (header.sender_rank, state)
        answer = {"nonce": server_nonce.hex(), "worker_nonce": worker_nonce.hex()}  # signed with the secret
        self._reply(peer, header, [memoryview(json.dumps(answer).encode())])

    def _bye(self, peer: bytes, message: Message) -> None:
        """A worker closed its store: what still waits for it can never complete, so say so now."""
        rank = message.header.sender_rank
        self.workers[rank].gone = True
        self._reply(peer, message.header)
        reason = self._departed_problem()
        stranded = [(waiting, request) for waiting, request in self.barrier.values()]
        stranded += [
            (waiting, request)
            for rounds in self.rounds.values()
            for _, waiting, request in rounds.waiting_pulls
        ]
        self.barrier = {}
        for rounds in self.rounds.values():
            rounds.waiting_pulls = []
        for waiting, request in stranded:
            self._reply_error(waiting, request, reason)

    def _departed(self) -> list[int]:
        return [rank for rank, worker in self.workers.items() if worker.gone]

    def _departed_problem(self) -> str:
        return f"worker(s) {self._departed()} closed their kvstore, so this cannot complete; every worker must run the same steps"

    def _abort(self, peer: bytes, message: Message) -> None:
        reason = (
            bytes(message.payloads[0]).decode("utf-8", "replace") if message.payloads else "no reason given"
        )
        raise PeerFailure(f"worker {message.header.sender_rank} aborted the job: {reason}")

    def _broadcast_abort(self, reason: str) -> None:
        for rank, worker in self.workers.items():
            if not worker.gone:
                header = Header(Command.ABORT, 0, Role.SERVER, self.rank, response=True)
                try:  # best effort: the job ends either way, and the launcher stops what is left
                    self.transport.send(worker.peer, header, [memoryview(f"server {self.rank}: {reason}".encode())])
                except (ProtocolError, zmq.ZMQError) as error:
                    log.warning("server %d could not tell worker %d to stop: %s", self.rank, rank, error)
                    continue
                log.info("server %d told worker %d to stop", self.rank, rank)

    def _slot_id(self, header: Header) -> SlotId:
        assert header.key is not None and header.dtype is not None  # ensured by _tensor_request
        return (header.key, header.slice_start, header.slice_stop)

    def _tensor_request(self, message: Message) -> tuple[SlotId, _Push | None]:
        header = message.header
        if header.key is None or header.dtype is None:
            raise RemoteError(f"{header.describe()} needs a key and a dtype")
        if header.command in (Command.PULL, Command.TAKE, Command.PUT):  # no pushed value (PUT parses its own)
            return self._slot_id(header), None
        if header.compressed and header.command in (Command.PUSH, Command.PUSHPULL):
            try:  # decoded into a tensor of its own (no received frame behind it)
                config = compression.config_of(message.payloads)
                decoded = compression.decode_data(config, message.payloads[1], header.dtype, header.slice_numel)
            except ProtocolError as error:
                raise RemoteError(f"{header.describe()}: {error}") from None
            return self._slot_id(header), (decoded, None, config)
        if len(message.payloads) != 1 or header.compressed:
            raise RemoteError(f"{header.describe()} needs exactly one uncompressed payload frame")
        tensor = tensor_from_bytes(message.payloads[0], header.dtype, header.slice_numel)
        return self._slot_id(header), (tensor, message.frames[0] if message.frames else None, None)

    def _init(self, peer: bytes, message: Message) -> None:
        slot_id, push = self._tensor_request(message)
        assert push is not None
        self.table.init(slot_id, message.header.shape, push[0])
        self._reply(peer, message.header)

    def _lookup(self, message: Message) -> tuple[SlotId, Slot, _Push | None]:
        header = message.header
        slot_id, push = self._tensor_request(message)
        assert header.dtype is not None
        return slot_id, self.table.get(slot_id, header.shape, header.dtype, _ACTIONS[header.command]), push

    def _push(self, peer: bytes, message: Message) -> None:
        slot_id, slot, push = self._lookup(message)
        assert push is not None
        self._merge(slot_id, slot, message.header.sender_rank, push)
        self._reply(peer, message.header)

    def _pull(self, peer: bytes, message: Message) -> None:
        slot_id, slot, _ = self._lookup(message)
        self._answer_pull(slot_id, slot, peer, message.header)

    def _pushpull(self, peer: bytes, message: Message) -> None:
        slot_id, slot, push = self._lookup(message)
        assert push is not None
        self._merge(slot_id, slot, message.header.sender_rank, push)
        self._answer_pull(slot_id, self.table.slots[slot_id], peer, message.header)

    def _merge(self, slot_id: SlotId, slot: Slot, worker: int, push: _Push) -> None:
        if not self.options.sync:
            self.table.apply(slot, push[0], merged_owned=False, frame=push[1])
            return
        rounds = self.rounds.get(slot_id)
        if rounds is None:
            rounds = self.rounds[slot_id] = _Rounds()
        queued = rounds.queued
        queue = queued.get(worker)
        if queue is None:
            queue = queued[worker] = deque()
        queue.append(push)
        rounds.pushed[worker] = rounds.pushed.get(worker, 0) + 1
        workers = self.topology.num_workers
        while len(queued) == workers and all(queued.values()):  # keys: ranks below workers (hello checks)
            pushes = [queued[rank].popleft() for rank in range(workers)]  # rank order: deterministic sums
            if workers == 1:
                self.table.apply(slot, pushes[0][0], merged_owned=False, frame=pushes[0][1])
            else:
                self.table.apply(slot, _sum([push[0] for push in pushes]), merged_owned=True)
            if pushes[0][2] is not None and self.table.optimizer is None:
                self._compress_value(slot_id, slot, pushes[0][2])
            rounds.applied += 1
        if rounds.waiting_pulls:
            ready = [pull for pull in rounds.waiting_pulls if pull[0] <= rounds.applied]
            rounds.waiting_pulls = [pull for pull in rounds.waiting_pulls if pull[0] > rounds.applied]
            for _, peer, request in ready:
                self._send_value(slot, peer, request)

    def _compress_value(self, slot_id: SlotId, slot: Slot, config: GradientCompression) -> None:
        """A sync round of compressed pushes, no optimizer: the sum goes back compressed the same way.

        Why: without an optimizer the pulls carry gradient sums, which tolerate compression as the
        pushes did, and on a full-duplex link the pulls are the other half of the bytes. Error
        feedback again, with this server's residual per slot; the value becomes what the frames
        carry, so every puller (and a later plain pull) gets the same values. A 2bit sum is sent in
        quanta of ``threshold x workers``: with the pushes' own quantum, workers agreeing on a sign
        (a sum of 2 quanta) would pile up a backlog in the residual, one quantum per step.
        """
        if config.type == "2bit":
            config = GradientCompression("2bit", config.threshold * self.topology.num_workers)
        numel = slot.value.numel()  # flat
        total = compression.add_to_residual(self.residuals, slot_id, slot.value, 0, numel)
        frames = compression.frames_of(config, compression.encode_into_residual(config, total))
        slot.value, slot.owned, slot.frame = compression.decode_data(config, frames[1], total.dtype, numel), True, None
        slot.compressed = frames

    def _answer_pull(self, slot_id: SlotId, slot: Slot, peer: bytes, request: Header) -> None:
        rounds = self.rounds.get(slot_id) if self.options.sync else None
        needed = 0 if rounds is None else rounds.pushed.get(request.sender_rank, 0)
        if rounds is not None and rounds.applied < needed:
            if self._departed():
                raise RemoteError(f"{request.describe()}: {self._departed_problem()}")
            rounds.waiting_pulls.append((needed, peer, request))  # answered when that round is applied
            return
        self._send_value(slot, peer, request)

    def _take(self, peer: bytes, message: Message) -> None:
        """Answered like a pull (once every round the taker pushed into is applied), then the slot is gone."""
        slot_id, slot, _ = self._lookup(message)
        self._answer_pull(slot_id, slot, peer, message.header)

    def _put(self, peer: bytes, message: Message) -> None:
        header = message.header
        slot_id, _ = self._tensor_request(message)
        assert header.dtype is not None  # ensured by _tensor_request
        try:
            value, state = state_from_payloads(message.payloads, header.dtype, header.slice_numel)
        except ProtocolError as error:
            raise RemoteError(f"{header.describe()}: {error}") from None
        self.table.put(slot_id, header.shape, value, state)
        self.rounds.pop(slot_id, None)  # a new slot: its rounds count from here
        self._reply(peer, header)

    def _send_value(self, slot: Slot, peer: bytes, request: Header) -> None:
        if request.command is Command.TAKE:
            self._send_taken(self._slot_id(request), peer, request)
            return
        if slot.compressed is not None:
            self.transport.reply(peer, request, self.rank, slot.compressed, compressed=True)
            return
        if self.table.optimizer is not None:
            # updated in place by the next round: send a copy (copy=True: pyzmq's default shares
            # buffers from 64 KB up, and the reply could then carry the next round's values). A copy
            # also spares the wake-up of pyzmq's collector thread that a shared buffer costs per reply
            self._reply(peer, request, [snapshot_frame(slot.value)])
            return
        value = slot.frame if slot.frame is not None else tensor_bytes(slot.value)  # a frame is sent on, uncopied
        self._reply(peer, request, [value])

    def _send_taken(self, slot_id: SlotId, peer: bytes, request: Header) -> None:
        rounds = self.rounds.get(slot_id)
        if rounds is not None and (any(rounds.queued.values()) or rounds.waiting_pulls):
            self._reply_error(peer, request, f"{request.describe()}: other workers' pushes or pulls of it are "
                                             f"still pending; take a slot only between steps")  # fmt: skip
            return
        slot = self.table.take(slot_id)
        self.rounds.pop(slot_id, None)
        self.residuals.pop(slot_id, None)  # what the slot's compressed replies left out goes with it (< a quantum)
        self._reply(peer, request, state_payloads(slot.value, slot.state))  # the slot is gone: no copy needed

    def _set_optimizer(self, peer: bytes, message: Message) -> None:
        self.table.set_optimizer(_text_payload(message))
        self._reply(peer, message.header)

    def _barrier(self, peer: bytes, message: Message) -> None:
        if self._departed():
            raise RemoteError(f"barrier: {self._departed_problem()}")
        self.barrier[message.header.sender_rank] = (peer, message.header)
        if len(self.barrier) == self.topology.num_workers:
            arrived, self.barrier = self.barrier, {}
            for waiting_peer, request in arrived.values():
                self._reply(waiting_peer, request)

    def _checkpoint_meta(self) -> dict[str, object]:
        return {"kind": self.options.kind, "num_servers": self.topology.num_servers,
                "bigarray_bound": self.options.bigarray_bound}  # fmt: skip

    def _checkpoint_name(self) -> str:
        return f"server-{self.rank}-of-{self.topology.num_servers}.pt"

    def _checkpoint_path(self, path: str) -> str:
        """``path`` (relative to the checkpoint root, or absolute inside it) resolved; a path that leads
        outside the root (``..``, a symbolic link) is refused: a peer must not write anywhere it likes."""
        resolved = os.path.realpath(os.path.join(self.checkpoint_root, path))
        if os.path.commonpath([resolved, self.checkpoint_root]) != self.checkpoint_root:
            raise RemoteError(f"checkpoint directory {path!r} is outside server {self.rank}'s checkpoint root "
                              f"{self.checkpoint_root}; use a directory inside it, or start the servers with "
                              f"TANDEM_PS_CHECKPOINT_DIR set to a directory that contains it")  # fmt: skip
        return resolved

    def _save(self, peer: bytes, message: Message) -> None:
        """Payloads: the directory, then optionally a note for whoever loads it (answered: the file written)."""
        path, *note = _text_payloads(message, most=2)
        target = self.table.save(self._checkpoint_path(path), self._checkpoint_name(), self._checkpoint_meta(), *note)
        self._reply(peer, message.header, [memoryview(target.encode())])

    def _load(self, peer: bytes, message: Message) -> None:
        """Payload: the directory (answered: the note saved with the checkpoint)."""
        note = self.table.load(self._checkpoint_path(_text_payload(message)), self._checkpoint_name(),
                               self._checkpoint_meta())  # fmt: skip
        self.rounds.clear()  # a restore happens between steps: no round is half-merged
        self.residuals.clear()
        self._reply(peer, message.header, [memoryview(note.encode())])


def _sum(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The sum in rank order (deterministic, and bit for bit what the workers' order gives): the first
    two added into a new tensor in one op, the rest added in place."""
    total = torch.add(tensors[0], tensors[1])
    for tensor in tensors[2:]:
        total.add_(tensor)
    return total


def _text_payload(message: Message) -> str:
    return _text_payloads(message, most=1)[0]


def _text_payloads(message: Message, most: int) -> list[str]:
    """The message's 1 to ``most`` payload frames as UTF-8 text."""
    if not 1 <= len(message.payloads) <= most:
        expected = "exactly one payload frame" if most == 1 else f"1 to {most} payload frames"
        raise RemoteError(f"{message.header.describe()} needs {expected}, got {len(message.payloads)}")
    try:
        return [bytes(payload).decode("utf-8") for payload in message.payloads]
    except UnicodeDecodeError:
        raise RemoteError(f"{message.header.describe()}: payload is not UTF-8 text") from None


def _json_payload(message: Message) -> dict[str, object]:
    try:
        value = json.loads(_text_payload(message))
    except json.JSONDecodeError as error:
        raise RemoteError(f"{message.header.describe()}: payload is not JSON ({error})") from None
    if not isinstance(value, dict):
        raise RemoteError(f"{message.header.describe()}: payload must be a JSON object")
    return value


def _nonce(value: object) -> bytes:
    """A hello's worker nonce (hex text in its JSON), checked."""
    try:
        nonce = bytes.fromhex(value) if isinstance(value, str) else b""
    except ValueError:
        nonce = b""
    if len(nonce) != NONCE_BYTES:
        raise RemoteError(f"hello without a valid nonce ({NONCE_BYTES} bytes as hex): an older or foreign client")
    return nonce


def hello_info(topology: Topology, options: DistOptions) -> dict[str, object]:
    """What a worker tells each server when it connects (checked against the server's own view)."""
    return {"kind": options.kind, "num_workers": topology.num_workers, "num_servers": topology.num_servers,
            "max_frame_bytes": options.max_frame_bytes, "pid": os.getpid(), "host": socket.gethostname()}  # fmt: skip
