"""Answers in a shape on the demo model: valid JSON and right fields, with and without a schema, and the mask's cost.

    nanomm-bench shapes --per-kind 40 --timed 10 --json lessons/data/18-shapes.json

Lesson: lessons/18-answers-in-a-shape.md (nanomm/engine/structured.py is the engine's side).

Held-out scenes (nanomm/demo/evaluation.py `held_out_items`, string seeds that training's integer seeds never
produce) are asked colour, shape and count questions, each answer a one-field JSON object whose schema is written
here: {"colour": one of the palette}, {"shape": one of the shapes}, {"count": an integer 0..9}. Four conditions,
the same pictures and questions:

- free: the question as trained; the reply graded with `grade`;
- asked: the question, then "Answer in JSON, like {...}."; no schema;
- schema: the question as trained, the answer held to the schema (`StructuredOutputsParams(json=...)`);
- asked + schema: both;
- choice: the question as trained, the bare answer held to the kind's words (`StructuredOutputsParams(choice=...)`):
  the same mask without the JSON around the answer.

Every reply is checked here, not by llguidance: `json.loads`, then the one field with its allowed values (the
schema check); a valid answer's field is right if it equals the scene's truth. The cost of the mask is timed on
`--timed` questions per kind, one request at a time, under "asked" and "asked + schema" (the same prompts): the
decode time per token from the engine's metrics (`tpot_s`), and the grammar's own host time (the matcher's mask and
advance, timed with perf_counter), per token; again under n-gram speculation (`--no-ngram` leaves it out).
"""

import argparse
import contextlib
import json
import time
from pathlib import Path

from nanomm import LLM, SamplingParams, StructuredOutputsParams, demo_checkpoint
from nanomm.bench.machine import machine_info
from nanomm.demo.evaluation import EvalItem, conversation, held_out_items
from nanomm.demo.scenes import COLOURS, SHAPES
from nanomm.demo.tasks import grade

KINDS = ("colour", "shape", "count")
MAX_COUNT = 9  # the count schema's maximum (held-out counts are 0..6)
EXAMPLES = {"colour": '{"colour": "red"}', "shape": '{"shape": "circle"}', "count": '{"count": 3}'}
CONDITIONS = ("free", "asked", "schema", "asked + schema", "choice")
NGRAM = dict(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)
MAX_TOKENS = 24


def schema_of(kind: str) -> dict:
    """The one-field JSON schema of a kind's answer."""
    value = {"type": "integer", "minimum": 0, "maximum": MAX_COUNT} if kind == "count" else {
        "enum": list(COLOURS if kind == "colour" else SHAPES)}
    return {"type": "object", "properties": {kind: value}, "required": [kind], "additionalProperties": False}


def parse_answer(kind: str, text: str):
    """The answer's field if the text is JSON that fits the kind's schema (checked here, by hand), else None."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or set(value) != {kind}:
        return None
    field = value[kind]
    if kind == "count":
        ok = isinstance(field, int) and not isinstance(field, bool) and 0 <= field <= MAX_COUNT
    else:
        ok = field in (COLOURS if kind == "colour" else SHAPES)
    return str(field) if ok else None


def asking(item: EvalItem, kind: str, asked: bool) -> list[dict]:
    """The item's chat, its question followed by the request for JSON when asked."""
    messages = conversation(item, [])
    if asked:
        content = messages[0]["content"]
        content[-1] = {"type": "text", "text": f"{content[-1]['text']} Answer in JSON, like {EXAMPLES[kind]}."}
    return messages


def choices_of(kind: str) -> list[str]:
    """The bare answers a kind allows: the palette, the shapes, or the digits 0..MAX_COUNT."""
    return list(COLOURS if kind == "colour" else SHAPES if kind == "shape" else map(str, range(MAX_COUNT + 1)))


def params(kind: str, constrained: bool, choice: bool = False) -> SamplingParams:
    shape = StructuredOutputsParams(choice=choices_of(kind)) if choice else (
        StructuredOutputsParams(json=schema_of(kind)) if constrained else None)
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs=shape)


def score(kind: str, items: list[EvalItem], replies: list[str]) -> dict:
    """The share of valid answers, of right fields (over all answers), and of free replies `grade` calls right."""
    fields = [parse_answer(kind, r) for r in replies]
    truths = [item.turns[-1].answer for item in items]
    n = len(items)
    return {"n": n, "valid_json": sum(f is not None for f in fields) / n,
            "field_right": sum(f == t for f, t in zip(fields, truths)) / n,
            "graded_right": sum(grade(item.turns[-1], r) for item, r in zip(items, replies)) / n,
            "examples": replies[:3]}


def accuracy_rows(llm, items_by_kind: dict[str, list[EvalItem]]) -> list[dict]:
    rows = []
    for kind, items in items_by_kind.items():
        for condition in CONDITIONS:
            asked, constrained = "asked" in condition, "schema" in condition
            sampling = params(kind, constrained, choice=condition == "choice")
            outs = llm.chat([asking(item, kind, asked) for item in items], sampling, use_tqdm=False)
            rows.append({"kind": kind, "condition": condition,
                         **score(kind, items, [o.outputs[0].text for o in outs])})
    return rows


@contextlib.contextmanager
def timing_the_grammar():
    """Adds up perf_counter time spent in the matchers' mask and advance while inside (the class's methods are
    wrapped, and restored on the way out)."""
    from nanomm.engine.structured import GrammarMatcher

    spent = {"s": 0.0}
    originals = {name: getattr(GrammarMatcher, name) for name in ("mask", "advance")}

    def timed(method):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                spent["s"] += time.perf_counter() - start
        return wrapper

    for name, method in originals.items():
        setattr(GrammarMatcher, name, timed(method))
    try:
        yield spent
    finally:
        for name, method in originals.items():
            setattr(GrammarMatcher, name, method)


def timed_answer(llm, item: EvalItem, kind: str, sampling: SamplingParams, spent: dict) -> dict:
    """One request alone: its tokens, its decode time after the first token (the engine's tpot_s), and the
    grammar's host time while it ran."""
    before = spent["s"]
    out = llm.chat(asking(item, kind, True), sampling, use_tqdm=False)[0]
    n = len(out.outputs[0].token_ids)
    return {"tokens": n, "decode_s": out.metrics.tpot_s * (n - 1) if n > 1 else 0.0, "decode_tokens": max(n - 1, 0),
            "grammar_s": spent["s"] - before}


def cost_pair(llm, items_by_kind: dict[str, list[EvalItem]], speculation: str) -> list[dict]:
    """Each timed question answered under its schema, then without one for as many tokens (ignore_eos, max_tokens
    = the constrained answer's length): the same prompts and the same number of decode steps, mask or none."""
    runs = {True: [], False: []}
    with timing_the_grammar() as spent:
        for kind, items in items_by_kind.items():
            for item in items:
                shaped = timed_answer(llm, item, kind, params(kind, True), spent)
                free = SamplingParams(temperature=0.0, max_tokens=shaped["tokens"], ignore_eos=True)
                runs[True].append(shaped)
                runs[False].append(timed_answer(llm, item, kind, free, spent))
    return [{"speculation": speculation, "schema": constrained, "requests": len(rs),
             "tokens": sum(r["tokens"] for r in rs),
             "decode_us_per_token": 1e6 * sum(r["decode_s"] for r in rs)
             / max(sum(r["decode_tokens"] for r in rs), 1),
             "grammar_us_per_token": 1e6 * sum(r["grammar_s"] for r in rs) / max(sum(r["tokens"] for r in rs), 1)}
            for constrained, rs in ((False, runs[False]), (True, runs[True]))]


def cost_rows(llm, items_by_kind, speculation: str) -> list[dict]:
    cost_pair(llm, {kind: items[:1] for kind, items in items_by_kind.items()}, speculation)  # compile, warm up
    return cost_pair(llm, items_by_kind, speculation)


def markdown(rows: list[dict], costs: list[dict]) -> str:
    lines = ["| kind | condition | valid JSON | field right | graded right |", "|---|---|---:|---:|---:|"]
    lines += [f"| {r['kind']} | {r['condition']} | {r['valid_json']:.1%} | {r['field_right']:.1%} | "
              f"{r['graded_right']:.1%} |" for r in rows]
    lines += ["", "| speculation | schema | tokens | decode µs/token | grammar µs/token |",
              "|---|---|---:|---:|---:|"]
    lines += [f"| {c['speculation']} | {c['schema']} | {c['tokens']} | {c['decode_us_per_token']:.0f} | "
              f"{c['grammar_us_per_token']:.0f} |" for c in costs]
    return "\n".join(lines)


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--per-kind", type=int, default=40, help="held-out questions per kind for the accuracy table")
    p.add_argument("--timed", type=int, default=10, help="questions per kind timed one at a time (0: no timing)")
    p.add_argument("--seed", type=int, default=18, help="held_out_items' seed (held-out seeds are strings: "
                                                         "training never drew them)")
    p.add_argument("--no-ngram", action="store_true", help="leave out the timing under n-gram speculation")
    p.add_argument("--json")


def check_args(parser: argparse.ArgumentParser, args) -> None:
    if args.per_kind < 1 or args.timed < 0 or args.timed > args.per_kind:
        parser.error("--per-kind must be at least 1, and --timed between 0 and --per-kind")


def main(args) -> int:
    items_by_kind = {kind: held_out_items(kind, args.per_kind, args.seed) for kind in KINDS}
    timed = {kind: items[:args.timed] for kind, items in items_by_kind.items()}
    with LLM(demo_checkpoint(), num_preprocess_workers=0) as llm:
        rows = accuracy_rows(llm, items_by_kind)
        costs = cost_rows(llm, timed, "none") if args.timed else []
    if args.timed and not args.no_ngram:
        with LLM(demo_checkpoint(), num_preprocess_workers=0, speculative_config=NGRAM) as llm:
            costs += cost_rows(llm, timed, "ngram")
    print(markdown(rows, costs))
    if args.json:
        arguments = {k: v for k, v in vars(args).items() if k not in ("module", "parser")}
        Path(args.json).write_text(json.dumps({"args": arguments, "machine": machine_info(),
                                               "rows": rows, "costs": costs}, indent=1, ensure_ascii=False))
    return 0
