"""tandem on a CUDA GPU: both backends against eager autograd, and step times beside torch.compile.

    python bench/gpu.py [--models resnet,gpt,lstm_lm,hf-gpt2,hf-llama] [--steps 10] [--repeats 7]
                        [--no-collective] [--deterministic] [--gradients] [--device cuda]

Not a test: the CI machine has no GPU. Run it by hand where one is; the figures land in
docs/benchmarks.md. The models and batches are bench/compiled.py's (tiny: on a large GPU their steps
are bound by kernel launches, which is where per-op framework cost shows). Float32 with TF32 off, so
that eager and tandem compute the same sums. Per model:

* **Numerics**: ``--steps`` steps of ``tandem.Trainer`` (SGD with momentum) with ``backend="aten"``
  and ``backend="inductor"`` against the same steps of ``torch.optim.SGD`` on eager autograd: the
  largest relative error of a step's loss, and of a parameter tensor (by norm). Dropout is set to 0
  here, so that the errors are the kernels' alone (tests/accelerator checks dropout's masks equal
  eager's on the GPU).
* **Memory**: the device allocator's peak during one step (``max_memory_allocated`` above what was
  live before the step: ``memory_report()["allocator_peak_bytes"]`` for tandem) of eager and of
  tandem at mirror off and memory-aware; beside it tandem's own meter (``peak_bytes``: the live
  intermediate storages, what mirroring budgets count; no library workspaces).
* **Step time** (forward + loss + backward, synchronised): eager, ``torch.compile`` (default mode),
  tandem aten, tandem inductor; medians of ``--repeats`` interleaved rounds after 2 warm-up rounds.

``--deterministic`` runs deterministic cuDNN and cuBLAS kernels, so that eager's run-to-run spread is
0; ``--gradients`` also compares one step's gradients of each backend, and of ``torch.compile``,
with eager's (which parameters differ, and by how much, before any update compounds it).

``--collective`` (the default): ``Trainer(kvstore="collective", communication="p3")`` on NCCL, one
worker under torchrun (one GPU: NCCL refuses two ranks on one device), 10 steps of the gpt model:
its parameters against a plain Trainer's.

Writes bench/out/gpu.md and bench/out/gpu.png.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import traceback
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn
from torch.utils._pytree import tree_map

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from anywhere without installing

import tandem  # noqa: E402
from bench.capture import eager_step  # noqa: E402
from bench.common import bar_plot, command_line, interleaved_medians, markdown_table, write_report  # noqa: E402
from bench.compiled import MODELS, build  # noqa: E402
from tandem import optim  # noqa: E402
from tandem.testing.reference import eager_train  # noqa: E402

LR, MOMENTUM = 0.01, 0.9
RTOL = 1e-4  # the float32 tolerance the CPU conformance suite holds the inductor backend to
MiB = 2**20
MEMORY_COLUMNS = ("eager", "tandem off", "tandem memory-aware", "tandem off meter", "tandem memory-aware meter")


def on(device: torch.device, tree: Any) -> Any:
    return tree_map(lambda leaf: leaf.to(device) if isinstance(leaf, torch.Tensor) else leaf, tree)


def model(name: str, device: torch.device) -> tuple[nn.Module, Callable[..., torch.Tensor], tuple[Any, ...]]:
    module, loss_fn, batch = build(name)
    for layer in module.modules():
        if isinstance(layer, nn.Dropout):
            layer.p = 0.0  # compare deterministic steps: the errors are the kernels' alone
    return module.to(device), loss_fn, on(device, batch)


def relative(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    ours, theirs = ours.detach().double(), theirs.detach().double()
    return float((ours - theirs).norm() / theirs.norm().clamp_min(1e-12))


def sgd(module: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(module.parameters(), lr=LR, momentum=MOMENTUM)


def numerics(name: str, device: torch.device, steps: int) -> dict[str, Any]:
    """Per backend, and for eager run again (the device's own run-to-run spread: cuDNN's convolutions
    are not deterministic): the largest relative error of a loss and of a parameter after ``steps``."""
    module, loss_fn, batch = model(name, device)
    reference = copy.deepcopy(module)
    expected = eager_train(reference, loss_fn, batch, sgd(reference), steps)
    result: dict[str, Any] = {}
    for backend in ("eager again", "aten", "inductor"):
        ours = copy.deepcopy(module)
        if backend == "eager again":
            losses = eager_train(ours, loss_fn, batch, sgd(ours), steps)
        else:
            trainer = tandem.Trainer(ours, loss_fn, optim.SGD(lr=LR, momentum=MOMENTUM), backend=backend)
            try:
                losses = [trainer.step(*batch) for _ in range(steps)]
            finally:
                trainer.close()
        final = dict(ours.named_parameters())
        errors = [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, expected)]
        result[backend] = {
            "first loss": errors[0],  # before any update: the forward's own rounding, not its growth over steps
            "loss": max(errors),
            "parameters": max(relative(final[n], p) for n, p in reference.named_parameters()),
        }
    return result


def gradients(name: str, device: torch.device) -> dict[str, Any]:
    """One step's gradients of each backend against eager's: the largest relative error of a parameter's
    gradient, which parameter, and its gradient's norm beside the largest gradient norm of the model
    (a tiny gradient's relative error is large for the same absolute rounding)."""
    module, loss_fn, batch = model(name, device)
    loss_fn(module, *batch).backward()
    expected = {n: p.grad.detach().clone() for n, p in module.named_parameters() if p.grad is not None}
    largest = max(float(g.norm()) for g in expected.values())
    result: dict[str, Any] = {}
    for backend in ("torch.compile", "aten", "inductor"):
        if backend == "torch.compile":  # inductor's own rounding, for scale
            twin = copy.deepcopy(module)
            loss_fn(torch.compile(twin), *batch).backward()
            grads = {n: p.grad for n, p in twin.named_parameters()}
        else:
            grads = tandem.compile(copy.deepcopy(module), loss_fn, *batch, backend=backend)(*batch).grads
        errors = {n: relative(grads[n], g) for n, g in expected.items()}
        worst = max(errors, key=errors.__getitem__)
        result[backend] = {"error": errors[worst], "parameter": worst,
                           "norm / largest norm": float(expected[worst].norm()) / largest,
                           "median error": sorted(errors.values())[len(errors) // 2]}  # fmt: skip
    return result


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # a step's kernels are queued, not done, when it returns


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (a smoke run of the script)"


def eager_peak(module: nn.Module, loss_fn: Callable[..., torch.Tensor], batch: tuple[Any, ...],
               device: torch.device) -> float:  # fmt: skip
    """The allocator's peak over one eager step, above what was live before it (as tandem reports)."""
    if device.type != "cuda":
        return float("nan")
    loss_fn(module, *batch).backward()  # warm-up: library workspaces and the allocator's pools settle
    module.zero_grad(set_to_none=True)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    loss_fn(module, *batch).backward()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    module.zero_grad(set_to_none=True)
    return peak


def timing(name: str, device: torch.device, repeats: int) -> dict[str, Any]:
    """Step times (ms) of every candidate; peaks (MiB) of eager and tandem off / memory-aware."""
    module, loss_fn, batch = model(name, device)

    def synchronised(step: Callable[[], Any]) -> Callable[[], None]:
        def run() -> None:
            step()
            synchronize(device)
        return run

    compiled = cast(nn.Module, torch.compile(copy.deepcopy(module)))
    eager_step(compiled, loss_fn, batch)  # compiles forward and backward
    candidates = {"eager": synchronised(lambda: eager_step(module, loss_fn, batch)),
                  "torch.compile": synchronised(lambda: eager_step(compiled, loss_fn, batch))}  # fmt: skip
    peaks = {"eager": eager_peak(module, loss_fn, batch, device) / MiB}
    for backend in ("aten", "inductor"):
        step = tandem.compile(module, loss_fn, *batch, backend=backend)
        step(*batch)
        candidates[f"tandem {backend}"] = synchronised(partial(step, *batch))
        if backend == "aten":
            aware = tandem.compile(module, loss_fn, *batch, mirror="memory-aware")
            aware(*batch)
            for policy, measured in (("off", step), ("memory-aware", aware)):
                report = measured.memory_report()
                allocator = report["allocator_peak_bytes"]  # None on a CPU
                peaks[f"tandem {policy}"] = float("nan") if allocator is None else allocator / MiB
                peaks[f"tandem {policy} meter"] = report["peak_bytes"] / MiB
    times = interleaved_medians(candidates, repeats=repeats)
    return {"ms": {label: seconds * 1e3 for label, seconds in times.items()}, "peak_mib": peaks}


def collective_child(device: torch.device, steps: int) -> None:
    """Under torchrun (one worker): collective p3 (NCCL on a GPU) against a plain Trainer, the gpt model."""
    module, loss_fn, batch = model("gpt", device)
    reference = copy.deepcopy(module)
    trainer = tandem.Trainer(module, loss_fn, optim.SGD(lr=LR, momentum=MOMENTUM), kvstore="collective",
                             communication="p3")  # fmt: skip
    store = type(trainer.kvstore).__name__
    losses = [trainer.step(*batch) for _ in range(steps)]
    trainer.close()
    plain = tandem.Trainer(reference, loss_fn, optim.SGD(lr=LR, momentum=MOMENTUM))
    expected = [plain.step(*batch) for _ in range(steps)]
    plain.close()
    final = dict(module.named_parameters())
    error = max(relative(final[n], p) for n, p in reference.named_parameters())
    print(json.dumps({"store": store, "losses": [losses[0], losses[-1]], "expected": [expected[0], expected[-1]],
                      "parameters": error}))  # fmt: skip


def collective(device: torch.device, steps: int) -> dict[str, Any]:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1", __file__, "--collective-child",
               "--steps", str(steps), "--device", str(device)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))})  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"torchrun exited {done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def guarded(what: str, work: Callable[[], Any]) -> Any:
    """One check's result, or its error printed (the other checks still run)."""
    try:
        result = work()
        print(f"{what}: {json.dumps(result)}", flush=True)
        return result
    except Exception:  # noqa: BLE001 - a device check reports every failure and goes on
        print(f"{what} FAILED:\n{traceback.format_exc()}", flush=True)
        return None


def report(device: torch.device, steps: int, checked: dict[str, Any], timed: dict[str, Any],
           collective_result: dict[str, Any] | None) -> str:  # fmt: skip
    runs = ("eager again", "aten", "inductor")
    rows = []
    for name, result in checked.items():
        cells = ["failed"] * 6 if result is None else [f"{result[r][k]:.1e}" for r in runs for k in ("loss", "parameters")]
        rows.append([name, *cells])
    numbers = markdown_table(["model", *(f"{r} {k}" for r in runs for k in ("loss", "parameters"))], rows)

    def verdict(result: dict[str, Any], backend: str) -> str:
        """Loss and parameters each: within RTOL, else against eager's own run-to-run spread."""
        judged = []
        for quantity in ("loss", "parameters"):
            error, spread = result[backend][quantity], result["eager again"][quantity]
            if error > RTOL:
                within = "within" if error <= spread else "BEYOND"
                judged.append(f"{quantity} {error:.1e}, {within} eager's own run-to-run spread ({spread:.1e})")
        return f"within {RTOL:g} of eager" if not judged else f"beyond {RTOL:g}: " + "; ".join(judged)

    verdicts = [f"- {name} {backend}: {verdict(result, backend)}"
                for name, result in checked.items() if result is not None for backend in ("aten", "inductor")]  # fmt: skip
    labels = ["torch.compile", "tandem aten", "tandem inductor"]
    time_rows, memory_rows = [], []
    for name, result in timed.items():
        if result is None:
            time_rows.append([name, "failed", *["" for _ in labels]])
            continue
        ms = result["ms"]
        time_rows.append([name, f"{ms['eager']:.2f}", *[f"{ms[label] / ms['eager']:.2f}x" for label in labels]])
        peaks = result["peak_mib"]
        memory_rows.append([name, *(f"{peaks[k]:.1f}" for k in MEMORY_COLUMNS)])
    times = markdown_table(["model", "eager ms", *[f"{label} / eager" for label in labels]], time_rows)
    memory = markdown_table(["model", *(f"{k} MiB" for k in MEMORY_COLUMNS)], memory_rows)
    first = "; ".join(f"{name} " + ", ".join(f"{r} {result[r]['first loss']:.1e}" for r in runs)
                      for name, result in checked.items() if result is not None)  # fmt: skip
    kernels = "deterministic kernels" if torch.backends.cudnn.deterministic else "default kernels"
    lines = [f"Device: {device_name(device)}, torch {torch.__version__}, float32, TF32 off, {kernels}.",
             f"Numerics: largest relative error over {steps} SGD steps against eager autograd "
             "(a loss: per step; a parameter: by norm).", numbers, "\n".join(verdicts),
             f"Relative error of the first step's loss (before any update): {first}",
             "Step time (forward + loss + backward, synchronised; medians of interleaved rounds):", times,
             "Peak device memory of one step (the allocator's, above what was live before it; 'meter': "
             "tandem's count of live intermediate storages):", memory]
    if collective_result is not None:
        lines.append(f"Collective p3 on NCCL (one worker, torchrun): store {collective_result['store']}, "
                     f"loss {collective_result['losses'][0]:.4f} -> {collective_result['losses'][-1]:.4f}, "
                     f"parameters vs a plain Trainer: relative error {collective_result['parameters']:.1e}")
    return "\n\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {MODELS}")
    parser.add_argument("--steps", type=int, default=10, help="training steps of the numerics check")
    parser.add_argument("--repeats", type=int, default=7, help="timed rounds (medians)")
    parser.add_argument("--device", default="cuda:0", help="a CUDA device ('cpu': a smoke run of the script)")
    parser.add_argument("--no-collective", action="store_true", help="skip the NCCL collective check")
    parser.add_argument("--deterministic", action="store_true",
                        help="deterministic cuDNN and cuBLAS kernels (eager's run-to-run spread becomes 0)")
    parser.add_argument("--gradients", action="store_true", help="also one step's gradients against eager's")
    parser.add_argument("--collective-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False  # eager and tandem must compute the same float32 sums
    torch.backends.cudnn.allow_tf32 = False
    if args.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS's deterministic mode needs it
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
        torch.use_deterministic_algorithms(True, warn_only=True)
    device = torch.device(args.device)
    if args.collective_child:
        collective_child(device, args.steps)
        return
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit(f"bench/gpu.py: torch sees no CUDA device (asked for {args.device!r}); --device cpu "
                             "checks the script")  # fmt: skip
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    names = args.models.split(",")
    checked = {name: guarded(f"numerics {name}", partial(numerics, name, device, args.steps)) for name in names}
    if args.gradients:
        for name in names:
            guarded(f"gradients {name}", partial(gradients, name, device))
    timed = {name: guarded(f"timing {name}", partial(timing, name, device, args.repeats)) for name in names}
    collective_result = None if args.no_collective else guarded("collective", lambda: collective(device, args.steps))
    text = report(device, args.steps, checked, timed, collective_result)
    print(text)
    write_report("gpu", text)
    done = {name: result["ms"] for name, result in timed.items() if result is not None}
    if done:
        labels = ["torch.compile", "tandem aten", "tandem inductor"]
        bar_plot("gpu", f"step time / eager on {device_name(device)}", list(done),
                 {label: [ms[label] / ms["eager"] for ms in done.values()] for label in labels}, "step time / eager")
    print(f"command: {command_line()}")


if __name__ == "__main__":
    main()
