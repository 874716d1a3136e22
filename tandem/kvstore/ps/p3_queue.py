"""A priority queue that never reorders two items of one lane: P3's send and receive order.

P3 sends the highest-priority slice first, FIFO among equal priorities. Reordering across keys is
the point; reordering *within* one slot is a bug: a pull queued after a push of the same slice must
not overtake it, or it returns the value from before that push. A lane is such a slot; an item's
*effective* priority is capped at the effective priority of the item queued before it in its lane,
so a lane's items always leave in order while different lanes still overtake each other.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable
from typing import Generic, TypeVar

Item = TypeVar("Item")


class LanePriorityQueue(Generic[Item]):
    """Highest priority first, FIFO on ties, lane order always kept. Thread safety: none (callers lock)."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, Hashable, Item]] = []
        self._order = itertools.count()
        self._lanes: dict[
            Hashable, list[int]
        ] = {}  # lane -> [effective priority of its last item, items queued]

    def put(self, item: Item, priority: int, lane: Hashable) -> int:
        """Queue ``item``; returns its effective priority (lower than ``priority`` only to keep lane order)."""
        state = self._lanes.get(lane)
        effective = priority if state is None else min(priority, state[0])
        self._lanes[lane] = [effective, 1 if state is None else state[1] + 1]
        heapq.heappush(self._heap, (-effective, next(self._order), lane, item))
        return effective

    def peek(self) -> Item:
        """The item ``pop`` would return; raises IndexError when empty."""
        return self._heap[0][3]

    def pop(self) -> Item:
        """Remove and return the highest-priority item; raises IndexError when empty."""
        _, _, lane, item = heapq.heappop(self._heap)
        state = self._lanes[lane]
        state[1] -= 1
        if state[1] == 0:
            del self._lanes[lane]
        return item

    def __len__(self) -> int:
        return len(self._heap)
