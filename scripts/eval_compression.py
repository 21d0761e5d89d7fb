"""Visual-token compression on the trained demo model: accuracy per task, method and keep ratio, next to the random
baseline and the resolution cap that gives as many tokens, with encode / prefill / TTFT and throughput.

    python scripts/eval_compression.py --out runs/compression --caps 72 36 15     # every configuration (long)
    python scripts/eval_compression.py --out runs/compression --caps 72 36 15 --timing-only   # quiet machine
    python scripts/eval_compression.py --out runs/compression --methods prune pool --ratios 0.5
    python scripts/eval_compression.py --out runs/compression --caps 72 36 15 --methods
    python scripts/eval_compression.py --report runs/compression                  # the markdown tables
    python scripts/eval_compression.py --report runs/compression --summary lessons/data/10-compression.json

Each configuration is one JSON file in --out, so configurations can run in several processes (one per core) and
be reported together. A configuration is "none" (every token, the default cap of 144), a method at a keep ratio
(nanomm/inputs/compression.py) at the default cap, or a smaller cap with no compression (appendix A1's lever).
Accuracy: greedy through nanomm.LLM on the held-out set (nanomm/demo/evaluation.py), the same items for every
configuration. TTFT: the median of one-at-a-time requests on pictures no cache holds. Throughput: a fixed batch of
48 single-picture questions submitted at once (distinct pictures, so no cache serves them), 8 tokens each.
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import torch


from nanomm.bench.machine import cpu_name
import nanomm
from nanomm import LLM, SamplingParams
from nanomm.demo.evaluation import EvalItem, accuracy, conversation, held_out_items, median_ttft
from nanomm.workshop.other_renderer import TASKS as EXTERNAL_TASKS
from nanomm.workshop.other_renderer import external_items
from nanomm.demo.tasks import QA, TASKS
from nanomm.inputs.image import ImageProcessorConfig

METHODS = ("pool", "random", "prune", "attention")
RATIOS = (0.5, 0.25, 0.1)
DEFAULT_CAP = 144  # the demo model's visual tokens per picture (--cap)
THROUGHPUT_REQUESTS, THROUGHPUT_TOKENS = 48, 8


def configurations(args) -> list[dict]:
    out = [{"name": "none", "cap": args.cap, "policy": None}] if args.baseline else []
    out += [{"name": f"{m} {r}", "cap": args.cap, "policy": {"method": m, "keep_ratio": r}}
            for m in args.methods for r in args.ratios]
    out += [{"name": f"cap {c}", "cap": c, "policy": None} for c in args.caps]
    return out


def run(config: dict, args) -> dict:
    """One configuration: TTFT, throughput and (unless --timing-only) accuracy on every task."""
    model = args.model
    token_side = ImageProcessorConfig.from_pretrained(model).factor  # one visual token's side in pixels
    cap = config["cap"]
    smallest = cap if args.fixed_size else min(cap, 16)  # --fixed-size: every picture resized to the cap
    engine = dict(max_pixels=cap * token_side ** 2, min_pixels=smallest * token_side ** 2,
                  visual_token_compression=config["policy"])
    items = {task: question_items(task, args) for task in args.tasks}
    with LLM(model, **engine) as llm:
        fresh = held_out_items("number", args.ttft_repeats + 1, seed=args.seed + 1000)  # pictures of their own
        row = dict(config, ttft=median_ttft(llm, fresh, repeats=args.ttft_repeats))
        row["throughput"] = throughput(llm, held_out_items("colour", THROUGHPUT_REQUESTS, seed=args.seed + 2000))
        if args.timing_only:
            return row
        began = time.perf_counter()
        row["accuracy"] = {task: accuracy(llm, items[task])[:2] for task in args.tasks}
        row["accuracy_s"] = time.perf_counter() - began
    return row


def question_items(task: str, args) -> list[EvalItem]:
    """The held-out set's questions of a task, or with --external the pictures drawn by independent code."""
    if not args.external:
        return held_out_items(task, args.per_task, args.seed)
    return [EvalItem(e.task, e.images, (QA(e.task, e.question, e.answer),))
            for e in external_items(task, args.per_task, args.seed)]


def throughput(llm, items) -> dict:
    """48 requests at once: requests/s and output tokens/s over the whole batch, and what their prompts hold."""
    params = SamplingParams(temperature=0.0, max_tokens=THROUGHPUT_TOKENS, ignore_eos=True)
    began = time.perf_counter()
    outs = llm.chat([conversation(item, []) for item in items], params, use_tqdm=False)
    elapsed = time.perf_counter() - began
    block = llm.engine.config.block_size
    return {"seconds": elapsed, "requests_per_s": len(outs) / elapsed,
            "output_tokens_per_s": sum(len(o.outputs[0].token_ids) for o in outs) / elapsed,
            "visual_tokens": statistics.median(o.metrics.num_visual_tokens for o in outs),
            "encoded_tokens": statistics.median(o.metrics.num_encoded_visual_tokens for o in outs),
            "prompt_tokens": statistics.median(o.metrics.num_prompt_tokens for o in outs),
            "kv_blocks": statistics.median(-(-(o.metrics.num_prompt_tokens + THROUGHPUT_TOKENS) // block)
                                           for o in outs),
            "encode_s": sum(o.metrics.encode_s for o in outs)}


def load_rows(folder: Path) -> list[dict]:
    """Each configuration's accuracy run, with its --timing-only and --external results where there are some (a
    folder of --timing-only runs alone gives rows without accuracy)."""
    rows = []
    for stem in sorted({p.name.split(".json")[0].removesuffix(".timing").removesuffix(".external")
                        for p in folder.glob("*.json")}):
        plain, timing, external = (folder / f"{stem}{suffix}.json" for suffix in ("", ".timing", ".external"))
        row = json.loads((plain if plain.exists() else timing).read_text())
        if timing.exists():  # all configurations timed in one quiet process
            measured = json.loads(timing.read_text())
            row.update(ttft=measured["ttft"], throughput=measured["throughput"], timing_machine=measured["machine"])
        if external.exists():
            row["external"] = json.loads(external.read_text())["accuracy"]
        rows.append(row)
    full = max(r["cap"] for r in rows)
    ratios = {r["policy"]["keep_ratio"] for r in rows if r["policy"]} | {1.0}
    order = {"none": 0, "pool": 1, "random": 2, "prune": 3, "attention": 4, "cap": 5}

    def key(row):  # by keep ratio (a cap: the ratio nearest its share of the full cap), then by method
        share = row["cap"] / full
        ratio = row["policy"]["keep_ratio"] if row["policy"] else min(ratios, key=lambda x: abs(x - share))
        return -ratio, order[row["name"].split()[0]]

    return sorted(rows, key=key)


def report(folder: Path, summary_path: str | None) -> None:
    """Print the tables; with summary_path, also write the rows the lesson reads (lessons/data/)."""
    rows = load_rows(folder)
    tasks = list(rows[0].get("accuracy", {}))
    if summary_path:
        Path(summary_path).write_text(json.dumps(summary(rows, tasks), indent=1) + "\n")
    print(f"accuracy: {rows[0]['machine']}; {rows[0]['per_task']} questions per task (seed {rows[0]['seed']})")
    print(f"timings: {rows[0].get('timing_machine', rows[0]['machine'])}")
    if tasks:
        print_accuracy(rows, "accuracy", "held-out set")
    if any("external" in r for r in rows):
        print_accuracy([r for r in rows if "external" in r], "external", "pictures drawn by other_renderer.py")
    print("\n| configuration | visual tokens | encoded | KV blocks | encode ms | prefill ms | TTFT ms | "
          "req/s (48 at once) | out tok/s |\n|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        t, b = r["ttft"], r["throughput"]
        print(f"| {r['name']} | {t['visual_tokens']:.0f} | {b['encoded_tokens']:.0f} | {b['kv_blocks']:.0f} | "
              f"{t['encode_ms']:.1f} | {t['prefill_ms']:.1f} | {t['ttft_ms']:.1f} | {b['requests_per_s']:.2f} | "
              f"{b['output_tokens_per_s']:.1f} |")


def print_accuracy(rows: list[dict], key: str, title: str) -> None:
    tasks = list(rows[0][key])
    print(f"\n{title}, accuracy %\n\n| configuration | visual tokens | " + " | ".join(tasks) + " |\n|"
          + "---|" * (len(tasks) + 2))
    for r in rows:
        cells = [f"{100 * right / total:.1f}" for right, total in r[key].values()]
        print(f"| {r['name']} | {r['throughput']['visual_tokens']:.0f} | " + " | ".join(cells) + " |")


def summary(rows: list[dict], tasks: list[str]) -> dict:
    """The measured rows in percent and milliseconds, with the command and machine that produced them."""
    first = rows[0]
    command = (f"python scripts/eval_compression.py --out runs/compression --per-task {first['per_task']} "
               "--caps 72 36 15"
               " (accuracy: split over two processes with OMP_NUM_THREADS=1), then the same with --timing-only "
               "(timings: one process, alone on the machine)")
    return {"command": command, "accuracy_machine": first["machine"],
            "timing_machine": first.get("timing_machine", first["machine"]), "per_task": first["per_task"],
            "tasks": tasks,
            "rows": [{"name": r["name"], "visual_tokens": r["throughput"]["visual_tokens"],
                      "encoded_tokens": r["throughput"]["encoded_tokens"], "kv_blocks": r["throughput"]["kv_blocks"],
                      "accuracy": _percent(r["accuracy"]), "external": _percent(r.get("external", {})),
                      "ttft_ms": round(r["ttft"]["ttft_ms"], 2), "encode_ms": round(r["ttft"]["encode_ms"], 2),
                      "prefill_ms": round(r["ttft"]["prefill_ms"], 2),
                      "requests_per_s": round(r["throughput"]["requests_per_s"], 2),
                      "output_tokens_per_s": round(r["throughput"]["output_tokens_per_s"], 1)} for r in rows]}


def _percent(accuracy: dict) -> dict:
    return {task: round(100 * right / total, 2) for task, (right, total) in accuracy.items()}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # The timings of the accuracy runs are kept, but --report shows a --timing-only run's where there is one.
    parser.add_argument("--model", default=None, help="a demo checkpoint folder; default: the one shipped")
    parser.add_argument("--out", help="a folder for one JSON file per configuration")
    parser.add_argument("--report", help="print the tables of the JSON files in this folder, and stop")
    parser.add_argument("--summary", help="with --report: also write the rows as one JSON file (the lesson's)")
    parser.add_argument("--methods", nargs="*", default=list(METHODS), choices=METHODS)
    parser.add_argument("--ratios", type=float, nargs="*", default=list(RATIOS))
    parser.add_argument("--caps", type=int, nargs="*", default=[], help="also: these caps, uncompressed")
    parser.add_argument("--no-baseline", dest="baseline", action="store_false", help="skip 'none'")
    parser.add_argument("--cap", type=int, default=DEFAULT_CAP, help="visual tokens per picture before compression")
    parser.add_argument("--fixed-size", action="store_true", help="resize every picture to the cap (up if need be): "
                        "for timings on a random-weight model at a larger cap")
    parser.add_argument("--tasks", nargs="*", default=list(TASKS), choices=TASKS)
    parser.add_argument("--per-task", type=int, default=500)
    parser.add_argument("--external", action="store_true", help="accuracy on pictures drawn by independent code "
                        "(nanomm/workshop/other_renderer.py), into NAME.external.json")
    parser.add_argument("--timing-only", action="store_true", help="TTFT and throughput only, into NAME.timing.json "
                        "(which --report prefers), after one discarded warm-up: run it alone on a quiet machine")
    parser.add_argument("--ttft-repeats", type=int, default=12, help="requests in each TTFT median")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.external:
        args.tasks = [t for t in args.tasks if t in EXTERNAL_TASKS]
    if args.report:
        return report(Path(args.report), args.summary)
    if not args.out:
        parser.error("give --out (a folder for the results), or --report")
    args.model = args.model or str(nanomm.demo_checkpoint())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    machine = f"{cpu_name()}, torch {torch.__version__}, {torch.get_num_threads()} thread(s)"
    print(f"model {args.model} | {machine}")
    if args.timing_only:  # the process's first engine pays for what later ones find ready: not measured
        run(configurations(args)[0], args)
    for config in configurations(args):
        row = run(config, args) | {"machine": machine, "per_task": args.per_task, "seed": args.seed}
        suffix = ".timing.json" if args.timing_only else ".external.json" if args.external else ".json"
        (out / f"{config['name'].replace(' ', '_')}{suffix}").write_text(json.dumps(row, indent=2))
        if args.timing_only:
            print(f"{config['name']}: TTFT {row['ttft']['ttft_ms']:.1f} ms", flush=True)
            continue
        cells = ", ".join(f"{task} {100 * r / n:.1f}" for task, (r, n) in row["accuracy"].items())
        print(f"{config['name']}: {row['ttft']['visual_tokens']:.0f} tokens, TTFT {row['ttft']['ttft_ms']:.1f} ms, "
              f"{cells} ({row['accuracy_s']:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
