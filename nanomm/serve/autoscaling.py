"""How many replicas each pool wants: the load each replica reports, and the three policies that read it.

Lesson: lessons/15-scaling-each-pool.md. Used by nanomm/serve/ray.py (Ray Serve), and by the simulator
(nanomm/sim/autoscaling.py), which runs these same policy objects on its own clock.

Every replica keeps a `LoadWindow` over the last few seconds and reports three numbers:

- `visual_tokens_per_s`: visual tokens of the requests that arrived (what encoders and prefill instances are
  asked to do, whether or not they keep up);
- `in_flight`: requests it holds now (on a decode instance: its running sequences);
- `first_answer_p95_s`: the 95th percentile of arrival -> its first answer (the handoff for a prefill
  instance, the first token for a decode or integrated instance, the encode, its queue included, for an
  encoder).

A policy turns the reports of one pool's replicas into the replicas that pool should have. Ray applies the
bounds and the up and down delays around it (its own `AutoscalingConfig`), so a policy here is one formula:

- `default`: Ray's own policy, ongoing requests per replica against `target_ongoing_requests`; `RequestsPolicy`
  is the same rule for the simulator. Every request counts the same, whether it carries no picture or four
  thousand visual tokens.
- `LoadPolicy`: the pool's load against one replica's capacity, from the cost model: visual tokens per second
  for encoders and prefill instances, running sequences for decode instances.
- `SLOPolicy`: feedback on the first-answer p95 against the pool's share of the TTFT target: up in proportion
  when over it, down one replica when well under it.

Nothing here imports Ray or torch: the policies are plain objects over a context with `current_num_replicas`
and `aggregated_metrics` (Ray's `AutoscalingContext` has both), so tests and the simulator call them directly.
"""

import math
from collections import deque
from dataclasses import dataclass

POLICIES = ("default", "load", "slo")
# policy "slo": each pool's share of the TTFT target, the part of a first token's time that pool takes (a prefill
# instance waits for its encode, a decode instance's first token comes after the KV pull)
SLO_SHARES = {"encoder": 0.4, "prefill": 0.8, "decode": 0.2, "integrated": 1.0}
LOAD_SIGNAL = {"encoder": "visual_tokens_per_s", "prefill": "visual_tokens_per_s", "integrated": "in_flight",
               "decode": "in_flight"}  # which report measures a pool's load (policy "load")


class LoadWindow:
    """One replica's arrivals, answers and requests in flight over the last `window_s` seconds."""

    def __init__(self, window_s: float = 10.0):
        self.window_s = window_s
        self.arrivals: deque[tuple[float, float]] = deque()  # (time, visual tokens)
        self.answers: deque[tuple[float, float]] = deque()  # (time, seconds from arrival to first answer)
        self.in_flight = 0

    def arrive(self, now: float, visual_tokens: float) -> None:
        self.arrivals.append((now, visual_tokens))
        self.in_flight += 1

    def first_answer(self, now: float, seconds: float) -> None:
        self.answers.append((now, seconds))

    def leave(self) -> None:
        self.in_flight -= 1

    def report(self, now: float) -> dict[str, float]:
        for events in (self.arrivals, self.answers):
            while events and events[0][0] < now - self.window_s:
                events.popleft()
        latencies = sorted(seconds for _, seconds in self.answers)
        p95 = latencies[min(len(latencies) - 1, math.ceil(0.95 * len(latencies)) - 1)] if latencies else 0.0
        return {"visual_tokens_per_s": sum(tokens for _, tokens in self.arrivals) / self.window_s,
                "in_flight": float(self.in_flight), "first_answer_p95_s": p95}


def _pool_total(ctx, metric: str) -> float:
    """The sum over the pool's replicas of one reported metric (each already averaged over Ray's look-back)."""
    return sum((ctx.aggregated_metrics or {}).get(metric, {}).values())


def _pool_mean(ctx, metric: str) -> float:
    values = list((ctx.aggregated_metrics or {}).get(metric, {}).values())
    return sum(values) / len(values) if values else 0.0


@dataclass
class RequestsPolicy:
    """Requests in flight per replica against `target`: Ray's default rule, for the simulator (on Ray, the
    policy "default" is Ray's own, on the requests its handles count)."""
    target: float = 2.0

    def __call__(self, ctx) -> tuple[int, dict]:
        return math.ceil(_pool_total(ctx, "in_flight") / self.target), {}


@dataclass
class LoadPolicy:
    """The pool's load over `utilization` x one replica's `capacity` (same unit as the pool's load signal)."""
    role: str
    capacity: float
    utilization: float = 0.7

    def __post_init__(self):
        if self.role not in LOAD_SIGNAL:
            raise ValueError(f"no load signal for the role {self.role!r}; roles: {sorted(LOAD_SIGNAL)}")
        if not self.capacity > 0 or not 0 < self.utilization <= 1:
            raise ValueError(f"capacity must be > 0 and utilization in (0, 1], got {self.capacity}, {self.utilization}")

    def __call__(self, ctx) -> tuple[int, dict]:
        load = _pool_total(ctx, LOAD_SIGNAL[self.role])
        return math.ceil(load / (self.capacity * self.utilization)), {}


@dataclass
class SLOPolicy:
    """First-answer p95 (mean over the pool's replicas) against `target_s`: over it, grow in proportion;
    under `low` x target_s, shrink by one; in between, stay."""
    target_s: float
    low: float = 0.5

    def __call__(self, ctx) -> tuple[int, dict]:
        current = ctx.current_num_replicas
        p95 = _pool_mean(ctx, "first_answer_p95_s")
        if p95 > self.target_s:
            return math.ceil(current * p95 / self.target_s), {}
        if p95 < self.low * self.target_s:
            return current - 1, {}
        return current, {}


def replica_capacity(costs, role: str, max_num_seqs: int, tpot_slo_s: float = 0.05, picture_tokens: int = 1024,
                     context_tokens: int = 2048) -> float:
    """One replica's capacity in its pool's load unit, from a cost model (nanomm/emulate/costs.py's CostModel):

    - encoder: visual tokens per second, encoding pictures of `picture_tokens` (4 patches a token) one by one;
    - prefill: visual tokens per second, prefilling such pictures one by one. Its pictures' tokens come from the
      encoder service ahead of its steps (engine/encode_ahead.py), so each costs it the prefill alone;
    - decode, integrated: the running sequences whose decode step, at `context_tokens` each, fits the TPOT
      target (at most max_num_seqs)."""
    if role == "encoder":
        return picture_tokens / costs.encode_seconds([4 * picture_tokens])
    if role == "prefill":
        return picture_tokens / costs.step_seconds([(picture_tokens, picture_tokens)])
    sequences = 1
    while sequences < max_num_seqs and costs.step_seconds([(1, context_tokens)] * (sequences + 1)) <= tpot_slo_s:
        sequences += 1
    return float(sequences)
