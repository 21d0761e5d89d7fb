"""Time and page faults of big prefill steps: the first one of a process, then one more with other prompts.

    python scripts/bench_prefill_steps.py --preset 2b-shaped --cache-dir checkpoints/bench-2b-shaped
    python scripts/bench_prefill_steps.py --preset 2b-shaped --cache-dir checkpoints/bench-2b-shaped \\
        --mlp-pass-bytes 36700160        # the MLP passes of 512 rows the 2B's shape had before

Each wave is bench.py's decode workload (32 prompts, half with a picture), all added at once; its first engine
step prefills up to the token budget (2,048 tokens). The second wave uses other prompts (another seed), so the
prefix cache does not shorten it: it shows the steady state, when the first step has already touched memory.
Page faults and kernel time come from getrusage, for the whole process over the step. Run it alone: the cores
are shared with nothing else, and one process per setting (a process's memory history is the point).
"""

import argparse
import json
import time
from pathlib import Path

from nanomm import LLM
from nanomm.accel import fused_layers
from nanomm.bench import machine
from nanomm.bench import requests as bench
from nanomm.tools.weights import PRESETS


def timed_step(engine) -> dict:
    before, start = machine.process_usage(), time.perf_counter()
    engine.step()
    wall = time.perf_counter() - start
    return dict(wall_s=wall, **machine.usage_since(before))


def prefill_wave(llm: LLM, args, seed: int) -> dict:
    """Add the decode workload of `seed`, time the engine's first step (the big prefill), then abort it."""
    args.seed = seed
    prompts = bench.workloads(args)["decode"]["prompts"]
    ids = bench.add_all(llm.engine, prompts, bench.greedy(args.max_tokens), f"wave{seed}")
    tokens = sum(llm.engine.requests[request_id].num_prompt_tokens for request_id in ids)
    step = timed_step(llm.engine) | {"tokens": tokens}
    bench.abort_all(llm.engine, ids)
    return step


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=list(PRESETS), default="small")
    p.add_argument("--cache-dir", default="checkpoints/bench-small")
    p.add_argument("--checkpoint", help="a local Qwen2-VL folder; overrides --preset")
    p.add_argument("--mlp-pass-bytes", type=int, help="fused_layers.MLP_PASS_BYTES for this run (default 16 MiB)")
    p.add_argument("--json", help="write the numbers here")
    args = p.parse_args(argv)
    workload = bench.workload_args(["--workload", "decode"])  # bench.py's decode workload and its pixel caps
    workload.max_tokens = 8
    if args.mlp_pass_bytes:
        fused_layers.MLP_PASS_BYTES = args.mlp_pass_bytes
    folder = bench.load_checkpoint(argparse.Namespace(checkpoint=args.checkpoint, preset=args.preset,
                                                      cache_dir=args.cache_dir), print)
    llm = LLM(str(folder), device="cpu", dtype="float32", max_pixels=workload.max_pixels)
    bench.warm_up(llm)
    waves = {"first": prefill_wave(llm, workload, seed=0), "second": prefill_wave(llm, workload, seed=1)}
    results = dict(machine=machine.machine_info(), checkpoint=str(folder), mlp_pass_bytes=fused_layers.MLP_PASS_BYTES, **waves)
    for name, w in waves.items():
        print(f"{name} prefill step ({w['tokens']} prompt tokens, the first {llm.engine.config.max_num_batched_tokens} "
              f"in this step): {w['wall_s']:.2f} s wall, {w['user_s']:.2f} s user, {w['system_s']:.2f} s system, "
              f"{w['page_faults']:,} page faults")
    print(f"machine: {results['machine']['cpu']}; MLP passes of {fused_layers.MLP_PASS_BYTES:,} bytes")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    llm.close()
    return results


if __name__ == "__main__":
    main()
