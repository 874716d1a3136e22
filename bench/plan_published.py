"""The planner against published cluster results: P3's speedups on ResNet-50 and VGG-19 (issue #30).

The P3 paper (Jayarajan et al., SysML 2019) reports P3 over MXNet's parameter server at up to +25 %
on ResNet-50 and +66 % on VGG-19 "on clusters with realistic network bandwidth". Its artifact
(github.com/anandj91/p3, ``run_exp.sh``) trains with MXNet's ``train_imagenet.py``: one GPU per
machine, batch 32 per GPU, 224 x 224 images, ``--kv-store dist_device_sync``, started by MXNet's
``launch.py -n N``, which puts one worker and one server on each machine.

What this script does:
  - builds the real architectures (timm's ``resnet50`` and ``vgg19``, random weights, no download) and
    profiles one tandem step of each on this CPU (``tandem.planner.profile``, batch ``--profile-batch``,
    one thread): per-segment compute and which parameters each segment reads and finishes;
  - scales the segment times, all by one factor, to the GPU the paper used: the step's floating-point
    operations at batch 32 (counted by ``torch.utils.flop_counter`` on a real forward + backward)
    divided by the GPU's peak (an NVIDIA Quadro P4000, 5.3 TFLOP/s float32) times ``--efficiency``;
  - simulates ``--machines`` machines, each a worker and a colocated server (``Cluster(colocated=True)``),
    over a sweep of link rates: MXNet's plain store (whole tensors, each pushed as its gradient is
    ready: tandem's ``overlap``), the same after backward (``baseline``), and P3 as MXNet ran it
    (40,000-element slices, water mark 10);
  - prints predicted samples/s and the speedups, checks the issue's goals, and plots speedup vs bandwidth.

The paper's baseline is MXNet's default store, which already sends each gradient as backward produces
it, so "P3 over baseline" is ``p3 / overlap`` here; ``p3 / baseline`` is shown beside it.

Reproduce: python bench/plan_published.py   (--efficiency, --message-us, --machines, --rates, --no-bulk; about
9 minutes, most of it simulating; the first run also profiles both models, about 1 minute, cached in
bench/out/plan_published/)
Writes bench/out/plan_published.md and bench/out/plan_published.png.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from anywhere without installing

from bench.common import OUT, command_line, markdown_table, write_report  # noqa: E402

MODELS = {"ResNet-50": "resnet50", "VGG-19": "vgg19"}  # the paper's name -> timm's
PAPER_BEST = {"ResNet-50": 0.25, "VGG-19": 0.66}  # P3 over MXNet's parameter server, at best
WITHIN = 0.25  # the tolerance on the best figures (relative)
FLAT = 0.005  # speedups this close count as equal (a sweep's no-gain tail differs by rounding)
P4000_FLOPS = 5.3e12  # NVIDIA Quadro P4000, float32 peak
BATCH = 32  # per GPU, the artifact's default
RATES_GBIT = (1, 2, 4, 6, 8, 10, 15, 20, 25, 30)
COPY_BYTE_S = 0.1e-9  # CPU per byte sent or received: one copy at 10 GB/s (an assumption)
P3_SLICE, P3_WATER_MARK = 40_000, 10  # MXNet's P3: MXNET_KVSTORE_SLICE_THRESHOLD, launch.py --p3's water mark


def _build(timm_name: str) -> Any:
    from tandem.testing.torchvision_compat import ensure_importable

    ensure_importable()  # timm imports torchvision
    import timm
    import torch

    torch.manual_seed(0)
    return timm.create_model(timm_name, pretrained=False)


def _loss(module: Any, images: Any, labels: Any) -> Any:
    import torch.nn.functional as F

    return F.cross_entropy(module(images), labels)


def _batch(size: int) -> tuple[Any, Any]:
    import torch

    generator = torch.Generator().manual_seed(0)
    return torch.randn(size, 3, 224, 224, generator=generator), torch.randint(0, 1000, (size,), generator=generator)


def flops_per_sample(module: Any) -> float:
    """Floating-point operations of one sample's forward + backward (multiply-adds count 2)."""
    from torch.utils.flop_counter import FlopCounterMode

    images, labels = _batch(2)
    counter = FlopCounterMode(display=False)
    with counter:
        _loss(module, images, labels).backward()
    module.zero_grad(set_to_none=True)
    return counter.get_total_flops() / 2


def profiled(name: str, batch: int, out: Path, refresh: bool, bulk: bool = True) -> tuple[Any, float]:
    """The model's tandem profile at ``batch`` (``bulk``: tandem's segments; else one per op) and its
    flops per sample, cached in ``out``."""
    from tandem.planner.profile import Profile, profile

    suffix = "" if bulk else "_nobulk"
    path, flops_path = out / f"profile_{MODELS[name]}{suffix}.json", out / f"flops_{MODELS[name]}.json"
    if path.exists() and flops_path.exists() and not refresh:
        found = Profile.load(path)
        if found.batch_size == batch:
            return found, float(json.loads(flops_path.read_text())["flops_per_sample"])
    module = _build(MODELS[name])
    flops = flops_per_sample(module)
    start = time.perf_counter()
    print(f"{name}: profiling one step at batch {batch} on this CPU (one thread)...", flush=True)
    found = profile(module, _loss, _batch(batch), MODELS[name], runs=3, warmup=1, bulk=bulk)
    print(f"{name}: profiled in {time.perf_counter() - start:.0f} s: {found.compute_s:.2f} s per step, "
          f"{len(found.segments)} segments", flush=True)  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    found.save(path)
    flops_path.write_text(json.dumps({"flops_per_sample": flops}))
    return found, flops


def gpu_workload(found: Any, flops: float, efficiency: float) -> Any:
    """The profile's workload at batch 32 on the P4000: every segment scaled by one factor."""
    from tandem.planner.sim import Workload

    workload: Workload = found.workload()
    target = flops * BATCH / (P4000_FLOPS * efficiency)
    factor = target / workload.compute_s
    return dataclasses.replace(workload, forward_s=tuple(t * factor for t in workload.forward_s),
                               backward_s=tuple(t * factor for t in workload.backward_s), batch_size=BATCH)  # fmt: skip


def sweep(workload: Any, machines: int, machine: Any, rates: list[float]) -> dict[float, dict[str, float]]:
    """Predicted samples/s per link rate (Gbit/s) and mode."""
    from tandem.planner.sim import Cluster, Strategy, simulate

    strategies = {"baseline": Strategy("baseline"), "overlap": Strategy("overlap"),
                  "p3": Strategy("p3", slice_size=P3_SLICE, water_mark=P3_WATER_MARK)}  # fmt: skip
    found: dict[float, dict[str, float]] = {}
    for rate in rates:
        cluster = Cluster(machines, machines, rate * 1e9, colocated=True, machine=machine)
        found[rate] = {mode: simulate(workload, cluster, strategy).samples_per_s for mode, strategy in strategies.items()}
    return found


def _percent(change: float) -> str:
    return f"{round(change, 2) + 0.0:+.0%}"  # + 0.0: no "-0%" for a change that rounds to nothing


def plot(results: dict[str, dict[float, dict[str, float]]], path: Path, machines: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4))
    for (name, by_rate), color in zip(results.items(), ("tab:blue", "tab:orange")):
        rates = sorted(by_rate)
        axes.plot(rates, [100 * (by_rate[r]["p3"] / by_rate[r]["overlap"] - 1) for r in rates], "o-", color=color,
                  label=f"{name}: p3 over MXNet's store (predicted)")  # fmt: skip
        axes.axhline(100 * PAPER_BEST[name], color=color, linestyle="--", linewidth=0.8,
                     label=f"{name}: the paper's best (+{PAPER_BEST[name]:.0%})")  # fmt: skip
    axes.set_xlabel("link rate per machine, each way (Gbit/s)")
    axes.set_ylabel("P3 speedup (%)")
    axes.set_title(f"tandem plan: P3 on {machines} machines (worker + server each), P4000-scaled compute", fontsize=10)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--machines", type=int, default=4, help="machines, each running a worker and a server")
    parser.add_argument("--efficiency", type=float, default=0.5,
                        help="share of the P4000's float32 peak the GPU step reaches (an assumption)")
    parser.add_argument("--message-us", type=float, default=10.0,
                        help="CPU per message at either end, microseconds (MXNet's C++ ps-lite; an assumption)")
    parser.add_argument("--rates", type=float, nargs="+", default=list(RATES_GBIT), help="link rates, Gbit/s")
    parser.add_argument("--profile-batch", type=int, default=2, help="batch of the CPU profile (scaled to 32)")
    parser.add_argument("--reprofile", action="store_true", help="profile again instead of reading the cache")
    parser.add_argument("--no-bulk", action="store_true",
                        help="profile with one segment per op (tandem's bulking off: finer overlap) instead")
    args = parser.parse_args()
    if not 0 < args.efficiency <= 1:
        parser.error(f"--efficiency must lie in (0, 1], got {args.efficiency}")

    from tandem.planner.sim import Machine

    out = OUT / "plan_published"
    started = time.perf_counter()
    # per byte: one copy at 10 GB/s at either end (ZeroMQ, no authentication); the servers sum at Machine's rate;
    # a message's CPU the same however many requests it carries
    costs = Machine(message_s=args.message_us * 1e-6, byte_s=COPY_BYTE_S, server_message_s=args.message_us * 1e-6,
                    server_byte_s=COPY_BYTE_S, entry_s=0.0, server_entry_s=0.0)  # fmt: skip
    results: dict[str, dict[float, dict[str, float]]] = {}
    sensitivity: list[list[Any]] = []
    rows: list[list[Any]] = []
    lines: list[str] = []
    for name in MODELS:
        found, flops = profiled(name, args.profile_batch, out, args.reprofile, bulk=not args.no_bulk)
        workload = gpu_workload(found, flops, args.efficiency)
        results[name] = by_rate = sweep(workload, args.machines, costs, args.rates)
        print(f"{name}: {workload.total_bytes / 1e6:.0f} MB of parameters, {flops / 1e9:.1f} GFLOP per sample, "
              f"{workload.compute_s * 1e3:.0f} ms per step on the P4000 at {args.efficiency:.0%} of peak", flush=True)
        for rate in sorted(by_rate):
            modes = by_rate[rate]
            rows.append([name, f"{rate:g}", f"{modes['baseline']:.1f}", f"{modes['overlap']:.1f}", f"{modes['p3']:.1f}",
                         _percent(modes["p3"] / modes["overlap"] - 1), _percent(modes["p3"] / modes["baseline"] - 1)])  # fmt: skip
        best_rate = max(by_rate, key=lambda r: by_rate[r]["p3"] / by_rate[r]["overlap"])
        best = by_rate[best_rate]["p3"] / by_rate[best_rate]["overlap"] - 1
        met = abs(best / PAPER_BEST[name] - 1) <= WITHIN
        lines.append(f"- {name}: best predicted P3 speedup {best:+.0%} at {best_rate:g} Gbit/s, the paper's "
                     f"+{PAPER_BEST[name]:.0%}: {'met' if met else 'MISSED'} (within {WITHIN:.0%} of it)")  # fmt: skip
        for efficiency in sorted({0.3, args.efficiency, 0.7}):  # how much the assumptions move the best figure
            for message_us in sorted({0.0, args.message_us, Machine().single_message_s * 1e6}):
                machine = dataclasses.replace(costs, message_s=message_us * 1e-6, server_message_s=message_us * 1e-6)
                swept = by_rate if (efficiency, message_us) == (args.efficiency, args.message_us) else \
                    sweep(gpu_workload(found, flops, efficiency), args.machines, machine, args.rates)  # the main run's
                speedups = {r: m["p3"] / m["overlap"] - 1 for r, m in swept.items()}
                top = max(speedups, key=lambda r: speedups[r])
                sensitivity.append([name, f"{efficiency:.0%}", f"{message_us:g}", _percent(speedups[top]), f"{top:g}"])
    bests = {name: max(m["p3"] / m["overlap"] for m in by_rate.values()) for name, by_rate in results.items()}
    lines.append(f"- ordering: VGG-19 gains more than ResNet-50 at best: "
                 f"{'met' if bests['VGG-19'] > bests['ResNet-50'] else 'MISSED'}")  # fmt: skip
    for name, by_rate in results.items():
        rates = sorted(by_rate)
        speedups = [by_rate[r]["p3"] / by_rate[r]["overlap"] for r in rates]
        peak = speedups.index(max(speedups))
        grows = all(a >= b - FLAT for a, b in zip(speedups[peak:], speedups[peak + 1 :]))
        lines.append(f"- {name}: the gain grows as bandwidth falls from {rates[-1]:g} down to {rates[peak]:g} Gbit/s "
                     f"({'met' if grows else 'MISSED'}), below which it shrinks again"
                     if peak > 0 else f"- {name}: the gain grows as bandwidth falls over the whole sweep "
                     f"({'met' if grows else 'MISSED'})")  # fmt: skip
    image = OUT / "plan_published.png"
    plot(results, image, args.machines)
    text = (f"({time.strftime('%Y-%m-%d')}; {args.machines} machines, each a worker and a colocated server; batch "
            f"{BATCH} per GPU; compute scaled to a P4000 at {args.efficiency:.0%} of its {P4000_FLOPS / 1e12:.1f} "
            f"TFLOP/s; {args.message_us:g} us + {COPY_BYTE_S * 1e9:g} ns/B of CPU per message; ran {(time.perf_counter() - started) / 60:.1f} "
            f"minutes{'; one segment per op' if args.no_bulk else ''})\n\nPredicted samples/s (all machines) and P3's speedup over MXNet's store (overlap) and over "
            f"baseline:\n\n"
            + markdown_table(["model", "Gbit/s", "baseline", "overlap (MXNet's store)", "p3 (40k, wm 10)",
                              "p3 / overlap", "p3 / baseline"], rows)
            + "\n\nGoals (issue #30):\n\n" + "\n".join(lines)
            + "\n\nThe best speedup under other assumptions (GPU efficiency, CPU per message):\n\n"
            + markdown_table(["model", "efficiency", "us per message", "best p3 / overlap", "at Gbit/s"], sensitivity)
            + f"\n\n![P3 speedup vs bandwidth]({image.name})\n")  # fmt: skip
    path = write_report("plan_published", text)
    print(text)
    print(f"wrote {path} and {image} ({command_line()})")


if __name__ == "__main__":
    main()
