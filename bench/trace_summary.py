"""Where a traced step's time goes: event durations from tandem's Perfetto traces, in numbers.

Run a job with ``TANDEM_TRACE=/tmp/name-{pid}.json`` (one file per process: a distributed job's
workers and servers each write one; a worker's holds its compute), then point this at a file.
Events are grouped by kind, per thread: a name's leading words, up to the first that names a tensor
or slice (holds a dot or a bracket). ``forward[0]`` and ``forward[1]`` are both ``forward``; ``send
pushpull stages.0.0.weight[0]`` is ``send pushpull``; an evaluation's segments are ``eval``.
``--step 'forward[0]'`` (it starts every training step) also reports the time between its
consecutive starts and, for every kind, its milliseconds a step; ``--skip N`` leaves out the first N
steps (capture, compiling, warm-up).

Example (the digits time-to-accuracy configuration, 2 workers at 100 Mbit/s, as root):

    TANDEM_TRACE=/tmp/digits-{pid}.json python bench/time_to_accuracy.py --task digits \\
        --rates 100mbit --workers 2 --modes collective-baseline+int8@inductor
    python bench/trace_summary.py /tmp/digits-<pid>.json --step 'forward[0]' --skip 20
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from anywhere without installing

from bench.common import markdown_table  # noqa: E402


def kind(name: str) -> str:
    """``forward[0]`` -> ``forward``; ``send pushpull stages.0.weight[0]`` -> ``send pushpull``."""
    words: list[str] = []
    for word in name.split(" "):
        head = word.split("[", 1)[0]
        if not head or "." in head or not head[0].isalpha():  # a tensor's name, a slice, "+ 20 fused"
            break
        words.append(head)
        if head != word:  # "forward[0]": the index ends the kind
            break
    return " ".join(words) or name


def spans(path: Path) -> tuple[list[dict[str, Any]], dict[int, str]]:
    """The complete events (``ph == "X"``) in start order, and the thread names by thread id."""
    document = json.loads(path.read_text())
    events = document["traceEvents"] if isinstance(document, dict) else document
    threads = {event["tid"]: event["args"]["name"] for event in events
               if event.get("ph") == "M" and event.get("name") == "thread_name"}  # fmt: skip
    return sorted((event for event in events if event.get("ph") == "X"), key=lambda event: event["ts"]), threads


def spread(values: list[float]) -> str:
    """``p10-p90 (median m)`` in milliseconds."""
    if len(values) == 1:
        return f"{values[0]:.1f}"
    deciles = statistics.quantiles(values, n=10, method="inclusive")
    return f"{deciles[0]:.1f}-{deciles[-1]:.1f} ({statistics.median(values):.1f})"


def summarize(path: Path, step: str | None, skip: int) -> str:
    events, threads = spans(path)
    window = (float("-inf"), float("inf"))
    starts: list[float] = []
    if step is not None:
        starts = [event["ts"] for event in events if event["name"] == step][skip:]
        if len(starts) < 2:
            raise SystemExit(f"{path}: fewer than 2 {step!r} events after skipping {skip}; name an event "
                             f"that starts every training step (forward[0])")  # fmt: skip
        window = (starts[0], starts[-1])  # whole steps only
    durations: dict[tuple[str, str], list[float]] = defaultdict(list)
    counted = 0
    for event in events:
        if window[0] <= event["ts"] < window[1]:
            durations[(threads.get(event["tid"], str(event["tid"])), kind(event["name"]))].append(event["dur"] / 1000)
            counted += 1
    steps = len(starts) - 1
    headers = ["thread", "kind", "events", "ms each: p10-p90 (median)"] + (["ms a step"] if steps > 0 else [])
    rows = [[thread, name, len(values), spread(values)] + ([f"{sum(values) / steps:.1f}"] if steps > 0 else [])
            for (thread, name), values in sorted(durations.items())]  # fmt: skip
    text = f"{path.name}: {counted} events" + (f" in {steps} steps" if steps > 0 else "") + "\n\n" + markdown_table(headers, rows)
    if steps > 0:
        intervals = [(later - earlier) / 1000 for earlier, later in zip(starts, starts[1:])]
        text += f"\n\n{steps} steps (from one {step} to the next), ms: {spread(intervals)}"
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("traces", nargs="+", type=Path, help="trace files written under TANDEM_TRACE")
    parser.add_argument("--step", default=None, help="an event that starts every training step: forward[0]")
    parser.add_argument("--skip", type=int, default=0, help="steps left out at the start (with --step)")
    args = parser.parse_args()
    if args.skip < 0 or (args.skip and args.step is None):
        parser.error("--skip takes a count of steps >= 0, and needs --step")
    print("\n\n".join(summarize(path, args.step, args.skip) for path in args.traces))


if __name__ == "__main__":
    main()
