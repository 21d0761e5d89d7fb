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
import math
import os
import platform
import random
import shlex
import statistics
import sys
import time
from pathlib import Path

try:
    import resource  # page faults and system time of a run (Unix)
except ImportError:
    resource = None

try:
    import nanomm  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from PIL import Image
from rich.console import Console
from rich.table import Table

from nanomm import LLM, SamplingParams
from nanomm.tools.random_checkpoint import make_checkpoint
from workshop.op_count import decode_step_ops
from nanomm.tools.weights import PRESETS
from nanomm.inputs.tokenizer import IMAGE_PLACEHOLDER
from nanomm.accel.packed_linear import PackedLinear, packed_linear_available
from nanomm.model.qwen2_vl import Qwen2VL
from nanomm.accel import fused_layers

WORDS = ("the a cat dog sat on mat and looked at picture of red blue green house tree sky river boat "
         "mountain city street window small large old new bright dark quickly slowly under over").split()


# -----------------------------------------------------------------------------------------------------------
# Workloads


def random_image(width: int, height: int, seed: int) -> Image.Image:
    """Uniform noise: every patch is different, so nothing about the image is cheaper than a real photo."""
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), dtype=torch.uint8, generator=g)
    return Image.frombytes("RGB", (width, height), pixels.numpy().tobytes())


def chat_prompt(text: str, images=(), mm_kwargs=None):
    """A Qwen2-VL user turn with the images first, as the chat template renders it."""
    body = IMAGE_PLACEHOLDER * len(images) + text
    prompt = (f"<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n{body}<|im_end|>\n"
              f"<|im_start|>assistant\n")
    if not images:
        return prompt
    out = {"prompt": prompt, "multi_modal_data": {"image": list(images)}}
    if mm_kwargs:
        out["mm_processor_kwargs"] = dict(mm_kwargs)
    return out


def make_workload(seed: int, num: int, images: tuple[int, int], size: tuple[int, int], words: tuple[int, int],
                  alternate: bool = False, mm_kwargs=None) -> list:
    """`num` prompts; image count in [images] (alternating 0/1 when `alternate`), side lengths in [size],
    text of [words] words. Everything is drawn from one seeded RNG, so a workload is the same on every run."""
    rng = random.Random(seed)
    prompts = []
    for i in range(num):
        n_images = i % 2 if alternate else rng.randint(*images)
        imgs = [random_image(rng.randint(*size), rng.randint(*size), seed * 100_003 + i * 10 + j)
                for j in range(n_images)]
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(*words)))
        prompts.append(chat_prompt(text, imgs, mm_kwargs))
    return prompts


def workloads(args) -> dict[str, dict]:
    out = {}
    if args.workload in ("decode", "both"):
        out["decode"] = dict(
            prompts=make_workload(args.seed, args.num_requests, (0, 1), (56, 224), args.decode_words, alternate=True,
                                  mm_kwargs={"max_pixels": args.max_pixels}),
            max_tokens=args.max_tokens)
    if args.workload in ("prefill", "both"):
        out["prefill"] = dict(
            prompts=make_workload(args.seed + 1, args.prefill_num_requests, args.prefill_images, (224, 448),
                                  args.prefill_words, mm_kwargs={"max_pixels": args.prefill_max_pixels}),
            max_tokens=args.prefill_max_tokens)
    if args.workload == "burst":
        side = args.burst_image_side
        out["burst"] = dict(prompts=[chat_prompt(f"Describe picture {i} in one line.", [random_image(side, side, i)],
                                                 {"max_pixels": side * side}) for i in range(args.burst_num_requests)],
                            max_tokens=args.prefill_max_tokens)
    return out


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


# -----------------------------------------------------------------------------------------------------------
# The machine and its roofline


def cpu_name() -> str:
    """The processor's model name (/proc/cpuinfo on Linux), which every benchmark figure is recorded with."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_info() -> dict:
    cpu = cpu_name()
    try:
        mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        mem_gib = None
    import transformers
    return dict(cpu=cpu, logical_cores=os.cpu_count(),
                usable_cores=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
                memory_gib=round(mem_gib, 1) if mem_gib else None, load_avg=list(os.getloadavg()),
                python=platform.python_version(), torch=torch.__version__, transformers=transformers.__version__,
                torch_threads=torch.get_num_threads(), torch_interop_threads=torch.get_num_interop_threads(),
                cuda=torch.cuda.is_available(),
                gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)


def synchronize(device: torch.device) -> None:
    """Wait for the device: on a GPU, work is queued and a timer around a launch measures only the launch."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_time(fn, repeats: int, device: torch.device = torch.device("cpu")) -> float:
    fn()  # warm-up: page faults, thread pool start
    synchronize(device)
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best


def measure_roofline(bw_mib: int, matmul_n: int, repeats: int, device: torch.device = torch.device("cpu"),
                     dtype: torch.dtype = torch.float32) -> dict:
    """Memory bandwidth and matmul rate with torch and the same thread count as the engines.

    Read bandwidth: x.sum() over a tensor much larger than the caches reads every byte once and does one add
    per 4 bytes, far below the vector units' rate, so it is limited by DRAM; decode reads weights the same way.
    Copy bandwidth (read + write) is reported too, for reference. Matmul: an n x n @ n x n float32 product,
    2 n^3 FLOPs, timed with torch.mm (MKL) and, on CPU, with the oneDNN packed kernel nanomm's linear layers
    use (nanomm/accel/packed_linear.py); the machine's rate is the faster of the two, so neither engine is measured
    against a roof its own library could beat. On a GPU the same, in the run's dtype (cuBLAS only)."""
    n = bw_mib * 2**20 // 4
    x, y = torch.ones(n, device=device), torch.empty(n, device=device)
    read_s = best_time(lambda: x.sum(), repeats, device)
    copy_s = best_time(lambda: y.copy_(x), repeats, device)
    a, b, c = (torch.randn(matmul_n, matmul_n, device=device, dtype=dtype) for _ in range(3))
    mm_s = best_time(lambda: torch.mm(a, b, out=c), repeats, device)
    packed_s = math.inf
    if packed_linear_available(device, dtype):
        layer = torch.nn.Linear(matmul_n, matmul_n, bias=False)
        layer.weight.data = b
        packed = PackedLinear(layer, batch_size_hint=matmul_n)
        packed_s = best_time(lambda: packed(a), repeats)
    del x, y, a, b, c
    return dict(read_gbps=n * 4 / read_s / 1e9, copy_gbps=2 * n * 4 / copy_s / 1e9,
                matmul_gflops=2 * matmul_n**3 / min(mm_s, packed_s) / 1e9,
                mkl_matmul_gflops=2 * matmul_n**3 / mm_s / 1e9,
                onednn_matmul_gflops=2 * matmul_n**3 / packed_s / 1e9 if packed_s < math.inf else None,
                bw_tensor_mib=bw_mib, matmul_n=matmul_n, repeats=repeats)


def model_cost(llm: LLM) -> dict:
    """What one decode step of one token must touch, from the loaded model.

    Weights: every decoder layer, the final norm and the LM head are read once per step whatever the batch
    size (the embedding table is only gathered, B rows; with tied embeddings it *is* the head, counted once).
    The vision tower does not run in decode. FLOPs per token: 2 per weight of every matrix (decoder + head)."""
    t = llm.model.config.text
    with torch.device("meta"):  # the engine's own copy may hold packed (oneDNN) weights: count a plain one
        model = Qwen2VL(llm.model.config)
    lm = model.language_model
    head = model.lm_head.weight
    decoder = list(lm.layers.parameters()) + list(lm.norm.parameters())
    return dict(
        element_bytes=torch.empty(0, dtype=llm.model.dtype).element_size(),
        weight_bytes_per_step=(sum(p.numel() for p in decoder) + head.numel())
        * torch.empty(0, dtype=llm.model.dtype).element_size(),
        matmul_params_per_token=sum(p.numel() for p in lm.layers.parameters() if p.dim() == 2) + head.numel(),
        total_params=sum(p.numel() for p in {id(p): p for p in model.parameters()}.values()),
        kv_bytes_per_token=llm.stats()["kv_bytes_per_token"],
        attn_flops_per_context_token=4 * t.num_hidden_layers * t.num_attention_heads * t.head_dim,  # QK^T + PV
    )


def decode_roofline(cost: dict, roof: dict, probe: dict) -> dict | None:
    """Per measured decode step: bytes = weights + the KV of every running sequence (K and V, all layers);
    FLOPs = 2 * matmul params * batch + attention over the contexts. Roofline step time = max(bytes / read
    bandwidth, FLOPs / matmul rate); activations, the KV write and the sampler are left out (small)."""
    if not probe["step_s"]:
        return None
    roof_s = []
    for batch, context in zip(probe["batch"], probe["context_tokens"]):
        nbytes = cost["weight_bytes_per_step"] + context * cost["kv_bytes_per_token"]
        flops = 2 * cost["matmul_params_per_token"] * batch + cost["attn_flops_per_context_token"] * context
        roof_s.append(max(nbytes / (roof["read_gbps"] * 1e9), flops / (roof["matmul_gflops"] * 1e9)))
    steps = len(roof_s)
    mean_batch = sum(probe["batch"]) / steps
    mean_ctx = sum(probe["context_tokens"]) / steps
    bytes_mean = cost["weight_bytes_per_step"] + mean_ctx * cost["kv_bytes_per_token"]
    flops_mean = 2 * cost["matmul_params_per_token"] * mean_batch + cost["attn_flops_per_context_token"] * mean_ctx
    return dict(steps=steps, mean_batch=mean_batch, mean_context_tokens=mean_ctx,
                bytes_per_step=bytes_mean, flops_per_step=flops_mean,
                bound="memory" if bytes_mean / roof["read_gbps"] >= flops_mean / roof["matmul_gflops"] else "compute",
                measured_step_s_mean=sum(probe["step_s"]) / steps, measured_step_s_median=statistics.median(probe["step_s"]),
                roofline_step_s_mean=sum(roof_s) / steps,
                fraction_of_roofline=sum(roof_s) / sum(probe["step_s"]),
                achieved_read_gbps=bytes_mean * steps / sum(probe["step_s"]) / 1e9)


# -----------------------------------------------------------------------------------------------------------
# nanomm


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    k = (len(s) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


COUNTERS = ("steps", "generated_tokens", "computed_tokens", "visual_tokens_encoded", "encode_s",
            "prefix_cache_queried_tokens", "prefix_cache_hit_tokens", "preemptions")


def process_usage() -> dict:
    """Minor page faults and CPU seconds (user, system) of this whole process so far; NaNs where there is no
    `resource` (not Unix)."""
    if resource is None:
        return dict(page_faults=math.nan, user_s=math.nan, system_s=math.nan)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return dict(page_faults=usage.ru_minflt, user_s=usage.ru_utime, system_s=usage.ru_stime)


def usage_since(before: dict) -> dict:
    """process_usage() now, less `before`."""
    return {key: value - before[key] for key, value in process_usage().items()}


def run_nanomm(llm: LLM, prompts: list, max_tokens: int) -> dict:
    before, usage_before = llm.stats(), process_usage()
    start = time.perf_counter()
    outs = llm.generate(prompts, greedy(max_tokens))
    wall = time.perf_counter() - start
    usage = usage_since(usage_before)
    after = llm.stats()
    delta = {k: after[k] - before[k] for k in COUNTERS}  # this run only, without the warm-up
    m = [o.metrics for o in outs]
    ttft = [x.ttft_s for x in m]
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    return dict(
        wall_s=wall, generated_tokens=generated, tokens_per_s=generated / wall,
        prompt_tokens=sum(x.num_prompt_tokens for x in m), visual_tokens=sum(x.num_visual_tokens for x in m),
        prompt_tokens_per_s=sum(x.num_prompt_tokens for x in m) / wall,
        ttft_p50_s=percentile(ttft, 0.5), ttft_p95_s=percentile(ttft, 0.95), ttft_p99_s=percentile(ttft, 0.99),
        mean_queue_s=statistics.mean(x.queue_s for x in m), mean_preprocess_s=statistics.mean(x.preprocess_s for x in m),
        mean_encode_s=statistics.mean(x.encode_s for x in m), mean_prefill_s=statistics.mean(x.prefill_s for x in m),
        mean_tpot_s=statistics.mean([x.tpot_s for x in m if x.tpot_s is not None] or [0.0]),
        page_faults=usage["page_faults"], system_s=usage["system_s"],
        run_counters=delta, stats=after, token_ids=[o.outputs[0].token_ids for o in outs])


def add_all(engine, prompts: list, sampling: SamplingParams, prefix: str) -> list[str]:
    """Prepare every prompt, then add them all (admitted at once, as in generate); their request ids."""
    prepared = engine.prepare_all(prompts, [sampling] * len(prompts))
    return [engine.add_request(p, sampling, request_id=f"{prefix}-{i}", prepared=pp)
            for i, (p, pp) in enumerate(zip(prompts, prepared))]


def abort_all(engine, request_ids: list[str]) -> None:
    """Abort the requests and step until the engine has given everything back."""
    for request_id in request_ids:
        engine.abort_request(request_id)
    while engine.has_unfinished_requests():
        engine.step()


def warm_up(llm: LLM) -> list:
    """A tiny generate first (first-call allocations, thread pools); returns its prompts, for transformers'."""
    prompts = make_workload(12345, 2, (0, 1), (56, 84), (4, 8), alternate=True)
    llm.generate(prompts, greedy(4))
    return prompts


def decode_probe(llm: LLM, prompts: list, max_tokens: int, max_steps: int, count_ops: bool = True) -> dict:
    """Time pure decode steps at the workload's batch size: add every request, step until none is waiting or
    prefilling, then time up to `max_steps` steps in which every running request decodes one token; abort the
    rest. The scheduler is only read here, never driven from outside."""
    engine, sched = llm.engine, llm.engine.scheduler
    ids = add_all(engine, prompts, greedy(max_tokens), "decode-probe")
    while sched.waiting or any(r.num_remaining > 1 for r in sched.running):
        engine.step()
    probe = dict(step_s=[], batch=[], context_tokens=[])
    for _ in range(max_steps):
        running = list(sched.running)
        if not running or sched.waiting or any(r.num_remaining != 1 for r in running):
            break
        start = time.perf_counter()
        engine.step()  # it ends by reading the sampled tokens back to the host: the device work is done
        probe["step_s"].append(time.perf_counter() - start)
        probe["batch"].append(len(running))
        probe["context_tokens"].append(sum(r.num_tokens for r in running))  # KV rows attended this step
    if count_ops and sched.running and not sched.waiting and all(r.num_remaining == 1 for r in sched.running):
        probe["ops"] = decode_step_ops(engine)  # one more decode step, its ATen operations counted (not timed)
    abort_all(engine, ids)
    return probe


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


def add_device_args(parser) -> None:
    """--device and --dtype, the same in every bench script: where the engines run, and in what."""
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the engines run")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                        help="weights and activations")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    src = p.add_argument_group("checkpoint")
    src.add_argument("--checkpoint", help="a local Qwen2-VL folder (HF layout); overrides --preset")
    src.add_argument("--preset", choices=list(PRESETS), default="small", help="random checkpoint to generate")
    src.add_argument("--cache-dir", default="checkpoints/bench-small", help="where the preset is generated once")
    w = p.add_argument_group("workloads")
    w.add_argument("--workload", choices=["decode", "prefill", "both", "burst"], default="both")
    w.add_argument("--num-requests", type=int, default=32, help="decode workload: requests")
    w.add_argument("--max-tokens", type=int, default=128, help="decode workload: output tokens per request")
    w.add_argument("--max-pixels", type=int, default=28 * 28 * 64, help="decode workload: per-prompt pixel cap")
    w.add_argument("--prefill-num-requests", type=int, default=32)
    w.add_argument("--prefill-max-tokens", type=int, default=8)
    w.add_argument("--prefill-max-pixels", type=int, default=28 * 28 * 256,
                   help="prefill workload: per-prompt pixel cap (mm_processor_kwargs), larger images")
    w.add_argument("--burst-num-requests", type=int, default=32, help="burst workload: requests arriving at once")
    w.add_argument("--burst-image-side", type=int, default=896, help="burst workload: each picture's side, px")
    w.add_argument("--seed", type=int, default=0)
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
    p.add_argument("--quick", action="store_true", help="smoke run: few requests, few tokens, small sizes")
    args = p.parse_args(argv)
    args.decode_words, args.prefill_words, args.prefill_images = (8, 64), (200, 500), (1, 3)
    if args.quick:  # smaller defaults; flags given explicitly still win
        args.prefill_words, args.prefill_images = (40, 80), (1, 2)
        quick = dict(num_requests=4, max_tokens=8, prefill_num_requests=4, prefill_max_tokens=2, burst_num_requests=4,
                     burst_image_side=112,
                     hf_batch_sizes="1,4", decode_probe_steps=4, bw_mib=128, repeats=3)
        for key, value in quick.items():
            if getattr(args, key) == p.get_default(key):
                setattr(args, key, value)
    args.hf_batch_sizes = sorted({int(b) for b in args.hf_batch_sizes.split(",") if b.strip()})
    return args


def load_checkpoint(args, log) -> Path:
    if args.checkpoint:
        return Path(args.checkpoint)
    folder = Path(args.cache_dir)
    marker = folder / "bench_checkpoint.json"  # written last: a folder without it is incomplete
    want = {"preset": args.preset, "seed": 0}
    if not marker.exists() or json.loads(marker.read_text()) != want:
        log(f"generating the random '{args.preset}' checkpoint in {folder} ...")
        make_checkpoint(folder, preset=args.preset)
        marker.write_text(json.dumps(want))
    return folder


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
