"""Step time at bulk sizes 1, 2, 4, 15, 50 and whole-graph, forward and backward caps varied apart.

    python bench/bulking.py [--repeats 7] [--threads 1]

One capture per model; each bulk setting is planned from it and run on the threaded engine, all
settings interleaved round by round. Ratios are against bulk 1 (one engine op per graph node).
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import OUT, command_line, interleaved_medians, markdown_table, write_report  # noqa: E402
from tandem import engine  # noqa: E402
from tandem.executor import Executor  # noqa: E402
from tandem.graph.capture import capture  # noqa: E402
from tandem.models import ZOO  # noqa: E402
from tandem.passes.manager import plan  # noqa: E402
from tandem.passes.segments import WHOLE  # noqa: E402
from tandem.step import StepConfig  # noqa: E402

SIZES = [1, 2, 4, 15, 50, WHOLE]
MODELS = {  # name: (zoo model, config, batch config, batch size)
    "lstm_lm": ("lstm_lm", dict(vocab_size=200, embed_dim=32, hidden=32, num_layers=2), dict(seq_len=20), 8),
    "mlp (24 thin layers)": ("mlp", dict(in_features=64, hidden=(32,) * 24), {}, 16),
    "resnet": ("resnet", dict(depth=8, width=16, in_channels=3, small_input=True), dict(image_size=32), 16),
}


def label(size: int) -> str:
    return "whole" if size == WHOLE else str(size)


def settings() -> list[tuple[str, int, int]]:
    both = [(f"fwd={label(s)} bwd={label(s)}", s, s) for s in SIZES]
    forward_only = [(f"fwd={label(s)} bwd=15", s, 15) for s in SIZES if s != 15]
    backward_only = [(f"fwd=15 bwd={label(s)}", 15, s) for s in SIZES if s != 15]
    return both + forward_only + backward_only


def engine_cost_per_op(ops: int = 20000, repeats: int = 7) -> float:
    """Microseconds the threaded engine adds per pushed no-op (push + schedule + run + complete)."""
    threaded = engine.ThreadedEngine()
    var = engine.Var("chain")

    def chain() -> None:
        for _ in range(ops):
            threaded.push(_noop, writes=(var,))
        threaded.wait_all()

    def plain() -> None:
        for _ in range(ops):
            _noop()

    medians = interleaved_medians({"engine": chain, "plain": plain}, repeats=repeats)
    return (medians["engine"] - medians["plain"]) / ops * 1e6


def _noop() -> None:
    pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    engine.set_engine(engine.ThreadedEngine())
    results: dict[str, dict[str, float]] = {}
    segments: dict[str, dict[str, int]] = {}
    for title, (name, config, batch_config, batch_size) in MODELS.items():
        entry = ZOO[name]
        torch.manual_seed(0)
        module = entry.build(**config)
        batch = entry.make_batch(batch_size, torch.Generator().manual_seed(0), **config, **batch_config)
        start = time.perf_counter()
        captured = capture(module, entry.loss_fn, batch)
        print(f"{title}: captured {len(captured.op_nodes())} nodes in {time.perf_counter() - start:.1f}s")
        inputs = captured.inputs(module, batch)
        candidates, counts = {}, {}
        for setting, forward, backward in settings():
            executor = Executor(plan(captured.clone(), StepConfig(bulk_fwd=forward, bulk_bwd=backward).plan))
            candidates[setting] = partial(executor.run, inputs)
            counts[setting] = len(executor.segments)
        gc.collect()
        gc.freeze()  # the planned graphs are long-lived: keep cyclic GC from rescanning them mid-timing
        results[title] = interleaved_medians(candidates, repeats=args.repeats)
        gc.unfreeze()
        segments[title] = counts
    overhead = engine_cost_per_op()
    report = render(results, segments, overhead, args)
    print(report)
    write_report("bulking", report)
    plot(results)


def render(results: dict[str, dict[str, float]], segments: dict[str, dict[str, int]], overhead: float,
           args: argparse.Namespace) -> str:
    headers = ["setting"] + [f"{m}: ms / segments / speed-up vs bulk 1" for m in results]
    rows = []
    for setting, _, _ in settings():
        row: list[object] = [setting]
        for model, medians in results.items():
            base = medians["fwd=1 bwd=1"]
            row.append(f"{medians[setting] * 1e3:.2f} / {segments[model][setting]} / {base / medians[setting]:.2f}x")
        rows.append(row)
    return (f"Command: `{command_line()}` (torch threads {args.threads}, medians of {args.repeats} interleaved rounds)\n\n"
            + markdown_table(headers, rows) + f"\n\nthreaded engine cost per pushed op: {overhead:.2f} us")


def plot(results: dict[str, dict[str, float]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 3, figsize=(15, 4))
    for axis, (prefix, title) in zip(axes, [("both", "fwd = bwd cap"), ("fwd", "fwd cap (bwd=15)"), ("bwd", "bwd cap (fwd=15)")]):
        for model, medians in results.items():
            base = medians["fwd=1 bwd=1"]
            points = []
            for setting, forward, backward in settings():
                kind = "both" if forward == backward else ("fwd" if backward == 15 else "bwd")
                if kind == prefix or (forward == backward == 15):
                    cap = forward if prefix != "bwd" else backward
                    points.append((SIZES.index(cap), base / medians[setting]))
            points.sort()
            axis.plot([label(SIZES[i]) for i, _ in points], [y for _, y in points], marker="o", label=model)
        axis.set_title(title)
        axis.set_xlabel("cap (op nodes per segment)")
        axis.set_ylabel("speed-up over bulk 1")
        axis.legend()
    figure.tight_layout()
    OUT.mkdir(parents=True, exist_ok=True)
    figure.savefig(OUT / "bulking.png", dpi=110)
    print(f"plot: {OUT / 'bulking.png'}")


if __name__ == "__main__":
    main()
