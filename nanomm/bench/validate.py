"""The topology simulator against the twin: the same arrivals, pictures and costs, four shapes, three loads.

    nanomm-bench stage-costs --emulate h200:qwen2-vl-2b --json host.json   # the host's costs first
    nanomm-bench validate --host-costs host.json --json validation.json
    nanomm-bench validate --host-costs host.json --quick                  # the suite's reduced run

Lesson: lessons/13-three-topologies.md (the simulator checked against the twin).

For each topology (integrated, 1e1pd, 1e1p1d, 1e2p1d) the cluster is started once with `nanomm-serve --emulate`
(the load generator's commands, nanomm/bench/load.py), then:

1. capacity: a rate sweep (--sweep) on the twin; capacity is the highest rate up to which at least
   --target-share of the requests met both SLOs;
2. three load levels (--levels, shares of that capacity), each run --runs times with new arrivals and pictures;
3. each run's requests, as the client recorded them, are replayed through the engine-faithful simulator
   (nanomm/sim/twin.py, as `nanomm-bench simulate --emulate ... --replay` runs it), and both are summed up by the
   same functions.

A point is inside its bands when goodput is within 10% of the twin's and TTFT p50, TTFT p90 and TPOT p50 within
15%. The table shows each figure's mean over the runs with its spread (max - min), the bands met, and the share
of the machine's two cores the cluster and the load generator used (its CPU time, from /proc). Not a test:
tests/test_validate_simulator.py runs --quick and checks that the table is produced and complete, never a band.
"""

import argparse
import asyncio
import json
import os
import statistics
import time
from dataclasses import asdict
from pathlib import Path

from nanomm.bench import load
from nanomm.bench.machine import machine_info
from nanomm.sim.stats import percentile
from nanomm.sim.twin import HostCosts, TwinCosts, simulate_twin
from nanomm.sim.workload import requests_from_load

TOPOLOGIES = ("integrated", "1e1pd", "1e1p1d", "1e2p1d")
BANDS = {"goodput": 0.10, "ttft_p50": 0.15, "ttft_p90": 0.15, "tpot_p50": 0.15}


def figures(records: list, slo_ttft_s: float, slo_tpot_s: float) -> dict:
    """Goodput (requests within both SLOs per second, first send to last answer), TTFT p50/p90, TPOT p50."""
    done = [r for r in records if r.error is None and r.finished_at is not None]
    summary = load.summarize(records, 0.0, slo_ttft_s, slo_tpot_s)
    return {"goodput": summary["goodput_rps"], "ttft_p50": percentile([r.ttft_s for r in done], 50),
            "ttft_p90": percentile([r.ttft_s for r in done], 90),
            "tpot_p50": percentile([r.tpot_s for r in done if r.tpot_s is not None], 50),
            "within_slo": summary["slo_attainment"]}


def simulated_records(records: list, topology: str, costs: TwinCosts) -> list:
    """The run's requests replayed through the simulator, as the client would have recorded them."""
    requests = requests_from_load({"records": [asdict(r) for r in records]})
    outcomes, _ = simulate_twin(topology, costs, requests)
    out = []
    for request, result in zip(requests, outcomes):
        record = load.RequestRecord(request.arrival_s, len(request.image_tokens),
                                    prompt_tokens=request.prompt_tokens, completion_tokens=request.output_tokens)
        if result is None:
            record.error = "failed in the simulator (preempted on a decode instance)"
        else:
            ttft, _, finish = result
            record.first_token_at, record.finished_at = request.arrival_s + ttft, finish
        out.append(record)
    return out


def one_run(url: str, args, rate: float, seed: int, processes: dict) -> tuple[list, dict | None]:
    """One open-loop run: its records, and each process's share of the machine's CPU while it ran. Every run
    draws new pictures and words (its own seed): a picture sent before would hit the twin's encoder cache."""
    window = {}

    def start_counting():
        window["cpu"], window["start"] = load.process_cpu_seconds(processes), time.monotonic()

    records = asyncio.run(load.run_load(url, "twin", load.parse_mix(args.mix), rate, args.num_requests,
                                        args.max_tokens, seed=seed, content_seed=seed,
                                        on_start=start_counting, pictures=args.pictures))
    shares = load.cpu_shares(window["cpu"], load.process_cpu_seconds(processes), time.monotonic() - window["start"])
    return records, shares


def find_capacity(url: str, args, processes: dict, log) -> float:
    """The highest swept rate up to which --target-share of requests met both SLOs (the first rate if none)."""
    capacity = args.sweep[0]
    for i, rate in enumerate(args.sweep):
        records, _ = one_run(url, args, rate, seed=100 + i, processes=processes)
        share = figures(records, args.slo_ttft, args.slo_tpot)["within_slo"]
        log(f"  sweep {rate:g} req/s: {share:.0%} within the SLOs")
        if share < args.target_share:
            break
        capacity = rate
    return capacity


def pairs(records: list) -> list[list[float]]:
    """[TTFT, TPOT] in milliseconds of each answered request (TPOT 0 for a one-token answer)."""
    return [[round(r.ttft_s * 1e3, 2), round((r.tpot_s or 0.0) * 1e3, 3)] for r in records
            if r.error is None and r.finished_at is not None]


def compare(measured: dict, predicted: dict) -> dict[str, bool]:
    return {name: measured[name] is not None and predicted[name] is not None
            and abs(predicted[name] - measured[name]) <= band * abs(measured[name]) for name, band in BANDS.items()}


def validate_topology(topology: str, args, costs: TwinCosts, log) -> list[dict]:
    commands, front = load.topology_commands(topology, ["--emulate", args.emulate], "twin", [])
    started = load.start_servers(commands, log)
    processes = {"load": os.getpid(), **{role: p.pid for role, (p, _) in started.items()}}
    try:
        url = started[front][1]
        asyncio.run(load.run_load(url, "twin", load.parse_mix("1x448x448:1"), rate=1e6, num_requests=2,
                                  max_tokens=2, seed=0, content_seed=-1))  # warm-up
        capacity = find_capacity(url, args, processes, log)
        rows = []
        for i, level in enumerate(args.levels):
            rate = level * capacity
            runs = []
            for run in range(args.runs):
                records, shares = one_run(url, args, rate, seed=1000 * (i + 1) + run, processes=processes)
                measured = figures(records, args.slo_ttft, args.slo_tpot)
                predicted = figures(simulated_records(records, topology, costs), args.slo_ttft, args.slo_tpot)
                runs.append({"measured": measured, "predicted": predicted, "in_band": compare(measured, predicted),
                             "cpu_share": shares, "errors": sum(r.error is not None for r in records),
                             "records": [asdict(r) for r in records]})
            rows.append({"topology": topology, "capacity_rps": capacity, "level": level, "rate": rate, "runs": runs})
            log(table_row(rows[-1]))
        return rows
    finally:
        load.stop_servers(started)


def spread(values: list, digits: int) -> str:
    """The mean over the runs, and their spread (max - min) when there are several."""
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    mean = f"{statistics.mean(values):,.{digits}f}"
    return mean if len(values) == 1 else f"{mean} ± {max(values) - min(values):,.{digits}f}"


def table_row(row: dict) -> str:
    runs = row["runs"]
    cells = [row["topology"], f"{row['level']:.0%} of {row['capacity_rps']:g}", f"{row['rate']:.2f}"]
    for name, scale, digits in (("goodput", 1, 2), ("ttft_p50", 1e3, 0), ("ttft_p90", 1e3, 0), ("tpot_p50", 1e3, 2)):
        for side in ("measured", "predicted"):
            cells.append(spread([r[side][name] * scale if r[side][name] is not None else None for r in runs], digits))
    met = sum(all(r["in_band"].values()) for r in runs)
    cpu = [sum(r["cpu_share"].values()) for r in runs if r["cpu_share"]]
    cells += [f"{met}/{len(runs)}", f"{max(cpu):.0%}" if cpu else "-"]
    return "| " + " | ".join(cells) + " |"


def markdown_table(rows: list[dict]) -> str:
    head = ("| topology | load | rate (req/s) | goodput (req/s), twin | simulator | TTFT p50 (ms), twin | simulator "
            "| TTFT p90 (ms), twin | simulator | TPOT p50 (ms), twin | simulator | runs in all bands | CPU share "
            "(max) |")
    return "\n".join([head, "|---|---|" + "---:|" * 11, *(table_row(r) for r in rows)])


def lesson_data(report: dict, costs: TwinCosts) -> dict:
    """The report without its records: each run's figures, CPU shares, and every request's [TTFT, TPOT] as the twin
    measured and the simulator replayed it (lessons/data/13-twin-validation.json, which lesson 13 reads)."""
    rows = []
    for row in report["rows"]:
        runs = []
        for run in row["runs"]:
            records = [load.RequestRecord(**r) for r in run["records"]]
            simulated = simulated_records(records, row["topology"], costs)
            runs.append({"measured": run["measured"], "predicted": run["predicted"], "in_band": run["in_band"],
                         "cpu_share": run["cpu_share"],
                         "duration_s": {"measured": load.summarize(records, row["rate"], 1.0)["duration_s"],
                                        "predicted": load.summarize(simulated, row["rate"], 1.0)["duration_s"]},
                         "pairs": {"measured": pairs(records), "predicted": pairs(simulated)}})
        rows.append({**{k: v for k, v in row.items() if k != "runs"}, "runs": runs})
    keep = ("command", "machine", "args", "costs", "bands", "table")
    return {**{k: report[k] for k in keep}, "rows": rows}


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--emulate", default="h200:qwen2-vl-2b", metavar="GPU:MODEL")
    p.add_argument("--host-costs", required=True, metavar="JSON", help="nanomm-bench stage-costs --emulate")
    p.add_argument("--topologies", nargs="+", default=list(TOPOLOGIES), type=load.startable_topology)
    p.add_argument("--mix", default="1x2240x2240:3,0x0x0:1", help="the load generator's mix")
    p.add_argument("--pictures", default="smooth", choices=load.PICTURES)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--num-requests", type=int, default=60, help="requests per run")
    p.add_argument("--slo-ttft", type=float, default=2.0)
    p.add_argument("--slo-tpot", type=float, default=0.02)
    p.add_argument("--target-share", type=float, default=0.9, help="share within the SLOs that capacity keeps")
    p.add_argument("--sweep", type=float, nargs="+", default=[1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0],
                   help="rates tried for capacity, in order (req/s)")
    p.add_argument("--levels", type=float, nargs="+", default=[0.5, 0.8, 0.95])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="the suite's reduced run: few requests, one run, two rates")
    p.add_argument("--json")
    p.add_argument("--lesson-data", metavar="JSON", help="also write the figures without the records (lesson 13's)")


def check_args(p: argparse.ArgumentParser, args) -> None:
    if args.quick:
        args.num_requests, args.runs, args.sweep, args.max_tokens = 4, 1, [2.0, 4.0], 8
        args.mix = "1x448x448:1,0x0x0:1"


def main(args) -> int:
    command = args.command_line
    machine = machine_info()
    log = print if not args.quick else (lambda line: print(line, flush=True))
    log(f"command: {command}\nmachine: {machine['cpu']}, {machine['usable_cores']} cores")
    with open(args.host_costs) as f:
        costs = TwinCosts.for_twin(args.emulate, HostCosts.from_json(json.load(f)))
    rows = []
    for topology in args.topologies:
        log(f"{topology}:")
        rows += validate_topology(topology, args, costs, log)
    table = markdown_table(rows)
    print(table)
    arguments = {k: v for k, v in vars(args).items() if k not in ("module", "parser")}
    report = {"command": command, "machine": machine, "args": arguments, "costs": costs.describe(), "bands": BANDS,
              "rows": rows, "table": table}
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    if args.lesson_data:
        Path(args.lesson_data).write_text(json.dumps(lesson_data(report, costs)))
    return 0
