"""Accuracy of the demo model per task, at several pixel caps, with TTFT per cap; and on independently drawn pictures.

    python scripts/eval_demo.py --model runs/demo                        # 200 questions per task, five caps
    python scripts/eval_demo.py --model runs/demo --per-task 50 --caps 16 100
    python scripts/eval_demo.py --model runs/demo --draft runs/draft     # plus the draft's speed-up
    python scripts/eval_demo.py --model runs/demo --json results.json    # also write the numbers as JSON
    python scripts/eval_demo.py --model runs/demo --quantization int4 --kv-cache-dtype fp8   # quantized serving
    python scripts/eval_demo.py --model runs/demo --caps --no-external --number-by-size --seed 9  # why numbers fail

Prints markdown tables: accuracy by task x cap on the held-out set (nanomm/demo/evaluation.py), accuracy at the
default cap on pictures from nanomm/workshop/other_renderer.py, with --draft, speculative decoding at batch 1, and
with --number-by-size, number reading by digit height and number length, and its mistakes by kind.
Greedy decoding through nanomm.LLM on the CPU; TTFT is the median of one-at-a-time requests.
"""

import argparse
import bisect
import json
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch


from nanomm.bench.machine import cpu_name
from nanomm import LLM, SamplingParams
from nanomm.demo.evaluation import (CAPS, MISREADINGS, EvalItem, accuracy, answer_items,
                                    conversation, digit_height, held_out_items, median_ttft, misreading,
                                    tasks_with_follow_up)
from nanomm.demo.tasks import QA, grade
from nanomm.engine.trace import ENGINE_PID
from nanomm.inputs.image import ImageProcessorConfig


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a trained demo checkpoint folder (scripts/train_demo.py)")
    parser.add_argument("--per-task", type=int, default=200)
    parser.add_argument("--caps", type=int, nargs="*", default=list(CAPS),
                        help="visual tokens per picture (none: skip the held-out table)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-external", action="store_true", help="skip the independently drawn set")
    parser.add_argument("--draft", default=None, help="a draft folder: also measure speculative decoding with it")
    parser.add_argument("--spec-requests", type=int, default=24, help="requests in the speculative measurement")
    parser.add_argument("--json", help="write the results here too")
    parser.add_argument("--quantization", choices=["int8", "int4"], help="weight-only quantization (accel/quant.py)")
    parser.add_argument("--group-size", type=int, default=128, help="int4: input columns per scale")
    parser.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto")
    parser.add_argument("--number-by-size", action="store_true",
                        help="also: number reading at the default cap by digit height and by how many digits")
    args = parser.parse_args(argv)
    args.engine = dict(quantization=args.quantization, quantization_group_size=args.group_size,
                       kv_cache_dtype=args.kv_cache_dtype)  # every LLM below gets these
    model = args.model
    print(f"model {model} | {cpu_name()} | torch {torch.__version__} | "
          f"{torch.get_num_threads()} threads | quantization {args.quantization} | KV {args.kv_cache_dtype}")
    results = {"held_out": held_out_table(model, args) if args.caps else None, "external": None, "speculative": None}
    if not args.no_external:
        results["external"] = external_table(model, args)
    if args.draft:
        results["speculative"] = speculative_table(model, args.draft, args)
    if args.number_by_size:
        results["number_by_size"], results["number_misreadings"] = number_by_size_table(model, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


def held_out_table(model: str, args) -> dict:
    tasks = tasks_with_follow_up()
    items = {task: held_out_items(task, args.per_task, args.seed) for task in tasks}
    ttft_items = held_out_items("number", 13, seed=args.seed + 1000)  # pictures of their own: no cache hits
    table, token_pixels = {}, ImageProcessorConfig.from_pretrained(model).factor  # one visual token's side
    for cap in args.caps:
        with LLM(model, max_pixels=cap * token_pixels ** 2, min_pixels=min(cap, 16) * token_pixels ** 2,
                 **args.engine) as llm:
            row = {"ttft": median_ttft(llm, ttft_items)}  # first: on pictures no cache holds yet
            began = time.perf_counter()
            row |= {task: accuracy(llm, items[task])[:2] for task in tasks}
            row["seconds"] = time.perf_counter() - began
        table[cap] = row
    header = "| task | " + " | ".join(f"{cap} tokens" for cap in args.caps) + " |"
    print(f"\nheld-out set, {args.per_task} questions per task (seed {args.seed}); accuracy by visual-token cap\n")
    print(header + "\n|" + "---|" * (len(args.caps) + 1))
    for task in tasks:
        print(f"| {task} | " + " | ".join(_percent(*table[cap][task]) for cap in args.caps) + " |")
    for key, label in (("visual_tokens", "visual tokens per picture (median)"), ("ttft_ms", "TTFT ms (median, batch 1)"),
                       ("encode_ms", "  of which vision encode ms"), ("prefill_ms", "  of which prefill ms")):
        print(f"| {label} | " + " | ".join(f"{table[cap]['ttft'][key]:.1f}" for cap in args.caps) + " |")
    return table


def external_table(model: str, args) -> dict:
    from nanomm.workshop.other_renderer import TASKS as EXTERNAL_TASKS
    from nanomm.workshop.other_renderer import external_items

    table = {}
    with LLM(model, **args.engine) as llm:
        for task in EXTERNAL_TASKS:
            items = [EvalItem(e.task, e.images, (QA(e.task, e.question, e.answer),))
                     for e in external_items(task, args.per_task, args.seed)]
            table[task] = accuracy(llm, items)[:2]
    print(f"\npictures drawn by nanomm/workshop/other_renderer.py, {args.per_task} per task, default cap\n")
    print("| task | accuracy |\n|---|---|")
    for task, (right, total) in table.items():
        print(f"| {task} | {_percent(right, total)} |")
    return table


HEIGHT_EDGES = (10, 15, 20, 30)  # digit height in the picture the model sees, px: the groups' bounds
HEIGHT_GROUPS = tuple(f"digits {low}-{high} px tall" for low, high in zip((0,) + HEIGHT_EDGES, HEIGHT_EDGES))
HEIGHT_GROUPS += (f"digits {HEIGHT_EDGES[-1]}+ px tall",)


def number_by_size_table(model: str, args) -> tuple[dict, dict]:
    """Number reading at the default cap, split by how tall the digits are once the picture is resized to the
    cap, and by how many digits the number has; then the wrong readings by kind of mistake (`misreading`)."""
    items = held_out_items("number", args.per_task, args.seed)
    image_config = ImageProcessorConfig.from_pretrained(model)
    with LLM(model, **args.engine) as llm:
        replies = answer_items(llm, items)
    groups = {key: [0, 0] for key in HEIGHT_GROUPS + tuple(f"{n}-digit numbers" for n in (1, 2, 3))}  # right, total
    mistakes = Counter()
    for item, reply in zip(items, replies):
        right, number = grade(item.turns[-1], reply), item.scenes[0].number
        height_group = HEIGHT_GROUPS[bisect.bisect_right(HEIGHT_EDGES, digit_height(item, image_config))]
        for key in (height_group, f"{len(number)}-digit numbers"):
            groups[key][0] += right
            groups[key][1] += 1
        if not right:
            mistakes[misreading(number, reply)] += 1
    groups = {key: tally for key, tally in groups.items() if tally[1]}
    mistakes = {kind: mistakes[kind] for kind in MISREADINGS if mistakes[kind]}
    print(f"\nnumber reading at the default cap, {args.per_task} questions (seed {args.seed})\n")
    print("| group | questions | accuracy |\n|---|---:|---:|")
    for key, (right, total) in groups.items():
        print(f"| {key} | {total} | {_percent(right, total)} |")
    print(f"\nthe {sum(mistakes.values())} wrong readings, by kind of mistake\n")
    print("| mistake | readings |\n|---|---:|")
    for kind, n in mistakes.items():
        print(f"| {kind} | {n} |")
    return groups, mistakes


def speculative_table(model: str, draft: str, args, k: int = 4) -> dict:
    """Batch 1, greedy, "Describe the picture." (the longest answers): decode rate with the draft against without.

    Decode rate = (tokens - 1) / (last token time - first token time): the target's prefill is not counted, the
    draft's is (its first round). Outputs must be identical token for token; the table says so. A second table takes the
    decode steps apart (from each run's engine trace, engine/trace.py): how long a step is, how much of it the
    draft's proposals take and how much the target's forward pass, and how many tokens a step emits."""
    items = held_out_items("describe", args.spec_requests, seed=args.seed)
    params = SamplingParams(temperature=0.0, max_tokens=48)
    runs = {}
    for name, extra in (("plain", {}), (f"draft k={k}", {"speculative": {"method": "draft", "model": draft,
                                                                          "num_speculative_tokens": k}})):
        with tempfile.TemporaryDirectory() as folder:
            trace_file = Path(folder) / "trace.json"
            with LLM(model, **extra, **args.engine, trace_path=str(trace_file)) as llm:
                warm_up = llm.chat(conversation(items[0], []), params)[0]
                outs = [llm.chat(conversation(item, []), params)[0] for item in items]
            steps = decode_step_costs(trace_file, max_step_tokens=1 + k)
        decode_s = sum(o.metrics.e2e_s - o.metrics.ttft_s for o in outs)
        emitted_in_decode = sum(len(o.outputs[0].token_ids) - 1 for o in [warm_up] + outs)  # the trace has both
        runs[name] = {"tokens": [list(o.outputs[0].token_ids) for o in outs],
                      "decode_tok_s": sum(len(o.outputs[0].token_ids) - 1 for o in outs) / decode_s,
                      "e2e_ms": 1e3 * statistics.median(o.metrics.e2e_s for o in outs),
                      "proposed": sum(o.metrics.num_draft_tokens for o in outs),
                      "accepted": sum(o.metrics.num_accepted_tokens for o in outs),
                      "decode_steps": steps | {"tokens_per_step": emitted_in_decode / steps["steps"]}}
    plain, spec = runs["plain"], runs[f"draft k={k}"]
    exact = plain["tokens"] == spec["tokens"]
    mean_tokens = statistics.mean(len(t) for t in plain["tokens"])
    print(f"\nspeculative decoding with the trained draft, batch 1, greedy, {len(items)} 'Describe the picture.' "
          f"requests ({mean_tokens:.1f} tokens each on average)\n")
    print("| configuration | decode tok/s | median end-to-end ms | acceptance | same tokens |\n|---|---|---|---|---|")
    for name, run in runs.items():
        rate = f"{run['accepted'] / run['proposed']:.2f}" if run["proposed"] else "-"
        print(f"| {name} | {run['decode_tok_s']:.1f} | {run['e2e_ms']:.1f} | {rate} | "
              f"{'yes' if name == 'plain' or exact else 'NO'} |")
    print(f"decode speedup {spec['decode_tok_s'] / plain['decode_tok_s']:.2f}x, end-to-end "
          f"{plain['e2e_ms'] / spec['e2e_ms']:.2f}x")
    print("\nthe decode steps of both runs (warm-up request included; medians)\n")
    print("| configuration | decode steps | tokens per step | step ms | of which the draft's proposals ms | "
          "of which the target's forward ms |\n|---|---:|---:|---:|---:|---:|")
    for name, run in runs.items():
        s = run["decode_steps"]
        print(f"| {name} | {s['steps']} | {s['tokens_per_step']:.2f} | {s['step_ms']:.2f} | {s['propose_ms']:.2f} | "
              f"{s['forward_ms']:.2f} |")
    for run in runs.values():
        del run["tokens"]
    return {"runs": runs, "exact": exact}


def decode_step_costs(trace_file: Path, max_step_tokens: int) -> dict:
    """Medians over the decode steps of an engine trace, in ms: the whole step, its "propose" span (the draft's
    rounds, its catch-up included) and its forward pass. A decode step's forward computes at most
    max_step_tokens tokens (the last known one and the proposals); a prefill step's computes the prompt."""
    events = json.loads(trace_file.read_text())["traceEvents"]
    steps, parts = [], {}
    for event in events:  # the engine lane's spans, each appended when it ends: a step's parts come before it
        if event.get("ph") != "X" or event["pid"] != ENGINE_PID:
            continue
        if event["name"] == "step":
            steps.append(parts | {"step": event})
            parts = {}
        else:
            parts[event["name"]] = event
    decode = [s for s in steps if "forward" in s and s["forward"]["args"]["tokens"] <= max_step_tokens]

    def median_ms(name: str) -> float:
        return statistics.median(s[name]["dur"] / 1e3 if name in s else 0.0 for s in decode)

    return {"steps": len(decode), "step_ms": median_ms("step"), "propose_ms": median_ms("propose"),
            "forward_ms": median_ms("forward")}


def _percent(right: int, total: int) -> str:
    return f"{100 * right / total:.1f}%"


if __name__ == "__main__":
    main()
