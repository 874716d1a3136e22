"""Helpers of the kvstore wire tests: sessions from fixed nonces, and a hello between real transports."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tandem.kvstore.ps.auth import Session
from tandem.kvstore.ps.protocol import Command, Header, Role
from tandem.kvstore.ps.transport import Incoming, ServerTransport, WorkerTransport

SECRET = b"s3cret"
WORKER_NONCE, SERVER_NONCE = b"w" * 16, b"s" * 16


def session_pair(secret: bytes = SECRET, rank: int = 1) -> tuple[Session, Session]:
    """A worker's and its server's session of one connection (built from the same nonces and rank)."""
    return (Session(secret, WORKER_NONCE, SERVER_NONCE, rank, is_server=False),
            Session(secret, WORKER_NONCE, SERVER_NONCE, rank, is_server=True))  # fmt: skip


def poll_until(poll: Callable[[], list[Incoming]], count: int) -> list[Incoming]:
    """What ``poll`` returns over up to 100 calls, once ``count`` messages arrived (else the test fails)."""
    received: list[Incoming] = []
    for _ in range(100):
        received += poll()
        if len(received) >= count:
            return received
    raise AssertionError(f"{len(received)} of {count} messages arrived")


def handshake(server: ServerTransport, worker: WorkerTransport, rank: int = 1) -> bytes:
    """A hello from ``worker`` (its only server: ``server``) and its answer, then, with a secret, a session
    of the same nonces opened on both sides, as the kvstore's client and server do; returns the worker's
    routing id. The transports' message counters start again at zero afterwards."""
    worker.send(0, Header(Command.HELLO, 1, Role.WORKER, rank), [memoryview(b"{}")])
    (hello,) = poll_until(lambda: server.poll(0.1), 1)
    assert hello.message is not None, hello.error
    if server.secret:
        server.open_session(hello.peer, WORKER_NONCE, SERVER_NONCE, rank)
    server.reply(hello.peer, hello.message.header, 0)
    (answer,) = poll_until(lambda: worker.poll(0.1), 1)
    assert answer.message is not None and answer.message.header.command is Command.HELLO, answer.error
    if worker.secret:
        worker.open_session(0, WORKER_NONCE, SERVER_NONCE, rank)
    server.sent = worker.sent = worker.received = 0
    peer: Any = hello.peer
    return bytes(peer)
