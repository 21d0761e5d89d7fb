"""An independent picture generator, for checking the demo model off its training pictures.

The demo model is trained on pictures drawn by ``nanomm/demo/scenes.py``.  Its accuracy
claims must also hold on pictures drawn by *other* code: other renderers, outlines,
picture sizes, backgrounds and JPEG artefacts.  This module is that other code.  It was
written without looking at ``scenes.py`` and shares no drawing code with it.

Each item is one or two pictures plus a question in the demo's English forms and its exact
answer.  Pictures are drawn with plain Pillow (stdlib + PIL only, no numpy) and vary in:

* size: width and height each 200..512 px, independently;
* background: white, light gray/beige, dark, a vertical gradient, or light with thin lines;
* colour: each colour name is drawn as one of several CSS shades (``COLOUR_SHADES``),
  always contrasting with the background under the object;
* drawing: some objects have a dark outline, some are antialiased (drawn at 4x, then
  downscaled with LANCZOS), the rest are drawn aliased; numbers use DejaVu fonts;
* degradation: some pictures are slightly blurred and/or saved and reloaded as JPEG.

Everything is deterministic from ``(task, n, seed)``.  Used by ``scripts/eval_demo.py``
(the out-of-distribution accuracy check) and by the tests::

    items = external_items("colour", n=30, seed=0)
    items[0].images, items[0].question, items[0].answer

Run ``python -m workshop.other_renderer OUTDIR`` from scripts/ to write a few example PNGs.
"""

from __future__ import annotations

import io
import math
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from PIL import Image, ImageColor, ImageDraw, ImageFilter, ImageFont

TASKS = ("colour", "shape", "count", "left_right", "above_below", "number", "compare")
SHAPES = ("circle", "square", "triangle", "star")

COLOUR_SHADES = {
    "red": ("red", "crimson", (220, 0, 0)),
    "green": ("green", "lime", "forestgreen", "limegreen"),
    "blue": ("blue", "mediumblue", "royalblue", "dodgerblue", "navy"),
    "yellow": ("yellow", "gold"),
    "orange": ("orange", "darkorange"),
    "purple": ("purple", "darkviolet", "blueviolet", "rebeccapurple"),
    "pink": ("pink", "hotpink", "deeppink", "lightpink"),
    "brown": ("brown", "saddlebrown", "sienna"),
    "black": ("black",),
    "white": ("white",),
    "gray": ("gray", "darkgray", "dimgray", "silver"),
}
COLOURS = tuple(COLOUR_SHADES)

FONT_DIR = Path("/usr/share/fonts/truetype/dejavu")
FONT_FILES = ("DejaVuSans.ttf", "DejaVuSans-Bold.ttf", "DejaVuSerif.ttf", "DejaVuSansMono.ttf")

MIN_SIDE, MAX_SIDE = 200, 512
SIZE_FRACTION = (0.06, 0.18)  # object size as a fraction of the picture's shorter side
MIN_SIZE_PX = 10
# Circumradius over size: circle radius = size, square half-side = size; triangles and
# stars get a slightly larger circumradius so they are not much smaller than the others.
EXTENT_FACTOR = {"circle": 1.0, "square": math.sqrt(2.0), "triangle": 1.2, "star": 1.25}
STAR_INNER_RATIO = 0.42
GAP_PX = 4  # empty space kept between objects, and between objects and the number
BORDER_PX = 2
MIN_CONTRAST = 120  # RGB distance between an object's colour and the background under it
TEXT_CONTRAST = 200  # RGB distance between the number's colour and the background
CLEAR_APART = 0.5  # left/right, above/below: centre gap >= this x (sum of circumradii)

OUTLINE_SHADES = ((0, 0, 0), (30, 30, 30), (47, 79, 79), (25, 25, 60))
TEXT_SHADES = ((0, 0, 0), (20, 20, 20), (0, 0, 110), (110, 0, 0), (255, 255, 255), (245, 245, 200))
BACKGROUND_KINDS = ("white", "light", "dark", "gradient", "lines")

PLACE_TRIES = 300
SCENE_TRIES = 300


@dataclass(frozen=True)
class ExternalItem:
    """One question about one or two pictures, with its exact answer."""

    task: str  # one of TASKS
    images: tuple  # tuple of PIL.Image.Image (RGB), 1 or 2 pictures
    question: str
    answer: str


@dataclass(frozen=True)
class _Spec:
    """What one object must be: its shape and the colour names it may take."""

    shape: str
    colours: tuple


@dataclass(frozen=True)
class _Spot:
    """Where one object sits: centre and size (radius / half-side) in pixels."""

    x: float
    y: float
    size: float


@dataclass(frozen=True)
class _Object:
    """A fully decided object, ready to draw."""

    shape: str
    colour: str
    rgb: tuple
    spot: _Spot
    outline: Optional[tuple]
    outline_width: int
    smooth: bool


# ----------------------------------------------------------------------------- public API


def external_items(task: str, n: int, seed: int = 0) -> list[ExternalItem]:
    """n items of one task, deterministic for (task, n, seed).

    Answers are balanced: each possible answer (or, for ``number``, each digit count)
    occurs n / (number of answers) times, rounded, in shuffled order.
    """
    if task not in _BUILDERS:
        raise ValueError(f"unknown task {task!r}; expected one of {TASKS}")
    build, options = _BUILDERS[task]
    answers = _balanced(random.Random(f"other_renderer:{task}:{seed}:answers"), options, n)
    return [build(random.Random(f"other_renderer:{task}:{seed}:{i}"), answer) for i, answer in enumerate(answers)]


def _balanced(rng: random.Random, options: tuple, n: int) -> list:
    """n picks from options, each option equally often, shuffled block by block."""
    picks: list = []
    while len(picks) < n:
        block = list(options)
        rng.shuffle(block)
        picks.extend(block)
    return picks[:n]


# ----------------------------------------------------------------------------- task builders


def _colour_item(rng: random.Random, colour: str) -> ExternalItem:
    shape = rng.choice(SHAPES)
    others = [s for s in SHAPES if s != shape]
    specs = [_Spec(shape, (colour,))] + _distractors(rng, others, COLOURS, 0, 3)
    image = _picture(rng, specs)
    return ExternalItem("colour", (image,), f"What colour is the {shape}?", colour)


def _shape_item(rng: random.Random, shape: str) -> ExternalItem:
    colour = rng.choice(COLOURS)
    other_colours = tuple(c for c in COLOURS if c != colour)
    specs = [_Spec(shape, (colour,))] + _distractors(rng, SHAPES, other_colours, 0, 3)
    image = _picture(rng, specs)
    return ExternalItem("shape", (image,), f"What shape is the {colour} object?", shape)


def _count_item(rng: random.Random, answer: str) -> ExternalItem:
    count = int(answer)
    shape = rng.choice(SHAPES)
    image = _picture(rng, _counted_specs(rng, shape, count, 3))
    return ExternalItem("count", (image,), f"How many {shape}s are there?", answer)


def _left_right_item(rng: random.Random, answer: str) -> ExternalItem:
    first, second, specs = _pair_specs(rng)
    image = _picture(rng, specs, arrange=_arrange_pair(axis=0, first_lower=answer == "left"))
    return ExternalItem("left_right", (image,), f"Is the {first} left or right of the {second}?", answer)


def _above_below_item(rng: random.Random, answer: str) -> ExternalItem:
    first, second, specs = _pair_specs(rng)
    image = _picture(rng, specs, arrange=_arrange_pair(axis=1, first_lower=answer == "above"))
    return ExternalItem("above_below", (image,), f"Is the {first} above or below the {second}?", answer)


def _number_item(rng: random.Random, digits: int) -> ExternalItem:
    number = str(rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10**digits - 1))
    specs = _distractors(rng, SHAPES, COLOURS, 0, 2)
    image = _picture(rng, specs, number=number)
    return ExternalItem("number", (image,), "What number is written in the picture?", number)


def _compare_item(rng: random.Random, answer: str) -> ExternalItem:
    shape = rng.choice(SHAPES)
    fewer, more = sorted(rng.sample(range(6), 2))
    counts = (more, fewer) if answer == "first" else (fewer, more)
    images = tuple(_picture(rng, _counted_specs(rng, shape, k, 2)) for k in counts)
    return ExternalItem("compare", images, f"Which picture has more {shape}s, the first or the second?", answer)


def _distractors(rng: random.Random, shapes, colours: tuple, low: int, high: int) -> list[_Spec]:
    """Between low and high objects with shapes from `shapes`, any colour from `colours`."""
    return [_Spec(rng.choice(list(shapes)), colours) for _ in range(rng.randint(low, high))]


def _counted_specs(rng: random.Random, shape: str, count: int, max_distractors: int) -> list[_Spec]:
    """count objects of shape plus distractors of other shapes (at least one if count is 0)."""
    others = [s for s in SHAPES if s != shape]
    return [_Spec(shape, COLOURS)] * count + _distractors(rng, others, COLOURS, int(count == 0), max_distractors)


def _pair_specs(rng: random.Random) -> tuple[str, str, list[_Spec]]:
    """Two different shapes, each appearing once, plus distractors of the other shapes."""
    first, second = rng.sample(SHAPES, 2)
    others = [s for s in SHAPES if s not in (first, second)]
    specs = [_Spec(first, COLOURS), _Spec(second, COLOURS)] + _distractors(rng, others, COLOURS, 0, 2)
    return first, second, specs


_BUILDERS = {
    "colour": (_colour_item, COLOURS),
    "shape": (_shape_item, SHAPES),
    "count": (_count_item, tuple(str(k) for k in range(7))),
    "left_right": (_left_right_item, ("left", "right")),
    "above_below": (_above_below_item, ("above", "below")),
    "number": (_number_item, (1, 2, 3)),
    "compare": (_compare_item, ("first", "second")),
}


# ----------------------------------------------------------------------------- one picture

Arrange = Callable[[list[_Spec], list[_Spot], tuple], Optional[list[_Spot]]]


def _picture(
    rng: random.Random, specs: list[_Spec], arrange: Optional[Arrange] = None, number: Optional[str] = None
) -> Image.Image:
    """Draw one picture with the given objects (and number), retrying until every rule holds."""
    for _ in range(SCENE_TRIES):
        picture = _try_picture(rng, specs, arrange, number)
        if picture is not None:
            return _degrade(rng, picture)
    raise RuntimeError(f"could not lay out {len(specs)} objects (number={number!r})")


def _try_picture(rng, specs, arrange, number) -> Optional[Image.Image]:
    size = (rng.randint(MIN_SIDE, MAX_SIDE), rng.randint(MIN_SIDE, MAX_SIDE))
    base, picture = _background(rng, size)
    keep_out = _write_number(rng, picture, base, number) if number is not None else None
    if number is not None and keep_out is None:
        return None
    spots = _place(rng, specs, size, keep_out)
    if spots is not None and arrange is not None:
        spots = arrange(specs, spots, size)
    if spots is None:
        return None
    objects = [_decide_object(rng, spec, spot, base) for spec, spot in zip(specs, spots)]
    if any(obj is None for obj in objects):
        return None
    for obj in objects:
        _draw_object(picture, obj)
    return picture


def _extent(shape: str, size: float) -> float:
    """Radius of the circle around the drawn shape."""
    return size * EXTENT_FACTOR[shape]


def _object_sizes(rng: random.Random, specs: list[_Spec], short: int) -> list[float]:
    """Random sizes; busy pictures get smaller objects so that they still fit."""
    low, high = SIZE_FRACTION
    high = max(low + 0.01, min(high, high * math.sqrt(3 / max(len(specs), 1))))
    return [max(MIN_SIZE_PX, rng.uniform(low, high) * short) for _ in specs]


def _place(rng, specs: list[_Spec], size: tuple, keep_out) -> Optional[list[_Spot]]:
    """Non-overlapping spots inside the picture and outside keep_out, or None."""
    spots: list[_Spot] = []
    taken: list[tuple] = []  # (x, y, circumradius)
    for spec, object_size in zip(specs, _object_sizes(rng, specs, min(size))):
        radius = _extent(spec.shape, object_size)
        centre = _free_centre(rng, radius, taken, size, keep_out)
        if centre is None:
            return None
        taken.append((*centre, radius))
        spots.append(_Spot(centre[0], centre[1], object_size))
    return spots


def _free_centre(rng, radius: float, taken: list, size: tuple, keep_out) -> Optional[tuple]:
    margin = radius + BORDER_PX
    if 2 * margin >= min(size):
        return None
    for _ in range(PLACE_TRIES):
        x, y = rng.uniform(margin, size[0] - margin), rng.uniform(margin, size[1] - margin)
        clear = all(math.hypot(x - tx, y - ty) >= radius + tr + GAP_PX for tx, ty, tr in taken)
        if clear and not _circle_hits_box(x, y, radius + GAP_PX, keep_out):
            return x, y
    return None


def _circle_hits_box(x: float, y: float, radius: float, box) -> bool:
    if box is None:
        return False
    nearest_x = min(max(x, box[0]), box[2])
    nearest_y = min(max(y, box[1]), box[3])
    return math.hypot(x - nearest_x, y - nearest_y) < radius


def _arrange_pair(axis: int, first_lower: bool) -> Arrange:
    """Make objects 0 and 1 clearly apart along axis (0 = x, 1 = y), mirroring the
    whole layout if needed so that object 0 has the lower coordinate iff first_lower."""

    def arrange(specs: list[_Spec], spots: list[_Spot], size: tuple) -> Optional[list[_Spot]]:
        a, b = spots[0], spots[1]
        gap = (b.x - a.x) if axis == 0 else (b.y - a.y)
        needed = CLEAR_APART * (_extent(specs[0].shape, a.size) + _extent(specs[1].shape, b.size))
        if abs(gap) < needed:
            return None
        if (gap > 0) == first_lower:
            return spots
        return [_mirror(spot, axis, size) for spot in spots]

    return arrange


def _mirror(spot: _Spot, axis: int, size: tuple) -> _Spot:
    if axis == 0:
        return _Spot(size[0] - spot.x, spot.y, spot.size)
    return _Spot(spot.x, size[1] - spot.y, spot.size)


# ----------------------------------------------------------------------------- colours


def _rgb(shade) -> tuple:
    return ImageColor.getrgb(shade) if isinstance(shade, str) else tuple(shade)


def _distance(a: tuple, b: tuple) -> float:
    return math.sqrt(sum((p - q) ** 2 for p, q in zip(a[:3], b[:3])))


def _background_under(base: Image.Image, box: tuple) -> list[tuple]:
    """Background colours on a 3x3 grid over box (clipped to the picture)."""
    left, top, right, bottom = box
    xs = [min(max(int(left + (right - left) * t), 0), base.width - 1) for t in (0, 0.5, 1)]
    ys = [min(max(int(top + (bottom - top) * t), 0), base.height - 1) for t in (0, 0.5, 1)]
    return [base.getpixel((x, y)) for x in xs for y in ys]


def _contrasting(shades, under: list[tuple], threshold: float) -> list[tuple]:
    return [rgb for rgb in map(_rgb, shades) if min(_distance(rgb, c) for c in under) >= threshold]


def _pick_colour(rng, names: tuple, under: list[tuple]) -> Optional[tuple]:
    """(name, rgb) for a random allowed colour name with a shade that stands out, or None."""
    for name in rng.sample(list(names), len(names)):
        shades = _contrasting(COLOUR_SHADES[name], under, MIN_CONTRAST)
        if shades:
            return name, rng.choice(shades)
    return None


def _decide_object(rng, spec: _Spec, spot: _Spot, base: Image.Image) -> Optional[_Object]:
    r = _extent(spec.shape, spot.size)
    picked = _pick_colour(rng, spec.colours, _background_under(base, (spot.x - r, spot.y - r, spot.x + r, spot.y + r)))
    if picked is None:
        return None
    outline = rng.choice(OUTLINE_SHADES) if rng.random() < 0.35 else None
    width = rng.randint(2, max(2, min(4, int(spot.size // 5)))) if outline else 0
    return _Object(spec.shape, picked[0], picked[1], spot, outline, width, smooth=rng.random() < 0.3)


# ----------------------------------------------------------------------------- backgrounds


def _background(rng: random.Random, size: tuple) -> tuple[Image.Image, Image.Image]:
    """(base, picture): base is the plain background used for contrast checks; picture is
    the same plus any thin decorative lines, and is what objects get drawn on."""
    kind = rng.choice(BACKGROUND_KINDS)
    if kind == "gradient":
        base = _gradient(rng, size)
    else:
        base = Image.new("RGB", size, _plain_colour(rng, kind))
    picture = base.copy()
    if kind == "lines":
        _draw_thin_lines(rng, picture)
    return base, picture


def _plain_colour(rng: random.Random, kind: str) -> tuple:
    if kind == "white":
        return (255, 255, 255)
    if kind == "dark":
        return rng.choice(((rng.randint(0, 25),) * 3, (0, 0, rng.randint(50, 90)), (15, 20, 45)))
    grey = rng.randint(215, 240)
    return rng.choice(((grey, grey, grey), (245, 245, 220), (240, 234, 214), (250, 240, 230)))


def _gradient(rng: random.Random, size: tuple) -> Image.Image:
    top, bottom = _gradient_end(rng), _gradient_end(rng)
    image = Image.new("RGB", size)
    draw = ImageDraw.Draw(image)
    for y in range(size[1]):
        t = y / max(size[1] - 1, 1)
        draw.line([(0, y), (size[0], y)], fill=tuple(round(a + (b - a) * t) for a, b in zip(top, bottom)))
    return image


def _gradient_end(rng: random.Random) -> tuple:
    low, high = (195, 255) if rng.random() < 0.6 else (0, 60)
    return tuple(rng.randint(low, high) for _ in range(3))


def _pale(rng: random.Random) -> tuple:
    return tuple(rng.randint(150, 210) for _ in range(3))


def _draw_thin_lines(rng: random.Random, picture: Image.Image) -> None:
    draw = ImageDraw.Draw(picture)
    width, height = picture.size
    if rng.random() < 0.5:
        step, colour = rng.randint(16, 48), _pale(rng)
        for x in range(rng.randint(0, step), width, step):
            draw.line([(x, 0), (x, height)], fill=colour, width=1)
        for y in range(rng.randint(0, step), height, step):
            draw.line([(0, y), (width, y)], fill=colour, width=1)
        return
    for _ in range(rng.randint(3, 8)):
        points = [(rng.uniform(0, width), rng.uniform(0, height)) for _ in range(rng.randint(2, 6))]
        draw.line(points, fill=_pale(rng), width=rng.randint(1, 2))


# ----------------------------------------------------------------------------- drawing


def _draw_object(picture: Image.Image, obj: _Object) -> None:
    if obj.smooth:
        _draw_antialiased(picture, obj)
    else:
        _draw_shape(ImageDraw.Draw(picture), obj, obj.spot.x, obj.spot.y, scale=1)


def _draw_antialiased(picture: Image.Image, obj: _Object, factor: int = 4) -> None:
    """Draw at factor x on a transparent patch, downscale with LANCZOS, paste."""
    reach = _extent(obj.shape, obj.spot.size) + 3
    left, top = math.floor(obj.spot.x - reach), math.floor(obj.spot.y - reach)
    side = math.ceil(2 * reach) + 2
    patch = Image.new("RGBA", (side * factor, side * factor), (0, 0, 0, 0))
    _draw_shape(ImageDraw.Draw(patch), obj, (obj.spot.x - left) * factor, (obj.spot.y - top) * factor, scale=factor)
    patch = patch.resize((side, side), Image.Resampling.LANCZOS)
    picture.paste(patch, (left, top), patch)


def _draw_shape(draw: ImageDraw.ImageDraw, obj: _Object, cx: float, cy: float, scale: int) -> None:
    size = obj.spot.size * scale
    radius = _extent(obj.shape, obj.spot.size) * scale
    style = {"fill": obj.rgb}
    if obj.outline is not None:
        style.update(outline=obj.outline, width=obj.outline_width * scale)
    if obj.shape == "circle":
        draw.ellipse((cx - size, cy - size, cx + size, cy + size), **style)
    elif obj.shape == "square":
        draw.regular_polygon((cx, cy, radius), 4, rotation=0, **style)  # axis-aligned
    elif obj.shape == "triangle":
        draw.regular_polygon((cx, cy, radius), 3, rotation=0, **style)  # points up
    else:
        draw.polygon(_star_points(cx, cy, radius), **style)


def _star_points(cx: float, cy: float, radius: float) -> list[tuple]:
    """Five-pointed star, one point straight up, alternating outer and inner corners."""
    points = []
    for k in range(10):
        r = radius if k % 2 == 0 else radius * STAR_INNER_RATIO
        angle = -math.pi / 2 + k * math.pi / 5
        points.append((cx + r * math.cos(angle), cy + r * math.sin(angle)))
    return points


def _write_number(rng, picture: Image.Image, base: Image.Image, number: str) -> Optional[tuple]:
    """Print number somewhere on picture; return its ink box, or None if it did not fit."""
    font = _number_font(rng, number, min(picture.size))
    ink = font.getbbox(number)
    ink_w, ink_h = ink[2] - ink[0], ink[3] - ink[1]
    if ink_w + 2 * GAP_PX >= picture.width or ink_h + 2 * GAP_PX >= picture.height:
        return None
    x = rng.randint(GAP_PX, picture.width - ink_w - GAP_PX)
    y = rng.randint(GAP_PX, picture.height - ink_h - GAP_PX)
    box = (x, y, x + ink_w, y + ink_h)
    shades = _contrasting(TEXT_SHADES, _background_under(base, box), TEXT_CONTRAST)
    if not shades:
        return None
    draw = ImageDraw.Draw(picture)
    draw.fontmode = "1" if rng.random() < 0.25 else "L"  # sometimes aliased text
    draw.text((x - ink[0], y - ink[1]), number, font=font, fill=rng.choice(shades))
    return box


def _number_font(rng: random.Random, number: str, short: int) -> ImageFont.FreeTypeFont:
    """A DejaVu font whose digits are 7%..20% of short tall (at least 12 px)."""
    path = FONT_DIR / rng.choice(FONT_FILES)
    target = max(12.0, rng.uniform(0.07, 0.20) * short)
    font_size = max(8, round(target / 0.73))  # DejaVu digits are about 0.73 em tall
    font = ImageFont.truetype(str(path), font_size)
    while _ink_height(font, number) < 12:
        font_size += 1
        font = ImageFont.truetype(str(path), font_size)
    return font


def _ink_height(font: ImageFont.FreeTypeFont, text: str) -> int:
    box = font.getbbox(text)
    return box[3] - box[1]


def _degrade(rng: random.Random, picture: Image.Image) -> Image.Image:
    """Sometimes a slight blur, sometimes a JPEG round trip."""
    if rng.random() < 0.3:
        picture = picture.filter(ImageFilter.GaussianBlur(rng.uniform(0.3, 1.0)))
    if rng.random() < 0.35:
        picture = _jpeg_round_trip(picture, rng.randint(40, 90))
    return picture


def _jpeg_round_trip(picture: Image.Image, quality: int) -> Image.Image:
    buffer = io.BytesIO()
    picture.save(buffer, format="JPEG", quality=quality)
    buffer.seek(0)
    return Image.open(buffer).convert("RGB")


# ----------------------------------------------------------------------------- examples


def write_examples(out_dir: Path, per_task: int = 3, seed: int = 0) -> None:
    """Save a few items of every task as PNGs in out_dir and print their Q/A."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for task in TASKS:
        for i, item in enumerate(external_items(task, per_task, seed)):
            names = [f"{task}_{i}_{j}.png" for j in range(len(item.images))]
            for name, image in zip(names, item.images):
                image.save(out_dir / name)
            print(f"{' + '.join(names)}: {item.question} -> {item.answer}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m workshop.other_renderer OUT_DIR")
    write_examples(Path(sys.argv[1]))
