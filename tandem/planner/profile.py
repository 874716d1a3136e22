"""One profiled training step: what ``tandem plan`` simulates, saved as JSON and checked when read back.

A profile holds, in forward order, every parameter the step sends (name, elements, bytes), and per
segment of the executor (``tandem.executor.Segment``): its phase, its median seconds over timed runs
on the calling thread, the parameters it reads and those whose gradient it finishes; and the
seconds of a worker's optimizer update of every parameter (``update_seconds``: what a worker adds to
its step where the workers, not servers, update). Its ``fingerprint`` hashes the parameters' names,
shapes and dtypes and the batch's shapes: a profile read for another model, batch or tandem version
is refused with what differs.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn

from tandem.planner.sim import Workload

T = TypeVar("T")


class ProfileMismatch(ValueError):
    """A saved profile is not of the model (or tandem) it is used for."""


@dataclass(frozen=True)
class SegmentProfile:
    phase: str  # "forward" or "backward"
    seconds: float  # median over the timed runs
    reads: tuple[str, ...] = ()  # parameters it reads (forward segments)
    gradients: tuple[str, ...] = ()  # parameters whose gradient it finishes (backward segments)


@dataclass(frozen=True)
class Profile:
    model: str
    version: str  # tandem's
    fingerprint: str
    batch_size: int  # samples per worker per step
    parameters: tuple[tuple[str, int, int], ...]  # (name, elements, bytes), forward order
    batch_shapes: tuple[tuple[int, ...], ...]
    segments: tuple[SegmentProfile, ...]
    threads: int = 1  # torch threads while profiled
    extra: dict[str, Any] = field(default_factory=dict)  # anything else worth keeping (runs, backend)
    update_s: float = 0.0  # a worker's optimizer update of every parameter (0: not measured, not charged)

    def workload(self) -> Workload:
        index = {name: i for i, (name, _, _) in enumerate(self.parameters)}
        forward = [s for s in self.segments if s.phase == "forward"]
        backward = [s for s in self.segments if s.phase != "forward"]
        reads = tuple(tuple(index[n] for n in s.reads if n in index) for s in forward)
        return Workload(names=tuple(name for name, _, _ in self.parameters),
                        param_bytes=tuple(nbytes for _, _, nbytes in self.parameters),
                        forward_s=tuple(s.seconds for s in forward), forward_reads=reads,
                        backward_s=tuple(s.seconds for s in backward),
                        backward_grads=tuple(tuple(index[n] for n in s.gradients if n in index) for s in backward),
                        batch_size=self.batch_size, update_s=self._update_shares(reads))  # fmt: skip

    def _update_shares(self, reads: tuple[tuple[int, ...], ...]) -> tuple[float, ...]:
        """``update_s`` split over the forward segments by the bytes of the parameters each reads first
        (where the executor applies them: just before the first segment that reads them)."""
        if not self.update_s or not reads:
            return ()
        owned = [sum(self.parameters[p][2] for p in params) for params in first_readers(reads)]
        total = sum(owned)
        return tuple(self.update_s * b / total for b in owned) if total else ()

    @property
    def compute_s(self) -> float:
        return sum(s.seconds for s in self.segments)

    def scaled(self, factor: float) -> Profile:
        """This profile with every segment (and the update) ``factor`` times as long (the machine's speed moved since)."""
        return replace(self, segments=tuple(replace(s, seconds=s.seconds * factor) for s in self.segments),
                       update_s=self.update_s * factor)  # fmt: skip

    @property
    def total_bytes(self) -> int:
        return sum(nbytes for _, _, nbytes in self.parameters)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(self), indent=1))
        return path

    @staticmethod
    def load(path: str | Path) -> Profile:
        data = json.loads(Path(path).read_text())
        try:
            return Profile(**{**data, "parameters": tuple(tuple(p) for p in data["parameters"]),
                              "batch_shapes": tuple(tuple(s) for s in data["batch_shapes"]),
                              "segments": tuple(SegmentProfile(**{**s, "reads": tuple(s["reads"]),
                                                                  "gradients": tuple(s["gradients"])})
                                                for s in data["segments"])})  # fmt: skip
        except (KeyError, TypeError) as error:
            raise ProfileMismatch(f"{path} is not a tandem plan profile ({error})") from None

    def check(self, model: str, fingerprint: str, parameters: Sequence[tuple[str, int, int]] | None = None,
              batch_shapes: Sequence[tuple[int, ...]] | None = None) -> None:  # fmt: skip
        """Refuse this profile for another model, tandem version or parameter/batch layout, naming what differs."""
        from tandem import __version__

        differs = []
        if self.model != model:
            differs.append(f"model: the profile is of {self.model!r}, not {model!r}")
        if self.version != __version__:
            differs.append(f"tandem version: the profile was made by {self.version}, this is {__version__}")
        if self.fingerprint != fingerprint:
            detail = ""
            if parameters is not None and tuple(map(tuple, parameters)) != self.parameters:
                ours, theirs = {p[0]: p[1:] for p in parameters}, {p[0]: p[1:] for p in self.parameters}
                changed = sorted(n for n in ours.keys() | theirs.keys() if ours.get(n) != theirs.get(n))
                detail = f" (parameters differ: {', '.join(changed[:5])}{', ...' if len(changed) > 5 else ''})"
            elif batch_shapes is not None and tuple(map(tuple, batch_shapes)) != self.batch_shapes:
                detail = f" (batch shapes {list(self.batch_shapes)} vs {list(batch_shapes)})"
            differs.append(f"fingerprint: {self.fingerprint} vs {fingerprint}{detail}")
        if differs:
            raise ProfileMismatch("the saved profile does not fit: " + "; ".join(differs) + " (profile again)")


def segment_seconds(step: Any, batch: Sequence[Any], runs: int = 5, warmup: int = 2) -> list[float]:
    """Median seconds of each segment of a compiled step (``tandem.compile``, run once) over ``runs`` runs
    on this thread, after ``warmup``, at this thread's torch threads."""
    from tandem.graph.batch import BatchLayout

    executor, graph = step.executor, step.graph
    _, tensors = BatchLayout.of(batch)
    inputs = graph.inputs(step.module, tensors)
    seconds: list[list[float]] = [[] for _ in executor.segments]
    # on the CPU, this thread's CPU time: the segment's work, not the time other processes preempted it
    # (the simulator shares the cores itself); an accelerator's kernels run elsewhere: wall time
    on_cpu = all(t.device.type == "cpu" for t in (*step.module.parameters(), *tensors))
    clock = time.thread_time if on_cpu else time.perf_counter
    with torch.no_grad():  # the engine's threads run segments so, too
        for run in range(warmup + runs):
            slots = executor.new_slots(inputs)
            for i, segment in enumerate(executor.segments):
                start = clock()
                segment.function(slots)
                if run >= warmup:
                    seconds[i].append(clock() - start)
    return [statistics.median(t) for t in seconds]


def first_readers(reads: Sequence[Sequence[T]]) -> list[list[T]]:
    """Per forward segment, the parameters of ``reads`` that no earlier segment read: where a worker's
    update applies each one (``DistributedUpdate``: before the first segment that reads it)."""
    seen: set[T] = set()
    found = []
    for params in reads:
        found.append([p for p in params if p not in seen])
        seen.update(params)
    return found


def update_seconds(module: nn.Module, groups: Sequence[Sequence[str]], runs: int = 5, warmup: int = 2) -> float:
    """Median seconds of a worker's optimizer update of the parameters in ``groups``, as the Trainer applies
    it where the workers update: per group (the parameters a forward segment reads first) the summed
    gradients averaged, then one fused SGD-with-momentum update (``tandem.optim.SGD``: the planner's
    reference rule; Adam's update costs about twice its passes over memory). On copies: the module
    keeps its values. CPU: this thread's CPU time; an accelerator: wall time, synchronised."""
    from tandem import optim
    from tandem.update.base import OptimizerApply

    params = {name: p.detach().clone() for name, p in module.named_parameters()}
    owned = [[name for name in group if name in params] for group in groups]
    owned = [group for group in owned if group]
    if not owned:
        return 0.0
    summed = {name: torch.ones_like(p) for name, p in params.items()}
    apply = OptimizerApply(params, optim.SGD(lr=1e-6, momentum=0.9))
    device = next(iter(params.values())).device
    on_cpu = device.type == "cpu"
    clock = time.thread_time if on_cpu else time.perf_counter
    seconds = []
    for run in range(warmup + runs):
        start = clock()
        for group in owned:
            apply(group, {name: summed[name] / 2 for name in group})  # the sum over workers, averaged
        if not on_cpu:
            torch.accelerator.synchronize()
        if run >= warmup:
            seconds.append(clock() - start)
    return statistics.median(seconds)


def describe(module: nn.Module, batch: Sequence[Any]) -> tuple[tuple[tuple[str, int, int], ...], tuple[tuple[int, ...], ...], str]:
    """(parameters as (name, elements, bytes), batch tensor shapes, fingerprint) of a module and batch."""
    from tandem.graph.batch import BatchLayout

    _, tensors = BatchLayout.of(batch)
    parameters = tuple((name, p.numel(), p.numel() * p.element_size()) for name, p in module.named_parameters())
    shapes = tuple(tuple(t.shape) for t in tensors)
    dtypes = [str(p.dtype) for p in module.parameters()] + [str(t.dtype) for t in tensors]
    digest = hashlib.sha256(json.dumps([parameters, shapes, dtypes]).encode()).hexdigest()[:16]
    return parameters, shapes, digest


def profile(module: nn.Module, loss_fn: Any, batch: Sequence[Any], model: str = "model", runs: int = 5,
            warmup: int = 2, threads: int | None = 1, **options: Any) -> Profile:  # fmt: skip
    """Capture and plan one step (``tandem.compile(module, loss_fn, *batch, **options)``), then time each
    segment over ``runs`` runs on this thread (after ``warmup``); ``threads``: torch threads meanwhile
    (1: as each process of a local job runs; None: leave as is)."""
    from tandem import __version__
    from tandem.step import compile as compile_step

    if runs < 1:
        raise ValueError(f"runs must be >= 1, got {runs}")
    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        step = compile_step(module, loss_fn, *batch, **options)
        step(*batch)  # capture, plan, the measured first run
        seconds = segment_seconds(step, batch, runs, warmup)
        forward_reads = [s.parameters for s in step.executor.segments if str(s.phase) == "forward"]
        update = update_seconds(module, first_readers(forward_reads), runs, warmup)
        used = torch.get_num_threads()
    finally:
        torch.set_num_threads(previous)
    executor, graph = step.executor, step.graph
    sent = list(graph.grads)  # what a distributed update sends, forward order (tied: the first name)
    parameters, shapes, digest = describe(module, batch)
    sizes = {name: (numel, nbytes) for name, numel, nbytes in parameters}
    segments = tuple(SegmentProfile(str(s.phase), t, tuple(n for n in s.parameters if n in sizes),
                                    tuple(s.gradients)) for s, t in zip(executor.segments, seconds))  # fmt: skip
    return Profile(model=model, version=__version__, fingerprint=digest, batch_size=int(shapes[0][0]) if shapes and shapes[0] else 1,
                   parameters=tuple((n, *sizes[n]) for n in sent), batch_shapes=shapes, segments=segments,
                   threads=used, extra={"runs": runs, "backend": executor.backend}, update_s=update)  # fmt: skip
