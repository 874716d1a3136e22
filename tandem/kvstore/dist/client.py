"""A worker's connection to every server: one IO thread owns the sockets, sends, receives, heartbeats.

All outgoing messages go through ``submit`` into one priority queue (highest priority first, FIFO
within a priority) that the IO thread drains: this is the one place where P3 adds its cap on
messages in flight. Responses are matched to requests by id and completed from the IO thread.

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
import queue
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from tandem.kvstore.dist.protocol import Command, Header, Message, Role
from tandem.kvstore.dist.topology import DistOptions
from tandem.kvstore.dist.transport import Incoming, WorkerTransport
from tandem.kvstore.errors import KVStoreError, PeerFailure, RemoteError

log = logging.getLogger("tandem.kvstore.worker")
EXIT_GRACE_SECONDS = 3.0  # time the main thread gets to raise the failure itself before a hard exit


@dataclass
class _Request:
    server: int
    on_reply: Callable[[Message], None]
    on_error: Callable[[BaseException], None]


@dataclass(order=True)
class _Outgoing:
    sort_key: tuple[int, int]  # (-priority, sequence): highest priority first, then FIFO
    server: int = field(compare=False)
    header: Header = field(compare=False)
    payloads: Sequence[Any] = field(compare=False)


class Client:
    """Thread safety: ``submit``, ``failure`` and ``close`` may be called from any thread."""

    def __init__(self, endpoints: list[str], rank: int, options: DistOptions) -> None:
        self.endpoints, self.rank, self.options = endpoints, rank, options
        self.transport = WorkerTransport(options.secret_bytes, endpoints, identity=f"worker-{rank}".encode())
        self._outbox: queue.PriorityQueue[_Outgoing] = queue.PriorityQueue()
        self._pending: dict[int, _Request] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._sequence = itertools.count()
        self._stop = threading.Event()
        self._connected = threading.Event()  # heartbeats start once every server accepted our hello
        self._failure: PeerFailure | None = None
        self._last_heard = [time.monotonic()] * len(endpoints)
        self._thread = threading.Thread(target=self._run, name=f"tandem-kvstore-worker-{rank}", daemon=True)
        self._thread.start()

    @property
    def failure(self) -> PeerFailure | None:
        return self._failure

    def submit(self, server: int, header: Header, payloads: Sequence[Any], on_reply: Callable[[Message], None],
               on_error: Callable[[BaseException], None]) -> None:  # fmt: skip
        """Queue a request to ``server``; ``on_reply``/``on_error`` run later in the IO thread. Never blocks."""
        with self._lock:
            if self._failure is not None:
                raise self._failure
            request_id = next(self._ids)
            self._pending[request_id] = _Request(server, on_reply, on_error)
        header = replace(header, request_id=request_id, sender_role=Role.WORKER, sender_rank=self.rank)
        self._outbox.put(_Outgoing((-header.priority, next(self._sequence)), server, header, payloads))
        self.transport.wake()

    def outstanding(self) -> int:
        with self._lock:
            return len(self._pending)

    def _run(self) -> None:
        next_heartbeat = time.monotonic()
        try:
            while not self._stop.is_set():
                connected = self._connected.is_set()
                wait = max(0.0, next_heartbeat - time.monotonic()) if connected else self.options.heartbeat
                for incoming in self.transport.poll(wait):
                    self._receive(incoming)
                self._send_queued()
                if connected and time.monotonic() >= next_heartbeat:
                    self._heartbeat()
                    next_heartbeat = time.monotonic() + self.options.heartbeat
        except PeerFailure as failure:
            self._fail(failure)
        except Exception as error:  # a bug here must not leave the main thread waiting forever
            log.exception("worker %d: kvstore IO thread crashed", self.rank)
            self._fail(PeerFailure(f"worker {self.rank}: kvstore IO thread crashed: {error!r}"))

    def _send_queued(self) -> None:
        while True:
            try:
                outgoing = self._outbox.get_nowait()
            except queue.Empty:
                return
            self.transport.send(outgoing.server, outgoing.header, outgoing.payloads)

    def _heartbeat(self) -> None:
        now = time.monotonic()
        for server, heard in enumerate(self._last_heard):
            if now - heard > self.options.timeout:
                raise PeerFailure(
                    f"server {server} ({self.endpoints[server]}) stopped answering: no heartbeat for "
                    f"{self.options.timeout:.1f} s"
                )
            self.transport.send(server, Header(Command.HEARTBEAT, 0, Role.WORKER, self.rank))

    def _receive(self, incoming: Incoming) -> None:
        server, message = incoming.peer, incoming.message
        if message is None:
            log.warning("worker %d rejected a message from server %d: %s", self.rank, server, incoming.error)
            return
        self._last_heard[server] = time.monotonic()
        header = message.header
        if header.command is Command.ABORT:
            reason = bytes(message.payloads[0]).decode("utf-8", "replace") if message.payloads else "aborted"
            raise PeerFailure(f"the job was stopped: {reason}")
        if header.command is Command.HEARTBEAT or not header.response:
            return
        with self._lock:
            request = self._pending.pop(header.request_id, None)
        if request is None:
            log.warning("worker %d: response %d from server %d matches no request", self.rank, header.request_id, server)
            return
        if header.error:
            text = bytes(message.payloads[0]).decode("utf-8", "replace") if message.payloads else "unknown error"
            request.on_error(RemoteError(f"server {server}: {text}"))
            return
        try:
            request.on_reply(message)
        except BaseException as error:  # noqa: BLE001 - a bad reply fails its own request only
            request.on_error(error)

    def _fail(self, failure: PeerFailure) -> None:
        with self._lock:
            if self._failure is not None:
                return
            self._failure = failure
            pending, self._pending = self._pending, {}
        log.error("worker %d: %s", self.rank, failure)
        for request in pending.values():
            request.on_error(failure)
        self._abort_servers(str(failure))
        if self.options.exit_on_failure:
            threading.Thread(target=self._exit_later, args=(str(failure),), daemon=True).start()

    def _abort_servers(self, reason: str) -> None:
        """Best effort: tell every server so that the other workers learn of the failure too."""
        payload = [memoryview(f"worker {self.rank}: {reason}".encode())]
        for server in range(len(self.endpoints)):
            try:
                self.transport.send(server, Header(Command.ABORT, 0, Role.WORKER, self.rank), payload)
            except Exception:  # noqa: BLE001 - the socket may be gone already
                pass

    def _exit_later(self, reason: str) -> None:
        time.sleep(EXIT_GRACE_SECONDS)
        print(f"tandem kvstore, worker {self.rank}: {reason}; exiting", file=sys.stderr, flush=True)
        os._exit(1)

    def call(self, server: int, header: Header, payloads: Sequence[Any], timeout: float) -> Message:
        """Send one request and block for its reply (raises its error, or a timeout naming the server)."""
        done = threading.Event()
        result: dict[str, Any] = {}

        def finish(name: str, value: Any) -> None:
            result[name] = value
            done.set()

        self.submit(server, header, payloads, lambda message: finish("message", message),
                    lambda error: finish("error", error))  # fmt: skip
        if not done.wait(timeout):
            raise KVStoreError(f"server {server} ({self.endpoints[server]}) did not answer {header.describe()} "
                               f"within {timeout:.1f} s")  # fmt: skip
        if "error" in result:
            raise result["error"]
        return result["message"]

    def hello(self, info: dict[str, object]) -> None:
        payload = [memoryview(json.dumps(info).encode())]
        for server in range(len(self.endpoints)):
            self.call(server, Header(Command.HELLO, 0, Role.WORKER, self.rank), payload, self.options.rendezvous_timeout)
        self._last_heard = [time.monotonic()] * len(self.endpoints)
        self._connected.set()
        self.transport.wake()

    def close(self, goodbye_timeout: float) -> None:
        """Say goodbye to every server (unless the job failed), then stop the IO thread and close sockets."""
        if self._failure is None and self._thread.is_alive():
            for server in range(len(self.endpoints)):
                try:
                    self.call(server, Header(Command.BYE, 0, Role.WORKER, self.rank), [], goodbye_timeout)
                except KVStoreError as error:
                    log.warning("worker %d: goodbye to server %d failed: %s", self.rank, server, error)
        self._stop.set()
        self.transport.wake()
        self._thread.join(timeout=goodbye_timeout)
        self.transport.close()
