"""Where a step's time goes: the engine's prefill and decode steps, and a demo-model training step.

    python scripts/profile_steps.py --device cuda --dtype bfloat16 --preset small --cache-dir checkpoints/bench-small
    python scripts/profile_steps.py --quick        # the tiny preset and a tiny training model: a smoke run

The question the first GPU numbers left open (BENCHMARKS.md, "The first GPU numbers"): on an H200 the engine's
batch-32 TTFT was 2.7 s and a demo training step 0.46 s, far from what the GPU's roofline allows. Three parts:

- steps: bench.py's decode workload (32 requests, every other one with a picture) through an `LLM` that records
  its step trace (nanomm/engine/trace.py). Each engine step is a prefill step (a chunk in it reads prompt tokens),
  a decode step, or an idle one (nothing ready); the table sums each kind's phases: schedule, encode, forward,
  sample, commit.
- prefill ops: torch.profiler over the prefill of 32 new requests (one output token each): the ops with the
  most self time, how often the host waited for the device (`aten::item`, `aten::nonzero`, syncs), and the
  kernels launched per prefill step.
- decode kernels: torch.profiler over one eager decode step of the same 32 requests (no CUDA graph: a replay
  would launch one): the kernels it launched, and per decoder layer (the embedding's, LM head's and sampling's
  counted in). On a CPU nothing is launched: both counts are 0.
- training: the demo model's training step (nanomm/workshop/training.py) on the batches of the one-session recipe:
  drawing one batch (on one CPU core), then forward, backward and the optimizer, each timed after a device sync.

gpu_check.sh runs it as its `profile` stage. The phase spans are host times: on a GPU, work launched in one phase
may finish in a later one (the sample phase waits for the forward's kernels), so compare step totals, and read the
phases as where the host spent its time.
"""

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from nanomm.bench.machine import machine_info, synchronize
from nanomm.bench.requests import (abort_all, add_all, greedy, load_checkpoint, make_workload, warm_up, workload_args,
                                   workloads)
from nanomm import LLM, demo_checkpoint
from nanomm.demo.tasks import TASKS
from nanomm.workshop.op_count import eager_steps
from nanomm.workshop.trainer import TINY_SPEC, _processors, new_heads, new_run, set_picture_cap
from nanomm.workshop.training import TrainConfig, batch_loss, make_batch
from nanomm.engine.trace import ENGINE_PID, STEP_LANE
from nanomm.model.loader import load_model

PHASES = ("schedule", "encode", "forward", "sample", "commit")  # a step's spans ("propose" lies inside schedule)
# Profiler events where the host waits for the device (or reads a value back from it).
KERNEL_LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")
HOST_WAITS = ("aten::item", "aten::_local_scalar_dense", "aten::nonzero", "cudaStreamSynchronize",
              "cudaDeviceSynchronize", "cudaMemcpy", "cudaMemcpyAsync")


def step_kinds(events: list[dict], steps: range) -> dict:
    """The trace's engine steps numbered in `steps`, by kind: "prefill" (a chunk reads prompt tokens), "decode",
    or "idle" (no forward pass: nothing was ready to run); how many, their total milliseconds, and each phase's."""
    lane = [e for e in events if e.get("ph") == "X" and e.get("pid") == ENGINE_PID and e.get("tid") == STEP_LANE]
    chunks = sorted(e["ts"] for e in events if e.get("ph") == "X" and e.get("name") == "prefill chunk")
    kinds: dict[str, dict] = {}
    forwards = [e["ts"] for e in lane if e["name"] == "forward"]
    for step in (e for e in lane if e["name"] == "step" and e["args"]["step"] in steps):
        start, end = step["ts"], step["ts"] + step["dur"]
        if not any(start <= ts <= end for ts in forwards):
            kind = "idle"
        else:
            kind = "prefill" if any(start <= ts <= end for ts in chunks) else "decode"
        entry = kinds.setdefault(kind, {"steps": 0, "total_ms": 0.0, "phases_ms": dict.fromkeys(PHASES, 0.0)})
        entry["steps"] += 1
        entry["total_ms"] += step["dur"] / 1e3
        for phase in (e for e in lane if e["name"] in PHASES and start <= e["ts"] <= end):
            entry["phases_ms"][phase["name"]] += phase["dur"] / 1e3
    return kinds


def top_ops(profile, device: torch.device, rows: int = 12) -> list[dict]:
    """The ops with the most self time (the device's on a GPU, the host's on a CPU), and their call counts."""
    on_gpu = device.type == "cuda"
    averages = [a for a in profile.key_averages() if not a.key.startswith("ProfilerStep")]
    self_us = (lambda a: a.self_device_time_total) if on_gpu else (lambda a: a.self_cpu_time_total)
    ranked = sorted(averages, key=self_us, reverse=True)[:rows]
    return [{"op": a.key, "calls": a.count, "self_ms": round(self_us(a) / 1e3, 3),
             "host_self_ms": round(a.self_cpu_time_total / 1e3, 3)} for a in ranked]


def host_waits(profile) -> dict[str, int]:
    counts = {a.key: a.count for a in profile.key_averages() if a.key in HOST_WAITS}
    return dict(sorted(counts.items()))


def kernel_launches(profile) -> int:
    """Kernels the host launched (the CUDA runtime's and driver's launch calls); 0 on a CPU."""
    return sum(a.count for a in profile.key_averages() if a.key in KERNEL_LAUNCHES)


def profile_decode_step(llm: LLM, device: torch.device, prompts: list) -> dict:
    """The kernels one eager decode step of `prompts` launches, and per decoder layer."""
    engine, sched = llm.engine, llm.engine.scheduler
    ids = add_all(engine, prompts, greedy(3), "decode-profile")
    while sched.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.running):
        engine.step()
    with eager_steps(engine), torch.profiler.profile(activities=activities(device)) as profile:
        engine.step()
        synchronize(device)
    abort_all(engine, ids)
    layers = len(llm.model.language_model.layers)
    kernels = kernel_launches(profile)
    return {"batch": len(prompts), "layers": layers, "kernels": kernels, "kernels_per_layer": kernels / layers}


def activities(device: torch.device) -> list:
    kinds = [torch.profiler.ProfilerActivity.CPU]
    return kinds + ([torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])


def profile_serving(args, device: torch.device) -> dict:
    """The decode workload's steps by kind, then the profiler over one batch of prefills."""
    options = ["--workload", "decode", "--preset", args.preset, "--cache-dir", args.cache_dir]
    options += ["--quick"] if args.quick else []
    bench_options = workload_args(options)
    folder = load_checkpoint(bench_options, print)
    trace = Path(tempfile.mkdtemp()) / "trace.json"
    workload = workloads(bench_options)["decode"]
    with LLM(str(folder), device=args.device, dtype=args.dtype, max_pixels=bench_options.max_pixels,
             trace_path=str(trace)) as llm:
        warm_up(llm)
        first_step = llm.engine.num_steps
        began = time.perf_counter()
        outputs = llm.generate(workload["prompts"], greedy(workload["max_tokens"]), use_tqdm=False)
        wall_s = time.perf_counter() - began
        timed_steps = range(first_step, llm.engine.num_steps)  # not the warm-up's, nor the profiled ones below
        fresh = make_workload(bench_options.seed + 7, len(workload["prompts"]), (0, 1), (56, 224),
                              bench_options.decode_words, alternate=True,
                              mm_kwargs={"max_pixels": bench_options.max_pixels})  # new prompts: no prefix hits
        steps_before = llm.engine.num_steps
        with torch.profiler.profile(activities=activities(device)) as profile:
            llm.generate(fresh, greedy(1), use_tqdm=False)
            synchronize(device)
        prefill_steps = llm.engine.num_steps - steps_before
        decode = profile_decode_step(llm, device, fresh)  # their prompts are in the prefix cache now
    ttfts = [o.metrics.ttft_s for o in outputs]
    return {"requests": len(outputs), "wall_s": round(wall_s, 3), "ttft_p50_s": round(statistics.median(ttfts), 4),
            "steps": step_kinds(json.loads(trace.read_text())["traceEvents"], timed_steps),
            "prefill_top_ops": top_ops(profile, device), "prefill_host_waits": host_waits(profile),
            "prefill_steps": prefill_steps, "prefill_kernels": kernel_launches(profile), "decode_step": decode}


def training_folder(quick: bool) -> Path:
    """A copy of the shipped demo model at a 400-token cap (the one-session recipe's), or a tiny new model."""
    folder = Path(tempfile.mkdtemp()) / "run"
    if quick:
        return new_run(folder, TINY_SPEC)
    shutil.copytree(demo_checkpoint(), folder)
    set_picture_cap(folder, 400)
    return folder


def profile_training(args, device: torch.device) -> dict:
    folder = training_folder(args.quick)
    cfg = TrainConfig(focus_start=0, focus_phases=((1000, TASKS),), number_chats=0.5, counting_chats=0.45,
                      batch_size=args.train_batch, number_close_ups=args.train_batch, device=args.device)
    tokenizer, image_config = _processors(str(folder))
    began = time.perf_counter()
    batches = [make_batch(step, cfg, tokenizer, image_config) for step in range(2)]
    draw_s = (time.perf_counter() - began) / len(batches)
    model = load_model(folder, device=args.device).float().train().requires_grad_(True)
    heads = new_heads(model, 0).to(device)
    optimizer = torch.optim.AdamW(list(model.parameters()) + list(heads.parameters()), lr=1e-6)
    times = {"forward": [], "backward": [], "optimizer": []}

    def step(batch) -> None:
        marks = [time.perf_counter()]
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss, _ = batch_loss(model, batch, heads, cfg.hint_weight, position_weight=cfg.position_weight)
        synchronize(device)
        marks.append(time.perf_counter())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        synchronize(device)
        marks.append(time.perf_counter())
        optimizer.step()
        synchronize(device)
        marks.append(time.perf_counter())
        for name, start, end in zip(times, marks, marks[1:]):
            times[name].append(end - start)

    for i in range(args.train_steps):  # the first is a warm-up, dropped below
        step(batches[i % len(batches)])
    with torch.profiler.profile(activities=activities(device)) as profile:
        step(batches[0])
        synchronize(device)
    median_ms = {name: round(statistics.median(values[1:] or values) * 1e3, 2) for name, values in times.items()}
    return {"chats_per_step": 2 * args.train_batch, "draw_batch_ms": round(draw_s * 1e3, 1), "step_ms": median_ms,
            "top_ops": top_ops(profile, device), "host_waits": host_waits(profile)}


def print_summary(result: dict) -> None:
    serving, training = result["serving"], result["training"]
    print(f"serving: {serving['requests']} requests in {serving['wall_s']} s, TTFT p50 {serving['ttft_p50_s']} s")
    for kind, entry in serving["steps"].items():
        phases = ", ".join(f"{name} {ms:.0f}" for name, ms in entry["phases_ms"].items() if ms)
        print(f"  {kind} steps: {entry['steps']}, {entry['total_ms']:.0f} ms in all ({phases} ms)")
    print(f"  prefill host waits: {serving['prefill_host_waits']}; kernels launched: {serving['prefill_kernels']} in "
          f"{serving['prefill_steps']} prefill steps")
    decode = serving["decode_step"]
    print(f"  one eager decode step of {decode['batch']}: {decode['kernels']} kernels launched, "
          f"{decode['kernels_per_layer']:.1f} per decoder layer ({decode['layers']})")
    print("  prefill top ops: " + ", ".join(f"{o['op']} {o['self_ms']} ms x{o['calls']}"
                                            for o in serving["prefill_top_ops"][:6]))
    print(f"training, {training['chats_per_step']} chats a step: drawing a batch {training['draw_batch_ms']} ms "
          f"(one core); " + ", ".join(f"{k} {v} ms" for k, v in training["step_ms"].items()))
    print(f"  host waits in one step: {training['host_waits']}")
    print("  top ops: " + ", ".join(f"{o['op']} {o['self_ms']} ms x{o['calls']}" for o in training["top_ops"][:6]))


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small", help="bench.py's random checkpoint for the serving part")
    parser.add_argument("--cache-dir", default="checkpoints/bench-small")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--train-batch", type=int, default=32, help="chats a training batch draws (and as many "
                        "close-ups)")
    parser.add_argument("--train-steps", type=int, default=4, help="timed training steps (the first is a warm-up)")
    parser.add_argument("--quick", action="store_true", help="tiny preset, tiny training model, small batches")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.quick:
        args.preset, args.train_batch, args.train_steps = "tiny", 2, 2
    device = torch.device(args.device)
    result = {"machine": machine_info(), "device": args.device, "dtype": args.dtype, "preset": args.preset,
              "serving": profile_serving(args, device), "training": profile_training(args, device)}
    print_summary(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
