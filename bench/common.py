"""Shared benchmark helpers: interleaved timing, medians, markdown tables, PNG plots.

The machine is shared and noisy, so every benchmark measures the things it compares side by side
in one run, interleaved round by round, and reports medians and ratios rather than absolute times.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parent / "out"


def command_line() -> str:
    return "python " + " ".join([os.path.relpath(sys.argv[0])] + sys.argv[1:])


def interleaved_medians(candidates: dict[str, Callable[[], Any]], repeats: int = 7, warmup: int = 2,
                        inner: int = 1, clock: Callable[[], float] = time.perf_counter,
                        min_repeats: int = 5) -> dict[str, float]:
    """Median seconds per call of each candidate; rounds alternate candidates so drift hits all alike.

    ``clock=time.process_time`` measures CPU seconds of the whole process (all threads): on a loaded
    shared machine that counts the work done rather than the time spent preempted. ``min_repeats``
    below 5 is for smoke runs only (``--quick``), whose numbers are not reported as measurements.
    """
    if repeats < min_repeats:
        raise ValueError("medians need at least 5 runs")
    for _ in range(warmup):
        for fn in candidates.values():
            fn()
    samples: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(repeats):
        for name, fn in candidates.items():
            start = clock()
            for _ in range(inner):
                fn()
            samples[name].append((clock() - start) / inner)
    return {name: statistics.median(values) for name, values in samples.items()}


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def cell(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
        return str(value)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def write_report(name: str, text: str, command: str | None = None) -> Path:
    """``bench/out/<name>.md``: the command that measured it (this process's unless given) and ``text``."""
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / f"{name}.md"
    path.write_text(f"Command: `{command or command_line()}`\n\n{text}\n")
    return path


def bar_plot(name: str, title: str, labels: Sequence[str], series: dict[str, Sequence[float]], ylabel: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    OUT.mkdir(parents=True, exist_ok=True)
    figure, axes = plt.subplots(figsize=(min(14, max(6, 1.2 * len(labels) * len(series) / 2)), 4))  # wider is unreadable
    width = 0.8 / max(len(series), 1)
    for i, (series_name, values) in enumerate(series.items()):
        axes.bar([x + i * width for x in range(len(labels))], values, width, label=series_name)
    axes.set_xticks([x + width * (len(series) - 1) / 2 for x in range(len(labels))], labels)
    axes.set_ylabel(ylabel)
    axes.set_title(title)
    axes.legend()
    figure.tight_layout()
    path = OUT / f"{name}.png"
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path
