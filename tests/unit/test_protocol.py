"""The wire format: round trips, and every malformed header rejected with a named reason."""

from __future__ import annotations

import json
import struct
from dataclasses import replace
from enum import IntEnum

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.kvstore.errors import ProtocolError
from tandem.kvstore.ps.auth import TAG_BYTES, Session, handshake_tag
from tandem.kvstore.ps.protocol import (
    FIXED,
    Command,
    Header,
    Role,
    decode,
    decode_header,
    encode_header,
    encode_reply,
    is_handshake,
    seal,
    split_tag,
    state_from_payloads,
    state_payloads,
    tensor_bytes,
    tensor_from_bytes,
)


def _push(key: int | str = "w", shape: tuple[int, ...] = (7, 3, 5), **changes: object) -> Header:
    fields: dict[str, object] = dict(command=Command.PUSH, request_id=42, sender_role=Role.WORKER, sender_rank=1,
                                     key=key, priority=-3, dtype=torch.float32, shape=shape, slice_start=0,
                                     slice_stop=105, payload_count=1, payload_nbytes=420)  # fmt: skip
    fields.update(changes)
    return Header(**fields)  # type: ignore[arg-type]


def _signed(frame: bytes, secret: bytes, payloads: list[object] | None = None) -> bytes:
    """``frame`` as a job with ``secret`` sends it: sealed under a fresh session (sequence number 1),
    or unsigned without a secret."""
    if not secret:
        return frame
    return seal(frame, payloads or [], Session(secret, b"w" * 16, b"s" * 16, 1, is_server=False))


@pytest.mark.parametrize("key", [0, 17, -5, "layer.0.weight", "ключ"])
@pytest.mark.parametrize("secret", [b"", b"s3cret"])
@pytest.mark.parametrize("receipt", [False, True])
@pytest.mark.parametrize("compressed", [False, True])
def test_header_round_trip(key: int | str, secret: bytes, receipt: bool, compressed: bool) -> None:
    header = _push(key, receipt=receipt, compressed=compressed)
    decoded = decode_header(_signed(encode_header(header), secret))
    assert decoded == replace(header, signed=bool(secret), sequence=1 if secret else 0)


def test_message_round_trip_views_tensor_without_copy() -> None:
    value = torch.arange(105, dtype=torch.float32).reshape(7, 3, 5)
    frames = [encode_header(_push()), tensor_bytes(value)]
    message = decode(frames)
    received = tensor_from_bytes(message.payloads[0], torch.float32, 105)
    assert torch.equal(received.reshape(7, 3, 5), value)
    assert received.data_ptr() == value.data_ptr()  # same memory: nothing was copied


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.int64, torch.bool, torch.float64])
def test_tensor_bytes_any_dtype_and_zero_dim(dtype: torch.dtype) -> None:
    value = torch.ones((), dtype=dtype)
    assert torch.equal(tensor_from_bytes(tensor_bytes(value), dtype, 1).reshape(()), value)
    assert tensor_from_bytes(tensor_bytes(torch.empty(0, dtype=dtype)), dtype, 0).numel() == 0


def _corrupt(offset_field: int, value: object) -> bytes:
    fields = list(FIXED.unpack_from(encode_header(_push(shape=(105,)))))
    fields[offset_field] = value
    return FIXED.pack(*fields) + struct.pack("<q", 105) + b"w"


@pytest.mark.parametrize(
    "frame, reason",
    [
        (b"", "shorter"),
        (b"GARBAGE" * 20, "bad magic"),
        (_corrupt(1, 99), "protocol version 99"),
        (_corrupt(2, 200), "unknown command"),
        (_corrupt(3, 0x80), "unknown flag"),
        (_corrupt(12, 77), "unknown dtype"),
        (_corrupt(13, 40), "dimensions"),
        (_corrupt(15, 106), "outside an array"),
        (_corrupt(10, 9), "unknown key kind"),
        (_corrupt(11, 5), "header length"),
    ],
    ids=lambda value: value if isinstance(value, str) else "",  # the frames carry a timestamp: stable ids for xdist
)
def test_malformed_headers_are_rejected_with_reason(frame: bytes, reason: str) -> None:
    with pytest.raises(ProtocolError, match=reason):
        decode_header(frame)


def test_payload_count_and_size_are_checked() -> None:
    header = encode_header(_push())
    with pytest.raises(ProtocolError, match="payload frames"):
        decode([header])
    with pytest.raises(ProtocolError, match="payload bytes"):
        decode([header, b"short"])
    with pytest.raises(ProtocolError, match="does not hold"):
        tensor_from_bytes(memoryview(b"abc"), torch.float32, 1)


def test_decoding_checks_the_format_only_and_seal_marks_and_tags_the_frame() -> None:
    """Whether a tag is right is the transport's check (``test_auth``): decoding only strips it."""
    header = _push()
    frame = encode_header(header)
    session = Session(b"right", b"w" * 16, b"s" * 16, 1, is_server=False)
    sealed = seal(frame, [b"x" * 420], session)
    assert len(sealed) == len(frame) + TAG_BYTES
    body, tag = split_tag(sealed)
    assert body[7] == frame[7] | 4 and body[:7] + body[32:] == frame[:7] + frame[32:]  # the SIGNED flag,
    assert body[8:24] == frame[8:24] and body[24:32] == (1).to_bytes(8, "little")  # and sequence number 1
    assert len(tag) == TAG_BYTES and decode_header(sealed) == replace(header, signed=True, sequence=1)
    assert decode_header(seal(frame, [b"x" * 420], session)).sequence == 2  # each seal takes the next number
    assert decode_header(seal(frame, [], secret=b"wrong")).signed  # a wrong tag still decodes: format only
    handshake = seal(encode_header(Header(Command.HELLO, 1, Role.WORKER, 0)), [b"{}"], secret=b"right")
    assert is_handshake(handshake) and not is_handshake(sealed) and not is_handshake(b"")
    body, tag = split_tag(handshake)
    assert tag == handshake_tag(b"right", body, [b"{}"]) != handshake_tag(b"wrong", body, [b"{}"])
    assert decode_header(handshake).sequence == 0  # a handshake is numbered by no session
    short = bytearray(frame[: FIXED.size])
    short[7] |= 4  # the SIGNED flag on a frame with no room for a tag
    with pytest.raises(ProtocolError, match="signed header of"):
        decode_header(bytes(short))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_never_crash_the_decoder(frame: bytes) -> None:
    try:
        decode_header(frame)
    except ProtocolError:
        pass


@settings(max_examples=200, deadline=None)
@given(st.integers(0, FIXED.size + 20), st.integers(0, 255))
def test_single_byte_corruption_is_caught_or_harmless(position: int, byte: int) -> None:
    frame = bytearray(encode_header(_push(shape=(105,))))
    if position < len(frame):
        frame[position] = byte
    try:
        decode_header(bytes(frame))
    except ProtocolError:
        pass


@pytest.mark.parametrize("secret", [b"", b"s3cret"])
@pytest.mark.parametrize("error", [False, True])
@pytest.mark.parametrize("compressed", [False, True])
def test_encode_reply_equals_the_reply_header(secret: bytes, error: bool, compressed: bool) -> None:
    request = _push(shape=(105,), receipt=True, compressed=True)  # a reply is compressed only when it says so
    fast = decode_header(_signed(encode_reply(request, 3, 1, 420, error, compressed), secret))
    slow = request.reply(Role.SERVER, 3, error=error, payload_count=1, payload_nbytes=420, compressed=compressed)
    assert fast == replace(slow, timestamp=fast.timestamp, signed=bool(secret), sequence=1 if secret else 0)


def test_key_cache_keeps_bools_and_int_subclasses_apart() -> None:
    class Layer(IntEnum):
        FIRST = 1

    assert decode_header(encode_header(_push(1))).key == 1
    with pytest.raises(TypeError, match="int or str"):
        encode_header(_push(True))  # would hit the cached entry of 1 if the cache ignored the type
    assert decode_header(encode_header(_push(Layer.FIRST))).key == 1


def test_tensor_bytes_views_memory_of_every_dtype_in_order() -> None:
    for dtype in [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
                  torch.int16, torch.int8, torch.uint8, torch.bool]:  # fmt: skip
        value = (torch.arange(24) % 3).to(dtype).reshape(2, 3, 4)
        view = tensor_bytes(value)
        assert (view.format, view.ndim, view.nbytes) == ("B", 1, 24 * value.element_size())
        assert bytes(view) == value.reshape(-1).view(torch.uint8).numpy().tobytes()
    with pytest.raises(ValueError, match="contiguous"):
        tensor_bytes(torch.ones(4, 4).t())


def test_slot_state_round_trips_and_bad_tables_are_rejected() -> None:
    value = torch.linspace(0, 1, 6)
    state = {"step": torch.tensor(3.0), "exp_avg": torch.arange(6.0), "flags": torch.ones(2, 3, dtype=torch.bool)}
    frames = [memoryview(bytearray(frame)) for frame in state_payloads(value, state)]  # as received: copies
    got_value, got_state = state_from_payloads(frames, torch.float32, 6)
    assert torch.equal(got_value, value) and got_state.keys() == state.keys()
    assert all(torch.equal(got_state[name], tensor) for name, tensor in state.items())
    good = [["exp_avg", 1, [6]], ["flags", 10, [2, 3]], ["step", 1, []]]  # sorted by name, as sent
    assert json.loads(bytes(frames[0])) == good
    for table, reason in [(b"not json", "not JSON"), (b"[]", "one entry per state frame"),
                          ([good[0], good[1], ["step", 99, []]], "unknown dtype code"),
                          ([good[0], good[1], ["step", 1, [-1]]], "bad optimizer state entry"),
                          ([good[0], good[1], ["step", 1, [2**62, 0]]], "bad optimizer state entry"),
                          ([good[0], good[1], "step"], "bad optimizer state entry"),
                          ([good[0], good[1], ["exp_avg", 1, [6]]], "listed twice"),
                          ([good[0], good[1], ["step", 1, [2]]], "does not hold")]:  # fmt: skip
        raw = table if isinstance(table, bytes) else json.dumps(table).encode()
        with pytest.raises(ProtocolError, match=reason):
            state_from_payloads([memoryview(bytearray(raw)), *frames[1:]], torch.float32, 6)
    with pytest.raises(ProtocolError, match="does not hold"):
        state_from_payloads(frames, torch.float32, 7)


@pytest.mark.parametrize("secret", [b"", b"s3cret"])
def test_a_reused_header_is_packed_once_and_sent_with_each_request_id(secret: bytes) -> None:
    header = _push()
    sent = replace(header, signed=bool(secret), sequence=1 if secret else 0)  # as it arrives
    first = decode_header(_signed(encode_header(header, request_id=7), secret))
    second = decode_header(_signed(encode_header(header, request_id=8), secret))
    assert (first.request_id, second.request_id) == (7, 8)
    assert first == replace(sent, request_id=7) and second == replace(sent, request_id=8)
    resized = decode_header(_signed(encode_header(header, payload_count=2, payload_nbytes=9), secret))
    assert (resized.payload_count, resized.payload_nbytes) == (2, 9)  # a different size is packed anew
    assert decode_header(_signed(encode_header(header), secret)) == sent  # and the first size still holds


def test_a_header_decoded_again_equals_a_fresh_parse() -> None:
    """A frame seen before is looked up, not parsed: the result must not tell the difference."""
    header = _push(key="cached-key", shape=(105,), receipt=True)
    first = decode_header(encode_header(header, request_id=1))
    again = decode_header(encode_header(replace(header, timestamp=5.0), request_id=2))  # looked up
    assert again == replace(first, request_id=2, timestamp=5.0) and again is not first
    assert decode_header(encode_header(header, request_id=3)).request_id == 3 and first.request_id == 1
    frame = bytearray(encode_header(header, request_id=4))
    struct.pack_into("<d", frame, 16, float("nan"))  # the timestamp, which the lookup skips
    with pytest.raises(ProtocolError, match="timestamp is not finite"):
        decode_header(bytes(frame))
    changed = decode_header(encode_header(replace(header, priority=9)))
    assert changed.priority == 9  # any other byte differing is another header


def test_a_signed_header_is_looked_up_by_its_format_and_its_tag_checked_every_time() -> None:
    """A signed frame seen before is looked up like an unsigned one (its tag and sequence number are
    not part of the lookup), and its tag is still checked per message: changing the request id under
    the same tag decodes, but the session refuses it."""
    header = _push(key="signed-key", shape=(105,))
    sender = Session(b"s3cret", b"w" * 16, b"s" * 16, 1, is_server=False)
    receiver = Session(b"s3cret", b"w" * 16, b"s" * 16, 1, is_server=True)
    for request_id in (1, 2):
        frame = seal(encode_header(header, request_id=request_id), [], sender)
        decoded = decode_header(frame)
        assert (decoded.request_id, decoded.sequence, decoded.signed) == (request_id, request_id, True)
        assert receiver.check(decoded.sequence, *split_tag(frame), []) is None
    forged = bytearray(seal(encode_header(header, request_id=3), [], sender))
    struct.pack_into("<Q", forged, 8, 4)  # another request id under the same tag
    assert decode_header(bytes(forged)).request_id == 4  # well-formed: decoding says nothing about the tag
    problem = receiver.check(3, *split_tag(bytes(forged)), [])
    assert problem is not None and "bad message tag" in problem


@pytest.mark.parametrize("error", [False, True])
def test_replies_packed_once_carry_each_request_id(error: bool) -> None:
    request = decode_header(encode_header(_push(key="reply-key", shape=(105,)), request_id=5))
    for request_id, count, nbytes in [(5, 1, 420), (6, 1, 420), (7, 0, 0)]:
        asked = replace(request, request_id=request_id)
        asked.__dict__["_replies"] = request.__dict__["_replies"]  # as decode_header shares it
        reply = decode_header(encode_reply(asked, 2, count, nbytes, error))
        slow = asked.reply(Role.SERVER, 2, error=error, payload_count=count, payload_nbytes=nbytes)
        assert reply == replace(slow, timestamp=reply.timestamp)
