"""Search the communication modes and their knobs for a cluster, from one profile; report and plot.

``search(profile, Target(...))`` simulates every mode of ``Target.modes`` (p3 with a coordinate search
over slice size, then water mark, as the runtime tuner walks them), each with and without gradient
compression, picks the fastest uncompressed one (compression changes what is learnt: shown, not
chosen), then the fewest servers within 3 % of the most, and sweeps workers and link rates for the plot.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path

from tandem.planner.profile import Profile
from tandem.planner.sim import (
    MODES,
    PS_MODES,
    SLICED_MODES,
    Cluster,
    Machine,
    Prediction,
    Strategy,
    Workload,
    simulate,
)

SLICE_SIZES = (5_000, 10_000, 20_000, 40_000, 80_000, 160_000, 320_000)  # the tuner's grid (p3_tuner.py)
WATER_MARKS = (1, 2, 4, 10, 20, 40, 80, 160)
SWEEP_WORKERS = (1, 2, 4, 8, 16, 32, 64)
SWEEP_RATES = ("100mbit", "1gbit", "10gbit", "25gbit", "100gbit")
SERVER_SLACK = 0.97  # the fewest servers giving this share of the best throughput
TIE = 0.01  # modes within 1 % tie; the tie goes to the earlier (simpler) mode of MODES
_RATE = re.compile(r"^\s*([0-9.]+(?:e[0-9]+)?)\s*([kmgt]?)(bit|bps)?\s*$", re.IGNORECASE)


def parse_rate(rate: str | float) -> float:
    """Bits/s of ``"100mbit"``, ``"10gbit"``, ``"12.5mbps"`` (bytes) or a number of bits/s; > 0."""
    if isinstance(rate, int | float):
        bits = float(rate)
    else:
        match = _RATE.match(rate)
        if match is None:
            raise ValueError(f"link rate {rate!r} is not a rate: use e.g. '100mbit', '10gbit', '12.5mbps' or bits/s")
        scale = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}[match.group(2).lower()]
        bits = float(match.group(1)) * scale * (8 if (match.group(3) or "").lower() == "bps" else 1)
    if not bits > 0:
        raise ValueError(f"link rate must be > 0 bits/s (e.g. '100mbit', '10gbit'), got {rate!r}")
    return bits


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def rate_label(bits: float) -> str:
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bits >= scale:
            return f"{bits / scale:g} {unit}"
    return f"{bits:g} bit/s"


@dataclass(frozen=True)
class Target:
    """The cluster to plan for; ``machine``: its CPU costs, cores and placement (``Machine()``: measured
    costs, a spare core per thread; ``measure.this_machine()``: this machine, every process on it)."""

    workers: int = 16
    servers: int = 4
    rate: str | float = "10gbit"
    latency_s: float = 50e-6
    modes: tuple[str, ...] = MODES
    compressions: tuple[str, ...] = ("fp16", "2bit")  # simulated beside each mode, never recommended
    machine: Machine = Machine()
    sweep: bool = True  # the curves over workers and link rates (for the plot)
    colocated: bool = False  # each server on a worker's machine (Cluster.colocated); sweeps keep servers <= workers

    def __post_init__(self) -> None:
        if not (isinstance(self.workers, int) and self.workers >= 1):
            raise ValueError(f"workers must be an int >= 1, got {self.workers!r}")
        unknown = [m for m in self.modes if m not in MODES]
        if unknown or not self.modes:
            raise ValueError(f"modes must be some of {MODES}, got {list(self.modes)}")
        if any(m in PS_MODES for m in self.modes) and not (isinstance(self.servers, int) and self.servers >= 1):
            raise ValueError(f"servers must be an int >= 1 for the parameter-server modes {PS_MODES}, got "
                             f"{self.servers!r} (0 servers: the modes without servers alone, --modes allreduce collective)")  # fmt: skip
        if self.servers < 0:
            raise ValueError(f"servers must be >= 0, got {self.servers}")
        parse_rate(self.rate)
        self.cluster()  # the rest of the checks (colocated: at most one server per worker)

    def cluster(self, workers: int | None = None, servers: int | None = None, rate: str | float | None = None) -> Cluster:
        machines = self.workers if workers is None else workers
        servers = self.servers if servers is None else servers
        if self.colocated and workers is not None:  # a sweep point of fewer machines: at most a server on each
            servers = min(servers, machines)
        return Cluster(machines, servers, parse_rate(self.rate if rate is None else rate), self.latency_s, self.machine,
                       colocated=self.colocated)  # fmt: skip


@dataclass
class Plan:
    profile: Profile
    target: Target
    predictions: list[Prediction]  # per mode at its best knobs, then the compressed variants
    best: Prediction  # uncompressed: the fastest mode at target.servers, or the best PS mode at ``servers`` if faster
    servers: int  # the fewest servers within SERVER_SLACK of the most (parameter-server modes)
    server_curve: dict[int, float] = field(default_factory=dict)  # servers -> samples/s of the best PS mode
    by_workers: dict[str, dict[int, float]] = field(default_factory=dict)  # mode -> workers -> samples/s
    by_rate: dict[str, dict[float, float]] = field(default_factory=dict)  # mode -> bits/s -> samples/s

    def prediction(self, mode: str, compression: str = "none") -> Prediction | None:
        return next((p for p in self.predictions if p.strategy.mode == mode and p.strategy.compression == compression), None)

    def report(self) -> str:
        profile, cluster = self.profile, self.target.cluster()
        lines = [f"tandem plan: {profile.model} ({sum(p[1] for p in profile.parameters) / 1e6:.2f}M parameters, "
                 f"{profile.total_bytes / 1e6:.1f} MB sent per step), batch {profile.batch_size} per worker, "
                 f"compute {profile.compute_s * 1e3:.1f} ms per step ({len(profile.segments)} segments, "
                 f"{profile.threads} thread{'s' if profile.threads > 1 else ''})",
                 f"cluster: {_count(cluster.workers, 'worker')}, {_count(cluster.servers, 'server')}"
                 f"{' (each on a worker machine)' if cluster.colocated else ''}, "
                 f"{rate_label(cluster.rate_bps)} links, "
                 f"{cluster.latency_s * 1e6:.0f} us latency", f"machine: {cluster.machine.describe()}", ""]  # fmt: skip
        header = f"{'mode':<32}{'samples/s':>10}{'ms/iter':>10}{'compute':>9}{'exposed comm':>13}{'idle':>8}"
        lines += [header, "-" * len(header)]
        for p in self.predictions:
            mark = "  <- recommended" if p is self.best else ""
            lines.append(f"{p.strategy.label:<32}{p.samples_per_s:>10.1f}{p.iteration_s * 1e3:>10.1f}"
                         f"{p.compute_s * 1e3:>9.1f}{p.exposed_s * 1e3:>13.1f}{p.idle_s * 1e3:>8.1f}{mark}")  # fmt: skip
        lines.append("")
        s = self.best.strategy
        knobs = f", slice size {s.slice_size}, water mark {s.water_mark}" if s.mode in SLICED_MODES else ""
        baseline = self.prediction("baseline")
        versus = f", {self.best.samples_per_s / baseline.samples_per_s:.2f}x baseline" if baseline else ""
        servers = self.best.cluster.servers
        where = (f", {servers} servers" + (f" (not {cluster.servers})" if servers != cluster.servers else "")
                 if s.mode in PS_MODES else " (no servers)")  # fmt: skip
        lines.append(f"recommended: {s.mode}{knobs}{where}: {self.best.samples_per_s:.1f} samples/s predicted{versus}")
        if self.server_curve:
            curve = ", ".join(f"{n}: {v:.0f}" for n, v in self.server_curve.items())
            lines.append(f"servers: {self.servers} (the fewest within {1 - SERVER_SLACK:.0%} of the most; samples/s of "
                         f"the best parameter-server mode by servers: {curve})")  # fmt: skip
        return "\n".join(lines)

    def plot(self, path: str | Path) -> Path:
        """Predicted samples/s vs workers (left) and vs link rate (right), one line per mode."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
        cluster = self.target.cluster()
        for mode, points in self.by_workers.items():
            left.plot(list(points), list(points.values()), marker="o", label=mode)
        ideal = {w: w * self.profile.batch_size / self.profile.compute_s for w in SWEEP_WORKERS}
        left.plot(list(ideal), list(ideal.values()), linestyle=":", color="gray", label="compute only")
        left.set(xscale="log", yscale="log", xlabel="workers", ylabel="samples/s",
                 title=f"{self.profile.model}: {cluster.servers} servers, {rate_label(cluster.rate_bps)}")
        for mode, by_rate in self.by_rate.items():
            right.plot([r / 1e9 for r in by_rate], list(by_rate.values()), marker="o", label=mode)
        right.set(xscale="log", xlabel="link rate (Gbit/s)", ylabel="samples/s",
                  title=f"{cluster.workers} workers, {cluster.servers} servers")
        for axis in (left, right):
            axis.legend(fontsize=8)
            axis.grid(True, which="both", alpha=0.3)
        figure.tight_layout()
        figure.savefig(path, dpi=110)
        plt.close(figure)
        return path


def best_strategy(workload: Workload, cluster: Cluster, mode: str) -> Prediction:
    """The mode at its best knobs: p3's (or collective's) slice size at water mark 10, then its water mark
    (ties: bigger)."""
    if mode not in SLICED_MODES:
        return simulate(workload, cluster, Strategy(mode))  # type: ignore[arg-type]
    best = _walk(workload, cluster, [Strategy(mode, size, 10) for size in SLICE_SIZES])  # type: ignore[arg-type]
    return _walk(workload, cluster, [Strategy(mode, best.strategy.slice_size, mark) for mark in WATER_MARKS])  # type: ignore[arg-type]


def _walk(workload: Workload, cluster: Cluster, strategies: list[Strategy]) -> Prediction:
    best: Prediction | None = None
    for strategy in strategies:
        prediction = simulate(workload, cluster, strategy, iterations=4)
        if best is None or prediction.samples_per_s >= best.samples_per_s * (1 - 1e-6):  # ties: later, bigger
            best = prediction
    assert best is not None
    return simulate(workload, cluster, best.strategy)  # measured again over more iterations


def search(profile: Profile, target: Target) -> Plan:
    workload, cluster = profile.workload(), target.cluster()
    chosen = {mode: best_strategy(workload, cluster, mode) for mode in target.modes}
    best = chosen[target.modes[0]]
    for mode in target.modes[1:]:  # an earlier mode is kept unless a later one is more than TIE faster
        if chosen[mode].samples_per_s > best.samples_per_s * (1 + TIE):
            best = chosen[mode]
    compressed = [simulate(workload, cluster, dataclasses.replace(p.strategy, compression=c))
                  for p in chosen.values() for c in target.compressions if c != "none"]  # fmt: skip
    result = Plan(profile, target, [*chosen.values(), *compressed], best, target.servers)
    ps = [chosen[m] for m in target.modes if m in PS_MODES]
    if ps:
        strategy = max(ps, key=lambda p: p.samples_per_s).strategy
        most = target.workers if target.colocated else max(target.workers, target.servers)
        counts = sorted({n for n in (1, 2, 4, 8, 16, 32, 64) if n <= most} | {target.servers})
        result.server_curve = {n: simulate(workload, target.cluster(servers=n), strategy, iterations=4).samples_per_s
                               for n in counts}  # fmt: skip
        top = max(result.server_curve.values())
        result.servers = min(n for n, v in result.server_curve.items() if v >= SERVER_SLACK * top)
        if result.servers != target.servers and result.server_curve[result.servers] > best.samples_per_s * (1 + TIE):
            result.best = simulate(workload, target.cluster(servers=result.servers), strategy)  # more servers win
    if target.sweep:
        for p in chosen.values():
            label = p.strategy.label
            result.by_workers[label] = {w: simulate(workload, target.cluster(workers=w), p.strategy, 4).samples_per_s
                                        for w in SWEEP_WORKERS}  # fmt: skip
            result.by_rate[label] = {parse_rate(r): simulate(workload, target.cluster(rate=r), p.strategy, 4).samples_per_s
                                     for r in SWEEP_RATES}  # fmt: skip
    return result
