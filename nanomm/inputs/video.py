"""Decoded videos in, pixel patches out: keep some frames, resize each one, pair them up, patchify.

A video is a stack of frames, and Qwen2-VL's vision tower already eats time: every patch row is
C x T x P x P = 3 x 2 x 14 x 14 values, two frames deep. A still image fills the two slots with the same
frame (nanomm/inputs/image.py); a video puts two consecutive frames there. So a clip of 16 frames at 56x84
becomes 8 temporal patches of 4x6 14-px patches (grid_thw (8, 4, 6), 192 rows of 1176), and after the 2x2
merge 8 x 2 x 3 = 48 visual tokens: <|video_pad|> x 48 in the prompt. lessons/17-video.md walks through it.

Two stages, as for images: `nanomm/inputs/video_io.py`'s `load_video` turns what the caller sent (frames, an
array, an animation, an MP4 or WebM) into a `VideoInput` under `VideoLimits`, checking the untrusted input before
any pixel is decoded; then, here, `preprocess_video` reproduces transformers 5.24's video processors bit for bit:
`Qwen2VLVideoProcessor` (Qwen2-VL, Qwen2.5-VL) and `Qwen3VLVideoProcessor` (tests/test_video_processor.py checks
both against fixtures that transformers itself wrote). Which frames are kept, the pixel cap and Qwen3-VL's
timestamps are the family's rules (inputs/video_settings.py); the rest is shared:
  - the kept frames: every one for Qwen2-VL unless do_sample_frames is asked for with a rate or a count, 2 a
    second for Qwen3-VL;
  - smart_resize, with the cap of each frame (Qwen2-VL: the image processor's min_pixels / max_pixels) or of the
    whole clip (Qwen3-VL);
  - torch's antialiased bicubic resize of the uint8 frames, which is what torchvision runs on the CPU. It is not
    PIL's resize (the image path): along one axis the two agree to +-1, but where one side shrinks and the other
    grows they differ by up to about 20 levels;
  - an odd frame count is padded by repeating the last frame, up to a multiple of temporal_patch_size;
  - rescale and normalise fused the way HF's torch backend does it: (x - mean*255) / (std*255) in float32, which
    differs from the image path's float64 rescale in the last bit of some values;
  - patchify in the image layout, rows (t-group, merged row, merged col, row in block, col in block).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field, replace
from functools import cached_property

import torch
import torch.nn.functional as F
from PIL import Image

from nanomm.errors import InvalidInputError, is_finite_number
from nanomm.inputs.compression import CompressionPolicy, kept_layout
from nanomm.inputs.image import ImageProcessorConfig, _pixel_cap
from nanomm.inputs.video_io import VideoInput, _tensor_bytes
from nanomm.inputs.video_pruning import kept_per_patch
from nanomm.inputs.video_settings import VideoSettings
from nanomm.model.rope import spaced_in_time

HASH_VERSION = "nanomm-video-v3"  # bump when the preprocessing changes, so old cache keys stop matching


@dataclass(eq=False)
class ProcessedVideo:
    """One clip, resized, padded to whole temporal patches and hashed; its float patches are built on first use.

    As for `ProcessedImage`, `pixel_values` is a cached property so that the float work runs on the thread that
    reads it (the engine's), and never for a clip that the encoder cache already holds.
    """

    frames_rgb: bytes = field(repr=False)  # (T_padded, H, W, 3) uint8, resized; an odd clip's last frame repeated
    grid_thw: tuple[int, int, int]  # (grid_t, grid_h, grid_w) in patch units; grid_t = T_padded / temporal_patch
    content_hash: str  # sha256 of the decoded frames and every parameter that changes the tokens or their places
    config: ImageProcessorConfig = field(repr=False)
    fps: float  # of the frames kept (transformers' sampled_fps): the clip's own rate unless frames were sampled
    timestamps: tuple[float, ...] | None = None  # Qwen3-VL: each temporal patch's time in seconds, for the prompt
    kept: tuple[torch.Tensor, ...] | None = None  # per temporal patch, the tokens pruning keeps (video_pruning.py)
    # lesson 10's compression, applied to each temporal patch as to a picture (inputs/compression.py)
    compression: CompressionPolicy | None = None
    is_video = True  # a class attribute: says what it is

    def with_compression(self, policy: CompressionPolicy | None) -> "ProcessedVideo":
        """This clip with each temporal patch's tokens compressed by `policy`, which joins its hash. A pruned clip
        (video_pruning.py) is already cut down: it stays as it is."""
        if policy is None or self.kept is not None:
            return self
        content_hash = hashlib.sha256(f"{self.content_hash}\0{policy.key}".encode()).hexdigest()
        return replace(self, content_hash=content_hash, compression=policy)

    @cached_property
    def pixel_values(self) -> torch.Tensor:
        """(grid_t*grid_h*grid_w, C*T*P*P) float32: HF's pixel_values_videos for this clip."""
        grid_t, grid_h, grid_w = self.grid_thw
        P, T = self.config.patch_size, self.config.temporal_patch_size
        x = torch.frombuffer(bytearray(self.frames_rgb), dtype=torch.uint8)
        x = x.view(grid_t * T, grid_h * P, grid_w * P, 3).permute(0, 3, 1, 2)  # (T_padded, C, H, W)
        return _patchify_video(_rescale_and_normalize_video(x, self.config), self.config)

    @property
    def merge_size(self) -> int:
        return self.config.merge_size

    @property
    def token_grid(self) -> tuple[int, int, int]:
        """(T, H, W) of the vision tower's output tokens: one per temporal patch and merge_size**2 patches."""
        grid_t, grid_h, grid_w = self.grid_thw
        return grid_t, grid_h // self.merge_size, grid_w // self.merge_size

    @property
    def num_encoded_tokens(self) -> int:
        return math.prod(self.token_grid)

    @property
    def num_tokens(self) -> int:
        """The number of <|video_pad|> tokens: every encoded token, or those pruning or compression keeps."""
        if self.kept is not None:
            return sum(len(k) for k in self.kept)
        return self.token_grid[0] * kept_layout((1, *self.token_grid[1:]), self.compression)[0]

    def layout(self, interval: float | None, coords: torch.Tensor | None):
        """mrope_positions' `compressed` entry, (extent, (3, tokens) positions relative to the clip's start), for
        a clip whose tokens are not one per cell of its grid; None for one whose are. The time axis is spaced by
        `interval`, as M-RoPE places the clip.
          - pruned: each kept token where it sat unpruned;
          - compressed: each token at its own patch's time id plus its place in the patch (coords, (3, tokens)
            with t = 0, from the encoder; zeros while unknown). The text after resumes past the latest time and
            the largest (pooled) row or column."""
        if self.kept is not None:
            extent, cells = spaced_in_time(self.token_grid, interval)
            return extent, cells[:, self.kept_rows]
        if self.compression is None:
            return None
        t, h, w = self.token_grid
        times = spaced_in_time((t, 1, 1), interval)[1][0]  # (t,): each patch's time id
        per_patch, patch_extent = kept_layout((1, h, w), self.compression)
        origins = torch.zeros(3, t * per_patch, dtype=torch.long)
        origins[0] = times.repeat_interleave(per_patch)
        return max(int(times[-1]) + 1, patch_extent), origins + coords

    @property
    def kept_rows(self) -> torch.Tensor | None:
        """Which of the clip's encoded tokens (t-major) the language model gets; None: all of them."""
        if self.kept is None:
            return None
        per_patch = math.prod(self.token_grid[1:])
        return torch.cat([g * per_patch + k for g, k in enumerate(self.kept)])

    @property
    def position_extent(self) -> int:
        """M-RoPE positions the clip spans, max(token_grid): the rule of transformers 4.x and vLLM. (transformers
        5.24 moves the text after a video on by max(h, w) of the token grid alone, ignoring its length.)"""
        return max(self.token_grid)

    @property
    def second_per_grid(self) -> float:
        """Seconds one temporal patch spans: Qwen2.5-VL's second_per_grid_ts, which spaces the M-RoPE t ids."""
        return self.config.temporal_patch_size / self.fps


    def temporal_groups(self) -> list["VideoGroup"]:
        """The clip as the engine encodes it: one unit per temporal patch, each encoded and cached on its own
        when prefill reaches it (the tower attends within a temporal patch only, so the tokens are the same)."""
        return [VideoGroup(self, g) for g in range(self.grid_thw[0])]


@dataclass(eq=False)
class VideoGroup:
    """Temporal patch `index` of a clip: a unit of encoding with the duck type of `ProcessedImage` (its pixel
    rows, a (1, grid_h, grid_w) grid, its own hash), while its tokens keep the clip's M-RoPE positions (computed
    from the whole clip before it is split, inputs/prompt.py)."""
    video: ProcessedVideo
    index: int
    is_video = True

    @property
    def grid_thw(self) -> tuple[int, int, int]:
        return (1, *self.video.grid_thw[1:])

    @property
    def content_hash(self) -> str:
        return hashlib.sha256(f"{self.video.content_hash}\0temporal patch {self.index}".encode()).hexdigest()

    @property
    def frames_rgb(self) -> bytes:
        """(temporal_patch_size, H, W, 3) uint8: this patch's frames, resized (what an encoder service is sent)."""
        frame_bytes = len(self.video.frames_rgb) // (self.video.grid_thw[0] * self.config.temporal_patch_size)
        per_patch = frame_bytes * self.config.temporal_patch_size
        return self.video.frames_rgb[self.index * per_patch:(self.index + 1) * per_patch]

    @property
    def config(self):
        return self.video.config

    @cached_property
    def pixel_values(self) -> torch.Tensor:
        """(grid_h*grid_w, C*T*P*P) float32: this temporal patch's rows of the clip's pixel values."""
        rows = self.video.grid_thw[1] * self.video.grid_thw[2]
        return self.video.pixel_values[self.index * rows:(self.index + 1) * rows]

    @property
    def merge_size(self) -> int:
        return self.video.merge_size

    @property
    def token_grid(self) -> tuple[int, int, int]:
        return (1, *self.video.token_grid[1:])

    @property
    def num_encoded_tokens(self) -> int:
        return math.prod(self.token_grid)

    @property
    def kept_rows(self) -> torch.Tensor | None:
        return None if self.video.kept is None else self.video.kept[self.index]

    @property
    def compression(self) -> CompressionPolicy | None:
        return self.video.compression

    @property
    def num_tokens(self) -> int:
        if self.kept_rows is not None:
            return len(self.kept_rows)
        return kept_layout(self.token_grid, self.compression)[0]

    @property
    def position_extent(self) -> int:
        """As a picture's (a Qwen3-VL patch is placed as one): how far past its start the text resumes."""
        return kept_layout(self.token_grid, self.compression)[1]

    def layout(self, interval: float | None, coords: torch.Tensor | None):
        """A Qwen3-VL patch, placed as a picture of its own: as `ProcessedVideo.layout`, with no time axis to space
        (interval is unused) and coords this patch's own."""
        if self.kept_rows is not None:
            extent, cells = spaced_in_time(self.token_grid, None)
            return extent, cells[:, self.kept_rows]
        return None if self.compression is None else (self.position_extent, coords)


def preprocess_video(video: VideoInput, config: ImageProcessorConfig, *, min_pixels=None, max_pixels=None,
                     name: str = "video", settings: VideoSettings | None = None) -> ProcessedVideo:
    """Sample, resize, pad and hash one clip. settings: the family's video processor (inputs/video_settings.py);
    None: Qwen2-VL's, every frame kept, each capped by config's min_pixels / max_pixels (or the ones given here)."""
    frames = _check_video_input(video, name)
    if settings is None:
        lo, hi = _pixel_cap(config, min_pixels, max_pixels, name)
        settings = VideoSettings("qwen2", replace(config, min_pixels=lo, max_pixels=hi))
    pixels = settings.pixels
    indices = settings.frame_indices(len(frames), video.fps, name)
    width, height = frames[0].size
    resized = settings.resized(len(indices), height, width, name)
    if resized[0] * resized[1] > pixels.max_image_pixels:  # a huge min_pixels would upscale every frame
        raise InvalidInputError(f"{name}: min_pixels={pixels.min_pixels} would resize each frame to {resized[1]}x"
                                f"{resized[0]}, over the pixel limit of {pixels.max_image_pixels:,} (max_image_pixels)")
    clip = b"".join(frames[i].tobytes() for i in indices)  # (T, H, W, 3) uint8: the kept frames
    content_hash = _content_hash(clip, indices, len(frames), (height, width), float(video.fps), resized, settings)
    if resized != (height, width):  # torchvision returns a frame already at the size as is
        clip = _resize_clip(clip, len(indices), (height, width), resized)  # (T, h, w, 3)
    clip, padded = _pad_clip(clip, len(indices), pixels.temporal_patch_size)  # (T_padded, h, w, 3)
    grid_thw = (padded // pixels.temporal_patch_size, resized[0] // pixels.patch_size,
                resized[1] // pixels.patch_size)
    sampled_fps = len(indices) / len(frames) * float(video.fps)
    kept = None
    if settings.pruning_rate:
        frames_thwc = torch.frombuffer(bytearray(clip), dtype=torch.uint8).view(padded, *resized, 3)
        kept = tuple(kept_per_patch(frames_thwc, pixels.factor, pixels.temporal_patch_size, settings.pruning_rate))
    return ProcessedVideo(clip, grid_thw, content_hash, pixels, sampled_fps,
                          settings.timestamps(indices, float(video.fps)), kept)


def _check_video_input(video, name: str) -> tuple:
    """A VideoInput built by hand skips load_video: check what preprocessing relies on (limits are load_video's)."""
    if not isinstance(video, VideoInput):
        raise InvalidInputError(f"{name}: expected a VideoInput (see load_video), got {type(video).__qualname__}")
    frames = tuple(video.frames)
    if not frames:
        raise InvalidInputError(f"{name}: the video has no frames")
    if not all(isinstance(f, Image.Image) and f.mode == "RGB" for f in frames):
        raise InvalidInputError(f"{name}: every frame must be a PIL image in mode RGB")
    if any(f.size != frames[0].size for f in frames):
        raise InvalidInputError(f"{name}: frames of different sizes; every frame of a video must be the same size")
    if not is_finite_number(video.fps) or video.fps <= 0:
        raise InvalidInputError(f"{name}: fps must be a positive number, got {video.fps!r}")
    return frames


# ---------------------------------------------------------------------------------------------------------------
# Preprocessing


def _resize_clip(clip: bytes, num_frames: int, size: tuple[int, int], resized: tuple[int, int]) -> bytes:
    """(T, H, W, 3) uint8 -> (T, h, w, 3) uint8: torchvision's CPU resize of uint8 frames (BICUBIC, antialias=True),
    which is torch's native uint8 kernel (fixed-point, no float round trip)."""
    x = torch.frombuffer(bytearray(clip), dtype=torch.uint8).view(num_frames, *size, 3)  # (T, H, W, C)
    x = F.interpolate(x.permute(0, 3, 1, 2), size=list(resized), mode="bicubic", align_corners=False,
                      antialias=True)  # (T, C, h, w)
    return _tensor_bytes(x.permute(0, 2, 3, 1))  # (T, h, w, C)


def _pad_clip(clip: bytes, num_frames: int, temporal_patch_size: int) -> tuple[bytes, int]:
    """(T, h, w, 3) -> (T_padded, h, w, 3) and T_padded: the last frame repeated up to a multiple of the
    temporal patch size (HF pads after normalising; the same values, as normalising works pixel by pixel)."""
    pad = -num_frames % temporal_patch_size
    last_frame = clip[len(clip) // num_frames * (num_frames - 1):]
    return clip + last_frame * pad, num_frames + pad


def _rescale_and_normalize_video(x: torch.Tensor, config: ImageProcessorConfig) -> torch.Tensor:
    """uint8 -> float32 as HF's torch backend does it for videos, rescale fused into normalize:
    (x - mean / rescale_factor) / (std / rescale_factor), all in float32."""
    mean = torch.tensor(config.image_mean, dtype=torch.float32) * (1.0 / config.rescale_factor)
    std = torch.tensor(config.image_std, dtype=torch.float32) * (1.0 / config.rescale_factor)
    return x.to(torch.float32).sub_(mean.view(-1, 1, 1)).div_(std.view(-1, 1, 1))  # (T, C, H, W)


def _patchify_video(x: torch.Tensor, config: ImageProcessorConfig) -> torch.Tensor:
    """(T_padded, C, H, W) -> (grid_t*gh*gw, C*T*P*P): the image layout with two real frames per row."""
    P, M, T = config.patch_size, config.merge_size, config.temporal_patch_size
    frames, C, H, W = x.shape
    grid_t, gh, gw = frames // T, H // P, W // P
    x = x.reshape(grid_t, T, C, gh // M, M, P, gw // M, M, P)  # (gt, T, C, gh/M, M, P, gw/M, M, P)
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)  # (gt, gh/M, gw/M, M, M, C, T, P, P)
    return x.reshape(grid_t * gh * gw, C * T * P * P)


def _content_hash(clip: bytes, indices: list[int], total: int, size: tuple[int, int], fps: float,
                  resized: tuple[int, int], settings: VideoSettings) -> str:
    """sha256 of "video:", the parameters as canonical JSON, a NUL, then the kept (T, H, W, 3) frames in order.

    fps and which frames were kept are in it: they change no pixel, but Qwen2.5-VL spaces the video's M-RoPE time
    ids by it and Qwen3-VL writes times into the prompt, so two rates give different KV for the same frames (the
    prefix cache keys on this hash)."""
    config = settings.pixels
    params = {
        "version": HASH_VERSION, "frames_thw": [total, *size], "kept_frames": indices, "resized_hw": list(resized),
        "fps": fps,
        "resample": "torch-bicubic-antialias-uint8", "min_pixels": config.min_pixels, "max_pixels": config.max_pixels,
        "patch_size": config.patch_size, "temporal_patch_size": config.temporal_patch_size,
        "merge_size": config.merge_size, "image_mean": list(config.image_mean), "image_std": list(config.image_std),
        "rescale_factor": config.rescale_factor, "sampling": settings.describe(),
    }
    h = hashlib.sha256(b"video:" + json.dumps(params, sort_keys=True).encode() + b"\0")
    h.update(clip)
    return h.hexdigest()
