"""tandem::bernoulli: aten.bernoulli.p's numbers and generator state, bit for bit, on every path."""

from __future__ import annotations

import shutil

import pytest
import torch

from tandem.backends import bernoulli

fast_only = pytest.mark.skipif(bernoulli.unavailable_reason() is not None,
                               reason=f"tandem's fast draw is not used here: {bernoulli.unavailable_reason()}")


def aten_and_tandem(shape: tuple[int, ...], p: float, dtype: torch.dtype, seed: int, skip: int) -> None:
    """Both draws from the same state of the default generator: equal values, equal state after."""
    torch.manual_seed(seed)
    torch.rand(skip)  # start mid-block (skip 0: a fresh seed, whose first draw regenerates the block)
    expected = torch.ops.aten.bernoulli.p(torch.empty(shape, dtype=dtype), p)
    state = torch.get_rng_state()
    torch.manual_seed(seed)
    torch.rand(skip)
    got = torch.ops.tandem.bernoulli(torch.empty(shape, dtype=dtype), p)
    assert got.dtype == dtype and got.shape == expected.shape
    assert torch.equal(got, expected)
    assert torch.equal(torch.get_rng_state(), state), "the generator is left where aten leaves it"


@fast_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("size", [1, 2, 311, 312, 623, 624, 625, 1023, 1024, 1025, 70_001])
def test_the_fast_draw_is_atens(size: int, dtype: torch.dtype) -> None:
    for p in (0.9, 0.5, 0.1):
        for skip in (0, 1, 623):
            aten_and_tandem((size,), p, dtype, seed=size, skip=skip)


@fast_only
@pytest.mark.parametrize("p", [0.0, 1.0, 2.0**-53, 1 - 2.0**-53, 0.3])
def test_probabilities_at_the_edges(p: float) -> None:
    aten_and_tandem((4, 1000), p, torch.float32, seed=3, skip=5)


@fast_only
def test_successive_draws_follow_one_stream() -> None:
    torch.manual_seed(11)
    expected = [torch.ops.aten.bernoulli.p(torch.empty(n), 0.8) for n in (5, 700, 1300, 3)]
    torch.manual_seed(11)
    assert all(torch.equal(torch.ops.tandem.bernoulli(torch.empty(n), 0.8), e) for n, e in zip((5, 700, 1300, 3), expected))


@pytest.mark.parametrize("case", ["float16", "bfloat16", "non-contiguous", "channels-last", "disabled"])
def test_every_other_input_gets_atens_numbers_and_layout(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Half types go to aten's draw, as everything does with TANDEM_FAST_BERNOULLI=0; a strided input's
    noise keeps its layout and is drawn in memory order, as eager's ``empty_like(x).bernoulli_(p)``."""
    shape, dtype = (6, 7, 5, 3), torch.float32
    if case in ("float16", "bfloat16"):
        dtype = getattr(torch, case)
    if case == "disabled":
        monkeypatch.setenv("TANDEM_FAST_BERNOULLI", "0")
        assert bernoulli.unavailable_reason() == "TANDEM_FAST_BERNOULLI=0"
    source = torch.empty(shape, dtype=dtype)
    if case == "non-contiguous":
        source = source.transpose(0, 2)
    if case == "channels-last":
        source = source.contiguous(memory_format=torch.channels_last)
    torch.manual_seed(1)
    expected = torch.empty_like(source).bernoulli_(0.7)  # eager dropout's noise
    state = torch.get_rng_state()
    torch.manual_seed(1)
    got = torch.ops.tandem.bernoulli(source, 0.7)
    assert torch.equal(got, expected) and got.stride() == expected.stride()
    assert torch.equal(torch.get_rng_state(), state), "the generator is left where eager's draw leaves it"


def test_a_bad_probability_gets_atens_error() -> None:
    with pytest.raises(RuntimeError, match="bernoulli"):
        torch.ops.tandem.bernoulli(torch.empty(3), 1.5)


def test_it_is_tagged_random_so_mirroring_never_recomputes_it() -> None:
    import torch.fx as fx

    from tandem.graph import cost

    graph = fx.Graph()
    node = graph.call_function(torch.ops.tandem.bernoulli.default, (graph.placeholder("x"), 0.9))
    assert cost.is_random(node)


@pytest.mark.parametrize("compiler", ["/nonexistent/cc", "false", "g++", "cc '"])
def test_a_missing_or_failing_compiler_is_a_reason_not_an_error(compiler: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Then the op draws with aten's kernel: the reason says which compiler and what went wrong."""
    monkeypatch.setenv("CC", compiler)
    if compiler == "g++" and shutil.which("g++") is None:
        pytest.skip("no g++")
    built = bernoulli._library.__wrapped__()  # uncached: a fresh build under this CC
    if compiler == "g++":  # a C++ compiler builds it as C (unmangled names)
        assert not isinstance(built, str), built
    else:
        assert isinstance(built, str) and compiler.split()[0] in built, built
