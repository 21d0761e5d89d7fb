"""Long chats on the demo model: a new picture every turn, under each old-image policy.

    nanomm-bench long-chats --chats 20 --turns 12 --keep-last-images 2 --json lessons/data/16-long-chats.json
    nanomm-bench long-chats --chats 3 --turns 12 --processor-cache off bytes uuids   # preprocessing per turn

Lesson: lessons/16-long-conversations.md.

Each chat shows a new 448x448 scene every turn and asks a question about it (graded against the scene). The
conversation goes on with the model's own answers. Per turn and policy it records the prompt's visual tokens, the
prefix-cache hit, and whether the reply is right and equal to the reply under "keep". Beside every turn past
K + 1, a probe (not added to the chat) asks about the picture K + 1 turns back: the one that the policy changed.
The demo model was trained on one picture per question, so the probe shows what a policy takes away from the
context rather than a skill the model has.

With --processor-cache, it measures instead what a client's resent pictures cost to preprocess, under "keep": the
pictures go as PNG data URLs, as a client sends them, and per turn it records the prompt's preprocessing time,
its TTFT and the pictures decoded, on an engine of its own per mode: "off" (no processor cache), "bytes" (the
cache finds each resent picture by its bytes) and "uuids" (each picture carries a uuid, and a resent one is sent
as its uuid alone). nanomm/inputs/processor_cache.py is the cache.
"""

import argparse
import base64
import io
import json
import random
from pathlib import Path


from nanomm import LLM, SamplingParams, demo_checkpoint
from nanomm.demo.scenes import random_scene, render
from nanomm.demo.tasks import QA, grade, scene_questions

POLICIES = ("keep", "drop", "downscale:6272", "compress:pool:0.25")
GREEDY = SamplingParams(temperature=0.0, max_tokens=24)
SIDE = 448
TASKS = ("colour", "shape", "count")  # one-word answers about a picture's objects


def chat_turns(seed: int, turns: int) -> list[tuple]:
    """Per turn, (picture, question about it): the same for the same seed, drawn by the scene generator."""
    rng = random.Random(f"nanomm-long-chat/{seed}")
    out = []
    while len(out) < turns:
        scene = random_scene(rng, num_shapes=rng.randint(1, 4), width=SIDE, height=SIDE, number_probability=0.0)
        by_task = scene_questions(scene)
        tasks = [t for t in TASKS if t in by_task]
        if tasks:
            out.append((render(scene, rng), rng.choice(by_task[rng.choice(tasks)])))
    return out


def user_turn(picture, qa: QA) -> dict:
    return {"role": "user", "content": [{"type": "image", "image": picture}, {"type": "text", "text": qa.question}]}


def first_difference(a: list[int], b: list[int]) -> int:
    """The first position where two token lists differ (the shorter one's length if one is the other's prefix)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def run_chat(llm, turns: list[tuple], policy: str, keep_last: int, prompts: list | None = None) -> list[dict]:
    """One chat under one policy: per turn, the reply, its grade, and what the prompt cost (each turn's expanded
    prompt is appended to `prompts` if given)."""
    kwargs = {"old_image_policy": policy, "keep_last_images": keep_last}
    messages, rows, previous = [], [], None
    for t, (picture, qa) in enumerate(turns):
        messages.append(user_turn(picture, qa))
        out = llm.chat(messages, GREEDY, use_tqdm=False, mm_processor_kwargs=kwargs)[0]
        reply = out.outputs[0].text
        probe = _probe(llm, messages, turns, t, keep_last, kwargs)
        messages.append({"role": "assistant", "content": reply})
        rows.append({"turn": t + 1, "reply": reply, "right": grade(qa, reply), "probe_right": probe,
                     "visual_tokens": out.metrics.num_visual_tokens, "prompt_tokens": len(out.prompt_token_ids),
                     "cached_tokens": out.metrics.num_cached_tokens,
                     "changed_at": None if previous is None else first_difference(previous, out.prompt_token_ids)})
        previous = out.prompt_token_ids
        if prompts is not None:
            prompts.append(previous)
    return rows


def _probe(llm, messages: list[dict], turns: list[tuple], t: int, keep_last: int, kwargs: dict) -> bool | None:
    """Ask, beside the chat, about the picture keep_last + 1 turns back; None while there is none."""
    back = t - (keep_last + 1)
    if back < 0:
        return None
    qa = turns[back][1]
    probe = messages + [{"role": "assistant", "content": "..."},
                        {"role": "user", "content": f"About the picture {keep_last + 1} turns ago: {qa.question}"}]
    return grade(qa, llm.chat(probe, GREEDY, use_tqdm=False, mm_processor_kwargs=kwargs)[0].outputs[0].text)


def summarize(by_policy: dict[str, list[list[dict]]]) -> list[dict]:
    """Per policy: accuracy on the latest picture, agreement with keep, the probe's accuracy, last turn's tokens."""
    keep = by_policy["keep"]
    table = []
    for policy, chats in by_policy.items():
        rows = [r for chat in chats for r in chat]
        probes = [r["probe_right"] for r in rows if r["probe_right"] is not None]
        same = [a["reply"] == b["reply"] for chat, base in zip(chats, keep) for a, b in zip(chat, base)]
        table.append({"policy": policy, "latest_right": sum(r["right"] for r in rows) / len(rows),
                      "same_as_keep": sum(same) / len(same), "probe_right": sum(probes) / len(probes),
                      "last_turn_visual_tokens": chats[0][-1]["visual_tokens"],
                      "last_turn_prompt_tokens": chats[0][-1]["prompt_tokens"],
                      "mean_cached_share": sum(r["cached_tokens"] / r["prompt_tokens"] for r in rows) / len(rows)})
    return table


def markdown(table: list[dict]) -> str:
    lines = ["| policy | latest picture right | same reply as keep | K+1 back right | visual tokens, last turn "
             "| prompt tokens, last turn | prompt served from the prefix cache |", "|---|---:|---:|---:|---:|---:|---:|"]
    for r in table:
        lines.append(f"| {r['policy']} | {r['latest_right']:.1%} | {r['same_as_keep']:.1%} | {r['probe_right']:.1%} | "
                     f"{r['last_turn_visual_tokens']} | {r['last_turn_prompt_tokens']} | {r['mean_cached_share']:.1%} |")
    return "\n".join(lines)


CACHE_MODES = ("off", "bytes", "uuids")


def png_data_url(picture) -> str:
    buffer = io.BytesIO()
    picture.save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def url_part(url: str, uuid: str, mode: str, new: bool) -> dict:
    """A picture as a client sends it: its data URL, and under "uuids" its uuid (the uuid alone once sent)."""
    if mode != "uuids":
        return {"type": "image_url", "image_url": {"url": url}}
    return {"type": "image_url", "image_url": {"url": url} if new else None, "uuid": uuid}


def cached_chat_messages(urls: list[str], questions: list[tuple], t: int, mode: str, name: str) -> list[dict]:
    """What a client sends at turn t (0-based): every earlier turn with its true answer, then the new picture.
    Picture k's uuid is f"{name}/{k}"."""
    messages = []
    for k in range(t + 1):
        question, answer = questions[k]
        picture = url_part(urls[k], f"{name}/{k}", mode, new=k == t)
        messages.append({"role": "user", "content": [picture, {"type": "text", "text": question}]})
        if k < t:
            messages.append({"role": "assistant", "content": answer})
    return messages


def run_cached_chat(llm, urls: list[str], questions: list[tuple], mode: str, name: str) -> list[dict]:
    """One chat under "keep" with the pictures as data URLs: per turn, preprocessing, TTFT and pictures decoded.
    The assistant turns are the questions' true answers, so every mode sends the same prompts."""
    rows = []
    for t in range(len(questions)):
        decodes = llm.stats()["processor_cache_decodes"]
        out = llm.chat(cached_chat_messages(urls, questions, t, mode, name), GREEDY, use_tqdm=False)[0]
        rows.append({"turn": t + 1, "preprocess_s": out.metrics.preprocess_s, "ttft_s": out.metrics.ttft_s,
                     "decodes": llm.stats()["processor_cache_decodes"] - decodes,
                     "cached_tokens": out.metrics.num_cached_tokens, "reply": out.outputs[0].token_ids})
    return rows


def cache_table(by_mode: dict[str, list[list[dict]]]) -> list[dict]:
    """Per turn, per mode: the mean preprocessing and TTFT over the chats, and the pictures decoded."""
    turns = len(next(iter(by_mode.values()))[0])
    table = []
    for t in range(turns):
        row = {"turn": t + 1}
        for mode, chats in by_mode.items():
            rows = [chat[t] for chat in chats]
            row[mode] = {"preprocess_ms": 1000 * sum(r["preprocess_s"] for r in rows) / len(rows),
                         "ttft_ms": 1000 * sum(r["ttft_s"] for r in rows) / len(rows),
                         "decodes": sum(r["decodes"] for r in rows) / len(rows)}
        table.append(row)
    return table


def cache_markdown(table: list[dict]) -> str:
    modes = [k for k in table[0] if k != "turn"]
    head = " | ".join(f"{m}: preprocess ms | TTFT ms | decoded" for m in modes)
    lines = [f"| turn | {head} |", "|---:|" + "---:|" * 3 * len(modes)]
    for row in table:
        cells = " | ".join(f"{row[m]['preprocess_ms']:.1f} | {row[m]['ttft_ms']:.0f} | {row[m]['decodes']:.0f}"
                           for m in modes)
        lines.append(f"| {row['turn']} | {cells} |")
    return "\n".join(lines)


def run_cache_modes(args) -> int:
    """--processor-cache: each mode on a fresh engine, the same chats (and one warm-up turn first)."""
    chats = [chat_turns(args.seed * 100_000 + i, args.turns) for i in range(args.chats)]
    urls = [[png_data_url(picture) for picture, _ in turns] for turns in chats]
    questions = [[(qa.question, qa.answer) for _, qa in turns] for turns in chats]
    warm_up = chat_turns(-1, 1)
    by_mode = {}
    for mode in args.processor_cache:
        llm = LLM(demo_checkpoint(), num_preprocess_workers=0, mm_processor_cache_gb=0 if mode == "off" else 4)
        run_cached_chat(llm, [png_data_url(warm_up[0][0])], [(warm_up[0][1].question, "")], mode, "warm-up")
        by_mode[mode] = [run_cached_chat(llm, u, q, mode, f"chat-{i}")
                         for i, (u, q) in enumerate(zip(urls, questions))]
        llm.close()
    replies = {mode: [[r.pop("reply") for r in chat] for chat in runs] for mode, runs in by_mode.items()}
    same = all(r == next(iter(replies.values())) for r in replies.values())
    table = cache_table(by_mode)
    print(cache_markdown(table))
    print(f"replies the same in every mode: {same}")
    if args.json:
        arguments = {k: v for k, v in vars(args).items() if k not in ("module", "parser")}
        Path(args.json).write_text(json.dumps({"args": arguments, "table": table, "same_replies": same,
                                               "chats": by_mode}, indent=1))
    return 0


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--chats", type=int, default=20)
    p.add_argument("--turns", type=int, default=12)
    p.add_argument("--keep-last-images", type=int, default=2)
    p.add_argument("--policy", nargs="+", default=list(POLICIES))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json")
    p.add_argument("--processor-cache", nargs="+", choices=CACHE_MODES, metavar="MODE",
                   help="measure preprocessing and TTFT per turn instead, under each of: off (no processor "
                        "cache), bytes (found by the pictures' bytes), uuids (resent pictures as their uuid alone)")


def main(args) -> int:
    if args.processor_cache:
        return run_cache_modes(args)
    policies = ["keep"] + [x for x in args.policy if x != "keep"]
    llm = LLM(demo_checkpoint(), num_preprocess_workers=0)
    chats = [chat_turns(args.seed * 100_000 + i, args.turns) for i in range(args.chats)]
    by_policy = {policy: [run_chat(llm, turns, policy, args.keep_last_images) for turns in chats]
                 for policy in policies}
    table = summarize(by_policy)
    print(markdown(table))
    if args.json:
        arguments = {k: v for k, v in vars(args).items() if k not in ("module", "parser")}
        Path(args.json).write_text(json.dumps({"args": arguments, "table": table, "chats": by_policy}, indent=1))
    llm.close()
    return 0
