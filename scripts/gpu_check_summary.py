"""gpu_check.sh's record: gpu_check.json (everything) and, on stdout, the summary of the numbers, each beside
its target. It reads what the stages have left in WORK so far, so it runs after every stage.

    python scripts/gpu_check_summary.py WORK OUT     # writes OUT/gpu_check.json, prints the summary
"""

import json
import sys
from pathlib import Path

BENCHES = ("step-2b", "burst-2b", "profile", "bench-small", "bench-quant")  # the stages' order
OUTPUT_CHARS = 20_000  # the end of each stage's output kept in the JSON


def read_stages(work: Path) -> dict:
    """stages.tsv's lines, "NAME EXIT SECONDS OUTCOME" (passed, failed, timed-out or skipped), with each output."""
    tsv = work / "stages.tsv"
    lines = tsv.read_text().splitlines() if tsv.exists() else []
    stages = {}
    for name, rc, seconds, outcome in (line.split() for line in lines):
        output = work / f"{name}.txt"
        stages[name] = {"exit": int(rc), "seconds": int(seconds), "outcome": outcome,
                        "output": output.read_text(errors="replace")[-OUTPUT_CHARS:] if output.exists() else None}
    return stages


def read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # not written (yet), or cut off by a killed stage


def summary_lines(combined: dict) -> list[str]:
    stages = combined["stages"]
    done = ", ".join(f"{name} {stage['outcome']} (exit {stage['exit']}) in {stage['seconds']}s"
                     for name, stage in stages.items())
    lines = [f"stages: {done or 'none finished yet'}"] + ([combined["stopped"]] if combined["stopped"] else [])
    for name in BENCHES:
        try:  # one result that lacks a field (an older bench's JSON, say) must not hide the others
            describe = {"bench-quant": quant_lines, "profile": profile_lines, "burst-2b": burst_lines}.get(
                name, bench_lines)
            lines += describe(name, combined[name])
        except (KeyError, TypeError, ZeroDivisionError) as error:
            lines.append(f"{name}: unreadable result ({type(error).__name__}: {error})")
    return lines


def quant_lines(name: str, result: dict | None) -> list[str]:
    if not result:
        return [f"{name}: no result"]
    rows = result["rows"]
    return [f"{name}, batch-1 decode tok/s: " + ", ".join(
        f"{k} {v['tok_s']:.0f} ({v['tok_s'] / rows['float32']['tok_s']:.2f}x, "
        f"{v['tok_s'] / v['roofline_tok_s']:.0%} of roofline)" for k, v in rows.items())]


def profile_lines(name: str, result: dict | None) -> list[str]:
    """profile_steps.py: kernels per prefill step and per decode layer, each kind of engine step's total and phases,
    and the prefill's host waits and top ops (the training step is in gpu_check.json)."""
    if not result:
        return [f"{name}: no result"]
    serving = result["serving"]
    decode = serving["decode_step"]
    kinds = []
    for kind, entry in serving["steps"].items():
        phases = ", ".join(f"{phase} {ms:.0f}" for phase, ms in entry["phases_ms"].items() if ms >= 0.5)
        kinds.append(f"{entry['steps']} {kind} steps {entry['total_ms']:.0f} ms ({phases})")
    return [f"{name}: {serving['requests']} requests, TTFT p50 {serving['ttft_p50_s'] * 1e3:.0f} ms; kernels: "
            f"{serving['prefill_kernels'] / max(1, serving['prefill_steps']):.0f} per prefill step, "
            f"{decode['kernels']} per batch-{decode['batch']} decode step ({decode['kernels_per_layer']:.1f} a layer, "
            f"head and sampling included)",
            "  " + "; ".join(kinds),
            f"  prefill host waits {serving['prefill_host_waits']}; top ops " + ", ".join(
                f"{op['op']} {op['self_ms']:.1f} ms x{op['calls']}" for op in serving["prefill_top_ops"][:4])]


def burst_lines(name: str, result: dict | None) -> list[str]:
    """bench.py's burst workload: requests with one large picture each, arriving at once."""
    if not result:
        return [f"{name}: no result"]
    burst = result["workloads"]["burst"]
    ours = burst["nanomm"]
    return [f"{name}: {burst['num_requests']} requests at once, {ours['visual_tokens'] // burst['num_requests']} "
            f"visual tokens each: TTFT p50 {ours['ttft_p50_s']:.3f} s (target <= 0.6), p99 {ours['ttft_p99_s']:.3f} s "
            f"(target <= 1.2); mean encode {ours['mean_encode_s']:.3f} s, prefill {ours['mean_prefill_s']:.3f} s"]


def bench_lines(name: str, result: dict | None) -> list[str]:
    if not result:
        return [f"{name}: no result"]
    decode = result["workloads"]["decode"]
    hf = decode.get("hf", {}).get("best_tokens_per_s", float("nan"))
    batch1 = decode["batch1_roofline"]
    return [f"{name}: {result['machine'].get('gpu')}, {result['dtype']}; read {result['roofline']['read_gbps']:.0f} "
            f"GB/s, matmul {result['roofline']['matmul_gflops'] / 1e3:.0f} TFLOP/s; batch 32: nanomm "
            f"{decode['nanomm']['tokens_per_s']:.0f} tok/s, transformers {hf:.0f}, ratio "
            f"{decode.get('speedup', float('nan')):.2f}x (target >= 3x), identical "
            f"{decode.get('agreement', {}).get('identical')}/{decode['num_requests']}",
            f"  batch 1: decode step {batch1['measured_step_s_mean'] * 1e3:.2f} ms mean (median "
            f"{batch1['measured_step_s_median'] * 1e3:.2f}), roofline {batch1['roofline_step_s_mean'] * 1e3:.2f} ms: "
            f"{batch1['fraction_of_roofline']:.0%} of it (target >= 50% on 2b); batch 32 decode step: "
            f"{decode['decode_roofline']['fraction_of_roofline']:.0%} of the roofline, "
            f"{decode['decode_probe'].get('ops', {}).get('kernels_per_layer', float('nan')):.0f} ops per layer"]


def main(work: Path, out: Path) -> None:
    env, stopped = work / "env.txt", work / "stopped.txt"
    combined = {"env": env.read_text() if env.exists() else None, "stages": read_stages(work),
                "stopped": stopped.read_text().strip() if stopped.exists() else None}
    for name in BENCHES:
        combined[name] = read_json(work / f"{name}.json")
    partial = out / "gpu_check.json.partial"  # written whole, then renamed: a reader never sees half a file
    partial.write_text(json.dumps(combined, indent=1, default=str))
    partial.replace(out / "gpu_check.json")
    print("\n".join(summary_lines(combined)))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
