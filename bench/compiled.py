"""Compiled segments (issue #28): tandem's inductor backend against eager and torch.compile.

    python bench/compiled.py [--models resnet,gpt,lstm_lm,hf-gpt2,hf-llama] [--threads 1,2]
                             [--repeats 7] [--clock cpu|wall] [--quick] [--first-call-only | --memory-only | --profile]

Three measurements, each model in fresh subprocesses (inductor specializes its kernels to the
thread count, and dynamo's caches stay per process):

* **Step time** (forward + loss + backward) of eager (``zero_grad(set_to_none=True)``, ``loss_fn``,
  ``backward()``), ``torch.compile(model)`` in the default mode and in
  ``mode="max-autotune-no-cudagraphs"``, and ``tandem.compile`` with ``backend="aten"`` and
  ``backend="inductor"`` (mirror off) with each of inductor's two wrappers (``tandem inductor`` is the
  one ``TANDEM_INDUCTOR_CPP_WRAPPER`` selects, the other is its own column), at each ``--threads``. Medians of ``--repeats`` interleaved
  rounds after 2 warm-up rounds; ``--clock cpu`` (the default) is the process CPU time of all
  threads, robust on a shared machine. The timing subprocesses share one inductor cache directory.
* **Memory against time** (at the first ``--threads``, in the same interleaved rounds): tandem inductor at mirror off /
  memory-aware / budgets 0.8, 0.6, 0.4 of off, and torch.compile (default mode) with
  ``torch._functorch.config.activation_memory_budget`` 1.0 / 0.8 / 0.6 / 0.4. One meter for every
  point: the profiler's allocation events during one step (``tandem.executor._AllocationEvents``,
  what tandem's inductor backend reports as ``peak_bytes``): the highest running sum of bytes
  allocated minus freed during the step, above what was live when it started, so parameters, buffers
  and the batch are not counted and the gradients are, for every column.
* **First call** (capture + compile + the first step) of tandem inductor (both wrappers) and of torch.compile
  (default mode), 1 thread: cold, a fresh subprocess whose ``TORCHINDUCTOR_CACHE_DIR`` is a new
  empty directory; warm, a second fresh subprocess on the same directory (tandem's capture cache
  lives in it too: the warm run loads the captured graph). Model construction and ``import torch``
  are not counted.

``--quick``: gpt only, 1 thread, 3 rounds (a smoke run of the script; its numbers mean little).
``--first-call-only``: the first-call table alone (bench/out/compiled_first_call.md), for
re-measuring compile times on a quiet machine.
``--profile``: a ``torch.profiler`` breakdown of eager's and tandem inductor's step per model (1
thread, ``TANDEM_ENGINE=naive``, the fastest of 3 alternating rounds of ``--repeats`` steps):
matrix products, random draws and everything else, per step (bench/out/compiled_profile.md).
``--memory-only``: the memory-against-time table and plot alone, at the first ``--threads``
(bench/out/compiled_memory.md and compiled_memory.png): no other thread counts and no first calls
(the max-autotune and aten columns still run in the rounds, unreported).
Writes bench/out/compiled.md, bench/out/compiled_memory.png and bench/out/compiled_time.png.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from datetime import date
from functools import partial
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import tandem  # noqa: E402
from bench.capture import CASES, eager_step  # noqa: E402
from bench.common import OUT, command_line, interleaved_medians, markdown_table, write_report  # noqa: E402
from bench.real_models import cpu_name, sequence_lengths  # noqa: E402
from tandem.backends.inductor import onednn_below_avx512  # noqa: E402
from tandem.env import knob  # noqa: E402
from tandem.executor import _AllocationEvents  # noqa: E402
from tandem.models import LIBRARY, ZOO  # noqa: E402
from tandem.testing import real_models  # noqa: E402
from tandem.testing.torchvision_compat import ensure_importable  # noqa: E402

MODELS = ["resnet", "gpt", "lstm_lm", "hf-gpt2", "hf-llama"]
LM_BATCH, LM_SEQ_LEN = 16, 32  # the transformers LMs: 16 sequences of 32 tokens (bench/real_models.py's)
BUDGETS = (0.8, 0.6, 0.4)
COMPILE_MODES = {"torch.compile": None, "torch.compile max-autotune": "max-autotune-no-cudagraphs"}
GOAL_EAGER, GOAL_EAGER_MODELS, GOAL_WARM_S = 0.85, ("resnet", "gpt"), 5.0
# "tandem inductor" is the wrapper TANDEM_INDUCTOR_CPP_WRAPPER selects (default or set); this column is the other one
CPP_WRAPPER = bool(knob("TANDEM_INDUCTOR_CPP_WRAPPER"))
OTHER_WRAPPER = f"tandem inductor {'Python' if CPP_WRAPPER else 'C++'} wrapper"
TIME_LABELS = ["torch.compile", "torch.compile max-autotune", "tandem aten", "tandem inductor", OTHER_WRAPPER]
MiB = 2**20


# -- the models -------------------------------------------------------------------------------------


def build(name: str) -> tuple[nn.Module, Callable[..., torch.Tensor], tuple[Any, ...]]:
    """The model (seeded), its loss and one batch: bench/capture.py's CASES, or a LIBRARY LM."""
    torch.manual_seed(0)
    if name in LIBRARY:
        ensure_importable()
        logging.getLogger("transformers").setLevel(logging.ERROR)
        entry = LIBRARY[name]
        module = entry.build()
        with sequence_lengths(LM_SEQ_LEN, LM_SEQ_LEN):
            batch: tuple[Any, ...] = real_models.causal_lm_batch(LM_BATCH, torch.Generator().manual_seed(0))
        return module, entry.loss_fn, batch
    config, batch_config, batch_size = cast(tuple[dict[str, Any], dict[str, Any], int], CASES[name])
    zoo = ZOO[name]
    module = zoo.build(**config)
    batch = zoo.make_batch(batch_size, torch.Generator().manual_seed(0), **config, **batch_config)
    return module, zoo.loss_fn, batch


def batch_tensors(batch: tuple[Any, ...]) -> list[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(batch) if isinstance(t, torch.Tensor)]


def torch_compiled(module: nn.Module, mode: str | None, budget: float = 1.0) -> nn.Module:
    """A copy of ``module`` under torch.compile; the caller's first step compiles it (under ``budget``).

    A budget below 1.0 gets its own backend (inductor's ``compile_fx`` under the patched budget):
    dynamo reuses a compiled frame for any backend equal to the one that compiled it, and two
    default-mode torch.compile wrappers are equal, so a second copy would run the first's kernels.
    """
    if budget == 1.0:
        compiled: nn.Module = torch.compile(copy.deepcopy(module), mode=mode)  # type: ignore[assignment]
    else:
        compiled = torch.compile(copy.deepcopy(module), backend=partial(budget_backend, budget))  # type: ignore[assignment]
    compiled._bench_budget = budget  # type: ignore[assignment]  # read by first_step
    return compiled


def budget_backend(budget: float, graph: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
    """torch.compile's inductor backend with ``activation_memory_budget=budget`` (read when partitioning)."""
    import torch._functorch.config as functorch_config
    from torch._inductor.compile_fx import compile_fx

    with functorch_config.patch(activation_memory_budget=budget):
        return compile_fx(graph, example_inputs)  # type: ignore[return-value]


def first_step(module: nn.Module, loss_fn: Callable[..., torch.Tensor], batch: tuple[Any, ...]) -> None:
    """One step; a torch.compile'd module compiles forward and backward here, under its memory budget."""
    import torch._functorch.config as functorch_config

    with functorch_config.patch(activation_memory_budget=getattr(module, "_bench_budget", 1.0)):
        eager_step(module, loss_fn, batch)


def allocation_peak(module: nn.Module, loss_fn: Callable[..., torch.Tensor], batch: tuple[Any, ...]) -> int:
    """Peak bytes of one eager or torch.compile step, metered as tandem meters its inductor steps."""
    module.zero_grad(set_to_none=True)  # outside: the gradients are allocated inside, as tandem's are
    gc.collect()
    with _AllocationEvents(batch_tensors(batch)) as events:
        loss_fn(module, *batch).backward()
    module.zero_grad(set_to_none=True)
    return events.peak_bytes()


# -- the subprocesses ---------------------------------------------------------------------------------


def child_timing(name: str, threads: int, sweep: bool, repeats: int, clock: str) -> dict[str, Any]:
    """Every candidate of one model at one thread count, timed side by side; with ``sweep`` the memory points too."""
    torch.set_num_threads(threads)
    module, loss_fn, batch = build(name)
    candidates: dict[str, Callable[[], Any]] = {"eager": partial(eager_step, module, loss_fn, batch)}
    peaks: dict[str, int] = {}
    modules: dict[str, nn.Module] = {"eager": module}
    for label, mode in COMPILE_MODES.items():
        modules[label] = torch_compiled(module, mode)
    if sweep:
        for budget in BUDGETS:
            modules[f"torch.compile budget {budget:g}"] = torch_compiled(module, None, budget)
    for label, compiled in modules.items():
        if label != "eager":
            first_step(compiled, loss_fn, batch)
            candidates[label] = partial(eager_step, compiled, loss_fn, batch)
        if sweep and label != "torch.compile max-autotune":
            eager_step(compiled, loss_fn, batch)
            peaks[label] = allocation_peak(compiled, loss_fn, batch)
    fallbacks: dict[str, Any] = {}
    policies: list[str | float] = ["off", "memory-aware", *BUDGETS] if sweep else ["off"]
    for backend in ("aten", "inductor"):
        for policy in policies if backend == "inductor" else policies[:1]:
            step = tandem.compile(module, loss_fn, *batch, backend=backend, mirror=policy)
            step(*batch)  # captured, compiled and measured: the first step's peak_bytes
            label = f"tandem {backend}" + ("" if policy == "off" else f" {policy}" if isinstance(policy, str) else f" budget {policy:g}")
            candidates[label] = partial(step, *batch)
            if backend == "inductor":
                peaks[label] = int(step.memory_report()["peak_bytes"])
                fallbacks.update(step.compile_report()["fallbacks"])
    with other_wrapper():
        step = tandem.compile(module, loss_fn, *batch, backend="inductor")
        step(*batch)
    candidates[OTHER_WRAPPER] = partial(step, *batch)
    gc.collect()
    gc.freeze()  # the captured graphs are long-lived: keep cyclic GC from rescanning them mid-timing
    try:
        times = interleaved_medians(candidates, repeats=repeats, min_repeats=1 if repeats < 5 else 5,
                                    clock=time.process_time if clock == "cpu" else time.perf_counter)
    finally:
        gc.unfreeze()
    return {"times": times, "peaks": peaks, "fallbacks": fallbacks}


@contextlib.contextmanager
def other_wrapper() -> Iterator[None]:
    """Compile under the inductor wrapper TANDEM_INDUCTOR_CPP_WRAPPER does not select (read at compile time)."""
    previous = os.environ.get("TANDEM_INDUCTOR_CPP_WRAPPER")
    os.environ["TANDEM_INDUCTOR_CPP_WRAPPER"] = "0" if CPP_WRAPPER else "1"
    try:
        yield
    finally:
        if previous is None:
            del os.environ["TANDEM_INDUCTOR_CPP_WRAPPER"]
        else:
            os.environ["TANDEM_INDUCTOR_CPP_WRAPPER"] = previous


def child_first_call(name: str, system: str) -> dict[str, Any]:
    """Seconds from the built model to the end of the first step (capture / dynamo + compile + run)."""
    torch.set_num_threads(1)
    module, loss_fn, batch = build(name)
    start = time.perf_counter()
    if system.startswith("tandem"):
        with other_wrapper() if system == OTHER_WRAPPER else contextlib.nullcontext():
            step = tandem.compile(module, loss_fn, *batch, backend="inductor")
            step(*batch)
        seconds = time.perf_counter() - start
        report = step.compile_report()
        return {"seconds": seconds, "capture_s": report["capture_s"], "plan_s": report["plan_s"],
                "compile_s": report["compile_s"]}
    first_step(torch_compiled(module, None), loss_fn, batch)
    return {"seconds": time.perf_counter() - start}


PROFILE_GROUPS = {"matrix products": ("aten::mm", "aten::addmm", "aten::bmm"),
                  "random draws": ("aten::bernoulli_", "tandem::bernoulli")}  # tandem's: its vectorised draw


def child_profile(name: str, steps: int) -> dict[str, Any]:
    """Per-step milliseconds of eager and tandem inductor under ``torch.profiler`` (1 thread; the parent
    sets ``TANDEM_ENGINE=naive`` so tandem's ops run on the profiled thread): the op groups that are
    the same aten calls in both, and everything else."""
    from torch.profiler import ProfilerActivity, profile

    torch.set_num_threads(1)
    module, loss_fn, batch = build(name)
    step = tandem.compile(module, loss_fn, *batch, backend="inductor")
    runs = {"eager": partial(eager_step, module, loss_fn, batch), "tandem inductor": partial(step, *batch)}
    result: dict[str, Any] = {}
    for run in runs.values():
        for _ in range(3):  # compiled, warm
            run()
    for _ in range(3):  # rounds alternate the two; each keeps its fastest round (the machine is shared)
        for label, run in runs.items():
            with profile(activities=[ProfilerActivity.CPU]) as profiler:
                start = time.perf_counter()
                for _ in range(steps):
                    run()
                seconds = time.perf_counter() - start
            self_us = {event.key: event.self_cpu_time_total for event in profiler.key_averages()}
            row = {"step": seconds / steps * 1e3,
                   **{group: sum(self_us.get(op, 0.0) for op in ops) / steps / 1e3 for group, ops in PROFILE_GROUPS.items()}}
            if label not in result or row["step"] < result[label]["step"]:
                result[label] = row
    return result


def profile_section(results: dict[str, dict[str, Any]], steps: int) -> str:
    rows = []
    for name, result in results.items():
        for label, row in result.items():
            other = row["step"] - sum(row[group] for group in PROFILE_GROUPS)
            rows.append([name, label, f"{row['step']:.1f}", *(f"{row[group]:.1f}" for group in PROFILE_GROUPS),
                         f"{other:.1f}"])
    headers = ["model", "column", "step ms", *(f"{group} ms" for group in PROFILE_GROUPS), "everything else ms"]
    return (f"Profiled step (torch.profiler, {steps} steps, the fastest of 3 alternating rounds, 1 thread, wall "
            f"clock under the profiler; matrix products: {', '.join(PROFILE_GROUPS['matrix products'])}; random draws: "
            f"{', '.join(PROFILE_GROUPS['random draws'])}; self CPU time per step):\n\n" + markdown_table(headers, rows))


def run_child(arguments: list[str], cache_dir: str) -> dict[str, Any]:
    command = [sys.executable, __file__, "--child", *arguments]
    environment = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache_dir}
    done = subprocess.run(command, capture_output=True, text=True, env=environment, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(arguments)} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# -- report -------------------------------------------------------------------------------------------


def verdict(met: bool) -> str:
    return "met" if met else "MISSED"


def time_section(results: dict[tuple[str, int], dict[str, Any]]) -> tuple[str, list[str]]:
    rows, goals = [], []
    for (name, threads), result in results.items():
        times = result["times"]
        eager = times["eager"]
        best = min(times[label] for label in COMPILE_MODES)
        ours = times["tandem inductor"]
        rows.append([name, threads, f"{eager * 1e3:.1f}", *[f"{times[label] / eager:.3f}" for label in TIME_LABELS],
                     f"{ours / best:.3f}", f"{times[OTHER_WRAPPER] / ours:.3f}"])
        goals.append(f"- {name}, {threads} thread(s): tandem inductor {ours * 1e3:.1f} ms <= torch.compile's best "
                     f"{best * 1e3:.1f} ms: {verdict(ours <= best)} ({ours / best:.3f}x)")
        if name in GOAL_EAGER_MODELS:
            goals.append(f"- {name}, {threads} thread(s): tandem inductor <= {GOAL_EAGER}x eager: "
                         f"{verdict(ours <= GOAL_EAGER * eager)} ({ours / eager:.3f}x)")
    headers = ["model", "threads", "eager ms", *[f"{label} / eager" for label in TIME_LABELS],
               "tandem inductor / best torch.compile", f"{OTHER_WRAPPER} / tandem inductor"]
    return markdown_table(headers, rows), goals


def memory_points(result: dict[str, Any]) -> dict[str, list[tuple[str, float, float]]]:
    """family -> [(label, step ms, peak MiB)] of the memory sweep."""
    curves: dict[str, list[tuple[str, float, float]]] = {"tandem inductor": [], "torch.compile": [], "eager": []}
    for label, peak in result["peaks"].items():
        family = "eager" if label == "eager" else "tandem inductor" if label.startswith("tandem") else "torch.compile"
        curves[family].append((label, result["times"][label] * 1e3, peak / MiB))
    return curves


def dominates(ours: list[tuple[str, float, float]], theirs: list[tuple[str, float, float]]) -> list[str]:
    """The torch.compile points no tandem point matches in both step time and peak memory."""
    return [label for label, ms, mib in theirs if not any(o_ms <= ms and o_mib <= mib for _, o_ms, o_mib in ours)]


def memory_section(results: dict[str, dict[str, Any]]) -> tuple[str, list[str]]:
    rows, goals = [], []
    for name, result in results.items():
        curves = memory_points(result)
        eager_peak = curves["eager"][0][2]
        for family in ("eager", "torch.compile", "tandem inductor"):
            for label, ms, mib in curves[family]:
                rows.append([name, label, f"{mib:.2f}", f"{mib / eager_peak:.2f}", f"{ms:.1f}"])
        missed = dominates(curves["tandem inductor"], curves["torch.compile"])
        goals.append(f"- {name}: tandem's curve dominates torch.compile's: {verdict(not missed)}"
                     + (f" (no tandem point is both faster and smaller than: {', '.join(missed)})" if missed else ""))
    return markdown_table(["model", "column", "peak MiB", "peak / eager", "step ms"], rows), goals


def first_call_section(results: dict[str, dict[str, dict[str, Any]]]) -> tuple[str, list[str]]:
    rows, goals = [], []
    for name, result in results.items():
        ours_cold, ours_warm = result["tandem cold"], result["tandem warm"]
        theirs_cold, theirs_warm = result["torch.compile cold"]["seconds"], result["torch.compile warm"]["seconds"]
        other_cold, other_warm = result[f"{OTHER_WRAPPER} cold"]["seconds"], result[f"{OTHER_WRAPPER} warm"]["seconds"]
        rows.append([name, f"{ours_cold['seconds']:.1f}", f"{ours_cold['capture_s']:.1f}", f"{ours_cold['compile_s']:.1f}",
                     f"{other_cold:.1f}", f"{theirs_cold:.1f}", f"{ours_warm['seconds']:.1f}", f"{ours_warm['capture_s']:.1f}",
                     f"{ours_warm['compile_s']:.1f}", f"{other_warm:.1f}", f"{theirs_warm:.1f}"])
        goals.append(f"- {name}: tandem cold {ours_cold['seconds']:.1f} s <= torch.compile cold {theirs_cold:.1f} s: "
                     f"{verdict(ours_cold['seconds'] <= theirs_cold)}; tandem warm {ours_warm['seconds']:.1f} s < "
                     f"{GOAL_WARM_S:g} s: {verdict(ours_warm['seconds'] < GOAL_WARM_S)}")
    headers = ["model", "tandem cold s", "of which capture s", "of which compile s", f"{OTHER_WRAPPER} cold s",
               "torch.compile cold s", "tandem warm s", "of which capture s", "of which compile s",
               f"{OTHER_WRAPPER} warm s", "torch.compile warm s"]
    return markdown_table(headers, rows), goals


def plot_memory(results: dict[str, dict[str, Any]], threads: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes_row = plt.subplots(1, len(results), figsize=(4.2 * len(results), 4), squeeze=False)
    for axes, (name, result) in zip(axes_row[0], results.items()):
        curves = memory_points(result)
        for family, marker in (("tandem inductor", "o"), ("torch.compile", "s"), ("eager", "x")):
            points = sorted(curves[family], key=lambda p: p[2])
            axes.plot([p[1] for p in points], [p[2] for p in points], marker=marker, label=family)
            for label, ms, mib in points:
                short = label.replace("tandem inductor", "").replace("torch.compile", "").replace("budget ", "").strip()
                axes.annotate(short or ("off" if family == "tandem inductor" else "1.0" if family == "torch.compile" else ""),
                              (ms, mib), fontsize=7, xytext=(3, 3), textcoords="offset points")
        axes.set_title(name)
        axes.set_xlabel("step ms (median)")
        axes.set_ylabel("peak MiB during the step")
        axes.set_ylim(bottom=0)
        axes.legend(fontsize=7)
    figure.suptitle(f"peak memory vs step time, {threads} thread(s) (lower left is better)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def plot_time(results: dict[tuple[str, int], dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = TIME_LABELS
    keys = list(results)
    figure, axes = plt.subplots(figsize=(max(8, 1.3 * len(keys)), 4))
    width = 0.8 / len(labels)
    for i, label in enumerate(labels):
        axes.bar([x + i * width for x in range(len(keys))],
                 [results[k]["times"][label] / results[k]["times"]["eager"] for k in keys], width, label=label)
    axes.set_xticks([x + width * (len(labels) - 1) / 2 for x in range(len(keys))], [f"{n}\n{t} thr" for n, t in keys])
    axes.axhline(1.0, color="black", linewidth=0.8)
    axes.axhline(GOAL_EAGER, color="red", linestyle="--", linewidth=0.8, label=f"goal {GOAL_EAGER}x (resnet, gpt)")
    axes.set_ylabel("step time / eager")
    axes.set_title("step time over eager (forward + loss + backward; lower is better)")
    axes.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--threads", default="1,2", help="comma-separated torch thread counts")
    parser.add_argument("--repeats", type=int, default=7, help="interleaved rounds (median; at least 5)")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="cpu",
                        help="cpu: process CPU time of all threads (robust on a loaded machine); wall: perf_counter")
    parser.add_argument("--quick", action="store_true", help="gpt, 1 thread, 3 rounds: checks the script")
    parser.add_argument("--first-call-only", action="store_true",
                        help="only the first-call table (cold and warm compiles; writes compiled_first_call.md)")
    parser.add_argument("--memory-only", action="store_true",
                        help="only the memory-against-time sweep (writes compiled_memory.md and its plot)")
    parser.add_argument("--profile", action="store_true",
                        help="only a torch.profiler breakdown of eager's and tandem inductor's step (writes compiled_profile.md)")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if sum([args.first_call_only, args.memory_only, args.profile]) > 1:
        parser.error("--first-call-only, --memory-only and --profile each run one table; pick one")
    if args.child:
        with contextlib.suppress(AttributeError):
            torch._dynamo.config.recompile_limit = 64  # one cache entry per torch.compile'd copy
        # torch.compile as a user must run it where oneDNN runs AVX2 code (tandem's backend does the
        # same): channels-last convolutions there corrupt the heap (docs/compiled.md)
        if onednn_below_avx512():
            import torch._inductor.config as inductor_config

            inductor_config.layout_optimization = False
        kind, name, *rest = args.child
        if kind == "timing":
            result = child_timing(name, int(rest[0]), rest[1] == "sweep", int(rest[2]), rest[3])
        elif kind == "profile":
            result = child_profile(name, int(rest[0]))
        else:
            result = child_first_call(name, rest[0])
        print(json.dumps(result))
        return
    if args.quick:
        args.models, args.threads, args.repeats = "gpt", "1", 3
    elif args.repeats < 5:
        parser.error("--repeats must be at least 5 (medians)")
    models, thread_counts = args.models.split(","), [int(t) for t in args.threads.split(",")]
    started = time.perf_counter()
    shared_cache = tempfile.mkdtemp(prefix="tandem-bench-compiled-")
    if args.profile:
        os.environ["TANDEM_ENGINE"] = "naive"  # the children's ops run on the thread the profiler records
        steps = max(args.repeats, 5)
        profiles = {name: run_child(["profile", name, str(steps)], shared_cache) for name in models}
        text = profile_section(profiles, steps)
        print(f"\nCommand: `{command_line()}`\n\n{text}")
        write_report("compiled_profile", text)
        return
    timing: dict[tuple[str, int], dict[str, Any]] = {}
    sweeps: dict[str, dict[str, Any]] = {}
    first_calls: dict[str, dict[str, dict[str, Any]]] = {}
    for name in models:
        timed_threads = [] if args.first_call_only else thread_counts[:1] if args.memory_only else thread_counts
        for threads in timed_threads:
            sweep = threads == thread_counts[0]
            result = run_child(["timing", name, str(threads), "sweep" if sweep else "-", str(args.repeats), args.clock],
                               shared_cache)
            timing[(name, threads)] = result
            if sweep:
                sweeps[name] = result
            if result["fallbacks"]:
                print(f"{name}: segments fell back to aten: {result['fallbacks']}")
            times = result["times"]
            print(f"{name}, {threads} thread(s): " + ", ".join(f"{k} {v / times['eager']:.3f}" for k, v in times.items()
                                                                if k != "eager") + " (x eager)", flush=True)
        if args.memory_only:
            continue
        first_calls[name] = {}
        for system in ("tandem", OTHER_WRAPPER, "torch.compile"):
            slug = "".join(c if c.isalnum() else "-" for c in system)  # C++ builds choke on spaces and "+" in paths
            cache = tempfile.mkdtemp(prefix=f"tandem-bench-first-call-{slug}-")
            for temperature in ("cold", "warm"):
                first_calls[name][f"{system} {temperature}"] = run_child(["first-call", name, system], cache)
        print(f"{name}: first call " + ", ".join(f"{k} {v['seconds']:.1f}s" for k, v in first_calls[name].items()), flush=True)
    minutes = (time.perf_counter() - started) / 60
    first_table, first_goals = first_call_section(first_calls)
    if args.first_call_only:
        text = (f"({date.today().isoformat()}; {os.cpu_count()}-core CPU ({cpu_name()}), torch {torch.__version__}, "
                f"ran {minutes:.1f} minutes)\n\nFirst call (capture + compile + first step), 1 thread, fresh "
                f"subprocesses:\n\n{first_table}\n\nGoals:\n\n" + "\n".join(first_goals))
        print(f"\nCommand: `{command_line()}`\n\n{text}")
        write_report("compiled_first_call", text)
        return
    memory_table, memory_goals = memory_section(sweeps)
    header = (f"({date.today().isoformat()}; {os.cpu_count()}-core CPU ({cpu_name()}), torch {torch.__version__}, "
              f"medians of {args.repeats} interleaved rounds, {args.clock} clock; ran {minutes:.1f} minutes; "
              f"tandem inductor: inductor's {'C++' if CPP_WRAPPER else 'Python'} wrapper"
              + ("; --quick: a smoke run, the numbers mean little" if args.quick else "") + ")")
    memory_title = f"Peak memory during one step (profiler allocation events) and step time, {thread_counts[0]} thread(s):"
    if args.memory_only:
        text = f"{header}\n\n{memory_title}\n\n{memory_table}\n\nGoals:\n\n" + "\n".join(memory_goals)
        print(f"\nCommand: `{command_line()}`\n\n{text}")
        write_report("compiled_memory", text)
        plot_memory(sweeps, thread_counts[0], OUT / "compiled_memory.png")
        print(f"\nwrote {OUT / 'compiled_memory.md'} and {OUT / 'compiled_memory.png'}")
        return
    time_table, time_goals = time_section(timing)
    text = "\n\n".join([
        header,
        "Step time (forward + loss + backward) over eager:", time_table,
        memory_title,
        memory_table,
        "First call (capture + compile + first step), 1 thread, fresh subprocesses:", first_table,
        "Goals:\n\n" + "\n".join(time_goals + memory_goals + first_goals),
    ])
    print(f"\nCommand: `{command_line()}`\n\n{text}")
    write_report("compiled", text)
    plot_memory(sweeps, thread_counts[0], OUT / "compiled_memory.png")
    plot_time(timing, OUT / "compiled_time.png")
    print(f"\nwrote {OUT / 'compiled.md'}, {OUT / 'compiled_memory.png'} and {OUT / 'compiled_time.png'}")


if __name__ == "__main__":
    main()
