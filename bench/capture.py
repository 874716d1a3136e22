"""Captured step time over eager PyTorch step time (forward + loss + backward), side by side.

    python bench/capture.py [--repeats 7] [--threads 1] [--clock wall|cpu]

Also counts minor page faults per step: with TANDEM_RETAIN_HOST_MEMORY=0 (glibc's default malloc
thresholds) steps fault their freed activation memory back in; see tandem/engine/host_memory.py.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import tandem  # noqa: E402
from bench.common import bar_plot, command_line, interleaved_medians, markdown_table, write_report  # noqa: E402
from tandem.engine.host_memory import minor_page_faults_per_call  # noqa: E402
from tandem.models import ZOO  # noqa: E402

CASES = {
    "resnet": (dict(depth=18, width=16, in_channels=3, small_input=True), dict(image_size=32), 32),
    "gpt": (dict(vocab_size=512, block_size=64, n_layer=4, n_head=4, n_embd=128, dropout=0.1), {}, 16),
    "lstm_lm": (dict(vocab_size=1000, embed_dim=128, hidden=128, num_layers=2), dict(seq_len=35), 32),
}


def eager_step(module: torch.nn.Module, loss_fn, batch) -> None:
    module.zero_grad(set_to_none=True)
    loss_fn(module, *batch).backward()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--models", default=",".join(CASES))
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="wall: perf_counter; cpu: process CPU time of all threads (robust on a loaded machine)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows, ratios = [], []
    for name in args.models.split(","):
        config, batch_config, batch_size = CASES[name]
        entry = ZOO[name]
        torch.manual_seed(0)
        module = entry.build(**config)
        eager_module = copy.deepcopy(module)
        batch = entry.make_batch(batch_size, torch.Generator().manual_seed(0), **config, **batch_config)
        step = tandem.compile(module, entry.loss_fn, *batch)

        candidates = {"eager": partial(eager_step, eager_module, entry.loss_fn, batch), "tandem": partial(step, *batch)}
        medians = interleaved_medians(candidates, repeats=args.repeats,
                                      clock=time.process_time if args.clock == "cpu" else time.perf_counter)
        faults = {label: minor_page_faults_per_call(fn, 3) for label, fn in candidates.items()}
        ratio = medians["tandem"] / medians["eager"]
        ratios.append(ratio)
        rows.append([name, batch_size, len(step.graph.op_nodes()), medians["eager"] * 1e3, medians["tandem"] * 1e3, ratio,
                     round(faults["eager"]), round(faults["tandem"])])
        print(f"{name}: eager {medians['eager'] * 1e3:.2f} ms, tandem {medians['tandem'] * 1e3:.2f} ms, ratio {ratio:.3f}")
    table = markdown_table(["model", "batch", "graph nodes", "eager ms (median)", "tandem ms (median)", "tandem / eager",
                            "eager page faults / step", "tandem page faults / step"], rows)
    print(f"\nCommand: `{command_line()}` (torch threads: {args.threads}, {args.repeats} interleaved rounds, "
          f"{args.clock} clock)\n")
    print(table)
    write_report("capture", table)
    bar_plot("capture", "captured step time / eager step time (lower is better)", [r[0] for r in rows],
             {"tandem / eager": ratios}, "ratio")


if __name__ == "__main__":
    main()
