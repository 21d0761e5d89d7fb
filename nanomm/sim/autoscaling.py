"""The autoscaler in the simulator: E+P+D pools that grow and shrink as nanomm on Ray Serve's policies say.

    nanomm-bench autoscale --replay lessons/data/15-day.json --host-costs lessons/data/13-twin-host.json

Lesson: lessons/15-scaling-each-pool.md.

The engines are the engine-faithful simulator's (nanomm/sim/twin.py: nanomm's scheduler on the cost
model the twin sleeps on). Around them, what Ray Serve does with nanomm's replicas (nanomm/serve/ray.py):

- each replica keeps the same `LoadWindow` and reports it every `metrics_interval_s`; a pool's metric is each
  replica's mean report over `look_back_period_s`, as Ray's controller aggregates it;
- the same policy objects (nanomm/serve/autoscaling.py) decide each pool's replicas; the `default` policy is
  Ray's rule, ongoing requests over `target_ongoing_requests` (`RequestsPolicy`);
- Ray's bounds and delays: a new count is applied once the policy has asked for more (or fewer) replicas for
  `upscale_delay_s` (or `downscale_delay_s`); a new replica serves after `replica_start_s` (measured on the
  twin run) and counts from the moment it is asked for; a removed one takes no new work and finishes its own;
- routing: each request to the prefill replica with the least outstanding visual tokens, with an encoder lease
  from the encoder replica holding the fewest; its handoff to the decode replica running the fewest requests.

An encoder replica's first answers are its encodes, queue included. Left out: Ray's own request path (the proxy, the handles' hops), so the host delay per request is the
processes-and-router topology's, measured on the twin; the encode of a step goes to the least busy encoder,
not necessarily the one its request leased.
"""

from collections import deque
from dataclasses import dataclass, field, replace
from types import SimpleNamespace

from nanomm.serve.app_spec import AppSpec
from nanomm.serve.autoscaling import SLO_SHARES, LoadPolicy, LoadWindow, RequestsPolicy, SLOPolicy
from nanomm.sim.events import EventClock
from nanomm.topology import parse_topology
from nanomm.sim.twin import EncoderService, TwinCosts, TwinEngine, TwinRequest, outcome
from nanomm.sim.workload import requests_from_load

POOLS = ("encoder", "prefill", "decode")


@dataclass(eq=False)
class Replica:
    worker: object  # a TwinEngine, or an EncoderService
    window: LoadWindow
    reports: list = field(default_factory=list)  # (time, report)
    outstanding: float = 0.0  # what the router charges it: visual tokens (prefill), leases (encoder), requests


class ScaledPool:
    """One pool's replicas, sized by a policy under Ray's bounds and delays."""

    def __init__(self, name: str, policy, config: dict, clock, make_worker, start_s: float):
        self.name, self.policy, self.config, self.clock = name, policy, config, clock
        self.make_worker, self.start_s = make_worker, start_s
        self.serving: list[Replica] = []
        self.starting = 0
        self.wanted_since: tuple[int, float] | None = None  # (direction, since when)
        for _ in range(config["initial_replicas"]):
            self._add()

    @property
    def count(self) -> int:
        return len(self.serving) + self.starting

    def _add(self) -> None:
        window = LoadWindow(self.config["window_s"])
        self.serving.append(Replica(self.make_worker(window), window))

    def _start_one(self) -> None:
        self.starting += 1

        def ready():
            self.starting -= 1
            self._add()

        self.clock.at(self.clock.now + self.start_s, ready)

    def report(self) -> None:
        for replica in self.serving:
            replica.reports.append((self.clock.now, replica.window.report(self.clock.now)))

    def control(self) -> None:
        """One tick of Ray's controller for this pool."""
        look_back = self.clock.now - self.config["look_back_period_s"]
        metrics: dict[str, dict] = {}
        for i, replica in enumerate(self.serving):
            recent = [r for t, r in replica.reports if t >= look_back] or [replica.window.report(self.clock.now)]
            for name in recent[0]:
                metrics.setdefault(name, {})[i] = sum(r[name] for r in recent) / len(recent)
        context = SimpleNamespace(current_num_replicas=self.count, aggregated_metrics=metrics)
        desired, _ = self.policy(context)
        desired = min(self.config["max_replicas"], max(self.config["min_replicas"], desired))
        direction = (desired > self.count) - (desired < self.count)
        if direction == 0:
            self.wanted_since = None
            return
        if self.wanted_since is None or self.wanted_since[0] != direction:
            self.wanted_since = (direction, self.clock.now)
        delay = self.config["upscale_delay_s"] if direction > 0 else self.config["downscale_delay_s"]
        if self.clock.now - self.wanted_since[1] >= delay:
            self.wanted_since = None
            for _ in range(desired - self.count):
                self._start_one()
            for _ in range(self.count - desired):
                if len(self.serving) > 1:  # the least loaded stops taking work and finishes its own
                    self.serving.remove(min(self.serving, key=lambda r: r.outstanding))

    def pick(self) -> Replica:
        return min(self.serving, key=lambda r: r.outstanding)


def make_policy(name: str, role: str, spec) -> object:
    """The policy Ray runs for this pool of the application `spec` (nanomm/serve/app_spec.py's AppSpec) describes."""
    if name == "default":
        return RequestsPolicy(target=spec.target_ongoing_requests)
    if name == "load":
        return LoadPolicy(role=role, capacity=spec.capacity(role), utilization=spec.utilization)
    return SLOPolicy(target_s=SLO_SHARES[role] * spec.ttft_slo_s)


def simulate(requests: list, costs: TwinCosts, policy: str, app_args: dict, start_s: float,
             metrics_interval_s: float = 1.0, tick_s: float = 0.5) -> dict:
    """Every request through autoscaled E+P+D pools: outcomes, and each pool's replicas once a second."""
    spec = AppSpec(**app_args)
    if not spec.split:
        raise ValueError(f"topology {spec.topology!r}: the autoscaling simulator models <X>e<Y>p<Z>d applications")
    clock = EventClock()
    config = {"window_s": spec.window_s,
              "look_back_period_s": spec.look_back_period_s, "min_replicas": spec.min_replicas,
              "max_replicas": spec.max_replicas, "upscale_delay_s": spec.upscale_delay_s,
              "downscale_delay_s": spec.downscale_delay_s}
    encoders_now: list = []  # the serving encoder services, which prefill engines pick from
    pools: dict[str, ScaledPool] = {}

    def decode_engine(window):
        return WatchedEngine(clock, costs, "decode")

    def prefill_engine(window):
        return TwinEngine(clock, costs, "prefill", encoders_now, hand_off)

    def route(track: TwinRequest) -> None:
        track.arrived_s = clock.now
        work = sum(track.request.image_tokens)
        prefill, encoder = pools["prefill"].pick(), pools["encoder"].pick()
        for replica, charge in ((prefill, work), (encoder, 1)):
            replica.outstanding += charge
            replica.window.arrive(clock.now, work)
        track.replicas = (prefill, work, encoder)
        prefill.worker.submit(track)

    def hand_off(track: TwinRequest) -> None:
        prefill, work, encoder = track.replicas
        prefill.outstanding -= work
        encoder.outstanding -= 1
        prefill.window.first_answer(clock.now, clock.now - track.arrived_s)
        prefill.window.leave(), encoder.window.leave()
        taken = track.handed_to = TwinRequest(track.request)

        def arrive():
            decode = pools["decode"].pick()
            decode.outstanding += 1
            decode.window.arrive(clock.now, 0)
            taken.replica, taken.arrived_s = decode, clock.now
            decode.worker.admit_transferred(taken)

        clock.at(clock.now + costs.kv_link_s(track.request.prompt_tokens), arrive)

    for role, make in (("encoder", lambda window: TimedEncoderService(clock, costs, window)),
                       ("prefill", prefill_engine),
                       ("decode", decode_engine)):
        pools[role] = ScaledPool(role, make_policy(policy, role, spec),
                                 {**config, "initial_replicas": spec.initial_replicas_of(role)}, clock, make, start_s)
    _keep_encoders_listed(pools["encoder"], encoders_now)
    tracks = [TwinRequest(r) for r in requests]
    for track in tracks:
        delay = costs.host.request_delay(parse_topology("1e1p1d"), track.request.body_bytes)
        clock.at(track.request.arrival_s + delay, route, track)
    end = max(r.arrival_s for r in requests) + 60
    timeline = []

    def report():
        for pool in pools.values():
            pool.report()
        timeline.append({"t": clock.now, **{name: pool.count for name, pool in pools.items()}})
        if clock.now < end:
            clock.at(clock.now + metrics_interval_s, report)

    def control():
        for pool in pools.values():
            pool.control()
        _keep_encoders_listed(pools["encoder"], encoders_now)
        if clock.now < end:
            clock.at(clock.now + tick_s, control)

    clock.at(0.0, report), clock.at(0.0, control)
    clock.run()
    outcomes = [outcome(t) for t in tracks]
    last = max((o[2] for o in outcomes if o is not None), default=0.0)  # the run ends with its last answer
    return {"outcomes": outcomes, "timeline": [s for s in timeline if s["t"] <= last]}


def _keep_encoders_listed(pool: ScaledPool, listed: list) -> None:
    listed[:] = [replica.worker for replica in pool.serving]


class TimedEncoderService(EncoderService):
    """An encoder service whose jobs' times, the queue included, are its replica's first answers (as
    nanomm/serve/ray.py's TimedEncodes records them)."""

    def __init__(self, clock, costs: TwinCosts, window: LoadWindow):
        super().__init__(clock, costs)
        self.window, self.submitted = window, deque()

    def submit(self, image_tokens: list[int], then) -> None:
        self.submitted.append(self.clock.now)
        super().submit(image_tokens, then)

    def job_done(self, image_tokens: list[int], then) -> None:
        self.window.first_answer(self.clock.now, self.clock.now - self.submitted.popleft())
        super().job_done(image_tokens, then)


class WatchedEngine(TwinEngine):
    """A decode engine that tells its replica's window when a request's first token and its end come."""

    def emit_token(self, track: TwinRequest, now: float) -> None:
        first = track.first_token_s is None
        super().emit_token(track, now)
        replica = track.replica
        if first and track.first_token_s is not None:
            replica.window.first_answer(now, now - track.arrived_s)
        if track.finish_s is not None:
            replica.outstanding -= 1
            replica.window.leave()


def summarize(result: dict, request_phases: list[str], phases: list[str], slo_ttft: float, slo_tpot: float) -> dict:
    good = {name: [] for name in phases}
    for phase, out in zip(request_phases, result["outcomes"]):
        good[phase].append(out is not None and out[0] <= slo_ttft and out[1] <= slo_tpot)
    seconds = {pool: sum(s[pool] for s in result["timeline"]) for pool in POOLS}  # one sample a second
    return {"slo_attainment": sum(map(sum, good.values())) / len(request_phases),
            "slo_attainment_by_phase": {name: sum(g) / len(g) for name, g in good.items() if g},
            "replica_seconds": seconds, "timeline": result["timeline"]}


def replayed_requests(run: dict) -> tuple[list, list[str]]:
    """A policy's measured run (`nanomm-bench day`'s records) as the simulator's requests, on the run's own
    clock (its replica timeline's), and their phases."""
    records = sorted((r for r in run["records"] if r["error"] is None), key=lambda r: r["sent_at"])
    requests = [replace(request, arrival_s=record["sent_at"])
                for request, record in zip(requests_from_load({"records": records}), records)]
    return requests, [r["phase"] for r in records]
