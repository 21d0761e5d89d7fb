"""The demo model's making: scenes, questions and answers, grading, chats as training sequences, the training loop.

The expected answers here are written by hand from scenes built by hand, never computed by nanomm.demo.
tests/test_demo_model.py tests the trained model itself.
"""

import importlib.util
import random
import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch
from PIL import Image, ImageChops

from nanomm.demo.scenes import COLOURS, PALETTE, SHAPES, Scene, Shape, other_font, random_scene, render
from nanomm.demo.tasks import QA, compare_questions, describe, grade, scene_questions
from nanomm.workshop import trainer
from nanomm.workshop.trainer import TINY_SPEC, new_run, set_picture_cap, train
from nanomm.workshop.training import (IGNORE, TrainConfig, batch_loss, counting_chat, encode_chat, image_token_places,
                                  learning_rate, make_batch, number_close_up, number_hints, pick_contrasting,
                                  stage, token_hints)
from nanomm.inputs.image import ImageProcessorConfig, preprocess_image
from nanomm.inputs.tokenizer import Tokenizer
from nanomm.model.loader import load_model


def shape(kind, colour, x, y, radius=10):
    return Shape(kind, colour, PALETTE[colour][0], x, y, radius)


def plain_scene(shapes, number=None):
    style = {"background": "light", "colours": ((255, 255, 255),) * 2, "supersample": 1, "outline": None,
             "blur": 0.0, "jpeg": None, "noise": 0}
    return Scene(200, 200, shapes, number=number, number_box=(150, 10, 180, 30) if number else None,
                 style=style | ({"number_font": "aileron", "number_rgb": (0, 0, 0), "number_bold": False}
                                if number else {}))


# A red circle top-left, a blue square bottom-right, two green stars in the middle row.
SCENE = plain_scene([shape("circle", "red", 40, 40), shape("square", "blue", 160, 160),
                     shape("star", "green", 60, 100), shape("star", "green", 140, 100)], number="42")


def answers(scene, task):
    return {qa.question: qa.answer for qa in scene_questions(scene).get(task, [])}


def test_questions_and_answers_follow_the_scene():
    assert answers(SCENE, "colour") == {"What colour is the circle?": "red", "What colour is the square?": "blue"}
    # Green is on two objects: "What shape is the green object?" has no single answer, so it is not asked.
    assert answers(SCENE, "shape") == {"What shape is the red object?": "circle",
                                       "What shape is the blue object?": "square"}
    assert answers(SCENE, "count") == {"How many circles are there?": "1", "How many squares are there?": "1",
                                       "How many triangles are there?": "0", "How many stars are there?": "2"}
    assert answers(SCENE, "left_right") == {"Is the circle left or right of the square?": "left",
                                            "Is the square left or right of the circle?": "right"}
    assert answers(SCENE, "above_below") == {"Is the circle above or below the square?": "above",
                                             "Is the square above or below the circle?": "below"}
    assert answers(SCENE, "number") == {"What number is written in the picture?": "42"}
    assert describe(SCENE) == "a red circle, a green star, a green star and a blue square"  # left to right


def test_shapes_too_close_to_call_are_not_asked_about():
    close = plain_scene([shape("circle", "red", 100, 40), shape("square", "blue", 102, 160)])
    assert answers(close, "left_right") == {}  # 2 px apart horizontally: no "left of" question
    assert set(answers(close, "above_below").values()) == {"above", "below"}


def test_compare_asks_only_about_shapes_whose_counts_differ():
    first = plain_scene([shape("star", "red", 40, 40), shape("star", "blue", 120, 40), shape("circle", "red", 80, 120)])
    second = plain_scene([shape("star", "pink", 40, 40), shape("circle", "red", 80, 120), shape("circle", "red", 140, 150)])
    qas = compare_questions(first, second)
    assert {qa.question: qa.answer for qa in qas} == {
        "Which picture has more circles, the first or the second?": "second",
        "Which picture has more stars, the first or the second?": "first"}


@pytest.mark.parametrize("reply, right", [
    ("red", True), ("Red.", True), ("It is red.", True), ("RED!", True), ("blue", False), ("", False),
    ("red or blue", False)])
def test_grade_one_word_answers(reply, right):
    assert grade(QA("colour", "What colour is the circle?", "red"), reply) is right


def test_grade_descriptions_as_sets_of_coloured_shapes():
    qa = QA("describe", "Describe the picture.", "a red circle and a blue square")
    assert grade(qa, "A blue square and a red circle.")
    assert not grade(qa, "a red circle")
    assert not grade(qa, "a blue circle and a red square")
    assert not grade(qa, "a red circle, a blue square and a green star")


def test_scenes_and_pictures_are_reproducible_from_the_seed():
    one, two = random.Random(7), random.Random(7)
    a, b = random_scene(one), random_scene(two)
    assert a == b
    assert render(a, one).tobytes() == render(b, two).tobytes()
    assert random_scene(random.Random(8)) != a


def test_random_scenes_cover_every_shape_colour_and_background():
    rng = random.Random(0)
    scenes = [random_scene(rng) for _ in range(300)]
    assert {s.kind for sc in scenes for s in sc.shapes} == set(SHAPES)
    assert {s.colour for sc in scenes for s in sc.shapes} == set(COLOURS)
    assert {sc.style["background"] for sc in scenes} == {"light", "dark", "gradient", "noise", "colour"}
    assert sum(sc.number is not None for sc in scenes) > 60
    for sc in scenes:  # no two shapes overlap, and all are inside the picture
        for i, s in enumerate(sc.shapes):
            assert s.radius <= s.x <= sc.width - s.radius and s.radius <= s.y <= sc.height - s.radius
            assert all((s.x - t.x) ** 2 + (s.y - t.y) ** 2 > (s.radius + t.radius) ** 2 for t in sc.shapes[i + 1:])


def test_a_drawn_shape_has_its_colour_where_the_scene_says():
    scene = plain_scene([shape("circle", "red", 50, 50, radius=20), shape("square", "blue", 150, 150, radius=20)])
    picture = render(scene)
    assert picture.getpixel((50, 50)) == PALETTE["red"][0]
    assert picture.getpixel((150, 150)) == PALETTE["blue"][0]
    assert picture.getpixel((150, 50)) == (255, 255, 255)


def test_hints_say_what_lies_under_each_visual_token(tiny_run):
    # A 112x112 picture is 4x4 visual tokens of 28x28 pixels. A big red circle covers the top-left 2x2 tokens
    # (most of their sample points lie within 0.9 x 30 px of its centre at (28, 28)); a small blue star sits
    # inside the bottom-right token only (one sample point: labelled as the block of its centre); "7" is printed
    # in the top-right token (x 84-112), its centre x = 95 in the block's middle third (93.3-102.7). Columns 2-4:
    # the digit (+1) in the block's left, middle and right third. Relations (columns 5-8: where the only
    # circle/square/triangle/star is left (0) or right (1); columns 9-12: above (0) or below (1)): from the
    # circle, the star is right and below; from the star, the circle is left and above; no square or triangle,
    # so those stay IGNORE (-100). Column 13: how many of the covering shape's kind (one circle, one star),
    # IGNORE off the shapes; column 14: 1 on the block of a shape's centre (the circle's (28, 28) is in block
    # (1, 1), the star's in (3, 3)), else 0.
    scene = plain_scene([shape("circle", "red", 28, 28, radius=30), shape("star", "blue", 90, 95, radius=5)],
                        number="7")
    scene.width = scene.height = 112
    scene.number_box = (85, 5, 105, 25)
    image = preprocess_image(render(scene), ImageProcessorConfig.from_pretrained(tiny_run))
    assert image.grid_thw == (1, 8, 8)
    red, blue, circle, star, text, seven = COLOURS.index("red") + 1, COLOURS.index("blue") + 1, 1, 4, 5, 8
    _ = -100
    expected = torch.tensor([[0, 0, 0, 0, 0] + [_] * 9 + [0]] * 16).view(4, 4, 15)
    for r, c in ((0, 0), (0, 1), (1, 0), (1, 1)):
        expected[r, c] = torch.tensor([red, circle, 0, 0, 0, _, _, _, 1, _, _, _, 1, 1, int((r, c) == (1, 1))])
    expected[3, 3] = torch.tensor([blue, star, 0, 0, 0, 0, _, _, _, 0, _, _, _, 1, 1])
    expected[0, 3] = torch.tensor([0, text, 0, seven, 0] + [_] * 9 + [0])
    assert SHAPES == ("circle", "square", "triangle", "star")
    assert torch.equal(token_hints(scene, image), expected.view(16, 15))


def test_every_digit_of_a_small_number_is_hinted():
    # 4x4 blocks of 28 px. "305" in the box x 20-44, y 40-50: three digits 8 px wide, centres at x = 24, 32, 40,
    # all in block row 1 (28-56 px). 24 is in block column 0, its right third (18.7-28); 32 in column 1's left
    # third (28-37.3); 40 in column 1's middle third (37.3-46.7). No block's centre (14, 42, 70, 98) lies in the
    # box but x = 42: labelling only the digit under a block's centre would teach "5" and never "3" or "0".
    scene = plain_scene([], number="305")
    scene.width = scene.height = 112
    scene.number_box = (20, 40, 44, 50)
    assert number_hints(scene, 4, 4) == {1 * 4 + 0: [0, 0, 3 + 1], 1 * 4 + 1: [0 + 1, 5 + 1, 0]}
    # A tall "8" (x 60-80, y 10-50, centre x 70: column 2's middle third) covers 18 px of row 0 and 22 px of
    # row 1, each more than half a block (14 px): both rows show it.
    scene.number, scene.number_box = "8", (60, 10, 80, 50)
    assert number_hints(scene, 4, 4) == {0 * 4 + 2: [0, 9, 0], 1 * 4 + 2: [0, 9, 0]}
    # Moved down to y 20-60: 8 px of row 0 and 4 px of row 2 are too little; row 1 alone (28 px) shows it.
    scene.number_box = (60, 20, 80, 60)
    assert number_hints(scene, 4, 4) == {1 * 4 + 2: [0, 9, 0]}
    # A wide "4" (x 10-66, y 0-28): its centre x = 38 is in column 1 (28-56), its middle third ((38 - 28) / 28 x 3
    # = 1.07). Column 0 holds 18 px of it, over half a block (14 px): text, no digit centred there. Column 2 holds
    # 10 px: too little.
    scene.number, scene.number_box = "4", (10, 0, 66, 28)
    assert number_hints(scene, 4, 4) == {0: [0, 0, 0], 1: [0, 5, 0]}


def test_count_hints_count_the_shapes_of_a_kind(tiny_run):
    # Three circles and a square far apart in a 168x168 picture (6x6 blocks of 28 px): every block a circle covers
    # says 3, the square's blocks say 1, and exactly four blocks are centres (30 px is in block 1, 138 in block 4).
    shapes = [shape("circle", "red", 30, 30, radius=18), shape("circle", "green", 138, 30, radius=18),
              shape("circle", "blue", 30, 138, radius=18), shape("square", "black", 138, 138, radius=18)]
    scene = plain_scene(shapes)
    scene.width = scene.height = 168
    image = preprocess_image(render(scene), ImageProcessorConfig.from_pretrained(tiny_run))
    hints = token_hints(scene, image)
    assert hints.shape == (36, 15)
    kind, count, centre = hints[:, 1], hints[:, 13], hints[:, 14]
    assert set(count[kind == 1].tolist()) == {3} and set(count[kind == 2].tolist()) == {1}
    assert set(count[kind == 0].tolist()) == {-100}
    assert sorted(centre.nonzero().squeeze(1).tolist()) == [1 * 6 + 1, 1 * 6 + 4, 4 * 6 + 1, 4 * 6 + 4]


# ---------------------------------------------------------------------------------------------------------
# Chats as training sequences, and the loop


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A tiny demo-shaped model (the demo's tokenizer and pictures), untrained."""
    return new_run(tmp_path_factory.mktemp("demo-tiny") / "run", TINY_SPEC)


def test_a_run_s_picture_cap_can_be_raised(tiny_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    before = ImageProcessorConfig.from_pretrained(run)
    assert before.factor == 28  # the tiny tower's token: 14-pixel patches, merged 2x2
    set_picture_cap(run, 100)
    raised = ImageProcessorConfig.from_pretrained(run)
    assert (raised.max_pixels, raised.min_pixels) == (100 * 28 * 28, before.min_pixels)  # 280x280 px; floor kept
    assert preprocess_image(Image.new("RGB", (400, 400)), raised).num_tokens == 100  # resized to 280x280
    assert preprocess_image(Image.new("RGB", (400, 400)), before).num_tokens < 100


def test_a_training_chat_is_what_the_chat_template_renders(tiny_run):
    tokenizer = Tokenizer.from_pretrained(tiny_run)
    config = ImageProcessorConfig.from_pretrained(tiny_run)
    image = preprocess_image(render(SCENE), config)
    qas = [QA("colour", "What colour is the circle?", "red"), QA("count", "How many stars are there?", "2")]
    example = encode_chat(tokenizer, [image], qas)

    messages = [{"role": "user", "content": [{"type": "image", "image": "x"}, {"type": "text", "text": qas[0].question}]},
                {"role": "assistant", "content": "red"}, {"role": "user", "content": qas[1].question},
                {"role": "assistant", "content": "2"}]
    text, _ = tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    expected = tokenizer.expand_image_placeholders(tokenizer.encode(text), [image.num_tokens])
    assert example.token_ids == expected
    # Exactly the answers and their <|im_end|> are labelled, each with its own token id.
    labelled = [t for t, label in zip(example.token_ids, example.labels) if label != IGNORE]
    assert [label for label in example.labels if label != IGNORE] == labelled
    assert tokenizer.decode(labelled) == "red<|im_end|>2<|im_end|>"
    assert example.tasks == ["colour", "count"]


def test_batches_depend_only_on_seed_and_step(tiny_run):
    tokenizer, config = Tokenizer.from_pretrained(tiny_run), ImageProcessorConfig.from_pretrained(tiny_run)
    cfg = TrainConfig(batch_size=3, curriculum_steps=0)
    a, b = make_batch(5, cfg, tokenizer, config), make_batch(5, cfg, tokenizer, config)
    assert [ex.token_ids for ex in a] == [ex.token_ids for ex in b]
    assert [ex.token_ids for ex in make_batch(6, cfg, tokenizer, config)] != [ex.token_ids for ex in a]


def tiny_config(steps, **kwargs):
    settings = dict(batch_size=4, lr=3e-3, warmup_steps=2, curriculum_steps=0, save_every=100, max_turns=4,
                    vision_steps=0)
    return TrainConfig(steps=steps, **(settings | kwargs))


def test_each_stage_warms_up_then_decays_on_its_own_schedule():
    cfg = TrainConfig(steps=30, vision_steps=10, warmup_steps=2, lr=1e-2, vision_lr=1e-3, min_lr_ratio=0.1)
    rates = [learning_rate(step, cfg) for step in range(30)]
    assert rates[:2] == pytest.approx([5e-4, 1e-3])  # stage 1: warm-up to vision_lr
    assert 1e-4 < rates[9] < 1.5e-4  # and decay towards a tenth of it by the end of stage 1
    assert rates[10:12] == pytest.approx([5e-3, 1e-2])  # stage 2: its own warm-up, to lr
    assert rates[29] == pytest.approx(1e-3, rel=0.1)


def test_stage_three_cuts_stage_two_short_and_holds_its_own_rate():
    cfg = TrainConfig(steps=30, vision_steps=10, warmup_steps=2, lr=1e-2, focus_start=25,
                      focus_phases=((5, ("colour",)), (3, ("count", "colour"))), focus_lr=4e-3, focus_warmup=4)
    assert [stage(step, cfg) for step in (0, 9, 10, 24, 25, 32)] == [1, 1, 2, 2, 3, 3]
    assert cfg.total_steps == 33
    assert [cfg.focus_tasks(step) for step in (25, 29, 30, 32)] == [("colour",)] * 2 + [("count", "colour")] * 2
    plain = TrainConfig(steps=30, vision_steps=10, warmup_steps=2, lr=1e-2)
    # Stage 2 follows the schedule of a 30-step run up to the cut, then stage 3 warms up to focus_lr and stays.
    assert [learning_rate(s, cfg) for s in range(25)] == [learning_rate(s, plain) for s in range(25)]
    assert [learning_rate(s, cfg) for s in range(25, 33)] == pytest.approx([1e-3, 2e-3, 3e-3] + [4e-3] * 5)
    # By default stage 3 follows stage 2; without phases there is none.
    assert TrainConfig(steps=30, focus_phases=((5, ("colour",)),)).total_steps == 35
    plain_run = TrainConfig(steps=30, vision_steps=10)
    assert plain_run.total_steps == 30 and stage(29, plain_run) == 2


def test_stage_three_asks_only_its_phase_s_tasks_several_at_a_time(tiny_run):
    tokenizer, config = Tokenizer.from_pretrained(tiny_run), ImageProcessorConfig.from_pretrained(tiny_run)
    cfg = TrainConfig(steps=10, vision_steps=0, focus_start=5, focus_phases=((5, ("colour",)),), batch_size=12)
    chats = make_batch(5, cfg, tokenizer, config)
    assert {task for ex in chats for task in ex.tasks} == {"colour"}
    assert all(len(ex.images) == 1 for ex in chats)  # no two-picture chats unless "compare" is a phase's task
    assert sum(len(ex.tasks) for ex in chats) / len(chats) >= 2  # several shapes, each asked about


def test_stage_three_asks_several_questions_of_a_task_in_one_chat():
    qas = {task: [QA(task, f"{task} {i}", "x") for i in range(6)] for task in ("colour", "shape", "count")}
    for seed in range(20):
        chosen = pick_contrasting(qas, random.Random(seed), 8, ("colour", "shape"))
        assert len(chosen) == len(set(chosen)) == 8  # no repeats
        assert sorted(Counter(qa.task for qa in chosen).values()) == [4, 4]  # two tasks, four questions each
        assert all(qa.task != "count" for qa in chosen)  # a task not listed is never asked
    # When the listed tasks' pools run dry, fewer questions come back.
    assert len(pick_contrasting(qas, random.Random(0), 8, ("shape",))) == 4


def test_a_count_phase_asks_every_count_about_equally_often():
    # Counting chats ask "How many" about a kind drawn 0..6 times; the answer is what the scene holds, and every
    # count from 3 to 6 is at least 5% of the answers (under 2% each in stage 3's other pictures).
    rng, answers = random.Random(0), Counter()
    for _ in range(700):
        scene, qas = counting_chat(rng)
        for qa in qas:
            assert qa.task == "count"
            kind = qa.question.removeprefix("How many ").removesuffix("s are there?")
            assert qa.answer == str(sum(s.kind == kind for s in scene.shapes))
        answers.update(qa.answer for qa in qas)
    assert set(answers) == {str(n) for n in range(7)}
    assert min(answers[str(n)] for n in range(3, 7)) >= 0.05 * sum(answers.values())


def test_a_count_phase_mixes_counting_chats_into_its_batches(tiny_run):
    tokenizer, config = Tokenizer.from_pretrained(tiny_run), ImageProcessorConfig.from_pretrained(tiny_run)

    def share_of_three_to_six(counting_chats):
        cfg = TrainConfig(steps=10, vision_steps=0, focus_start=0, focus_phases=((5, ("count",)),), batch_size=40,
                          counting_chats=counting_chats)
        answers = Counter()
        for ex in make_batch(0, cfg, tokenizer, config):
            labelled = [t for t, label in zip(ex.token_ids[1:], ex.labels[1:]) if label != IGNORE]
            answers.update(tokenizer.decode(labelled, skip_special_tokens=False).split("<|im_end|>")[:-1])
        assert set(answers) <= {str(n) for n in range(7)}  # a count phase asks only "How many"
        return sum(answers[str(n)] for n in range(3, 7)) / sum(answers.values())

    # Without counting chats, 3 to 6 are about 7% of a count phase's answers; mostly counting chats triple that.
    assert share_of_three_to_six(0.0) < 0.1 and share_of_three_to_six(0.9) >= 0.18


def test_number_chats_ask_the_printed_number_among_the_phase_s_other_questions(tiny_run):
    tokenizer, config = Tokenizer.from_pretrained(tiny_run), ImageProcessorConfig.from_pretrained(tiny_run)

    def chats_asking_the_number(number_chats):
        cfg = TrainConfig(steps=10, vision_steps=0, focus_start=0, focus_phases=((5, ("number", "colour")),),
                          batch_size=40, number_chats=number_chats)
        batch = make_batch(0, cfg, tokenizer, config)
        assert all(set(ex.tasks) <= {"number", "colour"} for ex in batch)  # only the phase's tasks
        assert any("colour" in ex.tasks for ex in batch)  # the number among the phase's other questions
        return sum("number" in ex.tasks for ex in batch) / len(batch)

    # A picture holds a number 40% of the time: without number chats, under half the chats can ask it; with all
    # chats number chats, every chat asks it.
    assert chats_asking_the_number(0.0) < 0.5 and chats_asking_the_number(1.0) == 1.0


def test_number_close_ups_are_extra_chats_about_a_small_shrunk_picture_with_a_number(tiny_run):
    tokenizer, config = Tokenizer.from_pretrained(tiny_run), ImageProcessorConfig.from_pretrained(tiny_run)
    rng = random.Random(3)
    for _ in range(30):
        scene, qas, cap = number_close_up(rng, config)
        assert scene.number is not None and ("number", scene.number) in [(qa.task, qa.answer) for qa in qas]
        assert {qa.task for qa in qas} <= {"number", "colour", "shape"} and len(qas) <= 3
        assert max(scene.width, scene.height) <= 224 and config.min_pixels <= cap <= config.max_pixels
        assert cap <= max(config.min_pixels, scene.width * scene.height)  # shown at its size or smaller
    cfg = TrainConfig(steps=10, vision_steps=0, batch_size=3)
    plain = make_batch(4, cfg, tokenizer, config)
    with_close_ups = make_batch(4, TrainConfig(steps=10, vision_steps=0, batch_size=3, number_close_ups=2),
                                tokenizer, config)
    # The batch's own chats are unchanged (a resumed run's data is the same); the close-ups come after them.
    assert [ex.token_ids for ex in with_close_ups[:3]] == [ex.token_ids for ex in plain]
    assert len(with_close_ups) == 5 and all("number" in ex.tasks for ex in with_close_ups[3:])
    assert all(ex.hints[0].shape[0] == ex.images[0].num_tokens for ex in with_close_ups[3:])


@pytest.fixture(scope="module")
def stix():
    """A font file that is not the training renderer's own: matplotlib's (the lessons extra, in the dev extra)."""
    import matplotlib
    return str(Path(matplotlib.get_data_path()) / "fonts" / "ttf" / "STIXGeneral.ttf")


def ink_box(before: Image.Image, after: Image.Image):
    """The bounding box (left, top, right, bottom) of the pixels that differ."""
    return ImageChops.difference(before, after).getbbox()


@pytest.mark.parametrize("digits", ["7", "42", "509"])
def test_a_number_in_another_font_is_drawn_inside_its_box(digits, stix):
    without = render(plain_scene([]))
    scene = plain_scene([], number=digits)  # its box: (150, 10) to (180, 30), black on white
    scene.style["number_font"] = stix
    drawn = ink_box(without, render(scene))
    left, top, right, bottom = drawn
    assert 150 <= left and 10 <= top and right <= 181 and bottom <= 31  # inside, 1 px for anti-aliasing
    assert bottom - top >= 15 or right - left >= 27  # and as large as fits: its height or its width fills the box
    assert render(scene) != render(plain_scene([], number=digits))  # not the scene's own font


def test_other_font_redraws_half_the_numbers_and_leaves_runs_without_fonts_as_they_were(stix):
    rng = random.Random(5)
    state = rng.getstate()
    other_font(plain_scene([], number="12"), rng, ())
    assert rng.getstate() == state  # no font files: no draw from rng, so the old runs' pictures are unchanged
    fonts = [plain_scene([], number="12") for _ in range(400)]
    for scene in fonts:
        other_font(scene, rng, (stix, "other.ttf"))
    counts = Counter(scene.style["number_font"] for scene in fonts)
    assert set(counts) == {"aileron", stix, "other.ttf"} and 160 <= counts["aileron"] <= 240
    no_number = plain_scene([])
    other_font(no_number, random.Random(0), (stix,), share=1.0)
    assert "number_font" not in no_number.style


def test_number_fonts_from_the_command_line():
    spec = importlib.util.spec_from_file_location("train_demo", Path(__file__).parents[1] / "scripts" / "train_demo.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    number_fonts = script.number_fonts
    files = number_fonts(["matplotlib"])
    assert len(files) == 9 and all(Path(f).is_file() for f in files)
    assert not any("DejaVu" in f for f in files)  # the independent test pictures' font stays unseen
    with pytest.raises(SystemExit, match="not a .ttf or .otf file"):
        number_fonts(["/no/such/font.ttf"])


def test_number_fonts_change_the_pictures_of_a_batch_and_only_with_the_seed_and_step(tiny_run, stix):
    tokenizer, config = Tokenizer.from_pretrained(tiny_run), ImageProcessorConfig.from_pretrained(tiny_run)
    plain = TrainConfig(steps=10, vision_steps=0, batch_size=2, number_close_ups=3)
    fonts = TrainConfig(steps=10, vision_steps=0, batch_size=2, number_close_ups=3, number_fonts=(stix,))

    def close_up_pixels(cfg, step):  # the close-ups (the batch's last 3 chats) always hold a number
        return [ex.images[0].pixel_values for ex in make_batch(step, cfg, tokenizer, config)[2:]]

    differ = 0
    for step in range(4):
        with_fonts = close_up_pixels(fonts, step)
        assert all(torch.equal(a, b) for a, b in zip(with_fonts, close_up_pixels(fonts, step)))  # (seed, step)
        differ += sum(a.shape != b.shape or not torch.equal(a, b)
                      for a, b in zip(with_fonts, close_up_pixels(plain, step)))
    assert differ >= 3  # about half of the 12 close-ups are drawn in STIX (and later draws of rng shift too)


def test_image_token_places_go_row_by_row_from_the_top_left():
    # A (1, 4, 6) patch grid with a 2x2 merge is 2 rows of 3 tokens; then a 1-token picture.
    places = image_token_places([(1, 4, 6), (1, 2, 2)], merge_size=2)
    third = 1 / 3
    expected = [[-third, -0.25], [0, -0.25], [third, -0.25], [-third, 0.25], [0, 0.25], [third, 0.25], [0, 0]]
    assert torch.allclose(places, torch.tensor(expected))


def test_stage_one_trains_the_vision_tower_alone(tiny_run, tmp_path):
    folder = tmp_path / "run"
    shutil.copytree(tiny_run, folder)
    before = load_model(folder).state_dict()
    result = train(folder, tiny_config(3, vision_steps=3), show_progress=False, log=lambda _: None)
    after = result["model"].state_dict()
    changed = {name for name in before if not torch.equal(before[name], after[name])}
    assert "visual.patch_embed.proj.weight" in changed and "visual.merger.mlp.2.weight" in changed
    assert all(name.startswith("visual.") for name in changed), sorted(changed)


def test_a_few_training_steps_make_the_loss_fall(tiny_run, tmp_path):
    folder = tmp_path / "run"
    shutil.copytree(tiny_run, folder)
    result = train(folder, tiny_config(24), show_progress=False, log=lambda _: None)
    losses = result["losses"]
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert first > 4.0  # about ln(vocab): the untrained model knows nothing
    assert last < 0.6 * first, losses


def test_a_run_with_stage_three_ends_at_its_total_steps(tiny_run, tmp_path):
    folder = tmp_path / "run"
    shutil.copytree(tiny_run, folder)
    cfg = tiny_config(10, focus_start=2, focus_phases=((2, ("colour", "count")),), save_every=1)
    result = train(folder, cfg, show_progress=False, log=lambda _: None)
    assert len(result["losses"]) == 4 and result["steps"] == 4
    assert torch.load(folder / "train_state.pt", weights_only=False)["step"] == 4


def test_one_masked_attention_call_for_all_chats_is_one_call_per_chat(tiny_run):
    """The GPU's fused attention (a block-diagonal causal mask over the packed chats) gives the per-chat calls'
    loss and gradients: no chat sees another's tokens, nor its own later ones."""
    tokenizer, image_config = Tokenizer.from_pretrained(tiny_run), ImageProcessorConfig.from_pretrained(tiny_run)
    batch = make_batch(3, tiny_config(10, batch_size=5, number_close_ups=2), tokenizer, image_config)
    model = load_model(tiny_run).float().train().requires_grad_(True)
    results = []
    for fused in (False, True):
        model.zero_grad()
        loss, _ = batch_loss(model, batch, fused_attention=fused)
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]))
    (loss, grads), (fused_loss, fused_grads) = results
    assert len({len(ex.token_ids) for ex in batch}) > 1  # chats of several lengths, packed
    torch.testing.assert_close(fused_loss, loss, rtol=1e-5, atol=1e-6)
    assert len(grads) == len(fused_grads) > 10
    for grad, fused_grad in zip(grads, fused_grads):
        torch.testing.assert_close(fused_grad, grad, rtol=1e-4, atol=1e-6)


def test_more_batch_workers_draw_the_same_batches(tiny_run, tmp_path):
    """Workers draw batches ahead in any order; each batch depends only on (seed, step), so the run is the same."""
    runs = {}
    for workers in (1, 3):
        folder = tmp_path / f"workers-{workers}"
        shutil.copytree(tiny_run, folder)
        runs[workers] = train(folder, tiny_config(4, batch_workers=workers), show_progress=False,
                              log=lambda _: None)["losses"]
    assert len(runs[1]) == 4 and runs[3] == runs[1]


def test_a_time_limit_stops_the_run_with_a_state_to_resume_from(tiny_run, tmp_path):
    folder = tmp_path / "run"
    shutil.copytree(tiny_run, folder)
    quiet, said = dict(show_progress=False), []
    done = train(folder, tiny_config(3, save_every=1), **quiet, log=lambda _: None)
    assert done["steps"] == 3
    out_of_time = train(folder, tiny_config(6, save_every=100, time_limit=0.0), **quiet, log=said.append)
    assert out_of_time["steps"] == 3 and out_of_time["losses"] == []  # no time for even one more step
    assert torch.load(folder / "train_state.pt", weights_only=False)["step"] == 3 and "out of time" in said[-1]
    assert train(folder, tiny_config(6), **quiet, log=lambda _: None)["first_step"] == 3


def test_a_run_out_of_time_part_way_resumes_as_if_never_stopped(tiny_run, tmp_path, monkeypatch):
    """A clock that moves one second a step: with 2.5 s the run does steps 0-2, saves its state at step 3 (not
    at a save point), and the rest of the run gives the uninterrupted run's losses."""
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    shutil.copytree(tiny_run, straight)
    shutil.copytree(tiny_run, stopped)
    quiet = dict(show_progress=False, log=lambda _: None)
    whole = train(straight, tiny_config(5), **quiet)["losses"]
    clock, real_step = [0.0], trainer._train_step
    def step_and_tick(*args):
        clock[0] += 1.0
        return real_step(*args)
    with monkeypatch.context() as patch:
        patch.setattr(trainer.time, "perf_counter", lambda: clock[0])
        patch.setattr(trainer, "_train_step", step_and_tick)
        cut = train(stopped, tiny_config(5, save_every=100, time_limit=2.5), **quiet)
    assert cut["steps"] == 3 and cut["losses"] == whole[:3]
    rest = train(stopped, tiny_config(5), **quiet)
    assert rest["first_step"] == 3 and rest["losses"] == whole[3:]


def test_resuming_with_another_recipe_says_what_changed(tiny_run, tmp_path):
    folder = tmp_path / "run"
    shutil.copytree(tiny_run, folder)
    train(folder, tiny_config(2), show_progress=False, log=lambda _: None)
    said = []
    train(folder, tiny_config(3, lr=1e-3, batch_workers=2, save_every=50), show_progress=False, log=said.append)
    assert said[0].startswith("resuming") and "lr: 0.003 -> 0.001" in said[0]
    assert "batch_workers" not in said[0] and "save_every" not in said[0]  # how it runs, not what it learns
    said.clear()
    train(folder, tiny_config(3, lr=1e-3), show_progress=False, log=said.append)
    assert not any(line.startswith("resuming") for line in said)  # the same recipe: nothing to say


def test_a_resumed_run_ends_exactly_where_an_uninterrupted_one_does(tiny_run, tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    shutil.copytree(tiny_run, straight)
    shutil.copytree(tiny_run, resumed)
    quiet = dict(show_progress=False, log=lambda _: None)
    whole = train(straight, tiny_config(5), **quiet)
    # Killed during step 4 (index 3): the state saved after step 2 is what survives.
    killed = train(resumed, tiny_config(5, save_every=2), stop_before=3, **quiet)
    assert killed["losses"] == whole["losses"][:3]
    rest = train(resumed, tiny_config(5, save_every=2), **quiet)
    assert rest["first_step"] == 2
    assert rest["losses"] == whole["losses"][2:]
    for (name, a), b in zip(whole["model"].state_dict().items(), rest["model"].state_dict().values()):
        assert torch.equal(a, b), name

