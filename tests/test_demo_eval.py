"""Measuring a demo model: the held-out set, the chats it asks, the grading, and the independently drawn pictures.

A stand-in model that knows every answer (or none) checks the plumbing; the real engine runs it once on a random
checkpoint. What a trained model scores is scripts/eval_demo.py's business, not a test's.
"""

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from nanomm import LLM
from nanomm.workshop import other_renderer
from nanomm.demo.evaluation import (FOLLOW_UP, MISREADINGS, EvalItem, accuracy, conversation, digit_height,
                                    held_out_items, misreading, tasks_with_follow_up)
from nanomm.demo.tasks import TASKS, QA, grade
from nanomm.inputs.image import ImageProcessorConfig


class StandIn:
    """Answers by looking up (picture, question) in the items: right, or always with `wrong` if given."""

    def __init__(self, items, wrong=None):
        self.answers = {(id(item.images[0]), qa.question): qa.answer for item in items for qa in item.turns}
        self.wrong, self.seen = wrong, []

    def chat(self, conversations, params):
        outputs = []
        for messages in conversations:
            self.seen.append(messages)
            last = messages[-1]["content"]
            question = last if isinstance(last, str) else last[-1]["text"]
            text = self.wrong or self.answers[(id(messages[0]["content"][0]["image"]), question)]
            outputs.append(SimpleNamespace(outputs=[SimpleNamespace(text=text)]))
        return outputs


def test_the_held_out_set_is_fixed_and_its_answers_are_the_scenes():
    for task in tasks_with_follow_up():
        items = held_out_items(task, 6, seed=0)
        again = held_out_items(task, 6, seed=0)
        assert [i.turns for i in items] == [i.turns for i in again]
        assert [im.tobytes() for i in items for im in i.images] == [im.tobytes() for i in again for im in i.images]
        assert [i.turns for i in held_out_items(task, 6, seed=1)] != [i.turns for i in items]
        for item in items:
            assert len(item.images) == (2 if task == "compare" else 1)
            assert len(item.turns) == (2 if task == FOLLOW_UP else 1)
            assert all(224 <= side <= 400 for im in item.images for side in im.size)
            if task != FOLLOW_UP:
                assert item.turns[0].task == task
            else:
                assert item.turns[0].task != item.turns[1].task


def test_number_items_carry_their_scene_and_its_digits_height_at_a_cap():
    items = held_out_items("number", 6, seed=0)
    for item in items:
        scene, = item.scenes
        assert scene.number == item.turns[0].answer and scene.number_box is not None
    # By hand: a 400x400 picture whose digits are 20 px tall, at 144 tokens of 14x14 px (28,224 pixels), is
    # resized to 168x168, where the digits are 20 x 168 / 400 = 8.4 px tall; at 400 tokens (280x280), 14 px.
    item = items[0]
    scene = replace(item.scenes[0], number_box=(10.0, 30.0, 50.0, 50.0))
    square = EvalItem("number", (Image.new("RGB", (400, 400)),), item.turns, (scene,))
    config = ImageProcessorConfig(min_pixels=3136, max_pixels=144 * 14 * 14, patch_size=7, merge_size=2)
    assert digit_height(square, config) == pytest.approx(8.4)
    assert digit_height(square, config, max_pixels=400 * 14 * 14) == pytest.approx(14.0)


@pytest.mark.parametrize("truth, reply, kind", [
    ("865", "863", "wrong digits, right length"),
    ("865", "It is 36.", "too few digits"),
    ("5", "55", "a digit read twice"),
    ("39", "399", "a digit read twice"),
    ("39", "339", "a digit read twice"),
    ("55", "555", "a digit read twice"),
    ("47", "417", "too many digits"),
    ("5", "56", "too many digits"),
    ("12", "red", "no digits"),
    ("5", "5 or 5 circles", "right digits, other words"),
    ("5", "5 or 6 circles", "several numbers"),
    ("12", "twelve 12 circles", "right digits, other words"),
])
def test_a_wrong_number_reading_is_named_by_its_mistake(truth, reply, kind):
    assert misreading(truth, reply) == kind and kind in MISREADINGS


def test_count_items_ask_every_count_from_zero_to_six_equally():
    answers = [item.turns[0].answer for item in held_out_items("count", 14, seed=0)]
    assert sorted(answers) == sorted([str(n) for n in range(7)] * 2)


def test_accuracy_asks_follow_ups_after_the_models_own_first_reply():
    items = held_out_items(FOLLOW_UP, 5, seed=0) + held_out_items("colour", 5, seed=0)
    model = StandIn(items)
    right, total, replies = accuracy(model, items)
    assert (right, total) == (10, 10)
    assert replies == [item.turns[-1].answer for item in items]
    second_turns = [m for m in model.seen if len(m) == 3]
    assert len(second_turns) == 5
    for messages, item in zip(second_turns, items[:5]):
        assert messages[1] == {"role": "assistant", "content": item.turns[0].answer}
        assert messages[2] == {"role": "user", "content": item.turns[1].question}
    assert accuracy(StandIn(items, wrong="purple elephant"), items)[:2] == (0, 10)


def test_a_conversation_attaches_every_picture_to_the_first_question():
    item = held_out_items("compare", 1, seed=0)[0]
    (message,) = conversation(item, [])
    assert [part["type"] for part in message["content"]] == ["image", "image", "text"]
    assert message["content"][2]["text"] == item.turns[0].question


def test_the_engine_answers_the_held_out_chats(ckpt):
    items = held_out_items("shape", 3, seed=0) + held_out_items(FOLLOW_UP, 3, seed=0)
    with LLM(str(ckpt)) as llm:
        right, total, replies = accuracy(llm, items)
    assert total == 6 and len(replies) == 6 and all(isinstance(r, str) for r in replies)
    assert right == sum(grade(item.turns[-1], reply) for item, reply in zip(items, replies))


# ---------------------------------------------------------------------------------------------------------
# The independent renderer


@pytest.mark.parametrize("task", other_renderer.TASKS)
def test_the_other_renderer_is_deterministic_and_asks_the_demo_forms(task):
    items = other_renderer.external_items(task, 14, seed=0)
    again = other_renderer.external_items(task, 14, seed=0)
    assert [(i.question, i.answer) for i in items] == [(i.question, i.answer) for i in again]
    assert [im.tobytes() for i in items for im in i.images] == [im.tobytes() for i in again for im in i.images]
    allowed = {"colour": set(other_renderer.COLOURS), "shape": set(other_renderer.SHAPES),
               "count": {str(n) for n in range(7)}, "left_right": {"left", "right"},
               "above_below": {"above", "below"}, "compare": {"first", "second"}}
    for item in items:
        assert item.task == task and len(item.images) == (2 if task == "compare" else 1)
        assert item.answer in allowed[task] if task != "number" else item.answer.isdigit() and len(item.answer) <= 3
        assert grade(QA(task, item.question, item.answer), item.answer)
    if task in ("left_right", "above_below", "compare"):  # both answers, equally often
        assert len({i.answer for i in items}) == 2 and sum(i.answer == items[0].answer for i in items) == 7


def test_the_other_renderer_uses_the_same_words_as_the_tasks():
    from nanomm.demo.scenes import COLOURS, SHAPES

    assert set(other_renderer.COLOURS) == set(COLOURS) and set(other_renderer.SHAPES) == set(SHAPES)
    assert set(other_renderer.TASKS) == set(TASKS) - {"describe"}


# ---------------------------------------------------------------------------------------------------------
# The two scripts, end to end on a tiny model


@pytest.mark.slow
def test_train_then_evaluate_a_tiny_demo_model_and_its_draft(tmp_path):
    root = Path(__file__).resolve().parents[1]

    def script(name, *args):
        proc = subprocess.run([sys.executable, str(root / "scripts" / name), *args], cwd=tmp_path,
                              capture_output=True, text=True, timeout=240)
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stdout[-2000:] + proc.stderr[-2000:]
        return proc.stdout

    script("train_demo.py", "--out", "tiny", "--tiny", "--steps", "3", "--batch-size", "4", "--no-progress")
    summary = json.loads((tmp_path / "tiny" / "train_summary.json").read_text())
    assert summary["steps"] == 3 and summary["config"]["batch_size"] == 4 and "cores" in summary["machine"]
    config = json.loads((tmp_path / "tiny" / "config.json").read_text())
    assert config["torch_dtype"] == "float16" and config["num_hidden_layers"] == 2
    # Stage 3 resumes the finished run: two phases, three more steps.
    script("train_demo.py", "--out", "tiny", "--tiny", "--steps", "3", "--batch-size", "4", "--no-progress",
           "--focus-start", "3", "--focus", "2:all", "--focus", "1:colour,count")
    summary = json.loads((tmp_path / "tiny" / "train_summary.json").read_text())
    assert summary["steps"] == 6 and summary["resumed_at"] == 3
    assert summary["config"]["focus_phases"] == [[2, list(TASKS)], [1, ["colour", "count"]]]
    # --init-from: a new run that starts from the trained weights (a fresh optimizer, step 0), here one count step.
    script("train_demo.py", "--out", "tuned", "--init-from", "tiny", "--batch-size", "4", "--no-progress",
           "--focus-start", "0", "--focus", "1:count")
    summary = json.loads((tmp_path / "tuned" / "train_summary.json").read_text())
    assert summary["steps"] == 1 and summary["resumed_at"] == 0
    before, after = (load_file(tmp_path / run / "model.safetensors") for run in ("tiny", "tuned"))
    assert before.keys() == after.keys()
    changed = [name for name in before if not torch.equal(before[name], after[name])]
    assert changed and all((after[n] - before[n]).abs().max() < 0.05 for n in changed)  # one small step from tiny
    wrong = subprocess.run([sys.executable, str(root / "scripts" / "train_demo.py"), "--out", "tiny", "--focus",
                            "5:colours"], cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert wrong.returncode != 0 and "unknown tasks ['colours']" in wrong.stderr
    script("train_demo.py", "--out", "draft", "--draft-of", "tiny", "--steps", "2", "--batch-size", "2",
           "--no-progress")
    assert json.loads((tmp_path / "draft" / "config.json").read_text())["num_hidden_layers"] == 1
    printed = script("eval_demo.py", "--model", "tiny", "--draft", "draft", "--spec-requests", "3", "--per-task", "2",
                     "--caps", "16", "36", "--number-by-size", "--json", "eval.json")
    results = json.loads((tmp_path / "eval.json").read_text())
    assert set(results["held_out"]) == {"16", "36"}
    assert all(results["held_out"]["16"][task][1] == 2 for task in tasks_with_follow_up())
    assert set(results["external"]) == set(other_renderer.TASKS)
    assert results["speculative"]["exact"] is True  # a draft never changes a greedy token
    by_length = {k: v for k, v in results["number_by_size"].items() if k.endswith("-digit numbers")}
    assert sum(total for _, total in by_length.values()) == 2  # each of the 2 number questions counted once
    misread = 2 - sum(right for right, _ in by_length.values())
    assert sum(results["number_misreadings"].values()) == misread
    assert set(results["number_misreadings"]) <= set(MISREADINGS)
    assert "wrong readings, by kind of mistake" in printed
    assert "| colour |" in printed and "decode speedup" in printed
