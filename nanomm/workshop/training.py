"""Training the demo model: a few-million-parameter Qwen2-VL that answers questions about scenes, on a CPU.

Lesson: lessons/A2-how-the-demo-model-was-made.md. The script is scripts/train_demo.py; this module is its parts.

The model is nanomm's own `Qwen2VL`, trained in float32 (matmuls under bfloat16 autocast where the CPU has
AMX) with plain PyTorch, in up to three stages: 1, the vision tower alone on the hints below; 2, the whole model
on every task; 3 (optional, `focus_phases`), the whole model on pictures with several shapes, a few tasks at a
time, several questions of one task per chat (`pick_contrasting`). The recipe's parts:

- one picture, many questions: a training sequence is a whole chat, one or two pictures then up to eight
  question/answer turns, so one vision encode feeds many supervised answers (and follow-ups are trained);
- only answers are supervised: the loss is over the assistant's answer tokens and their <|im_end|>;
- a short curriculum: the first steps see pictures with one or two shapes, where "which shape is red" is
  easy, then up to the full mix;
- fresh data every step: scenes are drawn on the fly from a per-step seed, so there is no overfitting and a
  resumed run sees exactly the data it would have seen;
- hints for the vision tower: a training-only linear head reads each visual token and is taught what lies under
  it (which colour, which shape or text, which digits), where the other shapes are (left or right, above or
  below), how many shapes of its kind the picture holds, and whether a shape's centre lies in it, from the
  scene's truth, because through the answers alone the tower learns shapes very slowly. The head is thrown
  away: the checkpoint is a plain Qwen2-VL. (trainer.py's `local_attention_init` is the other half: a vision
  tower that starts out looking at neighbouring patches.)
- counting chats (`counting_chat`, `TrainConfig.counting_chats`): a stage-3 phase that asks count can draw most
  of its pictures with 0..6 shapes of one kind, so that every count is asked about equally often.
- number chats (`number_chat`, `TrainConfig.number_chats`): likewise, a phase that asks number can draw a share
  of its pictures with a printed number, and ask it among the phase's other questions (of the chats that are
  not counting chats, where a phase asks both).
- number close-ups (`number_close_up`, `TrainConfig.number_close_ups`): extra chats in every batch about a small
  picture around a printed number, often shrunk; a few visual tokens each, so they add many digits to a step
  for little of its time.
- number fonts (`TrainConfig.number_fonts`, `scenes.other_font`): font files that half the printed numbers are
  drawn in, so that digits are not learned in one renderer's fonts alone.

A batch is `batch_size` chats packed end to end with no padding; attention is causal per chat
(`PackedCausalAttention`: one call per chat on a CPU, one masked call for them all on a GPU), and the vision
tower runs all the batch's pictures in one call.
"""

from __future__ import annotations

import functools
import math
import random
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F

from nanomm.demo.scenes import COLOURS, SHAPES, counting_scene, other_font, random_scene, render, shape_mask
from nanomm.demo.tasks import (MAX_COUNT, QA, TASKS, clearly_apart, compare_questions, count_question,
                               scene_questions, vary)
from nanomm.model.attention import causal_attention, masked_attention
from nanomm.inputs.image import ImageProcessorConfig, preprocess_image
from nanomm.inputs.tokenizer import DEFAULT_SYSTEM_PROMPT, Tokenizer
from nanomm.model.qwen2_vl import Qwen2VL
from nanomm.model.rope import mrope_positions

IGNORE = -100  # the label of a token the loss skips


@dataclass
class TrainConfig:
    steps: int = 4000  # stage 1 (vision_steps) and stage 2 together
    batch_size: int = 16
    lr: float = 1.5e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 200
    weight_decay: float = 0.05
    grad_clip: float = 1.0
    curriculum_steps: int = 300  # stage 2 starts on pictures with 1-2 shapes, then the full mix
    compare_fraction: float = 0.2  # chats with two pictures
    max_turns: int = 8
    seed: int = 0
    save_every: int = 100
    threads: int = 0  # torch threads; 0 = leave torch's default
    device: str = "cpu"  # where the model trains: "cpu", or "cuda" (a GPU; the batches are still drawn on CPUs)
    batch_workers: int = 1  # processes drawing batches ahead of the step (a GPU step needs several to keep up)
    time_limit: float | None = None  # seconds: end the run at the first step after this, and export what it has
    freeze_vision: bool = False  # train the text model only (the draft)
    flush_denormal: bool = True  # tiny floats as zero: CPU arithmetic on denormals is many times slower
    hint_weight: float = 0.5  # weight of the vision hints' loss (0: answers only)
    vision_steps: int = 2000  # the first steps train the vision tower alone, on the hints (stage 1)
    vision_lr: float = 1e-3  # stage 1's peak learning rate
    vision_lr_scale: float = 0.3  # in stage 2 the tower learns at this fraction of the language model's rate
    position_weight: float = 1.0  # weight of the image tokens' position loss in stage 2 (`image_token_places`)
    bf16: bool = False  # matmuls and attention under bfloat16 autocast (fast on CPUs with AMX or AVX512-BF16)
    # Stage 3: phases of (steps, tasks), each asking only its tasks, on pictures with several shapes.
    focus_phases: tuple[tuple[int, tuple[str, ...]], ...] = ()
    focus_start: int | None = None  # the step stage 3 begins at (default: `steps`, where stage 2 ends)
    focus_lr: float = 3e-4  # stage 3's learning rate (after a short warm-up), the same for the whole model
    focus_warmup: int = 50
    # In a stage-3 phase that asks count, the share of chats that are `counting_chat`s (0: the recipe before them).
    counting_chats: float = 0.0
    # In a stage-3 phase that asks number, the share of chats about a picture that surely holds one (`number_chat`).
    number_chats: float = 0.0
    # Extra chats appended to every batch: small pictures around a printed number (`number_close_up`).
    number_close_ups: int = 0
    # Font files (.ttf/.otf) that half the printed numbers are drawn in instead (`scenes.other_font`); () = none.
    number_fonts: tuple[str, ...] = ()

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def focus_begins(self) -> int:
        return self.steps if self.focus_start is None else self.focus_start

    @property
    def focus_steps(self) -> int:
        return sum(steps for steps, _ in self.focus_phases)

    @property
    def total_steps(self) -> int:
        """The step the run ends at: stage 2's schedule ends at `steps`, stage 3 may cut it short and follows."""
        return self.focus_begins + self.focus_steps if self.focus_phases else self.steps

    def focus_tasks(self, step: int) -> tuple[str, ...]:
        """The tasks stage 3 asks at this step (its phase's)."""
        end = self.focus_begins
        for steps, tasks in self.focus_phases:
            end += steps
            if step < end:
                return tuple(tasks)
        return tuple(self.focus_phases[-1][1])


def stage(step: int, cfg: TrainConfig) -> int:
    """1: the vision tower alone; 2: the whole model on every task; 3: the whole model on its phase's tasks."""
    if cfg.focus_phases and step >= cfg.focus_begins:
        return 3
    return 1 if step < cfg.vision_steps else 2


def learning_rate(step: int, cfg: TrainConfig) -> float:
    """Stages 1 and 2 (the tower alone, then the whole model) each have their own linear warm-up, then cosine
    decay to min_lr_ratio of their peak; stage 3 warms up to focus_lr and stays there."""
    if stage(step, cfg) == 3:
        return cfg.focus_lr * min(1.0, (step - cfg.focus_begins + 1) / cfg.focus_warmup)
    stage_one = step < cfg.vision_steps
    peak = cfg.vision_lr if stage_one else cfg.lr
    start, end = (0, cfg.vision_steps) if stage_one else (cfg.vision_steps, cfg.steps)
    step, length = step - start, end - start  # within the stage
    warmup = min(cfg.warmup_steps, max(1, length // 4))
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, length - warmup))
    return peak * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


# ---------------------------------------------------------------------------------------------------------
# Chats: questions and answers -> token ids and labels


@dataclass
class Example:
    token_ids: list[int]  # the whole chat, image pads expanded
    labels: list[int]  # token id to predict at each position, or IGNORE
    images: list  # ProcessedImage, in prompt order
    tasks: list[str]  # the task of each answer, in order (for per-task accuracy)
    hints: list[torch.Tensor] = field(default_factory=list)  # per image: `token_hints`, (visual tokens, HINT_COLUMNS)


def encode_chat(tokenizer: Tokenizer, images: list, qas: list[QA]) -> Example:
    """A chat of len(qas) turns about the images (all attached to the first turn), as the chat template renders it.

    Each answer's tokens and its <|im_end|> are labelled; everything else is context. Text is encoded in pieces
    that the pre-tokenizer splits at anyway, so the ids equal encoding the whole rendered chat at once
    (tests/test_demo.py checks that against `Tokenizer.apply_chat_template`).
    """
    im_end = tokenizer.tokenizer.token_to_id("<|im_end|>")
    pictures = "<|vision_start|><|image_pad|><|vision_end|>" * len(images)
    ids = tokenizer.encode(f"<|im_start|>system\n{DEFAULT_SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\n{pictures}")
    ids = tokenizer.expand_image_placeholders(ids, [im.num_tokens for im in images])
    labels = [IGNORE] * len(ids)
    for qa in qas:
        context = tokenizer.encode(f"{qa.question}<|im_end|>\n<|im_start|>assistant\n")
        answer = tokenizer.encode(qa.answer) + [im_end]
        ids += context + answer
        labels += [IGNORE] * len(context) + answer
        newline = tokenizer.encode("\n" if qa is qas[-1] else "\n<|im_start|>user\n")
        ids += newline
        labels += [IGNORE] * len(newline)
    return Example(ids, labels, images, [qa.task for qa in qas])


def pick_questions(by_task: dict[str, list[QA]], rng: random.Random, max_turns: int) -> list[QA]:
    """Up to max_turns questions, covering as many tasks as the scene allows (rarer tasks first), no repeats."""
    chosen = []
    pools = {task: rng.sample(qas, len(qas)) for task, qas in by_task.items()}
    while len(chosen) < max_turns and any(pools.values()):
        for task in rng.sample(sorted(pools), len(pools)):
            if pools[task] and len(chosen) < max_turns:
                chosen.append(pools[task].pop())
    return rng.sample(chosen, len(chosen))


def in_curriculum(step: int, cfg: TrainConfig) -> bool:
    """The first curriculum_steps of the whole-model stage see easy pictures (the tower's stage sees the full mix)."""
    return cfg.vision_steps <= step < cfg.vision_steps + cfg.curriculum_steps


def training_scene(rng: random.Random, step: int, cfg: TrainConfig):
    """A random scene; during the curriculum only 1-2 shapes; a third of the time many of one shape (counting)."""
    if in_curriculum(step, cfg):
        return random_scene(rng, num_shapes=rng.randint(1, 2))
    if rng.random() < 0.35:
        return counting_scene(rng)
    return random_scene(rng, num_shapes=rng.randint(1, 5))


def training_cap(rng: random.Random, image_config: ImageProcessorConfig) -> int:
    """The pixel cap of one training picture: mostly the model's default, sometimes down to its minimum, so that
    the smaller caps a user (or the evaluation) may set are not a picture size the model has never seen."""
    if rng.random() < 0.7:
        return image_config.max_pixels
    return rng.randint(image_config.min_pixels, image_config.max_pixels)


SAME_TASK_TURNS = 4  # stage 3 asks up to this many questions of one task in a chat, each about another shape


def focus_scene(rng: random.Random):
    """Stage 3's pictures: several shapes, where a shape word must find its shape. Often 2-4 different kinds
    (each kind's colour and every pair's places can be asked), else many of one kind, or any 2-5 shapes."""
    draw = rng.random()
    if draw < 0.45:
        return random_scene(rng, kinds=rng.sample(SHAPES, rng.randint(2, len(SHAPES))))
    return counting_scene(rng) if draw < 0.8 else random_scene(rng, num_shapes=rng.randint(2, 5))


def pick_contrasting(by_task: dict[str, list[QA]], rng: random.Random, max_turns: int,
                     tasks: tuple[str, ...]) -> list[QA]:
    """Up to max_turns questions of the given tasks, no repeats: a task, then up to SAME_TASK_TURNS of its
    questions, then another task. "What colour is the circle?" next to "What colour is the star?" in one chat
    has two different answers, which only the shape word can tell apart (in stage 2's mix a chat asked about one
    colour or two, and the most striking colour in the picture was often right)."""
    pools = {task: rng.sample(qas, len(qas)) for task, qas in by_task.items() if task in tasks}
    chosen: list[QA] = []
    while len(chosen) < max_turns and pools:
        task = rng.choice(sorted(pools))
        take = min(SAME_TASK_TURNS, max_turns - len(chosen))
        chosen += pools[task][:take]
        del pools[task]
    return rng.sample(chosen, len(chosen))


OTHER_COUNTS = 0.3  # a counting chat also asks about each other kind with this probability


def counting_chat(rng: random.Random) -> tuple:
    """A picture with 0..6 shapes of one kind among others, and "How many" about that kind (every answer equally
    often), sometimes about the other kinds too. Pictures drawn at random rarely hold 3 or more of a kind: of
    stage 3's count questions, about 88% have the answer 0 or 1 and 5% an answer from 3 to 6 (appendix A2, section
    5), and the model shipped at 6ad4f33 answered most 3+ with "2" or "6"."""
    kind = rng.choice(SHAPES)
    scene = counting_scene(rng, kind=kind, count=rng.randint(0, MAX_COUNT))
    qas = [count_question(scene, kind)]
    qas += [count_question(scene, k) for k in SHAPES if k != kind and rng.random() < OTHER_COUNTS]
    return scene, rng.sample(qas, len(qas))


def number_chat(rng: random.Random, tasks: tuple[str, ...], max_turns: int) -> tuple:
    """A picture that holds a printed number among 1..4 shapes, "What number..." and up to max_turns - 1 questions
    of the phase's other tasks. A random picture holds a number 40% of the time and a chat asks one question about
    it, so a phase of every task reads few numbers; mixing number chats into its batches reads more, while the
    other tasks go on being asked (a phase of the number alone made count forget; appendix A2, section 5)."""
    scene = None
    while scene is None or scene.number is None:  # a number too wide for a small picture is left out: draw again
        scene = random_scene(rng, num_shapes=rng.randint(1, 4), number_probability=1.0)
    by_task = scene_questions(scene)
    number = by_task.pop("number")
    others = pick_contrasting(by_task, rng, max_turns - 1, tasks)
    return scene, rng.sample(number + others, 1 + len(others))


CLOSE_UP_SIDES = (64, 224)  # a close-up's width and height in pixels, before the cap shrinks it
CLOSE_UP_SCALES = (0.55, 1.0)  # the cap shrinks its sides by a factor drawn from this range


def number_close_up(rng: random.Random, image_config: ImageProcessorConfig) -> tuple:
    """A small picture around a printed number, beside 0..2 shapes, and the pixel cap to show it at: "What
    number..." and up to two questions about the shapes. A digit's height is 9..48 px as drawn, at most a fifth
    of the picture's side, so a close-up holds the smaller digits; shrinking its sides by a factor down to 0.55
    gives the digits that a large scene shrunk to the default cap holds (down to ~4 px; half of them are under
    about 10 px). With about 60 visual tokens on average instead of a scene's 130-250, a close-up costs the
    tower and the text model a fraction of a chat."""
    scene = None
    while scene is None or scene.number is None:  # a number too wide for the picture is left out: draw again
        width, height = (rng.randint(*CLOSE_UP_SIDES) for _ in range(2))
        scene = random_scene(rng, num_shapes=rng.randint(0, 2), width=width, height=height, number_probability=1.0)
    by_task = scene_questions(scene)
    number = by_task.pop("number")
    others = pick_questions({t: by_task[t] for t in ("colour", "shape") if t in by_task}, rng, 2)
    scale = rng.uniform(*CLOSE_UP_SCALES)
    cap = min(image_config.max_pixels, max(image_config.min_pixels, round(scale ** 2 * width * height)))
    return scene, rng.sample(number + others, 1 + len(others)), cap


def close_up_example(rng: random.Random, tokenizer: Tokenizer, image_config: ImageProcessorConfig,
                     number_fonts: tuple[str, ...] = ()) -> Example:
    scene, qas, cap = number_close_up(rng, image_config)
    other_font(scene, rng, number_fonts)
    image = preprocess_image(render(scene, rng), image_config, max_pixels=cap)
    example = encode_chat(tokenizer, [image], [QA(qa.task, vary(qa.question, rng), qa.answer) for qa in qas])
    example.hints = [token_hints(scene, image)]
    return example


def make_example(rng: random.Random, step: int, cfg: TrainConfig, tokenizer: Tokenizer,
                 image_config: ImageProcessorConfig) -> Example:
    focus = cfg.focus_tasks(step) if stage(step, cfg) == 3 else None
    compare = "compare" in focus if focus else not in_curriculum(step, cfg)
    if focus and "count" in focus and cfg.counting_chats and rng.random() < cfg.counting_chats:
        scene, qas = counting_chat(rng)
        scenes = [scene]
    elif focus and "number" in focus and cfg.number_chats and rng.random() < cfg.number_chats:
        scene, qas = number_chat(rng, focus, cfg.max_turns)
        scenes = [scene]
    elif compare and rng.random() < cfg.compare_fraction:
        scenes = [counting_scene(rng), counting_scene(rng)]
        qas = compare_questions(*scenes)
        if not qas:
            return make_example(rng, step, cfg, tokenizer, image_config)
        qas = rng.sample(qas, min(len(qas), 3))
    else:
        scenes = [focus_scene(rng) if focus else training_scene(rng, step, cfg)]
        by_task = scene_questions(scenes[0])
        qas = (pick_contrasting(by_task, rng, cfg.max_turns, focus) if focus
               else pick_questions(by_task, rng, cfg.max_turns))
        if not qas:
            return make_example(rng, step, cfg, tokenizer, image_config)
    for scene in scenes:
        other_font(scene, rng, cfg.number_fonts)
    images = [preprocess_image(render(scene, rng), image_config, max_pixels=training_cap(rng, image_config))
              for scene in scenes]
    qas = [QA(qa.task, vary(qa.question, rng), qa.answer) for qa in qas]
    example = encode_chat(tokenizer, images, qas)
    example.hints = [token_hints(scene, image) for scene, image in zip(scenes, images)]
    return example


# ---------------------------------------------------------------------------------------------------------
# Hints for the vision tower: what lies under each visual token

DIGIT_SLOTS = 3  # a block's digit hints: the digit centred in its left, middle and right third (each slot is its
# own cross-entropy in `hint_loss`, so the digits weigh three times what the one digit column did before)
HINT_CLASSES = (len(COLOURS) + 1, len(SHAPES) + 2) + (11,) * DIGIT_SLOTS  # colour | shape or text | digits
# Relation hints: for each shape kind and each axis, is the (only) shape of that kind before or after this one?
RELATION_HINTS = 2 * len(SHAPES)  # (kind, axis) pairs, each a two-way choice
COUNT_CLASSES = MAX_COUNT + 1  # how many shapes of the covering shape's kind the picture holds (1..6; 0 unused)
RELATIONS_AT = len(HINT_CLASSES)  # columns of `token_hints`: the classes above, relations, count, centre
COUNT_AT, CENTRE_AT = RELATIONS_AT + RELATION_HINTS, RELATIONS_AT + RELATION_HINTS + 1
HINT_COLUMNS = CENTRE_AT + 1
BACKGROUND_WEIGHT = 0.05  # weight of class 0 ("nothing here") in the hints' loss: most tokens are background
NOT_CENTRE_WEIGHT = 0.2  # weight of "no shape's centre is here" in the centre hint's loss


def token_hints(scene, image) -> torch.Tensor:
    """(visual tokens, HINT_COLUMNS) labels for each token's block of pixels.

    Columns 0-1: the colour and kind (shape, or len(SHAPES)+1 for the printed number) of the shape that covers
    most of the block (at least MIN_COVER of it); 0 where there is nothing. A shape too small to cover MIN_COVER
    of any block still labels the block of its centre. Columns 2 to 2 + DIGIT_SLOTS - 1: the printed digits in
    the block (`number_hints`), digit + 1 per slot, 0 where no digit is.

    Columns RELATIONS_AT to RELATIONS_AT + RELATION_HINTS - 1, on blocks covered by a shape: for each kind k of
    SHAPES, whether the only shape of kind k lies left (0) or right (1) of the covering shape, then the same for
    above (0) or below (1); IGNORE where there is no such shape, or it is not clearly apart (the rule left/right
    questions follow).

    Column COUNT_AT, on blocks covered by a shape: how many shapes of its kind the picture holds (IGNORE elsewhere
    and above MAX_COUNT). Column CENTRE_AT: 1 on the block of each shape's centre, 0 on every other block. Counting
    objects is counting centres of a kind; counting the tokens of a kind would depend on the shapes' sizes. (The
    tower learned the centres but not the counts: the language model counts. Appendix A2, section 5.)"""
    _, gh, gw = image.grid_thw
    rows, cols = gh // image.merge_size, gw // image.merge_size
    hints = torch.zeros(rows * cols, HINT_COLUMNS, dtype=torch.long)
    hints[:, RELATIONS_AT:CENTRE_AT] = IGNORE
    if scene.shapes:
        per_shape = torch.stack([_shape_hints(scene, s) for s in scene.shapes])  # (shapes, HINT_COLUMNS)
        cover, best = _block_cover(scene, rows, cols).max(dim=0)  # per block: the largest cover, and its shape
        covered = cover >= MIN_COVER
        hints[covered] = per_shape[best[covered]]
        block_w, block_h = scene.width / cols, scene.height / rows
        for s, labels in zip(scene.shapes, per_shape):
            centre = min(rows - 1, int(s.y / block_h)) * cols + min(cols - 1, int(s.x / block_w))
            hints[centre] = labels
            hints[centre, CENTRE_AT] = 1
    if scene.number is not None:
        for block, slots in number_hints(scene, rows, cols).items():
            hints[block] = IGNORE
            hints[block, :RELATIONS_AT] = torch.tensor([0, len(SHAPES) + 1] + slots)
            hints[block, CENTRE_AT] = 0
    return hints  # token order: blocks row by row, as the projector emits them


def number_hints(scene, rows: int, cols: int) -> dict[int, list[int]]:
    """The blocks the printed number shows in, each with its DIGIT_SLOTS labels: digit + 1 in the slot (third of
    the block's width) that the digit's centre falls in, 0 elsewhere. The number shows in a block when it covers
    at least half of the block's height or half of its own height, whichever is less (a small number shows in
    one row of blocks, a tall one in several), and the same across: a block that a wide digit's strokes fill but
    whose centre lies in the next block is text with no digit centred in it. Digits are taken as equally wide,
    which the fonts nearly are. Small digits matter most here: two or three of them can share one block, and
    none may cover the block's centre. (Digits narrower than a third of a block, about 8 pixels tall and less,
    can share a slot: the last one is kept.)"""
    left, top, right, bottom = scene.number_box
    block_w, block_h = scene.width / cols, scene.height / rows
    digit_w = (right - left) / len(scene.number)

    def shows(start, end, size, low, high):  # does the span start..end cover enough of the block low..high?
        return min(end, high) - max(start, low) >= 0.5 * min(end - start, size)

    # The labels of one row of blocks, the same in every row the number shows in: column -> slots.
    by_column = {c: [0] * DIGIT_SLOTS for c in range(cols)
                 if shows(left, right, block_w, c * block_w, (c + 1) * block_w)}
    for i, digit in enumerate(scene.number):
        x = left + (i + 0.5) * digit_w  # the digit's centre
        c = min(cols - 1, int(x / block_w))
        slot = min(DIGIT_SLOTS - 1, int((x - c * block_w) / block_w * DIGIT_SLOTS))
        by_column.setdefault(c, [0] * DIGIT_SLOTS)[slot] = int(digit) + 1
    rows_shown = [r for r in range(rows) if shows(top, bottom, block_h, r * block_h, (r + 1) * block_h)]
    return {r * cols + c: list(slots) for r in rows_shown for c, slots in by_column.items()}


MIN_COVER = 0.3  # the share of a token's block a shape must cover to label it


def _block_cover(scene, rows: int, cols: int) -> torch.Tensor:
    """(shapes, rows * cols): the share of each token's block that each shape covers."""
    mask = shape_mask(scene)
    ids = torch.frombuffer(bytearray(mask.tobytes()), dtype=torch.uint8).view(1, scene.height, scene.width)
    one_hot = (ids == torch.arange(1, len(scene.shapes) + 1).view(-1, 1, 1)).float()  # (shapes, height, width)
    return F.adaptive_avg_pool2d(one_hot, (rows, cols)).view(len(scene.shapes), rows * cols)


def _shape_hints(scene, shape) -> torch.Tensor:
    """The hints of a block covered by `shape`: its colour and kind, no digit, where the other shapes are, how many
    of its kind there are, and not a centre (token_hints marks the centre's block)."""
    relations = [IGNORE] * RELATION_HINTS
    unique = scene.unique("kind")
    for axis_index, axis in enumerate(("x", "y")):
        for k, kind in enumerate(SHAPES):
            other = unique.get(kind)
            if other is not None and other is not shape and clearly_apart(shape, other, axis):
                relations[axis_index * len(SHAPES) + k] = int(getattr(other, axis) > getattr(shape, axis))
    count = scene.count(shape.kind)
    return torch.tensor([COLOURS.index(shape.colour) + 1, SHAPES.index(shape.kind) + 1] + [0] * DIGIT_SLOTS
                        + relations + [count if count <= MAX_COUNT else IGNORE, 0])


def make_batch(step: int, cfg: TrainConfig, tokenizer: Tokenizer, image_config: ImageProcessorConfig) -> list[Example]:
    """The batch of a step depends only on (seed, step): a resumed run sees the same data."""
    rng = random.Random(cfg.seed * 1_000_003 + step)
    batch = [make_example(rng, step, cfg, tokenizer, image_config) for _ in range(cfg.batch_size)]
    return batch + [close_up_example(rng, tokenizer, image_config, cfg.number_fonts)
                    for _ in range(cfg.number_close_ups)]


# ---------------------------------------------------------------------------------------------------------
# The forward pass over a padded batch


class PackedCausalAttention:
    """Attention backend for training: several chats packed end to end, causal within each, no cache.

    On a CPU, like the vision tower's per-image attention: one attention call per chat (the engine's own
    `causal_attention`, which the dense reference uses too), so no chat pays for another's length.
    fused=True (the default on a GPU) attends every chat in one call with a block-diagonal causal mask instead:
    more arithmetic, since every token is scored against every other and masked, but one call per layer instead
    of one per chat. A GPU step of small kernels is bound by launching them, not by their arithmetic."""

    def __init__(self, lengths: list[int], fused: bool = False):
        self.lengths, self.fused = lengths, fused
        self.mask: torch.Tensor | None = None  # the fused call's (tokens, tokens) mask, made once per batch

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return self._attend_together(q, k, v)
        chats = zip(*(x.split(self.lengths) for x in (q, k, v)))  # per chat: (n, heads or kv_heads, head_dim)
        return torch.cat([causal_attention(*chat) for chat in chats])

    def _attend_together(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q (tokens, heads, head_dim); k, v (tokens, kv_heads, head_dim) -> (tokens, heads, head_dim)."""
        if self.mask is None:
            lengths = torch.tensor(self.lengths, device=q.device)
            chat = torch.repeat_interleave(torch.arange(len(self.lengths), device=q.device), lengths)  # (tokens,)
            place = torch.arange(chat.numel(), device=q.device)
            self.mask = (chat[:, None] == chat[None, :]) & (place[:, None] >= place[None, :])  # own chat, not later
        return masked_attention(q, k, v, self.mask)


def batch_loss(model: Qwen2VL, batch: list[Example], heads: torch.nn.ModuleDict | None = None,
               hint_weight: float = 0.0, vision_only: bool = False, position_weight: float = 0.0,
               fused_attention: bool | None = None) -> tuple[torch.Tensor, dict[str, tuple[int, int]]]:
    """Mean cross-entropy over answer tokens, and per task (first answer tokens right, answers). With the
    training heads (trainer.new_heads): plus hint_weight x the hints' loss and position_weight x the position
    loss, and each hint's accuracy on the tokens it labels.

    vision_only: stage 1, the tower and the hint head alone (the hints' loss, no language model).
    fused_attention: the chats' attention in one call per layer (`PackedCausalAttention`); default on a GPU."""
    cfg, device = model.config, model.device
    grids = [[tuple(im.grid_thw) for im in ex.images] for ex in batch]
    pixels = torch.cat([im.pixel_values for ex in batch for im in ex.images]).to(device)
    image_embeds = torch.cat(model.encode_images(pixels, [g for chat in grids for g in chat]))  # (vis. tokens, hidden)
    with_hints = heads is not None and (vision_only or hint_weight)
    hints = torch.cat([h for ex in batch for h in ex.hints]).to(device) if with_hints else None  # (vis. tokens, HINT_COLUMNS)
    if vision_only:
        return hint_loss(heads["hints"](image_embeds).float(), hints)
    ids = torch.tensor([t for ex in batch for t in ex.token_ids], device=device)  # (total tokens,): chats end to end
    # Position t predicts token t+1: each chat's labels shifted left by one, its last position predicts nothing.
    targets = torch.tensor([t for ex in batch for t in ex.labels[1:] + [IGNORE]], device=device)
    positions = torch.cat([mrope_positions(ex.token_ids, g, cfg.image_token_id, cfg.vision.spatial_merge_size)[0]
                           for ex, g in zip(batch, grids)], dim=1).to(device)  # (3, total tokens)
    attention = PackedCausalAttention([len(ex.token_ids) for ex in batch],
                                      fused=device.type == "cuda" if fused_attention is None else fused_attention)
    middle, layers = {}, model.language_model.layers  # the output of layer POSITION_LAYER, for the position loss
    hook = layers[POSITION_LAYER].register_forward_hook(lambda m, i, out: middle.update(x=out)) if heads else None
    hidden = model(ids, positions, attention, image_embeds, ids == cfg.image_token_id)  # (total tokens, hidden)
    if hook is not None:
        hook.remove()
    rows = (targets != IGNORE).nonzero().squeeze(1)
    logits = model.compute_logits(hidden[rows]).float()
    loss = F.cross_entropy(logits, targets[rows])
    accuracy = _first_token_accuracy(batch, rows, logits.argmax(-1) == targets[rows])
    if heads is not None and position_weight:
        position = heads["position"](middle["x"][ids == cfg.image_token_id]).float()  # (visual tokens, 2)
        places = image_token_places([g for chat in grids for g in chat], cfg.vision.spatial_merge_size)
        loss = loss + position_weight * F.mse_loss(position, places.to(device))
    if with_hints:
        hints_loss, hint_accuracy = hint_loss(heads["hints"](image_embeds).float(), hints)
        loss = loss + hint_weight * hints_loss
        accuracy |= hint_accuracy
    return loss, accuracy


HINT_OUTPUTS = sum(HINT_CLASSES) + 2 * RELATION_HINTS + COUNT_CLASSES + 2  # the hint head's width
POSITION_LAYER = 1  # the position loss reads the output of this decoder layer (the second of four)


def image_token_places(grids: list[tuple[int, int, int]], merge_size: int) -> torch.Tensor:
    """(visual tokens, 2): each image token's column and row in its picture, from -0.5 (left, top) to 0.5.

    The position loss: the language model's middle layer must know where each image token lies. The vision
    tower cannot say (its attention sees only offsets between patches, so on a plain background every place
    looks the same); the language model can, from M-RoPE: an image token at (row, column) sits (row + 1,
    column + 1) positions after <|vision_start|>. Then "left of" is a comparison of two places."""
    return torch.cat([_token_places(h // merge_size, w // merge_size) for _, h, w in grids])


@functools.lru_cache(maxsize=1024)
def _token_places(rows: int, cols: int) -> torch.Tensor:
    """(rows * cols, 2) for one picture's token grid (kept: a batch's pictures share a few grid sizes). Read only."""
    row, col = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")  # (rows, cols) each
    return torch.stack([(col.flatten() + 0.5) / cols, (row.flatten() + 0.5) / rows], dim=1) - 0.5


def hint_loss(scores: torch.Tensor, hints: torch.Tensor) -> tuple[torch.Tensor, dict[str, tuple[int, int]]]:
    """scores (visual tokens, HINT_OUTPUTS), hints (visual tokens, HINT_COLUMNS): one cross-entropy per kind of
    hint (background down-weighted), and each one's accuracy on the tokens it labels (not background)."""
    *classes, relations, count, centre = scores.split(HINT_CLASSES + (2 * RELATION_HINTS, COUNT_CLASSES, 2), dim=1)
    names = ("colour", "kind") + tuple(f"digit {i}" for i in range(DIGIT_SLOTS))
    total, accuracy = 0.0, {}
    for i, (name, part) in enumerate(zip(names, classes)):
        weight = torch.ones(part.shape[1], device=part.device)
        weight[0] = BACKGROUND_WEIGHT
        total = total + F.cross_entropy(part, hints[:, i], weight=weight)
        right = (part.argmax(1) == hints[:, i])[hints[:, i] != 0]
        key = f"hint {name.split()[0]}"  # the digit slots count together, as "hint digit"
        hits, seen = accuracy.get(key, (0, 0))
        accuracy[key] = (hits + int(right.sum()), seen + right.numel())
    relations = relations.reshape(-1, 2)  # (tokens * RELATION_HINTS, 2): before or after
    relation_labels, count_labels, centre_labels = (hints[:, RELATIONS_AT:COUNT_AT].reshape(-1), hints[:, COUNT_AT],
                                                    hints[:, CENTRE_AT])
    # name: (scores, labels, class weights, the tokens its accuracy is measured on)
    named = {"relation": (relations, relation_labels, None, relation_labels != IGNORE),
             "count": (count, count_labels, None, count_labels != IGNORE),
             "centre": (centre, centre_labels, torch.tensor([NOT_CENTRE_WEIGHT, 1.0], device=centre.device),
                        centre_labels == 1)}
    for name, (part, labels, weight, scored) in named.items():
        if (labels != IGNORE).any():
            total = total + F.cross_entropy(part, labels, weight=weight, ignore_index=IGNORE)
        right = (part.argmax(1) == labels)[scored]
        accuracy[f"hint {name}"] = (int(right.sum()), right.numel())
    return total, accuracy


def _first_token_accuracy(batch, rows, correct) -> dict[str, tuple[int, int]]:
    """Per task: how often the first token of the answer was the argmax (teacher-forced). A cheap live signal."""
    stats: dict[str, list[int]] = {task: [0, 0] for task in TASKS}
    by_row, offset = dict(zip(rows.tolist(), correct.tolist())), 0
    for ex in batch:
        starts = [t - 1 for t in range(1, len(ex.labels)) if ex.labels[t] != IGNORE and ex.labels[t - 1] == IGNORE]
        for task, t in zip(ex.tasks, starts):
            stats[task][0] += by_row[offset + t]
            stats[task][1] += 1
        offset += len(ex.token_ids)
    return {task: (right, total) for task, (right, total) in stats.items() if total}
