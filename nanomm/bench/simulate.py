"""The topology simulators from the command line: latency, goodput and utilisation of each topology for a mix.

    nanomm-bench simulate                                          # H200 costs: dp3, 1e2pd, 1e1p1d
    nanomm-bench simulate --rate 50 100 200 --topologies dp3 1e2pd 1e1p1d --json sim.json
    nanomm-bench simulate --search --max-workers 8 --rate 150 --mix 4x896x896:1,0x0x0:3
    nanomm-bench simulate --gpu l4 --save-costs l4.json            # write derived costs to edit, or
    nanomm-bench simulate --costs l4.json                          # feed costs measured elsewhere
    nanomm-bench simulate --costs costs.json --replay load.json --topologies integrated 1e1p1d --slo-tpot 0.05
    nanomm-bench simulate --emulate h200:qwen2-vl-2b --host-costs host.json --replay twin.json \\
        --topologies integrated 1e1pd 1e1p1d 1e2p1d          # nanomm's scheduler on the twin's cost model
    nanomm-bench simulate --emulate a100:qwen3-vl-4b --topologies dp4 1e3pd --mix 4x640x640:1 --text-tokens 400 \\
        --output-tokens 150 --slo-ttft 20 --slo-tpot 0.1 --p99-goodput 1 96 --repeats 3   # vLLM's EPD experiment
    nanomm-bench simulate --emulate h200:qwen2-vl-2b --topologies dp4 --sessions 200 --turns 6 --think-time 2 \\
        --mix 1x896x896:1 --rate 20 --routing load affinity    # multi-turn chats: cache-affine routing (lesson 15)

Lesson: lessons/13-three-topologies.md. The models are nanomm/sim/stages.py (StageCosts, a roofline sketch per
stage) and, with --emulate, nanomm/sim/twin.py (nanomm's scheduler on the emulated device's cost model).
Topologies follow the one grammar (nanomm/topology.py); --search tries every size of each shape.
Replay (--replay): instead of drawing requests from --mix, take every answered request of a `nanomm-bench load`
JSON (its `records`), one simulation per rate in it, so a prediction and a measurement see the same arrivals
and pictures. --factor is the pixels per visual token's side (28 for Qwen2-VL; 14 for the demo model).
Sessions (--sessions, with --emulate): multi-turn chats (nanomm/sim/chats.py), --rate their starts per second,
each turn's pictures drawn from --mix; --routing names how the twin's router picks whole engines (twin.py), and
each row then has the prefix- and encoder-cache hit rates.
"""

import argparse
import json
from contextlib import nullcontext
from dataclasses import asdict

from nanomm.bench.cli import topology_arg
from nanomm.emulate.costs import GPUS
from nanomm.inputs.image import DEFAULT_MAX_PIXELS
from nanomm.sim.stages import MODELS, SimResult, StageCosts, search_pools, simulate
from nanomm.sim.sweep import highest_rate_within
from nanomm.topology import SHAPES, parse_topology
from nanomm.sim.twin import HostCosts, TwinCosts
from nanomm.sim.chats import make_chats
from nanomm.sim.workload import FACTOR, make_requests, requests_from_load

SHORT = {"worker": "W", "encode": "E", "lm": "PD", "prefill": "P", "decode": "D"}  # pool labels in the table


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--costs", help="StageCosts JSON (e.g. measured); default: derived for --gpu")
    p.add_argument("--emulate", metavar="GPU:MODEL", help="nanomm's scheduler on the emulated device's cost model "
                   "(nanomm/sim/twin.py) instead of StageCosts, e.g. h200:qwen2-vl-2b")
    p.add_argument("--host-costs", metavar="JSON", help="with --emulate: the host's costs measured on the twin "
                   "(nanomm-bench stage-costs --emulate); default: none (the device alone)")
    p.add_argument("--gpu", default="h200", choices=sorted(GPUS))
    p.add_argument("--model", default="qwen2-vl-2b", choices=sorted(MODELS))
    p.add_argument("--save-costs", metavar="FILE", help="write the costs in use as JSON")
    p.add_argument("--mix", default="1x448x448:1", help="COUNTxWIDTHxHEIGHT:WEIGHT,... (images per request)")
    p.add_argument("--text-tokens", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--max-pixels", type=int, default=DEFAULT_MAX_PIXELS)
    p.add_argument("--factor", type=int, default=FACTOR, help="pixels per visual token's side (the demo model: 14)")
    p.add_argument("--replay", metavar="LOAD_JSON", help="simulate the requests a `nanomm-bench load` run sent "
                   "(its arrivals, pictures and lengths; one run per rate in it) instead of drawing them")
    p.add_argument("--rate", type=float, nargs="+", default=[50.0, 100.0, 200.0], help="requests/s")
    p.add_argument("--num-requests", type=int, default=500)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo-ttft", type=float, default=0.5, help="seconds")
    p.add_argument("--slo-tpot", type=float, default=0.05, help="seconds")
    p.add_argument("--token-budget", type=int, default=2048, help="tokens per engine step")
    p.add_argument("--topologies", nargs="+", type=topology_arg,
                   default=[parse_topology(t) for t in ("dp3", "1e2pd", "1e1p1d")],
                   help="integrated | dp<N> | <X>e<Y>pd | <X>e<Y>p<Z>d")
    p.add_argument("--search", action="store_true", help="for each shape, find the fewest workers meeting "
                   "--target-share")
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=SHAPES, help="searched with --search")
    p.add_argument("--max-workers", type=int, default=8)
    p.add_argument("--target-share", type=float, default=0.9)
    p.add_argument("--p99-goodput", nargs=2, type=float, metavar=("LOW", "HIGH"), help="instead of --rate: each "
                   "topology's highest rate in [LOW, HIGH] whose P99 TTFT and P99 TPOT meet --slo-ttft and "
                   "--slo-tpot (nanomm/sim/sweep.py)")
    p.add_argument("--repeats", type=int, default=1, help="with --p99-goodput: runs of different arrivals and "
                   "pictures (seeds --seed, --seed + 1, ...), each searched on its own")
    p.add_argument("--sessions", type=int, help="with --emulate: this many multi-turn chats instead of single "
                   "requests (--rate: sessions started per second)")
    p.add_argument("--turns", type=int, default=4, help="with --sessions: turns per chat")
    p.add_argument("--think-time", type=float, default=2.0, help="with --sessions: mean seconds between turns")
    p.add_argument("--routing", nargs="+", default=["requests"], choices=["requests", "load", "affinity"],
                   help="with --emulate: how whole engines are picked: the fewest requests (default), the router's "
                        "least work, or cache affinity (serve/affinity.py); several: one row each")
    p.add_argument("--affinity-slack", type=float, default=8192.0, help="with --routing affinity: prompt tokens an "
                   "affine pick may hold beyond the least loaded engine's")
    p.add_argument("--json", metavar="FILE")


def stage_or_twin_costs(args):
    if args.emulate:
        with open(args.host_costs) if args.host_costs else nullcontext() as f:
            host = HostCosts.from_json(json.load(f)) if f else HostCosts()
        return TwinCosts.for_twin(args.emulate, host)
    return StageCosts.from_json(args.costs) if args.costs else StageCosts.for_gpu(args.model, args.gpu)


def format_row(rate: float, result: SimResult | None, what: str) -> str:
    if result is None:
        return f"{what:<11} {'(none fits)':<14} {rate:>7g}"
    s, pools = result.summary(), " ".join(f"{SHORT[k]}={v}" for k, v in result.pools.items())
    goodput = "-" if s["goodput_rps"] is None else f"{s['goodput_rps']:.2f}"
    busy = " ".join(f"{SHORT[k]}={v:.0%}" for k, v in result.utilisation.items())
    label = what if what.startswith(result.topology) else result.topology  # a run's routing, when named
    return (f"{label:<11} {pools:<14} {rate:>7g} {s['ttft_p50_s']:>8.3f} {s['ttft_p90_s']:>8.3f} "
            f"{s['tpot_p50_s'] * 1e3:>8.1f} {s['tpot_p90_s'] * 1e3:>8.1f} {s['share_within_slo']:>7.0%} "
            f"{goodput:>8}  {busy}" + caches_column(s["caches"]))


def caches_column(caches: dict) -> str:
    if not caches:
        return ""
    return f"  prefix hits {caches['prefix_hit_rate']:.1%}, encoder hits {caches['encoder_hit_rate']:.1%}"


def requests_by_rate(args, costs) -> dict:
    if args.replay:
        with open(args.replay) as f:
            return {run["rate"]: requests_from_load(run) for run in json.load(f)["results"]}
    if args.sessions:
        if not args.emulate:
            raise SystemExit("--sessions needs the twin (--emulate): the stage model has no caches")
        limits = costs.limits
        return {rate: make_chats(args.mix, rate, args.sessions, args.turns, args.think_time, args.seed,
                                    args.text_tokens, args.output_tokens, limits.prefix_tokens, limits.block_size,
                                    args.max_pixels, args.factor) for rate in args.rate}
    body_bytes = getattr(getattr(costs, "host", None), "body_bytes_per_pixel", 0.0)
    return {rate: make_requests(args.mix, rate, args.num_requests, args.seed, args.text_tokens, args.output_tokens,
                                args.max_pixels, args.factor, body_bytes) for rate in args.rate}


def p99_goodput(args, costs) -> list[dict]:
    """Each topology's sustained rate (sweep.py), once per repeat; a line for each and one with the spread."""
    print(f"{'topology':<11} {'seed':>4} {'rate (req/s)':>12} {'TTFT p99 (s)':>12} {'TPOT p99 (ms)':>13} {'runs':>5}")
    results = []
    for topology in args.topologies:
        rates = []
        for seed in range(args.seed, args.seed + args.repeats):
            def run_at(rate, seed=seed):
                requests = make_requests(args.mix, rate, args.num_requests, seed, args.text_tokens,
                                         args.output_tokens, args.max_pixels, args.factor)
                return simulate(topology, costs, requests, args.slo_ttft, args.slo_tpot, args.token_budget)

            found = highest_rate_within(run_at, args.slo_ttft, args.slo_tpot, *args.p99_goodput)
            s = found.result.summary() if found.result else {"ttft_p99_s": float("nan"), "tpot_p99_s": float("nan")}
            print(f"{topology.name:<11} {seed:>4} {found.rate:>12.2f} {s['ttft_p99_s']:>12.2f} "
                  f"{s['tpot_p99_s'] * 1e3:>13.1f} {found.tried:>5}")
            rates.append(found.rate)
            results.append({"topology": topology.name, "seed": seed, "sustained_rate": found.rate,
                            **({k: v for k, v in s.items() if k.endswith("_s")})})
        print(f"{topology.name:<11} {'all':>4} {sum(rates) / len(rates):>12.2f}  (min {min(rates):.2f}, "
              f"max {max(rates):.2f})")
    return results


def main(args) -> int:
    costs = stage_or_twin_costs(args)
    if args.save_costs:
        costs.to_json(args.save_costs)
    if args.p99_goodput:
        return write_report(args, costs, p99_goodput(args, costs))
    slo = (args.slo_ttft, args.slo_tpot)
    print(f"{'topology':<11} {'pools':<14} {'rate':>7} {'TTFT p50':>8} {'p90 (s)':>8} {'TPOT p50':>8} "
          f"{'p90 (ms)':>8} {'in SLO':>7} {'goodput':>8}  utilisation")
    results = []
    for rate, requests in requests_by_rate(args, costs).items():
        if args.search:
            runs = [(shape, search_pools(shape, costs, requests, *slo, args.max_workers, args.target_share,
                                         args.token_budget)) for shape in args.shapes]
        else:
            runs = [(f"{t.name}" + (f" {routing}" if len(args.routing) > 1 else ""),
                     simulate(t, costs, requests, *slo, args.token_budget, routing, args.affinity_slack))
                    for t in args.topologies for routing in args.routing]
        for what, result in runs:
            print(format_row(rate, result, what))
            results.append({"rate": rate, "topology": result.topology if result else what, "run": what,
                            **(result.summary() if result else {"pools": None})})
    return write_report(args, costs, results)


def write_report(args, costs, results: list[dict]) -> int:
    arguments = {k: v for k, v in vars(args).items() if k not in ("module", "parser")}
    arguments["topologies"] = [t.name for t in args.topologies]
    report = {"costs": costs.describe() if args.emulate else asdict(costs), "args": arguments, "results": results}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0
