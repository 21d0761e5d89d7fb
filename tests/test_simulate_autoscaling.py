"""The shifting trace (`nanomm-bench load --trace`) and the simulator's autoscaler (nanomm/sim/autoscaling.py),
by hand: Ray's delays and start time on a pool, and the load policy growing the pools an image burst loads."""

from nanomm.bench.load import TRACES, Phase, trace_schedule
from nanomm.sim.autoscaling import ScaledPool, simulate, summarize
from nanomm.sim.events import EventClock
from nanomm.sim.twin import HostCosts, TwinCosts
from nanomm.sim.workload import SimRequest


def test_a_trace_ramps_each_phase_s_rate_and_keeps_its_mix():
    trace = (Phase("a", 100, 1.0, 3.0, "0x28x28:1", 8), Phase("b", 50, 2.0, 2.0, "1x448x448:1", 64))
    schedule = trace_schedule(trace, seed=3)
    first = [a for a in schedule if a.phase == "a"]
    second = [a for a in schedule if a.phase == "b"]
    assert schedule == sorted(schedule, key=lambda a: a.at) and len(first) + len(second) == len(schedule)
    assert all(0 <= a.at < 100 and a.entry.num_images == 0 and a.max_tokens == 8 for a in first)
    assert all(100 <= a.at < 150 and a.entry.num_images == 1 and a.max_tokens == 64 for a in second)
    # the ramp: a mean rate of 2/s over 100 s, more in its second half (rate 2..3) than its first (1..2)
    assert 160 <= len(first) <= 240 and len([a for a in first if a.at >= 50]) > len([a for a in first if a.at < 50])
    assert 70 <= len(second) <= 130
    assert trace_schedule(trace, seed=3) == schedule and trace_schedule(trace, seed=4) != schedule
    assert [p.name for p in TRACES["day"]] == ["chat", "pages", "long answers"]


class Wanting:
    """A policy that asks for whatever the test says."""

    def __init__(self):
        self.replicas = 1

    def __call__(self, context):
        return self.replicas, {}


def test_a_pool_follows_its_policy_after_ray_s_delays_and_the_start_time():
    clock, policy = EventClock(), Wanting()
    config = {"initial_replicas": 1, "window_s": 4, "look_back_period_s": 2, "min_replicas": 1, "max_replicas": 4,
              "upscale_delay_s": 2.0, "downscale_delay_s": 5.0}
    pool = ScaledPool("prefill", policy, config, clock, make_worker=lambda window: object(), start_s=3.0)
    seen = {}

    def tick():
        pool.control()
        seen[round(clock.now, 1)] = (pool.count, len(pool.serving))
        if clock.now < 20:
            clock.at(clock.now + 0.5, tick)

    policy.replicas = 9  # more than max_replicas: 4
    clock.at(0.0, tick)
    clock.at(10.0, lambda: setattr(policy, "replicas", 0))  # fewer than min_replicas: 1
    clock.run()
    assert seen[1.5] == (1, 1)  # asked for at 0, not yet 2 s
    assert seen[2.0] == (4, 1)  # after the upscale delay: 4 counted, starting
    assert seen[5.0] == (4, 4)  # 3 s later they serve
    assert seen[14.5] == (4, 4) and seen[15.0] == (1, 1)  # down at 10 + the 5 s downscale delay


def ramping_pages(seconds: float, rate_end: float) -> list[SimRequest]:
    """1400 x 1400 pictures (2,500 visual tokens), 4-token answers, arriving ever faster: 0.5/s up to rate_end."""
    schedule = trace_schedule((Phase("pages", seconds, 0.5, rate_end, "1x1400x1400:1", 4),), seed=0)
    return [SimRequest(i, a.at, (2500,), 20, a.max_tokens) for i, a in enumerate(schedule)]


def test_the_load_policy_grows_encoders_and_prefill_under_pictures_sooner_than_the_default():
    """Two minutes of 1400 x 1400 pictures on emulated L4s, ever more of them (0.5 up to 3.5 a second), more
    than one prefill replica serves. Under `load` the encoder and prefill pools grow and the decode pool does not;
    Ray's default (2 ongoing requests a replica) grows the prefill pool only once requests queue, later, and no
    more requests make the SLO."""
    costs = TwinCosts.for_twin("l4:qwen2.5-vl-3b", HostCosts())
    requests = ramping_pages(120, 3.5)
    runs = {}
    for policy in ("load", "default"):
        app_args = {"topology": "1e1p1d", "emulate": "l4:qwen2.5-vl-3b", "policy": policy, "max_replicas": 4,
                    "upscale_delay_s": 1.0, "downscale_delay_s": 15.0, "look_back_period_s": 2, "window_s": 4,
                    "target_ongoing_requests": 2, "utilization": 0.5}
        result = simulate(requests, costs, policy, app_args, start_s=6.0)
        runs[policy] = (result, summarize(result, ["burst"] * len(requests), ["burst"], 2.0, 0.05))
    timeline = runs["load"][0]["timeline"]
    peak = {pool: max(s[pool] for s in timeline) for pool in ("encoder", "prefill", "decode")}
    # at 3.5 pictures a second, a 2,520-token prefill of about 0.23 s on the L4 (and a tower about as long) keeps
    # 3.5 x 0.23 = 0.8 of a replica busy: at utilization 0.5 the policy asks for 2 of each
    assert peak["encoder"] >= 2 and peak["prefill"] >= 2 and peak["decode"] == 1

    def second_prefill_at(policy):
        return next(s["t"] for s in runs[policy][0]["timeline"] if s["prefill"] >= 2)

    assert second_prefill_at("load") < second_prefill_at("default")
    assert runs["load"][1]["slo_attainment"] >= runs["default"][1]["slo_attainment"]


def test_the_ray_app_s_topology_names_each_pool_and_its_first_replicas():
    """AppSpec (Ray-free, what the simulator and the Ray app both read) takes the one grammar: its counts are each
    pool's first replicas, within the bounds."""
    from nanomm.serve.app_spec import AppSpec

    spec = AppSpec(topology="2e3p1d", max_replicas=4)
    assert spec.pools == {"encoder": 2, "prefill": 3, "decode": 1} and spec.split
    assert [spec.initial_replicas_of(role) for role in spec.pools] == [2, 3, 1]
    assert AppSpec(topology="dp3").pools == {"integrated": 3} and not AppSpec(topology="integrated").split
    assert AppSpec(topology="2e3p1d", initial_replicas=2).initial_replicas_of("prefill") == 2  # given wins
