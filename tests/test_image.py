"""nanomm.inputs.image against transformers' Qwen2VLImageProcessorPil (the oracle), and every kind of bad input
(nanomm.inputs.image_io)."""

import base64
import contextlib
import io
import json
import random
import warnings

import pytest
import torch
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as hf_smart_resize

from helpers import data_url, png_header_only
from nanomm.errors import CheckpointError, InvalidInputError
from nanomm.inputs.image import (
    ImageProcessorConfig,
    ProcessedImage,
    preprocess_image,
    smart_resize,
    to_rgb,
)
from nanomm.inputs.image_io import load_image

HUB_MAX = 16384 * 28 * 28  # what the real Qwen2-VL preprocessor_config.json says
HF_CLASS_MAX = 28 * 28 * 1280  # HF's class default
NAME = "prompt 2, image 0"


# ---------------------------------------------------------------------------------------------------------------------
# Helpers


def random_image(mode: str, width: int, height: int, seed: int = 0) -> Image.Image:
    """An image of `mode` with seeded random pixels (flat colours would hide layout and rounding bugs)."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    n = width * height
    if mode == "1":
        return Image.frombytes("1", (width, height), rng.randbytes((width + 7) // 8 * height))
    if mode == "P":
        im = Image.frombytes("P", (width, height), rng.randbytes(n))
        im.putpalette(rng.randbytes(768))
        return im
    if mode in ("I;16", "I", "F"):  # values straddling 0..255, so that PIL's clipping to 8 bits is exercised
        dtype = {"I;16": torch.int16, "I": torch.int32, "F": torch.float32}[mode]
        low = 0 if mode == "I;16" else -60
        values = torch.rand(n, generator=g) * (600 - low) + low
        values = values.to(dtype) if mode != "F" else values
        return Image.frombytes(mode, (width, height), values.numpy().tobytes())
    return Image.frombytes(mode, (width, height), rng.randbytes(n * Image.getmodebands(mode)))


def encode(img: Image.Image, fmt: str = "PNG", **kwargs) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kwargs)
    return buf.getvalue()


def hf_preprocess(img: Image.Image, min_pixels: int, max_pixels: int):
    hf = Qwen2VLImageProcessorPil(size={"shortest_edge": min_pixels, "longest_edge": max_pixels})
    out = hf(images=img, return_tensors="pt")
    return out["pixel_values"], tuple(out["image_grid_thw"][0].tolist())


def assert_matches_hf(img: Image.Image, min_pixels: int = 56 * 56, max_pixels: int = HUB_MAX) -> ProcessedImage:
    expected, expected_grid = hf_preprocess(img, min_pixels, max_pixels)
    ours = preprocess_image(img, ImageProcessorConfig(min_pixels=min_pixels, max_pixels=max_pixels))
    assert ours.grid_thw == expected_grid
    assert ours.pixel_values.dtype == torch.float32
    assert ours.pixel_values.shape == expected.shape
    assert (ours.pixel_values - expected).abs().max().item() <= 1e-6  # 0.0 on the machines we tried
    assert ours.num_tokens == expected_grid[1] * expected_grid[2] // 4
    return ours


@contextlib.contextmanager
def raises_invalid(*words):
    """pytest.raises(InvalidInputError), and the message must mention the input's name and every word."""
    with pytest.raises(InvalidInputError) as info:
        yield info
    message = str(info.value).lower()
    for word in (NAME, *words):
        assert word.lower() in message, f"{word!r} not in {str(info.value)!r}"


# ---------------------------------------------------------------------------------------------------------------------
# Numerics against HF


@pytest.mark.parametrize("width,height", [
    (5, 7), (7, 5), (1, 1), (13, 17), (14, 2000), (2000, 14), (29, 27), (150, 100), (517, 333), (56, 84),
    (1920, 1080),
])
def test_sizes_match_hf(width, height):
    assert_matches_hf(random_image("RGB", width, height, seed=width * 7 + height))


@pytest.mark.parametrize("mode", ["RGB", "RGBA", "LA", "P", "L", "1", "CMYK", "I;16", "I", "F", "PA", "YCbCr",
                                  "LAB"])  # LAB: its "A" band is a colour, but HF composites it like alpha
def test_modes_match_hf(mode):
    assert_matches_hf(random_image(mode, 61, 47, seed=len(mode)))


@pytest.mark.filterwarnings("ignore:Palette images with Transparency")  # Pillow's, for HF too
def test_palette_with_transparency_matches_hf():
    """A PNG palette image with a tRNS chunk: HF composites it on white like RGBA."""
    rng = random.Random(3)
    png = encode(random_image("P", 45, 33, seed=3), transparency=rng.randbytes(256))
    img = load_image(png)
    assert img.mode == "P" and img.info.get("transparency") is not None
    assert_matches_hf(img)
    # compositing on white is not what a plain convert("RGB") does
    assert to_rgb(img).tobytes() != img.convert("RGB").tobytes()


@pytest.mark.parametrize("mode,transparency", [("RGB", (1, 2, 3)), ("L", 7)])
def test_trns_transparency_matches_hf(mode, transparency):
    """RGB and grey PNGs can mark one colour transparent (tRNS) without an alpha band: HF composites it on white."""
    img = random_image(mode, 50, 40, seed=9)
    for xy in ((0, 0), (10, 5), (49, 39)):
        img.putpixel(xy, transparency)
    img = load_image(encode(img, transparency=transparency))
    assert img.info.get("transparency") == transparency
    assert_matches_hf(img)
    assert to_rgb(img).tobytes() != img.convert("RGB").tobytes()  # the marked pixels turned white
    assert to_rgb(img).getpixel((10, 5)) == (255, 255, 255)


@pytest.mark.parametrize("min_pixels,max_pixels", [
    (56 * 56, HUB_MAX),
    (56 * 56, HF_CLASS_MAX),
    (56 * 56, 28 * 28 * 4),  # forces a downscale
    (1_000_000, HUB_MAX),  # forces an upscale
    (28 * 28 * 2, 28 * 28 * 2),
    (1, 500),  # below one 28x28 block: HF still gives 28x28
])
@pytest.mark.parametrize("width,height", [(150, 100), (517, 333)])
def test_caps_match_hf(min_pixels, max_pixels, width, height):
    assert_matches_hf(random_image("RGB", width, height, seed=1), min_pixels, max_pixels)


def test_1080p_under_small_cap_matches_hf():
    ours = assert_matches_hf(random_image("RGB", 1920, 1080, seed=5), max_pixels=HF_CLASS_MAX)
    assert ours.grid_thw == (1, 52, 94)  # 728x1316: the reference notes' example (1222 tokens)
    assert ours.num_tokens == 1222


def test_per_call_cap_overrides_config():
    img = random_image("RGB", 517, 333, seed=2)
    config = ImageProcessorConfig()
    override = preprocess_image(img, config, min_pixels=28 * 28, max_pixels=28 * 28 * 16)
    direct = preprocess_image(img, ImageProcessorConfig(min_pixels=28 * 28, max_pixels=28 * 28 * 16))
    assert torch.equal(override.pixel_values, direct.pixel_values)
    assert override.content_hash == direct.content_hash
    assert override.num_tokens <= 16 < preprocess_image(img, config).num_tokens


def test_patch_rows_layout():
    """Row i is patch (block row, block col, in-block (0,0),(0,1),(1,0),(1,1)); each row holds the frame twice."""
    img = random_image("RGB", 56, 56, seed=4)
    out = preprocess_image(img, ImageProcessorConfig())
    assert out.grid_thw == (1, 4, 4) and out.pixel_values.shape == (16, 1176)
    rows = out.pixel_values.view(16, 3, 2, 14, 14)  # (patches, C, T, P, P)
    assert torch.equal(rows[:, :, 0], rows[:, :, 1])
    frame = rows[:, :, 0]  # (patches, C, P, P)
    # patch 2 is block (0,0), in-block (1,0): rows 14..27, columns 0..13 of the image
    x = torch.frombuffer(bytearray(img.tobytes()), dtype=torch.uint8).view(56, 56, 3).permute(2, 0, 1)
    mean = torch.tensor((0.48145466, 0.4578275, 0.40821073)).view(3, 1, 1)
    std = torch.tensor((0.26862954, 0.26130258, 0.27577711)).view(3, 1, 1)
    expected = ((x.double() / 255).float() - mean) / std
    assert torch.equal(frame[2], expected[:, 14:28, 0:14])
    assert torch.equal(frame[4], expected[:, 0:14, 28:42])  # block (0,1) starts at row 4


def test_smart_resize_matches_hf():
    rng = random.Random(0)
    caps = [(56 * 56, HUB_MAX), (56 * 56, HF_CLASS_MAX), (28 * 28 * 4, 28 * 28 * 64), (1, 784), (200_000, 300_000)]
    sizes = [(70, 70), (42, 98), (14, 14), (13, 15), (14, 2000), (2000, 14), (1, 200), (5, 5), (126, 70)]
    while len(sizes) < 3000:
        h, w = rng.randint(1, 6000), rng.randint(1, 6000)
        if max(h, w) / min(h, w) <= 200:
            sizes.append((h, w))
    for i, (h, w) in enumerate(sizes):
        lo, hi = caps[i % len(caps)]
        factor = 28 if i % 7 else 32
        assert smart_resize(h, w, factor, lo, hi) == hf_smart_resize(h, w, factor, lo, hi), (h, w, factor, lo, hi)
    assert smart_resize(70, 70) == (56, 56)  # banker's rounding: round(2.5) == 2
    assert smart_resize(14, 2000) == (28, 672)  # no floor before the branches (qwen_vl_utils gives (28, 1988))


def test_smart_resize_aspect_ratio():
    assert smart_resize(10, 2000) == hf_smart_resize(10, 2000)  # exactly 200 is allowed
    with pytest.raises(ValueError):
        hf_smart_resize(10, 2001)
    with pytest.raises(InvalidInputError, match="aspect ratio"):
        smart_resize(10, 2001)
    with pytest.raises(InvalidInputError, match="positive"):
        smart_resize(0, 10)


# ---------------------------------------------------------------------------------------------------------------------
# Input forms and the content hash


def test_same_picture_any_form_same_result(tmp_path):
    img = random_image("RGBA", 90, 70, seed=6)
    png = encode(img)
    path = tmp_path / "picture.png"
    path.write_bytes(png)
    config = ImageProcessorConfig()
    forms = [str(path), path, png, bytearray(png), memoryview(png), Image.open(path), data_url(png),
             data_url(png, "image/jpeg")]  # the media type is a hint; the bytes decide
    outs = [preprocess_image(form, config) for form in forms]
    assert outs[0].grid_thw == (1, 4, 6)  # height 70 -> round(2.5) = 2 blocks: banker's rounding
    for out in outs[1:]:
        assert torch.equal(out.pixel_values, outs[0].pixel_values)
        assert out.content_hash == outs[0].content_hash
    assert len(outs[0].content_hash) == 64 and int(outs[0].content_hash, 16) >= 0
    assert_matches_hf(Image.open(path))


def test_hash_covers_parameters_and_pixels():
    img = random_image("RGB", 120, 90, seed=7)
    base = preprocess_image(img, ImageProcessorConfig())
    assert preprocess_image(img, ImageProcessorConfig()).content_hash == base.content_hash
    # a different cap changes the hash even where the resized size happens to be the same
    assert preprocess_image(img, ImageProcessorConfig(), max_pixels=HUB_MAX - 1).content_hash != base.content_hash
    assert preprocess_image(img, ImageProcessorConfig(), min_pixels=100).content_hash != base.content_hash
    for changed in (ImageProcessorConfig(image_mean=(0.5, 0.5, 0.5)), ImageProcessorConfig(image_std=(0.5, 0.5, 0.5)),
                    ImageProcessorConfig(rescale_factor=1 / 256), ImageProcessorConfig(patch_size=16),
                    ImageProcessorConfig(merge_size=1), ImageProcessorConfig(temporal_patch_size=1)):
        assert preprocess_image(img, changed).content_hash != base.content_hash
    other = img.copy()
    other.putpixel((0, 0), tuple(255 - v for v in img.getpixel((0, 0))))
    assert preprocess_image(other, ImageProcessorConfig()).content_hash != base.content_hash


def test_jpeg_round_trip_matches_hf():
    jpeg = encode(random_image("RGB", 300, 200, seed=8), "JPEG", quality=90)
    ours = preprocess_image(jpeg, ImageProcessorConfig())
    expected, grid = hf_preprocess(Image.open(io.BytesIO(jpeg)), 56 * 56, HUB_MAX)
    assert ours.grid_thw == grid and (ours.pixel_values - expected).abs().max().item() <= 1e-6


def test_load_image_keeps_mode_and_decodes():
    img = load_image(encode(random_image("LA", 20, 10)), NAME)
    assert img.mode == "LA" and img.size == (20, 10)
    assert img.getpixel((3, 3)) is not None  # decoded, not lazy
    pil = random_image("RGB", 8, 8)
    assert load_image(pil) is pil


def test_animated_gif_uses_first_frame():
    frames = [random_image("P", 40, 30, seed=s) for s in (10, 11, 12)]
    gif = encode(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=50)
    assert Image.open(io.BytesIO(gif)).n_frames == 3
    first = Image.open(io.BytesIO(gif))
    first.load()
    ours = preprocess_image(gif, ImageProcessorConfig())
    assert torch.equal(ours.pixel_values, preprocess_image(first, ImageProcessorConfig()).pixel_values)
    second = Image.open(io.BytesIO(gif))
    second.seek(1)
    assert not torch.equal(ours.pixel_values, preprocess_image(second.copy(), ImageProcessorConfig()).pixel_values)


def test_huge_jpeg_is_downscaled_to_the_cap():
    noise = Image.effect_noise((6000, 4000), 60)
    jpeg = encode(Image.merge("RGB", (noise, noise.transpose(Image.Transpose.ROTATE_180), noise)), "JPEG")
    out = preprocess_image(jpeg, ImageProcessorConfig(), name=NAME)
    _, gh, gw = out.grid_thw
    assert gh * gw * 14 * 14 <= HUB_MAX
    assert (gh * 14, gw * 14) == smart_resize(4000, 6000, 28, 56 * 56, HUB_MAX)
    assert out.pixel_values.shape == (gh * gw, 1176)


# ---------------------------------------------------------------------------------------------------------------------
# Configuration


def test_config_defaults():
    config = ImageProcessorConfig()
    assert (config.min_pixels, config.max_pixels, config.factor) == (3136, 12845056, 28)
    assert config.max_image_pixels == 89_478_485  # Pillow's default Image.MAX_IMAGE_PIXELS


@pytest.mark.parametrize("d", [
    {"min_pixels": 100, "max_pixels": 5000},
    {"size": {"shortest_edge": 200, "longest_edge": 6000}},
    {"min_pixels": 100, "max_pixels": 5000, "size": {"shortest_edge": 200, "longest_edge": 6000}},
    {"min_pixels": 100, "size": {"shortest_edge": 200, "longest_edge": 6000}},
    {"max_pixels": 7000, "size": {"shortest_edge": 200, "longest_edge": 6000}},
])
def test_config_from_dict_resolves_cap_like_hf(d):
    hf = Qwen2VLImageProcessorPil.from_dict(json.loads(json.dumps(d)))  # HF mutates what it is given
    ours = ImageProcessorConfig.from_dict(d)
    assert (ours.min_pixels, ours.max_pixels) == (hf.size["shortest_edge"], hf.size["longest_edge"])


def test_config_from_dict_fields_and_fallbacks():
    d = {"image_mean": [0.5, 0.25, 0.125], "image_std": [1, 2, 4], "patch_size": 16, "temporal_patch_size": 1,
         "merge_size": 3, "rescale_factor": 0.00392156862745098, "processor_class": "Qwen2VLProcessor",
         "image_processor_type": "Qwen2VLImageProcessor", "do_resize": True, "resample": 3}
    config = ImageProcessorConfig.from_dict(d)
    assert config.image_mean == (0.5, 0.25, 0.125) and config.image_std == (1.0, 2.0, 4.0)
    assert (config.patch_size, config.temporal_patch_size, config.merge_size, config.factor) == (16, 1, 3, 48)
    assert config.rescale_factor == 1 / 255 and (config.min_pixels, config.max_pixels) == (3136, HUB_MAX)
    assert ImageProcessorConfig.from_dict({"size": {"longest_edge": 5000}}).min_pixels == 3136
    old_layout = {"size": {"min_pixels": 1000, "max_pixels": 9000}}  # transformers 4.45-4.47 saved this
    assert ImageProcessorConfig.from_dict(old_layout).max_pixels == 9000
    for bad in ({"do_resize": False}, {"resample": 2}, {"min_pixels": 10, "max_pixels": 5}, {"size": 224},
                {"image_mean": [0.5]}, {"patch_size": 0}, {"max_pixels": "lots"}):
        with pytest.raises(CheckpointError):
            ImageProcessorConfig.from_dict(bad)


def test_config_from_pretrained(tmp_path):
    assert ImageProcessorConfig.from_pretrained(tmp_path) == ImageProcessorConfig()  # no file: defaults
    hf = Qwen2VLImageProcessorPil(size={"shortest_edge": 1234, "longest_edge": 567890}, image_mean=[0.1, 0.2, 0.3])
    hf.save_pretrained(tmp_path)
    config = ImageProcessorConfig.from_pretrained(str(tmp_path))
    assert (config.min_pixels, config.max_pixels, config.image_mean) == (1234, 567890, (0.1, 0.2, 0.3))
    nested = tmp_path / "v5"
    nested.mkdir()
    (nested / "processor_config.json").write_text(json.dumps({"image_processor": {"max_pixels": 4321}}))
    assert ImageProcessorConfig.from_pretrained(nested).max_pixels == 4321
    (tmp_path / "preprocessor_config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="JSON"):
        ImageProcessorConfig.from_pretrained(tmp_path)


# ---------------------------------------------------------------------------------------------------------------------
# Bad input: one test per kind, each checking the type, the problem and the input's name


def test_missing_file(tmp_path):
    with raises_invalid("no such file"):
        preprocess_image(str(tmp_path / "nope.png"), ImageProcessorConfig(), name=NAME)


def test_directory(tmp_path):
    with raises_invalid("directory"):
        preprocess_image(tmp_path, ImageProcessorConfig(), name=NAME)


def test_empty_bytes_and_empty_file(tmp_path):
    with raises_invalid("empty"):
        load_image(b"", NAME)
    (tmp_path / "empty.png").write_bytes(b"")
    with raises_invalid("empty"):
        load_image(tmp_path / "empty.png", NAME)


def test_truncated_file():
    png = encode(random_image("RGB", 64, 48))
    with raises_invalid("truncated"):
        load_image(png[: len(png) // 2], NAME)


def test_corrupt_file():
    png = bytearray(encode(random_image("RGB", 64, 48)))
    png[100:120] = b"\xff" * 20  # inside the compressed pixel data
    with raises_invalid("corrupt"):
        load_image(bytes(png), NAME)


@pytest.mark.parametrize("data", [
    b"hello, this is not an image at all" * 4,
    b'<svg xmlns="http://www.w3.org/2000/svg" width="10" height="10"><rect width="10" height="10"/></svg>',
    b"%PDF-1.4\n1 0 obj << /Type /Catalog >> endobj\ntrailer << /Root 1 0 R >>\n%%EOF\n",
    b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\n",  # EPS: Pillow could open it, via Ghostscript
])
def test_not_an_image_or_unsupported_format(data, tmp_path):
    with raises_invalid("supported format"):
        load_image(data, NAME)
    (tmp_path / "file.png").write_bytes(data)
    with raises_invalid("supported format"):
        load_image(tmp_path / "file.png", NAME)


@pytest.mark.parametrize("width,height,limit", [
    (50_000, 50_000, None),  # over twice Pillow's limit: Pillow itself refuses in Image.open
    (10_000, 10_000, None),  # over Pillow's limit: its warning must become an error, not a print
    (2_000, 2_000, 1_000_000),  # our own header check, under Pillow's limit
])
def test_decompression_bomb_rejected_from_header(width, height, limit):
    config = ImageProcessorConfig() if limit is None else ImageProcessorConfig(max_image_pixels=limit)
    filters_before, pillow_limit_before = list(warnings.filters), Image.MAX_IMAGE_PIXELS
    # The file is a few dozen bytes; decoding it would allocate width*height bytes. The pixel-limit message
    # can only come from the header checks, which run before any pixel buffer exists.
    with raises_invalid("pixel limit"):
        preprocess_image(png_header_only(width, height), config, name=NAME)
    assert warnings.filters == filters_before and Image.MAX_IMAGE_PIXELS == pillow_limit_before


def test_pil_image_over_the_limit():
    with raises_invalid("pixel limit"):
        preprocess_image(random_image("L", 40, 30), ImageProcessorConfig(max_image_pixels=1000), name=NAME)
    lazy = Image.open(io.BytesIO(png_header_only(2_000, 2_000)))  # opened by the caller, not decoded yet
    with raises_invalid("pixel limit"):
        preprocess_image(lazy, ImageProcessorConfig(max_image_pixels=1_000_000), name=NAME)


def test_upscale_past_the_limit_is_refused():
    with raises_invalid("pixel limit", "min_pixels"):
        preprocess_image(random_image("RGB", 5, 5), ImageProcessorConfig(), min_pixels=10**9, max_pixels=10**9,
                         name=NAME)


def test_aspect_ratio_over_200():
    with raises_invalid("aspect ratio"):
        preprocess_image(random_image("L", 402, 2), ImageProcessorConfig(), name=NAME)
    with raises_invalid("aspect ratio"):  # from the header alone: a 1,000,000 x 10 image is never decoded
        load_image(png_header_only(1_000_000, 10), NAME)


def test_zero_size_image():
    with raises_invalid("zero size"):
        preprocess_image(Image.new("RGB", (0, 10)), ImageProcessorConfig(), name=NAME)


@pytest.mark.parametrize("value", [3, None, 1.5, [b"\x89PNG"], {"image": "x.png"}, torch.zeros(3, 4, 4),
                                   torch.zeros(3, 4, 4).numpy()])
def test_wrong_python_type(value):
    with raises_invalid("must be a PIL image"):
        preprocess_image(value, ImageProcessorConfig(), name=NAME)


def test_bad_base64():
    with raises_invalid("base64"):
        load_image("data:image/png;base64,iVBORw0KGgo@@@notbase64", NAME)


@pytest.mark.parametrize("url", ["data:image/png,rawbytes", "data:image/png;base64", "data:;base64,AAAA"])
def test_malformed_data_url(url):
    with raises_invalid("data URL"):
        load_image(url, NAME)


def test_data_url_that_is_not_an_image():
    with raises_invalid("not an image"):
        load_image("data:text/plain;base64," + base64.b64encode(b"hello").decode(), NAME)
    with raises_invalid("supported format"):  # says image/png, holds text
        load_image(data_url(b"hello, not a png at all"), NAME)
    with raises_invalid("empty"):
        load_image("data:image/png;base64,", NAME)


def test_urls_are_not_fetched():
    with raises_invalid("URL"):
        load_image("https://example.com/cat.png", NAME)


@pytest.mark.parametrize("min_pixels,max_pixels,word", [
    (0, None, "min_pixels"), (-5, None, "min_pixels"), (None, 1.5e6, "max_pixels"), (True, None, "min_pixels"),
    (None, "1000000", "max_pixels"), (5000, 4000, "larger than"),
])
def test_bad_pixel_cap(min_pixels, max_pixels, word):
    with raises_invalid(word):
        preprocess_image(random_image("RGB", 30, 30), ImageProcessorConfig(), min_pixels=min_pixels,
                         max_pixels=max_pixels, name=NAME)


def test_unconvertible_mode():
    premultiplied = Image.new("La", (20, 20))  # PIL cannot convert "La" to RGB; HF fails on it too
    with raises_invalid("La"):
        preprocess_image(premultiplied, ImageProcessorConfig(), name=NAME)


def test_closed_pil_image():
    img = Image.open(io.BytesIO(encode(random_image("RGB", 20, 20))))
    img.close()
    with raises_invalid("cannot be decoded"):
        preprocess_image(img, ImageProcessorConfig(), name=NAME)


def test_bad_input_is_a_value_error():
    assert issubclass(InvalidInputError, ValueError)
