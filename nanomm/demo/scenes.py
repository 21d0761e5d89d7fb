"""Scenes for the demo model: simple shapes in named colours, drawn with PIL, with what is in them written down.

Lesson: lessons/A2-how-the-demo-model-was-made.md.

A `Scene` is the truth (which shapes, which colours, where, which number); `render` turns it into a picture.
They are separate on purpose: questions and answers are computed from the scene, never from pixels, and one
scene can be drawn many ways. Training draws with augmentation (outlines, hollow shapes, anti-aliasing or
not, blur, JPEG, noise, gradients, sizes, aspect ratios) so that the model learns "a red circle", not one
renderer's edges. Everything is seeded: the same `random.Random` state gives the same scene and picture.
"""

from __future__ import annotations

import functools
import io
import math
import random
from dataclasses import dataclass, field

from PIL import Image, ImageChops, ImageDraw, ImageFilter, ImageFont

SHAPES = ("circle", "square", "triangle", "star")

# Each colour name and shades people call by it (CSS/X11 colours and a few more). A drawn colour is one of
# these, jittered; the names are what the model answers.
PALETTE: dict[str, tuple[tuple[int, int, int], ...]] = {
    "red": ((255, 0, 0), (220, 20, 60), (205, 20, 20), (235, 45, 35), (200, 0, 30)),
    "green": ((0, 128, 0), (0, 255, 0), (34, 139, 34), (50, 205, 50), (0, 100, 0), (46, 139, 87), (0, 200, 0)),
    "blue": ((0, 0, 255), (0, 0, 139), (0, 0, 128), (65, 105, 225), (30, 144, 255), (0, 0, 205), (70, 130, 180)),
    "yellow": ((255, 255, 0), (255, 215, 0), (255, 236, 60), (240, 230, 40), (255, 255, 102)),
    "orange": ((255, 165, 0), (255, 140, 0), (255, 127, 0), (255, 117, 24), (240, 130, 30)),
    "purple": ((128, 0, 128), (148, 0, 211), (138, 43, 226), (102, 51, 153), (147, 112, 219), (160, 32, 240),
               (110, 0, 180)),
    "pink": ((255, 192, 203), (255, 105, 180), (255, 20, 147), (255, 182, 193), (255, 110, 199), (240, 128, 170)),
    "brown": ((165, 42, 42), (139, 69, 19), (160, 82, 45), (150, 75, 0), (123, 63, 0), (101, 67, 33), (128, 70, 27)),
    "black": ((0, 0, 0), (20, 20, 20), (35, 35, 35)),
    "white": ((255, 255, 255), (245, 245, 245), (250, 250, 235)),
    "gray": ((128, 128, 128), (169, 169, 169), (105, 105, 105), (192, 192, 192), (150, 150, 150), (90, 90, 90)),
}
COLOURS = tuple(PALETTE)
MIN_CONTRAST = 110  # RGB distance an object keeps from the background behind it


@dataclass
class Shape:
    kind: str  # one of SHAPES
    colour: str  # one of COLOURS
    rgb: tuple[int, int, int]
    x: float  # centre, in pixels of the final picture
    y: float
    radius: float  # the circumscribed radius of the drawn shape (its footprint)
    rotation: float = 0.0  # degrees; 0 = the upright shape
    hollow: bool = False  # drawn as a thick outline in its colour, unfilled


@dataclass
class Scene:
    width: int
    height: int
    shapes: list[Shape]
    number: str | None = None  # the digits printed in the picture, if any
    number_box: tuple[float, float, float, float] | None = None  # (left, top, right, bottom)
    style: dict = field(default_factory=dict)  # how to draw it: background, fonts, outlines, ...

    def count(self, kind: str) -> int:
        return sum(s.kind == kind for s in self.shapes)

    def unique(self, attribute: str) -> dict[str, Shape]:
        """The shapes that are the only one of their kind (attribute="kind") or colour ("colour"), by that value."""
        values = [getattr(s, attribute) for s in self.shapes]
        return {v: s for v, s in zip(values, self.shapes) if values.count(v) == 1}


# ---------------------------------------------------------------------------------------------------------
# Sampling a scene


def random_scene(rng: random.Random, *, num_shapes: int | None = None, kinds: list[str] | None = None,
                 max_shapes: int = 7, width: int | None = None, height: int | None = None,
                 number_probability: float = 0.4, augment: bool = True) -> Scene:
    """A random scene: size, background, non-overlapping shapes, maybe a printed number.

    The shapes are `kinds` if given, else num_shapes (default 1..max_shapes) random ones. A shape that finds no
    free spot is left out: the scene records what was drawn, so answers stay true."""
    if width is None or height is None:
        side, aspect = _random_side(rng), math.exp(rng.uniform(-0.5, 0.5)) if augment else 1.0
        width, height = round(side * math.sqrt(aspect)), round(side / math.sqrt(aspect))
    style = _random_style(rng, augment)
    scene = Scene(width, height, [], style=style)
    occupied: list[tuple[float, float, float]] = []  # (x, y, radius) of what is already placed
    if rng.random() < number_probability:
        _place_number(scene, rng, occupied)
    if kinds is None:
        num_shapes = rng.randint(1, max_shapes) if num_shapes is None else num_shapes
        kinds = [rng.choice(SHAPES) for _ in range(num_shapes)]
    num_shapes = len(kinds)
    # Small pictures and many shapes mean small shapes; some shapes are small anyway.
    side = min(width, height)
    largest = side * min(0.22, 0.5 / math.sqrt(num_shapes + 1))
    for kind in kinds:
        radius = rng.uniform(max(5.0, side * 0.035), max(6.0, largest))
        if rng.random() < 0.2:
            radius = rng.uniform(max(5.0, side * 0.03), max(6.0, side * 0.07))
        spot = _free_spot(rng, width, height, radius, occupied)
        if spot is None:
            continue
        colour = rng.choice(COLOURS)
        for _ in range(20):  # a colour that stands out from the background there
            rgb = _jitter(rng, rng.choice(PALETTE[colour]), 14 if augment else 0)
            if math.dist(rgb, background_at(style, *spot, width, height)) >= MIN_CONTRAST:
                break
            colour = rng.choice(COLOURS)
        else:
            continue
        occupied.append((*spot, radius))
        rotation = _random_rotation(rng, kind) if augment else 0.0
        hollow = augment and rng.random() < 0.08 and radius >= 8
        scene.shapes.append(Shape(kind, colour, rgb, spot[0], spot[1], radius, rotation, hollow))
    return scene


def _random_side(rng: random.Random) -> int:
    # Mostly 112-320 px, some larger ones that the processor's cap will shrink.
    return int(rng.uniform(400, 680)) if rng.random() < 0.08 else int(math.exp(rng.uniform(math.log(112), math.log(320))))


def _random_rotation(rng: random.Random, kind: str) -> float:
    if kind == "circle" or rng.random() < 0.7:
        return 0.0
    return rng.uniform(-20, 20) if kind == "square" else rng.uniform(-180, 180)


def _free_spot(rng, width, height, radius, occupied, tries=60):
    margin = radius + 2
    if width <= 2 * margin or height <= 2 * margin:
        return None
    for _ in range(tries):
        x, y = rng.uniform(margin, width - margin), rng.uniform(margin, height - margin)
        if all(math.hypot(x - ox, y - oy) > radius + r + 3 for ox, oy, r in occupied):
            return x, y
    return None


def _jitter(rng, rgb, amount):
    return tuple(min(255, max(0, c + rng.randint(-amount, amount))) for c in rgb)


# ---------------------------------------------------------------------------------------------------------
# Style: background and drawing options


def _random_style(rng: random.Random, augment: bool) -> dict:
    kind = rng.choice(["light", "light", "dark", "gradient", "noise", "colour"]) if augment else "light"
    light = lambda: tuple(rng.randint(215, 255) for _ in range(3)) if rng.random() < 0.6 else (255, 255, 255)
    dark = lambda: tuple(rng.randint(0, 50) for _ in range(3))
    style = {"background": kind, "supersample": 2, "outline": None, "blur": 0.0, "jpeg": None, "noise": 0}
    if kind == "light":
        style["colours"] = (light(),) * 2 if augment else ((255, 255, 255),) * 2
    elif kind == "dark":
        style["colours"] = (dark(),) * 2
    elif kind == "gradient":
        tone = rng.choice([light, dark, lambda: tuple(rng.randint(60, 255) for _ in range(3))])
        style["colours"] = (tone(), tone())
        style["direction"] = rng.choice(["horizontal", "vertical", "diagonal"])
    elif kind == "noise":
        base = light() if rng.random() < 0.6 else dark()
        style["colours"] = (base, base)
        style["noise"] = rng.randint(6, 30)
    else:  # a plain mid or pastel colour
        c = tuple(rng.randint(90, 235) for _ in range(3))
        style["colours"] = (c, c)
    if augment:
        style["supersample"] = rng.choice([1, 2, 2, 3])
        if rng.random() < 0.3:
            style["outline"] = (rng.choice(["black", "darker"]), rng.randint(1, 3))
        style["blur"] = rng.choice([0.0, 0.0, 0.0, 0.5, 0.8, 1.2])
        style["jpeg"] = rng.randint(25, 95) if rng.random() < 0.35 else None
    return style


def background_at(style: dict, x: float, y: float, width: int, height: int) -> tuple[int, int, int]:
    """The background colour at (x, y) before noise: what an object there is seen against."""
    a, b = style["colours"]
    direction = style.get("direction", "horizontal")
    t = {"horizontal": x / width, "vertical": y / height, "diagonal": (x / width + y / height) / 2}[direction]
    return tuple(round(ca + (cb - ca) * t) for ca, cb in zip(a, b))


def _background(style: dict, width: int, height: int) -> Image.Image:
    a, b = style["colours"]
    if a == b:
        img = Image.new("RGB", (width, height), a)
    else:
        # A 2x2 image resized bilinearly (corner pixel centres mapped to the corners) is a smooth gradient.
        corners = {"horizontal": [a, b, a, b], "vertical": [a, a, b, b], "diagonal": [a, _mix(a, b), _mix(a, b), b]}
        small = Image.new("RGB", (2, 2))
        small.putdata(corners[style["direction"]])
        img = small.resize((width, height), Image.Resampling.BILINEAR, box=(0.5, 0.5, 1.5, 1.5))
    return img


def _add_noise(img: Image.Image, amplitude: int, rng: random.Random) -> Image.Image:
    """Uniform gray noise in [-amplitude, amplitude], from the scene's own generator (reproducible)."""
    raw = Image.frombytes("L", img.size, rng.randbytes(img.width * img.height))
    noise = raw.point(lambda v: 128 + (v - 128) * amplitude // 128).convert("RGB")  # around 128
    return ImageChops.add(img, noise, 1.0, -128)  # img + noise - 128, clipped to 0..255


def _mix(a, b):
    return tuple((x + y) // 2 for x, y in zip(a, b))


# ---------------------------------------------------------------------------------------------------------
# The printed number

FONT_FILE_SUFFIXES = (".ttf", ".otf")  # a number_font that names a font file (`other_font`), not a built-in style
NUMBER_FONTS = ("aileron", "aileron", "bitmap", "segments")  # Pillow's scalable font, its 6x11 bitmap, LED digits


def _place_number(scene: Scene, rng: random.Random, occupied: list) -> None:
    digits = str(rng.choice([rng.randint(0, 9), rng.randint(10, 99), rng.randint(100, 999)]))
    side = min(scene.width, scene.height)
    height = rng.uniform(9, max(10.0, min(48.0, side * 0.2)))  # digit height in pixels of the final picture
    font = rng.choice(NUMBER_FONTS) if scene.style["supersample"] != 1 or rng.random() < 0.5 else "bitmap"
    width = _number_width(digits, font, height)
    if width + 4 >= scene.width or height + 4 >= scene.height:
        return
    left, top = rng.uniform(2, scene.width - width - 2), rng.uniform(2, scene.height - height - 2)
    scene.number, scene.number_box = digits, (left, top, left + width, top + height)
    occupied.append((left + width / 2, top + height / 2, math.hypot(width, height) / 2))
    for _ in range(20):
        rgb = rng.choice([(0, 0, 0), (255, 255, 255), (60, 60, 60), rng.choice(PALETTE[rng.choice(COLOURS)])])
        if math.dist(rgb, background_at(scene.style, left, top, scene.width, scene.height)) >= MIN_CONTRAST + 20:
            break
    scene.style.update(number_font=font, number_rgb=rgb, number_bold=rng.random() < 0.3)


def _number_width(digits: str, font: str, height: float) -> float:
    if font == "segments":
        return len(digits) * height * 0.7
    if font == "bitmap":
        return len(digits) * 6 * (height / 11)
    return ImageFont.load_default(max(1, round(height * 1.35))).getlength(digits)


def _draw_number(img: Image.Image, scene: Scene, scale: int) -> None:
    style = scene.style
    left, top, right, bottom = (v * scale for v in scene.number_box)
    height, rgb = bottom - top, style["number_rgb"]
    draw = ImageDraw.Draw(img)
    if style["number_font"] == "segments":
        _draw_segments(draw, scene.number, left, top, height, rgb)
    elif style["number_font"] == "bitmap":  # the 6x11 bitmap font, blown up with hard pixel edges
        mask = Image.new("L", (6 * len(scene.number) + 2, 12))
        ImageDraw.Draw(mask).text((0, 0), scene.number, fill=255, font=ImageFont.load_default_imagefont())
        factor = height / 11
        mask = mask.resize((max(1, round(mask.width * factor)), max(1, round(mask.height * factor))),
                           Image.Resampling.NEAREST)
        img.paste(Image.new("RGB", mask.size, rgb), (round(left), round(top)), mask)
    elif style["number_font"].lower().endswith(FONT_FILE_SUFFIXES):  # a run's own font file (`other_font`)
        _draw_fitted(draw, scene.number, (left, top, right, bottom), style["number_font"], rgb)
    else:
        font = ImageFont.load_default(max(1, round(height * 1.35)))
        bold = max(1, round(height / 14)) if style["number_bold"] else 0
        ink_left, ink_top, _, _ = font.getbbox(scene.number)  # the digits' ink starts below the text origin
        draw.text((left - ink_left, top - ink_top), scene.number, fill=rgb, font=font, stroke_width=bold)


def other_font(scene: Scene, rng: random.Random, font_files: tuple[str, ...], share: float = 0.5) -> None:
    """Augmentation for training: with probability `share`, the scene's number is drawn in one of these font
    files instead, fitted into the box its own font reserved (so nothing it was placed around is covered).
    Nothing is drawn from rng when font_files is empty: runs without extra fonts see the same pictures."""
    if font_files and scene.number is not None and rng.random() < share:
        scene.style["number_font"] = rng.choice(font_files)


def _draw_fitted(draw: ImageDraw.ImageDraw, digits: str, box: tuple, font_file: str, rgb) -> None:
    """The digits in font_file, as large as fits the box (their text box: ink top to bottom, advance across),
    at its top left."""
    left, top, right, bottom = box
    ink_left, ink_top, ink_right, ink_bottom = _truetype(font_file, 100).getbbox(digits)
    size = 100 * min((right - left) / max(1, ink_right - ink_left), (bottom - top) / max(1, ink_bottom - ink_top))
    font = _truetype(font_file, max(1, round(size)))
    ink_left, ink_top, _, _ = font.getbbox(digits)
    draw.text((left - ink_left, top - ink_top), digits, fill=rgb, font=font)


@functools.lru_cache(maxsize=256)
def _truetype(font_file: str, size: int) -> ImageFont.FreeTypeFont:
    return ImageFont.truetype(font_file, size)  # read once per (file, size): fonts are read-only once loaded


# Which of the 7 segments (a top, b top-right, c bottom-right, d bottom, e bottom-left, f top-left, g middle) light up.
SEGMENTS = {"0": "abcdef", "1": "bc", "2": "abdeg", "3": "abcdg", "4": "bcfg", "5": "acdfg", "6": "acdefg",
            "7": "abc", "8": "abcdefg", "9": "abcdfg"}


def _draw_segments(draw: ImageDraw.ImageDraw, digits: str, left: float, top: float, height: float, rgb) -> None:
    w, h, t = height * 0.5, height, max(1, round(height * 0.13))
    for i, digit in enumerate(digits):
        x0 = left + i * height * 0.7
        ends = {"a": ((0, 0), (w, 0)), "b": ((w, 0), (w, h / 2)), "c": ((w, h / 2), (w, h)), "d": ((0, h), (w, h)),
                "e": ((0, h / 2), (0, h)), "f": ((0, 0), (0, h / 2)), "g": ((0, h / 2), (w, h / 2))}
        for segment in SEGMENTS[digit]:
            (ax, ay), (bx, by) = ends[segment]
            draw.line([(x0 + ax, top + ay), (x0 + bx, top + by)], fill=rgb, width=t)


# ---------------------------------------------------------------------------------------------------------
# Drawing


def shape_outline(shape: Shape, scale: int = 1) -> list[tuple[float, float]]:
    """The polygon of a square, triangle or star (a circle is drawn as an ellipse)."""
    r, rotation = shape.radius * scale, shape.rotation
    corners = {"square": (4, 45.0, (1.0,)), "triangle": (3, -90.0, (1.0,)), "star": (5, -90.0, (1.0, 0.42))}
    n, start, radii = corners[shape.kind]
    points = []
    for i in range(n * len(radii)):
        angle = math.radians(start + rotation + i * 360 / (n * len(radii)))
        radius = r * radii[i % len(radii)]
        points.append((shape.x * scale + radius * math.cos(angle), shape.y * scale + radius * math.sin(angle)))
    return points


def _draw_shape(draw: ImageDraw.ImageDraw, shape: Shape, scale: int, outline) -> None:
    fill, line_rgb, width = shape.rgb, None, 0
    if shape.hollow:
        fill, line_rgb, width = None, shape.rgb, max(2, round(shape.radius * 0.18)) * scale
    elif outline is not None:
        kind, w = outline
        line_rgb = (0, 0, 0) if kind == "black" else tuple(c // 2 for c in shape.rgb)
        width = w * scale
    if shape.kind == "circle":
        r = shape.radius * 0.85 * scale
        box = (shape.x * scale - r, shape.y * scale - r, shape.x * scale + r, shape.y * scale + r)
        draw.ellipse(box, fill=fill, outline=line_rgb, width=width)
    else:
        draw.polygon(shape_outline(shape, scale), fill=fill, outline=line_rgb, width=width)


def shape_mask(scene: Scene) -> Image.Image:
    """A one-channel picture of which shape covers each pixel: i + 1 for scene.shapes[i] (filled, even when
    drawn hollow), 0 for the rest. The training hints (training.py, `token_hints`) are read off it."""
    mask = Image.new("L", (scene.width, scene.height), 0)
    draw = ImageDraw.Draw(mask)
    for i, shape in enumerate(scene.shapes):
        if shape.kind == "circle":
            r = shape.radius * 0.85
            draw.ellipse((shape.x - r, shape.y - r, shape.x + r, shape.y + r), fill=i + 1)
        else:
            draw.polygon(shape_outline(shape), fill=i + 1)
    return mask


def render(scene: Scene, rng: random.Random | None = None) -> Image.Image:
    """Draw the scene: background, shapes, number, then the picture-level augmentations of its style."""
    rng = rng or random.Random(0)
    style, scale = scene.style, scene.style["supersample"]
    img = _background(style, scene.width * scale, scene.height * scale)
    draw = ImageDraw.Draw(img)
    for shape in scene.shapes:
        _draw_shape(draw, shape, scale, style["outline"])
    if scene.number is not None:
        _draw_number(img, scene, scale)
    if scale > 1:  # drawn large, shrunk with a smoothing filter: anti-aliased edges
        img = img.resize((scene.width, scene.height), Image.Resampling.LANCZOS)
    if style["noise"]:
        img = _add_noise(img, style["noise"], rng)
    if style["blur"]:
        img = img.filter(ImageFilter.GaussianBlur(style["blur"]))
    if style["jpeg"]:
        buffer = io.BytesIO()
        img.save(buffer, format="JPEG", quality=style["jpeg"])
        img = Image.open(io.BytesIO(buffer.getvalue())).convert("RGB")
    return img


def counting_scene(rng: random.Random, kind: str | None = None, count: int | None = None, **kwargs):
    """A scene with `count` (0..6) shapes of one kind among 0..3 others: what "How many" needs to be learned."""
    kind = kind or rng.choice(SHAPES)
    count = rng.randint(0, 6) if count is None else count
    others = [k for k in SHAPES if k != kind]
    kinds = [kind] * count + [rng.choice(others) for _ in range(rng.randint(0 if count else 1, 3))]
    return random_scene(rng, kinds=rng.sample(kinds, len(kinds)), **kwargs)
