"""The worker transport's sends over a real ZeroMQ connection on 127.0.0.1 (no kvstore server)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import zmq

from tandem.kvstore.ps import transport
from tandem.kvstore.ps.protocol import Command, Header, Role, decode, tensor_bytes, tensor_from_bytes
from tandem.kvstore.ps.transport import ZERO_COPY_BYTES, WorkerTransport, snapshot_frame

PUSH = Header(Command.PUSH, 0, Role.WORKER, 0, key="k")


@pytest.fixture
def connection() -> Iterator[tuple[zmq.Socket, WorkerTransport]]:
    """A ROUTER standing in for a server, and a worker transport connected to it."""
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.RCVTIMEO, 10_000)  # a broken send fails the test instead of hanging it
    port = router.bind_to_random_port("tcp://127.0.0.1")
    worker = WorkerTransport(b"", [f"tcp://127.0.0.1:{port}"], send_timeout=10.0)
    yield router, worker
    worker.close()
    context.destroy(linger=0)


def test_big_payloads_leave_from_their_own_memory_intact(connection: tuple[zmq.Socket, WorkerTransport]) -> None:
    router, worker = connection
    assert transport._SEND_CONST is not None  # pyzmq exports libzmq here, so the path below is the one tested
    values = [torch.arange(n, dtype=torch.float32) for n in (ZERO_COPY_BYTES // 4, 3 * ZERO_COPY_BYTES // 4 + 1)]
    for request_id, value in enumerate(values, start=1):
        worker.send(0, PUSH, [tensor_bytes(value), memoryview(b"tail")], request_id=request_id)
    for request_id, value in enumerate(values, start=1):
        _, *frames = router.recv_multipart(copy=False)
        message = decode(frames)
        assert message.header.request_id == request_id
        assert torch.equal(tensor_from_bytes(message.payloads[0], torch.float32, value.numel()), value)
        assert bytes(message.payloads[1]) == b"tail"


def test_read_only_payloads_are_copied(connection: tuple[zmq.Socket, WorkerTransport]) -> None:
    """``zmq_send_const`` needs memory the caller owns and keeps; bytes go through pyzmq's own send."""
    router, worker = connection
    payload = memoryview(bytes(range(256)) * (ZERO_COPY_BYTES // 256 + 1))
    worker.send(0, PUSH, [payload], request_id=1)
    _, *frames = router.recv_multipart()
    assert decode(frames).payloads[0] == payload


def test_a_snapshot_frame_keeps_the_bytes_of_when_it_was_made() -> None:
    value = torch.zeros(40_000)  # 160 KB: above pyzmq's COPY_THRESHOLD, where a plain Frame shares the buffer
    frame = snapshot_frame(value)
    value.add_(1.0)  # what a server's in-place optimizer update does to a slot
    assert torch.equal(torch.frombuffer(bytearray(frame.bytes), dtype=torch.float32), torch.zeros(40_000))
