"""The shifting day against nanomm on Ray Serve, once per autoscaling policy, on the emulated device.

    nanomm-bench day --policy default load slo --json lessons/data/15-day.json

Lesson: lessons/15-scaling-each-pool.md.

For each policy: a local Ray cluster (on 127.0.0.1) serves `nanomm.serve.ray:app topology=1e1p1d` on emulated GPUs;
the load generator's `day` trace (nanomm/bench/load.py: chat, then image-heavy pages, then long answers) is sent
open-loop; every second the Ray controller's replica count of each pool is recorded. Reported per policy: the
share of requests within the SLOs (TTFT and TPOT), by phase and overall; each pool's replica-seconds (a replica
counts from the moment Ray starts it until it stops, as a GPU would be held); and each pool's most replicas in
each phase.
"""

import argparse
import asyncio
import json
import os
import random
import threading
import time
from dataclasses import asdict, replace
from pathlib import Path

from nanomm.bench.load import TRACES, run_schedule, trace_schedule
from nanomm.bench.machine import machine_info

POOLS = ("encoder", "prefill", "decode")


def app_args(policy: str, args) -> dict:
    return {"topology": "1e1p1d", "emulate": args.emulate, "policy": policy, "min_replicas": 1,
            "max_replicas": args.max_replicas, "upscale_delay_s": args.upscale_delay, "downscale_delay_s":
            args.downscale_delay, "look_back_period_s": 2, "window_s": 4, "target_ongoing_requests": 2,
            "tpot_slo_s": args.capacity_tpot, "utilization": args.utilization, "ttft_slo_s": args.slo_ttft}


class ReplicaTimeline:
    """Every `period_s`, each pool's replicas as Ray's controller reports them (all but those stopping)."""

    def __init__(self, app_name: str, period_s: float = 1.0):
        self.app_name, self.period_s = app_name, period_s
        self.samples: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self.start = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def _run(self):
        from ray import serve

        while not self._stop.wait(self.period_s):
            deployments = serve.status().applications[self.app_name].deployments
            states = {pool: deployments[pool].replica_states for pool in POOLS}
            counts = {pool: sum(n for state, n in states[pool].items() if state != "STOPPING") for pool in POOLS}
            starting = {f"{pool} starting": states[pool].get("STARTING", 0) for pool in POOLS}
            self.samples.append({"t": time.monotonic() - self.start, **counts, **starting})


def replica_seconds(samples: list[dict], period_s: float) -> dict[str, float]:
    return {pool: sum(s[pool] for s in samples) * period_s for pool in POOLS}


def replica_start_s(samples: list[dict], period_s: float) -> float | None:
    """How long a new replica takes to serve: the seconds replicas spent starting over the replicas started."""
    started = sum(max(0, b[pool] - a[pool]) for a, b in zip(samples, samples[1:]) for pool in POOLS)
    starting_s = sum(s[f"{pool} starting"] for s in samples for pool in POOLS) * period_s
    return starting_s / started if started else None


def most_replicas_by_phase(samples: list[dict], phases: list[tuple[str, float]]) -> dict[str, dict[str, int]]:
    """Each pool's most replicas in each phase's last two thirds, phases given as (name, seconds): a phase's
    first third still holds the replicas the phase before it grew, until the downscale delay has passed."""
    most, start = {}, 0.0
    for name, seconds in phases:
        late = [s for s in samples if start + seconds / 3 <= s["t"] < start + seconds]
        most[name] = {pool: max((s[pool] for s in late), default=0) for pool in POOLS}
        start += seconds
    return most


def within_slo(record: dict, slo_ttft: float, slo_tpot: float) -> bool:
    if record["error"] is not None or record["first_token_at"] is None:
        return False
    ttft = record["first_token_at"] - record["sent_at"]
    tokens = record["completion_tokens"]
    tpot = (record["finished_at"] - record["first_token_at"]) / (tokens - 1) if tokens > 1 else 0.0
    return ttft <= slo_ttft and tpot <= slo_tpot


def summarize(records: list[dict], timeline: ReplicaTimeline, trace, args) -> dict:
    phases = [p.name for p in trace]
    good = {name: [within_slo(r, args.slo_ttft, args.slo_tpot) for r in records if r["phase"] == name]
            for name in phases}
    return {"requests": len(records), "errors": sum(r["error"] is not None for r in records),
            "slo_attainment": sum(map(sum, good.values())) / len(records),
            "slo_attainment_by_phase": {name: sum(g) / len(g) for name, g in good.items() if g},
            "replica_seconds": replica_seconds(timeline.samples, timeline.period_s),
            "replica_start_s": replica_start_s(timeline.samples, timeline.period_s),
            "most_replicas_by_phase": most_replicas_by_phase(timeline.samples, [(p.name, p.seconds) for p in trace]),
            "timeline": timeline.samples,
            "records": records}


def run_policy(policy: str, args, trace, url: str) -> dict:
    from ray import serve

    from nanomm.serve.ray import app

    serve.run(app(app_args(policy, args)), name="nanomm", route_prefix="/")
    schedule = trace_schedule(trace, args.seed)
    warm = [replace(a, at=0.0, phase="warm-up") for a in schedule[:2]]
    asyncio.run(run_schedule(url, args.emulate, warm, random.Random(-1), pictures="smooth"))
    try:
        with ReplicaTimeline("nanomm") as timeline:
            records = asyncio.run(run_schedule(url, args.emulate, schedule, random.Random(args.seed + 1),
                                               pictures="smooth"))
    finally:
        serve.delete("nanomm")
    return summarize([asdict(r) for r in records], timeline, trace, args)


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--policy", nargs="+", default=["default", "load", "slo"])
    p.add_argument("--emulate", default="l4:qwen2.5-vl-3b", metavar="GPU:MODEL")
    p.add_argument("--trace", default="day", choices=sorted(TRACES))
    p.add_argument("--time-scale", type=float, default=1.0, help="each phase's length times this")
    p.add_argument("--max-replicas", type=int, default=5, help="each pool's ceiling")
    p.add_argument("--upscale-delay", type=float, default=1.0), p.add_argument("--downscale-delay", type=float, default=15.0)
    p.add_argument("--slo-ttft", type=float, default=2.0), p.add_argument("--slo-tpot", type=float, default=0.05)
    p.add_argument("--capacity-tpot", type=float, default=0.035,
                   help="policy load: a decode replica's capacity is the sequences whose step fits this")
    p.add_argument("--utilization", type=float, default=0.5, help="policy load: the share of a replica's capacity "
                   "to plan for (queues stay short below it)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json")


def main(args) -> int:
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # one machine: every Ray process on 127.0.0.1
    import ray
    from ray import serve

    from nanomm.serve.testing import free_local_port

    command = args.command_line
    trace = tuple(replace(p, seconds=p.seconds * args.time_scale) for p in TRACES[args.trace])
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    port = free_local_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    results = {}
    try:
        for policy in args.policy:
            result = run_policy(policy, args, trace, f"http://127.0.0.1:{port}")
            results[policy] = result
            print(f"{policy:8} within SLO {result['slo_attainment']:.1%} "
                  f"({', '.join(f'{k} {v:.0%}' for k, v in result['slo_attainment_by_phase'].items())}); "
                  f"replica-seconds {', '.join(f'{k} {v:.0f}' for k, v in result['replica_seconds'].items())}; "
                  f"most replicas {result['most_replicas_by_phase']}; errors {result['errors']}", flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
    if args.json:
        Path(args.json).write_text(json.dumps({"command": command, "machine": machine_info(),
                                               "app_args": {p: app_args(p, args) for p in args.policy},
                                               "trace": [asdict(p) for p in trace], "slo_ttft_s": args.slo_ttft,
                                               "slo_tpot_s": args.slo_tpot, "results": results}, indent=1))
    return 0
