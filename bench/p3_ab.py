"""A/B of P3 jobs: this checkout against an earlier commit, jobs alternating so drift hits both alike.

Each job is `bench/p3.py`'s own (`run_tandem`: 2 workers + 2 servers under `tandem launch`, one torch
thread each, step time and the same step without communication, interleaved). The earlier commit
runs from a temporary git worktree. Reports, per mode and side, the medians of step ms and of step
time over compute time (the ratio cancels most of the shared machine's drift).

Reproduce: .venv/bin/python bench/p3_ab.py --base 7a93f9f --model vgg --modes baseline p3 --jobs 4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
JOB = ("import json, sys, bench.p3 as p3; r = p3.run_tandem(sys.argv[1], sys.argv[2], sys.argv[3], 5, 4, "
       "p3._mode_env(sys.argv[2])); print(json.dumps([r['seconds'], r['compute']]))")  # fmt: skip


def run_job(tree: Path, model: str, mode: str, rate: str) -> tuple[float, float]:
    """(step seconds, compute seconds) of one job run from the checkout at ``tree``."""
    result = subprocess.run([sys.executable, "-c", JOB, model, mode, rate], cwd=tree, capture_output=True,
                            text=True, timeout=900, env={**os.environ, "PYTHONPATH": str(tree)})  # fmt: skip
    if result.returncode != 0:
        raise RuntimeError(f"{mode} job from {tree} failed:\n{result.stdout[-2000:]}{result.stderr[-2000:]}")
    seconds, compute = json.loads(result.stdout.strip().splitlines()[-1])
    return seconds, compute


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="the earlier commit (any git revision)")
    parser.add_argument("--model", default="vgg", choices=["vgg", "resnet"])
    parser.add_argument("--modes", nargs="+", default=["baseline", "p3"])
    parser.add_argument("--rate", default="none", help="tc rate, or 'none' for unshaped")
    parser.add_argument("--jobs", type=int, default=4, help="jobs per mode and side (median)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        base = Path(scratch) / "base"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(base), args.base], cwd=ROOT, check=True)
        try:
            trees = {"base": base, "this": ROOT}
            results: dict[tuple[str, str], list[tuple[float, float]]] = {(side, m): [] for side in trees for m in args.modes}
            for job in range(args.jobs):
                for side, tree in (list(trees.items()) if job % 2 == 0 else list(trees.items())[::-1]):
                    for mode in args.modes:
                        results[(side, mode)].append(run_job(tree, args.model, mode, args.rate))
                        print(f"job {job} {side} {mode}: step {results[(side, mode)][-1][0] * 1e3:.1f} ms", flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=ROOT, check=False)
    print(f"\n{args.model} at {args.rate}, base {args.base}, medians of {args.jobs} alternating jobs:")
    for (side, mode), runs in results.items():
        step = statistics.median(seconds for seconds, _ in runs) * 1e3
        ratio = statistics.median(seconds / compute for seconds, compute in runs)
        print(f"  {mode:9s} {side:5s} step {step:6.1f} ms  step/compute {ratio:.2f}")


if __name__ == "__main__":
    main()
