"""A/B against an earlier commit: the same measurement from this checkout and from that commit
(a temporary git worktree), alternating, so the shared machine's drift hits both sides alike.

- ``p3``: `bench/p3.py`'s own jobs (`run_tandem`: 2 workers + 2 servers under `tandem launch`, one
  torch thread each); medians of step ms and of step time over the same step's compute time (the
  ratio cancels most of the drift).
- ``kvstore``: one worker and one server (`bench/kvstore.py`'s `kvstore_job`), push then pull of
  one tensor; medians of wall time and of the CPU time of every thread of worker and server per
  operation (``/proc/<pid>/task/*/schedstat``, Linux). On this machine CPU moves where wall time
  cannot show it: wall-time medians of the same code differ by about 5 % between sides.
- ``drive``: no second checkout: one such job of this checkout switches ``Client.drive`` (the
  waiting thread receives its replies) on and off every ``--block`` operations, so both sides
  share the processes, the server and the moment; medians of wall and CPU time per push+pull.

Reproduce (the commands docs quote):
  .venv/bin/python bench/ab.py p3 --base 7a93f9f --model vgg --modes baseline p3 --jobs 4
  .venv/bin/python bench/ab.py kvstore --base 7a93f9f --size 1048576 --rounds 25
  .venv/bin/python bench/ab.py drive --size 1048576 --rounds 40
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
P3_JOB = ("import json, sys, bench.p3 as p3; r = p3.run_tandem(sys.argv[1], sys.argv[2], sys.argv[3], 5, 4, "
          "p3._mode_env(sys.argv[2])); print(json.dumps([r['seconds'], r['compute']]))")  # fmt: skip
# a one-server kvstore job answering each line "count [io]" with wall and CPU microseconds per
# push+pull; "io" switches Client.drive off for that block (the IO thread receives every reply)
KVSTORE_JOB = """
import os, sys, time, torch, bench.kvstore as kb
from tandem.kvstore.ps.client import Client
torch.set_num_threads(1)
processes = kb.Processes()
try:
    value, out = torch.ones(int(sys.argv[1]) // 4), torch.empty(int(sys.argv[1]) // 4)
    kv, store, (server,) = kb.kvstore_job(processes, 1)
    kv.init("ab", value)
    operation = kb.kvstore_push_pull(kv, "ab", value, out)
    cpu = lambda: sum(kb.thread_cpu_seconds(os.getpid())) + sum(kb.thread_cpu_seconds(server))
    drive = getattr(Client, "drive", None)  # None before the waiting thread received its replies
    # "io": waits do not drive, they only make sure the IO thread receives (as wait(drive=False) does)
    undriven = lambda client, handle, deadline: getattr(client, "wake_receiver", lambda: None)()
    print("ready", flush=True)
    for line in sys.stdin:
        count, *mode = line.split()
        if int(count) == 0:
            break
        if drive is not None:
            Client.drive = undriven if mode == ["io"] else drive
        wall, used = time.perf_counter(), cpu()
        for _ in range(int(count)):
            operation()
        print((time.perf_counter() - wall) / int(count) * 1e6, (cpu() - used) / int(count) * 1e6, flush=True)
    kv.close()
finally:
    processes.stop()
"""


@contextmanager
def sides(base: str) -> Iterator[dict[str, Path]]:
    """``{"base": worktree at base, "this": this checkout}``; the worktree is removed afterwards."""
    with tempfile.TemporaryDirectory() as scratch:
        tree = Path(scratch) / "base"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(tree), base], cwd=ROOT, check=True)
        try:
            yield {"base": tree, "this": ROOT}
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, check=False)


def alternating(trees: dict[str, Path], rounds: int) -> Iterator[tuple[int, str, Path]]:
    """(round, side, tree), the side going first alternating round by round."""
    for round_index in range(rounds):
        order = list(trees.items())
        for side, tree in order if round_index % 2 == 0 else order[::-1]:
            yield round_index, side, tree


def _env(tree: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(tree), "TANDEM_NUM_THREADS": "1"}


def p3(args: argparse.Namespace) -> None:
    results: dict[tuple[str, str], list[tuple[float, float]]] = {}
    with sides(args.base) as trees:
        for job, side, tree in alternating(trees, args.jobs):
            for mode in args.modes:
                result = subprocess.run([sys.executable, "-c", P3_JOB, args.model, mode, args.rate], cwd=tree,
                                        env=_env(tree), capture_output=True, text=True, timeout=900)  # fmt: skip
                if result.returncode != 0:
                    raise RuntimeError(f"{mode} job from {tree} failed:\n{result.stdout[-2000:]}{result.stderr[-2000:]}")
                seconds, compute = json.loads(result.stdout.strip().splitlines()[-1])
                results.setdefault((side, mode), []).append((seconds, compute))
                print(f"job {job} {side} {mode}: step {seconds * 1e3:.1f} ms", flush=True)
    print(f"\n{args.model} at {args.rate}, base {args.base}, medians of {args.jobs} alternating jobs:")
    for (side, mode), runs in sorted(results.items(), key=lambda item: (item[0][1], item[0][0])):
        step = statistics.median(seconds for seconds, _ in runs) * 1e3
        ratio = statistics.median(seconds / compute for seconds, compute in runs)
        print(f"  {mode:9s} {side:5s} step {step:6.1f} ms  step/compute {ratio:.2f}")


@contextmanager
def kvstore_jobs(trees: dict[str, Path], size: int) -> Iterator[dict[str, subprocess.Popen[str]]]:
    """One ``KVSTORE_JOB`` per tree, started and ready; each told to stop afterwards."""
    jobs = {side: subprocess.Popen([sys.executable, "-c", KVSTORE_JOB, str(size)], cwd=tree, env=_env(tree),
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                   text=True) for side, tree in trees.items()}  # fmt: skip
    try:
        for side, job in jobs.items():
            if job.stdout is None or job.stdout.readline().strip() != "ready":
                raise RuntimeError(f"the {side} kvstore job did not start")
        yield jobs
    finally:
        for job in jobs.values():
            if job.stdin is not None:
                job.stdin.write("0\n")
                job.stdin.close()
            job.wait(timeout=60)


def timed(job: subprocess.Popen[str], line: str) -> tuple[float, float]:
    """Wall and CPU microseconds per push+pull of one block (``line``: "count [io]")."""
    assert job.stdin is not None and job.stdout is not None
    job.stdin.write(f"{line}\n")
    job.stdin.flush()
    wall, cpu = map(float, job.stdout.readline().split())
    return wall, cpu


def report(samples: dict[str, list[tuple[float, float]]], this: str, base: str) -> None:
    medians = {side: [statistics.median(values) for values in zip(*runs)] for side, runs in samples.items()}
    for side, (wall, cpu) in medians.items():
        print(f"  {side:5s} wall {wall:6.0f} us/op  CPU (worker + server) {cpu:6.0f} us/op")
    print(f"  {this} / {base}: wall {medians[this][0] / medians[base][0]:.3f}, "
          f"CPU {medians[this][1] / medians[base][1]:.3f}")  # fmt: skip


def kvstore(args: argparse.Namespace) -> None:
    count = max(20, min(300, int(0.15e9 / args.size / 2)))  # about 0.15 s per side and round at 1 GB/s
    samples: dict[str, list[tuple[float, float]]] = {}
    with sides(args.base) as trees, kvstore_jobs(trees, args.size) as jobs:
        for round_index, side, _ in alternating(trees, args.rounds + 1):
            result = timed(jobs[side], str(count))
            if round_index:  # the first round warms up
                samples.setdefault(side, []).append(result)
    print(f"\npush+pull of {args.size} bytes, one server, base {args.base}, medians of {args.rounds} alternating rounds:")
    report(samples, "this", "base")


def drive(args: argparse.Namespace) -> None:
    """One job of this checkout, ``Client.drive`` on ("drive") and off ("io") block by block."""
    samples: dict[str, list[tuple[float, float]]] = {}
    with kvstore_jobs({"job": ROOT}, args.size) as jobs:
        for _, side, _ in alternating({"drive": ROOT, "io": ROOT}, args.rounds):
            mode = "io" if side == "io" else ""
            timed(jobs["job"], f"5 {mode}")  # settle into the side (the IO thread takes the sockets back within 2 ms)
            samples.setdefault(side, []).append(timed(jobs["job"], f"{args.block} {mode}"))
    print(f"push+pull of {args.size} bytes, one server, medians of {args.rounds} rounds of {args.block} operations:")
    report(samples, "drive", "io")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="what", required=True)
    jobs = commands.add_parser("p3", help="P3 training jobs")
    jobs.add_argument("--model", default="vgg", choices=["vgg", "resnet"])
    jobs.add_argument("--modes", nargs="+", default=["baseline", "p3"])
    jobs.add_argument("--rate", default="none", help="tc rate, or 'none' for unshaped")
    jobs.add_argument("--jobs", type=int, default=4, help="jobs per mode and side (median)")
    store = commands.add_parser("kvstore", help="push+pull of one tensor, one worker and one server")
    store.add_argument("--size", type=int, default=1 << 20, help="tensor bytes")
    store.add_argument("--rounds", type=int, default=25, help="rounds per side (median)")
    for command in (jobs, store):
        command.add_argument("--base", required=True, help="the earlier commit (any git revision)")
    toggle = commands.add_parser("drive", help="push+pull with Client.drive on and off in one job")
    toggle.add_argument("--size", type=int, default=1 << 20, help="tensor bytes")
    toggle.add_argument("--rounds", type=int, default=40, help="rounds (median); each times both sides")
    toggle.add_argument("--block", type=int, default=30, help="operations per side and round")
    args = parser.parse_args()
    {"p3": p3, "kvstore": kvstore, "drive": drive}[args.what](args)


if __name__ == "__main__":
    main()
