"""Quantization, measured: batch-1 decode speed and bytes per step of each weight format, KV capacity and
throughput of an fp8 cache, and how far quantized outputs drift from unquantized ones.

    python scripts/bench_quant.py speed                  # preset "small": float32, bfloat16, int8, int4
    python scripts/bench_quant.py capacity               # preset "small": fp8 KV against auto, fixed KV memory
    python scripts/bench_quant.py agreement              # preset "2b-shaped": top-1 agreement and KL
    python scripts/bench_quant.py kernels                # one LM-head-sized matmul, each kernel and dtype
    python scripts/bench_quant.py speed --quick          # a smoke run (tiny preset, few tokens)

speed      One request at a time (a short text prompt, greedy, ignore_eos), the formats interleaved, --repeats
           rounds; decode rate = 1 / the request's time per output token (prefill not counted), median. Bytes per
           step: the decoder layers, the final norm and the LM head as stored (codes, scales, zeros), plus the KV
           of the context. The read bandwidth measured in the same run gives each format's roofline: bytes per
           step / bandwidth. int8 and int4 are quantized at load from the float32 checkpoint.
capacity   The same KV memory (--kv-memory-mib) for every configuration; --requests requests with max_num_seqs
           high enough that the pool, not the scheduler, limits them. Reports the pool's token capacity, how many
           whole requests (prompt + output, in blocks) it holds, the requests running per step (mean and most),
           preemptions, and generated tokens per second.
agreement  Teacher-forced: --positions positions of random token ids through the unquantized model and through
           each quantized configuration (the dense reference's contiguous cache); top-1 agreement of the next-token
           logits and mean KL(unquantized || quantized).
kernels    One batch-1 product with a 151,936 x 512 weight (the `small` preset's LM head), best of --repeats x 4:
           float32 (torch.mm and the oneDNN-packed layer nanomm uses), bfloat16, and the int8 and int4 kernels
           fed float32 and bfloat16 activations: why quantized layers compute in bfloat16.

Benchmarks are not tests: nothing asserts a timing. Record the CPU with every figure (printed first).
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch


from nanomm.bench.machine import cpu_name, measure_roofline
from nanomm.bench.probes import model_cost

from nanomm import LLM, SamplingParams
from nanomm.model.loader import load_model
from nanomm.accel.quant import quantize_language_model, weight_bytes
from nanomm.model.rope import text_positions
from nanomm.reference import ContiguousKVCache
from nanomm.tools.random_checkpoint import make_checkpoint

PROMPT = ("<|im_start|>user\nWrite a short story about a small dog who looks at the dark window of a large "
          "house.<|im_end|>\n<|im_start|>assistant\n")
FORMATS = {  # name -> LLM arguments
    "float32": dict(dtype="float32"),
    "bfloat16": dict(dtype="bfloat16"),
    "int8": dict(dtype="float32", quantization="int8"),
    "int4": dict(dtype="float32", quantization="int4"),
}


def decode_weight_bytes(llm: LLM) -> int:
    """Bytes of weights one decode step reads: decoder layers, final norm, LM head (as stored)."""
    if llm.engine.config.quantization is None:  # the engine may hold oneDNN-packed copies: count a plain model
        return model_cost(llm)["weight_bytes_per_step"]
    lm = llm.model.language_model
    return weight_bytes(lm.layers) + weight_bytes(lm.norm) + weight_bytes(llm.model.lm_head)


def speed(args) -> dict:
    folder = make_checkpoint(args.cache_dir, preset=args.preset)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    engines = {name: LLM(str(folder), device=args.device, quantization_group_size=args.group_size,
                         kv_cache_memory_gib=1.0, **extra)  # a fixed pool: four engines share one GPU
               for name, extra in FORMATS.items()}
    for llm in engines.values():
        llm.generate(PROMPT, params, use_tqdm=False)  # warm-up
    rates: dict[str, list[float]] = {name: [] for name in engines}
    tokens = {}
    for _ in range(args.repeats):  # interleaved, so that a noisy moment hits every format alike
        for name, llm in engines.items():
            out = llm.generate(PROMPT, params, use_tqdm=False)[0]
            rates[name].append(1 / out.metrics.tpot_s)
            tokens[name] = list(out.outputs[0].token_ids)
    roof = measure_roofline(args.bw_mib, 1024, 5, torch.device(engines["float32"].model.device))
    rows = {}
    for name, llm in engines.items():
        context = len(llm.get_tokenizer().encode(PROMPT)) + args.max_tokens // 2
        nbytes = decode_weight_bytes(llm) + context * llm.stats()["kv_bytes_per_token"]
        rate = statistics.median(rates[name])
        rows[name] = dict(tok_s=rate, all_tok_s=rates[name], bytes_per_step=nbytes,
                          roofline_tok_s=roof["read_gbps"] * 1e9 / nbytes,
                          same_tokens_as_float32=tokens[name] == tokens["float32"],
                          first_divergence=_first_difference(tokens[name], tokens["float32"]))
        llm.close()
    base = rows["float32"]["tok_s"]
    print(f"\nbatch-1 decode, preset {args.preset}, {args.max_tokens} tokens, median of {args.repeats}; "
          f"read bandwidth {roof['read_gbps']:.1f} GB/s\n")
    print("| format | decode tok/s | vs float32 | MB read per step | roofline tok/s | of roofline | "
          "same tokens as float32 |\n|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        same = "yes" if r["same_tokens_as_float32"] else f"no (from token {r['first_divergence']})"
        print(f"| {name} | {r['tok_s']:.1f} | {r['tok_s'] / base:.2f}x | {r['bytes_per_step'] / 1e6:.1f} | "
              f"{r['roofline_tok_s']:.1f} | {r['tok_s'] / r['roofline_tok_s']:.0%} | {same} |")
    return dict(rows=rows, roofline=roof)


def _first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def capacity(args) -> dict:
    folder = make_checkpoint(args.cache_dir, preset=args.preset)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    prompts = [PROMPT.replace("small dog", f"small dog number {i}") for i in range(args.requests)]
    rows = {}
    for dtype in ("float32", "bfloat16"):
        for kv in ("auto", "fp8"):
            with LLM(str(folder), dtype=dtype, kv_cache_dtype=kv, kv_cache_memory_gib=args.kv_memory_mib / 1024,
                     max_num_seqs=args.requests, enable_prefix_caching=False) as llm:
                rows[f"{dtype} weights, {kv} KV"] = _run_capacity(llm, prompts, params)
    print(f"\nKV pool of {args.kv_memory_mib} MiB, preset {args.preset}, {args.requests} requests of "
          f"{args.max_tokens} greedy tokens, max_num_seqs {args.requests}\n")
    print("| configuration | KV bytes per token | pool tokens | whole requests it holds | running per step "
          "(mean / most) | preemptions | generated tok/s |\n|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['kv_bytes_per_token']} | {r['kv_capacity_tokens']:,} | {r['whole_requests']} | "
              f"{r['mean_running']:.1f} / {r['max_running']} | {r['preemptions']} | {r['tok_s']:.1f} |")
    return rows


def _run_capacity(llm: LLM, prompts: list[str], params: SamplingParams) -> dict:
    engine = llm.engine
    for prompt in prompts:
        engine.add_request(prompt, params)
    running, generated, began = [], 0, time.perf_counter()
    while engine.has_unfinished_requests():
        outputs = engine.step()
        running.append(engine.stats()["running"])
        generated += sum(len(o.outputs[0].delta_token_ids) for o in outputs)
    elapsed = time.perf_counter() - began
    stats, block = engine.stats(), engine.config.block_size
    request_blocks = -(-(len(engine.prepare(prompts[-1], params).token_ids) + params.max_tokens) // block)
    return dict(kv_bytes_per_token=stats["kv_bytes_per_token"], kv_capacity_tokens=stats["kv_capacity_tokens"],
                whole_requests=stats["kv_blocks_total"] // request_blocks, mean_running=statistics.mean(running),
                max_running=max(running), preemptions=stats["preemptions"], tok_s=generated / elapsed)


@torch.inference_mode()
def agreement(args) -> dict:
    folder = make_checkpoint(args.cache_dir, preset=args.preset)
    g = torch.Generator().manual_seed(0)
    configurations = {"int8": ("int8", "auto"), "int4": ("int4", "auto"), "fp8 KV": (None, "fp8"),
                      "int4 + fp8 KV": ("int4", "fp8")}
    model = load_model(folder, dtype="float32")
    vocab = model.config.text.vocab_size
    sequences = [torch.randint(0, min(vocab, 151_643), (args.sequence_length,), generator=g)
                 for _ in range(-(-args.positions // args.sequence_length))]
    reference = [_logits(model, ids, "auto") for ids in sequences]
    best_two = torch.cat(reference).topk(2, dim=-1).values  # (positions, 2)
    margin = float((best_two[:, 0] - best_two[:, 1]).median())  # how close a flip is on this checkpoint
    rows = {}
    for name, (quantization, kv) in configurations.items():
        quantized = model
        if quantization is not None:
            quantized = load_model(folder, dtype="float32")
            quantize_language_model(quantized, quantization, args.group_size)
        agree, kl, count, moved = 0, 0.0, 0, []
        for ids, base in zip(sequences, reference):
            logits = _logits(quantized, ids, kv)
            agree += int((logits.argmax(-1) == base.argmax(-1)).sum())
            moved.append((logits - base).abs().mean(dim=-1))
            kl += float(torch.nn.functional.kl_div(logits.log_softmax(-1), base.log_softmax(-1), log_target=True,
                                                   reduction="sum"))
            count += len(ids)
        rows[name] = dict(top1_agreement=agree / count, mean_kl=kl / count, positions=count,
                          mean_abs_logit_change=float(torch.cat(moved).mean()))
    print(f"\nteacher-forced next-token logits against float32, preset {args.preset}, "
          f"{rows['int8']['positions']} positions of random ids; median gap between the two best float32 "
          f"logits {margin:.2e}\n")
    print("| configuration | top-1 agreement | mean KL (nats) | mean abs logit change |\n|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['top1_agreement']:.1%} | {r['mean_kl']:.2e} | {r['mean_abs_logit_change']:.2e} |")
    return dict(rows=rows, median_top2_margin=margin)


def _logits(model, ids: torch.Tensor, kv_cache_dtype: str) -> torch.Tensor:
    cache = ContiguousKVCache(model.config.text.num_hidden_layers, kv_cache_dtype)
    hidden = model(ids, text_positions(len(ids)), cache)  # (positions, hidden)
    return model.compute_logits(hidden)  # (positions, vocab) float32


def kernels(args) -> dict:
    from nanomm.bench.machine import best_time
    from torch import nn

    from nanomm.accel.packed_linear import PackedLinear
    from nanomm.accel.quant import Int4Linear, Int8Linear

    g = torch.Generator().manual_seed(0)
    dense = nn.Linear(512, 151_936 if not args.quick else 1024, bias=False)
    dense.weight.data = torch.randn(dense.out_features, 512, generator=g) * 0.02
    x = torch.randn(1, 512, generator=g)
    int8, int4 = Int8Linear(dense), Int4Linear(dense, args.group_size)
    packed, x16, weight16 = PackedLinear(dense), x.bfloat16(), dense.weight.detach().bfloat16()
    calls = {
        "float32 torch.mm": lambda: x @ dense.weight.t(),
        "float32 oneDNN-packed (LLM's CPU default)": lambda: packed(x),
        "bfloat16 torch.mm": lambda: x16 @ weight16.t(),
        "int8 kernel, float32 activations": lambda: torch.ops.aten._weight_int8pack_mm(x, int8.codes,
                                                                                        int8.scales.float()),
        "int8 kernel, bfloat16 activations": lambda: int8.kernel_matmul(x16),
        "int4 kernel, float32 activations": lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(
            x, int4.kernel_weight, int4.group_size, int4.scales_and_zeros.float()),
        "int4 kernel, bfloat16 activations": lambda: int4.kernel_matmul(x16),
    }  # the CPU's kernels (the layers' own calls, and the same ops fed float32)
    rows = {}
    for name, call in calls.items():
        try:
            rows[name] = best_time(call, 4 * args.repeats) * 1e3
        except (RuntimeError, TypeError) as exc:  # a kernel missing or refusing a dtype on this build
            rows[name] = None
            print(f"{name}: {exc}")
    print(f"\none batch-1 product with a {dense.out_features:,} x 512 weight, best of {4 * args.repeats}\n")
    print("| call | ms |\n|---|---|")
    for name, ms in rows.items():
        print(f"| {name} | {'-' if ms is None else f'{ms:.2f}'} |")
    return rows


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["speed", "capacity", "agreement", "kernels"])
    p.add_argument("--preset", help="random checkpoint (default: small; 2b-shaped for agreement)")
    p.add_argument("--cache-dir", help="where the preset is generated once (default: checkpoints/bench-PRESET)")
    p.add_argument("--device", help="speed: cpu or cuda (default: cuda when available)")
    p.add_argument("--group-size", type=int, default=128, help="int4: input columns per scale")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--bw-mib", type=int, default=512, help="tensor size of the bandwidth test")
    p.add_argument("--requests", type=int, default=96, help="capacity: requests")
    p.add_argument("--kv-memory-mib", type=float, default=8.0, help="capacity: the KV pool, for every configuration")
    p.add_argument("--positions", type=int, default=1024, help="agreement: positions compared")
    p.add_argument("--sequence-length", type=int, default=256, help="agreement: positions per sequence")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    p.add_argument("--quick", action="store_true", help="smoke run: tiny preset, few tokens")
    p.add_argument("--json", help="write the numbers here too")
    args = p.parse_args(argv)
    args.preset = args.preset or ("tiny" if args.quick else "2b-shaped" if args.what == "agreement" else "small")
    args.cache_dir = args.cache_dir or f"checkpoints/bench-{args.preset}"
    if args.quick:
        args.max_tokens, args.repeats, args.bw_mib, args.requests = 8, 1, 16, 6
        args.positions, args.sequence_length, args.group_size, args.kv_memory_mib = 64, 32, 32, 0.05
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"{cpu_name()} | torch {torch.__version__} | {torch.get_num_threads()} threads | "
          f"command: python scripts/bench_quant.py {' '.join(sys.argv[1:] if argv is None else argv)}")
    results = {"speed": speed, "capacity": capacity, "agreement": agreement, "kernels": kernels}[args.what](args)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    return results


if __name__ == "__main__":
    main()
