"""Authentication of whole messages (``auth``): session tags in both directions, every kind of change
to a message rejected, the replay window, the handshake tag, and the transports doing the checks over
a real ZeroMQ connection on 127.0.0.1 (sessions per connection, replays, the frame size limit)."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import torch
import zmq
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from zmq.utils.monitor import recv_monitor_message

from tandem.kvstore.errors import ProtocolError
from tandem.kvstore.ps.auth import (
    ONE_CALL_BYTES,
    TAG_BYTES,
    DirectionKeys,
    ReplayWindow,
    Session,
    _session_tag,
    handshake_tag,
)
from tandem.kvstore.ps.curve import password_of, present_password
from tandem.kvstore.ps.protocol import (
    Command,
    Header,
    Role,
    decode,
    decode_header,
    encode_header,
    seal,
    split_tag,
    tensor_bytes,
    tensor_from_bytes,
)
from tandem.kvstore.ps.transport import ServerTransport, WorkerTransport, _Endpoint
from tests.unit.ps_wire import SECRET, SERVER_NONCE, WORKER_NONCE, handshake, poll_until, session_pair

PUSH = Header(Command.PUSH, 7, Role.WORKER, 1, key="w", dtype=torch.float32, shape=(3,), slice_stop=3)
HELLO = Header(Command.HELLO, 1, Role.WORKER, 1)


def _frames(sender: Session, payloads: Sequence[Any], header: Header = PUSH) -> tuple[int, bytes, bytes]:
    """A message of ``header`` and ``payloads`` sealed by ``sender``: its sequence number, body and tag."""
    frame = seal(encode_header(header, len(payloads), sum(memoryview(p).nbytes for p in payloads)), payloads, sender)
    return (decode_header(frame).sequence, *split_tag(frame))


# -- sessions ---------------------------------------------------------------------------------------


def test_a_session_round_trips_in_both_directions_with_a_key_per_direction() -> None:
    worker, server = session_pair()
    payloads = [b"abcd", memoryview(bytearray(b"efgh" * 2))]
    sequence, body, tag = _frames(worker, payloads)
    assert sequence == 1 and len(tag) == TAG_BYTES
    assert server.check(sequence, body, tag, payloads) is None
    answer = _frames(server, payloads)
    assert answer[0] == 1  # each side numbers its own messages
    assert worker.check(*answer, payloads) is None
    assert worker.tag(1, body, payloads) != server.tag(1, body, payloads)  # one key per direction
    reflected = worker.tag(2, body, payloads)  # a worker's own message sent back to it
    assert worker.check(2, body, reflected, payloads) is not None
    other_rank = Session(SECRET, WORKER_NONCE, SERVER_NONCE, 2, is_server=True)  # the rank is part of the key
    assert other_rank.check(*_frames(worker, payloads), payloads) is not None


# small: tagged in one AEAD call; large: covered in ONE_CALL_BYTES or more, 67 bytes past a multiple of
# 128 (streamed through Poly1305 as its 128-byte rounds and the rest)
SIZES = {"small": (3, 4), "large": (3, ONE_CALL_BYTES + 128 + 67)}


def _patterned(sizes: Sequence[int]) -> list[bytes]:
    """A payload per size, each part its own repeating byte pattern."""
    return [(bytes(range(part, part + 251)) * (size // 251 + 1))[:size] for part, size in enumerate(sizes)]


def _payloads(size: str) -> list[bytes]:
    return _patterned(SIZES[size])


def _flip(data: bytes, at: int) -> bytes:
    changed = bytearray(data)
    changed[at] ^= 1
    return bytes(changed)


@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize("change", ["last payload byte", "first payload byte", "header byte",
                                    "bytes moved between frames", "wrong secret", "sequence number",
                                    "a frame dropped"])  # fmt: skip
def test_a_changed_message_is_rejected_and_the_genuine_one_still_accepted(change: str, size: str) -> None:
    worker, server = session_pair()
    payloads = _payloads(size)
    assert (size == "large") == (sum(map(len, payloads)) >= ONE_CALL_BYTES)
    sequence, body, tag = _frames(worker, payloads)
    checker, got_sequence, got_body, got = server, sequence, body, list(payloads)
    if change == "last payload byte":
        got[1] = _flip(got[1], -1)
    elif change == "first payload byte":
        got[1] = _flip(got[1], 0)
    elif change == "header byte":
        changed = bytearray(body)
        changed[8] ^= 1  # the request id
        got_body = bytes(changed)
    elif change == "bytes moved between frames":  # the same bytes in the same order: only the lengths tell
        joined = b"".join(payloads)
        got = [joined[: len(payloads[0]) + 1], joined[len(payloads[0]) + 1 :]]
    elif change == "wrong secret":
        checker = session_pair(b"not the secret")[1]
    elif change == "sequence number":
        got_sequence = sequence + 1
    else:
        got = got[:1]
    problem = checker.check(got_sequence, got_body, tag, got)
    assert problem is not None and "bad message tag" in problem
    assert server.check(sequence, body, tag, payloads) is None  # a rejected message used up no number


@pytest.mark.parametrize("sizes", [(), (0,), (15, 16), (1023,), (1024 + 64,), (128 * 10,), (1000, 1000, 1000),
                                   (ONE_CALL_BYTES - 100,), (ONE_CALL_BYTES,), (ONE_CALL_BYTES + 64, 5, 0),
                                   (1, 2, ONE_CALL_BYTES // 2, ONE_CALL_BYTES // 2 + 127)], ids=str)  # fmt: skip
@pytest.mark.parametrize("key", ["w", "k" * 1000])  # a long key makes the header body a larger part
def test_every_size_round_trips_and_a_flipped_byte_anywhere_is_caught(sizes: tuple[int, ...], key: str) -> None:
    worker, server = session_pair()
    payloads = _patterned(sizes)
    header = Header(Command.PUSH, 7, Role.WORKER, 1, key=key, dtype=torch.uint8, shape=(1,), slice_stop=1)
    sequence, body, tag = _frames(worker, payloads, header)
    for part, payload in enumerate(payloads):
        for at in {0, 127, len(payload) // 2, len(payload) - 1} & set(range(len(payload))):
            changed = [*payloads[:part], _flip(payload, at), *payloads[part + 1 :]]
            assert "bad message tag" in str(server.check(sequence, body, tag, changed)), (part, at)
    assert "bad message tag" in str(server.check(sequence, _flip(body, -1), tag, payloads))
    assert server.check(sequence, body, tag, payloads) is None


def _documented_tag(key: bytes, sequence: int, body: bytes, payloads: list[bytes]) -> bytes:
    """The session tag as docs/security.md states it, built without ``auth``'s helpers: ChaCha20-Poly1305
    (RFC 8439) with the sequence number as nonce, an empty plaintext, and as associated data the part
    count and each part's length (8 bytes each, little-endian), then the parts, then zeros to a multiple
    of 128 bytes."""
    parts = [body, *payloads]
    associated = b"".join([len(parts).to_bytes(8, "little"), *(len(part).to_bytes(8, "little") for part in parts), *parts])
    associated += bytes(-len(associated) % 128)
    return ChaCha20Poly1305(key).encrypt(sequence.to_bytes(12, "little"), b"", associated)


def _as(kind: str, data: bytes) -> Any:
    """``data`` as a payload of ``kind``: bytes, a 2-D float32 memoryview, or a received zmq.Frame."""
    if kind == "floats" and len(data) % 8 == 0:
        return memoryview(bytearray(data)).cast("f", (2, len(data) // 8))
    return zmq.Frame(data) if kind == "frame" else data


# one AEAD call; streamed: a big part 67 bytes past a round, several big parts, a covered size of exactly
# ONE_CALL_BYTES (40-byte body, 24 bytes of lengths), a big part that starts on a 128-byte round (32 + 40 + 56)
@pytest.mark.parametrize("sizes", [(3,), (5000,), (ONE_CALL_BYTES + 67, 3), (ONE_CALL_BYTES // 2 + 8, ONE_CALL_BYTES // 2 + 296),
                                   (ONE_CALL_BYTES - 64,), (56, ONE_CALL_BYTES)], ids=str)  # fmt: skip
@pytest.mark.parametrize("kind", ["bytes", "floats", "frame"])
def test_tags_are_the_documented_construction(sizes: tuple[int, ...], kind: str) -> None:
    """One AEAD call or streamed through Poly1305, the tag is the construction the docs state, so that a
    change to what is covered cannot pass by changing both sides at once."""
    key, body = bytes(range(32)), bytes(range(40))
    payloads = _patterned(sizes)
    tag = _session_tag(DirectionKeys(key), 300, body, [_as(kind, payload) for payload in payloads])
    assert tag == _documented_tag(key, 300, body, payloads)


def test_the_handshake_tag_is_the_documented_construction() -> None:
    body = bytes(range(40))
    associated = b"".join([(2).to_bytes(8, "little"), (40).to_bytes(8, "little"), (2).to_bytes(8, "little"), body, b"{}"])
    associated += bytes(128 - len(associated))
    assert handshake_tag(b"secret", body, [b"{}"]) == hmac.digest(b"secret", associated, hashlib.sha256)[:TAG_BYTES]


def test_one_time_keys_are_rfc_8439s_and_one_per_nonce() -> None:
    """RFC 8439 section 2.6.2's test vector, then: one key per nonce, the same on both sides."""
    key = bytes.fromhex("808182838485868788898a8b8c8d8e8f909192939495969798999a9b9c9d9e9f")
    expected = "8ad5a08b905f81cc815040274ab29471a833b637e3fd0da508dbb8e2fdd1a646"
    assert DirectionKeys(key).one_time(bytes.fromhex("000000000001020304050607")).hex() == expected
    made = [DirectionKeys(key).one_time(number.to_bytes(12, "little")) for number in (1, 2, 2**40)]
    assert len(set(made)) == 3 and DirectionKeys(key).one_time((2).to_bytes(12, "little")) == made[1]


def test_the_replay_window_accepts_each_number_once_within_its_size() -> None:
    worker, server = session_pair()
    body = encode_header(PUSH)

    def check(sequence: int) -> str | None:
        return server.check(sequence, body, worker.tag(sequence, body, []), [])

    assert check(1) is None
    assert "replayed" in str(check(1))
    for sequence in (5, 3, 4, 2):  # out of order within the window: each once
        assert check(sequence) is None
    assert all("replayed" in str(check(sequence)) for sequence in (2, 3, 4, 5))
    top = 10 + ReplayWindow.SIZE
    assert check(top) is None
    assert "too old" in str(check(top - ReplayWindow.SIZE))  # out of the window: never seen, still refused
    assert check(top - ReplayWindow.SIZE + 1) is None  # the oldest number the window holds
    assert check(6) is not None and check(0) is not None


def test_a_replay_window_edge_cases() -> None:
    window = ReplayWindow()
    assert not window.accept(0) and not window.accept(-1)
    assert window.accept(3 * ReplayWindow.SIZE)  # a jump beyond the window forgets what it saw
    assert not window.accept(3 * ReplayWindow.SIZE)
    assert window.accept(3 * ReplayWindow.SIZE - 1) and not window.accept(2 * ReplayWindow.SIZE)


def test_a_handshake_tag_needs_the_secret_and_covers_the_payloads() -> None:
    body, tag = split_tag(seal(encode_header(HELLO, 1, 2), [b"{}"], secret=SECRET))
    assert tag == handshake_tag(SECRET, body, [b"{}"])
    assert tag != handshake_tag(b"wrong", body, [b"{}"])
    assert tag != handshake_tag(SECRET, body, [b"{ }"]) and tag != handshake_tag(SECRET, body, [b"{", b"}"])


# -- where the transports check ---------------------------------------------------------------------


@pytest.fixture
def endpoint() -> Iterator[_Endpoint]:
    """The checks every transport runs on what it receives, with ``SECRET``."""
    checker = _Endpoint(SECRET, 2**62, None)
    yield checker
    checker.close()


def _authenticate(checker: _Endpoint, session: Session | None, frame: bytes, payloads: Sequence[Any] = ()) -> None:
    checker._authenticate(session, frame, decode_header(frame), payloads)


def test_the_transport_rejects_what_is_not_signed_as_the_job_requires(endpoint: _Endpoint) -> None:
    hello = encode_header(HELLO, 1, 2)
    _authenticate(endpoint, None, seal(hello, [b"{}"], secret=endpoint.secret), [b"{}"])  # a hello needs no session
    with pytest.raises(ProtocolError, match="bad hello tag"):
        _authenticate(endpoint, None, seal(hello, [b"{}"], secret=b"wrong"), [b"{}"])
    with pytest.raises(ProtocolError, match="unauthenticated"):
        _authenticate(endpoint, None, hello)
    worker, server = session_pair()
    push = encode_header(PUSH, 0, 0)
    with pytest.raises(ProtocolError, match="without a session"):
        _authenticate(endpoint, None, seal(push, [], worker))
    with pytest.raises(ProtocolError, match="bad message tag"):
        _authenticate(endpoint, server, seal(push, [], session_pair(b"wrong")[0]))
    with pytest.raises(ProtocolError, match="bad message tag"):  # a hello-style tag is no session tag
        _authenticate(endpoint, server, seal(push, [], secret=SECRET))
    signed = seal(push, [], worker)
    _authenticate(endpoint, server, signed)
    with pytest.raises(ProtocolError, match="replayed"):
        _authenticate(endpoint, server, signed)
    unsigned = _Endpoint(b"", 2**62, None)
    try:
        _authenticate(unsigned, None, push)
        with pytest.raises(ProtocolError, match="no TANDEM_PS_SECRET"):
            _authenticate(unsigned, None, seal(hello, [b"{}"], secret=SECRET), [b"{}"])
    finally:
        unsigned.close()


def test_sealing_needs_a_session_except_for_the_handshake(endpoint: _Endpoint) -> None:
    assert endpoint._seal(None, encode_header(HELLO), []) != encode_header(HELLO)
    with pytest.raises(ProtocolError, match="no authenticated session"):
        endpoint._seal(None, encode_header(PUSH), [])


@pytest.fixture
def secured() -> Iterator[tuple[ServerTransport, WorkerTransport, bytes]]:
    """A server and a worker transport with ``SECRET`` after a hello (both holding the session), and
    the worker's routing id."""
    server = ServerTransport(SECRET, "127.0.0.1")
    worker = WorkerTransport(SECRET, [f"tcp://127.0.0.1:{server.port}"], send_timeout=10.0)
    peer = handshake(server, worker)
    yield server, worker, peer
    worker.close()
    server.close()


def test_a_session_message_goes_through_and_its_replays_are_rejected(
        secured: tuple[ServerTransport, WorkerTransport, bytes], monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    server, worker, peer = secured
    assert set(server.sessions) == {peer} and worker.sessions[0] is not None
    transmitted: list[tuple[bytes, list[Any]]] = []
    sealing = worker._seal

    def recording(session: Any, head: bytes, payloads: Sequence[Any]) -> bytes:
        sealed = sealing(session, head, payloads)  # what goes on the wire (sealed under the socket's lock)
        transmitted.append((sealed, [bytes(payload) for payload in payloads]))
        return sealed

    monkeypatch.setattr(worker, "_seal", recording)
    value = torch.arange(3, dtype=torch.float32)
    worker.send(0, PUSH, [tensor_bytes(value)])
    (item,) = poll_until(lambda: server.poll(0.1), 1)
    assert item.error is None and item.message is not None and item.peer == peer
    assert item.message.header.signed and item.message.header.sequence == 1
    assert torch.equal(tensor_from_bytes(item.message.payloads[0], torch.float32, 3), value)
    server.reply(peer, item.message.header, 0)
    (reply,) = poll_until(lambda: worker.poll(0.1), 1)
    assert reply.error is None and reply.message is not None and reply.message.header.signed
    (head, payloads), = transmitted
    assert decode([head, *payloads]).header.sequence == 1

    stranger = zmq.Context()
    try:  # the exact frames again from another connection: its routing id has no session
        raw = stranger.socket(zmq.DEALER)
        present_password(raw, password_of(server.secret))  # even a stranger who read the password off the wire
        raw.connect(f"tcp://127.0.0.1:{server.port}")
        raw.send_multipart([head, *payloads])
        (replayed,) = poll_until(lambda: server.poll(0.1), 1)
        assert replayed.peer != peer and replayed.message is None
        assert "without a session" in str(replayed.error)
    finally:
        stranger.destroy(linger=0)
    with worker._locks[0]:  # and on the worker's own connection: the number was seen
        worker.sockets[0].send_multipart([head, *payloads])
    (again,) = poll_until(lambda: server.poll(0.1), 1)
    assert again.peer == peer and again.message is None and "replayed" in str(again.error)
    worker.send(0, PUSH, [tensor_bytes(value)])  # the session goes on
    (later,) = poll_until(lambda: server.poll(0.1), 1)
    assert later.message is not None and later.message.header.sequence == 2
    server.close_session(peer)
    with pytest.raises(ProtocolError, match="no authenticated session"):
        server.reply(peer, later.message.header, 0)


def test_a_frame_above_the_limit_drops_its_sender_before_it_is_buffered() -> None:
    limit = 2**20
    server = ServerTransport(b"", "127.0.0.1", max_frame_bytes=limit)
    monitor = server.socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    monitor.setsockopt(zmq.RCVTIMEO, 10_000)
    context = zmq.Context()
    try:
        raw = context.socket(zmq.DEALER)
        raw.connect(f"tcp://127.0.0.1:{server.port}")
        fits = bytes(limit)
        raw.send_multipart([encode_header(PUSH, 1, limit), fits])  # at the limit: delivered
        (item,) = poll_until(lambda: server.poll(0.1), 1)
        assert item.error is None and item.message is not None
        raw.send_multipart([encode_header(PUSH, 1, limit + 1), bytes(limit + 1)])
        assert recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED
        assert server.poll(0.5) == []  # nothing of it reached the poll
    finally:
        context.destroy(linger=0)
        server.socket.disable_monitor()
        monitor.close(linger=0)
        server.close()
