"""Coalesced messages (BATCH): the index frame, its validation against hostile input, the transports
sending and receiving batches over a real ZeroMQ connection, and how requests are grouped."""

from __future__ import annotations

import struct
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import zmq

from tandem.kvstore.errors import ProtocolError
from tandem.kvstore.ps.auth import Session, attempt_key
from tandem.kvstore.ps.client import coalesced
from tandem.kvstore.ps.curve import admit_with_password, password_of
from tandem.kvstore.ps.protocol import (
    MAX_BATCH_ENTRIES,
    MAX_BATCH_PAYLOADS,
    Command,
    Header,
    Message,
    Role,
    attach,
    decode_batch_index,
    decode_header,
    encode_batch_index,
    encode_header,
    encode_reply,
    seal,
    split_batch,
    split_tag,
    tensor_bytes,
    tensor_from_bytes,
)
from tandem.kvstore.ps.topology import restart_count
from tandem.kvstore.ps.transport import ServerTransport, WorkerTransport
from tests.unit.ps_wire import SECRET, SERVER_NONCE, WORKER_NONCE, handshake, poll_until, session_pair

BATCH = Header(Command.BATCH, 0, Role.WORKER, 1)


def _request(command: Command, key: str, numel: int, request_id: int, rank: int = 1) -> Header:
    return Header(command, request_id, Role.WORKER, rank, key=key, dtype=torch.float32, shape=(numel,),
                  slice_start=0, slice_stop=numel)  # fmt: skip


def _batch(entries: list[tuple[Header, list[Any]]], session: Session | None = None,
           batch: Header = BATCH) -> list[Any]:  # fmt: skip
    """The frames of a BATCH carrying ``entries`` (header, payloads), as a sender writes them: entries
    unsigned, the batch sealed over its index and every payload under ``session`` if given."""
    heads = [encode_header(header, len(payloads), sum(memoryview(p).nbytes for p in payloads))
             for header, payloads in entries]  # fmt: skip
    index = encode_batch_index(heads)
    payloads = [payload for _, entry in entries for payload in entry]
    nbytes = len(index) + sum(memoryview(payload).nbytes for payload in payloads)
    head = encode_header(batch, 1 + len(payloads), nbytes)
    return [head if session is None else seal(head, [index, *payloads], session), index, *payloads]


def _split(frames: list[Any], session: Session | None = None) -> list[Message]:
    """The messages of a received BATCH; with ``session`` (the receiver's), its tag checked first."""
    message = attach(decode_header(frames[0]), frames[1:])
    if session is not None:
        problem = session.check(message.header.sequence, *split_tag(frames[0]), message.payloads)
        if problem is not None:
            raise ProtocolError(problem)
    return split_batch(message)


@pytest.mark.parametrize("secret", [b"", SECRET])
def test_a_batch_carries_its_messages_in_order_each_as_if_alone(secret: bytes) -> None:
    values = [torch.arange(n, dtype=torch.float32) for n in (3, 5)]
    entries = [(_request(Command.PUSH, "a", 3, 7), [tensor_bytes(values[0])]),
               (_request(Command.PULL, "b", 9, 8), []),
               (_request(Command.PUSHPULL, "c", 5, 9), [tensor_bytes(values[1])])]  # fmt: skip
    sender, receiver = session_pair(secret) if secret else (None, None)
    messages = _split(_batch(entries, sender), receiver)
    assert [(m.header.command, m.header.key, m.header.request_id) for m in messages] == [
        (Command.PUSH, "a", 7), (Command.PULL, "b", 8), (Command.PUSHPULL, "c", 9)]  # fmt: skip
    assert messages[1].payloads == []
    assert torch.equal(tensor_from_bytes(messages[0].payloads[0], torch.float32, 3), values[0])
    assert torch.equal(tensor_from_bytes(messages[2].payloads[0], torch.float32, 5), values[1])


def _expect(problem: str, frames: list[Any], session: Session | None = None) -> None:
    with pytest.raises(ProtocolError, match=problem):
        _split(frames, session)


def test_a_truncated_index_is_rejected() -> None:
    frames = _batch([(_request(Command.PULL, "a", 3, 1), []), (_request(Command.PULL, "b", 3, 2), [])])
    index = frames[1]
    short = index[:-5]
    frames = [encode_header(BATCH, 1, len(short)), short]
    _expect("truncated", frames)
    only_count = struct.pack("<H", 2)
    _expect("truncated", [encode_header(BATCH, 1, len(only_count)), only_count])
    _expect("truncated", [encode_header(BATCH, 1, 1), b"\x01"])


def test_trailing_bytes_in_the_index_are_rejected() -> None:
    frames = _batch([(_request(Command.PULL, "a", 3, 1), []), (_request(Command.PULL, "b", 3, 2), [])])
    index = frames[1] + b"x"
    _expect("trailing", [encode_header(BATCH, 1, len(index)), index])


@pytest.mark.parametrize("count", [0, MAX_BATCH_ENTRIES + 1, 65535])
def test_entry_counts_out_of_range_are_rejected(count: int) -> None:
    head = encode_header(_request(Command.PULL, "a", 3, 1))
    index = struct.pack("<H", count) + (struct.pack("<H", len(head)) + head) * min(count, MAX_BATCH_ENTRIES + 1)
    _expect("entries", [encode_header(BATCH, 1, len(index)), index])
    with pytest.raises(ValueError, match="batch carries"):
        encode_batch_index([head] * count)


def test_an_entry_longer_than_any_header_is_rejected() -> None:
    index = struct.pack("<HH", 1, 60000) + b"\0" * 60000
    _expect("at most", [encode_header(BATCH, 1, len(index)), index])


def test_sizes_that_do_not_match_are_rejected() -> None:
    value = tensor_bytes(torch.ones(3))
    entries = [(_request(Command.PUSH, "a", 3, 1), [value]), (_request(Command.PULL, "b", 3, 2), [])]
    frames = _batch(entries)
    # the batch announces one frame more than its entries carry (and sends it)
    extra = [encode_header(BATCH, 3, len(frames[1]) + 2 * value.nbytes), frames[1], value, value]
    _expect("payload frames", extra)
    # the entries' bytes do not add up to the batch's (frames and batch agree with each other)
    short = memoryview(b"\0" * 8)
    _expect("payload bytes", [encode_header(BATCH, 2, len(frames[1]) + 8), frames[1], short])
    # two entries whose frames are swapped: totals agree, each entry's own size does not
    a, b = tensor_bytes(torch.ones(2)), tensor_bytes(torch.ones(4))
    entries = [(_request(Command.PUSH, "a", 2, 1), [a]), (_request(Command.PUSH, "b", 4, 2), [b])]
    frames = _batch(entries)
    _expect("payload bytes", [frames[0], frames[1], b, a])
    # a truncated batch: fewer frames than its header announces
    with pytest.raises(ProtocolError, match="payload frames"):
        attach(decode_header(frames[0]), frames[1:-1])


def test_frame_counts_are_bounded_in_the_header() -> None:
    assert MAX_BATCH_PAYLOADS <= 255  # the header's payload count is one byte
    assert decode_header(encode_header(BATCH, MAX_BATCH_PAYLOADS, 0)).payload_count == MAX_BATCH_PAYLOADS
    with pytest.raises(ProtocolError, match="payload frames"):  # only a batch may carry more than 8
        decode_header(encode_header(_request(Command.PUSH, "a", 3, 1), 9, 12))


@pytest.mark.parametrize("command", [Command.HELLO, Command.BYE, Command.BATCH, Command.SET_OPTIMIZER, Command.TAKE])
def test_only_data_requests_travel_in_a_batch(command: Command) -> None:
    inner = Header(command, 3, Role.WORKER, 1)
    _expect("may not carry", _batch([(inner, []), (_request(Command.PULL, "a", 3, 1), [])]))


def test_entries_must_come_from_the_batch_sender() -> None:
    spoofed = _request(Command.PULL, "a", 3, 1, rank=0)
    _expect("sender", _batch([(_request(Command.PULL, "b", 3, 2), []), (spoofed, [])]))
    reply = replace_response(_request(Command.PULL, "a", 3, 1))
    _expect("direction", _batch([(reply, [])]))


def replace_response(header: Header) -> Header:
    return header.reply(Role.WORKER, header.sender_rank)


def test_only_the_batch_is_signed_and_its_tag_covers_every_entry() -> None:
    """An entry carries no tag of its own (the batch's covers the index and every payload): a signed
    entry is refused, and a change to any entry's bytes fails the batch's tag."""
    sender, receiver = session_pair()
    signed_entry = seal(encode_header(_request(Command.PULL, "a", 3, 1)), [], sender)
    index = encode_batch_index([signed_entry])
    _expect("tag of its own", [encode_header(BATCH, 1, len(index)), index])
    value = tensor_bytes(torch.arange(3, dtype=torch.float32))
    entries = [(_request(Command.PUSH, "a", 3, 1), [value]), (_request(Command.PULL, "b", 3, 2), [])]
    frames = _batch(entries, sender)
    tampered = bytearray(value)
    tampered[0] ^= 1
    _expect("bad message tag", [*frames[:2], memoryview(tampered)], receiver)
    other = bytearray(frames[1])
    other[-1] ^= 1  # the last entry's key: still a well-formed batch, with another key
    _expect("bad message tag", [frames[0], bytes(other), frames[2]], receiver)
    assert [m.header.key for m in _split(frames, receiver)] == ["a", "b"]  # untouched: accepted, once
    _expect("replayed", frames, receiver)


def test_decode_batch_index_refuses_a_message_that_is_no_batch() -> None:
    with pytest.raises(ProtocolError, match="not a batch"):
        decode_batch_index(_request(Command.PULL, "a", 3, 1), b"")


# -- over ZeroMQ ------------------------------------------------------------------------------------


@pytest.fixture(params=[b"", SECRET], ids=["unsigned", "signed"])
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[ServerTransport, WorkerTransport]]:
    """A server and a worker transport after a hello (with a secret, each side holding the session)."""
    server = ServerTransport(request.param, "127.0.0.1", coalesce_bytes=1 << 20)
    worker = WorkerTransport(request.param, [f"tcp://127.0.0.1:{server.port}"], send_timeout=10.0)
    handshake(server, worker)
    yield server, worker
    worker.close()
    server.close()


def test_requests_and_replies_coalesce_and_pulls_land_in_place(pair: tuple[ServerTransport, WorkerTransport]) -> None:
    server, worker = pair
    pushed = torch.arange(4, dtype=torch.float32)
    entries = [(_request(Command.PUSH, "a", 4, 1), [tensor_bytes(pushed)], 1),
               (_request(Command.PULL, "b", 3, 2), [], 2), (_request(Command.PULL, "c", 2, 3), [], 3)]  # fmt: skip
    worker.send_batch(0, 1, entries)
    assert worker.sent == 1
    incoming = poll_until(lambda: server.poll(0.1), 3)
    assert [item.message.header.request_id for item in incoming] == [1, 2, 3]
    assert torch.equal(tensor_from_bytes(incoming[0].message.payloads[0], torch.float32, 4), pushed)
    peer = incoming[0].peer
    values = {2: torch.full((3,), 2.0), 3: torch.full((2,), 3.0)}
    for item in incoming:
        header = item.message.header
        payloads = [tensor_bytes(values[header.request_id])] if header.command is Command.PULL else []
        server.reply(peer, header, 0, payloads)
    assert server.sent == 0  # held until the flush
    server.flush()
    assert server.sent == 1
    outs = {2: torch.zeros(3), 3: torch.zeros(2)}

    def landing(_: int, header: Header) -> memoryview | None:
        return tensor_bytes(outs[header.request_id]) if header.request_id in outs else None

    replies = poll_until(lambda: worker.poll(0.1, landing), 3)
    assert worker.received == 1
    assert [reply.message.header.request_id for reply in replies] == [1, 2, 3]
    assert [reply.message.landed for reply in replies] == [False, True, True]
    assert torch.equal(outs[2], values[2]) and torch.equal(outs[3], values[3])


def test_a_reply_past_the_bound_goes_out_and_control_messages_keep_their_order(
        pair: tuple[ServerTransport, WorkerTransport]) -> None:  # fmt: skip
    server, worker = pair
    server.coalesce_bytes = 16
    worker.send(0, _request(Command.PULL, "a", 2, 1), [], request_id=1)
    (item,) = poll_until(lambda: server.poll(0.1), 1)
    server.reply(item.peer, item.message.header, 0, [tensor_bytes(torch.ones(2))])  # 8 bytes: held
    assert server.sent == 0
    server.send(item.peer, Header(Command.ABORT, 0, Role.SERVER, 0, response=True), [memoryview(b"stop")])
    assert server.sent == 2  # the held reply first, then the abort
    server.reply(item.peer, item.message.header, 0, [tensor_bytes(torch.ones(8))])  # 32 bytes: at once
    assert server.sent == 3
    replies = poll_until(lambda: worker.poll(0.1), 3)
    assert [reply.message.header.command for reply in replies] == [Command.PULL, Command.ABORT, Command.PULL]


_AUTHENTICATORS: list[Any] = []  # the ZAP threads of _router_to's routers, stopped by _stop_router


def _stop_router(context: zmq.Context) -> None:
    while _AUTHENTICATORS:
        _AUTHENTICATORS.pop().stop()
    context.destroy(linger=0)


def _router_to(secret: bytes = b"") -> tuple[zmq.Context, zmq.Socket, bytes, WorkerTransport]:
    """A raw ROUTER standing in for a server, a worker transport connected to it (with a secret, holding
    the session of ``session_pair``), and the routing id the ROUTER gave the worker."""
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    if secret:  # the worker logs in with PLAIN (a password from the job's key), as to a real server
        _AUTHENTICATORS.append(admit_with_password(router, context, password_of(attempt_key(secret, restart_count()))))
    port = router.bind_to_random_port("tcp://127.0.0.1")
    worker = WorkerTransport(secret, [f"tcp://127.0.0.1:{port}"], send_timeout=10.0)
    if secret:
        worker.open_session(0, WORKER_NONCE, SERVER_NONCE, 1)
    worker.send(0, Header(Command.HEARTBEAT, 0, Role.WORKER, 1))  # so that the router knows the peer
    router.setsockopt(zmq.RCVTIMEO, 10_000)
    peer = router.recv_multipart()[0]
    return context, router, peer, worker


@pytest.mark.parametrize("damage", ["fewer frames", "more frames", "wrong size", "bad index"])
def test_a_hostile_batch_reply_is_rejected_without_losing_the_good_entries(damage: str) -> None:
    context, router, peer, worker = _router_to()
    try:
        requests = [_request(Command.PULL, "a", 2, 1), _request(Command.PULL, "b", 2, 2)]
        replies = [(encode_reply(request, 0, 1, 8), [tensor_bytes(torch.full((2,), float(n)))])
                   for n, request in enumerate(requests, start=1)]  # fmt: skip
        index = encode_batch_index([head for head, _ in replies])
        frames: list[Any] = [index, replies[0][1][0], replies[1][1][0]]
        if damage == "fewer frames":
            frames = frames[:-1]
        elif damage == "more frames":
            frames.append(b"extra")
        elif damage == "wrong size":
            frames[2] = b"\0" * 12
        else:
            frames[0] = index[:-3]
        batch = Header(Command.BATCH, 0, Role.SERVER, 0, response=True)
        head = encode_header(batch, 3, len(index) + 16)
        router.send_multipart([peer, head, *frames])
        outs = [torch.zeros(2), torch.zeros(2)]

        def landing(_: int, header: Header) -> memoryview | None:
            return tensor_bytes(outs[header.request_id - 1])

        received = poll_until(lambda: worker.poll(0.1, landing), 1 if damage == "bad index" else 2)
        good = [item for item in received if item.message is not None]
        bad = [item for item in received if item.message is None]
        assert bad and all(isinstance(item.error, ProtocolError) for item in bad)
        if damage == "bad index":
            assert not good
        else:
            assert good[0].message.header.request_id == 1 and torch.equal(outs[0], torch.full((2,), 1.0))
            if damage == "more frames":
                assert len(good) == 2 and torch.equal(outs[1], torch.full((2,), 2.0))
    finally:
        worker.close()
        _stop_router(context)


@pytest.mark.parametrize("tampered", [False, True])
def test_a_signed_batch_reply_is_accepted_or_rejected_whole(tampered: bool) -> None:
    """With a secret, a batch reply's entries complete only if the batch's tag checks out over all of
    them (each may already have landed in its pull's output, which nobody reads before completion)."""
    context, router, peer, worker = _router_to(SECRET)
    try:
        _, server_session = session_pair(worker.secret)  # the job's key for this start, as the worker holds it
        requests = [_request(Command.PULL, "a", 2, 1), _request(Command.PULL, "b", 2, 2)]
        values: list[Any] = [tensor_bytes(torch.full((2,), float(n))) for n in (1, 2)]
        index = encode_batch_index([encode_reply(request, 0, 1, 8) for request in requests])
        batch = Header(Command.BATCH, 0, Role.SERVER, 0, response=True)
        head = seal(encode_header(batch, 3, len(index) + 16), [index, *values], server_session)
        sent = [index, values[0], b"\0" * 8 if tampered else values[1]]  # same sizes, other bytes
        router.send_multipart([peer, head, *sent])
        outs = [torch.zeros(2), torch.zeros(2)]

        def landing(_: int, header: Header) -> memoryview | None:
            return tensor_bytes(outs[header.request_id - 1])

        received = poll_until(lambda: worker.poll(0.1, landing), 1)
        if tampered:
            assert len(received) == 1 and received[0].message is None
            assert "bad message tag" in str(received[0].error)
        else:
            assert [item.message.header.request_id for item in received if item.message is not None] == [1, 2]
            assert torch.equal(outs[1], torch.full((2,), 2.0))
    finally:
        worker.close()
        _stop_router(context)


# -- grouping ---------------------------------------------------------------------------------------


def _submission(server: int, nbytes: int, tag: int) -> Any:
    header = _request(Command.PUSH, str(tag), nbytes // 4, tag)
    return (server, header, [memoryview(b"\0" * nbytes)] if nbytes else [], None, None)


def test_grouping_keeps_each_servers_order_within_the_bounds() -> None:
    requests = [_submission(n % 2, 100 * (n % 3), n) for n in range(40)]
    groups = coalesced(requests, 250)
    assert sorted(request[1].request_id for group in groups for request in group) == list(range(40))
    for group in groups:
        assert len({request[0] for request in group}) == 1
        ids = [request[1].request_id for request in group]
        assert ids == sorted(ids)
        assert len(group) == 1 or sum(memoryview(request[2][0]).nbytes for request in group if request[2]) <= 250
    for server in (0, 1):
        order = [request[1].request_id for group in groups for request in group if request[0] == server]
        assert order == sorted(order)
    assert all(len(group) == 1 for group in coalesced(requests, 0))
    assert [len(group) for group in coalesced([_submission(0, 1000, 1), _submission(0, 4, 2)], 256)] == [1, 1]
    many = coalesced([_submission(0, 0, n) for n in range(MAX_BATCH_ENTRIES + 3)], 1 << 20)
    assert [len(group) for group in many] == [MAX_BATCH_ENTRIES, 3]
