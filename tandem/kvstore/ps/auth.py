"""Authentication of whole messages between a worker and a server, with replay protection.

With a shared secret (``TANDEM_PS_SECRET``) every message ends its header frame with a 16-byte
tag over the header *and every payload frame*, so neither a field nor a tensor byte can be changed
on the way. Two kinds of tag:

- **Handshake** (a worker's HELLO and the server's answer to it): HMAC-SHA256 with the secret,
  truncated to 16 bytes. The hello carries a fresh worker nonce, the answer a fresh server nonce and
  the worker's echoed back, so an answer recorded earlier cannot complete a new hello.
- **Session** (everything after): both sides derive a session key from the secret and both nonces
  (``Session``), and from it a key per direction. Each message carries a sequence number, and its
  tag is RFC 8439's ChaCha20-Poly1305 under the direction's key with the sequence number as nonce,
  the plaintext empty and the message (``covered``) as associated data: Poly1305 under a one-time key
  per message. A message covered in under ``ONE_CALL_BYTES`` (nearly all) is joined into one buffer
  and tagged by one AEAD call (0.6 us for a small one; ~14 GB/s); a bigger one is streamed through
  Poly1305 under the same one-time key, computed the RFC's way, so that its payload is not copied.
  Whole-message tags must not slow training.
  A receiver accepts each sequence number once (``ReplayWindow``), so a message replayed on the
  connection, or onto another one (a different session key), is rejected.

Payload lengths are part of what is tagged, so bytes cannot move between frames either.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import os
import struct
from collections.abc import Sequence
from typing import Any

from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.poly1305 import Poly1305

TAG_BYTES = 16
NONCE_BYTES = 16
# a message covered in fewer bytes (KiB) is copied into one buffer for one AEAD call; a bigger one is streamed
# (its one-time key and Poly1305 object cost ~5 us, which copying up to ~400 KB costs too)
ONE_CALL_BYTES = 256 * 1024
MAX_HELLO_BYTES = 4096  # a hello's JSON; bigger ones are refused before their tag is computed
HELLO_FRESH_SECONDS = 300.0  # a hello stamped further from the server's clock is refused (replays)
_ROUND = 128  # bytes OpenSSL's vectorised Poly1305 takes a round
_ROUND_OF_ZEROS = bytes(_ROUND)


def new_nonce() -> bytes:
    return os.urandom(NONCE_BYTES)


def _buffer(payload: Any) -> Any:
    return getattr(payload, "buffer", payload)  # a received zmq.Frame: its bytes without a copy


def attempt_key(secret: bytes, attempt: str) -> bytes:
    """The key one start of a job uses (``attempt``: its restart count): hellos recorded in an earlier
    start of the same job, under the same secret, do not verify in a later one."""
    return hmac.digest(secret, b"tandem attempt " + attempt.encode(), hashlib.sha256)


def _lengths(sizes: list[int]) -> bytes:
    """The part count, then each part's length (struct caches the compiled format)."""
    return struct.pack(f"<{len(sizes) + 1}Q", len(sizes), *sizes)


def covered(body: bytes | bytearray, payloads: Sequence[Any]) -> tuple[list[Any], int]:
    """What every tag covers, and its length: the number of parts (the header body, then each payload)
    and each part's length as little-endian 8-byte integers, then the parts themselves, then zeros to
    a multiple of 128 bytes. The lengths come first, so no byte can move between parts. The zeros keep
    Poly1305 fast: OpenSSL's vectorised Poly1305 eats 128 bytes a round, and hashing 64-127 bytes past
    a multiple of 128 ran at half speed, all of it (140,144 bytes: 18.8 us; 140,160: 9.6 us).

    As few buffers as it can: under ``ONE_CALL_BYTES`` one joined buffer. Above it, a big part stays
    where it is as whole 128-byte rounds of the stream, its ends joined with the pieces around it."""
    views = [memoryview(_buffer(part)) for part in (body, *payloads)]
    sizes = [view.nbytes for view in views]
    prefix = _lengths(sizes)
    unpadded = len(prefix) + sum(sizes)
    padding, total = _ROUND_OF_ZEROS[: -unpadded % _ROUND], unpadded - unpadded % -_ROUND
    if total < ONE_CALL_BYTES:
        return [b"".join([prefix, *views, padding])], total
    buffers: list[Any] = []
    pending: list[Any] = [prefix]
    position = len(prefix)  # where the next part starts in the covered stream
    for view, size in zip(views, sizes):
        head = -position % _ROUND  # bytes of this part that bring the stream to a round
        whole = (size - head) // _ROUND * _ROUND if size > head else 0
        if whole >= _ROUND:
            flat = view if view.format == "B" and view.ndim == 1 else view.cast("B")
            buffers += [b"".join([*pending, flat[:head]]), flat[head : head + whole]]
            pending = [flat[head + whole :]]
        else:
            pending.append(view)
        position += size
    buffers.append(b"".join([*pending, padding]))
    return buffers, total


def handshake_tag(secret: bytes, body: bytes | bytearray, payloads: Sequence[Any]) -> bytes:
    """The tag of a HELLO or its answer: HMAC-SHA256 with the secret, truncated."""
    mac = hmac.new(secret, digestmod=hashlib.sha256)
    for buffer in covered(body, payloads)[0]:
        mac.update(buffer)
    return mac.digest()[:TAG_BYTES]


class DirectionKeys:
    """The key of one direction of a session, for its AEAD and for its one-time Poly1305 keys.

    Thread safety: any thread (nothing here changes after construction)."""

    def __init__(self, key: bytes) -> None:
        self.key = key
        self.aead = ChaCha20Poly1305(key)

    def one_time(self, nonce: bytes) -> bytes:
        """RFC 8439's Poly1305 key of ``nonce`` (12 bytes): ChaCha20 block 0, its first 32 bytes."""
        counter_and_nonce = bytes(4) + nonce  # cryptography's ChaCha20 nonce: the block counter, then the nonce
        return Cipher(algorithms.ChaCha20(self.key, counter_and_nonce), mode=None).encryptor().update(bytes(32))


def _session_tag(keys: DirectionKeys, sequence: int, body: bytes | bytearray, payloads: Sequence[Any]) -> bytes:
    """The tag of message ``sequence``: ChaCha20-Poly1305 with an empty plaintext over ``covered``,
    in one AEAD call where ``covered`` is one buffer, else streamed through Poly1305 as RFC 8439 does it
    (the associated data, its length and the empty plaintext's as 8 bytes each)."""
    buffers, total = covered(body, payloads)
    nonce = sequence.to_bytes(12, "little")
    if len(buffers) == 1:
        return keys.aead.encrypt(nonce, b"", buffers[0])
    mac = Poly1305(keys.one_time(nonce))
    for buffer in buffers:
        mac.update(buffer)
    mac.update(total.to_bytes(8, "little") + bytes(8))  # ``total`` is a multiple of 16: no zeros before it
    return mac.finalize()


class ReplayWindow:
    """Accepts each sequence number once; numbers may arrive out of order within ``SIZE`` of the
    highest seen (a worker's threads number their messages before taking the socket in turn)."""

    SIZE = 4096
    _KEPT_BITS = (1 << SIZE) - 1

    def __init__(self) -> None:
        self.highest = 0
        self._seen = 0  # bit i: sequence number ``highest - i`` was accepted

    def fresh(self, sequence: int) -> bool:
        """Whether ``accept`` would take ``sequence`` (nothing recorded)."""
        if sequence <= 0:
            return False
        offset = self.highest - sequence
        return offset < 0 or (offset < self.SIZE and not (self._seen >> offset) & 1)

    def accept(self, sequence: int) -> bool:
        if not self.fresh(sequence):
            return False
        if sequence > self.highest:
            shift = sequence - self.highest
            self._seen = ((self._seen << shift) | 1) & self._KEPT_BITS if shift < self.SIZE else 1
            self.highest = sequence
        else:
            self._seen |= 1 << (self.highest - sequence)
        return True


class Session:
    """The keys and sequence numbers of one authenticated worker-server connection, on one side.

    Thread safety: ``next_sequence`` and ``tag`` may be called from any thread (sequence numbers are
    unique, drawn under the GIL); ``check`` from one receiving thread at a time.
    """

    def __init__(self, secret: bytes, worker_nonce: bytes, server_nonce: bytes, rank: int, is_server: bool) -> None:
        key = hmac.digest(secret, b"tandem session\0" + worker_nonce + server_nonce + rank.to_bytes(4, "little"),
                          hashlib.sha256)  # fmt: skip
        to_server = hmac.digest(key, b"worker to server", hashlib.sha256)
        to_worker = hmac.digest(key, b"server to worker", hashlib.sha256)
        send, receive = (to_worker, to_server) if is_server else (to_server, to_worker)
        self._send_keys, self._receive_keys = DirectionKeys(send), DirectionKeys(receive)
        self._sequences = itertools.count(1)
        self.window = ReplayWindow()
        self.confirmed = False  # a tagged message arrived from the peer: it holds the session key

    def next_sequence(self) -> int:
        return next(self._sequences)

    def tag(self, sequence: int, body: bytes | bytearray, payloads: Sequence[Any]) -> bytes:
        return _session_tag(self._send_keys, sequence, body, payloads)

    def check(self, sequence: int, body: bytes, tag: bytes, payloads: Sequence[Any]) -> str | None:
        """None if the message is authentic and new (then its number counts as seen), else the problem.
        The number is looked at first: a replay costs no tag."""
        if sequence <= 0:
            return "bad message tag: no sequence number (a handshake's tag is no session tag)"
        if not self.window.fresh(sequence):
            return f"replayed message: sequence number {sequence} was seen already (or is too old)"
        if not hmac.compare_digest(tag, _session_tag(self._receive_keys, sequence, body, payloads)):
            return "bad message tag: the sender's TANDEM_PS_SECRET differs, or the message was changed"
        self.window.accept(sequence)
        self.confirmed = True
        return None
