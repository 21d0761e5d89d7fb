"""Offline throughput: nanomm against transformers' `generate`, same random checkpoint, same inputs, one run.

    python scripts/bench.py                          # preset "small" (~100M params, real Qwen vocabulary), CPU
    python scripts/bench.py --quick                  # a smoke run: a few requests, a few tokens
    python scripts/bench.py --checkpoint DIR --workload decode --hf-batch-sizes 1,8,32 --json bench.json
    python scripts/bench.py --device cuda --dtype bfloat16 --preset 2b-shaped   # on a GPU (scripts/gpu_check.sh)

Three workloads, each greedy with ignore_eos so both engines generate exactly the same number of tokens:
  decode   many requests, 0 or 1 small image each, short varied text, --max-tokens output tokens each
  prefill  many requests, 1-3 larger images each, long text, --prefill-max-tokens output tokens each
  burst    --burst-num-requests requests arriving at once, one square picture of --burst-image-side px each
           (896 px: 1,024 visual tokens of 28 px), short text: time to first token when pictures queue up

nanomm runs each workload with one `llm.generate` call (continuous batching). transformers runs the same
requests in order, in static left-padded batches of each size in --hf-batch-sizes; its fastest batch size is
the one compared. Both see identical token ids and pixel values: the transformers inputs are built from
nanomm's own prepared prompts, which the test suite proves identical to transformers' processor output.

The same run measures the machine's roofline (memory bandwidth, matmul rate in the run's dtype) and nanomm's
pure decode step time at the workload's batch and at batch 1, and prints each one's fraction of the roofline. Timings are wall-clock on whatever else is running:
run it on a quiet machine. Results go in BENCHMARKS.md. Benchmarks are not tests: nothing asserts a timing.
"""

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from nanomm import LLM
from nanomm.accel import fused_layers
from nanomm.bench.machine import add_device_args, machine_info, measure_roofline
from nanomm.bench.probes import decode_probe, decode_roofline, model_cost, run_nanomm
from nanomm.bench.requests import add_workload_args, greedy, load_checkpoint, shape_workloads, warm_up, workloads


# -----------------------------------------------------------------------------------------------------------
# Workloads (the pictures, words and probes are nanomm/bench's: requests.py, machine.py, probes.py)


# -----------------------------------------------------------------------------------------------------------
# transformers


def hf_batch(prepared: list, pad_id: int, image_token_id: int) -> dict:
    """Left-padded batch of nanomm's prepared prompts, in the form Qwen2VLForConditionalGeneration wants."""
    length = max(len(p.token_ids) for p in prepared)
    input_ids = torch.full((len(prepared), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prepared), length), dtype=torch.long)
    for row, p in enumerate(prepared):
        input_ids[row, length - len(p.token_ids):] = torch.tensor(p.token_ids)
        mask[row, length - len(p.token_ids):] = 1
    # Without mm_token_type_ids, generate silently uses 1-D positions for images (see the reference notes).
    inputs = dict(input_ids=input_ids, attention_mask=mask,
                  mm_token_type_ids=((input_ids == image_token_id) & mask.bool()).int())
    images = [im for p in prepared for im in p.images]
    if images:
        inputs["pixel_values"] = torch.cat([im.pixel_values for im in images])
        inputs["image_grid_thw"] = torch.tensor([list(im.grid_thw) for im in images])
    return inputs


def hf_generate(model, prepared: list, max_tokens: int, pad_id: int, image_token_id: int) -> list[list[int]]:
    inputs = {k: v.to(model.device) for k, v in hf_batch(prepared, pad_id, image_token_id).items()}
    if "pixel_values" in inputs:
        inputs["pixel_values"] = inputs["pixel_values"].to(model.dtype)
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                             pad_token_id=pad_id)
    return out[:, inputs["input_ids"].shape[1]:].tolist()


def run_hf(model, prepared: list, max_tokens: int, batch_sizes: list[int], pad_id: int, image_token_id: int,
           max_seconds: float | None, log) -> dict:
    """Each batch size runs every request, in order, in static batches. With max_seconds, a batch size whose
    first batch projects a total over the limit stops there and is reported as skipped (with the estimate)."""
    runs = {}
    for bs in batch_sizes:
        batches = [prepared[i:i + bs] for i in range(0, len(prepared), bs)]
        tokens, start = [], time.perf_counter()
        for k, batch in enumerate(batches):
            tokens += hf_generate(model, batch, max_tokens, pad_id, image_token_id)
            elapsed = time.perf_counter() - start
            if k == 0 and max_seconds and len(batches) > 1 and elapsed * len(batches) > max_seconds:
                runs[bs] = dict(skipped=True, estimated_s=elapsed * len(batches), first_batch_s=elapsed,
                                first_batch_tokens_per_s=len(batch) * max_tokens / elapsed)
                log(f"  transformers batch {bs}: skipped, first batch projects {elapsed * len(batches):.0f} s "
                    f"> --hf-max-seconds {max_seconds:g}")
                break
        else:
            wall = time.perf_counter() - start
            runs[bs] = dict(skipped=False, wall_s=wall, tokens_per_s=len(prepared) * max_tokens / wall,
                            prompt_tokens_per_s=sum(len(p.token_ids) for p in prepared) / wall,
                            padded_prompt_tokens=sum(len(b) * max(len(p.token_ids) for p in b) for b in batches),
                            token_ids=tokens)
            log(f"  transformers batch {bs}: {runs[bs]['tokens_per_s']:.1f} tok/s ({wall:.1f} s)")
    return runs


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> dict:
    """Requests with identical tokens, and the first differing index of each other one."""
    diverged = {}
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            diverged[i] = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return dict(identical=len(ours) - len(diverged), total=len(ours), first_divergence=diverged)


# -----------------------------------------------------------------------------------------------------------
# Main


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_workload_args(p)
    e = p.add_argument_group("engines")
    e.add_argument("--max-num-seqs", type=int, help="nanomm LLM max_num_seqs (default: the LLM default)")
    e.add_argument("--max-num-batched-tokens", type=int, help="nanomm LLM max_num_batched_tokens (default: LLM's)")
    e.add_argument("--hf-batch-sizes", default="1,4,8,16,32", help="transformers static batch sizes to try")
    e.add_argument("--hf-max-seconds", type=float, help="skip a transformers batch size projected to take longer")
    e.add_argument("--no-hf", action="store_true", help="measure nanomm only")
    e.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    e.add_argument("--no-cpu-fast-linear", dest="cpu_fast_linear", action="store_false",
                   help="nanomm on plain F.linear instead of the oneDNN-packed fast path (LLM(cpu_fast_linear=False))")
    e.add_argument("--mlp-pass-bytes", type=int, help="nanomm: a long chunk's MLP in passes of this many bytes of "
                   "gate/up output (default: fused_layers.MLP_PASS_BYTES, 16 MiB); 36700160 is the old 512 rows of the 2B")
    e.add_argument("--decode-probe-steps", type=int, default=32, help="decode steps timed for the roofline")
    add_device_args(e)
    e.add_argument("--compile", action="store_true", help="nanomm with LLM(compile=True): torch.compile'd layers")
    r = p.add_argument_group("roofline")
    r.add_argument("--bw-mib", type=int, default=512, help="tensor size for the bandwidth test")
    r.add_argument("--matmul-n", type=int, default=2048)
    r.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", help="write every number to this file")
    args = shape_workloads(p, p.parse_args(argv))
    if args.quick:  # smaller defaults; flags given explicitly still win
        for key, value in dict(hf_batch_sizes="1,4", decode_probe_steps=4, bw_mib=128, repeats=3).items():
            if getattr(args, key) == p.get_default(key):
                setattr(args, key, value)
    args.hf_batch_sizes = sorted({int(b) for b in args.hf_batch_sizes.split(",") if b.strip()})
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    console = Console(width=None if sys.stdout.isatty() else 150)
    log = console.print
    t_start = time.perf_counter()
    command = " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]) if argv is None else \
        " ".join(shlex.quote(a) for a in ["scripts/bench.py", *argv])
    machine = machine_info()
    log(f"[bold]command:[/bold] {command}")
    log(f"[bold]machine:[/bold] {machine['cpu']}, {machine['usable_cores']} usable / {machine['logical_cores']} "
        f"logical cores, {machine['memory_gib']} GiB, load avg {machine['load_avg'][0]:.2f}; python "
        f"{machine['python']}, torch {machine['torch']} ({machine['torch_threads']} threads), transformers "
        f"{machine['transformers']}" + (f"; GPU {machine['gpu']}" if machine["gpu"] else ""))
    if machine["load_avg"][0] > 0.5:
        log(f"[yellow]load average {machine['load_avg'][0]:.2f} on {machine['usable_cores']} cores: something else "
            f"is running, timings will be noisy (oversubscribed threads slow steps down many times over; see --threads)"
            f"[/yellow]")
    if args.quick:
        log("[yellow]--quick: a smoke run (few requests, few tokens); not a measurement[/yellow]")

    folder = load_checkpoint(args, log)
    if args.mlp_pass_bytes:
        fused_layers.MLP_PASS_BYTES = args.mlp_pass_bytes  # read at every MLP call: this process's nanomm model only
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    log("measuring the roofline ...")
    roof = measure_roofline(args.bw_mib, args.matmul_n, args.repeats, device, dtype)
    log(f"  read {roof['read_gbps']:.1f} GB/s, copy {roof['copy_gbps']:.1f} GB/s, "
        f"matmul {roof['matmul_gflops']:.1f} GFLOP/s")

    engine_kwargs = {k: v for k, v in (("max_num_seqs", args.max_num_seqs),
                                       ("max_num_batched_tokens", args.max_num_batched_tokens)) if v is not None}
    # The engine's cap bounds every request's; each workload lowers it per prompt (mm_processor_kwargs).
    max_pixels = max(args.max_pixels, args.prefill_max_pixels, args.burst_image_side ** 2)
    llm = LLM(str(folder), device=args.device, dtype=args.dtype, max_pixels=max_pixels,
              cpu_fast_linear=args.cpu_fast_linear, compile=args.compile, **engine_kwargs)
    cost = model_cost(llm)
    warm = warm_up(llm)

    hf_model = None
    if not args.no_hf:
        import transformers
        transformers.logging.set_verbosity_error()
        transformers.logging.disable_progress_bar()
        hf_model = transformers.Qwen2VLForConditionalGeneration.from_pretrained(folder, dtype=dtype).to(device).eval()
        attn_impl = hf_model.config._attn_implementation
        pad_id = llm.tokenizer.pad_token_id
        pad_id = llm.tokenizer.eos_token_ids[0] if pad_id is None else pad_id
        image_token_id = llm.model.config.image_token_id
        hf_generate(hf_model, [llm.engine.prepare(p, greedy(2)) for p in warm], 2, pad_id, image_token_id)

    results = dict(command=command, machine=machine, quick=args.quick, checkpoint=str(folder),
                   device=args.device, dtype=args.dtype,
                   preset=None if args.checkpoint else args.preset, model=cost, roofline=roof,
                   engine_kwargs=dict(engine_kwargs, max_pixels=max_pixels),
                   hf_attn_implementation=None if hf_model is None else attn_impl, workloads={})
    for name, wl in workloads(args).items():
        prompts, max_tokens = wl["prompts"], wl["max_tokens"]
        log(f"[bold]{name}[/bold]: {len(prompts)} requests x {max_tokens} tokens")
        res = dict(num_requests=len(prompts), max_tokens=max_tokens,
                   images=sum(len(p["multi_modal_data"]["image"]) if isinstance(p, dict) else 0 for p in prompts))
        res["nanomm"] = run_nanomm(llm, prompts, max_tokens)
        log(f"  nanomm: {res['nanomm']['tokens_per_s']:.1f} tok/s ({res['nanomm']['wall_s']:.1f} s)")
        probe = decode_probe(llm, prompts, max_tokens, args.decode_probe_steps)
        res["decode_probe"] = probe
        res["decode_roofline"] = decode_roofline(cost, roof, probe)
        if name == "decode":  # one request alone: the step reads every weight for one token (bandwidth-bound)
            single = decode_probe(llm, prompts[:1], max_tokens, args.decode_probe_steps, count_ops=False)
            res["batch1_probe"], res["batch1_roofline"] = single, decode_roofline(cost, roof, single)
        if hf_model is not None:
            prepared = [llm.engine.prepare(p, greedy(max_tokens)) for p in prompts]
            sizes = sorted({min(bs, len(prepared)) for bs in args.hf_batch_sizes})  # 32 and 64 are one size for 8
            runs = run_hf(hf_model, prepared, max_tokens, sizes, pad_id, image_token_id, args.hf_max_seconds, log)
            done = {bs: r for bs, r in runs.items() if not r["skipped"]}
            for r in done.values():
                r["agreement"] = agreement(res["nanomm"]["token_ids"], r["token_ids"])
            best = max(done, key=lambda bs: done[bs]["tokens_per_s"]) if done else None
            res["hf"] = dict(runs={str(k): v for k, v in runs.items()}, best_batch_size=best,
                             tried=sizes, skipped=[bs for bs, r in runs.items() if r["skipped"]])
            if best is not None:
                res["hf"]["best_tokens_per_s"] = done[best]["tokens_per_s"]
                res["speedup"] = res["nanomm"]["tokens_per_s"] / done[best]["tokens_per_s"]
                res["agreement"] = done[best]["agreement"]
        results["workloads"][name] = res

    results["total_s"] = time.perf_counter() - t_start
    print_report(console, results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))
        log(f"wrote {args.json}")
    return results


# -----------------------------------------------------------------------------------------------------------
# Report


def print_report(console: Console, results: dict) -> None:
    names = list(results["workloads"])
    table = Table(title=f"nanomm vs transformers generate ({results['dtype']}, {results['device']}, greedy, "
                        "ignore_eos)")
    table.add_column("")
    for name in names:
        table.add_column(name, justify="right")

    def row(label, fn):
        cells = []
        for name in names:
            try:
                cells.append(fn(results["workloads"][name]))
            except (KeyError, TypeError):
                cells.append("-")
        table.add_row(label, *cells)

    row("requests x output tokens", lambda w: f"{w['num_requests']} x {w['max_tokens']}")
    row("images / prompt tokens (visual)", lambda w: f"{w['images']} / {w['nanomm']['prompt_tokens']} "
        f"({w['nanomm']['visual_tokens']})")
    row("nanomm output tok/s", lambda w: f"{w['nanomm']['tokens_per_s']:.1f}")
    row("nanomm prompt tok/s", lambda w: f"{w['nanomm']['prompt_tokens_per_s']:.0f}")
    row("nanomm wall s", lambda w: f"{w['nanomm']['wall_s']:.2f}")
    row("transformers best tok/s (batch)", lambda w: f"{w['hf']['best_tokens_per_s']:.1f} (bs {w['hf']['best_batch_size']})")
    row("transformers tok/s by batch size", lambda w: ", ".join(
        f"{bs}: {r['tokens_per_s']:.1f}" if not r["skipped"] else f"{bs}: skipped (~{r['estimated_s']:.0f}s)"
        for bs, r in w["hf"]["runs"].items()))
    row("nanomm / transformers best", lambda w: f"{w['speedup']:.2f}x")
    row("identical requests (vs best bs)", lambda w: f"{w['agreement']['identical']}/{w['agreement']['total']}")
    row("first divergence {req: index}", lambda w: str(w["agreement"]["first_divergence"] or "none"))
    row("identical by batch size", lambda w: ", ".join(
        f"{bs}: {r['agreement']['identical']}" for bs, r in w["hf"]["runs"].items() if not r["skipped"]))
    row("nanomm page faults / system s", lambda w: f"{w['nanomm']['page_faults']:,.0f} / {w['nanomm']['system_s']:.2f}")
    row("TTFT p50 / p95 / p99 s", lambda w: " / ".join(f"{w['nanomm'][k]:.3f}" for k in ("ttft_p50_s", "ttft_p95_s",
                                                                                          "ttft_p99_s")))
    row("mean queue/preproc/encode/prefill s", lambda w: " / ".join(
        f"{w['nanomm'][k]:.3f}" for k in ("mean_queue_s", "mean_preprocess_s", "mean_encode_s", "mean_prefill_s")))
    row("mean TPOT s", lambda w: f"{w['nanomm']['mean_tpot_s']:.4f}")
    row("steps / prefix-cache hit tokens", lambda w: f"{w['nanomm']['run_counters']['steps']} / "
        f"{w['nanomm']['run_counters']['prefix_cache_hit_tokens']}")
    row("decode probe: steps, mean batch, mean ctx", lambda w: f"{w['decode_roofline']['steps']}, "
        f"{w['decode_roofline']['mean_batch']:.1f}, {w['decode_roofline']['mean_context_tokens']:.0f}")
    row("decode step measured (median) ms", lambda w: f"{w['decode_roofline']['measured_step_s_mean'] * 1e3:.1f} "
        f"({w['decode_roofline']['measured_step_s_median'] * 1e3:.1f})")
    row("decode step roofline ms (bound)", lambda w: f"{w['decode_roofline']['roofline_step_s_mean'] * 1e3:.1f} "
        f"({w['decode_roofline']['bound']})")
    row("decode fraction of roofline", lambda w: f"{w['decode_roofline']['fraction_of_roofline']:.0%}")
    row("decode achieved read GB/s", lambda w: f"{w['decode_roofline']['achieved_read_gbps']:.1f}")
    row("batch-1 decode step measured (median) / roofline ms", lambda w: "{:.1f} ({:.1f}) / {:.1f} ({})".format(
        w["batch1_roofline"]["measured_step_s_mean"] * 1e3, w["batch1_roofline"]["measured_step_s_median"] * 1e3,
        w["batch1_roofline"]["roofline_step_s_mean"] * 1e3, w["batch1_roofline"]["bound"]))
    row("batch-1 decode fraction of roofline", lambda w: f"{w['batch1_roofline']['fraction_of_roofline']:.0%}")
    row("decode step ops: per layer / whole step (batch)", lambda w: "-" if "ops" not in w["decode_probe"] else
        f"{w['decode_probe']['ops']['kernels_per_layer']:.0f} / {w['decode_probe']['ops']['step_kernels']} "
        f"({w['decode_probe']['ops']['batch']})")
    console.print(table)

    roof, cost = results["roofline"], results["model"]
    console.print(
        f"roofline: read {roof['read_gbps']:.1f} GB/s (sum over {roof['bw_tensor_mib']} MiB), copy "
        f"{roof['copy_gbps']:.1f} GB/s, {results['dtype']} matmul {roof['matmul_gflops']:.1f} GFLOP/s ({roof['matmul_n']}^3: "
        f"torch.mm {roof['mkl_matmul_gflops']:.1f}, oneDNN packed {roof['onednn_matmul_gflops'] or 0:.1f}), "
        f"best of {roof['repeats']}")
    console.print(
        f"model: {cost['total_params'] / 1e6:.1f}M params; a decode step reads "
        f"{cost['weight_bytes_per_step'] / 1e6:.0f} MB of weights + {cost['kv_bytes_per_token']} B of KV per context "
        f"token; {2 * cost['matmul_params_per_token'] / 1e6:.0f} MFLOP per token")
    if results.get("hf_attn_implementation"):
        console.print(f"transformers: Qwen2VLForConditionalGeneration, attn_implementation="
                      f"{results['hf_attn_implementation']} (its default and fastest on CPU), static left-padded "
                      f"batches in request order; generate(do_sample=False, min_new_tokens=max_new_tokens)")
    console.print(f"total bench time {results['total_s']:.0f} s")


if __name__ == "__main__":
    main()
