"""Real library models (tandem.testing.real_models): capture, step time against eager PyTorch and
torch.compile, and measured peak memory with and without mirroring and gradient checkpointing.

    python bench/real_models.py [--models gpt2,timm_vit] [--repeats 21] [--threads 1] [--clock wall|cpu] [--skip-compile]

Every model of the registry (the named architectures and the extra ones), at a somewhat larger batch
than the conformance tests (LMs: 16 sequences of 32 tokens, encoder-decoders 16 target tokens;
vision: 32 images of 32x32), one model at a time:

* **capture s**: the first ``tandem.compile`` (capture + planning, mirror off); **nodes**: its op nodes.
* **step times**: forward + loss + backward. eager = ``zero_grad(set_to_none=True)``, ``loss_fn``,
  ``backward()``; tandem = ``step(*batch)`` (threaded engine, default bulking, mirror off);
  torch.compile = ``loss_fn(torch.compile(model), *batch).backward()`` as users write it
  (inductor, default mode). Medians of ``--repeats`` rounds, each round runs eager, tandem and
  torch.compile in turn (and the checkpointed pair for LMs), after 2 warm-up rounds.
  **compile first call s**: the first compiled forward + backward, with a fresh inductor cache
  directory per bench run (cold for the first model; later models may reuse kernels) and
  ``torch._dynamo.reset()`` before each model.
* **memory**: tandem's measured ``peak_bytes`` (its executor's meter: distinct live storages of
  intermediate values, gradients included; parameters, buffers and the batch are not counted) with
  mirror off and memory-aware. The eager peaks use the same rule, counted with a TorchDispatchMode
  (``EagerMeter`` below): every storage an aten op creates during the step (forward, loss, backward,
  autograd's saved values, the gradients) counts from its creation until it is freed, sampled after
  each op; storages that existed before the step (parameters, buffers, batch) and views or in-place
  results on them are not counted.
* **gradient checkpointing** (transformers LMs): the same model with
  ``activation_checkpointing_enable({"use_reentrant": False})`` (transformers 5's name of
  ``gradient_checkpointing_enable(gradient_checkpointing_kwargs=...)``, which is used where the new
  name does not exist): eager's peak against tandem's (its mirror pass recomputes the regions).

Writes bench/out/real_models.md and bench/out/real_models.png.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import date
from functools import partial
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import tandem  # noqa: E402
from bench.common import OUT, command_line, interleaved_medians, markdown_table, write_report  # noqa: E402
from tandem.testing import real_models  # noqa: E402
from tandem.testing.torchvision_compat import ensure_importable  # noqa: E402

MB = 1e6
LM_BATCH, SEQ_LEN, TARGET_LEN = 16, 32, 16  # the tests use 3 sequences of 12 (8 target) tokens
VISION_BATCH = 32  # 32x32 images (the registry's image size)
GOAL_TIME, GOAL_AWARE = 1.05, 0.85  # tandem / eager step time; memory-aware / off peak on the LMs


# -- the eager meter --------------------------------------------------------------------------------


class EagerMeter(TorchDispatchMode):
    """Peak bytes of distinct live storages created by aten ops while active (tandem's rule, in eager).

    A storage is counted from the op that creates it until it is freed (a weak reference expires);
    live bytes are summed after every op, which is where tandem's meter samples too. Outputs that
    share a storage with one of the op's inputs (views, in-place ops) add nothing, so views of
    parameters or of the batch are never counted.
    """

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, tuple[StorageWeakRef, int]] = {}  # storage address -> (weak ref, bytes)
        self.live_bytes = 0
        self.peak_bytes = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for key in [key for key, (ref, _) in self._live.items() if ref.expired()]:  # freed since the last op
            self.live_bytes -= self._live.pop(key)[1]
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for tensor in tree_leaves(out):
            if not isinstance(tensor, torch.Tensor):
                continue
            storage = tensor.untyped_storage()
            key = storage.data_ptr()
            if key == 0 or key in self._live or key in inputs:
                continue
            self._live[key] = (StorageWeakRef(storage), storage.nbytes())
            self.live_bytes += storage.nbytes()
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        return out


def eager_peak(module: nn.Module, loss_fn: Callable[..., torch.Tensor], batch: tuple[Any, ...]) -> int:
    eager_step(module, loss_fn, batch)  # warm-up: lazy initialization is not part of a step
    module.zero_grad(set_to_none=True)
    gc.collect()
    with EagerMeter() as meter:
        loss_fn(module, *batch).backward()
    module.zero_grad(set_to_none=True)
    return meter.peak_bytes


# -- one model ------------------------------------------------------------------------------------------


@dataclass
class Row:
    name: str
    library: str
    kind: str
    batch: str
    nodes: int = 0
    capture_seconds: float = 0.0
    times: dict[str, float] = field(default_factory=dict)  # candidate -> median seconds
    compile_first_seconds: float | None = None
    peaks: dict[str, int] = field(default_factory=dict)  # eager, off, memory-aware, ckpt eager, ckpt off, ckpt memory-aware

    def ratio(self, numerator: str, denominator: str, table: str = "times") -> float | None:
        values = getattr(self, table)
        if numerator not in values or denominator not in values or not values[denominator]:
            return None
        return float(values[numerator] / values[denominator])


@contextlib.contextmanager
def sequence_lengths(seq_len: int, target_len: int) -> Iterator[None]:
    """The registry's batch builders read these module constants when called: longer sequences."""
    saved = real_models.SEQ_LEN, real_models.TARGET_LEN
    real_models.SEQ_LEN, real_models.TARGET_LEN = seq_len, target_len  # type: ignore[misc]
    try:
        yield
    finally:
        real_models.SEQ_LEN, real_models.TARGET_LEN = saved  # type: ignore[misc]


def make_batch(entry: real_models.RealModel, seq_len: int, target_len: int) -> tuple[Any, ...]:
    generator = torch.Generator().manual_seed(0)
    if entry.kind != "lm":
        return entry.make_batch(VISION_BATCH, generator, torch.float32)
    with sequence_lengths(seq_len, target_len):
        batch = entry.make_batch(LM_BATCH, generator, torch.float32)
    if batch[0]["input_ids"].shape[1] != seq_len:
        raise RuntimeError(f"{entry.name}: the registry no longer reads SEQ_LEN at call time; update sequence_lengths()")
    return batch


def describe(batch: tuple[Any, ...]) -> str:
    first = batch[0]
    if isinstance(first, dict):
        ids, labels = first["input_ids"], first["labels"]
        return f"{ids.shape[0]}x{ids.shape[1]}" + (f" -> {labels.shape[1]}" if labels.shape[1] != ids.shape[1] else "")
    return f"{first.shape[0]}x{first.shape[-2]}x{first.shape[-1]}"


def eager_step(module: nn.Module, loss_fn: Callable[..., torch.Tensor], batch: tuple[Any, ...]) -> None:
    module.zero_grad(set_to_none=True)
    loss_fn(module, *batch).backward()


def enable_checkpointing(module: nn.Module) -> nn.Module:
    """transformers' gradient checkpointing, non-reentrant (the new name where transformers has it)."""
    enable = getattr(module, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        module.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})  # type: ignore[operator]
    return module


def tandem_peak(module: nn.Module, loss_fn: Callable[..., torch.Tensor], batch: tuple[Any, ...], mirror: str) -> tuple[Any, int]:
    step = tandem.compile(module, loss_fn, *batch, mirror=mirror)
    step(*batch)  # the first step is measured
    return step, int(step.memory_report()["peak_bytes"])


def measure(entry: real_models.RealModel, args: argparse.Namespace) -> Row:
    module = entry.build(seed=0)
    loss_fn = entry.loss_fn
    batch = make_batch(entry, args.seq_len, args.target_len)
    row = Row(entry.name, entry.library, entry.kind, describe(batch))

    start = time.perf_counter()
    step = tandem.compile(module, loss_fn, *batch, mirror="off")
    row.capture_seconds = time.perf_counter() - start
    step(*batch)
    report = step.memory_report()
    row.nodes, row.peaks["off"] = int(report["num_nodes"]), int(report["peak_bytes"])
    row.peaks["memory-aware"] = tandem_peak(module, loss_fn, batch, "memory-aware")[1]
    row.peaks["eager"] = eager_peak(module, loss_fn, batch)
    candidates: dict[str, Callable[[], Any]] = {"eager": partial(eager_step, module, loss_fn, batch),
                                                "tandem": partial(step, *batch)}

    if not args.skip_compile:
        torch._dynamo.reset()
        compiled = cast(nn.Module, torch.compile(module))
        start = time.perf_counter()
        eager_step(compiled, loss_fn, batch)
        row.compile_first_seconds = time.perf_counter() - start
        candidates["torch.compile"] = partial(eager_step, compiled, loss_fn, batch)

    if entry.kind == "lm" and entry.library == "transformers":
        checkpointed = enable_checkpointing(entry.build(seed=0))
        row.peaks["ckpt eager"] = eager_peak(checkpointed, loss_fn, batch)
        checkpointed_step, row.peaks["ckpt off"] = tandem_peak(checkpointed, loss_fn, batch, "off")
        row.peaks["ckpt memory-aware"] = tandem_peak(checkpointed, loss_fn, batch, "memory-aware")[1]
        candidates["ckpt eager"] = partial(eager_step, checkpointed, loss_fn, batch)
        candidates["ckpt tandem"] = partial(checkpointed_step, *batch)

    gc.collect()
    gc.freeze()  # the captured graphs are long-lived: keep cyclic GC from rescanning them mid-timing
    try:
        row.times = interleaved_medians(candidates, repeats=args.repeats,
                                        clock=time.process_time if args.clock == "cpu" else time.perf_counter)
    finally:
        gc.unfreeze()
    return row


# -- report ---------------------------------------------------------------------------------------------


def fmt(value: float | None, digits: int = 2, suffix: str = "") -> str:
    return "" if value is None else f"{value:.{digits}f}{suffix}"


def mb(row: Row, key: str) -> str:
    return f"{row.peaks[key] / MB:.2f}" if key in row.peaks else ""


def ms(row: Row, key: str) -> str:
    return f"{row.times[key] * 1e3:.1f}" if key in row.times else ""


def time_table(rows: list[Row]) -> str:
    headers = ["model", "library", "batch", "nodes", "capture s", "eager ms", "tandem ms", "tandem / eager",
               "torch.compile ms", "compile / eager", "compile first call s", "ckpt eager ms", "ckpt tandem ms",
               "ckpt tandem / eager"]
    body = [[r.name, r.library, r.batch, r.nodes, fmt(r.capture_seconds, 1), fmt(r.times["eager"] * 1e3, 1),
             fmt(r.times["tandem"] * 1e3, 1), fmt(r.ratio("tandem", "eager"), 3), ms(r, "torch.compile"),
             fmt(r.ratio("torch.compile", "eager"), 3), fmt(r.compile_first_seconds, 1), ms(r, "ckpt eager"),
             ms(r, "ckpt tandem"), fmt(r.ratio("ckpt tandem", "ckpt eager"), 3)] for r in rows]
    return markdown_table(headers, body)


def memory_table(rows: list[Row]) -> str:
    headers = ["model", "eager peak MB", "tandem off MB", "off / eager", "memory-aware MB", "memory-aware / off",
               "ckpt eager MB", "ckpt tandem MB", "ckpt tandem / ckpt eager", "ckpt tandem memory-aware MB",
               "ckpt memory-aware / ckpt eager"]
    body = [[r.name, mb(r, "eager"), mb(r, "off"), fmt(r.ratio("off", "eager", "peaks"), 3), mb(r, "memory-aware"),
             fmt(r.ratio("memory-aware", "off", "peaks"), 3), mb(r, "ckpt eager"), mb(r, "ckpt off"),
             fmt(r.ratio("ckpt off", "ckpt eager", "peaks"), 3), mb(r, "ckpt memory-aware"),
             fmt(r.ratio("ckpt memory-aware", "ckpt eager", "peaks"), 3)] for r in rows]
    return markdown_table(headers, body)


def goals(rows: list[Row]) -> list[str]:
    def verdict(label: str, checked: list[tuple[str, float]], limit: float) -> str:
        if not checked:
            return f"- {label}: no row measured"
        missed = [f"{name} {value:.3f}" for name, value in checked if value > limit]
        met = sum(1 for _, value in checked if value <= limit)
        return (f"- {label}: met on {met} of {len(checked)}" + (f"; missed: {', '.join(missed)}" if missed else "")
                + f" (median {statistics.median(v for _, v in checked):.3f})")

    times = [(r.name, r.ratio("tandem", "eager")) for r in rows]
    aware = [(r.name, r.ratio("memory-aware", "off", "peaks")) for r in rows if r.kind == "lm" and r.library == "transformers"]
    ckpt = [(r.name, r.ratio("ckpt off", "ckpt eager", "peaks")) for r in rows if "ckpt eager" in r.peaks]
    ckpt_aware = [(r.name, r.ratio("ckpt memory-aware", "ckpt eager", "peaks")) for r in rows if "ckpt eager" in r.peaks]
    return [verdict("tandem step time <= 1.05x eager", [(n, v) for n, v in times if v is not None], GOAL_TIME),
            verdict("memory-aware peak <= 0.85x mirror-off on the transformer LMs",
                    [(n, v) for n, v in aware if v is not None], GOAL_AWARE),
            verdict("checkpointed peak (tandem, mirror off) <= eager checkpointed peak",
                    [(n, v) for n, v in ckpt if v is not None], 1.0),
            verdict("checkpointed peak (tandem, memory-aware) <= eager checkpointed peak",
                    [(n, v) for n, v in ckpt_aware if v is not None], 1.0)]


def plot(rows: list[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r.name for r in rows]
    x = range(len(rows))
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(max(8, 0.62 * len(rows) + 2), 8.5), sharex=True)
    width = 0.4
    top.bar([i - width / 2 for i in x], [r.ratio("tandem", "eager") or 0 for r in rows], width, label="tandem / eager")
    top.bar([i + width / 2 for i in x], [r.ratio("torch.compile", "eager") or 0 for r in rows], width,
            label="torch.compile / eager")
    top.axhline(1.0, color="black", linewidth=0.8)
    top.axhline(GOAL_TIME, color="red", linestyle="--", linewidth=0.8, label=f"goal {GOAL_TIME}x (tandem)")
    top.set_ylabel("step time / eager step time")
    top.set_title("step time (forward + loss + backward), medians of interleaved rounds; lower is better")
    top.set_ylim(0, 1.3 * max([1.1] + [r.ratio(k, "eager") or 0 for r in rows for k in ("tandem", "torch.compile")]))
    top.legend(fontsize=8, loc="upper left", ncol=3)

    width = 0.27
    bottom.bar([i - width for i in x], [r.ratio("off", "eager", "peaks") or 0 for r in rows], width,
               label="tandem off / eager (meter check)", color="lightgray")
    bottom.bar(list(x), [r.ratio("memory-aware", "off", "peaks") or 0 for r in rows], width,
               label="memory-aware / mirror off")
    bottom.bar([i + width for i in x], [r.ratio("ckpt off", "ckpt eager", "peaks") or 0 for r in rows], width,
               label="checkpointed: tandem / eager")
    bottom.axhline(1.0, color="black", linewidth=0.8)
    bottom.axhline(GOAL_AWARE, color="red", linestyle="--", linewidth=0.8, label=f"goal {GOAL_AWARE}x (memory-aware, LMs)")
    bottom.set_ylabel("measured peak ratio")
    bottom.set_title("peak memory of live intermediates (tandem's meter; eager counted the same way)")
    bottom.set_xticks(list(x), names, rotation=45, ha="right")
    bottom.set_ylim(0, 1.35 * max([1.1] + [r.ratio(a, b, "peaks") or 0 for r in rows
                                            for a, b in (("off", "eager"), ("ckpt off", "ckpt eager"))]))
    bottom.legend(fontsize=8, loc="upper left", ncol=2)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()}, {platform.machine()}"
    return platform.processor() or platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="", help="comma-separated registry names (default: all, named first)")
    parser.add_argument("--repeats", type=int, default=21, help="interleaved timing rounds (median; at least 5)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: least disturbed by a shared machine)")
    parser.add_argument("--seq-len", type=int, default=SEQ_LEN, help="LM sequence length (max 64)")
    parser.add_argument("--target-len", type=int, default=TARGET_LEN, help="encoder-decoder target length")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="wall: perf_counter; cpu: process CPU time of all threads (robust on a loaded machine)")
    parser.add_argument("--skip-compile", action="store_true", help="leave torch.compile out (its cold compiles take most of the time)")
    args = parser.parse_args()
    if args.repeats < 5:
        parser.error("--repeats must be at least 5 (medians)")
    torch.set_num_threads(args.threads)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="tandem-bench-inductor-"))
    os.environ["TANDEM_CAPTURE_CACHE"] = "0"  # the capture column times tracing, not loading a cached graph
    ensure_importable()  # before transformers / timm import torchvision
    logging.getLogger("transformers").setLevel(logging.ERROR)
    with contextlib.suppress(ImportError):
        import transformers

        transformers.logging.set_verbosity_error()

    entries = list(real_models.NAMED + real_models.UNNAMED)
    if args.models:
        entries = [real_models.real_model(name) for name in args.models.split(",")]
    rows: list[Row] = []
    started = time.perf_counter()
    for entry in entries:
        row = measure(entry, args)
        rows.append(row)
        print(f"{row.name}: {row.nodes} nodes, capture {row.capture_seconds:.1f}s, tandem/eager "
              f"{fmt(row.ratio('tandem', 'eager'), 3)}, compile/eager {fmt(row.ratio('torch.compile', 'eager'), 3)} "
              f"(first call {fmt(row.compile_first_seconds, 1)}s), memory-aware/off "
              f"{fmt(row.ratio('memory-aware', 'off', 'peaks'), 3)}, ckpt tandem/eager "
              f"{fmt(row.ratio('ckpt off', 'ckpt eager', 'peaks'), 3)}", flush=True)
    minutes = (time.perf_counter() - started) / 60
    header = (f"({date.today().isoformat()}; {os.cpu_count()}-core CPU ({cpu_name()}), torch {torch.__version__}, "
              f"{args.threads} torch thread(s), medians of {args.repeats} interleaved rounds, {args.clock} clock; "
              f"ran {minutes:.1f} minutes)")
    text = "\n\n".join([header, "Step time (forward + loss + backward):", time_table(rows),
                        "Measured peak memory (live intermediate storages; parameters, buffers and batch not counted):",
                        memory_table(rows), "Goals:\n\n" + "\n".join(goals(rows))])
    print(f"\nCommand: `{command_line()}`\n\n{text}")
    write_report("real_models", text)
    plot(rows, OUT / "real_models.png")
    print(f"\nwrote {OUT / 'real_models.md'} and {OUT / 'real_models.png'}")


if __name__ == "__main__":
    main()
