"""The one percentile every tool reports with: the load generator, the simulators, the validation and the day.

Lesson: lessons/11-serving-under-load.md.
"""

import math


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (q from 0 to 100) with linear interpolation between ranks, numpy's default; None when
    there is nothing to rank."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)
