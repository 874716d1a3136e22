"""Seconds to capture one training step (forward, loss, backward) into a graph, side by side.

    python bench/capture_time.py [--models resnet,gpt,lstm_lm,hf-gpt2,hf-llama] [--repeats 5]

* **aot_export_module**: PyTorch's joint export, ``aot_export_module(..., trace_joint=True)``: one
  trace of the step, then a second trace of the joint graph on the real tensors.
* **tandem export**: ``tandem.graph.joint.export_joint``: the same graph from the first trace alone.
* **tandem.compile**: the whole of ``tandem.compile(...)``: capture (export under tandem's tracing
  state, no per-node stack traces) and planning (mirror off); the capture cache off, so every round traces.

The two exports run under tandem's tracing state (``capture._tracing``), so they differ only in the
second trace. One process, one torch thread, rounds interleaved after one warm-up round (torch's
lazy imports), process CPU time. Writes bench/out/capture_time.md and capture_time.png.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import tandem  # noqa: E402
from bench.common import bar_plot, command_line, interleaved_medians, markdown_table, write_report  # noqa: E402
from bench.compiled import MODELS, build  # noqa: E402
from tandem.graph import capture  # noqa: E402
from tandem.graph.joint import export_joint  # noqa: E402


def candidates(name: str) -> dict[str, Callable[[], Any]]:
    from torch._functorch.aot_autograd import aot_export_module

    module, loss_fn, batch = build(name)
    layout, tensors = capture._check_arguments(module, loss_fn, batch)
    wrapper = capture._LossModule(module, loss_fn, layout)

    def traced(export: Callable[[], Any]) -> Callable[[], Any]:
        def run() -> Any:
            with capture._tracing(wrapper, tensors):
                return export()
        return run

    return {
        "aot_export_module": traced(lambda: aot_export_module(wrapper, tuple(tensors), trace_joint=True, output_loss_index=0)),
        "tandem export": traced(lambda: export_joint(wrapper, tuple(tensors))),
        "tandem.compile": lambda: tandem.compile(module, loss_fn, *batch),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--repeats", type=int, default=5, help="interleaved rounds (median; at least 5)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.environ["TANDEM_CAPTURE_CACHE"] = "0"  # each round traces: a cached graph would time the load
    rows, speedups, names = [], [], args.models.split(",")
    for name in names:
        medians = interleaved_medians(candidates(name), repeats=args.repeats, warmup=1, clock=time.process_time)
        speedup = medians["aot_export_module"] / medians["tandem export"]
        speedups.append(speedup)
        rows.append([name, medians["aot_export_module"], medians["tandem export"], speedup, medians["tandem.compile"]])
        print(f"{name}: aot_export_module {medians['aot_export_module']:.2f} s, tandem export "
              f"{medians['tandem export']:.2f} s ({speedup:.2f}x), tandem.compile {medians['tandem.compile']:.2f} s")
    table = markdown_table(["model", "aot_export_module s", "tandem export s", "speedup", "tandem.compile s"], rows)
    print(f"\nCommand: `{command_line()}` (1 torch thread, medians of {args.repeats} interleaved rounds, CPU seconds)\n")
    print(table)
    write_report("capture_time", table)
    bar_plot("capture_time", "aot_export_module s / tandem export s (higher: faster)", names,
             {"speedup": speedups}, "x")


if __name__ == "__main__":
    main()
