"""Engine overhead: microseconds per pushed op, threaded vs naive, with and without dependencies.

Each case pushes N empty ops and waits for all of them; the figure is (push time + wait_all) / N.
Cases run round-robin, once per round, so machine noise hits all of them alike; the table shows the
median over rounds and each case's ratio to the headline case (threaded engine, one fresh var per op).

Reproduce: .venv/bin/python bench/engine_overhead.py  (options: --ops, --runs; see --help)
Writes bench/out/engine_overhead.png and bench/out/engine_overhead.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere without installing

from tandem import engine  # noqa: E402

OUT = Path(__file__).resolve().parent / "out"


def time_round_robin(cases: dict[str, Callable[[], None]], runs: int, desc: str) -> dict[str, list[float]]:
    """Seconds per run of each case; one run of every case per round."""
    samples: dict[str, list[float]] = {label: [] for label in cases}
    for _ in tqdm(range(runs), desc=desc, unit="round"):
        for label, case in cases.items():
            start = time.perf_counter()
            case()
            samples[label].append(time.perf_counter() - start)
    return samples


def write_report(name: str, title: str, lines: list[str], medians: dict[str, float], unit: str) -> None:
    """Print the markdown table and save it with a horizontal bar plot of the medians under bench/out/."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    OUT.mkdir(parents=True, exist_ok=True)
    table = "\n".join(lines)
    labels, values = list(medians), list(medians.values())
    (OUT / f"{name}.md").write_text(table + "\n")
    figure, axes = plt.subplots(figsize=(8, 0.5 * len(labels) + 1.5))
    axes.barh(labels[::-1], values[::-1], color="tab:blue")
    axes.set_xlabel(unit)
    axes.set_title(title)
    figure.tight_layout()
    figure.savefig(OUT / f"{name}.png", dpi=120)
    print(table)
    print(f"\nwrote {OUT / f'{name}.md'} and {OUT / f'{name}.png'}")


def overhead_cases(ops: int) -> dict[str, Callable[[], None]]:
    threaded, naive = engine.ThreadedEngine(), engine.NaiveEngine()
    fresh = [engine.Var(f"v{index}") for index in range(ops)]
    shared = engine.Var("shared")

    def noop() -> None:
        pass

    def case(eng: engine.Engine, push: Callable[[engine.Engine], None]) -> Callable[[], None]:
        def run() -> None:
            push(eng)
            eng.wait_all()

        return run

    def independent(eng: engine.Engine) -> None:
        push = eng.push
        for var in fresh:
            push(noop, writes=(var,))

    def chain(eng: engine.Engine) -> None:
        push, writes = eng.push, (shared,)
        for _ in range(ops):
            push(noop, writes=writes)

    def shared_reads(eng: engine.Engine) -> None:
        push, reads = eng.push, (shared,)
        for _ in range(ops):
            push(noop, reads=reads)

    def bulked(eng: engine.Engine) -> None:
        with engine.bulk(64):
            independent(eng)

    def plain_calls() -> None:
        for _ in fresh:
            noop()

    return {
        "threaded, one fresh var per op (headline)": case(threaded, independent),
        "threaded, dependency chain (all write one var)": case(threaded, chain),
        "threaded, all read one var": case(threaded, shared_reads),
        "threaded, inside engine.bulk(64)": case(threaded, bulked),
        "naive, one fresh var per op": case(naive, independent),
        "naive, dependency chain": case(naive, chain),
        "plain Python call of the op (no engine)": plain_calls,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ops", type=int, default=100_000, help="ops pushed per case and round")
    parser.add_argument("--runs", type=int, default=5, help="rounds; the table shows medians (>= 5)")
    args = parser.parse_args()
    if args.runs < 5 or args.ops < 1:
        parser.error("--runs must be >= 5 and --ops >= 1")
    command = f".venv/bin/python bench/engine_overhead.py --ops {args.ops} --runs {args.runs}"
    print(f"reproduce: {command}")
    samples = time_round_robin(overhead_cases(args.ops), args.runs, "engine overhead")
    per_op = {label: [seconds / args.ops * 1e6 for seconds in runs] for label, runs in samples.items()}
    medians = {label: statistics.median(values) for label, values in per_op.items()}
    headline = next(iter(medians.values()))
    lines = [
        f"Engine overhead, {args.ops} empty ops per case, median of {args.runs} rounds (`{command}`)",
        "",
        "| case | µs/op (median) | min | max | vs headline |",
        "|---|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {label} | {medians[label]:.2f} | {min(values):.2f} | {max(values):.2f} | {medians[label] / headline:.2f}x |"
        for label, values in per_op.items()
    ]
    verdict = "met" if headline <= 10 else "missed"
    lines += ["", f"Target <= 10 µs per op on the threaded engine: {verdict} ({headline:.2f} µs)."]
    write_report("engine_overhead", "engine overhead per op", lines, medians, "µs per op (median)")


if __name__ == "__main__":
    main()
