"""Which server holds which part of each key: a small strategy interface and ps-lite's default.

Placement lives in one module so that every worker computes the same plan without talking: a plan
depends only on the key, its element count and the job's topology. P3's round-robin slicing
(``RoundRobinPlacement``) is the second ``Placement`` beside ``RangePlacement``.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Protocol

from tandem.kvstore.ps.protocol import Key


@dataclass(frozen=True)
class Slice:
    """Elements ``[start, stop)`` of a key's flattened array live on ``server``."""

    server: int
    start: int
    stop: int

    def __post_init__(self) -> None:
        if not (self.server >= 0 and 0 <= self.start <= self.stop):
            raise ValueError(f"invalid slice: server {self.server}, elements [{self.start}, {self.stop})")

    @property
    def numel(self) -> int:
        return self.stop - self.start


class Placement(Protocol):
    def plan(self, key: Key, numel: int) -> list[Slice]:
        """The slices of ``key``, in element order, covering ``[0, numel)`` exactly once."""
        ...


def stable_server(key: Key, num_servers: int) -> int:
    """A server index for ``key`` that every process agrees on (Python's ``hash`` is salted per process)."""
    if isinstance(key, int):
        return (key * 9973) % num_servers  # ps-lite's rule for integer keys
    return zlib.crc32(key.encode("utf-8")) % num_servers


def _check_sizes(num_servers: int, size_name: str, size: int, knob: str) -> None:
    """The checks every placement's configuration shares: a server count and a positive size."""
    if num_servers < 1:
        raise ValueError(f"num_servers must be >= 1, got {num_servers}")
    if size < 1:
        raise ValueError(f"{size_name} must be >= 1 ({knob}), got {size}")


def _check_numel(numel: int) -> None:
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")


@dataclass(frozen=True)
class RangePlacement:
    """ps-lite's default: small arrays go whole to one server, big ones split evenly over all.

    Arrays of at least ``bigarray_bound`` elements are cut into ``num_servers`` contiguous parts
    whose sizes differ by at most one element, so every server carries the same load. A part of
    more than ``max_slice_numel`` elements is cut further (its pieces stay on its server), so no
    message carries more than a socket's frame limit (``TANDEM_PS_MAX_FRAME_BYTES``).
    """

    num_servers: int
    bigarray_bound: int = 1_000_000
    max_slice_numel: int = 2**62

    def __post_init__(self) -> None:
        _check_sizes(self.num_servers, "bigarray_bound", self.bigarray_bound, "TANDEM_KVSTORE_BIGARRAY_BOUND")
        _check_sizes(self.num_servers, "max_slice_numel", self.max_slice_numel, "TANDEM_PS_MAX_FRAME_BYTES")

    def plan(self, key: Key, numel: int) -> list[Slice]:
        _check_numel(numel)
        if numel < self.bigarray_bound or self.num_servers == 1:
            parts = [Slice(stable_server(key, self.num_servers), 0, numel)]
        else:
            bounds = [numel * part // self.num_servers for part in range(self.num_servers + 1)]
            slices = [Slice(server, bounds[server], bounds[server + 1]) for server in range(self.num_servers)]
            parts = [part for part in slices if part.numel > 0]  # fewer elements than servers: skip empty parts
        most = self.max_slice_numel
        if all(part.numel <= most for part in parts):
            return parts
        return [Slice(part.server, start, min(start + most, part.stop))
                for part in parts for start in range(part.start, part.stop, most)]  # fmt: skip


@dataclass(frozen=True)
class RoundRobinPlacement:
    """P3's placement: slices of ``slice_size`` elements, consecutive slices on consecutive servers.

    Every slice is its own request (so a big layer neither hogs one server nor holds the link for
    long); the first slice goes to the key's stable server, so single-slice keys still spread out.
    """

    num_servers: int
    slice_size: int = 40_000

    def __post_init__(self) -> None:
        _check_sizes(self.num_servers, "slice_size", self.slice_size, "TANDEM_KVSTORE_SLICE_THRESHOLD")

    def plan(self, key: Key, numel: int) -> list[Slice]:
        _check_numel(numel)
        first = stable_server(key, self.num_servers)
        if numel == 0:
            return [Slice(first, 0, 0)]
        starts = range(0, numel, self.slice_size)
        return [Slice((first + index) % self.num_servers, start, min(start + self.slice_size, numel))
                for index, start in enumerate(starts)]  # fmt: skip
