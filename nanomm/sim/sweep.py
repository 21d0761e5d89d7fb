"""Goodput as the highest sustainable rate: the fastest arrivals whose P99 TTFT and P99 TPOT both meet the SLO.

Lesson: lessons/13-three-topologies.md (vLLM's EPD experiment, which defines goodput this way).

`nanomm-bench simulate --p99-goodput LOW HIGH` runs it for each topology. The search halves the interval between a
rate that meets the SLO and one that misses it; a rate's result comes from `run_at(rate)`, a fresh simulation of
requests drawn at that rate (the same seed at every rate: the same arrival pattern, squeezed).
"""

from dataclasses import dataclass
from typing import Callable

from nanomm.sim.stages import SimResult
from nanomm.sim.stats import percentile


@dataclass(frozen=True)
class SustainedRate:
    rate: float  # the highest rate tried that met the SLO; 0.0 if even the lowest missed it
    result: SimResult | None  # that run
    tried: int  # simulations run


def meets_p99(result: SimResult, slo_ttft_s: float, slo_tpot_s: float) -> bool:
    return (percentile(result.ttft_s, 99) <= slo_ttft_s
            and (not result.tpot_s or percentile(result.tpot_s, 99) <= slo_tpot_s))


def highest_rate_within(run_at: Callable[[float], SimResult], slo_ttft_s: float, slo_tpot_s: float,
                        low: float, high: float, relative_step: float = 0.02) -> SustainedRate:
    """The highest rate in [low, high] whose run meets both P99 SLOs, to within relative_step of it (bisection:
    the SLO is assumed met below some rate and missed above it). `high` itself is tried first."""
    top = run_at(high)
    if meets_p99(top, slo_ttft_s, slo_tpot_s):
        return SustainedRate(high, top, 1)
    bottom = run_at(low)
    if not meets_p99(bottom, slo_ttft_s, slo_tpot_s):
        return SustainedRate(0.0, None, 2)
    best, tried = (low, bottom), 2
    while high - best[0] > relative_step * best[0]:
        middle = (best[0] + high) / 2
        result, tried = run_at(middle), tried + 1
        if meets_p99(result, slo_ttft_s, slo_tpot_s):
            best = (middle, result)
        else:
            high = middle
    return SustainedRate(best[0], best[1], tried)
