"""Backward mirroring: peak memory and step time of every policy, against PyTorch's own tools.

Columns, per model: eager PyTorch; torch.utils.checkpoint per block (``model.blocks``); tandem
with mirror off / all / sqrt / memory-aware / budgets; PyTorch's min-cut partitioner
(``aot_function`` + ``min_cut_rematerialization_partition``) with ``activation_memory_budget``
swept over the same fractions.

One meter for all columns: PyTorch's profiler records every CPU allocator event
(``profile_memory=True``, on the calling thread: tandem's step is metered on the naive engine,
timed on the default threaded one); a step's peak is the highest running sum of allocated-minus-freed
bytes during the step, above what was live when it started (parameters and batch excluded,
gradients included). Tandem's own measured ``peak_bytes`` (its executor's meter, intermediates
only) is shown beside it. Step times are medians over rounds that run every column in turn, so
machine noise hits all columns alike. Process peak RSS comes from a subprocess per run.

Reproduce: .venv/bin/python bench/mirror.py            (about 8 minutes on 2 cores)
           .venv/bin/python bench/mirror.py --quick    (tiny sizes, checks the script)
Writes bench/out/mirror_<model>.png, bench/out/mirror.md.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere without installing

from tandem.engine import NaiveEngine  # noqa: E402
from tandem.executor import Executor  # noqa: E402
from tandem.graph.capture import capture  # noqa: E402
from tandem.models import ZOO  # noqa: E402
from tandem.passes.manager import plan  # noqa: E402
from tandem.step import StepConfig  # noqa: E402

OUT = Path(__file__).resolve().parent / "out"
COMMAND = "PYTHONPATH=. .venv/bin/python bench/mirror.py"
BUDGETS = (0.8, 0.6, 0.4)
RSS_BATCH_FACTOR = 8  # RSS runs use a bigger batch, so activations show above the interpreter and capture
MB = 1e6

# Sizes where activations dominate the step's memory, small enough for 2 shared CPU cores.
MODELS: dict[str, tuple[dict[str, Any], int]] = {
    "resnet": ({"depth": 18, "width": 16, "small_input": True}, 32),
    "gpt": ({"vocab_size": 256, "block_size": 128, "n_layer": 4, "n_head": 4, "n_embd": 128, "dropout": 0.1}, 16),
    "lstm_lm": ({"vocab_size": 256, "embed_dim": 256, "hidden": 256, "num_layers": 2, "seq_len": 24}, 64),
    "vgg": ({"config": "vgg11", "width_multiplier": 0.25, "image_size": 32, "classifier_width": 256}, 64),
}
DEMO = {"depth": 8, "width": 16, "small_input": True}  # the larger-batch demonstration: a quick-to-capture ResNet
QUICK: dict[str, tuple[dict[str, Any], int]] = {name: (ZOO[name].tiny, 8) for name in MODELS}


@dataclass
class Column:
    label: str
    family: str  # eager / checkpoint / tandem / pytorch
    step: Callable[[], Any]
    budget: float | None = None
    times: list[float] = field(default_factory=list)  # wall-clock seconds per step
    cpu_times: list[float] = field(default_factory=list)  # process CPU seconds per step (all threads)
    peak_bytes: int = 0
    tandem_peak: int | None = None
    recompute_flops: int | None = None
    metered_step: Callable[[], Any] | None = None  # the same step on the calling thread (the profiler's)

    @property
    def seconds(self) -> float:
        return statistics.median(self.times)

    @property
    def cpu_seconds(self) -> float:
        return statistics.median(self.cpu_times)


# -- one meter for every column -----------------------------------------------------------------


def allocator_peak(step: Callable[[], Any]) -> int:
    """Peak bytes the CPU allocator held during one step, above the level at its start."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        result = step()
        del result
    events = [e for e in profiler.profiler.kineto_results.events() if e.name() == "[memory]"]  # type: ignore[union-attr]
    live = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        live += event.nbytes()
        peak = max(peak, live)
    return peak


# -- the columns ----------------------------------------------------------------------------------


def build(name: str, config: dict[str, Any], batch_size: int) -> tuple[nn.Module, Callable[..., torch.Tensor], tuple[torch.Tensor, ...]]:
    entry = ZOO[name]
    model_config = {k: v for k, v in config.items() if k != "seq_len"}
    torch.manual_seed(0)
    module = entry.build(**model_config)
    batch = entry.make_batch(batch_size, torch.Generator().manual_seed(0), **config)
    return module, entry.loss_fn, batch


def eager_step(module: nn.Module, loss_fn: Callable[..., torch.Tensor], batch: tuple[torch.Tensor, ...]) -> Any:
    module.zero_grad(set_to_none=True)
    loss = loss_fn(module, *batch)
    loss.backward()
    return loss.detach()


def checkpointed(module: nn.Module) -> nn.Module:
    """A copy whose every block runs under torch.utils.checkpoint (non-reentrant)."""
    from torch.utils.checkpoint import checkpoint

    twin = copy.deepcopy(module)
    for block in twin.blocks:  # type: ignore[union-attr]
        forward = block.forward
        block.forward = partial(checkpoint, forward, use_reentrant=False)  # type: ignore[method-assign]
    return twin


def tandem_columns(module: nn.Module, loss_fn: Callable[..., torch.Tensor], batch: tuple[torch.Tensor, ...],
                   policies: list[str | float]) -> list[Column]:
    captured = capture(module, loss_fn, batch)
    params = dict(module.named_parameters(remove_duplicate=False))  # tied weights: every name the graph reads
    buffers = {n: b.clone() for n, b in module.named_buffers(remove_duplicate=False)}  # stats are never written back
    columns = []
    for policy in tqdm(policies, desc="  tandem plans", leave=False):
        graph = plan(captured.clone(), StepConfig(mirror=policy).plan)
        executor = Executor(graph)
        inputs = [params[n] for n in graph.param_names] + [buffers[n] for n in graph.buffer_names] + list(batch)
        _, measured = executor.run_measured(inputs)
        label = f"tandem {policy}" if isinstance(policy, str) else f"tandem budget {policy:g}"
        column = Column(label, "tandem", partial(executor.run, inputs), budget=policy if isinstance(policy, float) else None)
        column.metered_step = partial(executor.run, inputs, engine=NaiveEngine())
        column.tandem_peak = measured.peak_bytes
        column.recompute_flops = graph.notes.get("memory", {}).get("recompute_flops", 0)
        columns.append(column)
    return columns


def pytorch_partitioner(module: nn.Module, loss_fn: Callable[..., torch.Tensor], batch: tuple[torch.Tensor, ...],
                        budget: float) -> Callable[[], Any]:
    """PyTorch's min-cut partitioner at ``activation_memory_budget=budget``; graphs run as-is (no inductor)."""
    import torch._functorch.config as functorch_config
    from torch._functorch.aot_autograd import aot_function, make_boxed_compiler
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    params = dict(module.named_parameters())
    buffers = dict(module.named_buffers())
    names = list(params) + list(buffers)

    def function(*args: torch.Tensor) -> torch.Tensor:
        # Buffers are cloned inside, so BN's stat update does not mutate a saved input.
        state = {n: (a if n in params else a.clone()) for n, a in zip(names, args[: len(names)])}
        return loss_fn(lambda *b: torch.func.functional_call(module, state, b), *args[len(names):])

    keep = make_boxed_compiler(lambda graph_module, _: graph_module)
    with functorch_config.patch(activation_memory_budget=budget):
        compiled = aot_function(function, fw_compiler=keep, bw_compiler=keep, partition_fn=min_cut_rematerialization_partition)
        arguments = [*params.values(), *buffers.values(), *batch]
        compiled(*arguments).backward()  # compile (and partition) now, under the patched budget

    def step() -> Any:
        for parameter in params.values():
            parameter.grad = None
        loss = compiled(*arguments)
        loss.backward()
        return loss.detach()

    return step


def columns_for(name: str, config: dict[str, Any], batch_size: int) -> list[Column]:
    module, loss_fn, batch = build(name, config, batch_size)
    columns = [Column("eager", "eager", partial(eager_step, module, loss_fn, batch))]
    columns.append(Column("checkpoint per block", "checkpoint", partial(eager_step, checkpointed(module), loss_fn, batch)))
    columns += tandem_columns(module, loss_fn, batch, ["off", "all", "sqrt", "memory-aware", *BUDGETS])
    for budget in (1.0, *BUDGETS):
        step = pytorch_partitioner(copy.deepcopy(module), loss_fn, batch, budget)
        columns.append(Column(f"pytorch budget {budget:g}", "pytorch", step, budget=budget))
    return columns


def measure(columns: list[Column], rounds: int) -> None:
    for column in columns:
        column.step()  # warm-up
        column.peak_bytes = allocator_peak(column.metered_step or column.step)
    for _ in tqdm(range(rounds), desc="  timing rounds", leave=False):
        for column in columns:  # round-robin: noise hits every column alike
            start, cpu_start = time.perf_counter(), time.process_time()
            column.step()
            column.times.append(time.perf_counter() - start)
            column.cpu_times.append(time.process_time() - cpu_start)


# -- process RSS and the larger batch ---------------------------------------------------------------


def rss_child(name: str, policy: str, quick: bool) -> None:
    """Runs in a subprocess: three steps of one policy; prints peak RSS of the process and of the steps."""
    config, batch_size = (QUICK if quick else MODELS)[name]
    module, loss_fn, batch = build(name, config, RSS_BATCH_FACTOR * batch_size)
    if policy == "eager":
        run: Callable[[], Any] = partial(eager_step, module, loss_fn, batch)
    else:
        import tandem

        run = partial(tandem.compile(module, loss_fn, *batch, mirror=policy), *batch)
    gc.collect()
    before = rss_now()
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM: the peak from here on is the steps'
    for _ in range(3):
        run()
    print(json.dumps({"process_bytes": peak_rss(), "steps_bytes": peak_rss() - before}))


def rss_now() -> int:
    return _status_kilobytes("VmRSS:") * 1024


def peak_rss() -> int:
    """Peak RSS since start or the last reset. VmHWM, not ru_maxrss: ru_maxrss survives exec, so a
    child started from a big parent reports the parent's peak."""
    return _status_kilobytes("VmHWM:") * 1024


def _status_kilobytes(field_name: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field_name):
            return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def process_rss(name: str, policy: str, quick: bool) -> dict[str, int]:
    command = [sys.executable, __file__, "--rss-child", name, policy] + (["--quick"] if quick else [])
    output = subprocess.run(command, capture_output=True, text=True, timeout=600, check=True).stdout
    return json.loads(output.strip().splitlines()[-1])


def largest_batch(name: str, config: dict[str, Any], policy: str, cap: int, start: int) -> int:
    """Largest batch whose measured peak_bytes fits ``cap``: doubling, then bisection."""
    import tandem

    def fits(batch_size: int) -> bool:
        module, loss_fn, batch = build(name, config, batch_size)
        step = tandem.compile(module, loss_fn, *batch, mirror=policy)
        step(*batch)
        return step.memory_report()["peak_bytes"] <= cap

    low, high = 0, start
    while fits(high):
        low, high = high, high * 2
    while high - low > max(1, low // 16):  # to within ~6%
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


# -- report -------------------------------------------------------------------------------------------


def table(name: str, columns: list[Column]) -> list[str]:
    eager, off = columns[0], next(c for c in columns if c.label == "tandem off")
    lines = [f"### {name}", "",
             "| column | peak MB (allocator) | vs eager | tandem peak MB | vs tandem off | step ms | CPU ms | CPU vs off | recompute MFLOP |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for c in columns:
        tandem_peak = f"{c.tandem_peak / MB:.1f}" if c.tandem_peak is not None else ""
        versus_off = f"{c.tandem_peak / off.tandem_peak:.2f}x" if c.tandem_peak is not None and off.tandem_peak else ""
        flops = f"{c.recompute_flops / 1e6:.1f}" if c.recompute_flops is not None else ""
        lines.append(f"| {c.label} | {c.peak_bytes / MB:.1f} | {c.peak_bytes / eager.peak_bytes:.2f}x | {tandem_peak} | "
                     f"{versus_off} | {c.seconds * 1e3:.1f} | {c.cpu_seconds * 1e3:.1f} | {c.cpu_seconds / off.cpu_seconds:.2f}x | {flops} |")
    return lines


def plot(name: str, columns: list[Column]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.5))
    for family, marker in (("tandem", "o"), ("pytorch", "s")):
        curve = sorted((c for c in columns if c.family == family and (c.budget is not None or c.label == "tandem off")),
                       key=lambda c: c.peak_bytes)
        axes.plot([c.cpu_seconds * 1e3 for c in curve], [c.peak_bytes / MB for c in curve], marker=marker, alpha=0.4,
                  label=f"{family} budget curve")
    for c in columns:
        axes.scatter(c.cpu_seconds * 1e3, c.peak_bytes / MB, s=18)
        axes.annotate(c.label.replace("tandem ", "t:").replace("pytorch budget", "pt"), (c.cpu_seconds * 1e3, c.peak_bytes / MB),
                      fontsize=7, xytext=(3, 3), textcoords="offset points")
    axes.set_xlabel("step CPU time (ms, median)")
    axes.set_ylabel("peak allocated during the step (MB)")
    axes.set_title(f"{name}: memory vs time per mirroring policy")
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(OUT / f"mirror_{name}.png", dpi=110)
    plt.close(figure)


def goals(name: str, columns: list[Column]) -> list[str]:
    by = {c.label: c for c in columns}
    off, aware = by["tandem off"], by["tandem memory-aware"]
    cut = 1 - aware.peak_bytes / off.peak_bytes
    lines = [f"- {name}: memory-aware peak {aware.peak_bytes / MB:.1f} MB vs off {off.peak_bytes / MB:.1f} MB "
             f"({cut:.0%} lower, {off.peak_bytes / aware.peak_bytes:.2f}x), step CPU time {aware.cpu_seconds / off.cpu_seconds - 1:+.0%} "
             f"(wall {aware.seconds / off.seconds - 1:+.0%}); "
             f"tandem meter: {1 - aware.tandem_peak / off.tandem_peak:.0%} lower"]  # type: ignore[operator]
    for budget in BUDGETS:
        ours, theirs = by[f"tandem budget {budget:g}"], by[f"pytorch budget {budget:g}"]
        lines.append(f"  - budget {budget:g}: tandem {ours.peak_bytes / MB:.1f} MB / {ours.cpu_seconds * 1e3:.0f} CPU ms, "
                     f"pytorch {theirs.peak_bytes / MB:.1f} MB / {theirs.cpu_seconds * 1e3:.0f} CPU ms")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="*", default=list(MODELS))
    parser.add_argument("--rounds", type=int, default=7, help="timing rounds (median over them)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: least disturbed by a shared machine)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: checks the script, numbers mean little")
    parser.add_argument("--rss-child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.rss_child:
        rss_child(*args.rss_child, quick=args.quick)
        return
    OUT.mkdir(parents=True, exist_ok=True)
    sizes = QUICK if args.quick else MODELS
    command = COMMAND + (" --quick" if args.quick else "")
    print(f"reproduce: {command}")
    report = [f"Command: `{command}` (torch {torch.__version__}, {args.threads} threads, medians of {args.rounds} rounds)", ""]
    summary = []
    for name in tqdm(args.models, desc="models"):
        config, batch_size = sizes[name]
        columns = columns_for(name, config, batch_size)
        measure(columns, args.rounds)
        report += table(f"{name} (batch {batch_size}, {config})", columns) + [""]
        summary += goals(name, columns)
        plot(name, columns)
        print("\n".join(table(name, columns)), flush=True)
    rss = {policy: process_rss("resnet", policy, args.quick) for policy in ("eager", "off", "memory-aware")}
    summary.append(f"- peak RSS, resnet at {RSS_BATCH_FACTOR}x the batch, one subprocess each (VmHWM): growth during 3 steps "
                   + ", ".join(f"{p} {v['steps_bytes'] / MB:.0f} MB" for p, v in rss.items())
                   + "; whole process incl. import and capture " + ", ".join(f"{p} {v['process_bytes'] / MB:.0f} MB" for p, v in rss.items()))
    config = QUICK["resnet"][0] if args.quick else DEMO
    cap = int(16 * MB if args.quick else 64 * MB)
    batches = {p: largest_batch("resnet", config, p, cap, start=8) for p in ("off", "memory-aware")}
    summary.append(f"- largest resnet batch under a {cap / MB:.0f} MB cap (measured peak_bytes): "
                   + ", ".join(f"{p} {b}" for p, b in batches.items())
                   + f" ({batches['memory-aware'] / max(1, batches['off']):.2f}x)")
    report += ["### Summary", ""] + summary
    (OUT / "mirror.md").write_text("\n".join(report) + "\n")
    print("\n".join(summary))
    print(f"wrote {OUT / 'mirror.md'} and mirror_<model>.png; reproduce: {command}")


if __name__ == "__main__":
    main()
