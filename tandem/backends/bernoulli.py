"""Dropout's random draws on the CPU: eager's numbers, bit for bit, several times faster.

Eager dropout draws a Bernoulli tensor (``empty_like(x).bernoulli_(1 - p)``). On every CPU but Intel's, torch draws it
one element at a time from the default generator's mt19937 (aten's ``bernoulli_scalar_kernel``
hands Intel CPUs to MKL's stream instead): two 32-bit words an element, under a lock, in a loop
the compiler cannot vectorise. On a 2-core AMD EPYC that took 17.6 ms of a profiled 144.5 ms step
of the zoo gpt (docs/compiled.md). ``tandem::bernoulli`` makes the same numbers from the same generator
state, a block of 624 words at a time, in C compiled for this machine on first use, and leaves
the generator where aten leaves it: the masks, and every later draw, are eager's.

How aten draws one element (``at::bernoulli_distribution<double>``): a 64-bit number from two
words, the first one high; its low 53 bits times 2**-53 is a double ``u`` in [0, 1); the element
is ``u < p``, which for an integer ``k`` is ``k < ceil(p * 2**53)``, exactly.

``tandem::bernoulli`` falls back to aten's draw unless ``unavailable_reason`` is None: on first use the C
source is compiled (into a private temporary directory, removed once loaded) and its draws, and the
generator's state after them, are checked against aten's on a private generator. Elsewhere (Intel
CPUs, no C compiler, ``TANDEM_FAST_BERNOULLI=0``), and for other dtypes, it
is ``torch.empty_like(self).bernoulli_(p)``, eager's own.

Contract: unlike aten's draw, which holds the generator's lock, a draw reads the default CPU
generator's state, runs the kernel without the GIL (other threads, the kvstore's among them, run
meanwhile), then sets the state. tandem's segments run one after another, so its own draws never
overlap; a draw from the default generator on another thread of the user's during one is undone
(its numbers come again). Draw elsewhere from your own ``torch.Generator``, or set
``TANDEM_FAST_BERNOULLI=0``.
"""

from __future__ import annotations

import ctypes
import functools
import math
import os
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from tandem.env import knob

# The state layout of torch's CPU generator (CPUGeneratorImplState): left (int32) at byte 8, next
# (uint64) at 16, the 624 mt19937 words as uint64 from 24. The self-test fails if it ever changes.
_SOURCE = r"""
#include <stdint.h>
#define N 624
#define M 397
#define CHUNK 1024

static inline uint32_t twist(uint32_t u, uint32_t v) {
  return (((u & 0x80000000U) | (v & 0x7fffffffU)) >> 1) ^ ((v & 1U) ? 0x9908b0dfU : 0U);
}

static void regenerate(uint32_t *s) { /* at::mt19937::next_state: three loops the compiler vectorises */
  int i;
  for (i = 0; i < N - M; i++) s[i] = s[i + M] ^ twist(s[i], s[i + 1]);
  for (; i < N - 1; i++) s[i] = s[i + M - N] ^ twist(s[i], s[i + 1]);
  s[N - 1] = s[M - 1] ^ twist(s[N - 1], s[0]);
}

typedef struct { uint32_t s[N]; int64_t next, avail; } stream_t;

static void take(stream_t *st, uint32_t *dst, int64_t count) { /* count tempered words, in order */
  while (count > 0) {
    if (st->avail == 0) { regenerate(st->s); st->next = 0; st->avail = N; }
    int64_t k = count < st->avail ? count : st->avail;
    const uint32_t *src = st->s + st->next;
    for (int64_t j = 0; j < k; j++) {
      uint32_t y = src[j];
      y ^= y >> 11; y ^= (y << 7) & 0x9d2c5680U; y ^= (y << 15) & 0xefc60000U; y ^= y >> 18;
      dst[j] = y;
    }
    st->next += k; st->avail -= k; dst += k; count -= k;
  }
}

/* aten's mt19937 calls regenerate when --left reaches 0: left - 1 words remain from next */
#define DRAW(name, type)                                                                  \
  void name(uint8_t *state, type *out, int64_t n, uint64_t threshold) {                   \
    stream_t st;                                                                          \
    uint64_t *words = (uint64_t *)(state + 24);                                           \
    for (int i = 0; i < N; i++) st.s[i] = (uint32_t)words[i];                             \
    st.next = (int64_t)*(uint64_t *)(state + 16);                                         \
    st.avail = (int64_t)*(int32_t *)(state + 8) - 1;                                      \
    uint32_t buffer[2 * CHUNK];                                                           \
    for (int64_t done = 0; done < n; done += CHUNK) {                                     \
      int64_t k = n - done < CHUNK ? n - done : CHUNK;                                    \
      take(&st, buffer, 2 * k);                                                           \
      for (int64_t i = 0; i < k; i++) {                                                   \
        uint64_t low53 = ((uint64_t)(buffer[2 * i] & 0x1fffffU) << 32) | buffer[2 * i + 1]; \
        out[done + i] = low53 < threshold ? (type)1 : (type)0;                            \
      }                                                                                   \
    }                                                                                     \
    for (int i = 0; i < N; i++) words[i] = st.s[i];                                       \
    *(int32_t *)(state + 8) = (int32_t)(st.avail + 1);                                    \
    *(uint64_t *)(state + 16) = (uint64_t)st.next;                                        \
  }

DRAW(bernoulli_float32, float)
DRAW(bernoulli_float64, double)
"""

_STATE_BYTES = 5056  # sizeof(CPUGeneratorImplState) in torch 2.x
_KERNELS = {torch.float32: "bernoulli_float32", torch.float64: "bernoulli_float64"}
_FLAG_SETS: tuple[list[str], ...] = (["-march=native"], [])  # vectorised for this CPU, else whatever the compiler defaults to


@torch.library.custom_op("tandem::bernoulli", mutates_args=(), tags=(torch.Tag.nondeterministic_seeded,))
def bernoulli(self: torch.Tensor, p: float) -> torch.Tensor:
    """Eager dropout's noise draw, ``torch.empty_like(self).bernoulli_(p)``: ``self``'s layout, drawn
    in memory order from the default generator, fast where ``available``. The dropout pass emits it
    (tagged random: never recomputed, and inductor keeps the draws in program order)."""
    out = torch.empty_like(self)  # eager's noise keeps the input's layout (channels-last stays so)
    if 0.0 <= p <= 1.0 and available(out.device, out.dtype) and _dense(out):
        return draw(out, p, torch.default_generator)  # dense, as empty_like makes it: memory order is storage order
    return out.bernoulli_(p)  # aten's own (and its error for a bad p)


OP = torch.ops.tandem.bernoulli.default  # what graphs call


@bernoulli.register_fake
def _bernoulli_fake(self: torch.Tensor, p: float) -> torch.Tensor:
    return torch.empty_like(self)


def _dense(tensor: torch.Tensor) -> bool:
    """Its elements fill its storage range without gaps or overlaps, in some order of dimensions."""
    expected = 1
    for size, stride in sorted(zip(tensor.shape, tensor.stride()), key=lambda dim: dim[1]):
        if size != 1:
            if stride != expected:
                return False
            expected *= size
    return True


def available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``tandem::bernoulli`` draws fast, and eager's numbers, for tensors of ``device`` and ``dtype``."""
    return device.type == "cpu" and dtype in _KERNELS and unavailable_reason() is None


def unavailable_reason() -> str | None:
    """Why the fast draw is not used here (None: it is); compiles and checks it on first call."""
    if not knob("TANDEM_FAST_BERNOULLI"):
        return "TANDEM_FAST_BERNOULLI=0"
    return _checked()


def draw(out: torch.Tensor, p: float, generator: torch.Generator) -> torch.Tensor:
    """Fill dense CPU ``out``, in memory order, as ``out.bernoulli_(p, generator=generator)`` would,
    advancing ``generator`` as it would (``0 <= p <= 1``; float32 or float64)."""
    library = _library()
    assert not isinstance(library, str), library
    state = generator.get_state()
    if state.numel() != _STATE_BYTES:  # the kernel reads and writes this layout: never out of bounds
        raise RuntimeError(f"torch's CPU generator state has {state.numel()} bytes, not {_STATE_BYTES}: "
                           f"set TANDEM_FAST_BERNOULLI=0")  # fmt: skip
    getattr(library, _KERNELS[out.dtype])(state.data_ptr(), out.data_ptr(), out.numel(), math.ceil(p * 2.0**53))
    generator.set_state(state)
    return out


@functools.cache
def _checked() -> str | None:
    """Compile, then compare with aten on a private generator: sizes across mt19937's 624-word
    blocks, from a fresh seed (whose first draw regenerates) and from mid-block."""
    library = _library()
    if isinstance(library, str):
        return library
    if (size := torch.Generator().get_state().numel()) != _STATE_BYTES:
        return f"torch's CPU generator state has another layout ({size} bytes, not {_STATE_BYTES})"
    for dtype in _KERNELS:
        for size in (1, 311, 624, 1249, 5000):
            for p in (0.9, 0.5, 0.003):
                for offset in (0, 3):
                    ours, aten = torch.Generator().manual_seed(size), torch.Generator().manual_seed(size)
                    torch.rand(offset, generator=ours), torch.rand(offset, generator=aten)
                    got = draw(torch.empty(size, dtype=dtype), p, ours)
                    expected = torch.empty(size, dtype=dtype).bernoulli_(p, generator=aten)
                    if not (torch.equal(got, expected) and torch.equal(ours.get_state(), aten.get_state())):
                        return ("torch draws Bernoulli numbers another way on this CPU (MKL's stream on Intel "
                                "CPUs), so a fast draw would change dropout's masks")  # fmt: skip
    return None


@functools.cache
def _library() -> ctypes.CDLL | str:
    """The compiled kernels, or why there are none. Built in a private temporary directory (nothing
    another user could have written is loaded), removed once loaded (the mapping stays)."""
    try:
        compiler = shlex.split(os.environ.get("CC", "")) or [shutil.which("cc") or shutil.which("gcc") or ""]
    except ValueError as error:
        return f"CC={os.environ.get('CC')!r} is not a command line: {error}"
    if not compiler[0]:
        return "no C compiler (cc) on PATH"
    try:
        with tempfile.TemporaryDirectory(prefix="tandem-bernoulli-") as directory:
            return _build(compiler, Path(directory))
    except Exception as error:  # noqa: BLE001 - no such compiler, no writable temporary directory, a noexec mount...
        return f"could not build or load the kernel with {compiler[0]}: {type(error).__name__}: {error}"


def _build(compiler: list[str], directory: Path) -> ctypes.CDLL | str:
    source, library = directory / "bernoulli.c", directory / "bernoulli.so"
    source.write_text(_SOURCE)
    failure = ""
    for flags in _FLAG_SETS:
        command = [*compiler, "-x", "c", "-O3", *flags, "-shared", "-fPIC", str(source), "-o", str(library)]  # C even with CC=g++
        try:
            result = subprocess.run(command, capture_output=True, text=True, errors="replace", timeout=120)
        except subprocess.TimeoutExpired:
            return f"{compiler[0]} took over 120 s to compile the kernel"
        if result.returncode == 0:
            loaded = ctypes.CDLL(str(library))
            for name in _KERNELS.values():
                kernel = getattr(loaded, name)
                kernel.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint64]
                kernel.restype = None
            return loaded
        failure = (result.stderr.strip().splitlines() or ["no output"])[0]
    return f"{compiler[0]} could not compile the kernel: {failure}"
