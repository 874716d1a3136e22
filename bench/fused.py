"""Fused multi-tensor ops against per-tensor loops, engine ops and torch's foreach paths.

MXNet's table (500 arrays of 100x100 float32 zeroed 10 times: 0.84 s per-array ops, 0.64 s with
engine bulking, 0.016 s as one operator) plus the global norm and SGD(momentum)/AdamW steps over
200 parameters of mixed sizes. Every variant runs once per round, round-robin, so machine noise hits
all of them alike; the table shows medians over the rounds.

Reproduce: .venv/bin/python bench/fused.py  (options: --rounds, --threads; see --help)
Writes bench/out/fused.png and bench/out/fused.md.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere without installing

from tandem import ops, optim  # noqa: E402

try:
    from tandem import engine
except ImportError:  # the engine is built in parallel; its rows are skipped until it lands
    engine = None  # type: ignore[assignment]

OUT = Path(__file__).resolve().parent / "out"


@dataclass
class Row:
    section: str
    label: str
    run: Callable[[], None]
    samples: list[float]


def zeroing_rows(count: int, side: int, repeats: int) -> list[Row]:
    """MXNet's reset_arrays benchmark: ``count`` arrays of side x side, each zeroed ``repeats`` times."""
    arrays = [torch.ones(side, side) for _ in range(count)]
    params = [torch.nn.Parameter(torch.ones(side, side)) for _ in range(count)]
    for param in params:
        param.grad = torch.ones(side, side)
    torch_optimizer = torch.optim.SGD(params, lr=0.1)

    def repeated(function: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            for _ in range(repeats):
                function()

        return run

    rows = [
        Row("zero", "Python loop of zero_()", repeated(lambda: [array.zero_() for array in arrays] and None), []),
        Row("zero", "tandem.ops.reset_arrays", repeated(lambda: ops.reset_arrays(arrays)), []),
        Row("zero", "torch._foreach_zero_", repeated(lambda: torch._foreach_zero_(arrays)), []),
        Row("zero", "torch.optim zero_grad(set_to_none=False)", repeated(lambda: torch_optimizer.zero_grad(set_to_none=False)), []),
    ]
    if engine is not None:
        rows += engine_zeroing_rows(arrays, repeats)
    return rows


def engine_zeroing_rows(arrays: list[torch.Tensor], repeats: int) -> list[Row]:
    engine_instance = engine.get_engine()
    variables = [engine.Var(f"array{index}") for index in range(len(arrays))]
    zero_ops = [partial(torch.Tensor.zero_, array) for array in arrays]

    def per_array() -> None:
        for _ in range(repeats):
            for zero, variable in zip(zero_ops, variables):
                engine_instance.push(zero, writes=[variable], name="zero")
        engine_instance.wait_all()

    def bulked() -> None:
        with engine.bulk(len(arrays)):
            for _ in range(repeats):
                for zero, variable in zip(zero_ops, variables):
                    engine_instance.push(zero, writes=[variable], name="zero")
        engine_instance.wait_all()

    def fused() -> None:
        for _ in range(repeats):
            engine_instance.push(partial(ops.reset_arrays, arrays), writes=variables, name="reset_arrays")
        engine_instance.wait_all()

    return [
        Row("zero", "engine: one op per array", per_array, []),
        Row("zero", f"engine: per-array ops in bulk({len(arrays)})", bulked, []),
        Row("zero", "engine: one op calling reset_arrays", fused, []),
    ]


def mixed_sizes(count: int, smallest: int, largest: int, seed: int) -> list[int]:
    """Log-uniform element counts: many small tensors (biases, norms) and a few big weights."""
    generator = torch.Generator().manual_seed(seed)
    logs = torch.empty(count, dtype=torch.float64).uniform_(math.log(smallest), math.log(largest), generator=generator)
    return [int(round(math.exp(value))) for value in logs.tolist()]


def random_tensors(sizes: list[int], seed: int, scale: float = 1.0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(size, generator=generator) * scale for size in sizes]


def norm_rows(sizes: list[int]) -> list[Row]:
    """Global gradient norm: tandem vs a per-parameter loop vs torch's foreach total norm."""
    grads = random_tensors(sizes, seed=2)
    rows = [
        Row("global norm", "tandem.ops.global_norm", lambda: ops.global_norm(grads) and None, []),
        Row("global norm", "per-parameter loop", lambda: torch.stack([grad.norm() for grad in grads]).norm() and None, []),
    ]
    if hasattr(torch.nn.utils, "get_total_norm"):
        rows.append(Row("global norm", "torch get_total_norm(foreach=True)",
                        lambda: torch.nn.utils.get_total_norm(grads, foreach=True) and None, []))
    return rows


def optimizer_rows(name: str, section: str, sizes: list[int]) -> list[Row]:
    """One optimizer step: tandem (foreach, fused kernel) vs torch (per-parameter loop, foreach, fused)."""
    torch_class, extra = {"sgd": (torch.optim.SGD, {"momentum": 0.9}), "adamw": (torch.optim.AdamW, {})}[name]
    initial, grads = random_tensors(sizes, seed=1), random_tensors(sizes, seed=3, scale=1e-2)
    rows = []
    for fused in (False, True):
        ours = optim.create(name, lr=1e-3, fused=fused, **extra)
        params = [tensor.clone() for tensor in initial]
        states = [ours.create_state(param) for param in params]
        label = f"tandem.optim.{type(ours).__name__}" + (" fused=True (single-pass kernel)" if fused else " (foreach)")
        rows.append(Row(section, label, partial(ours.update, params, grads, states), []))
    for option, label in (({"foreach": False}, "per-parameter loop (foreach=False)"),
                          ({"foreach": True}, "foreach=True"), ({"fused": True}, "fused=True")):
        holders = [torch.nn.Parameter(tensor.clone()) for tensor in initial]
        for holder, grad in zip(holders, grads):
            holder.grad = grad
        torch_optimizer = torch_class(holders, lr=1e-3, **extra, **option)
        rows.append(Row(section, f"torch.optim.{torch_class.__name__} {label}", torch_optimizer.step, []))
    return rows


def measure(rows: list[Row], rounds: int) -> None:
    """Every row once per round, in a fresh shuffled order: no variant always inherits a warm cache."""
    for row in rows:  # warm-up: allocate optimizer state, start engine threads
        row.run()
    order = random.Random(0)
    for _ in tqdm(range(rounds), desc="rounds", unit="round"):
        for row in order.sample(rows, len(rows)):
            start = time.perf_counter()
            row.run()
            row.samples.append(time.perf_counter() - start)


def median_ms(row: Row) -> float:
    return statistics.median(row.samples) * 1e3


def ratio_of_medians(row: Row, baseline: Row) -> float:
    return median_ms(row) / median_ms(baseline)


def baseline_of(row: Row, rows: list[Row]) -> Row:
    """The first tandem row of the row's section (reset_arrays, global_norm, the foreach optimizer)."""
    return next(other for other in rows if other.section == row.section and other.label.startswith("tandem"))


def table(rows: list[Row]) -> str:
    """Markdown: median ms and its ratio to the median of the section's first tandem row."""
    lines = ["| section | variant | median ms | x first tandem row |", "|---|---|---:|---:|"]
    for row in rows:
        ratio = ratio_of_medians(row, baseline_of(row, rows))
        lines.append(f"| {row.section} | {row.label} | {median_ms(row):.3f} | {ratio:.2f} |")
    return "\n".join(lines)


def goals(rows: list[Row]) -> list[str]:
    named = {(row.section, row.label): row for row in rows}
    results = []

    def ratio(slower: str, faster: str, section: str = "zero") -> float:
        return ratio_of_medians(named[section, slower], named[section, faster])

    def goal(text: str, value: float, target: float, higher_is_better: bool) -> None:
        met = value >= target if higher_is_better else value <= target
        results.append(f"- {text}: {value:.2f}x (goal {'>=' if higher_is_better else '<='} {target}x) {'MET' if met else 'MISSED'}")

    if ("zero", "engine: one op per array") in named:
        goal("reset_arrays vs one engine op per array (speed-up)", ratio("engine: one op per array", "tandem.ops.reset_arrays"), 50, True)
        ceiling = ratio("engine: one op per array", "torch._foreach_zero_")
        results.append(f"  (ceiling here: torch._foreach_zero_ itself is {ceiling:.2f}x faster than one engine op per array)")
    goal("reset_arrays / torch._foreach_zero_ (time ratio)", ratio("tandem.ops.reset_arrays", "torch._foreach_zero_"), 1.05, False)
    for section in ("adamw step", "adamw step, small params"):
        for label in ("tandem.optim.AdamW (foreach)", "tandem.optim.AdamW fused=True (single-pass kernel)"):
            loop = ratio("torch.optim.AdamW per-parameter loop (foreach=False)", label, section)
            goal(f"{section}: {label} vs per-parameter loop (speed-up)", loop, 2, True)
            foreach = ratio(label, "torch.optim.AdamW foreach=True", section)
            goal(f"{section}: {label} / torch AdamW(foreach=True) (time ratio)", foreach, 1.1, False)
    return results


def plot(rows: list[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sections = list(dict.fromkeys(row.section for row in rows))
    figure, axes = plt.subplots(len(sections), 1, figsize=(9, 2.2 * len(sections) + 1))
    for axis, section in zip(axes, sections):
        members = [row for row in rows if row.section == section]
        axis.barh([row.label for row in members], [median_ms(row) for row in members],
                  color=["tab:green" if row.label.startswith("tandem") else "tab:gray" for row in members])
        axis.set_title(section)
        axis.set_xlabel("median ms (lower is better)")
        if section == "zero":
            axis.set_xscale("log")
            axis.set_title("zero 500 arrays of 100x100, 10 times")
        axis.invert_yaxis()
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=15, help="timed rounds per variant (median of these; >= 5)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (the CI machine has 2 cores)")
    parser.add_argument("--params", type=int, default=200, help="parameters in the optimizer/norm rows")
    args = parser.parse_args()
    if args.rounds < 5:
        parser.error("--rounds must be >= 5 (the table reports medians)")
    torch.set_num_threads(args.threads)
    command = f".venv/bin/python bench/fused.py --rounds {args.rounds} --threads {args.threads} --params {args.params}"
    sizes = mixed_sizes(args.params, 10, 250_000, seed=0)
    print(f"reproduce: {command}")
    print(f"torch {torch.__version__}, {args.threads} thread(s); engine {'present' if engine else 'MISSING: engine rows skipped'}")
    print(f"zero: 500 arrays of 100x100 float32, 10 times per run; steps: {len(sizes)} params, "
          f"{sum(sizes):,} elements, sizes {min(sizes)}..{max(sizes)} (small params: 10..1000 elements)")
    small = mixed_sizes(args.params, 10, 1_000, seed=0)
    rows = (zeroing_rows(500, 100, 10) + norm_rows(sizes) + optimizer_rows("sgd", "sgd(momentum) step", sizes)
            + optimizer_rows("adamw", "adamw step", sizes) + optimizer_rows("adamw", "adamw step, small params", small))
    measure(rows, args.rounds)
    report = "\n".join([table(rows), "", *goals(rows), "", f"Command: `{command}`"])
    print(report)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "fused.md").write_text(report + "\n")
    plot(rows, OUT / "fused.png")
    print(f"wrote {OUT / 'fused.md'} and {OUT / 'fused.png'}")


if __name__ == "__main__":
    main()
