"""Gradient compression: encodings against elementwise formulas, error feedback, malformed frames."""

from __future__ import annotations

import struct
import sys

import pytest
import torch

from tandem.kvstore import LocalKVStore
from tandem.kvstore.compression import (
    BLOCK,
    DESCRIPTOR,
    KINDS,
    Compressor,
    GradientCompression,
    decode,
    decode_parts,
    encode_into_residual,
    encode_parts,
    summable,
)
from tandem.kvstore.errors import KVStoreError, ProtocolError
from tandem.trainer import TrainerConfig


def _frames_bytes(frames: list[memoryview]) -> int:
    return sum(frame.nbytes for frame in frames)


@pytest.mark.parametrize("numel", [0, 1, 3, 4, 5, 1001])
def test_2bit_sends_plus_minus_threshold_or_zero_and_keeps_the_rest(numel: int) -> None:
    compressor = Compressor(GradientCompression("2bit", 0.1))
    t = compressor.config.threshold
    grad = torch.linspace(-0.3, 0.3, numel)
    frames = compressor.encode("k", grad, 0, numel)
    assert frames[1].nbytes == (numel + 3) // 4  # four elements per byte: 16x fewer bytes than float32
    sent = decode(frames, torch.float32, numel)
    expected = torch.where(grad >= t, t, torch.where(grad <= -t, -t, 0.0))
    assert torch.equal(sent, expected)
    residual = compressor.residual("k")
    assert residual is not None and torch.equal(residual, grad - expected)


def test_error_feedback_sends_everything_eventually() -> None:
    """Whatever each push leaves out is added to the next: the sent total plus the residual is the gradient total."""
    compressor = Compressor(GradientCompression("2bit", 0.5))
    total_sent, total_grad = torch.zeros(50), torch.zeros(50)
    for step in range(40):
        grad = torch.sign(torch.arange(50.0) - 25) * (0.03 + 0.02 * torch.sin(torch.arange(50.0) + step))  # all < 0.5
        total_grad += grad
        total_sent += decode(compressor.encode("k", grad, 0, 50), torch.float32, 50)
    residual = compressor.residual("k")
    assert residual is not None
    torch.testing.assert_close(total_sent + residual, total_grad)
    assert total_sent.abs().sum() > 0  # small gradients did get through, by accumulating
    assert residual.abs().max() < 0.5 + 0.05  # what is held back stays below a threshold plus one gradient


def test_a_slice_uses_and_updates_only_its_part_of_the_residual() -> None:
    compressor = Compressor(GradientCompression("fp16"))
    grad = torch.full((10,), 1.0 + 2**-20)  # not representable in fp16: a residual is left
    compressor.encode("k", grad, 2, 6)
    residual = compressor.residual("k")
    assert residual is not None
    assert torch.count_nonzero(residual[:2]) == 0 and torch.count_nonzero(residual[6:]) == 0
    assert torch.all(residual[2:6] != 0)
    compressor.rename("k", "p3/80000/'k'")  # P3 moving to another slicing keeps the residual
    assert compressor.residual("k") is None and compressor.residual("p3/80000/'k'") is residual


def test_fp16_overflow_stays_in_the_residual_instead_of_becoming_inf() -> None:
    compressor = Compressor(GradientCompression("fp16"))
    frames = compressor.encode("k", torch.tensor([1e6, -1e6, 1.0]), 0, 3)
    sent = decode(frames, torch.float32, 3)
    assert sent.tolist() == [65504.0, -65504.0, 1.0]
    residual = compressor.residual("k")
    assert residual is not None and residual.tolist() == [1e6 - 65504.0, -1e6 + 65504.0, 0.0]


def test_fp16_summed_over_workers_is_clamped_so_the_sum_stays_finite() -> None:
    """A 16-bit all-reduce sums every worker's fp16 values in fp16: each is clamped to the range
    over the workers, so four workers' maxima sum to fp16's largest value, not to inf."""
    config = GradientCompression("fp16")
    total = torch.tensor([1e6, -1e6, 1.0])
    sent = encode_into_residual(config, total, summands=4)
    assert sent.dtype == torch.float16 and sent.tolist() == [65504.0 / 4, -65504.0 / 4, 1.0]
    assert torch.isfinite(sent * 4).all()  # four workers sending the same: their sum in fp16
    assert total.tolist() == [1e6 - 65504.0 / 4, -1e6 + 65504.0 / 4, 0.0]  # the rest stays in the residual
    assert summable(config) and summable(GradientCompression("bf16")) and not summable(GradientCompression("2bit"))


@pytest.mark.parametrize(("kind", "nbytes"), [("2bit", 10_000), ("fp16", 80_000), ("bf16", 80_000), ("int8", 42_500), ("int4", 22_500)])
def test_bytes_on_the_wire(kind: str, nbytes: int) -> None:
    config = GradientCompression(kind)
    frames = Compressor(config).encode("k", torch.randn(40_000), 0, 40_000)
    assert frames[1].nbytes == nbytes == 40_000 * 4 / config.ratio  # int8, int4: a float32 scale per 64 elements
    assert _frames_bytes(frames) == frames[1].nbytes + DESCRIPTOR.size


@pytest.mark.parametrize(("kind", "levels"), [("int8", 127), ("int4", 7)])
@pytest.mark.parametrize("numel", [0, 1, 5, 64, 1001])
def test_block_codes_send_each_element_to_its_blocks_largest_over_levels_and_keep_the_rest(kind: str, levels: int,
                                                                                           numel: int) -> None:
    compressor = Compressor(GradientCompression(kind))
    grad = torch.randn(numel, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 1, numel)
    frames = compressor.encode("k", grad, 0, numel)
    blocks = -(-numel // BLOCK)  # the last one shorter
    code_bytes = numel if kind == "int8" else (numel + 1) // 2  # int4: two codes per byte
    assert frames[1].nbytes == 4 * blocks + code_bytes  # a float32 scale per block, then the codes
    sent = decode(frames, torch.float32, numel)
    residual = compressor.residual("k")
    assert residual is not None and torch.equal(sent + residual, grad)  # exactly: what is not sent stays
    for start in range(0, numel, BLOCK):  # each block to its own scale: small values are not lost to large ones
        block = slice(start, start + BLOCK)
        scale = float(grad[block].abs().max()) / levels
        assert residual[block].abs().max() <= scale / 2 * (1 + 1e-6)  # rounded to the nearest code
        assert float(sent[block].abs().max()) == pytest.approx(levels * scale)
        codes = sent[block] / (float(sent[block].abs().max()) / levels)  # every code an integer in -levels..levels
        torch.testing.assert_close(codes, codes.round(), rtol=0, atol=1e-4)


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_block_code_error_feedback_is_exact_over_blocks_and_parts_up_to_float32s_largest(kind: str,
                                                                                          dtype: torch.dtype) -> None:
    """sent + residual is the total exactly, over several parts of several blocks each, float32's largest
    value included (its block's scale is capped so that the top code stays finite: the rest waits)."""
    config, generator = GradientCompression(kind), torch.Generator().manual_seed(2)
    sizes = [130, 1, 64, 200, 3]  # int4: odd counts share bytes across parts
    parts = [torch.randn(size, generator=generator, dtype=dtype) * 10.0 ** torch.randint(-6, 6, (size,), generator=generator)
             for size in sizes]  # fmt: skip
    parts[3][5] = torch.finfo(torch.float32).max
    totals = [part.clone() for part in parts]
    sent = decode_parts(config, encode_parts(config, totals), sizes, dtype)
    assert sent.isfinite().all()
    assert torch.equal(sent + torch.cat(totals), torch.cat(parts))


@pytest.mark.parametrize(("kind", "top"), [("int8", 127.0), ("int4", 7.0)])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_block_codes_of_zeros_and_of_a_value_that_is_not_finite(kind: str, top: float, bad: float) -> None:
    config = GradientCompression(kind)
    assert decode_parts(config, encode_into_residual(config, torch.zeros(4)), [4], torch.float32).tolist() == [0.0] * 4
    parts = [torch.tensor([1.0, bad]), torch.tensor([3.0, -top])]  # scale 1: exact codes
    sent = decode_parts(config, encode_parts(config, parts), [2, 2], torch.float32)
    assert sent[:2].isnan().all() and sent[2:].tolist() == [3.0, -top]  # the other part is intact
    assert parts[0].tolist() == [0.0, 0.0]  # a residual that restarts: a later finite gradient is sent whole
    long = torch.ones(2 * BLOCK)
    long[-1] = bad
    sent = decode_parts(config, encode_into_residual(config, long), [long.numel()], torch.float32)
    assert sent[BLOCK:].isnan().all() and sent[:BLOCK].tolist() == [1.0] * BLOCK  # per block


@pytest.mark.parametrize("kind", ["fp16", "bf16", "2bit:0.1", "int8", "int4"])
def test_parts_encoded_together_decode_to_each_part_encoded_alone(kind: str) -> None:
    """The collective store encodes the slices sharing a collective as one message: the values and
    residuals are those of each slice encoded alone (int8's and int4's blocks never straddle two slices)."""
    config = GradientCompression.parse(kind)
    generator = torch.Generator().manual_seed(1)
    sizes = [3, 1, 40, 7, 130]  # int8: the last one three blocks, 64 + 64 + 2
    parts = [torch.randn(size, generator=generator) * (index + 1) for index, size in enumerate(sizes)]
    alone = [part.clone() for part in parts]
    expected = torch.cat([decode_parts(config, encode_into_residual(config, part), [part.numel()], torch.float32)
                          for part in alone])  # fmt: skip
    together = [part.clone() for part in parts]
    sent = encode_parts(config, together, summands=1)
    torch.testing.assert_close(decode_parts(config, sent, sizes, torch.float32), expected, rtol=0, atol=0)
    for one, other in zip(together, alone):
        torch.testing.assert_close(one, other, rtol=0, atol=0)
    if kind in ("int8", "int4"):  # at any offset in a gathered buffer
        shifted = torch.cat([torch.zeros(3, dtype=torch.uint8), sent])[3:]
        assert torch.equal(decode_parts(config, shifted, sizes, torch.float32), expected)


def test_parse_forms_and_errors() -> None:
    assert GradientCompression.parse(None) == GradientCompression()
    assert not GradientCompression.parse("none").enabled
    assert GradientCompression.parse({"type": "2bit", "threshold": 0.25}) == GradientCompression("2bit", 0.25)
    assert GradientCompression.parse("2bit:0.25") == GradientCompression("2bit", 0.25)
    assert GradientCompression.parse("2bit").threshold == 0.5  # MXNet's default
    assert GradientCompression("2bit", 0.1).threshold == struct.unpack("<f", struct.pack("<f", 0.1))[0]
    with pytest.raises(KVStoreError, match="unknown gradient compression '3bit'"):
        GradientCompression.parse("3bit")
    for bad in (-1.0, 0, float("nan"), float("inf"), 1e39, "0.5"):
        with pytest.raises(KVStoreError, match="threshold must be a positive float32"):
            GradientCompression("2bit", bad)  # type: ignore[arg-type]
    with pytest.raises(KVStoreError, match="is 0 in float32"):
        GradientCompression("2bit", 1e-50)
    with pytest.raises(KVStoreError, match="must be a number"):
        GradientCompression.parse("2bit:high")
    with pytest.raises(KVStoreError, match="takes"):
        GradientCompression.parse({"type": "2bit", "ratio": 3})


def _frames(code: int, threshold: float, data: bytes) -> list[memoryview]:
    return [memoryview(DESCRIPTOR.pack(code, threshold)), memoryview(bytearray(data))]  # writable: frombuffer is quiet


@pytest.mark.parametrize(
    ("frames", "dtype", "numel", "problem"),
    [
        ([memoryview(b"xx")], torch.float32, 4, "descriptor frame and a data frame"),
        (_frames(9, 0.5, b"\x00"), torch.float32, 4, "unknown gradient compression code 9"),
        (_frames(KINDS["2bit"], 0.5, b"\x00\x00"), torch.float32, 4, "carry 2 bytes, not 1"),
        (_frames(KINDS["2bit"], 0.5, b"\x03"), torch.float32, 4, "unused code 3"),
        (_frames(KINDS["2bit"], float("nan"), b"\x00"), torch.float32, 4, "threshold nan"),
        (_frames(KINDS["fp16"], 0.0, b"\x00" * 6), torch.float32, 4, "carry 6 bytes, not 8"),
        (_frames(KINDS["fp16"], 0.0, b"\x00" * 8), torch.int64, 4, "only float32 and float64"),
        (_frames(KINDS["int8"], 0.0, b"\x00" * 4), torch.float32, 4, "carry 4 bytes, not 8"),
        (_frames(KINDS["int8"], 0.0, struct.pack("<f", -1.0) + b"\x01"), torch.float32, 1, "scale -1.0"),
        (_frames(KINDS["int8"], 0.0, struct.pack("<f", float("inf")) + b"\x01"), torch.float32, 1, "scale inf"),
        (_frames(KINDS["int8"], 0.0, struct.pack("<f", 1e38) + b"\x01"), torch.float32, 1, "scale 9.99"),
        (_frames(KINDS["int8"], 0.0, struct.pack("<f", 1.0) + b"\x01\x80"), torch.float32, 2, "code -128"),
        (_frames(KINDS["int8"], 0.0, struct.pack("<f", 1.0) + b"\x01" * 65), torch.float32, 65, "carry 69 bytes, not 73"),
        (_frames(KINDS["int8"], 0.0, struct.pack("<2f", 1.0, -2.0) + b"\x01" * 65), torch.float32, 65, "scale -2.0"),
        (_frames(KINDS["int8"], 0.0, struct.pack("<2f", 1.0, float("inf")) + b"\x01" * 65), torch.float32, 65, "scale inf"),
        (_frames(KINDS["int8"], 0.0, struct.pack("<f", -0.0) + b"\x00"), torch.float32, 1, "scale -0.0"),
        (_frames(KINDS["int8"], 0.0, struct.pack("<2f", 1.0, 1.0) + b"\x01" * 64 + b"\x80"), torch.float32, 65, "code -128"),
        (_frames(KINDS["int4"], 0.0, struct.pack("<f", 1.0) + b"\x01"), torch.float32, 3, "carry 5 bytes, not 6"),
        (_frames(KINDS["int4"], 0.0, struct.pack("<f", 1.0) + b"\x08"), torch.float32, 2, "code -8"),
        (_frames(KINDS["int4"], 0.0, struct.pack("<f", 1.0) + b"\x17\x81"), torch.float32, 4, "code -8"),
        (_frames(KINDS["int4"], 0.0, struct.pack("<f", 2.5e38) + b"\x01"), torch.float32, 1, "scale 2.5"),
        (_frames(KINDS["int4"], 0.0, struct.pack("<f", -0.0) + b"\x00"), torch.float32, 1, "scale -0.0"),
    ],
)
def test_malformed_frames_are_rejected_with_the_reason(
    frames: list[memoryview], dtype: torch.dtype, numel: int, problem: str
) -> None:
    with pytest.raises(ProtocolError, match=problem):
        decode(frames, dtype, numel)


def test_only_distributed_stores_compress() -> None:
    LocalKVStore().set_gradient_compression(None)  # "no compression" is fine anywhere, in every form
    LocalKVStore().set_gradient_compression(GradientCompression())
    with pytest.raises(KVStoreError, match="use a dist_\\* kvstore"):
        LocalKVStore().set_gradient_compression("2bit")
    with pytest.raises(ValueError, match="needs a distributed kvstore"):
        TrainerConfig(gradient_compression="2bit")


def test_2bit_packing_is_the_same_on_either_byte_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fast path folds four codes as one little-endian int32; the generic one shifts bytes."""
    from tandem.kvstore import compression

    codes = torch.randint(0, 3, (1001,), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    fast = compression._pack_2bit(codes)
    monkeypatch.setattr(sys, "byteorder", "big")
    assert torch.equal(compression._pack_2bit(codes), fast)
    expected = torch.cat([codes, codes.new_zeros(3)]).view(-1, 4)
    assert torch.equal(fast, expected[:, 0] | expected[:, 1] << 2 | expected[:, 2] << 4 | expected[:, 3] << 6)
    assert torch.equal(compression._unpack_2bit(fast, 1.0, 1001, torch.float32), torch.tensor([0.0, 1.0, -1.0])[codes.long()])
