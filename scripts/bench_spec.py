"""Speculative decoding at batch 1: decode tokens/s with n-gram and draft-model proposals against none.

    python scripts/bench_spec.py                      # preset "small" (~100M params, real Qwen vocabulary), CPU
    python scripts/bench_spec.py --quick              # a smoke run
    python scripts/bench_spec.py --json spec.json

One request at a time, ignore_eos. Greedy workloads must generate the same tokens in every configuration
(checked: one whose tokens differ from the plain engine's is reported as NOT EXACT). Three workloads:
  repeat   greedy; the prompt ends with the model's own greedy continuation of a chat prompt (--history tokens),
           so the output goes on repeating text that is already in the prompt: the case prompt lookup is made
           for (editing a document, answering about code in the prompt, a model stuck in a loop);
  fresh    greedy; a plain chat prompt (random-weight models fall into loops quickly, so this repeats too);
  sampled  the fresh prompt at temperature 1: the output is noise, proposals are nearly always wrong, and the
           table shows what trying costs.
Configurations: nanomm without speculation, with n-gram prompt lookup, with draft models made of the target's
first --draft-layers decoder layers (scripts/make_checkpoint.py --draft-from); transformers' generate, plain and
with its prompt-lookup decoding (`prompt_lookup_num_tokens`), on the same token ids (greedy workloads).

Decode rate = (tokens - 1) / (time to the last token - time to the first), so prefill is not counted: nanomm
from the request's metrics, transformers as (N - 1) / (t(N tokens) - t(1 token)). The median of --repeats runs.
The read bandwidth measured in the same run gives the memory-bound limit of plain decode: one token per step,
every weight read once per step. Benchmarks are not tests: nothing asserts a timing.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from nanomm.bench.machine import add_device_args, machine_info, measure_roofline
from nanomm.bench.probes import model_cost
from nanomm.bench.requests import chat_prompt, load_checkpoint

from nanomm import LLM, SamplingParams
from nanomm.tools.draft_checkpoint import make_draft_checkpoint

SEED_TEXT = "Describe the old river boat that sails slowly under the bright city bridge every morning."
FRESH_TEXT = "Write a short story about a small dog who looks at the dark window of a large house."


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def sampled(n: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True, seed=0)


def workloads(llm: LLM, history: int) -> dict[str, tuple[list[int], object]]:
    """Prompt token ids and sampling of each workload (built with the plain engine: every configuration sees
    the same ids)."""
    seed = llm.engine.prepare(chat_prompt(SEED_TEXT), None).token_ids
    continuation = llm.generate({"prompt_token_ids": seed}, greedy(history))[0].outputs[0].token_ids
    fresh = llm.engine.prepare(chat_prompt(FRESH_TEXT), None).token_ids
    return {"repeat": (seed + continuation, greedy), "fresh": (fresh, greedy), "sampled": (fresh, sampled)}


def run_nanomm(llm: LLM, prompt_ids: list[int], params, max_tokens: int, repeats: int) -> dict:
    llm.generate({"prompt_token_ids": prompt_ids[:32]}, greedy(4))  # warm-up: one-time kernel setup
    rates, out = [], None
    for _ in range(repeats):
        out = llm.generate({"prompt_token_ids": prompt_ids}, params(max_tokens))[0]
        m = out.metrics
        rates.append((max_tokens - 1) / (m.e2e_s - m.ttft_s))
    m = out.metrics
    return dict(decode_tokens_per_s=statistics.median(rates), runs=rates, token_ids=out.outputs[0].token_ids,
                acceptance_rate=m.acceptance_rate, mean_tokens_per_step=m.mean_tokens_per_decode_step,
                draft_tokens=m.num_draft_tokens, accepted_tokens=m.num_accepted_tokens,
                decode_steps=m.num_decode_steps)


def run_hf(model, prompt_ids: list[int], max_tokens: int, repeats: int, lookup: int | None) -> dict:
    """transformers' generate on the same ids; lookup = prompt_lookup_num_tokens (its n-gram speculation)."""
    input_ids = torch.tensor([prompt_ids], device=model.device)
    extra = dict(prompt_lookup_num_tokens=lookup) if lookup else {}

    def timed(n):
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=n,
                                 min_new_tokens=n, do_sample=False, pad_token_id=0, **extra)
        return time.perf_counter() - start, out[0, len(prompt_ids):].tolist()

    timed(4)  # warm-up
    rates, tokens = [], None
    for _ in range(repeats):
        first_s, _ = timed(1)
        all_s, tokens = timed(max_tokens)
        rates.append((max_tokens - 1) / (all_s - first_s))
    return dict(decode_tokens_per_s=statistics.median(rates), runs=rates, token_ids=tokens)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", help="an existing Qwen2-VL checkpoint folder (default: generate --preset)")
    p.add_argument("--preset", default="small")
    p.add_argument("--cache-dir", default="checkpoints/bench-small", help="where the preset is generated once")
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--draft-layers", default="1,5", help="decoder layers of the target each draft keeps")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--history", type=int, default=256, help="tokens of the model's own text in the repeat prompt")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-hf", action="store_true", help="skip transformers")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--quick", action="store_true", help="smoke run: few tokens, one repeat")
    add_device_args(p)
    args = p.parse_args(argv)
    if args.quick:
        args.max_tokens, args.history, args.repeats = 16, 32, 1
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    console = Console(stderr=True)
    log = console.log
    torch.manual_seed(0)
    folder = load_checkpoint(args, log)
    configs = {"nanomm": None, f"nanomm + n-gram (k={args.k})": dict(method="ngram", num_speculative_tokens=args.k)}
    for layers in [int(n) for n in args.draft_layers.split(",") if n.strip()]:
        draft_folder = folder.parent / f"{folder.name}-draft{layers}"
        if not (draft_folder / "config.json").exists():
            log(f"making the draft (first {layers} layers) in {draft_folder} ...")
            make_draft_checkpoint(folder, draft_folder, num_layers=layers)
        configs[f"nanomm + draft {layers}L (k={args.k})"] = dict(method="draft", model=str(draft_folder),
                                                                 num_speculative_tokens=args.k)
    results = dict(machine=machine_info(), command=" ".join(["python", "scripts/bench_spec.py", *(argv or sys.argv[1:])]),
                   args=vars(args), workloads={})
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    plain = LLM(str(folder), device=args.device, dtype=args.dtype)
    prompts = workloads(plain, args.history)
    cost = model_cost(plain)
    results["roofline"] = roof = measure_roofline(bw_mib=1024, matmul_n=1024, repeats=5, device=device, dtype=dtype)
    results["weight_bytes_per_step"] = cost["weight_bytes_per_step"]
    results["memory_bound_tokens_per_s"] = roof["read_gbps"] * 1e9 / cost["weight_bytes_per_step"]
    del plain
    for name, spec in configs.items():
        llm = LLM(str(folder), device=args.device, dtype=args.dtype, speculative=spec)
        for workload, (ids, params) in prompts.items():
            log(f"{name} / {workload} ...")
            results["workloads"].setdefault(workload, {"prompt_tokens": len(ids), "greedy": params is greedy})[name] \
                = run_nanomm(llm, ids, params, args.max_tokens, args.repeats)
        del llm
    if not args.no_hf:
        from transformers import Qwen2VLForConditionalGeneration
        model = Qwen2VLForConditionalGeneration.from_pretrained(str(folder), dtype=dtype).to(device).eval()
        for name, lookup in (("transformers", None), (f"transformers + prompt lookup (k={args.k})", args.k)):
            for workload, (ids, params) in prompts.items():
                if params is not greedy:
                    continue
                log(f"{name} / {workload} ...")
                results["workloads"][workload][name] = run_hf(model, ids, args.max_tokens, args.repeats, lookup)
    print_report(Console(), results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return results


def print_report(console: Console, results: dict) -> None:
    machine = results["machine"]
    console.print(f"[bold]{results['command']}[/bold]  ({machine['cpu']}, {machine['usable_cores']} cores, torch "
                  f"{machine['torch']} with {machine['torch_threads']} threads)")
    console.print(f"weights read per decode step {results['weight_bytes_per_step'] / 2**20:.0f} MiB, read bandwidth "
                  f"{results['roofline']['read_gbps']:.1f} GB/s -> memory-bound limit of plain decode "
                  f"{results['memory_bound_tokens_per_s']:.0f} tok/s")
    for workload, runs in results["workloads"].items():
        how = "greedy" if runs["greedy"] else "temperature 1"
        table = Table(title=f"{workload} workload ({runs['prompt_tokens']} prompt tokens, batch 1, {how})")
        for column in ("engine", "decode tok/s", "x nanomm", "acceptance", "tokens / step", "exact"):
            table.add_column(column, justify="left" if column == "engine" else "right")
        base = runs["nanomm"]
        for name, r in runs.items():
            if not isinstance(r, dict):
                continue
            exact = ("yes" if r["token_ids"] == base["token_ids"] else "NOT EXACT") if runs["greedy"] else "n/a"
            table.add_row(name, f"{r['decode_tokens_per_s']:.1f}",
                          f"{r['decode_tokens_per_s'] / base['decode_tokens_per_s']:.2f}",
                          f"{r['acceptance_rate']:.0%}" if "acceptance_rate" in r and r["draft_tokens"] else "-",
                          f"{r['mean_tokens_per_step']:.2f}" if "mean_tokens_per_step" in r else "-", exact)
        console.print(table)


if __name__ == "__main__":
    main()
