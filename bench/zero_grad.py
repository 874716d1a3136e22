"""MXNet's zero_grad table on tandem's engine: 500 arrays of 100x100 float32, each zeroed 10 times.

(a) a Python loop of t.zero_(), (b) one engine op per array, (c) the same pushes inside
engine.bulk(500), (d) one engine op running the loop (stand-in for a fused op), (e) one engine op
calling tandem.ops.reset_arrays (n/a while tandem.ops lacks it). Every variant ends with wait_all.
Variants run round-robin, once per round; the table shows medians and the speed-up over (b).
MXNet measured 0.84 s for (b), 0.64 s with bulking (1.3x: gaps between bulks) and 0.016 s fused.

Reproduce: .venv/bin/python bench/zero_grad.py  (options: --runs, --threads; see --help)
Writes bench/out/zero_grad.png and bench/out/zero_grad.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_overhead import time_round_robin, write_report  # noqa: E402

from tandem import engine  # noqa: E402

try:
    from tandem.ops import reset_arrays
except ImportError:  # tandem.ops is built in parallel; its row shows n/a until it lands
    reset_arrays = None

ARRAYS, SIDE, REPEATS = 500, 100, 10


def zeroing_cases(eng: engine.Engine) -> dict[str, Callable[[], None] | None]:
    arrays = [torch.ones(SIDE, SIDE) for _ in range(ARRAYS)]
    variables = tuple(engine.Var(f"array{index}") for index in range(ARRAYS))
    zero_ops = [(array.zero_, (var,)) for array, var in zip(arrays, variables)]

    def python_loop() -> None:
        for array in arrays:
            array.zero_()

    def one_op_per_array() -> None:
        push = eng.push
        for zero, writes in zero_ops:
            push(zero, writes=writes, name="zero_")

    def bulked() -> None:
        with engine.bulk(ARRAYS):
            one_op_per_array()

    def repeated(body: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            for _ in range(REPEATS):
                body()
            eng.wait_all()

        return run

    fused = None if reset_arrays is None else partial(reset_arrays, arrays)
    return {
        "(a) Python loop of zero_()": repeated(python_loop),
        "(b) one engine op per array": repeated(one_op_per_array),
        "(c) one op per array inside engine.bulk(500)": repeated(bulked),
        "(d) one engine op running the loop": repeated(lambda: eng.push(python_loop, writes=variables)),
        "(e) one engine op calling tandem.ops.reset_arrays": (
            None if fused is None else repeated(lambda: eng.push(fused, writes=variables))
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=7, help="rounds; the table shows medians (>= 5)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args()
    if args.runs < 5 or args.threads < 1:
        parser.error("--runs must be >= 5 and --threads >= 1")
    torch.set_num_threads(args.threads)
    command = f".venv/bin/python bench/zero_grad.py --runs {args.runs} --threads {args.threads}"
    print(f"reproduce: {command}")
    cases = zeroing_cases(engine.ThreadedEngine())
    available = {label: case for label, case in cases.items() if case is not None}
    samples = time_round_robin(available, args.runs, "zero_grad")
    medians = {label: statistics.median(values) for label, values in samples.items()}
    per_array = medians["(b) one engine op per array"]
    lines = [
        f"{ARRAYS} arrays of {SIDE}x{SIDE} float32 zeroed {REPEATS} times, median of {args.runs} rounds, "
        f"torch threads {args.threads} (`{command}`)",
        "",
        "| variant | seconds (median) | µs per array zeroing | speed-up vs (b) |",
        "|---|---:|---:|---:|",
    ]
    for label in cases:
        if label not in medians:
            lines.append(f"| {label} | n/a | n/a | n/a |")
            continue
        seconds = medians[label]
        lines.append(
            f"| {label} | {seconds:.4f} | {seconds / (ARRAYS * REPEATS) * 1e6:.2f} | {per_array / seconds:.2f}x |"
        )
    write_report("zero_grad", "zeroing 500 arrays x 10", lines, medians, "seconds (median)")


if __name__ == "__main__":
    main()
