"""``slice_size="auto"``: pick P3's slice size, water mark and send timing from measured iteration times.

ByteScheduler tunes one knob (its credit) with Bayesian optimisation, which needs many noisy
samples to fit a model. Here the objective is cheap to read directly (the store sees every push,
so the time between two pushes of the same key *is* the iteration time, compute overlap included)
and every knob is a small ordered grid with a single broad optimum, so a coordinate search is
enough: measure the start point; walk the slice-size grid up while iteration time improves by more
than ``tolerance`` or stays within it (going on past one point that does not: scores are noisy;
ties go to bigger slices, which send fewer requests), else down; then the same for the water
mark at the chosen slice size (ties go to higher marks: fewer notices and sender wake-ups).
Each point runs ``steps_per_trial`` iterations, and more where they are short (enough for
``min_trial_seconds`` at the warm-up's pace, agreed over workers: on a loaded machine a 50 ms
iteration varies by more than the tolerance), and scores the median of all but the first (which
still carries traffic of the previous point). Before a walk that follows measured points, the
best point is scored again (one lucky score must not outrank every later point). Typically 10-19
points (the send timing adds up to six), i.e. 130-250 iterations of 50 ms or 45-85 of 300 ms, then
fixed.

A trainer may also let it choose *when* gradients leave (``tune_send_timing``, ``SEND_TIMINGS``):
during backward, as each segment ends (P3's point: overlap with backward and the next forward);
all at once after backward, still applied per parameter by the next forward (overlap with the
forward only); or ``serial``: all at once after backward, the step waiting for every reply (no
overlap, the least CPU). Overlap only pays where the link, not the CPU, is the bottleneck: on a
fast link, communication threads compete with compute for the cores and stretch the step (ties go
to less overlap: as fast, and less CPU). That axis is searched first, at the start point; then
the slice size, for the timing chosen; then the timing once more, at that slice size (on a
CPU-bound machine the timings score close at small slices and far apart at big ones); then the
water mark, for the timing that won.

Every worker must slice the same way, so each score is averaged over workers (``agree``) before
the search takes a step: all workers then walk the same path. The water mark is per worker: when
only it is searched, each worker scores its own iterations.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from tandem.kvstore.config import P3Options


class Config(NamedTuple):
    """One point of the search."""

    slice_size: int
    water_mark: int
    send_timing: str = "during"  # one of SEND_TIMINGS

# when a trainer's gradients leave, from the most overlap to none: as each backward segment ends;
# when backward ends (the next forward still applies them per parameter); when backward ends, the
# step then waiting for every reply. Unshaped (CPU-bound), 160k slices, water mark 160, medians of
# step/compute over 4-5 interleaved jobs, two such runs: vgg after 1.73 / 1.73, serial 1.51 /
# 1.60, baseline 1.59 / 1.57; resnet after 1.26 / 1.27, serial 1.19 / 1.19, baseline 1.24 / 1.21
SEND_TIMINGS = ("during", "after", "serial")

SLICE_SIZES = (5_000, 10_000, 20_000, 40_000, 80_000, 160_000, 320_000)
# up to more requests than a step of the bench's models sends at >= 20k slices (resnet: ~90):
# where nothing needs overtaking (a fast link), a cap that never binds saves the RECEIVED notices
# and the sender thread's hops (resnet unshaped, 320k slices, held: step/compute 1.30 at 40,
# 1.26 at 1000, baseline 1.21; 5 interleaved jobs)
WATER_MARKS = (1, 2, 4, 10, 20, 40, 80, 160)
DEFAULT_SLICE_SIZE = 40_000  # MXNet's MXNET_KVSTORE_SLICE_THRESHOLD: where the search starts


def coordinate_search(axes: Sequence[Sequence[int]], start: Sequence[int], tolerance: float, patience: int = 1,
                      ties_up: Sequence[bool] = (), order: Sequence[int] = ()) -> Generator[tuple[int, ...], float, tuple[int, ...]]:  # fmt: skip
    """Yields points to measure, receives their cost, returns the best point; one pass per axis (see ``order``).

    ``order``: the axes to walk, in turn (default: each once, in order); an axis may come again,
    to be walked anew from where the others ended. A walk that follows measured points starts by
    measuring the best point again: later points are compared with that fresh score.

    Along an axis the walk goes on past up to ``patience`` points in a row that do not improve:
    measured costs are noisy, and one unlucky score must not end a walk toward a much better point.

    ``ties_up[axis]``: along that axis a higher point costs less outside the measured time (P3's
    bigger slices: fewer requests, less CPU left to everything else on the machine), so going up
    it is taken on a tie too, i.e. when no worse than the best cost seen by more than
    ``tolerance``. The best cost stays the lowest measured, so ties cannot drift away from it.
    A walk up on ties only still looks down for a real improvement.
    """
    best = list(start)
    best_cost = yield tuple(axis[index] for axis, index in zip(axes, best))
    fresh = True  # nothing measured since the best point's score
    for axis in order or range(len(axes)):
        if not fresh:
            # score the best point again before the next walk, and compare with that score: one
            # lucky score (or a quiet phase of the machine) would otherwise outrank every later point
            best_cost = yield tuple(grid[i] for grid, i in zip(axes, best))
        fresh = True
        origin = best[axis]
        for step in (1, -1):
            improved, misses = False, 0
            index = (best[axis] if step == 1 else origin) + step
            while 0 <= index < len(axes[axis]) and misses <= patience:
                trial = best.copy()
                trial[axis] = index
                cost = yield tuple(grid[i] for grid, i in zip(axes, trial))
                fresh = False
                better = cost < best_cost * (1 - tolerance)
                tie = step == 1 and axis < len(ties_up) and ties_up[axis] and cost <= best_cost * (1 + tolerance)
                if better or tie:
                    improved = improved or better
                    best, best_cost, misses = trial, min(cost, best_cost), 0
                else:
                    misses += 1
                index += step
            if improved:
                break  # improved going up: no need to look down
    return tuple(axis[index] for axis, index in zip(axes, best))


@dataclass
class AutoTuner:
    """Feeds iteration times to a coordinate search over (send timing, slice size, water mark) and applies its points.

    ``apply(config)`` switches the store to a point; ``agree(cost)`` averages a score over workers.
    Thread safety: none; called from the thread that pushes.
    """

    apply: Callable[[Config], None]
    agree: Callable[[float], float]
    slice_sizes: tuple[int, ...] = SLICE_SIZES
    water_marks: tuple[int, ...] = WATER_MARKS
    timings: tuple[str, ...] = ("during",)  # send timing candidates (of SEND_TIMINGS); see tune_send_timing
    start: Config = Config(DEFAULT_SLICE_SIZE, 10)
    steps_per_trial: int = 4
    min_trial_seconds: float = 0.5  # short iterations are noisy: points run ~this long (from the warm-up's pace)
    warmup: int = (
        6  # the first iterations run slow (allocations, caches): they must not score the start point
    )
    tolerance: float = 0.03
    clock: Callable[[], float] = time.perf_counter
    history: list[tuple[Config, float]] = field(default_factory=list)  # (point, agreed cost in seconds)
    result: Config | None = None
    _clock_key: object = None
    _last: float | None = None
    _seen: int = 0
    _samples: list[float] = field(default_factory=list)
    _trial_steps: int = 0  # set when the search starts (see _iteration_done)
    _search: Generator[tuple[int, ...], float, tuple[int, ...]] | None = None
    _current: Config | None = None

    def __post_init__(self) -> None:
        self.start = Config(*self.start)
        if self.steps_per_trial < 2:
            raise ValueError(
                f"steps_per_trial must be >= 2 (the first is discarded), got {self.steps_per_trial}"
            )
        for name, grid, value in (("slice size", self.slice_sizes, self.start.slice_size),
                                  ("water mark", self.water_marks, self.start.water_mark),
                                  ("send timing", self.timings, self.start.send_timing)):  # fmt: skip
            if value not in grid:
                raise ValueError(f"start {name} {value} is not among the candidates {grid}")

    @property
    def current(self) -> Config:
        return self._current or self.start

    def fix_slice_size(self) -> None:
        """Keep the slicing (async workers cannot agree on a switch; LAMB on the servers needs whole tensors).

        Must come before the search starts: the workers' paths would differ otherwise.
        """
        self._before_search("the slice size can only be fixed")
        self.slice_sizes = (self.current.slice_size,)
        self.start = self.start._replace(slice_size=self.current.slice_size)

    def tune_send_timing(self, timings: tuple[str, ...] = SEND_TIMINGS) -> None:
        """Also choose when gradients leave (among ``timings``, ordered from the most overlap to none,
        unless ``timings`` already holds a choice; for a caller that can hold gradients and wait)."""
        if len(self.timings) == 1:  # a recaptured step attaches again: idempotent
            self._before_search("the send timing can only be added")
            self.timings = timings

    def _before_search(self, what: str) -> None:
        if self._search is not None:
            raise RuntimeError(f"{what} before tuning starts (before the first pushes)")

    @property
    def slicing_fixed(self) -> bool:
        """The slicing is not searched; the water mark and send timing are per worker: scores need no agreement."""
        return len(self.slice_sizes) == 1

    def observe(self, key: object) -> None:
        """Call before each push: the second push of the first key pushed ends an iteration."""
        if self.result is not None:
            return
        if self._clock_key is None:
            self._clock_key = key
        if key != self._clock_key:
            return
        now = self.clock()
        if self._last is not None:
            self._iteration_done(now - self._last)
        self._last = self.clock()  # the agreement below must not count as iteration time

    def _iteration_done(self, seconds: float) -> None:
        self._seen += 1
        if self._seen < self.warmup:
            self._samples.append(seconds)
            return
        if self._search is None:
            # iterations per point, fixed for the whole search and agreed, so that every worker of a
            # sync job switches at the same iteration (each one's own clock would tell them apart)
            typical = self.agree(statistics.median(self._samples[1:] or [seconds]))
            self._trial_steps = max(self.steps_per_trial, 1 + math.ceil(self.min_trial_seconds / max(typical, 1e-6)))
            self._samples = []
            # timing first (by index: the grid is ordered, by overlap): the best slicing depends on it
            axes = (tuple(range(len(self.timings))), self.slice_sizes, self.water_marks)
            start = (self.timings.index(self.start.send_timing), self.slice_sizes.index(self.start.slice_size),
                     self.water_marks.index(self.start.water_mark))  # fmt: skip
            # ties go to less overlap: as fast, and fewer thread hops and engine ops (resnet unshaped
            # chose 'after' over 'serial' within the tolerance in one of three runs, and reached
            # 0.93x baseline); to bigger slices: as fast, and fewer requests (on a fast link, less
            # CPU); and to higher water marks: as fast, and fewer RECEIVED notices and sender
            # wake-ups. The timing is walked again once the slicing is chosen: where the CPU is the
            # bottleneck the timings score close at the start's small slices, and far apart at the
            # big ones chosen then (vgg unshaped, 320k slices: 48-51 ms per step during backward,
            # 43-46 ms after); the water mark comes last, for the timing chosen (holding sends
            # every gradient at once, so the cap matters more)
            self._search = coordinate_search(axes, start, self.tolerance, ties_up=(True, True, True),
                                             order=(0, 1, 0, 2) if len(self.timings) > 1 else ())  # fmt: skip
            self._switch(next(self._search))
            return
        self._samples.append(seconds)
        if len(self._samples) < self._trial_steps:
            return
        cost = self.agree(statistics.median(self._samples[1:]))
        self.history.append((self.current, cost))
        self._samples = []
        try:
            self._switch(self._search.send(cost))
        except StopIteration as done:
            self._switch(done.value)
            self.result = self.current

    def _switch(self, point: tuple[int, ...]) -> None:
        config = Config(point[1], point[2], self.timings[point[0]])
        if config != self._current:
            self.apply(config)
        self._current = config


def start_slice_size(p3: P3Options) -> int:
    """The slice size a store starts with: the one given, or where the tuner's search starts."""
    return DEFAULT_SLICE_SIZE if p3.auto else p3.slice_size


def tuner_for(p3: P3Options, apply: Callable[[Config], None], agree: Callable[[float], float]) -> AutoTuner | None:
    """The tuner of a store with ``p3``'s settings (``slice_size="auto"``), or None where nothing is tuned;
    the water mark given joins the grid, so that the search starts from it."""
    if not p3.auto:
        return None
    marks = tuple(sorted({*WATER_MARKS, p3.water_mark}))
    return AutoTuner(apply, agree, water_marks=marks, start=Config(DEFAULT_SLICE_SIZE, p3.water_mark))
