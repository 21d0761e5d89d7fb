"""Decode attention, batched against one sequence at a time, in one process: step time and kernels per layer.

    python scripts/bench_attention.py                    # preset tiny (overhead-bound), batch 32
    python scripts/bench_attention.py --preset small --batch 32 --repeats 3

Both ways run the same engine on the same requests (nanomm/accel/batched_attention.py: `batched_attention` for
decodes, `causal_attention` per sequence as the definition); the engine's runner is switched between them, and
the runs alternate so that a machine whose speed drifts affects both. Each run is bench.py's decode probe:
it prefills `--batch` text requests, then times their pure decode steps. Kernels are counted with
nanomm/workshop/op_count.py. Timings are wall-clock on whatever else runs: nothing asserts them.
"""

import argparse
import json
import statistics
from pathlib import Path


from nanomm.bench.machine import add_device_args, cpu_name
from nanomm.bench.probes import decode_probe
from nanomm import LLM
from nanomm.tools.random_checkpoint import make_checkpoint


def decode_run(llm, batch: int, max_tokens: int) -> tuple[float, dict]:
    """(mean seconds per pure decode step, the op count of one more decode step): bench.py's decode probe."""
    prompts = [f"Tell me a story about the number {i} and the sea, in detail." for i in range(batch)]
    probe = decode_probe(llm, prompts, max_tokens, max_steps=max_tokens - 2)  # leaves one step to count
    return statistics.mean(probe["step_s"]), probe["ops"]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--cache-dir", help="where the preset's checkpoint is made (default: checkpoints/bench-PRESET)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--json", help="write the numbers to this file")
    add_device_args(p)
    args = p.parse_args(argv)
    folder = Path(args.cache_dir or f"checkpoints/bench-{args.preset}")
    if not (folder / "config.json").is_file():
        make_checkpoint(folder, preset=args.preset)
    llm = LLM(str(folder), device=args.device, dtype=args.dtype, max_num_seqs=args.batch,
              num_kv_blocks=args.batch * 16)
    decode_run(llm, 4, 4)  # warm-up: first steps of each shape are slow
    times, ops = {True: [], False: []}, {}
    for _ in range(args.repeats):
        for batched in (True, False):
            llm.engine.runner.batched_attention = batched
            step_s, ops[batched] = decode_run(llm, args.batch, args.max_tokens)
            times[batched].append(step_s)
    print(f"{cpu_name()}; preset {args.preset}, batch {args.batch}, {args.repeats} alternating runs each")
    for batched, label in ((False, "one sequence at a time"), (True, "batched")):
        print(f"{label:<24} decode step {statistics.median(times[batched]) * 1e3:6.1f} ms (median; runs "
              + ", ".join(f"{t * 1e3:.1f}" for t in times[batched]) + f"), {ops[batched]['kernels_per_layer']:.0f} "
              f"kernels per layer, {ops[batched]['step_kernels']} in the step")
    llm.close()
    if args.json:
        Path(args.json).write_text(json.dumps({
            "machine": cpu_name(), "preset": args.preset, "batch": args.batch,
            "step_s": {"batched": times[True], "one_sequence": times[False]},
            "ops": {"batched": ops[True], "one_sequence": ops[False]}}, indent=2))


if __name__ == "__main__":
    main()
