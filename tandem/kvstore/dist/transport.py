"""ZeroMQ behind one small interface: the only kvstore module that touches sockets.

A server owns one ROUTER socket; a worker owns one DEALER socket per server. Tensor payloads of at
least ``ZERO_COPY_BYTES`` go out with ``copy=False`` (ZeroMQ reads the tensor's memory directly) and
come in as frames viewed by ``torch.frombuffer``; smaller ones are copied, which is cheaper than
ZeroMQ's zero-copy bookkeeping at that size. Every received message is decoded and validated here,
so callers only ever see well-formed ``Message`` objects or a ``ProtocolError``.

Thread safety: a transport's sockets belong to the one thread that calls ``poll``/``send``; only
``WorkerTransport.wake`` may be called from other threads.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import zmq

from tandem.kvstore.dist.protocol import Header, Message, decode, encode_header, payload_size
from tandem.kvstore.errors import ProtocolError

ZERO_COPY_BYTES = 64 * 1024
MAX_BATCH = 256  # messages drained per poll, so heartbeats and sends are never starved


@dataclass(frozen=True)
class Incoming:
    """One received message, or the reason it was rejected; ``peer`` says who sent it."""

    peer: Any  # ROUTER routing id (bytes) on a server, server index (int) on a worker
    message: Message | None
    error: ProtocolError | None = None


class _Endpoint:
    def __init__(self, secret: bytes) -> None:
        self.secret = secret
        self.context = zmq.Context()

    def _send(self, socket: zmq.Socket, prefix: list[bytes], header: Header, payloads: Sequence[Any],
              track: bool) -> zmq.MessageTracker | None:  # fmt: skip
        """Send ``prefix + [header] + payloads``; returns a tracker for a zero-copy payload if asked."""
        sized = replace(header, payload_count=len(payloads), payload_nbytes=payload_size(payloads))
        frames: list[Any] = [*prefix, encode_header(sized, self.secret), *payloads]
        control = len(prefix) + 1
        tracker = None
        for index, frame in enumerate(frames):
            flags = zmq.SNDMORE if index < len(frames) - 1 else 0
            if index < control:
                socket.send(frame, flags)
                continue
            big = memoryview(frame).nbytes >= ZERO_COPY_BYTES
            result = socket.send(frame, flags, copy=not big, track=track and big)
            tracker = result if isinstance(result, zmq.MessageTracker) else tracker
        return tracker

    def _decode(self, peer: Any, frames: list[Any]) -> Incoming:
        try:
            return Incoming(peer, decode(frames, self.secret))
        except ProtocolError as error:
            return Incoming(peer, None, error)

    def close(self) -> None:
        self.context.destroy(linger=500)  # give queued goodbyes half a second to leave


class ServerTransport(_Endpoint):
    """A ROUTER socket bound to ``bind_addr`` on an ephemeral port."""

    def __init__(self, secret: bytes, bind_addr: str) -> None:
        super().__init__(secret)
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 500)
        self.port = self.socket.bind_to_random_port(f"tcp://{bind_addr}")

    def send(self, peer: bytes, header: Header, payloads: Sequence[Any] = (), track: bool = False) -> Any:
        """Send to the worker whose routing id is ``peer``; returns a tracker for big tracked payloads."""
        return self._send(self.socket, [peer], header, payloads, track)

    def poll(self, timeout: float) -> list[Incoming]:
        """Messages that arrive within ``timeout`` seconds (at most ``MAX_BATCH``)."""
        received: list[Incoming] = []
        if not self.socket.poll(int(timeout * 1000)):
            return received
        while len(received) < MAX_BATCH:
            try:
                frames = self.socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            received.append(self._decode(frames[0].bytes, frames[1:]))
        return received


class WorkerTransport(_Endpoint):
    """One DEALER socket per server, plus an in-process wake-up socket for other threads."""

    def __init__(self, secret: bytes, endpoints: list[str], identity: bytes) -> None:
        super().__init__(secret)
        self.endpoints = endpoints
        self.sockets: list[zmq.Socket] = []
        for endpoint in endpoints:
            dealer = self.context.socket(zmq.DEALER)
            dealer.setsockopt(zmq.IDENTITY, identity)
            dealer.setsockopt(zmq.LINGER, 500)
            dealer.connect(endpoint)
            self.sockets.append(dealer)
        wake_address = f"inproc://wake-{id(self)}"
        self._wake_in = self.context.socket(zmq.PULL)
        self._wake_in.bind(wake_address)
        self._wake_out = self.context.socket(zmq.PUSH)
        self._wake_out.connect(wake_address)
        self._wake_lock = threading.Lock()
        self._poller = zmq.Poller()
        for dealer in [self._wake_in, *self.sockets]:
            self._poller.register(dealer, zmq.POLLIN)

    def wake(self) -> None:
        """Interrupt a ``poll`` in the IO thread (new messages to send). Thread safe."""
        with self._wake_lock:
            self._wake_out.send(b"", zmq.NOBLOCK)

    def send(self, server: int, header: Header, payloads: Sequence[Any] = ()) -> None:
        self._send(self.sockets[server], [], header, payloads, track=False)

    def poll(self, timeout: float) -> list[Incoming]:
        received: list[Incoming] = []
        ready = dict(self._poller.poll(int(max(timeout, 0) * 1000)))
        if self._wake_in in ready:
            while self._drain_one(self._wake_in):
                pass
        for server, dealer in enumerate(self.sockets):
            while dealer in ready and len(received) < MAX_BATCH:
                try:
                    frames = dealer.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                received.append(self._decode(server, frames))
        return received

    @staticmethod
    def _drain_one(socket: zmq.Socket) -> bool:
        try:
            socket.recv(zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False
