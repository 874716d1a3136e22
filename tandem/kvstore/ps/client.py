"""A worker's connection to every server: direct data sends, one IO thread for replies and heartbeats.

Data requests (push, pull, ...) leave from the calling thread through ``submit``, the one place
every request passes (P3 puts its priority queue and its cap on messages in flight in front of
it): it registers the request, then sends on the server's connection (``transport``). The IO
thread says hello and goodbye, sends heartbeats, and completes requests as their replies arrive,
receiving a pull's payload straight into its output tensor — so requests make progress while the
application computes.

A thread that waits on a handle receives replies itself (``drive``): the IO thread hands it the
sockets and sleeps, and stays asleep after the driver leaves, so that the next driver need not
take the sockets back. Why: with the IO thread receiving, every awaited reply crossed two sleeping
threads (the IO thread woke, then woke the waiter): 8-18 % of a 4 KB push+pull's wall time, 3-30 %
at 1 MB (docs/distributed.md). The IO thread receives again as soon as anyone needs replies that
no driver will take (``wake_receiver``): a driver leaving requests pending, ``Handle.wait(drive=
False)``, a ``Handle.done()`` poll, a done callback, a waiter finding another thread driving, P3's
sender held by its cap or sending late, a blocking ``call``. As a backstop it looks every
``UNDRIVEN_SECONDS`` (50 ms) and takes over pending replies that no thread drives. (It used to
wake every 2 ms while a driver was active and take over 2 ms after the last one left: one
wake-up per two 1 MB push+pulls.) Only one thread
receives at any time (the hand-over is synchronous), so the transport's notification descriptor
and wake-up pipe are never polled from two threads.

Failure: a server silent for ``timeout`` seconds, or an ABORT from a server, fails every pending
request with ``PeerFailure`` naming the node; the worker then tells the other servers (ABORT) and,
unless ``exit_on_failure`` is off, exits the process after a short grace period even if the main
thread never waits again — so a dead peer never leaves a worker hanging.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, TypeVar

import zmq

from tandem.env import knob
from tandem.kvstore.config import DistOptions
from tandem.kvstore.errors import KVStoreError, KVStoreTimeout, PeerFailure, ProtocolError, RemoteError
from tandem.kvstore.ps.auth import new_nonce
from tandem.kvstore.ps.curve import CurveKeys
from tandem.kvstore.ps.protocol import MAX_BATCH_ENTRIES, Command, Header, Message, Role
from tandem.kvstore.ps.topology import ServerAddress
from tandem.kvstore.ps.transport import Incoming, WorkerTransport, payload_size

log = logging.getLogger("tandem.kvstore.worker")
# a request to send: (server, header, payloads, on_reply, on_error), as ``Client.submit`` takes them
Submission = tuple[int, Header, Sequence[Any], Callable[[Message], None], Callable[[BaseException], None]]
T = TypeVar("T")
EXIT_GRACE_SECONDS = 3.0  # time the main thread gets to raise the failure itself before a hard exit
UNDRIVEN_SECONDS = 0.05  # the sleeping IO thread takes over replies nobody drove for this long (a backstop)


@dataclass
class _Request:
    server: int
    on_reply: Callable[[Message], None]
    on_error: Callable[[BaseException], None]
    landing: memoryview | None = None  # where the reply's payload may be received in place
    payloads: Sequence[Any] = ()  # sent from their own memory: kept alive until the reply proves them sent


class _Rendezvous:
    """Replies to one control command (hello, goodbye) from every server, awaited by a caller thread."""

    def __init__(self, servers: int) -> None:
        self.remaining = servers
        self.error: BaseException | None = None
        self.done = threading.Event()

    def reply(self, message: Message | None) -> None:
        self.remaining -= 1
        if self.remaining == 0:
            self.done.set()

    def fail(self, error: BaseException) -> None:
        self.error = self.error or error
        self.done.set()


class Client:
    """Thread safety: every public method may be called from any thread; callbacks run in the receiving
    thread (the IO thread, or a thread in ``drive``) and must not block."""

    def __init__(
        self, addresses: list[ServerAddress], rank: int, options: DistOptions, hello: dict[str, object]
    ) -> None:
        self.addresses, self.rank, self.options = addresses, rank, options
        self.transport = WorkerTransport(options.secret_bytes, [address.endpoint for address in addresses],
                                         options.timeout, options.max_frame_bytes, CurveKeys.from_env("worker"))  # fmt: skip
        self._pending: dict[int, _Request] = {}
        self._lock = threading.Lock()  # guards _pending and _failure
        self._ids = itertools.count(1)
        self._unanswered: list[Sequence[Any]] = []  # payloads of requests failed unanswered: alive until close
        self._failure: PeerFailure | None = None
        self._last_heard = [time.monotonic()] * len(addresses)
        self._nonce = new_nonce()  # the server's signed answer must echo it: an old answer cannot complete this hello
        self._hello_payload = [memoryview(json.dumps({**hello, "nonce": self._nonce.hex()}).encode())]
        self._hello = _Rendezvous(len(addresses))
        self._goodbye = _Rendezvous(len(addresses))
        self._closing = threading.Event()
        self.on_received: Callable[[int, Header], None] | None = None  # P3: (server, header) of a parked request
        self._abort_reason = ""  # set by abort(): send ABORT, not goodbye
        self.landed = 0  # replies received straight into their output tensor (receivers count; for tests)
        self._driving = threading.Lock()  # held by the waiting thread that receives (the driver)
        self._driver_ident: int | None = None
        self._receiver = threading.Condition()  # guards the three below; the hand-over's meeting point
        self._driver_active = False
        self._io_receiving = True  # the IO thread polls the sockets (else it sleeps on _receiver)
        self._left_to_drivers = False  # a driver took the sockets: the IO thread sleeps until wake_receiver
        self.driven = 0  # replies received by waiting threads rather than the IO thread (for tests)
        self.coalesce_bytes = knob("TANDEM_PS_COALESCE_BYTES")  # see submit_many
        self._thread = threading.Thread(target=self._run, name=f"tandem-kvstore-worker-{rank}", daemon=True)
        self._thread.start()

    @property
    def failure(self) -> PeerFailure | None:
        return self._failure

    def connect(self) -> None:
        """Block until every server accepted our hello (or raise, naming the problem)."""
        if not self._hello.done.wait(self.options.rendezvous_timeout):
            secured = " with the same TANDEM_PS_SECRET" if self.options.secret else ""
            raise KVStoreTimeout(
                f"worker {self.rank}: no answer to hello from {self._hello.remaining} server(s) within "
                f"{self.options.rendezvous_timeout:.0f} s; are the servers of this job running{secured} (and, with "
                f"CURVE, the same keys)? The servers' logs name what they rejected"
            )
        if self._hello.error is not None:
            raise self._hello.error

    def _register(self, request: _Request) -> int:
        with self._lock:
            if self._failure is not None:
                raise self._failure
            request_id = next(self._ids)
            self._pending[request_id] = request
        return request_id

    def submit(self, server: int, header: Header, payloads: Sequence[Any], on_reply: Callable[[Message], None],
               on_error: Callable[[BaseException], None]) -> None:  # fmt: skip
        """Send a request to ``server`` now; ``on_reply``/``on_error`` run later in the receiving thread.

        An ``on_reply`` with a ``landing`` attribute (writable bytes) gets the reply's payload
        received there in place when the size matches, and then sees ``message.landed``. Blocks
        only if the server stops reading (then raises after ``timeout`` seconds).
        """
        request_id = self._register(_Request(server, on_reply, on_error, getattr(on_reply, "landing", None), payloads))
        if header.sender_rank != self.rank or header.sender_role is not Role.WORKER:
            header = replace(header, sender_role=Role.WORKER, sender_rank=self.rank)
        try:
            self.transport.send(server, header, payloads, request_id)
        except zmq.Again:
            with self._lock:
                self._pending.pop(request_id, None)
            raise KVStoreTimeout(f"server {server} ({self.addresses[server]}) accepted no data for "
                                 f"{self.options.timeout:.1f} s") from None  # fmt: skip

    def submit_many(self, requests: Sequence[Submission]) -> None:
        """``submit`` each data request, those bound for one server coalesced into BATCH messages
        (``coalesced``: at most ``coalesce_bytes`` of payload each); the server treats a batch's
        requests as if they came one by one, in order. Raises as ``submit`` (a batch that was not
        sent is forgotten, as a request is; batches sent before it stay pending)."""
        for group in coalesced(requests, self.coalesce_bytes):
            self.submit_batch(group)

    def submit_batch(self, group: Sequence[Submission]) -> None:
        """Requests to one server (``group``, as ``coalesced`` makes them) in one message."""
        if len(group) == 1:
            self.submit(*group[0])
            return
        server = group[0][0]
        entries = []
        with self._lock:
            if self._failure is not None:
                raise self._failure
            for _, header, payloads, on_reply, on_error in group:
                request_id = next(self._ids)
                self._pending[request_id] = _Request(server, on_reply, on_error, getattr(on_reply, "landing", None),
                                                     payloads)  # fmt: skip
                if header.sender_rank != self.rank or header.sender_role is not Role.WORKER:
                    header = replace(header, sender_role=Role.WORKER, sender_rank=self.rank)
                entries.append((header, payloads, request_id))
        try:
            self.transport.send_batch(server, self.rank, entries)
        except zmq.Again:
            with self._lock:
                for _, _, request_id in entries:
                    self._pending.pop(request_id, None)
            raise KVStoreTimeout(f"server {server} ({self.addresses[server]}) accepted no data for "
                                 f"{self.options.timeout:.1f} s") from None  # fmt: skip

    def _landing(self, server: int, header: Header) -> memoryview | None:
        with self._lock:
            request = self._pending.get(header.request_id)
        return (
            request.landing if request is not None and request.server == server and header.response else None
        )

    def outstanding(self) -> int:
        with self._lock:
            return len(self._pending)

    def call(self, server: int, header: Header, payloads: Sequence[Any], timeout: float) -> Message:
        """Send one request and block for its reply (raises its error, or a timeout naming the server)."""
        done = threading.Event()
        result: dict[str, Any] = {}

        def finish(name: str, value: Any) -> None:
            result[name] = value
            done.set()

        self.submit(server, header, payloads, lambda message: finish("message", message),
                    lambda error: finish("error", error))  # fmt: skip
        self.wake_receiver()  # this thread waits without driving
        if not done.wait(timeout):
            raise KVStoreTimeout(f"server {server} ({self.addresses[server]}) did not answer {header.describe()} "
                                 f"within {timeout:.1f} s")  # fmt: skip
        if "error" in result:
            raise result["error"]
        return result["message"]

    def drive(self, handle: Any, deadline: float) -> None:
        """Receive replies on the calling thread until ``handle.done()``, ``deadline`` or a failure.

        Returns at once where another thread receives (its completions wake this one through the
        handle) or once the client is closing. Thread safe; raises where a reply callback waits
        (it runs on the receiving thread, which would wait for itself).
        """
        ident = threading.get_ident()
        if ident == self._thread.ident or ident == self._driver_ident:
            raise KVStoreError("a kvstore handle was waited on inside a reply or done callback; callbacks run on "
                               "the thread receiving replies and must not block: wait after they return")  # fmt: skip
        if self._closing.is_set():
            return
        if not self._driving.acquire(blocking=False):  # another thread drives; it may leave before our reply
            self.wake_receiver()
            return
        self._driver_ident = ident
        try:
            if self._take_receiving(deadline):
                self._receive_until(handle, deadline)
        finally:
            self._driver_ident = None
            self._hand_back()
            self._driving.release()

    def _hand_back(self) -> None:
        """Driver, done: the IO thread receives again at once if requests are still pending (their
        replies may have no waiter, and P3's cap waits on them); else it sleeps on (``wake_receiver``)."""
        with self._receiver:  # pending read under the lock: a wake_receiver racing this one is never lost
            self._driver_active = False
            if self._pending or self._io_receiving:  # (receiving still: the take-over timed out)
                self._left_to_drivers = False
            if self._pending:
                self._receiver.notify_all()

    def wake_receiver(self) -> None:
        """Make sure replies are received while nobody drives: for a thread about to wait on replies
        without driving. Thread safe; costs one attribute read when the IO thread is receiving."""
        if self._io_receiving or self._driver_active:  # an active driver hands back pending work
            return
        with self._receiver:
            if self._left_to_drivers and not self._driver_active:
                self._left_to_drivers = False
                self._receiver.notify_all()

    def _receive_until(self, handle: Any, deadline: float) -> None:
        while not handle.done() and self._failure is None and time.monotonic() < deadline:
            try:
                self.driven += self._receive(min(deadline - time.monotonic(), self.options.heartbeat))
            except PeerFailure as failure:  # an ABORT from a server
                self._fail(failure)

    def _receive(self, timeout: float) -> int:
        """The receiving thread: complete what arrives within ``timeout`` seconds; how many messages."""
        received = self.transport.poll(timeout, self._landing)
        for incoming in received:
            self._complete(incoming)
        return len(received)

    def _take_receiving(self, deadline: float) -> bool:
        """Driver: stop the IO thread receiving (wake it, wait until it sleeps); False if it did not."""
        with self._receiver:
            self._driver_active = self._left_to_drivers = True
            if self._io_receiving:
                self.transport.wake()
                self._receiver.wait_for(lambda: not self._io_receiving, max(0.0, deadline - time.monotonic()))
            return not self._io_receiving

    def _io_yields(self, connected: bool, wait: float) -> bool:
        """IO thread: leave receiving to drivers (one is active, or one was and nobody asked for the IO
        thread since)? If so, say so to a driver waiting for it, and sleep until woken or for ``wait``."""
        with self._receiver:
            closing = self._closing.is_set()  # goodbyes need a receiver: a driver's, or else this thread
            self._io_receiving = not (connected and (self._driver_active or (self._left_to_drivers and not closing)))
            if not self._io_receiving:
                self._receiver.notify_all()
                woken = self._receiver.wait(min(wait, UNDRIVEN_SECONDS))  # in the same hold: no notice is lost
                if not woken and not self._driver_active and self._pending:
                    self._left_to_drivers = False  # replies nobody drove for a while: a missed wake-up
            return not self._io_receiving

    def _take_back(self) -> bool:
        """IO thread, at a heartbeat: receive again unless a driver is active (so silence is judged
        on what has arrived); True if it now receives."""
        with self._receiver:
            if self._driver_active:
                return False
            self._left_to_drivers, self._io_receiving = False, True
            return True

    def _wake_io(self) -> None:
        """Wake the IO thread, receiving (from the transport's poll) or not (from ``_receiver``)."""
        self.transport.wake()
        with self._receiver:
            self._receiver.notify_all()

    def _complete(self, incoming: Incoming) -> None:
        """Hand a received reply to its request (the receiving thread: the IO thread or a driver)."""
        server, message = incoming.peer, incoming.message
        if message is None:
            log.warning("worker %d rejected a message from server %d: %s", self.rank, server, incoming.error)
            return
        self._last_heard[server] = time.monotonic()
        header = message.header
        if header.command is Command.ABORT:
            raise PeerFailure(f"the job was stopped: {message_text(message, 'no reason given')}")
        if header.command is Command.RECEIVED:
            if self.on_received is not None:
                self.on_received(server, header)
            return
        if header.command is Command.HEARTBEAT or not header.response:
            return
        with self._lock:
            request = self._pending.pop(header.request_id, None)
        if request is None:
            log.warning(
                "worker %d: response %d from server %d matches no request",
                self.rank,
                header.request_id,
                server,
            )
            return
        if header.error:
            request.on_error(RemoteError(f"server {server}: {message_text(message, 'unknown error')}"))
            return
        self.landed += message.landed
        try:
            request.on_reply(message)
        except BaseException as error:  # noqa: BLE001 - a bad reply fails its own request only
            request.on_error(error)

    def _run(self) -> None:
        try:
            self._send_to_all(Command.HELLO, self._hello, self._hello_payload)
            self._control_loop()
        except PeerFailure as failure:
            self._fail(failure)
        except Exception as error:  # a bug here must not leave the main thread waiting forever
            log.exception("worker %d: kvstore IO thread crashed", self.rank)
            self._fail(PeerFailure(f"worker {self.rank}: kvstore IO thread crashed: {error!r}"))
        finally:
            with self._receiver:  # a driver must not wait for this thread to hand over any more
                self._io_receiving = False
                self._receiver.notify_all()

    def _control_loop(self) -> None:
        next_heartbeat = time.monotonic()
        saying_goodbye = False
        while not self._goodbye.done.is_set():
            connected = self._hello.done.is_set() and self._hello.error is None
            wait = max(0.0, next_heartbeat - time.monotonic()) if connected else self.options.heartbeat
            if not self._io_yields(connected, wait):  # else a waiting thread received meanwhile
                self._receive(wait)
            if self._closing.is_set() and not saying_goodbye:
                saying_goodbye = True
                if self._abort_reason:  # dying of an exception: tell the job instead of leaving quietly
                    self._abort_servers(self._abort_reason)
                    self._goodbye.fail(PeerFailure(self._abort_reason))
                else:
                    self._send_to_all(Command.BYE, self._goodbye, [])
            if connected and time.monotonic() >= next_heartbeat:
                if not self._io_receiving and self._take_back():
                    self._receive(0)  # what arrived while drivers had the sockets
                self._heartbeat()
                next_heartbeat = time.monotonic() + self.options.heartbeat

    def _hello_answered(self, server: int, message: Message) -> None:
        """A server accepted our hello: with a secret, everything after it travels under a session of
        both nonces (the answer is signed with the secret and must echo our nonce)."""
        if self.options.secret:
            try:
                answer = json.loads(message_text(message))
                if answer.get("worker_nonce") != self._nonce.hex():
                    raise ProtocolError("the answer to hello echoes another nonce (a replayed answer)")
                self.transport.open_session(server, self._nonce, bytes.fromhex(answer["nonce"]), self.rank)
            except (ValueError, KeyError, TypeError, AttributeError, ProtocolError) as error:
                self._hello.fail(KVStoreError(f"server {server} ({self.addresses[server]}) answered hello "
                                              f"wrongly: {error}"))  # fmt: skip
                return
        self._hello.reply(message)

    def _send_to_all(self, command: Command, rendezvous: _Rendezvous, payloads: list[memoryview]) -> None:
        for server in range(len(self.addresses)):
            if command is not Command.HELLO and self.options.secret and self.transport.sessions[server] is None:
                rendezvous.reply(None)  # never connected (its hello failed): nothing to say, nothing it could check
                continue
            on_reply = partial(self._hello_answered, server) if command is Command.HELLO else rendezvous.reply
            request_id = self._register(_Request(server, on_reply, rendezvous.fail))
            self.transport.send(server, Header(command, request_id, Role.WORKER, self.rank), payloads)

    def _heartbeat(self) -> None:
        now = time.monotonic()
        for server, heard in enumerate(self._last_heard):
            if now - heard > self.options.timeout:
                raise PeerFailure(
                    f"server {server} ({self.addresses[server]}) stopped answering: no heartbeat for "
                    f"{self.options.timeout:.1f} s"
                )
            try:  # never wait here: this thread drains the replies; any message proves liveness anyway
                self.transport.send(server, Header(Command.HEARTBEAT, 0, Role.WORKER, self.rank), wait=False)
            except zmq.Again:
                pass

    def _fail(self, failure: PeerFailure) -> None:
        with self._lock:
            if self._failure is not None:
                return
            self._failure = failure
            pending, self._pending = self._pending, {}
            self._unanswered.extend(request.payloads for request in pending.values())  # maybe still queued to send
        log.error("worker %d: %s", self.rank, failure)
        for request in pending.values():
            request.on_error(failure)
        for rendezvous in (self._hello, self._goodbye):
            rendezvous.fail(failure)
        self._abort_servers(str(failure))
        if self.options.exit_on_failure and not self._closing.is_set():
            threading.Thread(target=self._exit_later, args=(str(failure),), daemon=True).start()

    def _abort_servers(self, reason: str) -> None:
        """Best effort: tell every server so that the other workers learn of the failure too."""
        payload = [memoryview(f"worker {self.rank}: {reason}".encode())]
        for server in range(len(self.addresses)):
            try:
                self.transport.send(server, Header(Command.ABORT, 0, Role.WORKER, self.rank), payload)
            except Exception:  # noqa: BLE001 - the socket may be gone already
                pass

    def _exit_later(self, reason: str) -> None:
        time.sleep(EXIT_GRACE_SECONDS)
        print(f"tandem kvstore, worker {self.rank}: {reason}; exiting", file=sys.stderr, flush=True)
        os._exit(1)

    def abort(self, reason: str, timeout: float) -> None:
        """Close, telling every server to stop the job (ABORT naming ``reason``) instead of saying goodbye."""
        self._abort_reason = reason
        self.close(timeout)

    def close(self, timeout: float) -> None:
        """Wait for outstanding requests, say goodbye to every server (unless the job failed), stop the IO thread."""
        deadline = time.monotonic() + timeout
        self.wake_receiver()  # the outstanding replies are received while this thread polls for them
        while (
            self.outstanding()
            and self._failure is None
            and not self._abort_reason
            and time.monotonic() < deadline
        ):
            time.sleep(0.002)
        self._closing.set()
        self._wake_io()
        if not self._goodbye.done.wait(max(0.0, deadline - time.monotonic())) and self._failure is None:
            log.warning("worker %d: %d server(s) did not answer goodbye within %.1f s", self.rank,
                        self._goodbye.remaining, timeout)  # fmt: skip
        self._goodbye.done.set()  # stops the IO loop in every case
        self._wake_io()
        self._thread.join(timeout=timeout)
        self.transport.close()
        self._unanswered.clear()  # ZeroMQ has dropped what it still held: the memory may go now


def message_text(message: Message, default: str = "") -> str:
    """A message's first payload as text (``default`` when it has none)."""
    return bytes(message.payloads[0]).decode("utf-8", "replace") if message.payloads else default


def coalesced(requests: Sequence[Submission], limit: int) -> list[list[Submission]]:
    """``requests`` grouped by server into messages (``grouped``), by the bytes of their payloads."""
    return grouped(requests, limit, lambda request: request[0],
                   lambda request: payload_size(request[2]) if request[2] else 0)


def grouped(items: Sequence[T], limit: int, server_of: Callable[[T], int], size_of: Callable[[T], float]) -> list[list[T]]:
    """``items`` grouped by server, each server's in their order, a group holding at most ``limit``
    bytes and ``MAX_BATCH_ENTRIES`` items (a bigger item goes alone; ``limit`` 0: all alone). The
    planner's simulator groups its requests with it too.

    Groups come in the order of their first request: no request leaves later than it would alone
    by more than the sending of the groups before it, which are what it was queued behind anyway.
    """
    if limit <= 0 or len(items) == 1:
        return [[item] for item in items]
    groups: list[list[T]] = []
    open_groups: dict[int, tuple[list[T], list[float]]] = {}  # server -> (its open group, [bytes])
    for item in items:
        nbytes, server = size_of(item), server_of(item)
        found = open_groups.get(server)
        if found is None or found[1][0] + nbytes > limit or len(found[0]) == MAX_BATCH_ENTRIES:
            found = open_groups[server] = ([], [0])
            groups.append(found[0])
        found[0].append(item)
        found[1][0] += nbytes
    return groups
