"""ZeroMQ behind one small interface: the only kvstore module that touches sockets.

Every server binds one ROUTER; every worker connects one DEALER to it. Everything between a worker
and a server (hello, heartbeats, goodbye, abort, data requests and their replies) travels on that
one connection, in order. Why one: a reply then follows its request on the same TCP stream (with
raw pyzmq on loopback, a 1 MB message acknowledged on a second connection took 100-200 us longer
than on the same one; inside the kvstore the difference was within the machine's noise), a
server has one port and one peer table, and a data request is accepted only from the connection
that said hello.

A DEALER is not thread safe, yet requests leave from the calling thread (handing each to the IO
thread costs a thread switch and a GIL hand-over per message, which dominated small transfers)
while one receiving thread (the IO thread, or a waiter it handed over to: ``Client.drive``) takes
replies. So each DEALER is used only under its lock, and the receiver never blocks inside ZeroMQ:
it waits on the socket's notification descriptor (``ZMQ_FD``) and drains under the lock. That
descriptor is edge-triggered: a send (even a refused one) may consume the notice of a reply that
arrived meanwhile, so a sender that finds the socket readable after trying wakes the receiver.
Sends never block under the lock (``NOBLOCK``, retried until the send timeout; the IO thread's
heartbeats are not retried).

Tensor payloads of at least ``ZERO_COPY_BYTES`` go out without a copy (ZeroMQ reads the tensor's
memory directly); a pull's reply is received straight into the output tensor (``recv_into``). A
worker sends them with libzmq's ``zmq_send_const`` (memory the caller keeps alive and unchanged
until the request's reply arrives, which proves every byte left): pyzmq's zero-copy send instead
wakes its garbage-collector thread, a Python thread wanting the GIL, once per message.

Every received message is decoded, validated and (with a secret) authenticated here, so callers
only ever see well-formed, authentic ``Message`` objects or a ``ProtocolError``: the transport
seals what it sends and checks what it receives with each peer's ``auth.Session``. Every socket
drops a peer that sends a frame above ``max_frame_bytes`` before buffering it (``ZMQ_MAXMSGSIZE``);
with a secret a server admits a connection only after a login (CURVE's keys, or a PLAIN password
derived from the secret: ``curve.py``), and a worker's routing id is random (nobody can guess it to
take it first, and it survives a reconnect).
"""

from __future__ import annotations

import ctypes
import hmac
import os
import select
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import zmq
from zmq.backend import zmq_poll
from zmq.backend.cython import _zmq as pyzmq_backend

from tandem.kvstore.errors import ProtocolError
from tandem.kvstore.ps.auth import MAX_HELLO_BYTES, Session, attempt_key, handshake_tag
from tandem.kvstore.ps.curve import CurveKeys, admit_with_password, password_of, present_password
from tandem.kvstore.ps.protocol import (
    BATCHABLE,
    MAX_BATCH_ENTRIES,
    Command,
    Header,
    Message,
    Role,
    attach,
    decode,
    decode_batch_index,
    decode_header,
    encode_batch_index,
    encode_header,
    encode_reply,
    frame_bytes,
    is_handshake,
    only_protocol_errors,
    seal,
    split_batch,
    split_tag,
    tensor_bytes,
)
from tandem.kvstore.ps.topology import restart_count

ZERO_COPY_BYTES = 64 * 1024
# plain ints: pyzmq's constants are IntFlags, and every ``&``/``|`` with one builds a new enum (a
# Python call each; a dozen per request showed up in profiles)
SNDMORE, NOBLOCK, POLLIN = int(zmq.SNDMORE), int(zmq.NOBLOCK), int(zmq.POLLIN)
EVENTS, RCVMORE = int(zmq.EVENTS), int(zmq.RCVMORE)
MAX_BATCH = 256  # messages drained per poll, so heartbeats and sends are never starved
Landing = Callable[[int, Header], memoryview | None]  # where a reply's payload may be received in place


@dataclass(slots=True)
class Incoming:
    """One received message, or the reason it was rejected; ``peer`` says who sent it."""

    peer: Any  # on a server: the sender's routing id; on a worker: the server's index
    message: Message | None
    error: ProtocolError | None = None

    def __post_init__(self) -> None:
        if self.error is not None:  # its traceback would keep the receiving frame's locals (a rejected
            self.error.__traceback__ = None  # message's frames, up to gigabytes) alive as long as this


def _libzmq_send_const() -> Any:
    """libzmq's ``zmq_send_const`` as linked into pyzmq (None where pyzmq does not export it)."""
    try:  # dlsym on pyzmq's extension searches the libzmq it links, the same library its sockets live in
        function = ctypes.CDLL(pyzmq_backend.__file__, use_errno=True).zmq_send_const
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    function.restype = ctypes.c_int
    return function


_SEND_CONST = _libzmq_send_const()
# pyzmq's compiled send (zmq.Socket derives from it): its Python wrapper only adds DRAFT-socket options
_send: Callable[..., Any] = pyzmq_backend.Socket.send


class _Endpoint:
    def __init__(self, secret: bytes, max_frame_bytes: int, curve: CurveKeys | None) -> None:
        # one key per start of the job: a restarted job's peers cannot replay the last start's hellos
        self.secret = attempt_key(secret, restart_count()) if secret else b""
        self.max_frame_bytes = max_frame_bytes
        self.curve = curve
        self.context = zmq.Context()

    def _socket(self, kind: int) -> zmq.Socket:
        socket = self.context.socket(kind)
        socket.setsockopt(zmq.LINGER, 500)  # queued goodbyes get half a second to leave at close
        socket.setsockopt(zmq.MAXMSGSIZE, self.max_frame_bytes)  # a bigger frame drops its sender unbuffered
        return socket

    def _head(self, header: Header, payloads: Sequence[Any], request_id: int | None = None) -> bytes:
        """The unsigned header frame for ``header`` carrying ``payloads`` (their count and bytes filled in here)."""
        return encode_header(header, len(payloads), payload_size(payloads), request_id)

    def _seal(self, session: Session | None, head: bytes, payloads: Sequence[Any]) -> bytes:
        """``head`` signed over ``payloads`` when the job has a secret: a HELLO or its answer with the
        secret, anything else under the peer's session."""
        if not self.secret:
            return head
        if is_handshake(head):
            return seal(head, payloads, secret=self.secret)
        if session is None:
            raise ProtocolError("no authenticated session with this peer: it has not completed hello")
        return seal(head, payloads, session)

    @only_protocol_errors
    def _authenticate(self, session: Session | None, head: bytes, header: Header, payloads: Sequence[Any]) -> None:
        """Raise ``ProtocolError`` unless the message is signed as this job requires (and new, in a session)."""
        if not self.secret:
            if header.signed:
                raise ProtocolError("message is signed but this process has no TANDEM_PS_SECRET; "
                                    "set the same secret everywhere")  # fmt: skip
            return
        if not header.signed:
            raise ProtocolError("unauthenticated message: TANDEM_PS_SECRET is set here but the sender did not sign")
        body, tag = split_tag(head)
        if header.command is Command.HELLO:
            if header.payload_count > 1 or header.payload_nbytes > MAX_HELLO_BYTES:  # before hashing a stranger's bytes
                raise ProtocolError(f"a hello carries one frame of at most {MAX_HELLO_BYTES} bytes")
            if not hmac.compare_digest(tag, handshake_tag(self.secret, body, payloads)):
                raise ProtocolError("bad hello tag: the sender's TANDEM_PS_SECRET differs, or the message was changed")
            return
        if session is None:
            raise ProtocolError(f"{header.command.name} from a peer without a session: it never completed an "
                                f"authenticated hello")  # fmt: skip
        problem = session.check(header.sequence, body, tag, payloads)
        if problem is not None:
            raise ProtocolError(problem)

    def _decode(self, peer: Any, frames: list[Any], session: Session | None) -> Incoming:
        try:
            message = decode(frames)
            self._authenticate(session, frame_bytes(frames[0]), message.header, message.payloads)
            return Incoming(peer, message)
        except ProtocolError as error:
            return Incoming(peer, None, error)

    def close(self) -> None:
        self.context.destroy(linger=500)


class ServerTransport(_Endpoint):
    """A server's ROUTER, bound to ``bind_addr`` on an ephemeral port (``port``); peers are routing ids."""

    def __init__(self, secret: bytes, bind_addr: str, coalesce_bytes: int = 0, max_frame_bytes: int = 2**62,
                 curve: CurveKeys | None = None) -> None:  # fmt: skip
        super().__init__(secret, max_frame_bytes, curve)
        self.socket = self._socket(zmq.ROUTER)
        # before bind: who may connect at all (CURVE's keys, else with a secret a PLAIN password)
        self._authenticator = (curve.make_server(self.socket, self.context) if curve is not None else
                               admit_with_password(self.socket, self.context, password_of(self.secret)) if secret
                               else None)  # fmt: skip
        self.port = self.socket.bind_to_random_port(f"tcp://{bind_addr}")
        self.sessions: dict[bytes, Session] = {}  # peer -> its session (with a secret, after its hello)
        self._poll_items = [(self.socket, POLLIN)]  # built once: Socket.poll builds a Poller per call
        self.coalesce_bytes = coalesce_bytes  # replies held per peer up to this many bytes (0: none held)
        self._held: dict[bytes, list[tuple[bytes, Sequence[Any], int]]] = {}  # peer -> (head, payloads, bytes)
        self._held_bytes: dict[bytes, int] = {}
        self._batch_head: Header | None = None
        self.sent = 0  # messages sent (a batch counts once), for benchmarks and tests

    def send(self, peer: bytes, header: Header, payloads: Sequence[Any] = ()) -> None:
        """Send to the worker whose routing id is ``peer`` (after any replies held for it). Big payloads
        are read after this returns: send only memory that nobody changes (a received frame, a tensor
        rebound rather than updated)."""
        if peer in self._held:
            self.flush(peer)
        self._send(peer, self._head(header, payloads), payloads)

    def reply(self, peer: bytes, request: Header, rank: int, payloads: Sequence[Any] = (), error: bool = False,
              compressed: bool = False) -> None:  # fmt: skip
        """Answer ``request`` (``send`` of its response header, built in one step).

        With ``coalesce_bytes``, replies to data requests are held and go out together at the next
        ``flush`` (one BATCH message per peer), or as soon as the peer's held bytes reach the bound.
        """
        nbytes = payload_size(payloads) if payloads else 0
        head = encode_reply(request, rank, len(payloads), nbytes, error, compressed)
        if not self.coalesce_bytes or request.command not in BATCHABLE:
            if peer in self._held:
                self.flush(peer)
            self._send(peer, head, payloads)
            return
        if self._batch_head is None:
            self._batch_head = Header(Command.BATCH, 0, Role.SERVER, rank, response=True)
        held = self._held.get(peer)
        if held is not None and self._held_bytes[peer] + nbytes > self.coalesce_bytes:
            self.flush(peer)
            held = None
        if held is None:
            held = self._held[peer] = []
            self._held_bytes[peer] = 0
        held.append((head, payloads, nbytes))
        self._held_bytes[peer] += nbytes
        if self._held_bytes[peer] >= self.coalesce_bytes or len(held) == MAX_BATCH_ENTRIES:
            self.flush(peer)

    def flush(self, peer: bytes | None = None) -> None:
        """Send the replies held for ``peer`` (every peer if None): one message, a BATCH if several."""
        for target in [peer] if peer is not None else list(self._held):
            held = self._held.pop(target, None)
            nbytes = self._held_bytes.pop(target, 0)
            if not held:
                continue
            if len(held) == 1:
                self._send(target, held[0][0], held[0][1])
                continue
            assert self._batch_head is not None  # set with the first held reply
            index = encode_batch_index([head for head, _, _ in held])
            payloads = [index, *(payload for _, entry, _ in held for payload in entry)]
            head = encode_header(self._batch_head, len(payloads), len(index) + nbytes)
            self._send(target, head, payloads)

    def open_session(self, peer: bytes, worker_nonce: bytes, server_nonce: bytes, rank: int) -> Session:
        """The session of ``peer`` after an authenticated hello (replacing any it had)."""
        session = self.sessions[peer] = Session(self.secret, worker_nonce, server_nonce, rank, is_server=True)
        return session

    def close_session(self, peer: bytes) -> None:
        self.sessions.pop(peer, None)

    def close(self) -> None:
        if self._authenticator is not None:
            self._authenticator.stop()
        super().close()

    def _send(self, peer: bytes, head: bytes, payloads: Sequence[Any]) -> None:
        head = self._seal(self.sessions.get(peer), head, payloads)
        self.sent += 1
        _send(self.socket, peer, SNDMORE)
        _send(self.socket, head, SNDMORE if payloads else 0)
        _send_payloads(self.socket, payloads)

    def poll(self, timeout: float) -> list[Incoming]:
        """Messages arriving within ``timeout`` seconds, in arrival order; ``peer`` is the sender's routing id."""
        received: list[Incoming] = []
        socket = self.socket
        if not zmq_poll(self._poll_items, int(max(timeout, 0) * 1000)):
            return received
        while len(received) < MAX_BATCH and _readable(socket):  # NOBLOCK all the same: never hang
            peer = socket.recv(NOBLOCK)  # a ROUTER's message has all its frames here once its first is
            if not socket.get(RCVMORE):
                received.append(Incoming(peer, None, ProtocolError("a message without a header frame")))
                continue
            head = socket.recv(NOBLOCK)  # the header as bytes: cheaper than a Frame object
            frames = socket.recv_multipart(NOBLOCK, copy=False) if socket.get(RCVMORE) else []
            try:
                message = attach(decode_header(head), frames)
                self._authenticate(self.sessions.get(peer), head, message.header, message.payloads)
                if message.header.command is Command.BATCH:  # its messages, handled as if they came alone
                    received.extend(Incoming(peer, entry) for entry in split_batch(message))
                else:
                    received.append(Incoming(peer, message))
            except ProtocolError as error:
                received.append(Incoming(peer, None, error))
        return received


class WorkerTransport(_Endpoint):
    """Per server one DEALER, shared under a lock by the sending threads and the receiving thread.

    Thread safety: ``poll`` belongs to one receiving thread at a time (the caller hands it over with
    a memory barrier, e.g. a lock); ``send`` and ``wake`` may be called from any thread (each socket
    is used only under its lock).
    """

    def __init__(self, secret: bytes, endpoints: list[str], send_timeout: float, max_frame_bytes: int = 2**62,
                 curve: CurveKeys | None = None) -> None:  # fmt: skip
        super().__init__(secret, max_frame_bytes, curve)
        self.sessions: list[Session | None] = [None] * len(endpoints)  # with a secret: set after each hello
        self.sockets = [self._dealer(endpoint, send_timeout) for endpoint in endpoints]
        self._locks = [threading.Lock() for _ in self.sockets]
        self._send_timeout = send_timeout
        # a pipe, not an inproc socket, wakes the receiver: a write and a read are one system call
        # each, where a ZeroMQ wake-up took a locked send and a drain (a few percent of a 4 KB op)
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_read, False)
        os.set_blocking(self._wake_write, False)
        self._wake_lock = threading.Lock()  # a wake-up never writes to the pipe after close (its number may be reused)
        self._backlog = False  # the last poll stopped at MAX_BATCH: the descriptors will not signal it again
        self._first = 0  # the socket drained first
        self._poller = select.poll()  # plain descriptors only, so the C poll serves (zmq.Poller wraps zmq_poll)
        self._poller.register(self._wake_read, select.POLLIN)
        for socket in self.sockets:  # the descriptors, not the sockets: polling a socket would use it unlocked
            self._poller.register(cast(int, socket.get(zmq.FD)), select.POLLIN)
        self._batch_heads: dict[int, Header] = {}  # rank -> the header of its BATCH requests
        self.sent = 0  # messages sent (a batch counts once), for benchmarks and tests
        self.received = 0  # messages received (likewise)

    def _dealer(self, endpoint: str, send_timeout: float) -> zmq.Socket:
        socket = self._socket(zmq.DEALER)
        # a random routing id: nobody can guess it to take it first, and it survives a reconnect (a
        # ROUTER-assigned one would not: the server would no longer know the worker after a TCP reset)
        socket.setsockopt(zmq.IDENTITY, b"w" + os.urandom(15))
        socket.setsockopt(zmq.SNDTIMEO, int(send_timeout * 1000))  # a backstop: sends start NOBLOCK anyway
        if self.curve is not None:
            self.curve.make_client(socket)
        elif self.secret:
            present_password(socket, password_of(self.secret))
        socket.connect(endpoint)
        return socket

    def open_session(self, server: int, worker_nonce: bytes, server_nonce: bytes, rank: int) -> None:
        """Sign and check everything after the hello with ``server`` under a session of these nonces."""
        self.sessions[server] = Session(self.secret, worker_nonce, server_nonce, rank, is_server=False)

    def wake(self) -> None:
        """Interrupt a ``poll`` (in the receiving thread). Thread safe; never blocks (a wake already queued will do)."""
        with self._wake_lock:
            if self._wake_write < 0:  # closed
                return
            try:
                os.write(self._wake_write, b"w")
            except BlockingIOError:  # the pipe is full of wake-ups already
                pass

    def send(self, server: int, header: Header, payloads: Sequence[Any] = (), request_id: int | None = None,
             wait: bool = True) -> None:  # fmt: skip
        """Send to ``server``. Thread safe; raises ``zmq.Again`` when it accepted nothing for the send
        timeout (at once with ``wait=False``: the IO thread must not stop draining replies).

        Big payloads are sent from their own memory: the caller keeps them alive and unchanged until
        the reply arrives, or until ``close`` if none ever does (see the module doc).

        ``request_id`` overrides the header's (so callers need not rebuild the frozen header).
        """
        self._transmit(server, self._head(header, payloads, request_id), payloads, wait)

    def send_batch(self, server: int, rank: int, entries: Sequence[tuple[Header, Sequence[Any], int]]) -> None:
        """Send several data requests ``(header, payloads, request id)`` to ``server`` as one BATCH message
        (``send`` for the rest: thread safe, raises ``zmq.Again``, payloads kept alive by the caller)."""
        batch = self._batch_heads.get(rank)
        if batch is None:
            batch = self._batch_heads[rank] = Header(Command.BATCH, 0, Role.WORKER, rank)
        heads = [self._head(header, payloads, request_id) for header, payloads, request_id in entries]
        index = encode_batch_index(heads)
        payloads = [index, *(payload for _, entry, _ in entries for payload in entry)]
        self._transmit(server, encode_header(batch, len(payloads), payload_size(payloads)), payloads, True)

    def _transmit(self, server: int, unsigned: bytes, payloads: Sequence[Any], wait: bool) -> None:
        socket, lock = self.sockets[server], self._locks[server]
        deadline = None  # taken only when a send is refused: most go at once
        while True:
            with lock:
                # sealed under the lock: sequence numbers then leave in order (one drawn earlier by a
                # thread that waited could fall behind the server's replay window and be dropped)
                head = self._seal(self.sessions[server], unsigned, payloads)
                try:
                    _send(socket, head, NOBLOCK | SNDMORE if payloads else NOBLOCK)
                    sent = True
                except zmq.Again:
                    sent = False
                else:  # the first frame went: the rest of a multipart message always follows
                    _send_payloads(socket, payloads, const=True)
                readable = _readable(socket)  # a reply whose notice this attempt consumed?
            if readable:
                self.wake()
            if sent:
                self.sent += 1
                return
            deadline = time.monotonic() + self._send_timeout if deadline is None else deadline
            if not wait or time.monotonic() > deadline:
                raise zmq.Again()
            time.sleep(0.001)  # the server is not reading: back off without holding the lock

    def close(self) -> None:
        super().close()
        with self._wake_lock:
            os.close(self._wake_read)
            os.close(self._wake_write)
            self._wake_write = -1

    def poll(self, timeout: float, landing: Landing | None = None) -> list[Incoming]:
        """The receiving thread only: replies and notices arriving within ``timeout`` seconds (or until ``wake``).

        A reply whose payload ``landing`` has a buffer for (a pull's output tensor) is received
        straight into it, saving a copy and the allocation of a big frame.
        """
        received: list[Incoming] = []
        for descriptor, _ in self._poller.poll(0 if self._backlog else int(max(timeout, 0) * 1000)):
            if descriptor == self._wake_read:
                _drain_pipe(self._wake_read)
        self._backlog = False
        start = self._first = (self._first + 1) % len(self.sockets)  # a backlog must not favour server 0
        for server in [*range(start, len(self.sockets)), *range(start)]:  # every one: a sender may have consumed its notice
            socket = self.sockets[server]
            with self._locks[server]:
                while _readable(socket):
                    if len(received) >= MAX_BATCH:
                        self._backlog = True
                        break
                    first = socket.recv(NOBLOCK)  # a small header: bytes are cheaper than a Frame object
                    self.received += 1
                    incoming = self._receive(server, socket, first, landing)
                    if type(incoming) is list:  # a batch's replies
                        received.extend(incoming)
                    else:
                        received.append(incoming)  # type: ignore[arg-type]
        return received

    def _receive(self, server: int, dealer: zmq.Socket, first: bytes, landing: Landing | None) -> Incoming | list[Incoming]:
        """The rest of a message whose header frame ``first`` arrived (its frames are all here already)."""
        session = self.sessions[server]
        if not dealer.get(RCVMORE):
            return self._decode(server, [first], session)
        try:
            header = decode_header(first)
        except ProtocolError as error:
            dealer.recv_multipart()  # the rest of a message we already rejected
            return Incoming(server, None, error)
        if header.command is Command.BATCH:
            return self._receive_batch(server, dealer, first, header, landing)
        wanted = landing is not None and header.payload_count == 1 and not header.error
        target = landing(server, header) if wanted and landing is not None else None
        try:
            if target is None or target.nbytes != header.payload_nbytes:
                message = attach(header, dealer.recv_multipart(copy=False))
            else:
                # straight into the pull's output; checked below before anyone is told it arrived (the
                # request stays pending on a bad tag, and its output is not to be read until it completes)
                size = dealer.recv_into(target)  # the rest of a multipart message is already here: never blocks
                if dealer.get(RCVMORE):
                    dealer.recv_multipart()
                    raise ProtocolError("reply has more payload frames than its header announced")
                if size != target.nbytes:
                    raise ProtocolError(f"reply payload of {size} bytes, header announced {target.nbytes}")
                message = Message(header, [target], landed=True)
            self._authenticate(session, first, header, message.payloads)
        except ProtocolError as error:
            return Incoming(server, None, error)
        return Incoming(server, message)


    def _receive_batch(self, server: int, dealer: zmq.Socket, first: bytes, batch: Header,
                       landing: Landing | None) -> list[Incoming]:  # fmt: skip
        """A BATCH's replies, each payload received straight into its pull's output where one waits.

        Each entry is checked as if it had come alone (one whose payload does not match its header is
        rejected, the others still complete); a batch whose frames do not match its index is rejected
        from the first entry that lacks frames; with a secret, a batch whose tag fails is rejected whole.
        """
        index, received = self._receive_entries(server, dealer, batch, landing)
        if self.secret:
            payloads = [payload for incoming in received if incoming.message is not None
                        for payload in incoming.message.payloads]  # fmt: skip
            try:
                if index is None or any(incoming.message is None for incoming in received):
                    raise ProtocolError("a signed batch arrived malformed")
                self._authenticate(self.sessions[server], first, batch, [index, *payloads])
            except ProtocolError as error:
                return [Incoming(server, None, error)]
        return received

    def _receive_entries(self, server: int, dealer: zmq.Socket, batch: Header,
                         landing: Landing | None) -> tuple[bytes | None, list[Incoming]]:  # fmt: skip
        """A BATCH's index frame (None if it was rejected) and its entries (see ``_receive_batch``)."""
        try:
            index = dealer.recv(NOBLOCK)
            headers = decode_batch_index(batch, index)
        except ProtocolError as error:
            if dealer.get(RCVMORE):
                dealer.recv_multipart()
            return None, [Incoming(server, None, error)]
        received: list[Incoming] = []
        for header in headers:
            count = header.payload_count
            if count and not dealer.get(RCVMORE):
                received.append(Incoming(server, None, ProtocolError("batch has fewer payload frames than its index announced")))
                return index, received
            target = landing(server, header) if landing is not None and count == 1 and not header.error else None
            if target is not None and target.nbytes == header.payload_nbytes:
                size = dealer.recv_into(target)  # the frames of a multipart message are all here: never blocks
                if size == target.nbytes:
                    received.append(Incoming(server, Message(header, [target], landed=True)))
                else:
                    problem = ProtocolError(f"reply payload of {size} bytes, header announced {target.nbytes}")
                    received.append(Incoming(server, None, problem))
                continue
            frames = []
            for _ in range(count):
                if not dealer.get(RCVMORE):
                    received.append(Incoming(server, None, ProtocolError("batch has fewer payload frames than its index announced")))
                    return index, received
                frames.append(dealer.recv(NOBLOCK, copy=False))
            try:
                received.append(Incoming(server, attach(header, frames)))
            except ProtocolError as error:
                received.append(Incoming(server, None, error))
        if dealer.get(RCVMORE):
            dealer.recv_multipart()
            received.append(Incoming(server, None, ProtocolError("batch has more payload frames than its index announced")))
        return index, received


def _send_payloads(socket: zmq.Socket, payloads: Sequence[Any], const: bool = False) -> None:
    """The payload frames of a message whose header frame went out with ``SNDMORE``.

    A payload that is a received ``zmq.Frame`` is sent on as it is: ZeroMQ shares the buffer (no
    copy, and none of pyzmq's per-message garbage-collector thread wake-ups that a zero-copy send
    of Python memory costs). With ``const``, big writable payloads go out through
    ``zmq_send_const``: no copy and no wake-up either, the caller owning the memory's lifetime.
    """
    last = len(payloads) - 1
    for index, payload in enumerate(payloads):
        flags = 0 if index == last else SNDMORE
        if type(payload) is zmq.Frame:
            _send(socket, payload, flags, False)
        elif _nbytes(payload) < ZERO_COPY_BYTES:
            _send(socket, payload, flags)
        elif const and _SEND_CONST is not None and type(payload) is memoryview and not payload.readonly:
            _send_const(socket, payload, flags)
        else:  # pyzmq keeps the payload alive until ZeroMQ is done with it
            _send(socket, payload, flags, False)


def snapshot_frame(tensor: torch.Tensor) -> zmq.Frame:
    """A frame holding a copy of ``tensor``'s bytes now, for sending memory that will change later.

    ``copy=True`` matters: pyzmq's default shares any buffer of 64 KB or more (``zmq.COPY_THRESHOLD``)
    and keeps it alive through its garbage-collector thread, so a later in-place write would reach
    the wire.
    """
    return zmq.Frame(tensor_bytes(tensor), copy=True)


def _send_const(socket: zmq.Socket, payload: memoryview, flags: int) -> None:
    """One frame of a multipart message already begun (so ZeroMQ accepts it at once: NOBLOCK is safe)."""
    address = ctypes.addressof(ctypes.c_char.from_buffer(payload))
    if _SEND_CONST(socket.underlying, address, payload.nbytes, flags | NOBLOCK) < 0:
        raise zmq.ZMQError(ctypes.get_errno())


def _readable(socket: zmq.Socket) -> bool:
    """Whether another message waits; cheaper than a NOBLOCK recv raising ``zmq.Again``."""
    return bool(cast(int, socket.get(EVENTS)) & POLLIN)


def _nbytes(payload: Any) -> int:
    return payload.nbytes if type(payload) is memoryview else memoryview(payload).nbytes


def payload_size(payloads: Sequence[Any]) -> int:
    """Total bytes of ``payloads`` (memoryviews, bytes or received frames)."""
    if len(payloads) == 1:  # most messages: no generator
        return _nbytes(payloads[0])
    return sum(_nbytes(payload) for payload in payloads)


def _drain_pipe(descriptor: int) -> None:
    """Read every wake-up queued in a non-blocking pipe."""
    try:
        while len(os.read(descriptor, 4096)) == 4096:
            pass
    except OSError:  # empty after all (another wake-up raced the poll), or closed meanwhile: fine
        pass
