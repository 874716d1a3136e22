"""P3's worker side: a priority send queue with a cap on pushes in flight, in front of the ``Client``.

Why a cap: once bytes are handed to the network they cannot be overtaken. With at most
``water_mark`` requests carrying tensor bytes sent but not yet known to have arrived, the backlog
stays in the priority queue, where the first layers' slices (produced last by backward, needed
first by forward) overtake the rest.

"Arrived", not "answered": in sync mode a server answers a pushpull only once every worker pushed
that round. If the cap counted unanswered pushpulls, two workers whose caps were full of requests
waiting for each other's pushes would deadlock. So a request may ask (``Header.receipt``) for a
small RECEIVED notice should the server have to park it, and its cap slot is released by that
notice or by the reply, whichever comes first. Pulls carry no tensor bytes and never count.

Requests of at most ``slice_size / SMALL_FRACTION`` elements (a norm's weight, a bias) do not count
either: they hold the wire for little, and a slot with its notice would cost more than it saves.
They never block the queue's head, so they add no wait to the argument above.

Notices cost a message each, so only requests sent while the cap binds ask for one: the request
that fills the cap, and any sent while others queue. Whenever the cap is full and no notice is
pending, one more request may go (asking for one): some slot is then always freed by arrival
alone, which is what rules the deadlock out, whatever the water mark did meanwhile (the tuner may
lower it below what is in flight). Where the cap never binds (a fast link, a high water mark), no
notices are sent at all.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from tandem import trace
from tandem.kvstore.errors import KVStoreError, KVStoreTimeout, PeerFailure
from tandem.kvstore.ps.client import Client, Submission, coalesced
from tandem.kvstore.ps.p3_queue import LanePriorityQueue
from tandem.kvstore.ps.protocol import Command, Header, Message
from tandem.kvstore.ps.transport import payload_size

QUEUED_COMMANDS = frozenset({Command.INIT, Command.PUSH, Command.PULL, Command.PUSHPULL})
MAX_GROUP = 64  # requests the sender thread takes from the queue at once, to coalesce
POLL_SECONDS = 0.2  # how often a waiting sender looks for a failed connection
SMALL_FRACTION = 16  # requests of at most slice_size / 16 elements pass the water mark (see small)


def small(numel: int, slice_size: int) -> bool:
    """Is a request of ``numel`` elements too small to count against the water mark? A norm's
    weight or a bias holds the wire for microseconds, and a slot of its own (with its RECEIVED
    notice) would cost more than it saves."""
    return numel * SMALL_FRACTION <= slice_size


@dataclass(eq=False)
class _Slot:
    """One capped request's place under the water mark; released once (by RECEIVED or the reply)."""

    lane: Hashable
    receipt: bool  # its request asked for a RECEIVED notice
    released: bool = field(default=False)


@dataclass
class _Request:
    server: int
    header: Header
    payloads: Sequence[Any]
    on_reply: Callable[[Message], None]
    on_error: Callable[[BaseException], None]
    queued_us: float
    capped: bool  # counts against the water mark (PrioritySender._counts)

    @property
    def lane(self) -> Hashable:
        """Requests of one lane keep their order: same server, key and slice."""
        return (self.server, self.header.key, self.header.slice_start)


class PrioritySender:
    """Stands in for a ``Client``: tensor requests are queued by priority, control requests pass straight.

    Thread safety: ``submit``, ``outstanding`` and ``water_mark`` may be used from any thread; one
    sender thread hands queued requests to the client (``submit`` sends itself when the queue is
    empty and the cap allows); replies are completed by the client's receiving thread (its IO thread
    or a thread waiting on a handle).
    """

    def __init__(self, client: Client, water_mark: int, slice_size: int, rank: int) -> None:
        if water_mark < 1:
            raise KVStoreError(f"water_mark must be >= 1 (TANDEM_PS_WATER_MARK), got {water_mark}")
        self._client, self._water_mark, self.slice_size = client, water_mark, slice_size
        self._queue: LanePriorityQueue[_Request] = LanePriorityQueue()
        self._cond = threading.Condition(threading.RLock())
        self._in_flight = 0  # capped requests sent and not yet known to have arrived
        self._receipts = 0  # of those, how many asked for a RECEIVED notice
        self.notices = 0  # RECEIVED notices received so far (each one message a fast link did without)
        self._awaiting: dict[Hashable, deque[_Slot]] = {}  # lane -> its unreleased slots, oldest first
        self._handing_over = 0  # popped, not yet registered by the client
        self._batching = 0  # open batched() blocks: requests wait in the queue until the last one ends
        self._stopping = False
        self._send_row, self._receive_row = f"p3 send (worker {rank})", f"p3 receive (worker {rank})"
        self._thread = threading.Thread(target=self._run, name=f"tandem-p3-sender-{rank}", daemon=True)
        self._thread.start()
        client.on_received = self._on_received

    @property
    def failure(self) -> PeerFailure | None:
        return self._client.failure

    @property
    def water_mark(self) -> int:
        return self._water_mark

    @water_mark.setter
    def water_mark(self, value: int) -> None:
        if value < 1:
            raise KVStoreError(f"water_mark must be >= 1, got {value}")
        with self._cond:
            self._water_mark = value
            self._cond.notify_all()

    def submit(self, server: int, header: Header, payloads: Sequence[Any], on_reply: Callable[[Message], None],
               on_error: Callable[[BaseException], None]) -> None:  # fmt: skip
        """Queue a tensor request by ``header.priority`` (control requests are sent at once); never blocks."""
        if header.command not in QUEUED_COMMANDS:
            self._client.submit(server, header, payloads, on_reply, on_error)
            return
        if self._client.failure is not None:
            raise self._client.failure
        request = _Request(server, header, payloads, on_reply, on_error, trace.now_us(), self._counts(header))
        with self._cond:
            if self._stopping:
                raise KVStoreError("this kvstore is closing; no new requests")
            if not self._queue and not self._handing_over and not self._batching and self._in_flight < self._water_mark:
                # nothing to overtake: send from this thread (saves a thread hand-off per slice);
                # holding the lock keeps every other send, and so every lane, behind this one
                self._send(request)
                return
            self._queue.put(request, header.priority, request.lane)
            if not self._batching:  # a block's end sends, then wakes the sender thread
                self._cond.notify_all()

    def submit_many(self, requests: Sequence[Submission]) -> None:
        """``submit`` each (one call's slices: one priority). What the cap lets go at once leaves now,
        the slices bound for one server coalesced (``Client.submit_many``); the rest is queued."""
        if self._client.failure is not None:
            raise self._client.failure
        if any(header.command not in QUEUED_COMMANDS for _, header, *_ in requests):
            for submission in requests:
                self.submit(*submission)
            return
        now = trace.now_us()
        queued = [_Request(server, header, payloads, on_reply, on_error, now, self._counts(header))
                  for server, header, payloads, on_reply, on_error in requests]  # fmt: skip
        with self._cond:
            if self._stopping:
                raise KVStoreError("this kvstore is closing; no new requests")
            going = 0
            if not self._queue and not self._handing_over and not self._batching:  # as many as the cap allows
                capped = self._in_flight
                while going < len(queued) and self._fits(queued[going], capped):
                    capped += queued[going].capped
                    going += 1
            for request in queued[going:]:
                self._queue.put(request, request.header.priority, request.lane)
            if going:  # under the lock, as submit's inline send: every lane stays behind it
                self._send_group(queued[:going])
            if going < len(queued) and not self._batching:
                self._cond.notify_all()

    @contextlib.contextmanager
    def batched(self) -> Iterator[None]:
        """Tensor requests submitted inside wait in the queue; when the (outermost) block ends, what
        the cap lets go leaves at once from this thread, by priority, coalesced per server (one
        message where they fit), and the sender thread takes the rest. Any thread may submit
        meanwhile. Nothing queued leaves while a block is open: waiting inside it on a request
        still queued (one made in it, or one the cap held back) waits for the block to end."""
        with self._cond:
            self._batching += 1
        try:
            yield
        finally:
            with self._cond:  # under the lock, as submit's inline send: every lane stays behind it
                self._batching -= 1
                if not self._batching and not self._handing_over:  # a group in hand-off goes first (lane order)
                    leaving, capped = [], self._in_flight
                    while self._queue and self._fits(self._queue.peek(), capped):
                        capped += self._queue.peek().capped
                        leaving.append(self._queue.pop())
                    if leaving:  # one group: each server's part in as few messages as fit (coalesced)
                        self._send_group(leaving)
                if self._queue:
                    self._cond.notify_all()

    def _counts(self, header: Header) -> bool:
        """Does a request count against the water mark? Only one carrying tensor bytes (not a pull)
        that is not ``small``."""
        return header.command is not Command.PULL and not small(header.slice_numel, self.slice_size)

    def _fits(self, request: _Request, capped: int) -> bool:
        """May ``request`` leave with ``capped`` capped requests already in flight?"""
        return not request.capped or capped < self._water_mark

    def call(self, server: int, header: Header, payloads: Sequence[Any], timeout: float) -> Message:
        return self._client.call(server, header, payloads, timeout)

    def drive(self, handle: Any, deadline: float) -> None:
        """``Client.drive``: replies (and so the releases of cap slots) are received by the waiter."""
        self._client.drive(handle, deadline)

    def wake_receiver(self) -> None:
        self._client.wake_receiver()

    def outstanding(self) -> int:
        """Requests queued here or awaiting a reply."""
        with self._cond:
            local = len(self._queue) + self._handing_over
        return local + self._client.outstanding()

    def _sendable(self) -> bool:
        if not self._queue or self._batching:
            return False
        # a full cap with no notice coming could wait on other workers forever: let one more go
        return self._fits(self._queue.peek(), self._in_flight) or not self._receipts

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._sendable():
                    if self._stopping and not self._queue:
                        return
                    if self._queue:  # held by the cap: the replies and notices freeing it must be received
                        self._client.wake_receiver()
                    self._cond.wait(POLL_SECONDS)
                    if self._client.failure is not None:
                        self._fail_queued(self._client.failure)
                group = self._pop_group()
                self._handing_over += len(group)
            try:
                if len(group) == 1:
                    self._send(group[0])
                else:
                    self._send_group(group)
            finally:
                with self._cond:
                    self._handing_over -= len(group)
            # sent late, maybe after a driver left nothing pending: its waiter may not drive
            self._client.wake_receiver()

    def _pop_group(self) -> list[_Request]:
        """Caller holds the lock, the queue is sendable: the next request, and after it those that would
        leave right behind it anyway (under the cap, within ``coalesce_bytes`` of payload in all), to be
        coalesced per server."""
        group = [self._queue.pop()]
        limit = self._client.coalesce_bytes
        if limit <= 0:
            return group
        capped, nbytes = self._in_flight + group[0].capped, _nbytes(group[0])
        while self._queue and len(group) < MAX_GROUP:
            following = self._queue.peek()
            size = _nbytes(following)
            if nbytes + size > limit or not self._fits(following, capped):
                break
            group.append(self._queue.pop())
            capped += following.capped
            nbytes += size
        return group

    def _send_group(self, requests: list[_Request]) -> None:
        """Send ``requests`` (in priority order), those bound for one server in one message where they fit."""
        if len(requests) == 1:
            self._send(requests[0])
            return
        start = trace.now_us()
        submissions: list[Submission] = []
        for request in requests:
            slot = self._hold(request) if request.capped else None
            header = _with_receipt(request.header) if slot is not None and slot.receipt else request.header
            sent = _Sent(self, request, slot)
            submissions.append((request.server, header, request.payloads, sent, sent.fail))
        for group in coalesced(submissions, self._client.coalesce_bytes):
            try:
                self._client.submit_batch(group)
            except (KVStoreTimeout, PeerFailure) as error:
                for submission in group:
                    submission[4](error)
        if trace.enabled():  # one event per request, as if each had been sent alone over the group's time
            end = trace.now_us()
            for request in requests:
                header = request.header
                trace.record(f"send {header.command.name.lower()} {header.key}[{self._slice(header)}]", start, end,
                             "comm", self._args(request, start), self._send_row)  # fmt: skip

    def _fail_queued(self, error: BaseException) -> None:
        """Caller holds the lock: every queued request fails with ``error``."""
        while self._queue:
            self._queue.pop().on_error(error)

    def _hold(self, request: _Request) -> _Slot:
        """Count ``request`` against the water mark until ``_release`` (registered before it is sent)."""
        with self._cond:
            self._in_flight += 1
            slot = _Slot(request.lane, receipt=self._in_flight >= self._water_mark or bool(self._queue))
            self._receipts += slot.receipt
            self._awaiting.setdefault(slot.lane, deque()).append(slot)
        return slot

    def _release(self, slot: _Slot) -> None:
        with self._cond:  # reentrant: a reply may fail inside an inline send
            if slot.released:
                return
            slot.released = True
            self._in_flight -= 1
            self._receipts -= slot.receipt
            waiting = self._awaiting[slot.lane]
            waiting.remove(slot)
            if not waiting:
                del self._awaiting[slot.lane]
            if self._queue:  # only a backlog waits for a slot: no wake-up of the sender thread otherwise
                self._cond.notify_all()

    def _on_received(self, server: int, header: Header) -> None:
        """Receiving thread: a server parked a request of this lane that asked for a notice: its slot is free again.

        Servers handle a lane in order and a notice precedes its reply, so it is the lane's oldest
        unreleased slot that asked for one.
        """
        with self._cond:
            self.notices += 1
            waiting = self._awaiting.get((server, header.key, header.slice_start), ())
            slot = next((slot for slot in waiting if slot.receipt), None)
            if slot is not None:
                self._release(slot)

    def _send(self, request: _Request) -> None:
        start = trace.now_us()
        header = request.header
        slot = self._hold(request) if request.capped else None
        if slot is not None and slot.receipt:
            header = _with_receipt(header)
        sent = _Sent(self, request, slot)
        try:
            self._client.submit(request.server, header, request.payloads, sent, sent.fail)
        except (KVStoreTimeout, PeerFailure) as error:
            sent.fail(error)
        if trace.enabled():
            trace.record(f"send {header.command.name.lower()} {header.key}[{self._slice(header)}]", start,
                         trace.now_us(), "comm", self._args(request, start), self._send_row)  # fmt: skip

    def _slice(self, header: Header) -> int:
        return header.slice_start // self.slice_size

    def _args(self, request: _Request, sent_us: float) -> dict[str, Any]:
        header = request.header
        return {"key": header.key, "slice": self._slice(header), "priority": header.priority,
                "server": request.server, "queued_us": round(sent_us - request.queued_us, 1)}  # fmt: skip

    def close(self, timeout: float) -> None:
        """Send what is queued (unless the job failed), stop the sender thread, then close the client."""
        deadline = time.monotonic() + timeout
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout=max(0.0, deadline - time.monotonic()))
        with self._cond:
            self._fail_queued(KVStoreError("the kvstore closed before this request was sent"))
        self._client.close(timeout=max(0.1, deadline - time.monotonic()))


class _Sent:
    """A sent request's reply and error callback in one object (no closures per request): frees its
    cap slot, records the receive event, then completes the request. ``landing`` is the request's
    own (where ``Client`` receives a pull's reply in place)."""

    __slots__ = ("sender", "request", "slot", "landing")

    def __init__(self, sender: PrioritySender, request: _Request, slot: _Slot | None) -> None:
        self.sender, self.request, self.slot = sender, request, slot
        self.landing = getattr(request.on_reply, "landing", None)

    def __call__(self, message: Message) -> None:
        if self.slot is not None:
            self.sender._release(self.slot)
        start = trace.now_us()
        self.request.on_reply(message)
        if trace.enabled():
            header, sender = self.request.header, self.sender
            trace.record(f"receive {header.key}[{sender._slice(header)}]", start, trace.now_us(), "comm",
                         sender._args(self.request, start), sender._receive_row)  # fmt: skip

    def fail(self, error: BaseException) -> None:
        if self.slot is not None:
            self.sender._release(self.slot)
        self.request.on_error(error)


def _with_receipt(header: Header) -> Header:
    """``header`` asking for a RECEIVED notice; made once per header (kept on it, like its packed frame)."""
    asking = header.__dict__.get("_with_receipt")
    if asking is None:
        asking = header.__dict__["_with_receipt"] = dataclasses.replace(header, receipt=True)
    return asking


def _nbytes(request: _Request) -> int:
    return payload_size(request.payloads) if request.payloads else 0
