"""P3's pure parts: the lane-keeping priority queue and round-robin slicing."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.kvstore.base import Handle
from tandem.kvstore.config import P3Options
from tandem.kvstore.errors import KVStoreError
from tandem.kvstore.ps.p3_queue import LanePriorityQueue
from tandem.kvstore.ps.p3_tuner import SEND_TIMINGS, SLICE_SIZES, WATER_MARKS, AutoTuner, Config
from tandem.kvstore.ps.placement import RoundRobinPlacement


def test_highest_priority_first_fifo_on_ties() -> None:
    queue: LanePriorityQueue[str] = LanePriorityQueue()
    for name, priority in [("a", 0), ("b", 5), ("c", 0), ("d", -3), ("e", 5)]:
        queue.put(name, priority, lane=name)
    assert queue.peek() == "b"
    assert [queue.pop() for _ in range(len(queue))] == ["b", "e", "a", "c", "d"]


def test_a_later_item_of_a_lane_never_overtakes_an_earlier_one() -> None:
    queue: LanePriorityQueue[str] = LanePriorityQueue()
    queue.put("push w", -5, lane="w")
    queue.put("other", 0, lane="x")
    assert queue.put("pull w", 10, lane="w") == -5  # capped at the push's priority
    assert [queue.pop() for _ in range(3)] == ["other", "push w", "pull w"]
    queue.put("fresh", 10, lane="w")  # the lane emptied: no cap any more
    assert queue.pop() == "fresh" and len(queue) == 0


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(-3, 3), st.integers(0, 3)), max_size=40))
def test_property_priority_order_across_lanes_fifo_within(items: list[tuple[int, int]]) -> None:
    queue: LanePriorityQueue[int] = LanePriorityQueue()
    effective = [queue.put(index, priority, lane) for index, (priority, lane) in enumerate(items)]
    order = [queue.pop() for _ in items]
    assert sorted(order) == list(range(len(items)))
    for lane in {lane for _, lane in items}:
        mine = [index for index in order if items[index][1] == lane]
        assert mine == sorted(mine)  # lane order kept
    popped = [effective[index] for index in order]
    assert popped == sorted(popped, reverse=True)  # by effective priority
    assert all(effective[i] <= items[i][0] for i in range(len(items)))


@pytest.mark.parametrize(
    ("numel", "size", "servers"), [(10, 3, 2), (7, 7, 3), (1, 5, 2), (0, 4, 2), (100, 9, 3)]
)
def test_round_robin_slices_cover_every_element_once(numel: int, size: int, servers: int) -> None:
    plan = RoundRobinPlacement(servers, size).plan("w", numel)
    assert plan[0].start == 0 and plan[-1].stop == numel
    assert all(a.stop == b.start for a, b in zip(plan, plan[1:]))
    assert all(part.numel <= size for part in plan)
    assert all((b.server - a.server) % servers == 1 % servers for a, b in zip(plan, plan[1:]))


def test_placement_is_the_same_in_every_process() -> None:
    assert RoundRobinPlacement(3, 4).plan("layer.weight", 10) == RoundRobinPlacement(3, 4).plan(
        "layer.weight", 10
    )


@pytest.mark.parametrize(
    ("slice_size", "water_mark", "match"), [(-1, 10, "slice_size"), (10, 0, "water_mark")]
)
def test_bad_options_name_the_knob(slice_size: int, water_mark: int, match: str) -> None:
    with pytest.raises(KVStoreError, match=match):
        P3Options(slice_size, water_mark)


def test_auto_slice_size() -> None:
    assert P3Options.from_env("auto", 4).auto and P3Options(0, 4).auto and not P3Options(10, 4).auto
    with pytest.raises(KVStoreError, match="'auto'"):
        P3Options.from_env("big")


def _run_search(cost: Callable[[Config], float], **options: object) -> AutoTuner:
    """Drive a tuner with a synthetic iteration-time function, as the store's pushes would."""
    applied: list[Config] = []
    clock = [0.0]
    tuner = AutoTuner(applied.append, lambda seconds: seconds, clock=lambda: clock[0], **options)  # type: ignore[arg-type]
    for _ in range(200):
        tuner.observe("first key")
        tuner.observe("other key")  # only the first key pushed marks iterations
        clock[0] += cost(tuner.current)
        if tuner.result is not None:
            break
    assert applied[-1] == tuner.result
    return tuner


def test_tuner_finds_the_best_point_of_a_bowl() -> None:
    best = (80_000, 4, "during")

    def cost(config: Config) -> float:
        slices, marks = SLICE_SIZES.index(config[0]), WATER_MARKS.index(config[1])
        return (
            1.0
            + 0.1 * abs(slices - SLICE_SIZES.index(best[0]))
            + 0.05 * abs(marks - WATER_MARKS.index(best[1]))
        )

    tuner = _run_search(cost)
    assert tuner.result == best
    # a handful of points (one past each axis' optimum, the best one scored again before the water
    # mark's walk), not the 56-point grid
    assert len(tuner.history) <= 11


def test_one_lucky_score_of_the_start_does_not_anchor_the_search() -> None:
    """The start's iterations take 0.5 through the warm-up and its first trial (a quiet moment), 1.0
    after: 160k's 0.9 must still win (the start is scored again after the send timing's walk)."""
    scores = iter([0.5] * (AutoTuner.warmup + AutoTuner.steps_per_trial))

    def cost(config: Config) -> float:
        if config == (40_000, 10, "during"):
            return next(scores, 1.0)
        return 0.9 if config == (160_000, 10, "during") else 1.2

    assert _run_search(cost, timings=SEND_TIMINGS).result == (160_000, 10, "during")


def test_one_unlucky_score_does_not_end_the_walk() -> None:
    """80k scores no better than 40k (noise), but 160k is much better: the walk goes on past 80k."""
    slice_cost = {40_000: 1.0, 80_000: 1.01, 160_000: 0.8, 320_000: 0.85}
    result = _run_search(lambda config: slice_cost.get(config.slice_size, 1.2) + abs(config.water_mark - 10) / 100).result
    assert result == (160_000, 10, "during")


def test_tuner_with_fixed_slicing_tunes_only_the_water_mark() -> None:
    tuner = AutoTuner(lambda config: None, lambda seconds: seconds)
    tuner.fix_slice_size()
    result = _run_search(lambda config: 1.0 + abs(config[1] - 20) / 100, slice_sizes=tuner.slice_sizes).result
    assert result == (40_000, 20, "during")


def test_flat_costs_choose_the_biggest_slices_and_the_highest_water_mark() -> None:
    """Equal iteration times: fewer requests, and fewer notices and sender wake-ups, are the cheaper choices."""
    assert _run_search(lambda config: 1.0).result == (SLICE_SIZES[-1], WATER_MARKS[-1], "during")


def test_short_iterations_are_scored_over_the_minimum_trial_time() -> None:
    """50 ms iterations: each point runs 11 (one discarded, ten scored = 0.5 s), not 4."""

    def iterations_per_point(min_trial_seconds: float) -> float:
        iterations = [0]

        def cost(config: Config) -> float:
            iterations[0] += 1
            return 0.05

        tuner = _run_search(cost, min_trial_seconds=min_trial_seconds)
        return (iterations[0] - tuner.warmup) / len(tuner.history)

    assert iterations_per_point(0.5) >= 11
    assert iterations_per_point(0.0) <= 4.2


def test_workers_with_different_paces_switch_at_the_same_iterations() -> None:
    """A sync job's workers must change slicing together: the trial length comes from the agreed pace."""

    def switch_iterations(seconds_per_iteration: float) -> list[int]:
        switches: list[int] = []
        iteration = [0]
        clock = [0.0]
        tuner = AutoTuner(lambda config: switches.append(iteration[0]), lambda seconds: 0.065,  # the agreed mean
                          clock=lambda: clock[0])  # fmt: skip
        while tuner.result is None and iteration[0] < 1000:
            iteration[0] += 1
            tuner.observe("first key")
            clock[0] += seconds_per_iteration
        return switches

    assert switch_iterations(0.05) == switch_iterations(0.08)


def test_ties_cannot_drift_from_the_best_cost() -> None:
    """Each bigger slice 2 % slower than the last: within the 3 % tolerance of the previous one,
    but only the first is within it of the best."""
    result = _run_search(lambda config: 1.0 + 0.02 * max(0, SLICE_SIZES.index(config.slice_size) - 3)).result
    assert result is not None and result.slice_size == 80_000


def test_a_tie_going_up_still_looks_down_for_a_real_improvement() -> None:
    slice_cost = {5_000: 0.95, 10_000: 0.8, 20_000: 0.9, 40_000: 1.0, 80_000: 1.01, 160_000: 1.3, 320_000: 1.3}
    result = _run_search(lambda config: slice_cost[config.slice_size] + abs(config.water_mark - 10) / 100).result
    assert result == (10_000, 10, "during")


def test_done_callbacks_run_once_on_success_failure_or_at_once() -> None:
    calls: list[tuple[str, object]] = []
    handle = Handle("pull", parts=2)
    handle.add_done_callback(lambda done: calls.append(("first", done.error)))
    handle.part_done()
    assert calls == [] and not handle.done()
    handle.part_done()
    handle.part_done()  # a stray extra completion must not run callbacks again
    assert calls == [("first", None)]
    handle.add_done_callback(lambda done: calls.append(("late", done.error)))  # already done: runs now
    assert calls[-1] == ("late", None)
    failing = Handle("push", parts=3)
    failing.add_done_callback(lambda done: calls.append(("failed", type(done.error).__name__)))
    failing.fail(KVStoreError("server 1 is gone"))
    failing.fail(KVStoreError("again"))
    assert calls[-1] == ("failed", "KVStoreError") and len(calls) == 3
    with pytest.raises(KVStoreError, match="gone"):
        failing.wait(timeout=1)


def test_slicing_can_only_be_fixed_before_the_search() -> None:
    tuner = _run_search(lambda config: 1.0)
    assert not tuner.slicing_fixed
    with pytest.raises(RuntimeError, match="before tuning starts"):
        tuner.fix_slice_size()
    with pytest.raises(RuntimeError, match="before tuning starts"):
        tuner.tune_send_timing()


def test_tuner_chooses_the_send_timing_first_then_tunes_for_it() -> None:
    """A fast link: sending after backward wins, and then bigger slices and a higher water mark do."""

    def cost(config: Config) -> float:
        overlap = SEND_TIMINGS.index("serial") - SEND_TIMINGS.index(config.send_timing)
        # overlap: slower, wherever it goes, the more of it the slower
        return 1.0 + overlap - 0.05 * SLICE_SIZES.index(config.slice_size) - 0.02 * WATER_MARKS.index(config.water_mark)

    tuner = _run_search(cost, timings=SEND_TIMINGS)
    assert [config for config, _ in tuner.history[:3]] == [(40_000, 10, timing) for timing in SEND_TIMINGS]
    assert tuner.result == (SLICE_SIZES[-1], WATER_MARKS[-1], "serial")


def test_the_send_timing_is_checked_again_at_the_slicing_chosen() -> None:
    """A CPU-bound machine: at the start's 40k slices the serial step scores worse, so the search keeps
    overlapping (during and after tie: it takes the one with less overlap); at the big slices it then
    picks, the serial step is clearly faster."""

    def cost(config: Config) -> float:
        bigger = SLICE_SIZES.index(config.slice_size) - SLICE_SIZES.index(40_000)
        return 1.05 - 0.1 * bigger if config.send_timing == "serial" else 1.0 - 0.04 * bigger

    tuner = _run_search(cost, timings=SEND_TIMINGS)
    assert [config for config, _ in tuner.history[1:3]] == [(40_000, 10, "after"), (40_000, 10, "serial")]
    # the best scored again, then the slice sizes' walk, for the timing kept
    assert [config for config, _ in tuner.history[3:5]] == [(40_000, 10, "after"), (80_000, 10, "after")]
    assert tuner.result == (SLICE_SIZES[-1], WATER_MARKS[-1], "serial")  # the water mark is flat here: ties go up
    # one more point, scored again before the water mark's walk
    assert [config for config, _ in tuner.history].count((SLICE_SIZES[-1], 10, "serial")) == 2
    water_marks = [config.water_mark for config, _ in tuner.history if config.send_timing == "serial"]
    assert len(set(water_marks)) > 1  # the water mark is tuned for the timing chosen
