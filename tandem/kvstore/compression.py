"""Gradient compression of pushes: fewer bytes up the link, with error feedback so nothing is lost.

Why: on a slow link a worker's pushes are half its traffic, and gradients tolerate coarse values
as long as what was left out is sent later. Like MXNet's ``kvstore.set_gradient_compression``, a
worker adds the *residual* (what earlier pushes of the key left out) to each gradient, sends a
coarse version of the sum and keeps the difference as the new residual. Over steps every bit of
every gradient reaches the servers, only later (error feedback; Seide et al. 2014, 1-bit SGD).

Kinds (``{"type": ..., "threshold": ...}``):

- ``2bit`` (MXNet's): each element becomes ``+threshold``, ``-threshold`` or 0, whichever the sum
  reaches (``>= threshold``, ``<= -threshold``, else 0); four elements per byte, 16x fewer bytes
  than float32.
- ``fp16`` / ``bf16``: the sum cast to 16 bits, 2x fewer bytes (fp16 values are clamped to its
  range first: what overflows stays in the residual instead of becoming ``inf``).
- ``int8``: the sum cut into blocks of 64 elements (``BLOCK``; a slice's last block shorter),
  each scaled by its own float32 (its largest magnitude / 127) and rounded to 8 bits: 3.76x fewer
  bytes. Unlike 2-bit it keeps every element's own value to 1/254 of its block's largest. A scale
  per block rather than per slice keeps small gradients beside a large one from rounding to 0 step
  after step (block-wise quantization, as in ZeRO++ and bitsandbytes; docs/distributed.md has the
  measurement). Unlike 16-bit floats the codes cannot be summed as they are, so the collective
  store all-gathers them: fewer bytes than fp16 with 2 and 3 workers, 1/16 more with 4, more
  beyond (a ring all-reduce moves 2(n-1)/n of the values, an all-gather n-1 times them).
- ``int4``: int8's blocks and scales (a block's largest magnitude / 7), each element rounded to 4
  bits (-7..7), two per byte: 7.1x fewer bytes. Coarser per step than int8 (a 14th of its block's
  largest), so more waits in the residual; what a slow link saves, and whether the model still
  learns as fast, docs/benchmarks.md measures (time to accuracy).

Only pushed values of float32 and float64 keys are compressed (pushes and pushpulls, never
``init``). Servers need no setting: a compressed push says so in its header (``Flag.COMPRESSED``)
and carries a descriptor frame (kind, threshold) before the data, so workers may even differ.
Pulls carry full values, as in MXNet, except where they carry gradient sums (a sync round without
a server-side optimizer): the server then compresses the sum back the same way, with its own
residual (``Server._compress_value``), and the reply says so in its header too.
"""

from __future__ import annotations

import functools
import math
import struct
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tandem.kvstore.errors import KVStoreError, ProtocolError
from tandem.kvstore.flat import elements

Key = int | str
KINDS = {"2bit": 1, "fp16": 2, "bf16": 3, "int8": 4, "int4": 5}  # the wire's kind codes
_NAMES = {code: name for name, code in KINDS.items()}
_CASTS = {"fp16": torch.float16, "bf16": torch.bfloat16}
_FP16_MAX = float(torch.finfo(torch.float16).max)
_FLOAT32_MAX = float(torch.finfo(torch.float32).max)
COMPRESSIBLE = frozenset({torch.float32, torch.float64})
DESCRIPTOR = struct.Struct("<B3xf")  # kind code, threshold (2bit; 0 otherwise)


@dataclass(frozen=True)
class GradientCompression:
    """What ``set_gradient_compression`` was given: ``type`` "none", "2bit", "fp16", "bf16", "int8" or "int4", and
    ``threshold`` (2bit only: the magnitude sent for every element that reaches it; MXNet's 0.5;
    rounded to float32, as the wire carries it)."""

    type: str = "none"
    threshold: float = 0.5

    def __post_init__(self) -> None:
        if self.type != "none" and self.type not in KINDS:
            raise KVStoreError(f"unknown gradient compression {self.type!r}; choose 'none' or one of {sorted(KINDS)}")
        threshold = self.threshold
        if not (isinstance(threshold, int | float) and 0 < threshold <= _FLOAT32_MAX):  # False for nan
            raise KVStoreError(f"gradient compression threshold must be a positive float32, got {self.threshold!r}")
        threshold = struct.unpack("<f", struct.pack("<f", threshold))[0]  # what the wire carries
        if threshold == 0:
            raise KVStoreError(f"gradient compression threshold {self.threshold!r} is 0 in float32")
        object.__setattr__(self, "threshold", threshold)  # frozen: set once, here

    @property
    def enabled(self) -> bool:
        return self.type != "none"

    @property
    def ratio(self) -> float:
        """How many times fewer bytes a float32 push takes on the wire (int8, int4: their scales included)."""
        if self.type in _LEVELS:
            return 4 * BLOCK / block_bytes(self.type, BLOCK)
        return {"none": 1, "2bit": 16}.get(self.type, 2)

    @classmethod
    def parse(cls, params: GradientCompression | dict[str, Any] | str | None) -> GradientCompression:
        """From MXNet's dict form (``{"type": "2bit", "threshold": 0.5}``), a string ("2bit", "2bit:0.1",
        "fp16") or None (no compression)."""
        if params is None:
            return cls()
        if isinstance(params, GradientCompression):
            return params
        if isinstance(params, str):
            kind, _, threshold = params.partition(":")
            try:
                return cls(kind, float(threshold)) if threshold else cls(kind)
            except ValueError:
                raise KVStoreError(f"gradient compression {params!r}: the threshold after ':' must be a number") from None
        if not isinstance(params, dict) or set(params) - {"type", "threshold"}:
            raise KVStoreError(f"gradient compression takes {{'type': ..., 'threshold': ...}}, got {params!r}")
        return cls(str(params.get("type", "none")), params.get("threshold", 0.5))


class Compressor:
    """A worker's encoder: the residual of every key, and the frames of a compressed push.

    Thread safety: one key's pushes must be encoded by one thread at a time (a store's pushes are
    made by the thread driving it); different keys may be encoded concurrently.
    """

    def __init__(self, config: GradientCompression) -> None:
        if not config.enabled:
            raise KVStoreError("a Compressor needs a compression type other than 'none'")
        self.config = config
        self._residuals: dict[Key, torch.Tensor] = {}

    def encode(self, key: Key, flat: torch.Tensor, start: int, stop: int) -> list[memoryview]:
        """The frames carrying elements ``[start, stop)`` of the flat value ``flat`` pushed to ``key``;
        the key's residual over those elements becomes what the frames leave out."""
        total = add_to_residual(self._residuals, key, flat, start, stop)
        return frames_of(self.config, encode_into_residual(self.config, total))

    def residual(self, key: Key) -> torch.Tensor | None:
        """What the pushes of ``key`` have left out so far (flat), or None before its first push."""
        return self._residuals.get(key)

    def rename(self, old: Key, new: Key) -> None:
        """``old``'s residual now belongs to ``new`` (P3 names slots after the slicing, which may change)."""
        residual = self._residuals.pop(old, None)
        if residual is not None:
            self._residuals[new] = residual


def add_to_residual(residuals: dict[Any, torch.Tensor], key: Any, flat: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """``residuals[key][start:stop] += flat[start:stop]``, returned as a view (the key's residual is
    made, zero, where it has none of ``flat``'s size and dtype): gradient plus what was left out before."""
    return add_to_residuals(residuals, [(key, flat, start, stop)])[0]


def add_to_residuals(residuals: dict[Any, torch.Tensor], parts: Sequence[tuple[Any, torch.Tensor, int, int]]) -> list[torch.Tensor]:
    """``add_to_residual`` of several ``(key, flat, start, stop)`` parts (of different keys), in one op."""
    totals = []
    for key, flat, start, stop in parts:
        residual = residuals.get(key)
        if residual is None or residual.numel() != flat.numel() or residual.dtype != flat.dtype:
            residual = residuals[key] = torch.zeros(flat.numel(), dtype=flat.dtype)
        totals.append(elements(residual, start, stop))
    # in place: the residuals hold the sums until encoded
    torch._foreach_add_(totals, [elements(flat, start, stop) for _, flat, start, stop in parts])
    return totals


def encode_into_residual(config: GradientCompression, total: torch.Tensor, summands: int = 1) -> torch.Tensor:
    """The compressed form of ``total`` (gradient plus residual, flat), leaving in ``total`` what it omits.

    ``summands``: how many such values will be summed in the compressed type itself (a 16-bit
    all-reduce); fp16 values are then clamped to its range divided by that many, so the sum cannot
    overflow either."""
    if config.type == "2bit":
        threshold = config.threshold
        positive, negative = total >= threshold, total <= -threshold
        codes = positive.view(torch.uint8) | (negative.view(torch.uint8) << 1)  # 0: zero, 1: +threshold, 2: -threshold
        total.add_(negative.to(total.dtype), alpha=threshold).sub_(positive.to(total.dtype), alpha=threshold)
        return _pack_2bit(codes)
    if config.type in _LEVELS:
        return _encode_blocks(config.type, total, [total.numel()])
    if config.type == "fp16":
        bound = _FP16_MAX / summands
        sent = total.clamp(-bound, bound).to(torch.float16)  # overflow stays in the residual
    else:
        sent = total.to(_CASTS[config.type])
    total.sub_(sent.to(total.dtype))
    return sent


def encode_parts(config: GradientCompression, totals: list[torch.Tensor], summands: int = 1) -> torch.Tensor:
    """``encode_into_residual`` of several flat values as one message (the collective store's fused
    slices): encoded over their concatenation in a few ops, not a few per part; int8's and int4's
    blocks never straddle two parts. ``decode_parts`` reads it back."""
    sizes = [total.numel() for total in totals]
    joined = totals[0] if len(totals) == 1 else torch.cat(totals)
    sent = (_encode_blocks(config.type, joined, sizes) if config.type in _LEVELS
            else encode_into_residual(config, joined, summands))
    if len(totals) > 1:  # the residuals are the totals: what the message leaves out goes back into each
        torch._foreach_copy_(totals, list(joined.split(sizes)))
    return sent


def decode_parts(config: GradientCompression, data: torch.Tensor, sizes: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """The values, joined, of parts of ``sizes`` elements that ``encode_parts`` encoded into ``data``."""
    if config.type in _LEVELS:
        return _decode_blocks(config.type, data, sizes, dtype)
    return decode_tensor(config, data, dtype, sum(sizes))


def summable(config: GradientCompression) -> bool:
    """Compressed values of this kind can be summed as they are (16-bit floats: all-reduced in
    16 bits, as DDP's fp16 and bf16 hooks do); int8, int4 and 2-bit codes cannot."""
    return config.type in _CASTS


def frames_of(config: GradientCompression, data: torch.Tensor) -> list[memoryview]:
    """The frames (descriptor, data) of values ``encode_into_residual`` compressed with ``config``."""
    from tandem.kvstore.ps.protocol import tensor_bytes  # late: protocol is the dist side's module

    threshold = config.threshold if config.type == "2bit" else 0.0
    return [memoryview(DESCRIPTOR.pack(KINDS[config.type], threshold)), tensor_bytes(data)]


def config_of(payloads: Sequence[memoryview]) -> GradientCompression:
    """The compression that frames (descriptor, data) were made with; ``ProtocolError`` if malformed."""
    if len(payloads) != 2 or payloads[0].nbytes != DESCRIPTOR.size:
        raise ProtocolError("compressed values need a descriptor frame and a data frame")
    code, threshold = DESCRIPTOR.unpack(payloads[0])
    kind = _NAMES.get(code)
    if kind is None:
        raise ProtocolError(f"unknown gradient compression code {code}")
    if kind != "2bit":
        return GradientCompression(kind)
    if not (math.isfinite(threshold) and threshold > 0):
        raise ProtocolError(f"2bit values with threshold {threshold}")
    return GradientCompression(kind, threshold)


def decode(payloads: Sequence[memoryview], dtype: torch.dtype, numel: int) -> torch.Tensor:
    """The ``numel`` values of ``dtype`` that compressed frames (descriptor, data) carry.

    Raises ``ProtocolError`` naming the problem for frames no ``Compressor`` makes.
    """
    return decode_data(config_of(payloads), payloads[1], dtype, numel)


def decode_data(config: GradientCompression, data: memoryview, dtype: torch.dtype, numel: int) -> torch.Tensor:
    """``decode`` of the data frame, for a caller that already read the descriptor (``config_of``)."""
    kind = config.type
    if dtype not in COMPRESSIBLE:
        raise ProtocolError(f"{kind} values of a {dtype} key: only float32 and float64 keys are compressed")
    if kind == "2bit":
        if data.nbytes != (numel + 3) // 4:
            raise ProtocolError(f"2bit values of {numel} elements carry {data.nbytes} bytes, not {(numel + 3) // 4}")
        codes = torch.frombuffer(data, dtype=torch.uint8) if numel else torch.empty(0, dtype=torch.uint8)
        return decode_tensor(config, codes, dtype, numel)
    if kind in _LEVELS:
        expected = block_bytes(kind, numel)
        if data.nbytes != expected:
            per_element = "a byte per element" if kind == "int8" else "half a byte per element"
            raise ProtocolError(f"{kind} values of {numel} elements carry {data.nbytes} bytes, not {expected} (a "
                                f"float32 scale per {BLOCK} elements, then {per_element})")  # fmt: skip
        if not numel:
            return torch.empty(0, dtype=dtype)
        message = torch.frombuffer(data, dtype=torch.uint8)  # the scales, then the codes
        head = SCALE_BYTES * _block_count(numel)
        scales = message[:head].clone().view(torch.float32)
        # what no encoder sends: the values would not be the sender's (NaN is: a block that was not finite)
        bad = scales.signbit() | (scales > _MAX_SCALE[kind])  # -0.0 and negative NaN included, inf too
        if bool(bad.any()):
            raise ProtocolError(f"{kind} values with scale {float(scales[bad][0])} (an encoder sends 0 to "
                                f"{_MAX_SCALE[kind]}, or NaN)")  # fmt: skip
        codes = message[head:]
        if bool(((codes == 0x80) if kind == "int8" else ((codes & 0x0F) == 0x08) | ((codes & 0xF0) == 0x80)).any()):
            lowest = -_LEVELS[kind] - 1
            raise ProtocolError(f"{kind} values carry the code {lowest} (an encoder rounds to "
                                f"{-_LEVELS[kind]}..{_LEVELS[kind]})")  # fmt: skip
        return decode_tensor(config, message, dtype, numel)
    if data.nbytes != 2 * numel:
        raise ProtocolError(f"{kind} values of {numel} elements carry {data.nbytes} bytes, not {2 * numel}")
    return decode_tensor(config, torch.frombuffer(data, dtype=_CASTS[kind]) if numel else None, dtype, numel)


def decode_tensor(config: GradientCompression, data: torch.Tensor | None, dtype: torch.dtype, numel: int) -> torch.Tensor:
    """The ``numel`` values of ``dtype`` that ``encode_into_residual`` made ``data`` of (None: no elements)."""
    if data is None or not numel:
        return torch.empty(0, dtype=dtype)
    if config.type == "2bit":
        return _unpack_2bit(data, config.threshold, numel, dtype)
    if config.type in _LEVELS:
        return _decode_blocks(config.type, data, [numel], dtype)
    return data.to(dtype)


SCALE_BYTES = 4  # an int8 or int4 message starts with its blocks' float32 scales
BLOCK = 64  # elements per scale: an outlier coarsens its own block only, for 1/16 more bytes (int8)
_LEVELS = {"int8": 127, "int4": 7}  # the largest code: codes run -levels..levels (never the lowest, -levels - 1)
# a scale whose top code stays finite in float32 (float32's largest / levels, one float below):
# of a block with larger values the residual keeps what levels x this scale leaves out
_MAX_SCALE = {kind: float(torch.nextafter(torch.tensor(_FLOAT32_MAX / levels, dtype=torch.float32), torch.tensor(0.0)))
              for kind, levels in _LEVELS.items()}


def _encode_blocks(kind: str, joined: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """``joined``, parts of ``sizes`` elements, as bytes: a float32 scale per block (``_Blocks``: its
    largest magnitude / the kind's top code), then every element / its block's scale rounded to a
    code (int8: a byte each; int4: two per byte, the first in the low half); ``joined`` keeps the
    rounding error. A block with a value that is not finite (or, in float64, beyond float32's range)
    gets scale NaN: all of it arrives as NaN, and its residual restarts at 0, so that a later finite
    gradient is sent whole. A dozen ops whatever the parts (they run once per collective, on the
    scheduler's thread, beside the step's compute)."""
    blocks = _blocks(tuple(sizes))
    if not joined.numel():
        return torch.empty(0, dtype=torch.uint8)
    levels = _LEVELS[kind]
    # every block's largest magnitude (max propagates NaN); beyond float32's range: inf, so scale NaN
    scales = blocks.maxima(joined.abs()).to(torch.float32).div_(levels)
    scales.masked_fill_(~scales.isfinite(), math.nan).clamp_(max=_MAX_SCALE[kind])  # the top code stays finite
    # per element, its block's float32 scale, as the receivers read it: the residual is exactly what they miss
    wide = blocks.per_element(scales.to(joined.dtype))
    # 0 / 0 (a zero block) and x / NaN give NaN: code 0; |x| / scale <= levels elsewhere, clamped against rounding
    codes = (joined / wide).nan_to_num_(0.0, 0.0, 0.0).round_().clamp_(-levels, levels)
    # not addcmul_: its fused multiply-add would round differently from the receivers' codes * scale
    joined.sub_(codes * wide).nan_to_num_(0.0, 0.0, 0.0)  # a block with scale NaN keeps 0
    packed = codes.to(torch.int8).view(torch.uint8)
    if kind == "int4":
        packed = _pack_nibbles(packed)
    return torch.cat([scales.view(torch.uint8), packed])


def _pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes in -7..7 (as uint8) two per byte, 4-bit two's complement, the first in the low half;
    an odd count's last byte padded with code 0."""
    if codes.numel() % 2:
        codes = torch.cat([codes, codes.new_zeros(1)])
    pairs = codes.view(-1, 2)
    return (pairs[:, 0] & 0x0F) | (pairs[:, 1] << 4)  # uint8: the shift drops the high half's sign bits


def _unpack_nibbles(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """``_pack_nibbles``' bytes back to ``numel`` int8 codes (the arithmetic shifts extend each sign)."""
    low = (packed << 4).view(torch.int8) >> 4
    high = packed.view(torch.int8) >> 4
    return torch.stack([low, high], dim=1).view(-1)[:numel]


class _Blocks:
    """How parts of some sizes are cut into int8 / int4 blocks: each part into blocks of ``BLOCK``
    elements, its last one shorter (an empty part has none); blocks never straddle two parts."""

    __slots__ = ("count", "numel", "_whole", "_block_of_element")

    def __init__(self, sizes: tuple[int, ...]) -> None:
        self.count = sum(_block_count(size) for size in sizes)
        self.numel = sum(sizes)
        # one part: its whole blocks are a view (a parameter-server push, up to millions of elements);
        # several (a collective's fused slices): each element's block, for one gather
        self._whole = sizes[0] // BLOCK * BLOCK if len(sizes) == 1 else None
        self._block_of_element = None if len(sizes) == 1 else torch.repeat_interleave(
            torch.arange(self.count), torch.tensor([length for size in sizes for length in _lengths(size)], dtype=torch.int64))

    def maxima(self, magnitudes: torch.Tensor) -> torch.Tensor:
        """Each block's largest element of ``magnitudes`` (>= 0, or NaN: propagated)."""
        if self._block_of_element is not None:  # one scatter: about 3x faster than segment_reduce on CPU
            return magnitudes.new_zeros(self.count).scatter_reduce_(0, self._block_of_element, magnitudes, "amax")
        whole = self._whole
        maxima = magnitudes[:whole].view(-1, BLOCK).amax(dim=1)
        return maxima if whole == self.numel else torch.cat([maxima, magnitudes[whole:].amax().view(1)])

    def per_element(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` (one per block) repeated over each block's elements."""
        if self._block_of_element is not None:
            return values.index_select(0, self._block_of_element)
        whole = self._whole
        assert whole is not None
        full = whole // BLOCK
        spread = values[:full, None].expand(full, BLOCK).reshape(-1)
        return spread if whole == self.numel else torch.cat([spread, values[full:].expand(self.numel - whole)])


def _block_count(size: int) -> int:
    return -(-size // BLOCK)  # the last block shorter


def _lengths(size: int) -> list[int]:
    whole, rest = divmod(size, BLOCK)
    return [BLOCK] * whole + ([rest] if rest else [])


def _blocks(sizes: tuple[int, ...]) -> _Blocks:
    """The blocks of parts of ``sizes``: one part's made each time (a peer may send any size, and
    they are cheap); several parts' cached, since a step repeats its collectives' groupings, up to
    ``_CACHED_ELEMENTS`` elements (each entry holds an int64 per element)."""
    if len(sizes) == 1 or sum(sizes) > _CACHED_ELEMENTS:
        return _Blocks(sizes)
    return _blocks_of_parts(sizes)


_CACHED_ELEMENTS = 1 << 20  # 8 MiB of block indices per cache entry at most


@functools.lru_cache(maxsize=16)  # a step's groupings, at 128 MiB at most (not every tuner trial's)
def _blocks_of_parts(sizes: tuple[int, ...]) -> _Blocks:
    return _Blocks(sizes)


def block_bytes(kind: str, numel: int) -> int:
    """Bytes of one part of ``numel`` elements in int8 or int4: a float32 scale per block, then a
    byte (int8) or half a byte (int4, the count rounded up) per element."""
    return SCALE_BYTES * _block_count(numel) + (numel if kind == "int8" else (numel + 1) // 2)


def _decode_blocks(kind: str, data: torch.Tensor, sizes: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """``_encode_blocks``' bytes (a uint8 tensor at any offset) back to the parts' values, joined."""
    blocks = _blocks(tuple(sizes))
    head = SCALE_BYTES * blocks.count
    scales = data[:head].clone().view(torch.float32).to(dtype)  # cloned: aligned for the float view
    codes = data[head:].view(torch.int8) if kind == "int8" else _unpack_nibbles(data[head:], blocks.numel)
    return codes.to(dtype).mul_(blocks.per_element(scales))


def _pack_2bit(codes: torch.Tensor) -> torch.Tensor:
    """Four 2-bit codes per byte, the first in the lowest bits; the last byte padded with zeros."""
    padding = -codes.numel() % 4
    if padding:
        codes = torch.cat([codes, codes.new_zeros(padding)])
    if sys.byteorder == "little":  # the four codes of a byte as one int32 c0 | c1 << 8 | ...: fold in two shifts
        word = codes.view(torch.int32)
        word = word | (word >> 6)  # bits 0-3: c0 c1, bits 16-19: c2 c3
        return (word | (word >> 12)).to(torch.uint8)  # bits 0-7: c0 c1 c2 c3 (the cast keeps the low byte)
    quads = codes.view(-1, 4)
    return quads[:, 0] | (quads[:, 1] << 2) | (quads[:, 2] << 4) | (quads[:, 3] << 6)


# every byte's four codes (a byte with the unused code 3 is refused before this table is read)
_BYTE_CODES = torch.tensor([[(byte >> shift) & 3 for shift in (0, 2, 4, 6)] for byte in range(256)])


def _unpack_2bit(packed: torch.Tensor, threshold: float, numel: int, dtype: torch.dtype) -> torch.Tensor:
    if bool(((packed & (packed >> 1)) & 0x55).any()):
        raise ProtocolError("2bit values carry the unused code 3")
    values = torch.tensor([0.0, threshold, -threshold, 0.0], dtype=dtype)[_BYTE_CODES]  # byte -> its 4 values
    return torch.index_select(values, 0, packed.long()).view(-1)[:numel]  # one gather of 4 values per byte
