"""``slice_size="auto"``: pick P3's slice size and water mark from measured iteration times.

ByteScheduler tunes one knob (its credit) with Bayesian optimisation, which needs many noisy
samples to fit a model. Here the objective is cheap to read directly (the store sees every push,
so the time between two pushes of the same key *is* the iteration time, compute overlap included)
and both knobs are small ordered grids with a single broad optimum, so a coordinate search is
enough: measure the start point; walk the slice-size grid up while iteration time improves by more
than ``tolerance``, else down; then the same for the water mark at the chosen slice size. Each
point runs ``steps_per_trial`` iterations and scores the median of all but the first (which still
carries traffic of the previous point). Typically 5-7 points, i.e. 20-30 iterations, then fixed.

Every worker must slice the same way, so each score is averaged over workers (``agree``) before
the search takes a step: all workers then walk the same path. The water mark is per worker: when
only it is searched, each worker scores its own iterations.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field

Config = tuple[int, int]  # (slice_size, water_mark)
SLICE_SIZES = (5_000, 10_000, 20_000, 40_000, 80_000, 160_000, 320_000)
WATER_MARKS = (1, 2, 4, 10, 20, 40)
DEFAULT_SLICE_SIZE = 40_000  # MXNet's MXNET_KVSTORE_SLICE_THRESHOLD: where the search starts


def coordinate_search(axes: Sequence[Sequence[int]], start: Sequence[int],
                      tolerance: float) -> Generator[tuple[int, ...], float, tuple[int, ...]]:  # fmt: skip
    """Yields points to measure, receives their cost, returns the best point; one pass per axis."""
    best = list(start)
    best_cost = yield tuple(axis[index] for axis, index in zip(axes, best))
    for axis in range(len(axes)):
        for step in (1, -1):
            moved = False
            index = best[axis] + step
            while 0 <= index < len(axes[axis]):
                trial = best.copy()
                trial[axis] = index
                cost = yield tuple(grid[i] for grid, i in zip(axes, trial))
                if cost >= best_cost * (1 - tolerance):
                    break
                best, best_cost, moved = trial, cost, True
                index += step
            if moved:
                break  # improved going up: no need to look down
    return tuple(axis[index] for axis, index in zip(axes, best))


@dataclass
class AutoTuner:
    """Feeds iteration times to a coordinate search over (slice size, water mark) and applies its points.

    ``apply(config)`` switches the store to a point; ``agree(cost)`` averages a score over workers.
    Thread safety: none; called from the thread that pushes.
    """

    apply: Callable[[Config], None]
    agree: Callable[[float], float]
    slice_sizes: tuple[int, ...] = SLICE_SIZES
    water_marks: tuple[int, ...] = WATER_MARKS
    start: Config = (DEFAULT_SLICE_SIZE, 10)
    steps_per_trial: int = 4
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
    _search: Generator[tuple[int, ...], float, tuple[int, ...]] | None = None
    _current: Config | None = None

    def __post_init__(self) -> None:
        if self.steps_per_trial < 2:
            raise ValueError(
                f"steps_per_trial must be >= 2 (the first is discarded), got {self.steps_per_trial}"
            )
        for name, grid, value in (("slice size", self.slice_sizes, self.start[0]),
                                  ("water mark", self.water_marks, self.start[1])):  # fmt: skip
            if value not in grid:
                raise ValueError(f"start {name} {value} is not among the candidates {grid}")

    @property
    def current(self) -> Config:
        return self._current or self.start

    def fix_slice_size(self) -> None:
        """Tune only the water mark (server-side optimizers and async mode cannot change slicing).

        Must come before the search starts: the workers' paths would differ otherwise.
        """
        if self._search is not None:
            raise RuntimeError(
                "the slice size can only be fixed before tuning starts (before the first pushes)"
            )
        self.slice_sizes = (self.current[0],)
        self.start = (self.current[0], self.start[1])

    @property
    def slicing_fixed(self) -> bool:
        """Only the water mark is searched: it is per worker, so scores need no agreement."""
        return len(self.slice_sizes) == 1

    def observe(self, key: object) -> None:
        """Call before each push: the second push of the first key pushed ends an iteration."""
        if self.result is not None:
            return
        now = self.clock()
        if self._clock_key is None:
            self._clock_key = key
        if key != self._clock_key:
            return
        if self._last is not None:
            self._iteration_done(now - self._last)
        self._last = self.clock()  # the agreement below must not count as iteration time

    def _iteration_done(self, seconds: float) -> None:
        self._seen += 1
        if self._seen < self.warmup:
            return
        if self._search is None:
            axes = (self.slice_sizes, self.water_marks)
            start = (self.slice_sizes.index(self.start[0]), self.water_marks.index(self.start[1]))
            self._search = coordinate_search(axes, start, self.tolerance)
            self._switch(next(self._search))
            return
        self._samples.append(seconds)
        if len(self._samples) < self.steps_per_trial:
            return
        cost = self.agree(statistics.median(self._samples[1:]))
        self.history.append((self.current, cost))
        self._samples = []
        try:
            self._switch(self._search.send(cost))
        except StopIteration as done:
            self.result = (done.value[0], done.value[1])
            self._switch(done.value)

    def _switch(self, point: tuple[int, ...]) -> None:
        config = (point[0], point[1])
        if config != self._current:
            self.apply(config)
        self._current = config
