"""Decoded images in, Qwen2-VL pixel patches out: RGB, smart_resize under the pixel cap, normalise, patchify.

This is the first stage of the request path. `preprocess_image` takes whatever the caller sent (a PIL image, a file
path, raw bytes or a `data:image/...;base64,...` URL), has `nanomm/inputs/image_io.py` load and validate it
(formats, decompression bombs, animated images, EXIF: the untrusted-input decisions are documented there), and
turns it into the `pixel_values` rows the vision encoder eats, the `grid_thw` that says how many 14-px patches the
image became, and a `content_hash` the encoder cache and the prefix cache key on. lessons/01-preprocessing.md walks
through it with numbers.

Every step reproduces transformers' `Qwen2VLImageProcessorPil` bit for bit (tests/test_image.py checks it):
  1. RGB: alpha (an A band, or `transparency` info) is composited on white; every other mode uses PIL's convert.
  2. smart_resize: both sides become multiples of 28 (= patch 14 x merge 2) and the area lands in
     [min_pixels, max_pixels], keeping the aspect ratio. max_pixels is the dynamic-resolution cap: it bounds the
     number of visual tokens (area / 28**2), so it is the main lever on prefill cost per image.
  3. PIL bicubic resize of the uint8 image: the result is re-quantised to uint8 (there is no float resampling).
  4. Rescale by 1/255 in float64, cast to float32, then (x - mean) / std in float32.
  5. Patchify into rows of C*T*P*P = 3*2*14*14 = 1176 values; a still image is its own frame twice (T=2).

A huge min_pixels that would upscale a small image past `max_image_pixels` raises `InvalidInputError` too.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path

import torch
from PIL import Image

from nanomm.errors import CheckpointError, InvalidInputError, check_int
from nanomm.inputs import image_io
from nanomm.inputs.compression import CompressionPolicy, kept_layout
from nanomm.inputs.image_io import MAX_ASPECT_RATIO, PILLOW_MAX_IMAGE_PIXELS
from nanomm.model.config import read_checkpoint_json

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
DEFAULT_MIN_PIXELS = 56 * 56  # the Hub preprocessor_config.json values (3,136 and 12,845,056)
DEFAULT_MAX_PIXELS = 16384 * 28 * 28  # (HF's class default is 1,003,520; the Hub file wins)
HASH_VERSION = "nanomm-image-v1"  # bump when the preprocessing changes, so old cache keys stop matching


@dataclass(frozen=True)
class ImageProcessorConfig:
    """Every knob that changes pixel_values, with Qwen2-VL's values (the Hub preprocessor_config.json)."""

    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = DEFAULT_MIN_PIXELS
    max_pixels: int = DEFAULT_MAX_PIXELS
    image_mean: tuple[float, float, float] = OPENAI_CLIP_MEAN
    image_std: tuple[float, float, float] = OPENAI_CLIP_STD
    rescale_factor: float = 1 / 255
    max_image_pixels: int = PILLOW_MAX_IMAGE_PIXELS  # decode-time guard on the SOURCE image (decompression bombs)

    def __post_init__(self):
        for key in ("patch_size", "temporal_patch_size", "merge_size", "min_pixels", "max_pixels", "max_image_pixels"):
            object.__setattr__(self, key, check_int(getattr(self, key), f"image processor config: {key}",
                                                     error=InvalidInputError))
        if self.min_pixels > self.max_pixels:
            raise InvalidInputError(f"image processor config: min_pixels ({self.min_pixels}) is larger than "
                                    f"max_pixels ({self.max_pixels})")
        for key in ("image_mean", "image_std"):
            value = tuple(float(v) for v in getattr(self, key))  # JSON gives lists; keep the config hashable
            if len(value) != 3 or (key == "image_std" and 0.0 in value):
                raise InvalidInputError(f"image processor config: {key} must be 3 numbers (std non-zero), got {value}")
            object.__setattr__(self, key, value)
        if not (math.isfinite(self.rescale_factor) and self.rescale_factor > 0):
            raise InvalidInputError(f"image processor config: rescale_factor must be > 0, got {self.rescale_factor}")

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    @classmethod
    def from_dict(cls, d: dict) -> "ImageProcessorConfig":
        """Read a preprocessor_config.json dict, resolving the pixel cap the way HF 5.24 does.

        An explicit top-level min_pixels / max_pixels wins over size["shortest_edge"] / size["longest_edge"]
        (Qwen2VLImageProcessorPil.__init__). A key missing from both falls back to our default (HF would fail at
        preprocessing time). size["min_pixels"] / size["max_pixels"], the layout transformers 4.45-4.47 saved, are
        read as a last resort. Switches our pipeline cannot honour (do_resize=False, another resample, ...) raise.
        """
        for key, supported in (("do_convert_rgb", True), ("do_resize", True), ("do_rescale", True),
                               ("do_normalize", True), ("resample", 3)):
            if d.get(key, supported) not in (None, supported):
                raise CheckpointError(f"preprocessor config: {key}={d[key]!r} is not supported (only {supported!r})")
        size = d.get("size") or {}
        if not isinstance(size, dict):
            raise CheckpointError(f"preprocessor config: size must be a dict, got {size!r}")
        keys = ("patch_size", "temporal_patch_size", "merge_size", "image_mean", "image_std", "rescale_factor")
        kwargs = {k: d[k] for k in keys if d.get(k) is not None}
        for ours, new_key in (("min_pixels", "shortest_edge"), ("max_pixels", "longest_edge")):
            for value in (d.get(ours), size.get(new_key), size.get(ours)):
                if value is not None:
                    kwargs[ours] = value
                    break
        try:
            return cls(**kwargs)
        except (ValueError, TypeError) as e:  # InvalidInputError is a ValueError
            raise CheckpointError(f"preprocessor config: {e}") from e

    @classmethod
    def from_pretrained(cls, folder) -> "ImageProcessorConfig":
        """folder/preprocessor_config.json, else the "image_processor" part of a transformers-5 processor_config.json,
        else the defaults."""
        folder = Path(folder)
        if (folder / "preprocessor_config.json").is_file():
            return cls.from_dict(read_checkpoint_json(folder / "preprocessor_config.json"))
        processor = read_checkpoint_json(folder / "processor_config.json", required=False).get("image_processor")
        if isinstance(processor, dict):
            return cls.from_dict(processor)
        return cls()


def smart_resize(height: int, width: int, factor: int = 28, min_pixels: int = DEFAULT_MIN_PIXELS,
                 max_pixels: int = DEFAULT_MAX_PIXELS) -> tuple[int, int]:
    """HF's smart_resize, step for step: sides become multiples of `factor`, area lands in [min_pixels, max_pixels].

    Python's round() is banker's rounding (70/28 = 2.5 -> 2), and there is no floor at `factor` before the
    branches: a side under 14 px rounds to 0 and the min_pixels branch then scales up from the ORIGINAL size.
    """
    if height <= 0 or width <= 0:
        raise InvalidInputError(f"image size must be positive, got {height}x{width} (height x width)")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise InvalidInputError(f"absolute aspect ratio must be smaller than {MAX_ASPECT_RATIO}, "
                                f"got {max(height, width) / min(height, width)}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def to_rgb(img: Image.Image) -> Image.Image:
    """transformers' convert_to_rgb (PIL branch): composite transparency on white, else PIL's convert("RGB").

    16-bit and float modes (I;16, I, F) go through PIL's convert too, which clamps each value to 0..255 (floats
    truncated) instead of rescaling the range, so a full-range 16-bit grey PNG comes out almost all white.
    HF does exactly this, and matching HF is the point here.
    """
    if "A" in img.getbands() or img.info.get("transparency") is not None:
        img = img.convert("RGBA")
        white = Image.new("RGBA", img.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, img).convert("RGB")
    return img.convert("RGB")


@dataclass(eq=False)
class ProcessedImage:
    """One image, resized and hashed; its float patches (`pixel_values`) are built on first use.

    Preprocessing splits in two on purpose. The PIL part (decode, convert, resize) releases the GIL and runs on
    the engine's worker pool; the torch part (rescale, normalise, patchify) runs later, on the thread that first
    reads `pixel_values`: the engine's. torch ops on pool threads each start an OpenMP thread team, and once
    those exist every small op on the engine thread pays for waking its own team (measured: decode attention
    ~3x slower for the rest of the process). It also means an image the encoder cache already holds is never
    turned into floats at all.
    """
    resized_rgb: bytes = field(repr=False)  # (H, W, 3) uint8 at the resized size
    grid_thw: tuple[int, int, int]  # (1, gh, gw) in patch units (not merged units)
    content_hash: str  # sha256 hex of the decoded pixels and every parameter that changes its visual tokens
    config: ImageProcessorConfig = field(repr=False)
    compression: CompressionPolicy | None = None  # visual-token compression after the projector (compression.py)

    def with_compression(self, policy: CompressionPolicy | None) -> "ProcessedImage":
        """This image with its visual tokens compressed by `policy`. The policy joins the content hash, so the
        encoder cache and the prefix cache never give one policy's tokens to another."""
        if policy is None:
            return self
        content_hash = hashlib.sha256(f"{self.content_hash}\0{policy.key}".encode()).hexdigest()
        return replace(self, content_hash=content_hash, compression=policy)

    @cached_property
    def pixel_values(self) -> torch.Tensor:
        """(gh*gw, C*T*P*P) float32, one row per 14x14 patch, merge-block major."""
        _, gh, gw = self.grid_thw
        h, w = gh * self.config.patch_size, gw * self.config.patch_size
        x = torch.frombuffer(bytearray(self.resized_rgb), dtype=torch.uint8).view(h, w, 3)  # (H, W, C)
        x = _rescale_and_normalize(x.permute(2, 0, 1), self.config)  # (C, H, W)
        return _patchify(x, self.config)

    @property
    def merge_size(self) -> int:
        return self.config.merge_size

    @property
    def token_grid(self) -> tuple[int, int, int]:
        """(T, H, W) of the vision tower's output tokens: each merge_size x merge_size block of patches is one."""
        t, gh, gw = self.grid_thw
        return t, gh // self.merge_size, gw // self.merge_size

    @property
    def num_encoded_tokens(self) -> int:
        """The tokens the vision tower puts out: what encoding this image costs."""
        return math.prod(self.token_grid)

    @property
    def num_tokens(self) -> int:
        """The number of <|image_pad|> tokens: the encoded tokens that compression keeps (all without it)."""
        return kept_layout(self.token_grid, self.compression)[0]

    @property
    def position_extent(self) -> int:
        """M-RoPE positions the image spans: the text after it resumes this far past its first position."""
        return kept_layout(self.token_grid, self.compression)[1]


def preprocess_image(image, config: ImageProcessorConfig, *, min_pixels=None, max_pixels=None,
                     name: str = "image") -> ProcessedImage:
    """Load, validate, resize and hash one image; min_pixels/max_pixels override the config's cap for this call."""
    min_pixels, max_pixels = _pixel_cap(config, min_pixels, max_pixels, name)
    img = image_io.load_image(image, name, max_image_pixels=config.max_image_pixels)
    try:
        rgb = to_rgb(img)
    except Exception as e:  # e.g. premultiplied "La", which PIL cannot convert
        raise InvalidInputError(f"{name}: cannot convert image mode {img.mode!r} to RGB ({e})") from e
    width, height = rgb.size
    h_bar, w_bar = smart_resize(height, width, config.factor, min_pixels, max_pixels)
    if h_bar * w_bar > config.max_image_pixels:  # a huge min_pixels would upscale a small image into a bomb
        raise InvalidInputError(f"{name}: min_pixels={min_pixels} would resize the image to {w_bar}x{h_bar}, "
                                f"over the pixel limit of {config.max_image_pixels:,} (max_image_pixels)")
    pixels = rgb.tobytes()  # (H, W, 3) uint8
    content_hash = _content_hash(pixels, (height, width), (h_bar, w_bar), config, min_pixels, max_pixels)
    if (w_bar, h_bar) != rgb.size:  # HF always resizes, but PIL's resize to the same size is an exact copy
        pixels = rgb.resize((w_bar, h_bar), Image.Resampling.BICUBIC).tobytes()  # still uint8: re-quantised
    grid_thw = (1, h_bar // config.patch_size, w_bar // config.patch_size)
    return ProcessedImage(pixels, grid_thw, content_hash, config)


def _pixel_cap(config: ImageProcessorConfig, min_pixels, max_pixels, name: str) -> tuple[int, int]:
    lo = config.min_pixels if min_pixels is None else min_pixels
    hi = config.max_pixels if max_pixels is None else max_pixels
    lo = check_int(lo, f"{name}: min_pixels", error=InvalidInputError)
    hi = check_int(hi, f"{name}: max_pixels", error=InvalidInputError)
    if lo > hi:
        raise InvalidInputError(f"{name}: min_pixels ({lo}) is larger than max_pixels ({hi})")
    return lo, hi


def _rescale_and_normalize(x: torch.Tensor, config: ImageProcessorConfig) -> torch.Tensor:
    """uint8 -> float32, in the dtypes HF's numpy code uses, so that every value is bit-identical to it:
    x * rescale_factor in float64, cast to float32, then (x - mean) / std in float32 with float32 mean/std."""
    mean = torch.tensor(config.image_mean, dtype=torch.float32).view(-1, 1, 1)  # (C, 1, 1)
    std = torch.tensor(config.image_std, dtype=torch.float32).view(-1, 1, 1)  # (C, 1, 1)
    x = x.double().mul_(config.rescale_factor).float()  # in place: a 12.8 MP image is 300 MB in float64
    return x.sub_(mean).div_(std)


def _patchify(x: torch.Tensor, config: ImageProcessorConfig) -> torch.Tensor:
    """(C, H, W) -> (gh*gw, C*T*P*P). Rows go merge-block by merge-block, so the M*M patches that the projector
    merges into one token are adjacent; each row is (c, t, py, px), the still frame repeated T times."""
    P, M, T = config.patch_size, config.merge_size, config.temporal_patch_size
    C, H, W = x.shape
    gh, gw = H // P, W // P
    x = x.reshape(C, gh // M, M, P, gw // M, M, P)  # (C, gh/M, M, P, gw/M, M, P)
    x = x.permute(1, 4, 2, 5, 0, 3, 6)  # (gh/M, gw/M, M, M, C, P, P)
    x = x.unsqueeze(5).expand(-1, -1, -1, -1, -1, T, -1, -1)  # (gh/M, gw/M, M, M, C, T, P, P)
    return x.reshape(gh * gw, C * T * P * P)  # (gh*gw, C*T*P*P)


def _content_hash(rgb_pixels: bytes, size: tuple[int, int], resized: tuple[int, int],
                  config: ImageProcessorConfig, min_pixels: int, max_pixels: int) -> str:
    """sha256 over every input of pixel_values: the decoded RGB pixels, their size, and the preprocessing params.

    The parameters go first as canonical JSON (floats print exactly), then a NUL, then the raw pixels.
    """
    params = {
        "version": HASH_VERSION, "size_hw": list(size), "resized_hw": list(resized), "resample": "bicubic",
        "min_pixels": min_pixels, "max_pixels": max_pixels, "patch_size": config.patch_size,
        "temporal_patch_size": config.temporal_patch_size, "merge_size": config.merge_size,
        "image_mean": list(config.image_mean), "image_std": list(config.image_std),
        "rescale_factor": config.rescale_factor,
    }
    h = hashlib.sha256(json.dumps(params, sort_keys=True).encode() + b"\0")
    h.update(rgb_pixels)
    return h.hexdigest()
