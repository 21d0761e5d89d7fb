"""The autoscaling day replayed in the simulator: each policy's measured run against what the simulator predicts.

    nanomm-bench autoscale --replay lessons/data/15-day.json --host-costs lessons/data/13-twin-host.json

Lesson: lessons/15-scaling-each-pool.md. The model is nanomm/sim/autoscaling.py; the runs are `nanomm-bench day`'s.
"""

import argparse
import json
from pathlib import Path

from nanomm.sim.autoscaling import POOLS, replayed_requests, simulate, summarize
from nanomm.sim.twin import HostCosts, TwinCosts


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--replay", required=True, help="`nanomm-bench day`'s JSON: each policy's run")
    p.add_argument("--host-costs", help="HostCosts JSON (nanomm-bench stage-costs --emulate)")
    p.add_argument("--replica-start", type=float, help="seconds a new replica takes to serve (default: the run's)")
    p.add_argument("--json")


def main(args) -> int:
    day = json.loads(Path(args.replay).read_text())
    host = HostCosts.from_json(json.loads(Path(args.host_costs).read_text())) if args.host_costs else HostCosts()
    phases = [phase["name"] for phase in day["trace"]]
    predictions = {}
    for policy, run in day["results"].items():
        app_args = day["app_args"][policy]
        costs = TwinCosts.for_twin(app_args["emulate"], host)
        start_s = args.replica_start or run.get("replica_start_s", 6.0)
        requests, request_phases = replayed_requests(run)
        result = simulate(requests, costs, policy, app_args, start_s)
        predictions[policy] = summarize(result, request_phases, phases, day["slo_ttft_s"], day["slo_tpot_s"])
        measured, predicted = run, predictions[policy]
        print(f"{policy:8} within SLO {measured['slo_attainment']:.1%} / {predicted['slo_attainment']:.1%}; "
              "replica-seconds " + ", ".join(f"{pool} {measured['replica_seconds'][pool]:.0f} / "
                                             f"{predicted['replica_seconds'][pool]:.0f}" for pool in POOLS)
              + " (measured / simulated)")
    if args.json:
        Path(args.json).write_text(json.dumps({"replay": args.replay, "predictions": predictions}, indent=1))
    return 0
