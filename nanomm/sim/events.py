"""Events in time order, the clock every simulator runs on, and the router's simplest choice.

Lesson: lessons/13-three-topologies.md.
"""

import heapq
import itertools


class EventClock:
    """Events in time order (ties: in the order they were set)."""

    def __init__(self):
        self.now, self._events, self._order = 0.0, [], itertools.count()

    def at(self, t: float, fn, *args) -> None:
        heapq.heappush(self._events, (t, next(self._order), fn, args))

    def run(self) -> None:
        while self._events:
            self.now, _, fn, args = heapq.heappop(self._events)
            fn(*args)


def least_loaded(pool: list):
    """The worker with the fewest requests queued or running (`load()`); min keeps the first of equals."""
    return min(pool, key=lambda worker: worker.load())
