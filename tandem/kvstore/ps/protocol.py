"""Wire format of the parameter server: an explicit, versioned binary header plus raw tensor frames.

Why not pickle: unpickling bytes from the network runs whatever code the sender chose. Every header
field here is a fixed-width integer or a length-prefixed UTF-8 string, validated on receipt, so a
hostile or confused peer can at worst get its message rejected.

A message is a ZeroMQ multipart message ``[header, payload_0, ..., payload_{n-1}]``. The header is
the fixed part ``FIXED`` (little-endian), then ``ndim`` int64 dimensions, then the key's UTF-8
bytes, then, when the message is signed (a job with ``TANDEM_PS_SECRET``), a 16-byte tag over the
header and every payload frame (``seal``; the keys and the replay check are ``auth``'s). Payloads
are tensor bytes (sent zero-copy) or, for control commands, UTF-8 JSON / text.
"""

from __future__ import annotations

import functools
import json
import math
import re
import struct
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import IntEnum, IntFlag
from typing import Any, ParamSpec, TypeVar

import torch

from tandem.kvstore.errors import ProtocolError
from tandem.kvstore.ps.auth import TAG_BYTES, Session, handshake_tag

MAGIC = b"TDKV"
VERSION = 8  # 2: the RECEIPT flag (a P3 server announces a parked request only when asked); 3: TAKE and PUT;
# 4: the COMPRESSED flag (gradient compression, tandem.kvstore.compression); 5: BATCH; 6: sequence numbers,
# tags over whole messages; 7: one-time keys from a ChaCha20 keystream; 8: every session tag ChaCha20-Poly1305
MAC_BYTES = TAG_BYTES
MAX_NDIM = 16
MAX_KEY_BYTES = 1024
MAX_PAYLOADS = 8
MAX_BATCH_ENTRIES = 127  # messages coalesced into one BATCH
MAX_BATCH_PAYLOADS = 1 + 2 * MAX_BATCH_ENTRIES  # its index frame, then at most 2 frames per entry (a u8 field)

# magic, version, command, flags, request_id, timestamp, sequence, sender_role, sender_rank, priority,
# key_kind, key_len, dtype, ndim, slice_start, slice_stop, payload_count, payload_nbytes
FIXED = struct.Struct("<4sHBBQdQBHiBHBBqqBQ")
_COMMAND_OFFSET, _FLAGS_OFFSET, _ID_OFFSET = 6, 7, 8  # where FIXED puts them; the id is followed by the timestamp
_ID_AND_TIME = struct.Struct("<Qd")
_SEQUENCE = struct.Struct("<Q")
_SEQUENCE_OFFSET = _ID_OFFSET + _ID_AND_TIME.size
_TIME_END = _SEQUENCE_OFFSET + _SEQUENCE.size  # the end of what changes per message: id, timestamp, sequence

Key = int | str
_P = ParamSpec("_P")
_R = TypeVar("_R")

# torch.frombuffer warns on read-only buffers (ZeroMQ frames); we only ever read received tensors
# or copy them, so the warning is noise on every message.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)


class Command(IntEnum):
    HELLO = 1
    BYE = 2
    HEARTBEAT = 3
    INIT = 4
    PUSH = 5
    PULL = 6
    PUSHPULL = 7
    SET_OPTIMIZER = 8
    BARRIER = 9
    SAVE = 10  # payloads: the directory, optionally a note; answered with the file written
    LOAD = 11  # payload: the directory; answered with the note saved with it ("" if none)
    ABORT = 12
    RECEIVED = 13  # server -> worker: the request arrived and waits for other workers (P3)
    TAKE = 14  # a slot's value and optimizer state, removed from the server (P3 moving to another slicing)
    PUT = 15  # a new slot with a value and optimizer state (where TAKE's go)
    BATCH = 16  # several data requests (or replies) to one peer in one message (``encode_batch_index``)


class Flag(IntFlag):
    RESPONSE = 1
    ERROR = 2
    SIGNED = 4
    RECEIPT = 8  # worker -> P3 server: announce RECEIVED if this request has to wait for other workers
    COMPRESSED = 16  # the value (a push's, or a reply's) travels compressed: a descriptor frame, then the data


class Role(IntEnum):
    WORKER = 0
    SERVER = 1


class KeyKind(IntEnum):
    NONE = 0
    INT = 1
    STR = 2


DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 1,
    torch.float64: 2,
    torch.float16: 3,
    torch.bfloat16: 4,
    torch.int64: 5,
    torch.int32: 6,
    torch.int16: 7,
    torch.int8: 8,
    torch.uint8: 9,
    torch.bool: 10,
}
CODE_DTYPES: dict[int, torch.dtype] = {code: dtype for dtype, code in DTYPE_CODES.items()}
TENSOR_COMMANDS = frozenset({Command.INIT, Command.PUSH, Command.PULL, Command.PUSHPULL})


@dataclass(frozen=True)
class Header:
    """Everything a message says about itself; ``payload_*`` describe the frames that follow."""

    command: Command
    request_id: int
    sender_role: Role
    sender_rank: int
    key: Key | None = None
    priority: int = 0
    dtype: torch.dtype | None = None
    shape: tuple[int, ...] = ()
    slice_start: int = 0
    slice_stop: int = 0
    response: bool = False
    error: bool = False
    payload_count: int = 0
    payload_nbytes: int = 0
    timestamp: float = field(default_factory=time.time)
    receipt: bool = False  # asks for a RECEIVED notice (see Flag.RECEIPT)
    compressed: bool = False  # the value is compressed (see Flag.COMPRESSED)
    signed: bool = False  # the frame ends with a tag (decoded headers only; ``seal`` signs)
    sequence: int = 0  # the sender's number for this message within its session (signed messages)

    @property
    def slice_numel(self) -> int:
        return self.slice_stop - self.slice_start

    def describe(self) -> str:
        """A short human description for error messages, e.g. ``push of key 'w' [0, 12)``."""
        key = "" if self.key is None else f" of key {self.key!r} [{self.slice_start}, {self.slice_stop})"
        return f"{self.command.name.lower()}{key}"

    def reply(self, role: Role, rank: int, **changes: Any) -> Header:
        """The response header to this request: same command, id, key and slice."""
        fields = dict(
            command=self.command,
            request_id=self.request_id,
            sender_role=role,
            sender_rank=rank,
            key=self.key,
            priority=self.priority,
            dtype=self.dtype,
            shape=self.shape,
            slice_start=self.slice_start,
            slice_stop=self.slice_stop,
            response=True,
        )
        fields.update(changes)
        return Header(**fields)  # type: ignore[arg-type]


@dataclass(slots=True)
class Message:
    header: Header
    payloads: list[memoryview]
    landed: bool = False  # the one payload was received straight into the requester's buffer
    frames: list[Any] | None = None  # the received zmq.Frames behind ``payloads``, if any


_KEY_CACHE: dict[Key, tuple[int, bytes]] = {}  # a job has few keys; encoding one per message showed up
_KEY_CACHE_LIMIT = 65536


def _encode_key(key: Key | None) -> tuple[int, bytes]:
    if key is None:
        return KeyKind.NONE, b""
    known = _KEY_CACHE.get(key) if type(key) is str or type(key) is int else None  # bool never hits
    if known is not None:
        return known
    if isinstance(key, bool) or not isinstance(key, int | str):
        raise TypeError(f"kvstore keys are int or str, got {type(key).__name__} {key!r}")
    kind, raw = (KeyKind.INT, str(key).encode()) if isinstance(key, int) else (KeyKind.STR, key.encode())
    if len(raw) > MAX_KEY_BYTES:
        raise ValueError(f"kvstore key {key!r} is longer than {MAX_KEY_BYTES} bytes; use a shorter name")
    if type(key) is str or type(key) is int:  # subclasses (IntEnum...) may print differently: not cached
        if len(_KEY_CACHE) >= _KEY_CACHE_LIMIT:
            _KEY_CACHE.clear()
        _KEY_CACHE[key] = (kind, raw)
    return kind, raw


def encode_header(header: Header, payload_count: int | None = None, payload_nbytes: int | None = None,
                  request_id: int | None = None) -> bytes:  # fmt: skip
    """The header frame for ``header``, unsigned (``seal`` signs it together with its payloads).

    ``payload_count``/``payload_nbytes``/``request_id`` override the header's (the sender knows
    them best; overriding here spares rebuilding a frozen Header per message). The frame is packed
    once per header and payload size and kept on the header: a worker sends the same request
    header (key, slice, dtype, shape) every step, and packing it was a third of a small request's
    cost; only the request id and timestamp are written anew.
    """
    count = header.payload_count if payload_count is None else payload_count
    nbytes = header.payload_nbytes if payload_nbytes is None else payload_nbytes
    packed = header.__dict__.get("_packed")  # frozen: the cache lives in the instance dict
    if packed is None or packed[0] != count or packed[1] != nbytes:
        flags = ((_RESPONSE if header.response else 0) | (_ERROR if header.error else 0)
                 | (_RECEIPT if header.receipt else 0) | (_COMPRESSED if header.compressed else 0))  # fmt: skip
        body = _pack(header.command, flags, header.sender_role, header.sender_rank, header.priority, header.key,
                     header.dtype, header.shape, header.slice_start, header.slice_stop, count, nbytes)  # fmt: skip
        packed = header.__dict__["_packed"] = (count, nbytes, body)
    return _stamp(packed[2], header.request_id if request_id is None else request_id, header.timestamp)


def encode_reply(request: Header, rank: int, payload_count: int = 0, payload_nbytes: int = 0,
                 error: bool = False, compressed: bool = False) -> bytes:  # fmt: skip
    """A server's response header to ``request`` (same command, id, key and slice) in one step.

    Equivalent to ``encode_header(request.reply(Role.SERVER, rank, error=error), ...)`` without
    building the intermediate Header: a server writes one per request. Replies to a header
    decoded from an unsigned frame are packed once and kept (``decode_header``).
    """
    replies = request.__dict__.get("_replies")
    shape = (rank, payload_count, payload_nbytes, error, compressed)
    body = None if replies is None else replies.get(shape)
    if body is None:
        flags = _RESPONSE | (_ERROR if error else 0) | (_COMPRESSED if compressed else 0)
        body = _pack(request.command, flags, Role.SERVER, rank, request.priority,
                     request.key, request.dtype, request.shape, request.slice_start, request.slice_stop,
                     payload_count, payload_nbytes)  # fmt: skip
        if replies is not None:
            if len(replies) >= _REPLIES_LIMIT:
                replies.clear()
            replies[shape] = body
    return _stamp(body, request.request_id, time.time())


def _stamp(body: bytes, request_id: int, timestamp: float) -> bytes:
    """A packed header body with its request id and timestamp written in."""
    frame = bytearray(body)
    _ID_AND_TIME.pack_into(frame, _ID_OFFSET, request_id, timestamp)
    return bytes(frame)


def is_handshake(frame: bytes) -> bool:
    """Whether an encoded header is a HELLO or the answer to one (tagged with the secret, not a session)."""
    return len(frame) > _COMMAND_OFFSET and frame[_COMMAND_OFFSET] == _HELLO


def seal(frame: bytes, payloads: Sequence[Any], session: Session | None = None, secret: bytes = b"") -> bytes:
    """``frame`` (an unsigned header) signed over itself and ``payloads``: under ``session``, with its
    next sequence number; without one (a handshake), with the shared ``secret``."""
    signed = bytearray(frame)
    signed[_FLAGS_OFFSET] |= _SIGNED
    if session is None:
        return bytes(signed) + handshake_tag(secret, signed, payloads)
    sequence = session.next_sequence()
    _SEQUENCE.pack_into(signed, _SEQUENCE_OFFSET, sequence)
    return bytes(signed) + session.tag(sequence, signed, payloads)


def split_tag(frame: bytes) -> tuple[bytes, bytes]:
    """A signed header frame's body and tag (``decode_header`` has checked it is long enough)."""
    return frame[:-MAC_BYTES], frame[-MAC_BYTES:]


def _pack(command: int, flags: int, role: int, rank: int, priority: int, key: Key | None,
          dtype: torch.dtype | None, shape: tuple[int, ...], start: int, stop: int, payload_count: int,
          payload_nbytes: int) -> bytes:  # fmt: skip
    """A header body with request id and timestamp zero and no signature (``_stamp`` writes those)."""
    key_kind, key_bytes = _encode_key(key)
    return b"".join((
        FIXED.pack(
            MAGIC, VERSION, command, flags, 0, 0.0, 0, role, rank, priority, key_kind, len(key_bytes),
            0 if dtype is None else DTYPE_CODES[dtype], len(shape), start, stop, payload_count, payload_nbytes,
        ),
        _shape_struct(len(shape)).pack(*shape),
        key_bytes,
    ))  # fmt: skip


_SHAPE_STRUCTS = [struct.Struct(f"<{ndim}q") for ndim in range(MAX_NDIM + 1)]


def _shape_struct(ndim: int) -> struct.Struct:
    if ndim > MAX_NDIM:
        raise ValueError(f"kvstore arrays have at most {MAX_NDIM} dimensions, got {ndim}")
    return _SHAPE_STRUCTS[ndim]


def _check(condition: bool, problem: str) -> None:
    if not condition:
        raise ProtocolError(problem)


def _lookup(table: dict[int, Any], value: int, what: str) -> Any:
    found = table.get(value)
    if found is None:
        raise ProtocolError(f"unknown {what} code {value}")
    return found


_COMMANDS = {int(command): command for command in Command}
_ROLES = {int(role): role for role in Role}
_KEY_KINDS = {int(kind): kind for kind in KeyKind}
_RESPONSE, _ERROR, _SIGNED, _RECEIPT = int(Flag.RESPONSE), int(Flag.ERROR), int(Flag.SIGNED), int(Flag.RECEIPT)
_COMPRESSED = int(Flag.COMPRESSED)
_BATCH, _HELLO = int(Command.BATCH), int(Command.HELLO)
_KNOWN_FLAGS = _RESPONSE | _ERROR | _SIGNED | _RECEIPT | _COMPRESSED


def _decode_key(kind: KeyKind, raw: bytes) -> Key | None:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ProtocolError("key is not valid UTF-8") from None
    if kind is KeyKind.NONE:
        _check(not raw, "a key-less message carries key bytes")
        return None
    if kind is KeyKind.INT:
        if not _INTEGER.fullmatch(raw):  # ASCII digits only: str.isdigit() admits "²", which int() refuses
            raise ProtocolError(f"integer key {text[:40]!r} is not an integer")
        return int(raw)
    return text


_INTEGER = re.compile(rb"-?[0-9]{1,%d}" % MAX_KEY_BYTES)


def only_protocol_errors(decoder: Callable[_P, _R]) -> Callable[_P, _R]:
    """A decoder of bytes from the network raises ``ProtocolError`` and nothing else: whatever else a
    hostile input trips (a bug's ValueError, struct.error...) becomes one, so callers' one ``except``
    always holds."""

    @functools.wraps(decoder)
    def guarded(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        try:
            return decoder(*args, **kwargs)
        except ProtocolError:
            raise
        except Exception as error:  # noqa: BLE001 - see the docstring
            raise ProtocolError(f"malformed message ({type(error).__name__}: {str(error)[:200]})") from None

    return guarded


@only_protocol_errors
def decode_header(frame: bytes) -> Header:
    """Parse and validate a header frame; raises ``ProtocolError`` naming the first problem.

    Only the format is checked here: whether a signed frame's tag is right (and its sequence number
    new) is the receiving transport's check, over the whole message. A job sends the same few
    headers over and over (one per command, key and slice), differing only in request id, timestamp,
    sequence number and tag. So a frame seen before is looked up by the rest of its bytes instead of
    parsed and checked again: byte for byte the same, it is just as valid. Decoded headers share a
    small cache of packed replies (``encode_reply``).
    """
    signed = len(frame) > _FLAGS_OFFSET and frame[_FLAGS_OFFSET] & _SIGNED
    if signed and len(frame) < FIXED.size + MAC_BYTES:
        raise ProtocolError(f"signed header of {len(frame)} bytes is shorter than {FIXED.size + MAC_BYTES}")
    unstamped = frame[:_ID_OFFSET] + frame[_TIME_END : len(frame) - MAC_BYTES if signed else len(frame)]
    known = _DECODED.get(unstamped)
    if known is not None:
        request_id, timestamp = _ID_AND_TIME.unpack_from(frame, _ID_OFFSET)
        if not math.isfinite(timestamp):
            raise ProtocolError("timestamp is not finite")
        header = _new_header(Header)
        fields = header.__dict__
        fields.update(known.__dict__)
        fields["request_id"], fields["timestamp"] = request_id, timestamp
        fields["sequence"] = _SEQUENCE.unpack_from(frame, _SEQUENCE_OFFSET)[0]
        return header
    header = _parse_header(frame[: -MAC_BYTES] if signed else frame)
    if len(_DECODED) >= _DECODED_LIMIT:
        _DECODED.clear()
    header.__dict__["_replies"] = {}
    _DECODED[unstamped] = header
    return header


_DECODED: dict[bytes, Header] = {}  # see decode_header: a frame without id and timestamp -> its header
_DECODED_LIMIT = 16384  # bounds what a hostile peer can make us keep (~20 MB)
_REPLIES_LIMIT = 64  # packed replies per decoded header (per rank, payload size and error flag)


def _parse_header(body: bytes) -> Header:
    """Parse and validate a header frame without its tag; raises ``ProtocolError`` naming the first problem.

    Problems are spelled out only once found (``if ...: raise``): formatting every message up
    front cost more than the whole parse, on every message.
    """
    if len(body) < FIXED.size:
        raise ProtocolError(f"header of {len(body)} bytes is shorter than {FIXED.size}")
    (magic, version, command, flags, request_id, timestamp, sequence, role, rank, priority, key_kind, key_len,
     dtype_code, ndim, start, stop, payload_count, payload_nbytes) = FIXED.unpack_from(body)  # fmt: skip
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {magic!r}: not a tandem kvstore message")
    if version != VERSION:
        raise ProtocolError(
            f"protocol version {version}, this build speaks {VERSION}: upgrade the older side"
        )
    if flags & ~_KNOWN_FLAGS:
        raise ProtocolError(f"unknown flag bits {flags:#x}")
    if ndim > MAX_NDIM:
        raise ProtocolError(f"{ndim} dimensions, at most {MAX_NDIM} allowed")
    if key_len > MAX_KEY_BYTES:
        raise ProtocolError(f"key of {key_len} bytes, at most {MAX_KEY_BYTES} allowed")
    if len(body) != FIXED.size + 8 * ndim + key_len:
        raise ProtocolError("header length does not match its ndim and key length")
    most = MAX_BATCH_PAYLOADS if command == _BATCH else MAX_PAYLOADS
    if payload_count > most:
        raise ProtocolError(f"{payload_count} payload frames, at most {most} allowed")
    shape = _SHAPE_STRUCTS[ndim].unpack_from(body, FIXED.size) if ndim else ()
    if ndim and min(shape) < 0:
        raise ProtocolError(f"negative dimension in shape {shape}")
    key = _decode_key(_lookup(_KEY_KINDS, key_kind, "key kind"), body[FIXED.size + 8 * ndim :])
    dtype = None if dtype_code == 0 else _lookup(CODE_DTYPES, dtype_code, "dtype")
    if not 0 <= start <= stop <= math.prod(shape):
        raise ProtocolError(f"slice [{start}, {stop}) outside an array of shape {shape}")
    if not math.isfinite(timestamp):
        raise ProtocolError("timestamp is not finite")
    header = _new_header(Header)  # frozen: skip its per-field object.__setattr__ (checked above)
    header.__dict__.update(
        command=_lookup(_COMMANDS, command, "command"), request_id=request_id,
        sender_role=_lookup(_ROLES, role, "role"), sender_rank=rank, key=key, priority=priority, dtype=dtype,
        shape=shape, slice_start=start, slice_stop=stop, response=bool(flags & _RESPONSE),
        error=bool(flags & _ERROR), payload_count=payload_count, payload_nbytes=payload_nbytes, timestamp=timestamp,
        receipt=bool(flags & _RECEIPT), compressed=bool(flags & _COMPRESSED), signed=bool(flags & _SIGNED),
        sequence=sequence,
    )  # fmt: skip
    return header


_new_header = object.__new__  # a decoded header is built field by field: an eighth of Header()'s cost


@only_protocol_errors
def decode(frames: Sequence[Any]) -> Message:
    """Validate a received multipart message's format (bytes or zmq.Frame parts) and view its payloads."""
    if not frames:
        raise ProtocolError("empty message")
    return attach(decode_header(frame_bytes(frames[0])), frames[1:])


def frame_bytes(frame: Any) -> bytes:
    """A received frame's bytes (a zmq.Frame's, or bytes as they are)."""
    return frame.bytes if hasattr(frame, "bytes") else bytes(frame)


@only_protocol_errors
def attach(header: Header, frames: Sequence[Any]) -> Message:
    """The message of an already decoded ``header`` and its payload frames, checked against it."""
    if len(frames) != header.payload_count:
        raise ProtocolError(f"header announces {header.payload_count} payload frames, {len(frames)} arrived")
    payloads = [_view(frame) for frame in frames]
    received = sum(payload.nbytes for payload in payloads)
    if received != header.payload_nbytes:
        raise ProtocolError(f"header announces {header.payload_nbytes} payload bytes, {received} arrived")
    return Message(header, payloads, frames=frames if isinstance(frames, list) else list(frames))


def _view(frame: Any) -> memoryview:
    buffer = getattr(frame, "buffer", frame)  # zmq.Frame exposes its bytes as .buffer without a copy
    return memoryview(buffer).cast("B")


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a contiguous CPU tensor, for sending as a frame."""
    if not tensor.is_cpu or not tensor.is_contiguous():
        raise ValueError("kvstore frames need contiguous CPU tensors; call .contiguous().cpu() first")
    if tensor.numel() == 0:
        return memoryview(b"")
    if tensor.dtype in _NUMPY_DTYPES:  # numpy views these directly: a third of the generic path's cost
        return tensor.numpy().data.cast("B")
    return tensor.reshape(-1).view(torch.uint8).numpy().data  # bfloat16 has no numpy type


_NUMPY_DTYPES = frozenset(DTYPE_CODES) - {torch.bfloat16}


def state_payloads(value: torch.Tensor, state: dict[str, torch.Tensor]) -> list[memoryview]:
    """A slot's value and optimizer state as frames: a JSON list of ``[name, dtype code, shape]``, the value, each state tensor."""
    names = sorted(state)
    contents = [[name, DTYPE_CODES[state[name].dtype], list(state[name].shape)] for name in names]
    _check(len(names) + 2 <= MAX_PAYLOADS, f"{len(names)} optimizer state tensors, at most {MAX_PAYLOADS - 2} fit")
    return [memoryview(json.dumps(contents).encode()), tensor_bytes(value),
            *(tensor_bytes(state[name].contiguous()) for name in names)]  # fmt: skip


@only_protocol_errors
def state_from_payloads(payloads: Sequence[memoryview], dtype: torch.dtype,
                        numel: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:  # fmt: skip
    """``state_payloads``' value and state, validated; views of the payloads (copy what you keep)."""
    _check(len(payloads) >= 2, f"{len(payloads)} payload frames, a value and its state need at least 2")
    try:
        contents = json.loads(bytes(payloads[0]))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ProtocolError(f"optimizer state table is not JSON: {error}") from None
    _check(isinstance(contents, list) and len(contents) == len(payloads) - 2,
           "optimizer state table does not list one entry per state frame")  # fmt: skip
    state = {}
    for entry, payload in zip(contents, payloads[2:]):
        valid = (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], str)
                 and isinstance(entry[1], int) and isinstance(entry[2], list) and len(entry[2]) <= MAX_NDIM
                 and all(isinstance(size, int) and 0 <= size < 2**62 for size in entry[2]))  # fmt: skip
        _check(valid, f"bad optimizer state entry {entry!r}: expected [name, dtype code, shape]")
        name, code, shape = entry
        _check(name not in state, f"optimizer state {name!r} listed twice")
        tensor = tensor_from_bytes(payload, _lookup(CODE_DTYPES, code, "dtype"), math.prod(shape))
        state[name] = tensor.view(shape)
    return tensor_from_bytes(payloads[1], dtype, numel), state


@only_protocol_errors
def tensor_from_bytes(payload: memoryview, dtype: torch.dtype, numel: int) -> torch.Tensor:
    """A 1-D tensor viewing ``payload`` without a copy; validates the byte count first."""
    _check(payload.nbytes == numel * dtype.itemsize,
           f"payload of {payload.nbytes} bytes does not hold {numel} {dtype} elements")  # fmt: skip
    if numel == 0:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(payload, dtype=dtype, count=numel)


# A BATCH message: ``[batch header, index, entry 0's payloads..., entry 1's payloads...]``. The index
# is a u16 entry count, then per entry a u16 length and that entry's own header frame (what it would
# carry alone, unsigned: the batch's tag covers the index and every payload).
# Entries are data requests, or replies to them, all from the batch's sender; each is validated as
# if it had arrived alone, and together they must account for every frame and byte that arrived.
BATCHABLE = TENSOR_COMMANDS
_U16 = struct.Struct("<H")
MAX_ENTRY_BYTES = FIXED.size + 8 * MAX_NDIM + MAX_KEY_BYTES


def encode_batch_index(heads: Sequence[bytes]) -> bytes:
    """The index frame of a BATCH carrying the messages whose header frames are ``heads`` (in order)."""
    if not 1 <= len(heads) <= MAX_BATCH_ENTRIES:
        raise ValueError(f"a batch carries 1 to {MAX_BATCH_ENTRIES} messages, got {len(heads)}")
    parts = [_U16.pack(len(heads))]
    for head in heads:
        parts.append(_U16.pack(len(head)))
        parts.append(head)
    return b"".join(parts)


@only_protocol_errors
def decode_batch_index(batch: Header, index: bytes) -> list[Header]:
    """The entries' headers of a BATCH whose header is ``batch`` and index frame ``index``, validated.

    Each entry is a data request (or, in a response batch, a reply) of the batch's sender, and the
    entries' payloads add up to the batch's own payload count and bytes (after the index).
    """
    _check(batch.command is Command.BATCH, f"{batch.command.name} is not a batch")
    _check(len(index) >= _U16.size, "batch index frame is truncated")
    (count,) = _U16.unpack_from(index)
    _check(1 <= count <= MAX_BATCH_ENTRIES, f"batch of {count} entries, 1 to {MAX_BATCH_ENTRIES} allowed")
    headers, offset, frames, nbytes = [], _U16.size, 0, len(index)
    for _ in range(count):
        _check(offset + _U16.size <= len(index), "batch index frame is truncated")
        (length,) = _U16.unpack_from(index, offset)
        offset += _U16.size
        _check(length <= MAX_ENTRY_BYTES, f"batch entry header of {length} bytes, at most {MAX_ENTRY_BYTES}")
        _check(offset + length <= len(index), "batch index frame is truncated")
        header = decode_header(index[offset : offset + length])
        offset += length
        _check(header.command in BATCHABLE, f"a batch may not carry {header.command.name}")
        _check(not header.signed, "a batch entry carries a tag of its own; only the batch is signed")
        _check(header.response == batch.response and header.sender_role == batch.sender_role
               and header.sender_rank == batch.sender_rank,
               "a batch entry's sender or direction differs from its batch's")  # fmt: skip
        frames += header.payload_count
        nbytes += header.payload_nbytes
        headers.append(header)
    _check(offset == len(index), "batch index frame has trailing bytes")
    _check(frames + 1 == batch.payload_count, f"batch entries announce {frames} payload frames, the batch {batch.payload_count - 1}")
    _check(nbytes == batch.payload_nbytes, "batch entries' payload bytes do not add up to the batch's")
    return headers


@only_protocol_errors
def split_batch(message: Message) -> list[Message]:
    """The messages a received BATCH carries (checked by ``attach`` against its header already)."""
    _check(bool(message.payloads), "a batch without its index frame")
    headers = decode_batch_index(message.header, bytes(message.payloads[0]))
    frames = message.frames if message.frames is not None else message.payloads
    messages, position = [], 1
    for header in headers:
        end = position + header.payload_count
        messages.append(attach(header, frames[position:end]))
        position = end
    return messages
