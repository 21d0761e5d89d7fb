"""Measuring the demo model: accuracy per task on a fixed held-out set, at several pixel caps, with TTFT.

Lesson: lessons/A1-what-pixels-buy.md. scripts/eval_demo.py prints the tables.

The held-out set is drawn by the same scene generator as training but from its own seeds (strings, which
`random.Random` hashes into a stream the integer training seeds never produce), and at 224-400 px, large enough
that the smallest caps must shrink every picture. `workshop.other_renderer` draws a second set with
independent code (its own shapes, fonts, colours and sizes), to check that the model learned shapes and
colours rather than one renderer's pixels.

Everything runs through the serving engine (`nanomm.LLM`, greedy), the same path a user's chat takes.
"""

from __future__ import annotations

import random
import re
import statistics
from dataclasses import dataclass

from PIL import Image

from nanomm.demo.scenes import SHAPES, Scene, random_scene, render
from nanomm.demo.tasks import QA, TASKS, compare_questions, grade, question, scene_questions
from nanomm.demo.scenes import counting_scene
from nanomm.inputs.image import ImageProcessorConfig, smart_resize
from nanomm.sampling import SamplingParams

# Pixel caps by visual tokens per picture: 16 up to the demo model's default, 144 (a token is a 14x14-pixel block).
CAPS = (16, 36, 64, 100, 144)
FOLLOW_UP = "follow-up"  # a second question in the same chat, graded on its own
GREEDY = SamplingParams(temperature=0.0, max_tokens=32)


@dataclass(frozen=True)
class EvalItem:
    task: str
    images: tuple[Image.Image, ...]
    turns: tuple[QA, ...]  # asked in order in one chat; the last one is graded
    scenes: tuple[Scene, ...] = ()  # the truth behind the images, where known (for analyses such as digit_height)


def held_out_items(task: str, n: int, seed: int = 0) -> list[EvalItem]:
    """n items of one task (or FOLLOW_UP), the same for the same (task, n, seed)."""
    rng = random.Random(f"nanomm-demo-held-out/{task}/{seed}")
    items: list[EvalItem] = []
    while len(items) < n:
        item = _held_out_item(task, rng, len(items))
        if item is not None:
            items.append(item)
    return items


def _held_out_item(task: str, rng: random.Random, i: int) -> EvalItem | None:
    size = dict(width=rng.randint(224, 400), height=rng.randint(224, 400))
    if task == "compare":
        scenes = [counting_scene(rng, **size), counting_scene(rng, **size)]
        qas = compare_questions(*scenes)
        return EvalItem(task, tuple(render(s, rng) for s in scenes), (rng.choice(qas),), tuple(scenes)) if qas else None
    if task == "count":  # every answer 0..6 equally often, about the shape that was counted out
        kind = rng.choice(SHAPES)
        scene = counting_scene(rng, kind=kind, count=i % 7, **size)
        if scene.count(kind) != i % 7:  # a shape found no room: draw another scene
            return None
        return EvalItem(task, (render(scene, rng),), (QA(task, question(task, shape=kind), str(i % 7)),), (scene,))
    scene = random_scene(rng, num_shapes=rng.randint(1, 5), number_probability=float(task == "number"), **size)
    by_task = scene_questions(scene)
    if task == FOLLOW_UP:
        if len(by_task) < 2:
            return None
        first, second = rng.sample(sorted(by_task), 2)
        turns = (rng.choice(by_task[first]), rng.choice(by_task[second]))
    elif task in by_task:
        turns = (rng.choice(by_task[task]),)
    else:
        return None
    return EvalItem(task, (render(scene, rng),), turns, (scene,))


def conversation(item: EvalItem, replies: list[str]) -> list[dict]:
    """The chat so far: the pictures and first question, then each earlier turn with the model's own reply."""
    content = [{"type": "image", "image": im} for im in item.images]
    messages = [{"role": "user", "content": content + [{"type": "text", "text": item.turns[0].question}]}]
    for qa, reply in zip(item.turns[1:], replies):
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": qa.question}]
    return messages


def answer_items(llm, items: list[EvalItem]) -> list[str]:
    """The model's reply to the last turn of each item (earlier turns answered by the model itself first)."""
    replies: list[list[str]] = [[] for _ in items]
    for turn in range(max(len(item.turns) for item in items)):
        todo = [i for i, item in enumerate(items) if len(item.turns) > turn]
        outputs = llm.chat([conversation(items[i], replies[i]) for i in todo], GREEDY)
        for i, out in zip(todo, outputs):
            replies[i].append(out.outputs[0].text)
    return [r[-1] for r in replies]


def accuracy(llm, items: list[EvalItem]) -> tuple[int, int, list[str]]:
    """(right, total, replies)."""
    replies = answer_items(llm, items)
    return sum(grade(item.turns[-1], r) for item, r in zip(items, replies)), len(items), replies


def median_ttft(llm, items: list[EvalItem], repeats: int = 12) -> dict[str, float]:
    """Median time to first token (and its encode / prefill parts), one request at a time: no batching.

    Measure on pictures this LLM has not seen (else the encoder cache serves them); one more item, first, warms up."""
    if len(items) <= repeats:
        raise ValueError(f"median_ttft needs {repeats + 1} items (one to warm up), got {len(items)}")
    llm.chat(conversation(items[repeats], []), SamplingParams(temperature=0.0, max_tokens=1))
    runs = []
    for item in items[:repeats]:
        out = llm.chat(conversation(item, []), SamplingParams(temperature=0.0, max_tokens=1))[0]
        runs.append(out.metrics)
    return {"ttft_ms": 1e3 * statistics.median(m.ttft_s for m in runs),
            "encode_ms": 1e3 * statistics.median(m.encode_s for m in runs),
            "prefill_ms": 1e3 * statistics.median(m.prefill_s for m in runs),
            "visual_tokens": statistics.median(m.num_visual_tokens for m in runs)}


def digit_height(item: EvalItem, image_config: ImageProcessorConfig, max_pixels: int | None = None) -> float:
    """How tall the item's printed digits are, in pixels of the picture the model sees (after `smart_resize` to
    the cap): what decides whether 7-pixel patches can resolve them (appendix A2, section 5)."""
    scene, picture = item.scenes[0], item.images[0]
    _, top, _, bottom = scene.number_box
    height, _ = smart_resize(picture.height, picture.width, image_config.factor, image_config.min_pixels,
                             max_pixels or image_config.max_pixels)
    return (bottom - top) * height / picture.height


# How a wrong number reading goes wrong (`misreading`): the kinds eval_demo.py --number-by-size counts.
MISREADINGS = ("wrong digits, right length", "too few digits", "a digit read twice", "too many digits",
               "several numbers", "no digits", "right digits, other words")


def misreading(truth: str, reply: str) -> str:
    """The kind of mistake in a wrong reply to "What number is written?", from the numbers in it. "a digit read
    twice" is the truth with one digit doubled ("5" -> "55", "39" -> "399"): what a digit that spans two visual
    tokens can cause. The reply must be one graded wrong (tasks.grade)."""
    numbers = re.findall(r"\d+", reply)
    if not numbers:
        return "no digits"
    if set(numbers) == {truth}:
        return "right digits, other words"
    if len(numbers) > 1:
        return "several numbers"
    read = numbers[0]
    if len(read) == len(truth):
        return "wrong digits, right length"
    if len(read) < len(truth):
        return "too few digits"
    doubled = any(read[i] == read[i + 1] and read[:i] + read[i + 1:] == truth for i in range(len(read) - 1))
    return "a digit read twice" if doubled else "too many digits"


def tasks_with_follow_up() -> tuple[str, ...]:
    return TASKS + (FOLLOW_UP,)
