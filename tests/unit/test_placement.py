"""Placement: whole small arrays on a stable server, big arrays split evenly over all servers."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tandem.kvstore.ps.placement import RangePlacement, Slice, stable_server


@given(st.integers(0, 10_000), st.integers(1, 5), st.integers(1, 50))
def test_plan_covers_every_element_once(numel: int, servers: int, bound: int) -> None:
    slices = RangePlacement(servers, bound).plan("k", numel)
    assert slices[0].start == 0 and slices[-1].stop == numel
    assert all(a.stop == b.start for a, b in zip(slices, slices[1:]))
    assert all(0 <= part.server < servers for part in slices)


def test_small_arrays_go_whole_to_the_hashed_server() -> None:
    placement = RangePlacement(3, bigarray_bound=1000)
    assert placement.plan(5, 999) == [Slice((5 * 9973) % 3, 0, 999)]
    assert placement.plan("w", 0) == [Slice(stable_server("w", 3), 0, 0)]


def test_big_arrays_split_into_near_equal_contiguous_parts() -> None:
    slices = RangePlacement(3, bigarray_bound=10).plan("w", 11)
    assert slices == [Slice(0, 0, 3), Slice(1, 3, 7), Slice(2, 7, 11)]
    assert max(s.numel for s in slices) - min(s.numel for s in slices) <= 1
    assert RangePlacement(3, bigarray_bound=1).plan("w", 2) == [Slice(1, 0, 1), Slice(2, 1, 2)]


def test_string_keys_place_the_same_in_every_process() -> None:
    keys = ["layer.0.weight", "layer.0.bias", "embedding", "x"]
    here = [stable_server(key, 7) for key in keys]
    code = f"from tandem.kvstore.ps.placement import stable_server; print([stable_server(k, 7) for k in {keys!r}])"
    there = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert there.stdout.strip() == str(here)
    assert len(set(stable_server(f"k{i}", 4) for i in range(100))) == 4  # keys spread over servers


def test_invalid_configuration_is_named() -> None:
    with pytest.raises(ValueError, match="num_servers"):
        RangePlacement(0)
    with pytest.raises(ValueError, match="BIGARRAY_BOUND"):
        RangePlacement(2, 0)


@given(st.integers(0, 5_000), st.integers(1, 4), st.integers(1, 60), st.integers(1, 700))
def test_parts_bigger_than_max_slice_numel_are_cut_on_their_server(numel: int, servers: int, bound: int,
                                                                   most: int) -> None:  # fmt: skip
    """Every piece fits ``max_slice_numel``; the pieces cover [0, numel) once, in order, and each lies on
    the server whose part it was cut from (the plan without the limit)."""
    whole = RangePlacement(servers, bound).plan("k", numel)
    pieces = RangePlacement(servers, bound, most).plan("k", numel)
    assert pieces[0].start == 0 and pieces[-1].stop == numel
    assert all(a.stop == b.start for a, b in zip(pieces, pieces[1:]))
    assert all(piece.numel <= most for piece in pieces)
    assert all(piece.numel > 0 for piece in pieces) or pieces == whole  # only an empty array has an empty piece
    for piece in pieces:
        (part,) = [part for part in whole if part.start <= piece.start and piece.stop <= part.stop]
        assert piece.server == part.server
    if all(part.numel <= most for part in whole):
        assert pieces == whole  # nothing to cut: the plan is the same


def test_cutting_examples_and_an_invalid_limit_named() -> None:
    assert RangePlacement(2, bigarray_bound=10, max_slice_numel=4).plan("w", 11) == [
        Slice(0, 0, 4), Slice(0, 4, 5), Slice(1, 5, 9), Slice(1, 9, 11)]  # fmt: skip
    server = stable_server("w", 3)
    assert RangePlacement(3, bigarray_bound=100, max_slice_numel=3).plan("w", 7) == [
        Slice(server, 0, 3), Slice(server, 3, 6), Slice(server, 6, 7)]  # fmt: skip
    with pytest.raises(ValueError, match="max_slice_numel must be >= 1 .TANDEM_PS_MAX_FRAME_BYTES"):
        RangePlacement(2, 10, 0)
