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
- collective-overlap, collective-p3: ``kvstore="collective"`` (workers only, launched with ``-s 0``):
            all-reduce over gloo, slices in production order, or by priority (P3), at the defaults;
- collective-p3-auto: collective-p3 with ``slice_size="auto"`` (the tuner, as in p3-auto);
- ddp:      torch DistributedDataParallel with gloo (2 processes, allreduce, no servers);
- ddp+fp16, ddp+powersgd: DDP with its communication hooks (``fp16_compress_hook``;
            ``powerSGD_hook``, rank ``POWERSGD_RANK``, vanilla all-reduce for the first
            ``POWERSGD_START`` steps, which fall in the untimed warm-up).
``--modes`` picks a subset. The goals of issue #29 are printed as met / missed under the table.
Per (model, rate) all modes run back to back; each job measures ``--runs`` runs of ``--steps``
steps (after a warm-up; each run primed by one untimed step, its final drain untimed: steady
state, see ``_timed_runs``) and reports the median samples/s. The ideal is
``global batch / max(compute time, model bytes / link rate)``: compute is the same step without
communication, run by each worker of the p3 job interleaved with its measured runs (same load);
``model bytes / link rate`` is the floor of a worker's communication (every byte leaves once and
arrives once on a full-duplex link).

Reproduce: .venv/bin/python bench/p3.py   (options: --models, --rates, --modes, --runs, --steps, --repeats,
--no-sweep)
Writes bench/out/p3.png, bench/out/p3.md and bench/out/p3_sweep.md. With ``--compression``: p3-auto
with and without gradient compression (``p3-auto+fp16``, ``p3-auto+2bit``) at ``--compression-rate``
instead, written to bench/out/p3_compression_<update>.md (``--update servers|workers``: where the
optimizer runs; on the workers the pulled sums travel compressed too). With ``--backends``: p3 with
the aten and the inductor segment backend side by side, written to bench/out/p3_backend.md.
Any mode of the main table may carry ``@inductor`` (``collective-p3-auto@inductor``, ``ddp@inductor``):
tandem's modes then run the inductor segment backend and DDP's ``torch.compile(DDP(model))``, their
compute columns compiled too; against "ddp" the table and the goals take the faster plain DDP.
``--repeats N`` runs every job of a row N times, the modes taking turns, and reports medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
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
MODES = ("baseline", "overlap", "p3", "p3-auto", "collective-overlap", "collective-p3", "collective-p3-auto")
DDP_MODES = ("ddp", "ddp+fp16", "ddp+powersgd")
DDP_HOOKS = ("fp16", "bf16", "powersgd")  # what ddp_wrap registers after "ddp+"
KINDS = {"baseline": "dist_sync", "overlap": "dist_sync", "p3": "dist_p3", "p3-auto": "dist_p3",
         "collective-baseline": "collective", "collective-overlap": "collective", "collective-p3": "collective",
         "collective-p3-auto": "collective"}  # fmt: skip
POWERSGD_RANK, POWERSGD_START = 2, 2  # PowerSGD's rank, and the vanilla all-reduce steps before it compresses
BACKENDS = ("aten", "inductor")  # a mode's "@inductor": compiled segments (tandem), torch.compile (DDP)
RATES = ("100mbit", "1gbit", "none")
WORKERS, SERVERS = 2, 2
WARMUP_STEPS = 3
RATIO_MODES = ("collective-p3", "collective-p3-auto", "p3", "p3-auto")  # the table's ratio columns
AUTO_MODES = ("p3-auto", "collective-p3-auto")  # tuned: the table says what the tuner chose
AUTO_WARMUP_STEPS = 300  # enough for the tuner: 6 warm-up, then 10-17 points of >= 4 iterations and >= 0.5 s each
JOB_TIMEOUT = 300
COMPILED_JOB_TIMEOUT = 900  # both workers compile their step (and its compute twin) side by side on 2 cores
MARK = "P3BENCH "


# ---- what each process runs --------------------------------------------------------------------


def split_mode(mode: str, default: str = "aten") -> tuple[str, str]:
    """``"collective-p3-auto@inductor"`` -> ``("collective-p3-auto", "inductor")``; no suffix: ``default``
    (aten: DDP eager)."""
    base, at, backend = mode.partition("@")
    return base, backend if at else default


def mode_argument(text: str) -> str:
    """argparse's check of a mode: one of MODES or DDP_MODES, with an optional ``@<backend>``."""
    base, backend = split_mode(text)
    if base not in (*MODES, *DDP_MODES) or backend not in BACKENDS:
        raise argparse.ArgumentTypeError(f"unknown mode {text!r}: one of {', '.join((*MODES, *DDP_MODES))}, "
                                         f"optionally with @{'/@'.join(BACKENDS)}")  # fmt: skip
    return base if backend == "aten" else text  # "p3@aten" is "p3"


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


def communication(mode: str) -> str:
    """The Trainer's ``communication`` of a mode without its compression: "collective-p3" -> "p3"."""
    return mode.removeprefix("collective-").removesuffix("-auto")


def servers(mode: str) -> int:
    """Server processes of a mode's job: none for the collective kvstore."""
    return 0 if KINDS[mode.partition("+")[0]] == "collective" else SERVERS


def ddp_wrap(module: Any, hook: str, backend: str = "aten") -> Any:
    """``module`` in DistributedDataParallel (default process group) with the communication hook
    ``hook``: "" (plain all-reduce), "fp16", "bf16" or "powersgd" (PowerSGDState(process_group=None,
    matrix_approximation_rank=POWERSGD_RANK, start_powerSGD_iter=POWERSGD_START), error feedback on);
    ``backend`` "inductor": under torch.compile as well."""
    import torch
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    # PowerSGD chains all-reduces in future callbacks: with two buckets (DDP's default 1 MB first
    # bucket) those of one bucket and the next bucket's race to gloo in a different order on each rank
    # ("Received data size doesn't match expected size"); bucket_cap_mb given explicitly drops the
    # small first bucket, so these models (< 25 MB) are one bucket
    wrapped = torch.nn.parallel.DistributedDataParallel(module, bucket_cap_mb=25.0 if hook == "powersgd" else None)
    if hook in ("fp16", "bf16"):
        wrapped.register_comm_hook(None, getattr(default_hooks, f"{hook}_compress_hook"))
    elif hook == "powersgd":
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=POWERSGD_RANK,
                                            start_powerSGD_iter=POWERSGD_START)  # fmt: skip
        wrapped.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    elif hook:
        raise ValueError(f"unknown DDP hook {hook!r}: fp16, bf16 or powersgd")
    # PyTorch's order for compiled DDP: wrap, then compile; dynamo's DDPOptimizer splits the graph at
    # bucket boundaries so that each bucket's all-reduce still starts during backward
    return torch.compile(wrapped) if backend == "inductor" else wrapped


def eager_step(module: Any, loss_fn: Callable[..., Any], batch: tuple[Any, ...], optimizer: Any) -> Callable[[], None]:
    """One training step of ``module`` with a torch optimizer: zero_grad, loss, backward, step."""

    def run() -> None:
        optimizer.zero_grad(set_to_none=True)
        loss_fn(module, *batch).backward()
        optimizer.step()

    return run


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
                      communication=communication(base), gradient_compression=compression or None,
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


def ddp_job(model: str, mode: str, backend: str, rank: int, master: str, port: int, runs: int, steps: int) -> None:
    """One of two DistributedDataParallel processes (gloo allreduce of gradients, torch.optim.SGD),
    with the communication hook of ``mode`` ("ddp+fp16": fp16_compress_hook, "ddp+powersgd"), under
    torch.compile where ``backend`` is "inductor" (its compute too)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{master}:{port}", rank=rank, world_size=WORKERS)
    module, loss_fn, batch, _ = _model(model)
    wrapped = ddp_wrap(module, mode.partition("+")[2], backend)
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.01, momentum=0.9)
    local, *_ = _model(model)  # the same step without communication, interleaved (as in tandem_job)
    local_optimizer = torch.optim.SGD(local.parameters(), lr=0.01, momentum=0.9)
    if backend == "inductor":
        local = torch.compile(local)
    _report(rank=rank, **_timed_runs({"seconds": (eager_step(wrapped, loss_fn, batch, optimizer), lambda: None),
                                      "compute": (eager_step(local, loss_fn, batch, local_optimizer), lambda: None)},
                                     runs, steps))  # fmt: skip
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


def _timeout(backend: str) -> int:
    return COMPILED_JOB_TIMEOUT if backend == "inductor" else JOB_TIMEOUT


def run_tandem(model: str, mode: str, rate: str, runs: int, steps: int, env: dict[str, str],
               launch_args: tuple[str, ...] = ()) -> dict[str, Any]:  # fmt: skip
    """Step seconds of ``mode`` and of its interleaved local compute, the parameter count, the tuner's result
    (``launch_args``: more options of `tandem launch`)."""
    shaping = [] if rate == "none" else ["--netns-rate", rate]
    command = [sys.executable, "-m", "tandem.launch", "-n", str(WORKERS), "-s", str(servers(mode)), *shaping, *launch_args,
               *[f"--env={name}={value}" for name, value in env.items()], "--",
               sys.executable, str(Path(__file__).resolve()), "--job", model, mode, str(runs), str(steps)]  # fmt: skip
    result = subprocess.run(
        command, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=_timeout(env.get("TANDEM_BACKEND", "aten"))
    )
    output = result.stdout + result.stderr
    if result.returncode != 0:
        raise RuntimeError(f"{mode} job on {model} at {rate} failed ({result.returncode}):\n{output[-4000:]}")
    reports, what = _results(output), f"{mode} on {model} at {rate}"
    return {"seconds": _step_seconds(reports, what, output), "compute": _step_seconds(reports, what, output, "compute"),
            "parameters": reports[0]["parameters"], "tuned": reports[0].get("tuned")}  # fmt: skip


def run_ddp(model: str, mode: str, rate: str, runs: int, steps: int, backend: str = "aten") -> dict[str, float]:
    """Step seconds of the DDP ``mode`` and of its interleaved local compute (``backend`` "inductor":
    under torch.compile)."""
    from tandem import netns

    with netns.Network(num_hosts=WORKERS, rate=None if rate == "none" else rate) as net:
        master, port = net.hosts[0].address, 29_731
        gloo = {"GLOO_SOCKET_IFNAME": "eth0"} if net.isolated else {}
        processes = [subprocess.Popen(host.command([sys.executable, str(Path(__file__).resolve()), "--ddp", model,
                                                    mode, backend, str(rank), master, str(port), str(runs),
                                                    str(steps)]),
                                      cwd=ROOT, env=_env(**gloo), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True)
                     for rank, host in enumerate(net.hosts)]  # fmt: skip
        outputs = [process.communicate(timeout=_timeout(backend))[0] for process in processes]
    output = "\n".join(outputs)
    reports = _results(output)
    if any(process.returncode for process in processes):
        if len(reports) < WORKERS:
            raise RuntimeError(f"{mode} on {model} at {rate} failed:\n{output[-4000:]}")
        # every rank measured and reported: a crash after that is gloo's teardown (seen once in a
        # namespace: "terminate called without an active exception"), not part of the measurement
        print(f"warning: {mode} on {model} at {rate} exited nonzero after reporting; its output ends:\n"
              f"{output[-1500:]}", file=sys.stderr)  # fmt: skip
    what = f"{mode} on {model} at {rate}"
    return {"seconds": _step_seconds(reports, what, output), "compute": _step_seconds(reports, what, output, "compute")}


def run_mode(model: str, mode: str, rate: str, runs: int, steps: int, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Any mode: a `tandem launch` job, or DDP (with its hook) in as many namespaces as workers; "@inductor":
    tandem's inductor segment backend, DDP under torch.compile. A mode without it runs aten (DDP: eager) whatever
    TANDEM_BACKEND says."""
    base, backend = split_mode(mode)
    if base.partition("+")[0] == "ddp":
        return run_ddp(model, base, rate, runs, steps, backend)
    return run_tandem(model, base, rate, runs, steps, {**_mode_env(base), "TANDEM_BACKEND": backend, **(env or {})})


def _mode_env(mode: str) -> dict[str, str]:
    """p3-auto, collective-p3-auto: slice size 0 (tune it), and a warm-up long enough for the tuner to settle."""
    auto = {"TANDEM_KVSTORE_SLICE_THRESHOLD": "0", "P3BENCH_WARMUP": str(AUTO_WARMUP_STEPS)}
    return auto if mode.partition("+")[0] in AUTO_MODES else {}


def _chose(tuned: list[Any] | None) -> str:
    """The tuner's result as the tables show it: slice size, water mark, send timing."""
    return "not settled" if tuned is None else f"{tuned[0] // 1000}k, {tuned[1]}, {tuned[2]}"


def _rate_bits(rate: str) -> float | None:
    from tandem.netns import parse_rate

    return None if rate == "none" else float(parse_rate(rate))


COMPARABLE = 2.0  # communication and compute are "comparable" within this factor of each other


def goals(measured: dict[tuple[str, str], dict[str, dict[str, Any]]], batch: dict[str, int]) -> list[str]:
    """Issue #29's throughput goals, each line "met" or "missed" with its numbers.

    collective p3 (the best of collective-p3 and collective-p3-auto, either backend) >= 1.0x DDP at every (model,
    rate), >= 1.15x where wire and compute time are within COMPARABLE of each other; parameter-server p3 (the best
    of p3 and p3-auto, either backend) >= 75% of its backend's ideal at 1 Gbit/s and >= 1.0x DDP at 100 Mbit/s. DDP
    is plain DDP (uncompressed, like the modes it is compared with), the faster of eager and compiled where both ran.
    """
    lines = []
    for (model, rate), modes in measured.items():
        speed = {mode: batch[model] / value["seconds"] for mode, value in modes.items() if mode != "_ideal"}
        ideals, computes, wire = modes["_ideal"]["value"], modes["_ideal"]["compute"], modes["_ideal"]["wire"]
        compute = computes.get("aten", next(iter(computes.values())))  # "comm ~ compute": the uncompiled step's
        plain_ddp_mode = _plain_ddp(speed)
        if plain_ddp_mode is None:
            continue
        ddp = speed[plain_ddp_mode]
        collective = {mode: speed[mode] for mode in speed if split_mode(mode)[0] in ("collective-p3", "collective-p3-auto")}
        if collective:
            best = max(collective, key=collective.__getitem__)
            ratio = collective[best] / ddp
            comparable = wire > 0 and 1 / COMPARABLE <= wire / compute <= COMPARABLE
            target = 1.15 if comparable else 1.0
            lines.append(f"{'met' if ratio >= target else 'MISSED'}: collective p3 >= {target}x ddp on {model} at "
                         f"{rate}{' (comm ~ compute)' if comparable else ''}: {best} {ratio:.2f}x "
                         f"({collective[best]:.0f} vs {plain_ddp_mode}'s {ddp:.0f} samples/s)")  # fmt: skip
        ps = {mode: speed[mode] for mode in speed if split_mode(mode)[0] in ("p3", "p3-auto")}
        if ps:
            best_ps = max(ps, key=ps.__getitem__)
            if _rate_bits(rate) == 1e9:  # each mode against the ideal of its own backend's compute
                share_of = {mode: value / ideals[split_mode(mode)[1]] for mode, value in ps.items()}
                best_share = max(share_of, key=share_of.__getitem__)
                share, ideal = share_of[best_share], ideals[split_mode(best_share)[1]]
                lines.append(f"{'met' if share >= 0.75 else 'MISSED'}: parameter-server p3 >= 75% of ideal on {model}"
                             f" at {rate}: {best_share} {share:.0%} ({ps[best_share]:.0f} of {ideal:.0f} samples/s)")  # fmt: skip
            if _rate_bits(rate) == 1e8:
                ratio = ps[best_ps] / ddp
                lines.append(f"{'met' if ratio >= 1.0 else 'MISSED'}: parameter-server p3 >= 1.0x ddp on {model} at "
                             f"{rate}: {best_ps} {ratio:.2f}x ({ps[best_ps]:.0f} vs {plain_ddp_mode}'s {ddp:.0f} samples/s)")  # fmt: skip
    return lines


def _per_backend(values: dict[str, float], scale: float = 1.0) -> str:
    """A table cell of one number per backend: "649, 795 @inductor"."""
    return ", ".join(f"{value * scale:.0f}" + ("" if backend == "aten" else f" @{backend}") for backend, value in values.items())


def _plain_ddp(speed: dict[str, float]) -> str | None:
    """The plain (uncompressed) DDP mode the ratios compare with: the faster of eager and compiled where both ran."""
    plain = [mode for mode in speed if split_mode(mode)[0] == "ddp"]
    return max(plain, key=speed.__getitem__) if plain else None


def _median_job(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One mode's jobs (rounds) as one: the medians of their step seconds, compute seconds and step / compute
    (each job's own ratio), every tuner's choice."""
    return {**results[-1], "seconds": statistics.median(result["seconds"] for result in results),
            "compute": statistics.median(result["compute"] for result in results),
            "relative": statistics.median(result["seconds"] / result["compute"] for result in results),
            "tuned": [result.get("tuned") for result in results]}  # fmt: skip


def main_bench(args: argparse.Namespace) -> None:
    from tqdm import tqdm

    from tandem import netns

    available, reason = netns.available()
    if not available:
        print(f"warning: {reason}; every rate runs unshaped on loopback", file=sys.stderr)
    args.modes = modes = list(dict.fromkeys(args.modes))  # a mode named twice runs (and is plotted) once
    ratio_modes = [mode for mode in modes if split_mode(mode)[0] in RATIO_MODES]
    auto_modes = [mode for mode in modes if split_mode(mode)[0] in AUTO_MODES]
    rows, throughput, everything = [], {}, {}
    jobs = [(model, rate) for model in args.models for rate in args.rates]
    bar = tqdm(total=len(jobs) * len(modes) * args.repeats, desc="p3 bench")
    for model, rate in jobs:
        batch = MODELS[model][2] * WORKERS
        jobs_of: dict[str, list[dict[str, Any]]] = {mode: [] for mode in modes}
        for round_number in range(args.repeats):  # the modes take turns, round by round: drift hits all alike
            for mode in modes:
                bar.set_postfix_str(f"{model} {rate} {mode} (round {round_number + 1})")
                jobs_of[mode].append(run_mode(model, mode, rate, args.runs, args.steps))
                with open(OUT / "p3_raw.jsonl", "a") as raw:  # every job's numbers as soon as they are in
                    raw.write(json.dumps({"model": model, "rate": rate, "mode": mode, "round": round_number,
                                          **jobs_of[mode][-1]}) + "\n")  # fmt: skip
                bar.update()
        measured = {mode: _median_job(results) for mode, results in jobs_of.items()}
        bits = _rate_bits(rate)
        parameters = next((value["parameters"] for value in measured.values() if "parameters" in value), None)
        if parameters is None:  # DDP modes only: count them here
            parameters = sum(p.numel() for p in _model(model)[0].parameters())
        wire = 0.0 if bits is None else parameters * 4 * 8 / bits
        # compute: the same step without communication, measured inside a job, interleaved with its runs; one per
        # backend (a p3 job's where there is one), since compiled segments shorten it
        computes = {}
        for backend in dict.fromkeys(split_mode(mode)[1] for mode in modes):
            preferred = [name if backend == "aten" else f"{name}@{backend}" for name in ("p3", "collective-p3")]
            source = next(mode for mode in (*preferred, *modes) if mode in measured and split_mode(mode)[1] == backend)
            computes[backend] = measured[source]["compute"]
        ideals = {backend: batch / max(compute, wire) for backend, compute in computes.items()}
        everything[(model, rate)] = {**measured, "_ideal": {"value": ideals, "compute": computes, "wire": wire}}
        speed = {mode: batch / value["seconds"] for mode, value in measured.items()}
        throughput[(model, rate)] = speed
        # the machine is shared: also compare step time in units of each job's own compute time
        relative = {mode: value["relative"] for mode, value in measured.items()}
        ddps = [mode for mode in speed if split_mode(mode)[0] in DDP_MODES]
        best_ddp = max(ddps, key=speed.__getitem__) if ddps else None
        plain_ddp_mode = _plain_ddp(speed)
        derived = []
        for mode in ratio_modes:
            if plain_ddp_mode is not None:
                derived += [speed[mode] / speed[plain_ddp_mode], relative[plain_ddp_mode] / relative[mode]]
            if best_ddp is not None:
                derived.append(speed[mode] / speed[best_ddp])
        derived += [speed[mode] / ideals[split_mode(mode)[1]] for mode in ratio_modes]
        rows.append([model, rate, *(speed[mode] for mode in modes), *derived, _per_backend(ideals),
                     f"{_per_backend(computes, 1e3)} / {wire * 1e3:.0f}", best_ddp or "-",
                     *(" / ".join(dict.fromkeys(map(_chose, measured[mode]["tuned"]))) for mode in auto_modes)])  # fmt: skip
    bar.close()
    has_ddp = any(split_mode(mode)[0] == "ddp" for mode in modes)
    has_any_ddp = any(split_mode(mode)[0] in DDP_MODES for mode in modes)
    derived_headers = []
    for mode in ratio_modes:
        if has_ddp:
            derived_headers += [f"{mode}/ddp", f"{mode}/ddp (per compute)"]
        if has_any_ddp:
            derived_headers.append(f"{mode}/best ddp")
    derived_headers += [f"{mode}/ideal" for mode in ratio_modes]
    headers = ["model", "link", *modes, *derived_headers, "ideal", "compute / wire ms", "best ddp",
               *(f"{mode} chose" for mode in auto_modes)]  # fmt: skip
    table = markdown_table(headers, rows)
    note = (f"samples/s (global batch {WORKERS} x per-worker batch), {WORKERS} workers (+ {SERVERS} servers for "
            f"the parameter-server modes), median of {args.runs} runs x {args.steps} steps"
            + (f" per job, median of {args.repeats} jobs per mode (the modes taking turns)" if args.repeats > 1 else "")
            + "; ideal = batch / "
            "max(compute, model bytes / rate); 'per compute': ratios of step time / compute time, each measured "
            "in its own job (load-normalised); 'best ddp': the fastest of ddp and its hooks")  # fmt: skip
    if any(split_mode(mode)[1] != "aten" for mode in modes):
        note += ("; '@inductor': tandem's inductor segment backend, DDP under torch.compile(DDP(model)), their "
                 "compute columns compiled too; ideal and compute one per backend; 'ddp' in the ratios and goals: the "
                 "faster plain DDP")  # fmt: skip
    checked = goals(everything, {model: MODELS[model][2] * WORKERS for model in args.models})
    goal_text = "\n".join(f"- {line}" for line in checked)
    report = write_report("p3", f"{note}\n\n{table}\n\nGoals:\n\n{goal_text}")
    _plot(throughput, args)
    print(f"\n{note}\n{table}\n\nGoals:\n{goal_text}\n\nwritten {report} and {OUT / 'p3.png'}\n"
          f"reproduce: {command_line()}")
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


COMPRESSED_MODES = ("p3-auto", "p3-auto+fp16", "p3-auto+2bit", "collective-p3", "collective-p3+fp16",
                    "collective-p3+2bit", "ddp", "ddp+fp16", "ddp+powersgd")


def _uncompressed(mode: str) -> str:
    """The mode a compressed one is compared with: "collective-p3+2bit" -> "collective-p3", "ddp+fp16" -> "ddp"."""
    return mode.partition("+")[0]


def _sent(mode: str, parameters: int, update: str) -> str:
    """MB a worker sends / receives per step, as the table shows it (before any all-reduce fan-out)."""
    from tandem.kvstore.compression import GradientCompression

    base, _, compression = mode.partition("+")
    if compression == "powersgd":
        return f"rank-{POWERSGD_RANK} factors"
    ratio = {"fp16": 2.0}.get(compression, 1.0) if base == "ddp" else GradientCompression.parse(compression or None).ratio
    pulled = parameters * 4 / (ratio if update == "workers" or KINDS.get(base) != "dist_p3" else 1)
    return f"{parameters * 4 / ratio / 1e6:.2f} / {pulled / 1e6:.2f}"


def compression_table(args: argparse.Namespace) -> None:
    """Every mode with and without gradient compression at one link rate, side by side per model:
    p3-auto (parameter server), collective-p3, DDP with its fp16 and PowerSGD hooks."""
    rate, rows, update = args.compression_rate, [], {"P3BENCH_UPDATE": args.update}
    bits = _rate_bits(rate)
    modes = [mode for mode in COMPRESSED_MODES if mode in args.modes or _uncompressed(mode) in args.modes]
    for model in args.models:
        batch, measured = MODELS[model][2] * WORKERS, {}
        for mode in modes:
            measured[mode] = run_mode(model, mode, rate, args.runs, args.steps, update)
        parameters = sum(p.numel() for p in _model(model)[0].parameters())
        wire = 0.0 if bits is None else parameters * 4 * 8 / bits  # the uncompressed floor, for every row
        compute = next(measured[mode]["compute"] for mode in ("p3-auto", "collective-p3", *modes) if mode in measured)
        ideal = batch / max(compute, wire)
        for mode in modes:
            speed, base = batch / measured[mode]["seconds"], measured.get(_uncompressed(mode))
            tuned = measured[mode].get("tuned")
            rows.append([model, rate, mode, _sent(mode, parameters, args.update), speed,
                         speed * base["seconds"] / batch if base else "-", speed / ideal,
                         _chose(tuned) if mode.startswith("p3-auto") else "-"])  # fmt: skip
    table = markdown_table(["model", "link", "mode", "MB sent / received per worker and step", "samples/s",
                            "vs uncompressed", "of ideal", "tuner chose"], rows)  # fmt: skip
    note = (f"samples/s, {WORKERS} workers (+ {SERVERS} servers for p3-auto, updates on the {args.update}), median "
            f"of {args.runs} runs x {args.steps} steps, all modes of a model back to back; ideal = batch / "
            "max(compute, model bytes / rate), uncompressed")  # fmt: skip
    report = write_report(f"p3_compression_{args.update}", f"{note}\n\n{table}")
    print(f"\n{note}\n{table}\n\nwritten {report}\nreproduce: {command_line()}")


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
        for mode in args.modes:
            style = "--" if mode.startswith("ddp") else ":" if mode.startswith("collective") else "-"
            marker = "o" if split_mode(mode)[1] == "aten" else "s"  # squares: compiled (@inductor)
            axis.plot(args.rates, [throughput[(model, rate)][mode] for rate in args.rates], style, marker=marker,
                      label=mode)  # fmt: skip
        axis.set_title(f"{model}: {WORKERS} workers ({SERVERS} servers for dist_*)")
        axis.set_xlabel("link rate per host")
        axis.set_ylabel("samples/s")
        axis.set_yscale("log")
        axis.legend(fontsize="small")
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
            ddp_job(rest[0], rest[1], rest[2], int(rest[3]), rest[4], int(rest[5]), int(rest[6]), int(rest[7]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--rates", nargs="+", default=list(RATES), help="tc rates, or 'none' for unshaped")
    parser.add_argument("--modes", nargs="+", default=[*MODES, *DDP_MODES], type=mode_argument,
                        help="modes of the main table, each optionally with @inductor (with --compression: the "
                             "uncompressed modes compared, no @)")  # fmt: skip
    parser.add_argument("--runs", type=int, default=5, help="runs per job (median; >= 5)")
    parser.add_argument("--steps", type=int, default=4, help="steps per run")
    parser.add_argument("--repeats", type=int, default=1,
                        help="main table: jobs per mode, the modes taking turns (median of the jobs' medians)")
    parser.add_argument(
        "--no-sweep", dest="sweep", action="store_false", help="skip the slice/water-mark sweep"
    )
    parser.add_argument("--sweep-model", default="vgg", choices=list(MODELS))
    parser.add_argument("--sweep-rate", default="100mbit")
    parser.add_argument("--compression", action="store_true",
                        help="instead of the main table: p3-auto, collective-p3 (fp16, 2bit) and DDP (fp16, "
                             "PowerSGD hooks) with and without compression")
    parser.add_argument("--compression-rate", default="100mbit")
    parser.add_argument("--update", default="servers", choices=["servers", "workers"],
                        help="--compression: where the optimizer runs (workers: pulls carry sums, compressed too)")
    parser.add_argument("--backends", action="store_true",
                        help="instead of the main table: p3 with the aten and the inductor segment backend")
    args = parser.parse_args()
    if args.runs < 5:
        parser.error("--runs must be >= 5 (medians of at least 5 runs)")
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    if (args.compression or args.backends) and any("@" in mode for mode in args.modes):
        parser.error("@<backend> modes are for the main table; --compression and --backends run aten")
    if args.compression:
        compression_table(args)
        return
    if args.backends:
        backend_table(args)
        return
    main_bench(args)


if __name__ == "__main__":
    main()
