"""The engine measured in-process: a model's bytes and FLOPs per decode step, a timed decode probe with its op
count, and a whole `generate` run's latency figures.

Lesson: lessons/09-bytes-per-step.md.
"""

import statistics
import time

import torch

from nanomm import LLM
from nanomm.model.qwen2_vl import Qwen2VL
from nanomm.bench.machine import process_usage, usage_since
from nanomm.bench.requests import abort_all, add_all, greedy
from nanomm.sim.stats import percentile
from nanomm.workshop.op_count import decode_step_ops

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


COUNTERS = ("steps", "generated_tokens", "computed_tokens", "visual_tokens_encoded", "encode_s",
            "prefix_cache_queried_tokens", "prefix_cache_hit_tokens", "preemptions")


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
        ttft_p50_s=percentile(ttft, 50), ttft_p95_s=percentile(ttft, 95), ttft_p99_s=percentile(ttft, 99),
        mean_queue_s=statistics.mean(x.queue_s for x in m), mean_preprocess_s=statistics.mean(x.preprocess_s for x in m),
        mean_encode_s=statistics.mean(x.encode_s for x in m), mean_prefill_s=statistics.mean(x.prefill_s for x in m),
        mean_tpot_s=statistics.mean([x.tpot_s for x in m if x.tpot_s is not None] or [0.0]),
        page_faults=usage["page_faults"], system_s=usage["system_s"],
        run_counters=delta, stats=after, token_ids=[o.outputs[0].token_ids for o in outs])


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

