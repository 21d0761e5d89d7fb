"""The engine-level input corpus: every bad input is rejected with a clear message naming the prompt and the
problem, and odd but legitimate image formats are served token for token like the dense reference. Bad videos too
(section 4, lesson 17): each refused from what its header or shape says, before its frames are decoded.

Every file is built here, in code, in a temporary folder: nothing is downloaded and nothing is committed.
tests/test_image.py covers the same inputs one level down (nanomm.inputs.image_io and nanomm.inputs.image); this
file checks the whole path: LLM.generate (validate everything before any compute), LLMEngine.add_request / step
(the worker pool turns an image that fails to decode into an "error" result for that request alone), and that no
KV block, encoder-cache hold or request is left behind either way.
"""

import base64
import io
import struct
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from helpers import (assert_no_leaks, chat_prompt, data_url, png_header_only, random_image, reference_tokens,
                     run_to_completion)
from nanomm import LLM, InvalidInputError, SamplingParams
from nanomm.inputs import video_io as video_module
from nanomm.inputs.video_io import VideoInput, VideoLimits, load_video
from nanomm.tools.random_checkpoint import make_checkpoint

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
LIMIT = 4  # limit_images_per_prompt
CAP_TOKENS = 16  # max_pixels = 28*28*16: at most 16 visual tokens per image
MAX_MODEL_LEN = 512


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    ckpt = make_checkpoint(tmp_path_factory.mktemp("tiny"), preset="tiny")  # Qwen2-VL: its engine serves videos
    return LLM(str(ckpt), device="cpu", dtype="float32", max_pixels=28 * 28 * CAP_TOKENS,
               limit_images_per_prompt=LIMIT, max_model_len=MAX_MODEL_LEN)


@pytest.fixture(autouse=True)
def drained(llm):
    """A failed test must not leave requests behind for the next one."""
    yield
    run_to_completion(llm.engine)


def image_pads(llm, out) -> int:
    return out.prompt_token_ids.count(llm.model.config.image_token_id)


# ---------------------------------------------------------------------------------------------------------------------
# Building the corpus


def encode(img: Image.Image, fmt: str, **kwargs) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kwargs)
    return buf.getvalue()


def random_mode_image(mode: str, width: int, height: int, seed: int) -> Image.Image:
    rgb = random_image(width, height, seed)
    if mode == "I;16":  # values over 255 too, so the 16-bit range is really used
        grey = rgb.convert("L").tobytes()
        values = b"".join(struct.pack("<H", v * 250) for v in grey)
        return Image.frombytes("I;16", (width, height), values)
    if mode == "F":
        grey = rgb.convert("L").tobytes()
        values = b"".join(struct.pack("<f", v * 1.7 - 60.25) for v in grey)  # negatives and over 255: clipped
        return Image.frombytes("F", (width, height), values)
    if mode == "P":
        return rgb.quantize(64)
    return rgb.convert(mode)


SVG = b'<svg xmlns="http://www.w3.org/2000/svg" width="64" height="64"><rect width="64" height="64" fill="red"/></svg>'


def zip_bytes() -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("picture.png", encode(random_image(20, 20, 1), "PNG"))  # an image inside is still not one
    return buf.getvalue()


def corrupt(data: bytes, start: int = 100) -> bytes:
    broken = bytearray(data)
    broken[start:start + 20] = b"\xff" * 20  # inside the compressed pixel data
    return bytes(broken)


@dataclass
class Corpus:
    folder: Path
    files: dict = field(default_factory=dict)  # name -> path
    blobs: dict = field(default_factory=dict)  # name -> bytes

    def add(self, name: str, data: bytes) -> Path:
        path = self.folder / name
        path.write_bytes(data)
        self.files[name], self.blobs[name] = path, data
        return path


@pytest.fixture(scope="module")
def bad(tmp_path_factory) -> Corpus:
    """Inputs that must be rejected."""
    corpus = Corpus(tmp_path_factory.mktemp("bad"))
    png = encode(random_image(64, 48, 2), "PNG")
    jpeg = encode(random_image(64, 48, 3), "JPEG", quality=90)
    corpus.add("corrupt.png", corrupt(png))
    corpus.add("truncated.png", png[: len(png) // 2])
    corpus.add("truncated.jpg", jpeg[: len(jpeg) // 2])
    corpus.add("empty.png", b"")
    corpus.add("hello.png", b"hello world")
    corpus.add("archive.zip", zip_bytes())
    corpus.add("drawing.svg", SVG)
    corpus.add("bomb.png", png_header_only(60_000, 60_000))
    corpus.add("thin.png", encode(random_image(1, 300, 4), "PNG"))  # 1 wide, 300 high
    corpus.add("wide.png", encode(random_image(4000, 10, 5), "PNG"))
    (corpus.folder / "a_directory.png").mkdir()
    # The corpus is what it claims to be: Pillow itself cannot decode these, or refuses them as bombs ...
    for name in ("corrupt.png", "truncated.png", "truncated.jpg", "bomb.png"):
        with pytest.raises((OSError, Image.DecompressionBombError)):
            Image.open(io.BytesIO(corpus.blobs[name])).load()
    # ... and these decode, but are too long and thin for Qwen2-VL's smart_resize.
    assert Image.open(io.BytesIO(corpus.blobs["thin.png"])).size == (1, 300)
    assert Image.open(io.BytesIO(corpus.blobs["wide.png"])).size == (4000, 10)
    return corpus


@pytest.fixture(scope="module")
def huge_jpeg() -> bytes:
    """6000x4000: the slow file to make (once per module). Smooth, so it stays a few MB even as a data URL."""
    img = random_image(60, 40, 6).resize((6000, 4000), Image.Resampling.BILINEAR)
    return encode(img, "JPEG", quality=85)


@pytest.fixture(scope="module")
def good(tmp_path_factory, huge_jpeg) -> Corpus:
    """Odd but legitimate images: each one must be served."""
    corpus = Corpus(tmp_path_factory.mktemp("good"))
    corpus.add("cmyk.jpg", encode(random_mode_image("CMYK", 61, 47, 10), "JPEG", quality=90))
    palette = random_mode_image("P", 45, 33, 11)
    corpus.add("palette_trns.png", encode(palette, "PNG", transparency=bytes(range(0, 256, 4))))
    corpus.add("la.png", encode(random_mode_image("LA", 50, 30, 12), "PNG"))
    corpus.add("gray16.png", encode(random_mode_image("I;16", 40, 52, 13), "PNG"))
    corpus.add("float.tif", encode(random_mode_image("F", 57, 43, 14), "TIFF"))
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 degrees clockwise to display"
    rotated = random_image(84, 56, 15)
    corpus.add("exif_rot6.jpg", encode(rotated, "JPEG", quality=90, exif=exif))
    corpus.add("no_exif.jpg", encode(rotated, "JPEG", quality=90))  # the same pixels, no orientation tag
    frames = [random_mode_image("P", 40, 30, s) for s in (16, 17, 18)]
    corpus.add("animated.gif", encode(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=50,
                                      loop=0))
    corpus.add("lossless.webp", encode(random_image(48, 36, 19), "WEBP", lossless=True))
    corpus.add("lossy.webp", encode(random_image(48, 36, 20), "WEBP", quality=70))
    corpus.add("one_pixel.png", encode(random_image(1, 1, 21), "PNG"))
    corpus.add("huge.jpg", huge_jpeg)

    def opened(name):
        im = Image.open(io.BytesIO(corpus.blobs[name]))  # from memory: no file handle left open
        im.load()
        return im
    # The corpus is what it claims to be, as Pillow decodes it.
    assert opened("cmyk.jpg").mode == "CMYK"
    assert opened("palette_trns.png").mode == "P" and opened("palette_trns.png").info.get("transparency")
    assert opened("la.png").mode == "LA"
    assert opened("gray16.png").mode == "I;16" and max(opened("gray16.png").getextrema()) > 255
    assert opened("float.tif").mode == "F"
    assert opened("exif_rot6.jpg").getexif()[0x0112] == 6 and 0x0112 not in opened("no_exif.jpg").getexif()
    assert opened("animated.gif").n_frames == 3
    assert opened("lossless.webp").format == opened("lossy.webp").format == "WEBP"
    assert opened("one_pixel.png").size == (1, 1)
    assert opened("huge.jpg").size == (6000, 4000)
    return corpus


MEDIA_TYPES = {".jpg": "image/jpeg", ".png": "image/png", ".gif": "image/gif", ".webp": "image/webp",
               ".tif": "image/tiff", ".svg": "image/svg+xml", ".zip": "application/zip"}


def as_form(corpus: Corpus, name: str, form: str):
    """One corpus entry as a path (str), a PathLike, raw bytes or a data URL."""
    path = corpus.files[name]
    return {"path": str(path), "pathlike": path, "bytes": corpus.blobs[name],
            "data_url": data_url(corpus.blobs[name], MEDIA_TYPES.get(path.suffix, "image/png"))}[form]


def with_images(text: str, images: list, placeholders: int | None = None) -> dict:
    """A chat prompt with `placeholders` image placeholders (default: one per image) and these images."""
    n = len(images) if placeholders is None else placeholders
    prompt = chat_prompt(text, ["x"] * n)["prompt"] if n else chat_prompt(text)
    return {"prompt": prompt, "multi_modal_data": {"image": list(images)}}


def ok_image(seed: int = 0):
    return random_image(44, 60, 100 + seed)


# ---------------------------------------------------------------------------------------------------------------------
# 1. Rejected by LLM.generate: the whole call, before any compute, naming "prompt 1" and the problem.
#
# Each bad image is the SECOND image of the second prompt, so the message must say "prompt 1, image 1".


IMAGE_CASES = {
    # name: (corpus name or a callable building the image from the corpus, form, a distinctive message fragment)
    "corrupt png bytes": ("corrupt.png", "bytes", "truncated or corrupt"),
    "corrupt png file": ("corrupt.png", "path", "truncated or corrupt"),
    "truncated png": ("truncated.png", "bytes", "truncated"),
    "truncated png file": ("truncated.png", "pathlike", "truncated"),
    "truncated jpeg": ("truncated.jpg", "path", "truncated"),
    "truncated jpeg data url": ("truncated.jpg", "data_url", "truncated"),
    "empty file": ("empty.png", "path", "empty (0 bytes)"),
    "empty bytes": ("empty.png", "bytes", "empty (0 bytes)"),
    "empty data url": (lambda c: "data:image/png;base64,", None, "empty (0 bytes)"),
    "text bytes": ("hello.png", "bytes", "not an image in a supported format"),
    "text file named .png": ("hello.png", "path", "not an image in a supported format"),
    "zip bytes": ("archive.zip", "bytes", "not an image in a supported format"),
    "zip file": ("archive.zip", "path", "not an image in a supported format"),
    "svg file": ("drawing.svg", "path", "not an image in a supported format"),
    "svg bytes": ("drawing.svg", "bytes", "not an image in a supported format"),
    "svg data url": ("drawing.svg", "data_url", "not an image in a supported format"),
    # Pillow's own check or nanomm's header check (max_image_pixels) may answer: both say "pixel limit".
    "decompression bomb bytes": ("bomb.png", "bytes", "pixel limit"),
    "decompression bomb file": ("bomb.png", "path", "pixel limit"),
    "decompression bomb under twice Pillow's limit": (lambda c: png_header_only(10_000, 10_000), None,
                                                      "pixel limit"),
    "decompression bomb data url": ("bomb.png", "data_url", "pixel limit"),
    "aspect ratio 1x300": ("thin.png", "path", "aspect ratio over 200"),
    "aspect ratio 4000x10": ("wide.png", "bytes", "aspect ratio over 200"),
    "aspect ratio PIL image": (lambda c: random_image(4000, 10, 7), None, "aspect ratio over 200"),
    "int": (lambda c: 42, None, "got builtins.int"),
    "None": (lambda c: None, None, "got builtins.NoneType"),
    "float": (lambda c: 1.5, None, "got builtins.float"),
    "list inside a list": (lambda c: [ok_image(1)], None, "got builtins.list"),
    "dict": (lambda c: {"image": str(c.files["corrupt.png"])}, None, "got builtins.dict"),
    "bad base64": (lambda c: "data:image/png;base64,iVBORw0KGgo@@@not-base64!", None, "base64 payload is invalid"),
    "data url of text": (lambda c: data_url(b"hello, not a png at all", "image/png"), None,
                         "not an image in a supported format"),
    "data url with a text media type": (lambda c: data_url(b"hello", "text/plain"), None,
                                        "the data url is not an image"),
    "data url missing comma": (lambda c: "data:image/png;base64" + base64.b64encode(b"x" * 30).decode(), None,
                               "malformed data url"),
    "data url not base64": (lambda c: "data:image/png,rawbytes", None, "malformed data url"),
    "http url": (lambda c: "https://example.com/cat.png", None, "urls are not fetched"),
    "missing file": (lambda c: str(c.folder / "no_such_file.png"), None, "no such file"),
    "missing file pathlike": (lambda c: c.folder / "missing" / "deeper.jpg", None, "no such file"),
    "directory": (lambda c: str(c.folder / "a_directory.png"), None, "is a directory"),
    "directory pathlike": (lambda c: c.folder, None, "is a directory"),
}


def bad_image(corpus: Corpus, case: str):
    source, form, fragment = IMAGE_CASES[case]
    image = source(corpus) if callable(source) else as_form(corpus, source, form)
    return image, fragment


def long_text(llm, num_tokens: int) -> str:
    """Text whose chat prompt is exactly num_tokens tokens long (a placeholder counts as one token)."""
    def length(n):
        return len(llm.tokenizer.encode(chat_prompt(" ".join(["the"] * n))))
    n = num_tokens - length(0)
    for _ in range(20):
        if length(n) == num_tokens:
            return " ".join(["the"] * n)
        n += 1 if length(n) < num_tokens else -1
    raise AssertionError(f"cannot build a prompt of exactly {num_tokens} tokens")


def prompt_cases(llm, corpus: Corpus) -> dict:
    """Prompt-level problems: name -> (prompt, fragment)."""
    images5 = [ok_image(i) for i in range(LIMIT + 1)]
    # Text alone (one placeholder token per image) fits max_model_len; with 4 images of 16 tokens expanded it does not.
    text = long_text(llm, MAX_MODEL_LEN - 40)
    too_long_with_images = with_images(text, [random_image(120, 120, i) for i in range(LIMIT)])
    unexpanded = len(llm.tokenizer.encode(too_long_with_images["prompt"]))
    assert unexpanded < MAX_MODEL_LEN <= unexpanded + LIMIT * (CAP_TOKENS - 1)
    return {
        "too many images": (with_images("five", images5), f"5 images, over the limit of {LIMIT}"),
        "more placeholders than images": (with_images("two places", [ok_image()], placeholders=2),
                                          "2 image placeholder(s) but 1 image(s)"),
        "more images than placeholders": (with_images("one place", [ok_image(), ok_image(1)], placeholders=1),
                                          "1 image placeholder(s) but 2 image(s)"),
        "images without placeholders": (with_images("none", [ok_image()], placeholders=0),
                                        "0 image placeholder(s) but 1 image(s)"),
        "placeholder without images": (chat_prompt("x", ["x"])["prompt"], "1 image placeholder(s) but 0 image(s)"),
        "too long text": (chat_prompt(long_text(llm, MAX_MODEL_LEN + 20)), f"max_model_len={MAX_MODEL_LEN}"),
        "too long text exactly max_model_len": (chat_prompt(long_text(llm, MAX_MODEL_LEN)), "leaves no room"),
        "too long with images expanded": (too_long_with_images, "(images expanded)"),
        "prompt of the wrong type": (42, "a str or a dict"),
    }


PROMPT_CASE_NAMES = ["too many images", "more placeholders than images", "more images than placeholders",
                     "images without placeholders", "placeholder without images", "too long text",
                     "too long text exactly max_model_len", "too long with images expanded",
                     "prompt of the wrong type"]


def assert_rejected(llm, prompts, fragment, where):
    steps, misses = llm.stats()["steps"], llm.stats()["encoder_cache_misses"]
    with pytest.raises(InvalidInputError) as err:
        llm.generate(prompts, GREEDY)
    message = str(err.value)
    assert where in message, f"{where!r} not in {message!r}"
    assert fragment.lower() in message.lower(), f"{fragment!r} not in {message!r}"
    assert len(message) < 400, f"an error message should be short: {message[:500]!r}..."
    assert llm.stats()["steps"] == steps and llm.stats()["encoder_cache_misses"] == misses  # no compute
    assert_no_leaks(llm)


@pytest.mark.parametrize("case", list(IMAGE_CASES))
def test_bad_image_rejects_the_call(llm, bad, case):
    image, fragment = bad_image(bad, case)
    prompts = [with_images("fine", [ok_image()]), with_images("the bad one", [ok_image(1), image])]
    assert_rejected(llm, prompts, fragment, "prompt 1, image 1")


@pytest.mark.parametrize("case", PROMPT_CASE_NAMES)
def test_bad_prompt_rejects_the_call(llm, bad, case):
    prompt, fragment = prompt_cases(llm, bad)[case]
    assert_rejected(llm, [chat_prompt("fine"), prompt], fragment, "prompt 1")


def test_single_bad_prompt_is_prompt_0_and_the_engine_still_serves(llm, bad):
    image, fragment = bad_image(bad, "decompression bomb bytes")
    assert_rejected(llm, with_images("alone", [image]), fragment, "prompt 0, image 0")
    prompt = with_images("after all those errors", [ok_image(2)])
    out = llm.generate(prompt, GREEDY)[0]
    assert out.outputs[0].token_ids == reference_tokens(llm, prompt, GREEDY)
    assert_no_leaks(llm)


def test_raw_base64_without_data_prefix_is_rejected(llm):
    raw_base64 = base64.b64encode(encode(random_image(40, 40, 8), "PNG")).decode()  # a common caller mistake
    prompts = [with_images("fine", [ok_image()]), with_images("forgot the prefix", [ok_image(1), raw_base64])]
    with pytest.raises(InvalidInputError) as err:
        llm.generate(prompts, GREEDY)
    assert "prompt 1, image 1" in str(err.value) and len(str(err.value)) < 400
    rid = llm.engine.add_request(prompts[1], GREEDY)
    error = run_to_completion(llm.engine)[rid].outputs[0].error
    assert f"request {rid}, image 1" in error, error


# ---------------------------------------------------------------------------------------------------------------------
# 2. The streaming API: structural problems raise at add_request; images that only fail when decoded finish their
#    own request with finish_reason "error"; the good requests around them are untouched.


DECODE_FAILURES = ["corrupt png bytes", "truncated png", "truncated jpeg", "empty file", "empty bytes",
                   "text bytes", "zip bytes", "svg file", "svg bytes", "svg data url", "decompression bomb bytes",
                   "decompression bomb file", "aspect ratio 1x300", "aspect ratio 4000x10", "data url of text"]
# Problems with the image itself are found on the worker (add_request's docstring says so), but either outcome
# is acceptable here, as long as it names the request, the image and the problem.
EITHER = ["int", "None", "list inside a list", "dict", "bad base64", "data url missing comma", "missing file",
          "directory"]
STRUCTURAL = ["too many images", "more placeholders than images", "more images than placeholders",
              "placeholder without images", "too long text", "prompt of the wrong type"]


def test_streaming_bad_requests_among_good_ones(llm, bad):
    engine = llm.engine
    good = {}
    first = with_images("first, already running", [ok_image(3), random_image(90, 70, 4)])
    good[engine.add_request(first, GREEDY)] = first
    engine.step()  # the bad requests arrive while a good one is in flight

    cases = prompt_cases(llm, bad)
    for case in STRUCTURAL:
        prompt, fragment = cases[case]
        with pytest.raises(InvalidInputError) as err:
            engine.add_request(prompt, GREEDY, request_id=f"structural {case}")
        assert f"request structural {case}" in str(err.value) and fragment.lower() in str(err.value).lower()

    expected_errors = {}  # request id -> fragments its error must contain
    for i, case in enumerate(DECODE_FAILURES + EITHER):
        image, fragment = bad_image(bad, case)
        prompt = with_images(f"bad {i}", [ok_image(4), image])
        try:
            rid = engine.add_request(prompt, GREEDY)
        except InvalidInputError as err:
            assert case in EITHER, f"{case}: expected an error result, not a raise at add_request: {err}"
            assert "image 1" in str(err) and fragment.lower() in str(err).lower()
            continue
        expected_errors[rid] = (f"request {rid}, image 1", fragment)
        if i % 5 == 0:  # good requests interleaved with the bad ones, some with images that need decoding
            prompt = with_images(f"good {i}", [random_image(60 + i, 50, 30 + i)]) if i % 2 else chat_prompt(f"good {i}")
            good[engine.add_request(prompt, GREEDY)] = prompt
    too_long, fragment = cases["too long with images expanded"]  # only known once the images are decoded
    expected_errors[engine.add_request(too_long, GREEDY)] = ("max_model_len", fragment)
    last = with_images("last", [ok_image(5)])
    good[engine.add_request(last, GREEDY)] = last

    assert_errors_and_answers(llm, run_to_completion(engine), expected_errors, good)


def assert_errors_and_answers(llm, finished: dict, expected_errors: dict, good: dict) -> None:
    """Every bad request finished with an error naming what was wrong and no tokens; every good one with the
    dense reference's tokens; nothing left behind."""
    assert sorted(finished) == sorted([*good, *expected_errors])
    for rid, fragments in expected_errors.items():
        completion = finished[rid].outputs[0]
        assert finished[rid].finished and completion.finish_reason == "error", rid
        assert completion.token_ids == [] and completion.text == ""
        for fragment in fragments:
            assert fragment.lower() in completion.error.lower(), f"{fragment!r} not in {completion.error!r}"
    for rid, prompt in good.items():
        completion = finished[rid].outputs[0]
        assert completion.finish_reason == "length" and completion.error is None
        assert completion.token_ids == reference_tokens(llm, prompt, GREEDY), f"good request {rid} differs"
    assert_no_leaks(llm)


def test_streaming_only_bad_requests(llm, bad):
    """Error results come back even when nothing else is running (step() has no model work to do)."""
    engine = llm.engine
    ids = {engine.add_request(with_images("bad", [bad_image(bad, case)[0]]), GREEDY): case
           for case in ("svg bytes", "decompression bomb file", "truncated jpeg")}
    finished = run_to_completion(engine)
    assert sorted(finished) == sorted(ids)
    for rid, case in ids.items():
        assert finished[rid].outputs[0].finish_reason == "error"
        assert IMAGE_CASES[case][2].lower() in finished[rid].outputs[0].error.lower()
    assert_no_leaks(llm)


# ---------------------------------------------------------------------------------------------------------------------
# 3. Served: odd but legitimate formats, as paths, bytes and data URLs, token for token like the dense reference.


SERVED = ["cmyk.jpg", "palette_trns.png", "la.png", "gray16.png", "float.tif", "exif_rot6.jpg", "animated.gif",
          "lossless.webp", "lossy.webp", "one_pixel.png", "huge.jpg"]
FORMS = ["path", "bytes", "data_url"]


def assert_served(llm, prompts) -> list:
    outputs = llm.generate(prompts, GREEDY)
    assert len(outputs) == len(prompts)
    for i, (prompt, out) in enumerate(zip(prompts, outputs)):
        completion = out.outputs[0]
        assert out.finished and completion.finish_reason == "length" and completion.error is None
        assert completion.token_ids == reference_tokens(llm, prompt, GREEDY), f"prompt {i} differs"
    assert_no_leaks(llm)
    return outputs


@pytest.mark.filterwarnings("ignore:Palette images with Transparency")  # Pillow's, on the way to RGBA
@pytest.mark.parametrize("name", SERVED)
def test_odd_format_is_served_in_every_form(llm, good, name):
    prompts = [with_images("describe it", [as_form(good, name, form)]) for form in FORMS]
    outputs = assert_served(llm, prompts)
    # The same picture in any form is the same image: same expanded prompt, same tokens.
    assert len({tuple(o.prompt_token_ids) for o in outputs}) == 1
    assert len({tuple(o.outputs[0].token_ids) for o in outputs}) == 1
    assert 1 <= image_pads(llm, outputs[0]) <= CAP_TOKENS
    if name == "one_pixel.png":
        assert image_pads(llm, outputs[0]) == 4  # min_pixels = 56*56 scales it up to one 2x2 block of tokens
    if name == "huge.jpg":
        assert outputs[0].metrics.num_visual_tokens == image_pads(llm, outputs[0])


def test_huge_jpeg_is_downscaled_to_the_cap(llm, good):
    """6000x4000 = 24 MP goes through, downscaled under max_pixels: at most 16 visual tokens (3:2 -> 4x3 = 12)."""
    prompt = with_images("a big photo", [as_form(good, "huge.jpg", "bytes")])
    out = assert_served(llm, [prompt])[0]
    assert image_pads(llm, out) <= CAP_TOKENS
    assert image_pads(llm, out) == 12
    assert len(out.prompt_token_ids) < 100


def test_exif_orientation_is_applied(llm, good):
    """image_io.py's documented choice (as vLLM serves phone photos): the EXIF-rotated JPEG is served like the
    same stored pixels turned upright by hand (PIL's own rotation is the oracle; a PIL image is taken as given)."""
    upright = Image.open(io.BytesIO(good.blobs["no_exif.jpg"])).transpose(Image.Transpose.ROTATE_270)
    tagged = with_images("which way up?", [as_form(good, "exif_rot6.jpg", "path")])
    by_hand = with_images("which way up?", [upright])
    rotated, turned = assert_served(llm, [tagged, by_hand])
    assert rotated.outputs[0].token_ids == turned.outputs[0].token_ids
    grids = [tuple(llm.engine.prepare(p, None).images[0].grid_thw) for p in (tagged, by_hand)]
    stored = tuple(llm.engine.prepare(with_images("x", [as_form(good, "no_exif.jpg", "bytes")]), None)
                   .images[0].grid_thw)
    assert grids[0] == grids[1] == (stored[0], stored[2], stored[1])  # height and width swapped: a quarter turn


@pytest.mark.filterwarnings("ignore:Palette images with Transparency")
def test_mixed_formats_and_forms_in_one_call(llm, good):
    """Several prompts of up to 4 odd images each, every form mixed, and a text-only prompt, in ONE generate call."""
    pick = lambda name, form: as_form(good, name, form)  # noqa: E731
    prompts = [
        with_images("four odd ones", [pick("cmyk.jpg", "path"), pick("palette_trns.png", "bytes"),
                                      pick("la.png", "data_url"), pick("gray16.png", "pathlike")]),
        with_images("four more", [pick("float.tif", "bytes"), pick("exif_rot6.jpg", "data_url"),
                                  pick("animated.gif", "path"), pick("lossless.webp", "bytes")]),
        chat_prompt("no image at all"),
        with_images("the rest", [pick("lossy.webp", "data_url"), pick("one_pixel.png", "bytes"),
                                 pick("huge.jpg", "path")]),
        with_images("the same image twice", [pick("la.png", "path"), pick("la.png", "bytes")]),
    ]
    outputs = assert_served(llm, prompts)
    assert [image_pads(llm, o) for o in outputs][2] == 0
    assert all(image_pads(llm, o) <= LIMIT * CAP_TOKENS for o in outputs)
    assert outputs[0].metrics.num_visual_tokens == image_pads(llm, outputs[0])


# ---------------------------------------------------------------------------------------------------------------------
# 4. Videos (lesson 17): bad clips are refused like bad images, from the header, the array's shape or the frame
#    rate, before a frame is decoded (a corrupt stream: when its broken frame is reached); a good clip still serves.


MAX_FRAMES = VideoLimits().max_frames  # 768, the engine's limits (load_video's defaults)
VIDEO_PLACEHOLDER = "<|vision_start|><|video_pad|><|vision_end|>"


def gif_bytes(num_frames: int, width: int, height: int, screen: tuple[int, int] | None = None,
              delay_cs: int = 5) -> bytes:
    """A GIF written by hand: a 2-colour palette (black, red) and num_frames frames of width x height, frame i all
    colour i % 2, each shown delay_cs hundredths of a second, on a logical screen that claims `screen` (default: the
    frame's size). A few bytes a frame: the frame count and the claimed size cost nothing to make."""
    screen_width, screen_height = screen or (width, height)
    out = bytearray(b"GIF89a" + struct.pack("<HHBBB", screen_width, screen_height, 0x80, 0, 0) + bytes(3) + b"\xff\0\0")
    out += b"\x21\xff\x0bNETSCAPE2.0\x03\x01\0\0\0"  # loop forever
    for i in range(num_frames):
        out += b"\x21\xf9\x04\0" + struct.pack("<H", delay_cs) + b"\0\0"  # graphic control: the frame's delay
        out += b"\x2c" + struct.pack("<HHHHB", 0, 0, width, height, 0)  # image descriptor, no local palette
        # LZW at 2 bits: 3-bit codes, a clear code (4) before every second pixel keeps them 3 bits wide, then end (5)
        codes = [c for k in range(width * height) for c in ([4] if k % 2 == 0 else []) + [i % 2]] + [5]
        packed = sum(code << (3 * k) for k, code in enumerate(codes)).to_bytes(-(-3 * len(codes) // 8), "little")
        out += b"\x02" + b"".join(bytes([len(packed[j:j + 255])]) + packed[j:j + 255]
                                   for j in range(0, len(packed), 255)) + b"\0"
    return bytes(out + b"\x3b")


def good_frames(num_frames: int = 4, size: tuple[int, int] = (56, 56), seed: int = 40) -> list:
    return [random_image(*size, seed + i) for i in range(num_frames)]


@pytest.fixture(scope="module")
def bad_videos(tmp_path_factory) -> Corpus:
    """Clips that must be refused, as files (bytes, paths, data URLs)."""
    corpus = Corpus(tmp_path_factory.mktemp("bad_videos"))
    frames = [im.quantize(16) for im in good_frames(4, (32, 32))]
    whole = encode(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=100, loop=0)
    corpus.add("truncated.gif", whole[: len(whole) // 2])
    corpus.add("huge_frame.gif", gif_bytes(1, 1, 1, screen=(60_000, 60_000)))  # 3.6 G pixels claimed
    corpus.add("big_frame.gif", gif_bytes(1, 1, 1, screen=(5_000, 5_000)))  # under Pillow's limit, over nanomm's
    corpus.add("big_clip.gif", gif_bytes(70, 1, 1, screen=(4_096, 4_096)))  # 70 x 16.8 M pixels claimed
    corpus.add("too_many_frames.gif", gif_bytes(MAX_FRAMES + 1, 1, 1))
    corpus.add("zero_ms.gif", gif_bytes(2, 4, 4, delay_cs=0))  # frames that last 0 ms: no frame rate
    webp = good_frames(2, (8, 8))
    corpus.add("1000fps.webp", encode(webp[0], "WEBP", save_all=True, append_images=webp[1:], duration=1,
                                      lossless=True))
    # The corpus is what it claims to be: the hand-made GIF decodes as Pillow reads GIFs ...
    well_formed = Image.open(io.BytesIO(gif_bytes(3, 4, 2)))
    assert well_formed.n_frames == 3 and well_formed.size == (4, 2)
    well_formed.seek(1)
    assert well_formed.convert("RGB").getpixel((3, 1)) == (255, 0, 0)
    # ... Pillow cannot decode the truncated one, or refuses the huge one as a bomb ...
    truncated = Image.open(io.BytesIO(corpus.blobs["truncated.gif"]))
    with pytest.raises(OSError):
        for index in range(4):
            truncated.seek(index)
            truncated.load()
    with pytest.raises(Image.DecompressionBombError):
        Image.open(io.BytesIO(corpus.blobs["huge_frame.gif"]))
    # ... and these headers claim what the limits refuse, in a few KB.
    assert Image.open(io.BytesIO(corpus.blobs["big_frame.gif"])).size == (5_000, 5_000)
    big_clip = Image.open(io.BytesIO(corpus.blobs["big_clip.gif"]))
    assert big_clip.n_frames * big_clip.width * big_clip.height > VideoLimits().max_total_pixels
    assert Image.open(io.BytesIO(corpus.blobs["too_many_frames.gif"])).n_frames == MAX_FRAMES + 1
    assert len(corpus.blobs["too_many_frames.gif"]) < 20_000
    assert Image.open(io.BytesIO(corpus.blobs["1000fps.webp"])).n_frames == 2
    return corpus


def gif_form(corpus: Corpus, name: str, form: str):
    path = corpus.files[name]
    return {"path": str(path), "pathlike": path, "bytes": corpus.blobs[name],
            "data_url": data_url(corpus.blobs[name], "image/webp" if path.suffix == ".webp" else "image/gif")}[form]


VIDEO_CASES = {
    # name: (a callable building the video from the corpus, a distinctive message fragment)
    "corrupt stream: truncated gif bytes": (lambda c: gif_form(c, "truncated.gif", "bytes"), "truncated or corrupt"),
    "corrupt stream: truncated gif file": (lambda c: gif_form(c, "truncated.gif", "pathlike"),
                                           "truncated or corrupt"),
    "corrupt stream: truncated gif data url": (lambda c: gif_form(c, "truncated.gif", "data_url"),
                                               "truncated or corrupt"),
    "huge frame: a gif claiming 60000x60000": (lambda c: gif_form(c, "huge_frame.gif", "bytes"), "pixel limit"),
    "huge frame: its data url": (lambda c: gif_form(c, "huge_frame.gif", "data_url"), "pixel limit"),
    "huge frame: 5000x5000, nanomm's limit": (lambda c: gif_form(c, "big_frame.gif", "path"), "(max_frame_pixels)"),
    "huge clip: 70 frames of 4096x4096": (lambda c: gif_form(c, "big_clip.gif", "bytes"), "(max_total_pixels)"),
    "huge frame: an array": (lambda c: torch.zeros(1, 5_000, 5_000, 3, dtype=torch.uint8).expand(2, -1, -1, -1),
                             "(max_frame_pixels)"),
    "too many frames: gif bytes": (lambda c: gif_form(c, "too_many_frames.gif", "bytes"),
                                   f"over the limit of {MAX_FRAMES} (max_frames)"),
    "too many frames: gif file": (lambda c: gif_form(c, "too_many_frames.gif", "path"), "(max_frames)"),
    "too many frames: an array": (lambda c: np.zeros((MAX_FRAMES + 1, 2, 2, 3), dtype=np.uint8), "(max_frames)"),
    "too many frames: a frame list": (lambda c: [Image.new("RGB", (2, 2))] * (MAX_FRAMES + 1), "(max_frames)"),
    "zero frames: an empty array": (lambda c: np.zeros((0, 56, 56, 3), dtype=np.uint8), "has no frames"),
    "zero frames: an empty tensor": (lambda c: torch.zeros(0, 56, 56, 3, dtype=torch.uint8), "has no frames"),
    "zero frames: an empty list": (lambda c: [], "has no frames"),
    "zero frames: an empty VideoInput": (lambda c: VideoInput((), 2.0), "has no frames"),
    "fps 0": (lambda c: VideoInput(tuple(good_frames(2)), 0), "fps must be a number in (0, 240], got 0"),
    "fps negative": (lambda c: VideoInput(tuple(good_frames(2)), -2.0), "fps must be a number in (0, 240], got -2.0"),
    "fps 10,000 in a VideoInput": (lambda c: VideoInput(tuple(good_frames(2)), 10_000.0),
                                   "fps must be a number in (0, 240], got 10000.0"),
    "fps NaN": (lambda c: VideoInput(tuple(good_frames(2)), float("nan")), "got nan"),
    "fps 0 from a file: frames of 0 ms": (lambda c: gif_form(c, "zero_ms.gif", "bytes"), "unplayable frame rate"),
    "fps 1000 from a file: frames of 1 ms": (lambda c: gif_form(c, "1000fps.webp", "data_url"),
                                             "fps must be a number in (0, 240], got 1000.0"),
}


@pytest.fixture
def frames_decoded(monkeypatch) -> list:
    """Each frame load_video converts to RGB (the decode of a file's frame, or a PIL frame's conversion), counted."""
    decoded, to_rgb = [], video_module.to_rgb

    def counting(image):
        decoded.append(image.size)
        return to_rgb(image)
    monkeypatch.setattr(video_module, "to_rgb", counting)
    return decoded


def with_video(text: str, video, images: list = ()) -> dict:
    """A chat prompt with these images, then one video, then the text."""
    prompt = chat_prompt(VIDEO_PLACEHOLDER + text, ["x"] * len(images))
    prompt = prompt["prompt"] if images else prompt
    return {"prompt": prompt, "multi_modal_data": {"video": [video], **({"image": list(images)} if images else {})}}


def good_video_prompts(bad: Corpus) -> list:
    frames = good_frames(3, (84, 56))  # 3 frames, padded to 4: 2 temporal patches of 3 x 2 tokens
    gif = encode(frames[0].quantize(32), "GIF", save_all=True, append_images=[f.quantize(32) for f in frames[1:]],
                 duration=500, loop=0)
    return [with_video("what moves?", frames), with_video("and here?", data_url(gif, "image/gif"), [ok_image(6)])]


@pytest.mark.parametrize("case", list(VIDEO_CASES))
def test_bad_video_rejects_the_call_before_its_frames_are_decoded(llm, bad_videos, frames_decoded, case):
    source, fragment = VIDEO_CASES[case]
    prompts = [with_images("fine", [ok_image()]), with_video("the bad one", source(bad_videos))]
    assert_rejected(llm, prompts, fragment, "prompt 1, video 0")
    if case.startswith("corrupt stream"):  # decoded until the broken frame: fewer than the file's 4 frames
        assert len(frames_decoded) < 4
    elif "from a file" in case:  # a file's rate comes from its frames' durations, read as each is decoded
        assert len(frames_decoded) <= 2
    else:
        assert frames_decoded == [], f"{case}: {len(frames_decoded)} frame(s) decoded before the refusal"


@pytest.mark.parametrize("fps", [0, -1, float("nan"), 10_000, float("inf"), True, "2"])
@pytest.mark.parametrize("form", ["frame list", "array"])
def test_fps_out_of_range_is_refused_before_a_frame_is_converted(frames_decoded, fps, form):
    """load_video's fps= (for frames given as a list or an array): in (0, max_fps], checked before anything else.
    (The engine passes no fps; a rate reaches it in a VideoInput or from a file's frame durations, as above.)"""
    frames = good_frames(2, (8, 8))
    source = frames if form == "frame list" else np.stack([np.asarray(f) for f in frames])
    with pytest.raises(InvalidInputError, match=r"clip: fps must be a number in \(0, 240\]"):
        load_video(source, "clip", fps=fps)
    assert frames_decoded == []


def test_bad_videos_then_good_requests_are_served(llm, bad_videos):
    """After every bad clip, in one call each: nothing leaked, and clips and pictures serve like the reference."""
    for case, (source, _) in VIDEO_CASES.items():
        with pytest.raises(InvalidInputError):
            llm.generate(with_video(case, source(bad_videos)), GREEDY)
    assert_no_leaks(llm)
    outputs = assert_served(llm, [*good_video_prompts(bad_videos), with_images("a picture", [ok_image(7)])])
    video_pads = [o.prompt_token_ids.count(llm.model.config.video_token_id) for o in outputs]
    assert video_pads == [12, 12, 0]


def test_streaming_bad_videos_among_good_ones(llm, bad_videos):
    """add_request: a bad clip alone may raise there or finish its request with an error (a clip without pictures
    is decoded on the caller's thread today); with a picture it goes to the worker pool and finishes with an error.
    Either way it names the request and the video, and the good requests around it are untouched."""
    engine = llm.engine
    good = {}
    for prompt in good_video_prompts(bad_videos):
        good[engine.add_request(prompt, GREEDY)] = prompt
    engine.step()  # the bad requests arrive while good ones are in flight
    expected_errors = {}
    for i, (case, (source, fragment)) in enumerate(VIDEO_CASES.items()):
        for images in ([], [ok_image(8)]):
            try:
                rid = engine.add_request(with_video(f"bad {i}", source(bad_videos), images), GREEDY)
            except InvalidInputError as err:
                assert not images, f"{case}: a request with a picture is prepared on the pool: {err}"
                assert "video 0" in str(err) and fragment.lower() in str(err).lower(), (case, str(err))
                continue
            expected_errors[rid] = (f"request {rid}, video 0", fragment)
        if i % 4 == 0:
            prompt = with_images(f"good {i}", [random_image(50 + i, 40, 60 + i)])
            good[engine.add_request(prompt, GREEDY)] = prompt
    assert_errors_and_answers(llm, run_to_completion(engine), expected_errors, good)
