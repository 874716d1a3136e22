"""ZeroMQ behind one small interface: the only kvstore module that touches sockets.

Every server binds a ROUTER (control: hello, heartbeats, goodbye, abort; and every reply) and a
PULL (data requests: init, push, pull, ...). Every worker connects a DEALER to each ROUTER, owned
by its IO thread, and a PUSH to each PULL, on which application threads send directly under a
lock: handing each request to the IO thread costs a thread switch and a GIL hand-over per message,
which dominated small and medium transfers. Replies are received by the IO thread, so requests
complete in the background while the application computes (what P3's overlap relies on).

Tensor payloads of at least ``ZERO_COPY_BYTES`` go out with ``copy=False`` (ZeroMQ reads the
tensor's memory directly); a pull's reply is received straight into the output tensor
(``recv_into``). Every received message is decoded and validated here, so callers only ever see
well-formed ``Message`` objects or a ``ProtocolError``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import zmq

from tandem.kvstore.dist.protocol import Header, Message, attach, decode, decode_header, encode_header, encode_reply
from tandem.kvstore.errors import ProtocolError

ZERO_COPY_BYTES = 64 * 1024
SNDMORE = zmq.SNDMORE
MAX_BATCH = 256  # messages drained per poll, so heartbeats and sends are never starved
Landing = Callable[[int, Header], memoryview | None]  # where a reply's payload may be received in place


@dataclass(slots=True)
class Incoming:
    """One received message, or the reason it was rejected; ``peer`` says who sent it."""

    peer: Any  # on a server: the routing id (control socket) or None (data socket); on a worker: server index
    message: Message | None
    error: ProtocolError | None = None


class _Endpoint:
    def __init__(self, secret: bytes) -> None:
        self.secret = secret
        self.context = zmq.Context()

    def _send(self, socket: zmq.Socket, prefix: bytes | None, head: bytes, payloads: Sequence[Any],
              track: bool) -> zmq.MessageTracker | None:  # fmt: skip
        """Send ``[prefix] + [head] + payloads``; returns a tracker for a zero-copy payload if asked.

        A payload that is a received ``zmq.Frame`` is sent on as it is: ZeroMQ shares the buffer
        (no copy, and none of pyzmq's per-message garbage-collector thread wake-ups that a
        zero-copy send of Python memory costs).
        """
        if prefix is not None:
            socket.send(prefix, SNDMORE)
        if not payloads:
            socket.send(head)
            return None
        socket.send(head, SNDMORE)
        tracker = None
        last = len(payloads) - 1
        for index, payload in enumerate(payloads):
            flags = 0 if index == last else SNDMORE
            if type(payload) is zmq.Frame:
                socket.send(payload, flags, copy=False)
            elif _nbytes(payload) < ZERO_COPY_BYTES:
                socket.send(payload, flags)
            else:
                result = socket.send(payload, flags, copy=False, track=track)
                tracker = result if track else tracker
        return tracker

    def _head(self, header: Header, payloads: Sequence[Any], request_id: int | None = None) -> bytes:
        """The header frame for ``header`` carrying ``payloads`` (their count and bytes filled in here)."""
        return encode_header(header, self.secret, len(payloads), payload_size(payloads), request_id)

    def _decode(self, peer: Any, frames: list[Any]) -> Incoming:
        try:
            return Incoming(peer, decode(frames, self.secret))
        except ProtocolError as error:
            return Incoming(peer, None, error)

    def _socket(self, kind: int, endpoint: str, identity: bytes = b"", send_timeout: float = 0) -> zmq.Socket:
        socket = self.context.socket(kind)
        socket.setsockopt(zmq.LINGER, 500)  # queued goodbyes get half a second to leave at close
        if identity:
            socket.setsockopt(zmq.IDENTITY, identity)
        if send_timeout:  # a server that stopped reading must not block a sender forever
            socket.setsockopt(zmq.SNDTIMEO, int(send_timeout * 1000))
        socket.connect(endpoint)
        return socket

    def close(self) -> None:
        self.context.destroy(linger=500)


class ServerTransport(_Endpoint):
    """A server's control ROUTER and data PULL sockets, bound to ``bind_addr`` on ephemeral ports."""

    def __init__(self, secret: bytes, bind_addr: str) -> None:
        super().__init__(secret)
        self.control = self.context.socket(zmq.ROUTER)
        self.data = self.context.socket(zmq.PULL)
        self._poller = zmq.Poller()
        self.ports = []
        for socket in (self.control, self.data):
            socket.setsockopt(zmq.LINGER, 500)
            self.ports.append(socket.bind_to_random_port(f"tcp://{bind_addr}"))
            self._poller.register(socket, zmq.POLLIN)

    def send(self, peer: bytes, header: Header, payloads: Sequence[Any] = (), track: bool = False) -> Any:
        """Send to the worker whose control routing id is ``peer``; returns a tracker for big tracked payloads."""
        return self._send(self.control, peer, self._head(header, payloads), payloads, track)

    def reply(self, peer: bytes, request: Header, rank: int, payloads: Sequence[Any] = (), track: bool = False,
              error: bool = False) -> Any:  # fmt: skip
        """Answer ``request`` (``send`` of its response header, built in one step); same return."""
        head = encode_reply(request, rank, self.secret, len(payloads), payload_size(payloads), error)
        return self._send(self.control, peer, head, payloads, track)

    def poll(self, timeout: float) -> list[Incoming]:
        """Messages arriving within ``timeout`` seconds; ``peer`` is None for data-socket messages."""
        received: list[Incoming] = []
        ready = self._poller.poll(int(max(timeout, 0) * 1000))
        if not ready:
            return received
        sockets = [socket for socket, _ in ready]
        for socket in (self.control, self.data):  # control first: goodbyes and heartbeats are never starved
            if socket not in sockets:
                continue
            while len(received) < MAX_BATCH:
                try:  # readable (poll said so, or EVENTS below did); NOBLOCK all the same: never hang
                    frames = socket.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                if socket is self.control:
                    received.append(self._decode(frames[0].bytes, frames[1:]))
                else:
                    received.append(self._decode(None, frames))
                if not _readable(socket):
                    break
        return received


class WorkerTransport(_Endpoint):
    """Per server a DEALER (IO thread: control messages, every reply) and a PUSH (data requests, any thread).

    Thread safety: ``poll`` and ``send_control`` belong to the IO thread; ``send_data`` and
    ``wake`` may be called from any thread (``send_data`` is serialised by a lock).
    """

    def __init__(self, secret: bytes, control: list[str], data: list[str], identity: bytes, send_timeout: float) -> None:
        super().__init__(secret)
        self.control = [self._socket(zmq.DEALER, endpoint, identity=identity) for endpoint in control]
        self.data = [self._socket(zmq.PUSH, endpoint, send_timeout=send_timeout) for endpoint in data]
        self._data_lock = threading.Lock()
        wake_address = f"inproc://wake-{id(self)}"
        self._wake_in = self.context.socket(zmq.PULL)
        self._wake_in.bind(wake_address)
        self._wake_out = self.context.socket(zmq.PUSH)
        self._wake_out.connect(wake_address)
        self._wake_lock = threading.Lock()
        self._poller = zmq.Poller()
        for socket in [self._wake_in, *self.control]:
            self._poller.register(socket, zmq.POLLIN)
        self._server_of = {socket: server for server, socket in enumerate(self.control)}

    def wake(self) -> None:
        """Interrupt a ``poll`` in the IO thread. Thread safe."""
        with self._wake_lock:
            self._wake_out.send(b"", zmq.NOBLOCK)

    def send_control(self, server: int, header: Header, payloads: Sequence[Any] = ()) -> None:
        """IO thread only."""
        self._send(self.control[server], None, self._head(header, payloads), payloads, track=False)

    def send_data(self, server: int, header: Header, payloads: Sequence[Any] = (), request_id: int | None = None) -> None:
        """Thread safe; raises ``zmq.Again`` when the server has not accepted data for the send timeout.

        ``request_id`` overrides the header's (so callers need not rebuild the frozen header).
        """
        head = self._head(header, payloads, request_id)
        with self._data_lock:
            self._send(self.data[server], None, head, payloads, track=False)

    def poll(self, timeout: float, landing: Landing | None = None) -> list[Incoming]:
        """IO thread only: replies and notices arriving within ``timeout`` seconds (or until ``wake``).

        A reply whose payload ``landing`` has a buffer for (a pull's output tensor) is received
        straight into it, saving a copy and the allocation of a big frame.
        """
        received: list[Incoming] = []
        for socket, _ in self._poller.poll(int(max(timeout, 0) * 1000)):
            if socket is self._wake_in:
                while _drain_one(self._wake_in):
                    pass
                continue
            server = self._server_of[socket]
            while len(received) < MAX_BATCH:
                try:
                    first = socket.recv(zmq.NOBLOCK)  # a small header: bytes are cheaper than a Frame object
                except zmq.Again:
                    break
                received.append(self._receive(server, socket, first, landing))
                if not _readable(socket):
                    break
        return received

    def _receive(self, server: int, dealer: zmq.Socket, first: bytes, landing: Landing | None) -> Incoming:
        """The rest of a message whose header frame ``first`` arrived (its frames are all here already)."""
        if not dealer.get(zmq.RCVMORE):
            return self._decode(server, [first])
        try:
            header = decode_header(first, self.secret)
        except ProtocolError as error:
            dealer.recv_multipart()  # the rest of a message we already rejected
            return Incoming(server, None, error)
        wanted = landing is not None and header.payload_count == 1 and not header.error
        target = landing(server, header) if wanted and landing is not None else None
        if target is None or target.nbytes != header.payload_nbytes:
            try:
                return Incoming(server, attach(header, dealer.recv_multipart(copy=False)))
            except ProtocolError as error:
                return Incoming(server, None, error)
        size = dealer.recv_into(target)  # the rest of a multipart message is already here: never blocks
        if dealer.get(zmq.RCVMORE):
            dealer.recv_multipart()
            return Incoming(server, None, ProtocolError("reply has more payload frames than its header announced"))
        if size != target.nbytes:
            return Incoming(server, None, ProtocolError(f"reply payload of {size} bytes, header announced {target.nbytes}"))
        return Incoming(server, Message(header, [target], landed=True))


def _readable(socket: zmq.Socket) -> bool:
    """Whether another message waits; cheaper than a NOBLOCK recv raising ``zmq.Again``."""
    return bool(cast(int, socket.get(zmq.EVENTS)) & zmq.POLLIN)


def _nbytes(payload: Any) -> int:
    return payload.nbytes if type(payload) is memoryview else memoryview(payload).nbytes


def payload_size(payloads: Sequence[Any]) -> int:
    """Total bytes of ``payloads`` (memoryviews, bytes or received frames)."""
    return sum(_nbytes(payload) for payload in payloads)


def _drain_one(socket: zmq.Socket) -> bool:
    try:
        socket.recv(zmq.NOBLOCK)
        return True
    except zmq.Again:
        return False
