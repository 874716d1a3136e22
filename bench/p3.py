"""P3 vs overlap vs baseline vs DDP: training throughput over a real bandwidth-limited network.

Each process runs in its own network namespace (``tandem.netns``) whose NIC is shaped to
the link rate in both directions, as on a cluster; 2 workers and 2 servers, one torch thread each.
Modes (``Trainer(kvstore=..., communication=...)``):
- baseline: backward, then push every gradient, then pull every parameter (dist_sync);
- overlap:  each gradient is pushpulled the moment backward produces it (dist_sync);
- p3:       the same, sliced, by priority, with a cap on pushes in flight (dist_p3), at the
            defaults (40k-element slices, water mark 10);
- p3-auto:  p3 with ``slice_size="auto"``: the tuner picks slicing, water mark and send timing in
            the warm-up (``AUTO_WARMUP_STEPS``), before the timed runs;
- ddp:      torch DistributedDataParallel with gloo (2 processes, allreduce, no servers).
Per (model, rate) all modes run back to back; each job measures ``--runs`` runs of ``--steps``
steps (after a warm-up; each run primed by one untimed step, its final drain untimed: steady
state, see ``_timed_runs``) and reports the median samples/s. The ideal is
``global batch / max(compute time, model bytes / link rate)``: compute is the same step without
communication, run by each worker of the p3 job interleaved with its measured runs (same load);
``model bytes / link rate`` is the floor of a worker's communication (every byte leaves once and
arrives once on a full-duplex link).

Reproduce: .venv/bin/python bench/p3.py   (options: --models, --rates, --runs, --steps, --no-sweep)
Writes bench/out/p3.png, bench/out/p3.md and bench/out/p3_sweep.md. With ``--compression``: p3-auto
with and without gradient compression (``p3-auto+fp16``, ``p3-auto+2bit``) at ``--compression-rate``
instead, written to bench/out/p3_compression_<update>.md (``--update servers|workers``: where the
optimizer runs; on the workers the pulled sums travel compressed too). With ``--backends``: p3 with
the aten and the inductor segment backend side by side, written to bench/out/p3_backend.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from anywhere without installing

from bench.common import OUT, command_line, markdown_table, write_report  # noqa: E402

MODELS: dict[str, tuple[str, dict[str, Any], int]] = {  # name -> (zoo entry, config, batch per worker)
    "vgg": (
        "vgg",
        {"config": "vgg11", "width_multiplier": 0.25, "image_size": 32, "classifier_width": 512},
        32,
    ),
    "resnet": ("resnet", {"depth": 18, "width": 16, "small_input": True}, 32),
}
MODES = ("baseline", "overlap", "p3", "p3-auto")
KINDS = {"baseline": "dist_sync", "overlap": "dist_sync", "p3": "dist_p3", "p3-auto": "dist_p3"}
RATES = ("100mbit", "1gbit", "none")
WORKERS, SERVERS = 2, 2
WARMUP_STEPS = 3
AUTO_WARMUP_STEPS = 300  # enough for the tuner: 6 warm-up, then 10-17 points of >= 4 iterations and >= 0.5 s each
JOB_TIMEOUT = 300
MARK = "P3BENCH "


# ---- what each process runs --------------------------------------------------------------------


def _model(name: str) -> tuple[Any, Any, tuple[Any, ...], int]:
    import torch

    from tandem.models import ZOO

    entry_name, config, batch_size = MODELS[name]
    entry = ZOO[entry_name]
    torch.manual_seed(0)
    module = entry.build(**config)
    batch = entry.make_batch(batch_size, torch.Generator().manual_seed(1), **config)
    return module, entry.loss_fn, batch, batch_size


def _timed_runs(cases: dict[str, tuple[Any, Any]], runs: int, steps: int) -> dict[str, list[float]]:
    """Steady-state seconds per step of each run of each case, cases interleaved run by run.

    A case is ``(step, finish)``; ``finish`` waits for outstanding communication. With overlap and
    P3 a step returns while its gradients are still on the wire (the next forward waits for each
    layer's parameters), so a run primes the pipeline with one untimed step, then times ``steps``
    steps from that step's return to the last one's: one step of communication is in flight at
    both ends of the window, as in the middle of a long training run. The drain (``finish``)
    after the window is not timed: a long run pays it once, not every few steps.
    """
    for step, finish in cases.values():
        for _ in range(int(os.environ.get("P3BENCH_WARMUP", WARMUP_STEPS))):
            step()
        finish()
    seconds: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(runs):
        for name, (step, finish) in cases.items():
            step()  # prime: the parameters of the first timed step are on the wire, as in steady state
            start = time.perf_counter()
            for _ in range(steps):
                step()
            seconds[name].append((time.perf_counter() - start) / steps)
            finish()  # drain before the next case runs, so that cases do not overlap
    return seconds


def _report(**fields: Any) -> None:
    print(MARK + json.dumps(fields), flush=True)


def tandem_job(model: str, mode: str, runs: int, steps: int) -> None:
    """A process of a `tandem launch` job: servers serve (kvstore.serve); workers train and report."""
    import torch

    import tandem.optim
    from tandem import kvstore
    from tandem.trainer import Trainer

    base, _, compression = mode.partition("+")  # "p3-auto+2bit": p3-auto with 2-bit gradient compression
    if kvstore.is_server():
        sys.exit(kvstore.serve(KINDS[base]))
    torch.set_num_threads(1)
    module, loss_fn, batch, _ = _model(model)
    trainer = Trainer(module, loss_fn, tandem.optim.SGD(lr=0.01, momentum=0.9), kvstore=KINDS[base],
                      communication=base.removesuffix("-auto"), gradient_compression=compression or None,
                      update_on_kvstore=os.environ.get("P3BENCH_UPDATE", "servers") == "servers",
                      progress=False)  # fmt: skip
    # the same step without communication, interleaved: compute time under the same load, side by side
    local_module, *_ = _model(model)
    local = Trainer(local_module, loss_fn, tandem.optim.SGD(lr=0.01, momentum=0.9), progress=False)
    seconds = _timed_runs({"seconds": (lambda: trainer.step(*batch), trainer.sync),
                           "compute": (lambda: local.step(*batch), lambda: None)}, runs, steps)  # fmt: skip
    store = trainer.kvstore
    tuner = getattr(store, "tuner", None)
    extra = {"tuned": tuner.result, "history": tuner.history} if tuner is not None and tuner.result else {}
    _report(rank=store.rank, parameters=sum(p.numel() for p in module.parameters()), **seconds, **extra)
    trainer.close()


def ddp_job(model: str, rank: int, master: str, port: int, runs: int, steps: int) -> None:
    """One of two DistributedDataParallel processes (gloo allreduce of gradients, torch.optim.SGD)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{master}:{port}", rank=rank, world_size=WORKERS)
    module, loss_fn, batch, _ = _model(model)
    wrapped = torch.nn.parallel.DistributedDataParallel(module)
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.01, momentum=0.9)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        loss_fn(wrapped, *batch).backward()
        optimizer.step()

    _report(rank=rank, **_timed_runs({"seconds": (step, lambda: None)}, runs, steps))
    dist.barrier()  # neither rank tears its connections down while the other still uses them
    dist.destroy_process_group()


# ---- the driver --------------------------------------------------------------------------------


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "TANDEM_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", **extra}


def _results(output: str) -> list[dict[str, Any]]:
    return [json.loads(line.split(MARK, 1)[1]) for line in output.splitlines() if MARK in line]


def _step_seconds(reports: list[dict[str, Any]], what: str, output: str, field: str = "seconds") -> float:
    """Median over runs of the slowest worker's step time (a sync step ends when the last worker's does)."""
    if not reports:
        raise RuntimeError(f"{what} reported nothing; its output:\n{output[-4000:]}")
    return statistics.median(max(values) for values in zip(*(report[field] for report in reports)))


def run_tandem(
    model: str, mode: str, rate: str, runs: int, steps: int, env: dict[str, str]
) -> dict[str, Any]:
    """Step seconds of ``mode`` and of its interleaved local compute, the parameter count, the tuner's result."""
    shaping = [] if rate == "none" else ["--netns-rate", rate]
    command = [sys.executable, "-m", "tandem.launch", "-n", str(WORKERS), "-s", str(SERVERS), *shaping,
               *[f"--env={name}={value}" for name, value in env.items()], "--",
               sys.executable, str(Path(__file__).resolve()), "--job", model, mode, str(runs), str(steps)]  # fmt: skip
    result = subprocess.run(
        command, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=JOB_TIMEOUT
    )
    output = result.stdout + result.stderr
    if result.returncode != 0:
        raise RuntimeError(f"{mode} job on {model} at {rate} failed ({result.returncode}):\n{output[-4000:]}")
    reports, what = _results(output), f"{mode} on {model} at {rate}"
    return {"seconds": _step_seconds(reports, what, output), "compute": _step_seconds(reports, what, output, "compute"),
            "parameters": reports[0]["parameters"], "tuned": reports[0].get("tuned")}  # fmt: skip


def run_ddp(model: str, rate: str, runs: int, steps: int) -> float:
    from tandem import netns

    with netns.Network(num_hosts=WORKERS, rate=None if rate == "none" else rate) as net:
        master, port = net.hosts[0].address, 29_731
        gloo = {"GLOO_SOCKET_IFNAME": "eth0"} if net.isolated else {}
        processes = [subprocess.Popen(host.command([sys.executable, str(Path(__file__).resolve()), "--ddp", model,
                                                    str(rank), master, str(port), str(runs), str(steps)]),
                                      cwd=ROOT, env=_env(**gloo), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True)
                     for rank, host in enumerate(net.hosts)]  # fmt: skip
        outputs = [process.communicate(timeout=JOB_TIMEOUT)[0] for process in processes]
    output = "\n".join(outputs)
    reports = _results(output)
    if any(process.returncode for process in processes):
        if len(reports) < WORKERS:
            raise RuntimeError(f"ddp on {model} at {rate} failed:\n{output[-4000:]}")
        # every rank measured and reported: a crash after that is gloo's teardown (seen once in a
        # namespace: "terminate called without an active exception"), not part of the measurement
        print(f"warning: ddp on {model} at {rate} exited nonzero after reporting; its output ends:\n"
              f"{output[-1500:]}", file=sys.stderr)  # fmt: skip
    return _step_seconds(reports, f"ddp on {model} at {rate}", output)


def _mode_env(mode: str) -> dict[str, str]:
    """p3-auto: slice size 0 (tune it), and a warm-up long enough for the tuner to settle before timing."""
    auto = {"TANDEM_KVSTORE_SLICE_THRESHOLD": "0", "P3BENCH_WARMUP": str(AUTO_WARMUP_STEPS)}
    return auto if mode.partition("+")[0] == "p3-auto" else {}


def _chose(tuned: list[Any] | None) -> str:
    """The tuner's result as the tables show it: slice size, water mark, send timing."""
    return "not settled" if tuned is None else f"{tuned[0] // 1000}k, {tuned[1]}, {tuned[2]}"


def _rate_bits(rate: str) -> float | None:
    from tandem.netns import parse_rate

    return None if rate == "none" else float(parse_rate(rate))


def main_bench(args: argparse.Namespace) -> None:
    from tqdm import tqdm

    from tandem import netns

    available, reason = netns.available()
    if not available:
        print(f"warning: {reason}; every rate runs unshaped on loopback", file=sys.stderr)
    rows, throughput = [], {}
    jobs = [(model, rate) for model in args.models for rate in args.rates]
    bar = tqdm(total=len(jobs) * (len(MODES) + 1), desc="p3 bench")
    for model, rate in jobs:
        batch = MODELS[model][2] * WORKERS
        seconds, measured = {}, {}
        for mode in MODES:
            bar.set_postfix_str(f"{model} {rate} {mode}")
            measured[mode] = run_tandem(model, mode, rate, args.runs, args.steps, _mode_env(mode))
            seconds[mode] = measured[mode]["seconds"]
            bar.update()
        bar.set_postfix_str(f"{model} {rate} ddp")
        seconds["ddp"] = run_ddp(model, rate, args.runs, args.steps)
        bar.update()
        bits = _rate_bits(rate)
        wire = 0.0 if bits is None else measured["p3"]["parameters"] * 4 * 8 / bits
        compute = measured["p3"]["compute"]  # measured in the p3 job itself, interleaved with its runs
        ideal = batch / max(compute, wire)
        speed = {mode: batch / value for mode, value in seconds.items()}
        throughput[(model, rate)] = speed
        # the machine is shared: also compare steps in units of each job's own compute time
        relative = {mode: measured[mode]["seconds"] / measured[mode]["compute"] for mode in MODES}
        tuned = measured["p3-auto"]["tuned"]
        rows.append([model, rate, *(speed[mode] for mode in (*MODES, "ddp")),
                     *(speed[mode] / speed["baseline"] for mode in MODES[1:]),
                     *(relative["baseline"] / relative[mode] for mode in MODES[1:]),
                     ideal, speed["p3"] / ideal, speed["p3-auto"] / ideal, f"{compute * 1e3:.0f} / {wire * 1e3:.0f}",
                     _chose(tuned)])  # fmt: skip
    bar.close()
    headers = ["model", "link", *MODES, "ddp (gloo)", *(f"{mode}/baseline" for mode in MODES[1:]),
               *(f"{mode}/baseline (per compute)" for mode in MODES[1:]), "ideal", "p3/ideal", "p3-auto/ideal",
               "compute / wire ms", "p3-auto chose"]  # fmt: skip
    table = markdown_table(headers, rows)
    note = (f"samples/s (global batch {WORKERS} x per-worker batch), {WORKERS} workers + {SERVERS} servers, "
            f"median of {args.runs} runs x {args.steps} steps; ideal = batch / max(compute, model bytes / rate); "
            "'per compute': ratios of step time / compute time measured in the same job (load-normalised)")  # fmt: skip
    report = write_report("p3", f"{note}\n\n{table}")
    _plot(throughput, args)
    print(f"\n{note}\n{table}\n\nwritten {report} and {OUT / 'p3.png'}\nreproduce: {command_line()}")
    if args.sweep:
        sweep(args)


def sweep(args: argparse.Namespace) -> None:
    """P3 alone at one (model, rate): slice size at the default water mark, water mark at the default slice."""
    model, rate = args.sweep_model, args.sweep_rate
    points = [(size, 10) for size in (10_000, 40_000, 160_000)] + [(40_000, mark) for mark in (1, 4, 40)]
    points.append((0, 10))  # auto
    rows = []
    for size, mark in points:
        env = {"TANDEM_KVSTORE_SLICE_THRESHOLD": str(size), "TANDEM_PS_WATER_MARK": str(mark)}
        measured = run_tandem(model, "p3", rate, args.runs, args.steps, {**env, **_mode_env("p3-auto" if size == 0 else "p3")})
        label = "auto" + (f" -> {tuple(measured['tuned'])}" if measured["tuned"] else " (not settled)")
        rows.append([label if size == 0 else size, mark, MODELS[model][2] * WORKERS / measured["seconds"]])
    table = markdown_table(["slice size", "water mark", "samples/s"], rows)
    report = write_report(
        "p3_sweep", f"p3 on {model} at {rate}, median of {args.runs} runs x {args.steps} steps\n\n{table}"
    )
    print(f"\n{table}\n\nwritten {report}\nreproduce: {command_line()}")


COMPRESSED_MODES = ("p3-auto", "p3-auto+fp16", "p3-auto+2bit")


def compression_table(args: argparse.Namespace) -> None:
    """p3-auto with and without gradient compression at one link rate, side by side per model."""
    from tandem.kvstore.compression import GradientCompression

    rate, rows, update = args.compression_rate, [], {"P3BENCH_UPDATE": args.update}
    bits = _rate_bits(rate)
    for model in args.models:
        batch, measured = MODELS[model][2] * WORKERS, {}
        for mode in COMPRESSED_MODES:
            measured[mode] = run_tandem(model, mode, rate, args.runs, args.steps, {**_mode_env(mode), **update})
        parameters = measured["p3-auto"]["parameters"]
        wire = 0.0 if bits is None else parameters * 4 * 8 / bits  # the uncompressed floor, for every row
        ideal = batch / max(measured["p3-auto"]["compute"], wire)
        for mode in COMPRESSED_MODES:
            speed, ratio = batch / measured[mode]["seconds"], GradientCompression.parse(mode.partition("+")[2] or None).ratio
            tuned, pulled = measured[mode]["tuned"], parameters * 4 / (ratio if args.update == "workers" else 1)
            rows.append([model, rate, mode, f"{parameters * 4 / ratio / 1e6:.2f} / {pulled / 1e6:.2f}", speed,
                         speed * measured["p3-auto"]["seconds"] / batch, speed / ideal,
                         _chose(tuned)])  # fmt: skip
    table = markdown_table(["model", "link", "mode", "MB pushed / pulled per step", "samples/s", "vs p3-auto",
                            "of ideal", "tuner chose"], rows)  # fmt: skip
    note = (f"samples/s, {WORKERS} workers + {SERVERS} servers, updates on the {args.update}, median of {args.runs} "
            f"runs x {args.steps} steps, all modes of a model back to back; ideal = batch / max(compute, model bytes / "
            "rate), uncompressed")  # fmt: skip
    report = write_report(f"p3_compression_{args.update}", f"{note}\n\n{table}")
    print(f"\n{note}\n{table}\n\nwritten {report}\nreproduce: {command_line()}")


BACKENDS = ("aten", "inductor")


def backend_table(args: argparse.Namespace) -> None:
    """p3 with each segment backend, side by side per model and link rate: compiled segments must not
    cost overlap (samples/s should move with the compute time, never below aten's at a shaped link)."""
    rows = []
    for model in args.models:
        batch = MODELS[model][2] * WORKERS
        for rate in args.rates:
            measured = {backend: run_tandem(model, "p3", rate, args.runs, args.steps, {"TANDEM_BACKEND": backend})
                        for backend in BACKENDS}  # fmt: skip
            aten, inductor = measured["aten"], measured["inductor"]
            rows.append([model, rate, batch / aten["seconds"], batch / inductor["seconds"],
                         aten["seconds"] / inductor["seconds"], aten["compute"] * 1e3, inductor["compute"] * 1e3])
            print(rows[-1], flush=True)
    table = markdown_table(["model", "link", "aten samples/s", "inductor samples/s", "inductor / aten",
                            "aten compute ms", "inductor compute ms"], rows)  # fmt: skip
    note = (f"p3 (dist_p3, 40k-element slices, water mark 10), {WORKERS} workers + {SERVERS} servers, one torch "
            f"thread each, median of {args.runs} runs x {args.steps} steps; compute: the same step without "
            "communication, interleaved with the measured runs")  # fmt: skip
    report = write_report("p3_backend", f"{note}\n\n{table}")
    print(f"\n{note}\n{table}\n\nwritten {report}\nreproduce: {command_line()}")


def _plot(throughput: dict[tuple[str, str], dict[str, float]], args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(args.models), figsize=(5 * len(args.models), 4), squeeze=False)
    for axis, model in zip(axes[0], args.models):
        for mode in (*MODES, "ddp"):
            axis.plot(
                args.rates, [throughput[(model, rate)][mode] for rate in args.rates], marker="o", label=mode
            )
        axis.set_title(f"{model}: {WORKERS} workers, {SERVERS} servers")
        axis.set_xlabel("link rate per host")
        axis.set_ylabel("samples/s")
        axis.legend()
    figure.tight_layout()
    OUT.mkdir(parents=True, exist_ok=True)
    figure.savefig(OUT / "p3.png", dpi=120)
    plt.close(figure)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] in ("--job", "--ddp"):
        rest = sys.argv[2:]
        if sys.argv[1] == "--job":
            tandem_job(rest[0], rest[1], int(rest[2]), int(rest[3]))
        else:
            ddp_job(rest[0], int(rest[1]), rest[2], int(rest[3]), int(rest[4]), int(rest[5]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--rates", nargs="+", default=list(RATES), help="tc rates, or 'none' for unshaped")
    parser.add_argument("--runs", type=int, default=5, help="runs per job (median; >= 5)")
    parser.add_argument("--steps", type=int, default=4, help="steps per run")
    parser.add_argument(
        "--no-sweep", dest="sweep", action="store_false", help="skip the slice/water-mark sweep"
    )
    parser.add_argument("--sweep-model", default="vgg", choices=list(MODELS))
    parser.add_argument("--sweep-rate", default="100mbit")
    parser.add_argument("--compression", action="store_true",
                        help="instead of the main table: p3-auto with fp16 and 2bit gradient compression")
    parser.add_argument("--compression-rate", default="100mbit")
    parser.add_argument("--update", default="servers", choices=["servers", "workers"],
                        help="--compression: where the optimizer runs (workers: pulls carry sums, compressed too)")
    parser.add_argument("--backends", action="store_true",
                        help="instead of the main table: p3 with the aten and the inductor segment backend")
    args = parser.parse_args()
    if args.runs < 5:
        parser.error("--runs must be >= 5 (medians of at least 5 runs)")
    if args.compression:
        compression_table(args)
        return
    if args.backends:
        backend_table(args)
        return
    main_bench(args)


if __name__ == "__main__":
    main()
