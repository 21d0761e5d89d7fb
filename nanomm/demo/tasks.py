"""Questions and answers about scenes, and how a reply is graded.

Lesson: lessons/A2-how-the-demo-model-was-made.md.

Every answer is computed from the `Scene` (the truth), never from pixels. The forms are fixed; capitals,
punctuation and "colour"/"color" are free, both in questions (training varies them) and in replies (`grade`
ignores them):

    colour       What colour is the {shape}?                          -> red
    shape        What shape is the {colour} object?                   -> circle
    count        How many {shape}s are there?                         -> 0 .. 6, in digits
    left_right   Is the {shape A} left or right of the {shape B}?     -> left | right
    above_below  Is the {shape A} above or below the {shape B}?       -> above | below
    number       What number is written in the picture?               -> the digits
    compare      Which picture has more {shape}s, the first or the second?  (two pictures) -> first | second
    describe     Describe the picture.                                -> a red circle and a blue square
"""

from __future__ import annotations

import random
import re
from collections import Counter
from dataclasses import dataclass

from nanomm.demo.scenes import COLOURS, SHAPES, Scene

TASKS = ("colour", "shape", "count", "left_right", "above_below", "number", "compare", "describe")
MAX_COUNT = 6
MAX_DESCRIBED = 4  # "Describe the picture." is asked of pictures with 1..4 shapes


@dataclass(frozen=True)
class QA:
    task: str
    question: str
    answer: str


def question(task: str, **names: str) -> str:
    """The canonical English form of each question."""
    forms = {
        "colour": "What colour is the {shape}?",
        "shape": "What shape is the {colour} object?",
        "count": "How many {shape}s are there?",
        "left_right": "Is the {a} left or right of the {b}?",
        "above_below": "Is the {a} above or below the {b}?",
        "number": "What number is written in the picture?",
        "compare": "Which picture has more {shape}s, the first or the second?",
        "describe": "Describe the picture.",
    }
    return forms[task].format(**names)


def describe(scene: Scene) -> str:
    """The shapes from left to right: "a red circle", "a red circle and a blue square", "a, b and c"."""
    names = [f"a {s.colour} {s.kind}" for s in sorted(scene.shapes, key=lambda s: s.x)]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def scene_questions(scene: Scene) -> dict[str, list[QA]]:
    """Every question this scene can answer unambiguously, by task (a task with none is absent)."""
    out: dict[str, list[QA]] = {}
    kinds, colours = scene.unique("kind"), scene.unique("colour")
    out["colour"] = [QA("colour", question("colour", shape=k), s.colour) for k, s in kinds.items()]
    out["shape"] = [QA("shape", question("shape", colour=c), s.kind) for c, s in colours.items()]
    out["count"] = [count_question(scene, k) for k in SHAPES if scene.count(k) <= MAX_COUNT]
    for task, axis, words in (("left_right", "x", ("left", "right")), ("above_below", "y", ("above", "below"))):
        out[task] = [QA(task, question(task, a=ka, b=kb), words[getattr(sa, axis) > getattr(sb, axis)])
                     for ka, sa in kinds.items() for kb, sb in kinds.items()
                     if ka != kb and clearly_apart(sa, sb, axis)]
    if scene.number is not None:
        out["number"] = [QA("number", question("number"), scene.number)]
    if 1 <= len(scene.shapes) <= MAX_DESCRIBED:
        out["describe"] = [QA("describe", question("describe"), describe(scene))]
    return {task: qas for task, qas in out.items() if qas}


def count_question(scene: Scene, kind: str) -> QA:
    """"How many {kind}s are there?", answered from the scene."""
    return QA("count", question("count", shape=kind), str(scene.count(kind)))


def compare_questions(first: Scene, second: Scene) -> list[QA]:
    """"Which picture has more {shape}s?" for every shape whose counts differ between the two pictures."""
    return [QA("compare", question("compare", shape=k), "first" if first.count(k) > second.count(k) else "second")
            for k in SHAPES if first.count(k) != second.count(k)]


def clearly_apart(a, b, axis: str) -> bool:
    """Centres apart by at least a third of the two sizes: "left of" is then not a matter of opinion."""
    return abs(getattr(a, axis) - getattr(b, axis)) >= (a.radius + b.radius) / 3


def vary(text: str, rng: random.Random) -> str:
    """The same question as people type it: color or colour, capitals or not, with or without the '?'."""
    if rng.random() < 0.5:
        text = text.replace("colour", "color")
    if rng.random() < 0.25:
        text = text.lower()
    if rng.random() < 0.15:
        text = text.rstrip("?.")
    return text


# ---------------------------------------------------------------------------------------------------------
# Grading

_WORDS = re.compile(r"[a-z0-9]+")


def normalize(text: str) -> list[str]:
    """Lower-case words, punctuation dropped, "color" spelled "colour"."""
    return ["colour" if w == "color" else w for w in _WORDS.findall(text.lower())]


def grade(qa: QA, reply: str) -> bool:
    """Is the reply right? One-word answers must be the reply's only word (or its last, after "it is" etc.);
    a description must name exactly the same coloured shapes, in any order."""
    words = normalize(reply)
    if qa.task == "describe":
        return Counter(_objects(words)) == Counter(_objects(normalize(qa.answer)))
    return bool(words) and (words == normalize(qa.answer) or words[-1:] == normalize(qa.answer))


def _objects(words: list[str]) -> list[tuple[str, str]]:
    """(colour, shape) pairs named in a description: each shape word with the colour word just before it."""
    pairs = []
    for prev, word in zip([""] + words, words):
        kind = word[:-1] if word.endswith("s") and word[:-1] in SHAPES else word
        if kind in SHAPES:
            pairs.append((prev if prev in COLOURS else "", kind))
    return pairs
