"""Which frames of a clip the model sees, at what size, and when they were taken: the video processor's settings.

Lesson: lessons/17-video.md (section "Three families, two video processors").

The families differ, and transformers 5.24 is the reference for each:
  - Qwen2-VL and Qwen2.5-VL (`Qwen2VLVideoProcessor`): do_sample_frames is False, so every frame is kept and a
    request's `fps` or `num_frames` changes nothing unless it also sets do_sample_frames=True (then: a whole number
    of temporal patches at a fixed stride); each frame is capped like a picture (min_pixels..max_pixels per frame).
  - Qwen3-VL (`Qwen3VLVideoProcessor`): do_sample_frames is True and fps 2: frames are sampled, at least
    min_frames and at most max_frames, spread evenly over the clip; the pixel budget is the whole clip's
    (frames x height x width, the `size` of video_preprocessor_config.json); and each temporal patch's time goes
    into the prompt as text, "<1.5 seconds>", before its own <|vision_start|> ... <|vision_end|>.
A rate is read against the clip's own frame rate (transformers' video_metadata.fps); Qwen2.5-VL's
second_per_grid_ts and Qwen3-VL's times follow from the frames kept (inputs/video.py).

`VideoSettings` holds one engine's settings: the family's, then the checkpoint's video_preprocessor_config.json,
then the engine's `media_io_kwargs["video"]` (`with_engine_kwargs`: there a rate or a count turns sampling on, as
vLLM's video loader samples the frames it decodes by them); a request's mm_processor_kwargs may change the sampling
and lower the caps (`with_request`), never raise them. Everything here is arithmetic on sizes and indices: no pixel
is touched.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from nanomm.errors import InvalidInputError, check_int, is_finite_number
from nanomm.inputs.image import MAX_ASPECT_RATIO, ImageProcessorConfig, smart_resize

QWEN3_CLIP_PIXELS = (4096, 25165824)  # Qwen3-VL's video_preprocessor_config.json size: shortest / longest edge
QWEN3_MEAN_STD = (0.5, 0.5, 0.5)
# The keys a request's mm_processor_kwargs (or the engine's media_io_kwargs["video"]) may set for its videos.
SAMPLING_KEYS = ("do_sample_frames", "fps", "num_frames", "min_frames", "max_frames")
PIXEL_KEYS = ("video_min_pixels", "video_max_pixels")
REQUEST_KEYS = SAMPLING_KEYS + PIXEL_KEYS + ("video_pruning_rate",)  # the last: inputs/video_pruning.py


@dataclass(frozen=True)
class VideoSettings:
    """rules: "qwen2" (Qwen2-VL, Qwen2.5-VL) or "qwen3" (Qwen3-VL): which of transformers' processors to follow.
    pixels: the patch geometry and normalisation, with min_pixels/max_pixels the cap per frame ("qwen2") or per
    clip ("qwen3"). do_sample_frames: False keeps every frame, whatever fps and num_frames say. fps / num_frames
    (at most one of the two): sample that many frames a second, or that many in all; neither: refused ("qwen2",
    as transformers fails) or every frame, between min_frames and max_frames ("qwen3"). A rate keeps between
    min_frames and max_frames. pruning_rate: the share of each later temporal patch's tokens dropped where they
    barely change (inputs/video_pruning.py)."""

    rules: str
    pixels: ImageProcessorConfig
    do_sample_frames: bool = False
    fps: float | None = None
    num_frames: int | None = None
    min_frames: int = 4
    max_frames: int = 768
    pruning_rate: float = 0.0

    @classmethod
    def for_model(cls, model_type: str, image_config: ImageProcessorConfig,
                  video_preprocessor: dict | None = None) -> "VideoSettings":
        """The family's defaults, then what the checkpoint's video_preprocessor_config.json sets."""
        if model_type == "qwen3_vl":
            lo, hi = QWEN3_CLIP_PIXELS
            pixels = replace(image_config, min_pixels=lo, max_pixels=hi, image_mean=QWEN3_MEAN_STD,
                             image_std=QWEN3_MEAN_STD)
            settings = cls("qwen3", pixels, do_sample_frames=True, fps=2.0)
        else:
            settings = cls("qwen2", image_config)
        return settings.with_file(video_preprocessor or {})

    def with_file(self, d: dict) -> "VideoSettings":
        """What a video_preprocessor_config.json changes: the clip's pixel budget, mean and std, the sampling (each
        key the processor's attribute of that name, as from_pretrained sets it; a null fps or num_frames unsets it)."""
        size = d.get("size") or {}
        pixels = replace(self.pixels, **{key: d[key] for key in ("image_mean", "image_std") if key in d},
                         **{key: size[edge] for key, edge in (("min_pixels", "shortest_edge"),
                                                               ("max_pixels", "longest_edge")) if edge in size})
        settings = replace(self, pixels=pixels, **{key: None for key in ("fps", "num_frames")
                                                   if key in d and d[key] is None})
        sampling = {key: d[key] for key in SAMPLING_KEYS if d.get(key) is not None}
        return settings.with_request(sampling, "video_preprocessor_config.json", cap=False)

    def with_engine_kwargs(self, kwargs: dict) -> "VideoSettings":
        """The engine's media_io_kwargs["video"]: as a request's, except that a rate or a count turns sampling on
        unless do_sample_frames says otherwise (vLLM's video loader samples the frames it decodes by these)."""
        if not isinstance(kwargs, dict):
            raise InvalidInputError(f"media_io_kwargs['video'] must be a dict, got {type(kwargs).__qualname__}")
        if kwargs.get("fps") is not None or kwargs.get("num_frames") is not None:
            kwargs = {"do_sample_frames": True, **kwargs}
        settings = self.with_request(kwargs, "media_io_kwargs['video']", cap=False)
        settings._check_something_to_sample_by("media_io_kwargs['video']")
        return settings

    def with_request(self, kwargs: dict, name: str, cap: bool = True) -> "VideoSettings":
        """These settings with a request's (or the engine's media_io_kwargs') changes, each checked. With cap, the
        frame and pixel caps may only go down: they bound a clip's visual tokens, so its KV and encoder memory."""
        unknown = set(kwargs) - set(REQUEST_KEYS)
        if unknown:
            raise InvalidInputError(f"{name}: unknown video settings {sorted(unknown)}; allowed: {list(REQUEST_KEYS)}")
        new, changes = {}, {}
        for key in ("num_frames", "min_frames", "max_frames", "video_min_pixels", "video_max_pixels"):
            if kwargs.get(key) is not None:
                new[key] = check_int(kwargs[key], f"{name}: {key}", error=InvalidInputError)
        if kwargs.get("do_sample_frames") is not None:
            if not isinstance(kwargs["do_sample_frames"], bool):
                raise InvalidInputError(f"{name}: do_sample_frames must be true or false, got "
                                        f"{kwargs['do_sample_frames']!r}")
            changes["do_sample_frames"] = kwargs["do_sample_frames"]
        if kwargs.get("fps") is not None:
            if not is_finite_number(kwargs["fps"]) or kwargs["fps"] <= 0:
                raise InvalidInputError(f"{name}: fps must be a positive number, got {kwargs['fps']!r}")
            new["fps"] = float(kwargs["fps"])
        if kwargs.get("video_pruning_rate") is not None:
            from nanomm.inputs.video_pruning import check_pruning_rate

            changes["pruning_rate"] = check_pruning_rate(kwargs["video_pruning_rate"], f"{name}: video_pruning_rate")
        if "fps" in new and "num_frames" in new:
            raise InvalidInputError(f"{name}: give fps or num_frames, not both")
        if cap:
            self._check_caps(new, name)
        changes.update({key: new[key] for key in ("min_frames", "max_frames") if key in new})
        if "fps" in new or "num_frames" in new:  # one replaces the other
            changes.update(fps=new.get("fps"), num_frames=new.get("num_frames"))
        lo, hi = new.get("video_min_pixels"), new.get("video_max_pixels", self.pixels.max_pixels)
        lo = min(self.pixels.min_pixels, hi) if lo is None else lo  # a lower cap takes the floor down with it
        if lo > hi:
            raise InvalidInputError(f"{name}: video_min_pixels ({lo}) is over video_max_pixels ({hi})")
        settings = replace(self, pixels=replace(self.pixels, min_pixels=lo, max_pixels=hi), **changes)
        if settings.min_frames > settings.max_frames:
            raise InvalidInputError(f"{name}: min_frames ({settings.min_frames}) is over max_frames "
                                    f"({settings.max_frames})")
        if cap:  # a request's: refused before a frame is decoded (a file's may yet get a rate from the engine)
            settings._check_something_to_sample_by(name)
        return settings

    def _check_something_to_sample_by(self, name: str) -> None:
        """Qwen2VLVideoProcessor told to sample with neither a rate nor a count fails (a TypeError in its
        sample_frames); Qwen3VLVideoProcessor keeps every frame then, between min_frames and max_frames."""
        if self.rules == "qwen2" and self.do_sample_frames and self.fps is None and self.num_frames is None:
            raise InvalidInputError(f"{name}: do_sample_frames needs an fps or a num_frames to sample by")

    def _check_caps(self, new: dict, name: str) -> None:
        for key, cap in (("max_frames", self.max_frames), ("num_frames", self.max_frames),
                         ("video_max_pixels", self.pixels.max_pixels), ("video_min_pixels", self.pixels.max_pixels)):
            if new.get(key, 0) > cap:
                raise InvalidInputError(f"{name}: {key}={new[key]} is over the engine's cap of {cap}")

    @property
    def samples(self) -> bool:
        """Whether frames are chosen at all (transformers' do_sample_frames): else every frame is kept."""
        return self.do_sample_frames

    def frame_indices(self, total: int, video_fps: float, name: str) -> list[int]:
        """Which of a clip's `total` frames (taken at video_fps, its metadata's fps) are kept, in order, by the
        family's rule."""
        if not self.do_sample_frames:
            return list(range(total))
        if self.rules == "qwen3":
            indices = _qwen3_indices(self, total, video_fps)
        else:
            indices = _qwen2_indices(self, total, video_fps, name)
        if not indices:
            raise InvalidInputError(f"{name}: sampling {total} frame(s) at {self.fps or self.num_frames} keeps none "
                                    f"(a clip needs at least {self.pixels.temporal_patch_size} frames)")
        return indices

    def resized(self, num_frames: int, height: int, width: int, name: str) -> tuple[int, int]:
        """(height, width) of every frame after resizing: the family's smart_resize."""
        factor, lo, hi = self.pixels.factor, self.pixels.min_pixels, self.pixels.max_pixels
        if self.rules == "qwen2":
            return smart_resize(height, width, factor, lo, hi)
        if num_frames < self.pixels.temporal_patch_size:
            raise InvalidInputError(f"{name}: Qwen3-VL needs a clip of at least {self.pixels.temporal_patch_size} "
                                    f"frames, got {num_frames}")
        return _clip_smart_resize(num_frames, height, width, self.pixels.temporal_patch_size, factor, lo, hi)

    def timestamps(self, indices: list[int], video_fps: float) -> tuple[float, ...] | None:
        """Qwen3-VL: each temporal patch's time in seconds, the mean of its first and last frame's (an odd clip's
        last frame repeated). None for the families without timestamps in the prompt."""
        if self.rules != "qwen3":
            return None
        T = self.pixels.temporal_patch_size
        padded = list(indices) + [indices[-1]] * (-len(indices) % T)
        seconds = [i / video_fps for i in padded]
        return tuple((seconds[g] + seconds[g + T - 1]) / 2 for g in range(0, len(seconds), T))

    def describe(self) -> dict:
        """The settings that change a clip's tokens, for its content hash."""
        return {"rules": self.rules, "do_sample_frames": self.do_sample_frames, "fps": self.fps,
                "num_frames": self.num_frames, "min_frames": self.min_frames, "max_frames": self.max_frames,
                "pruning_rate": self.pruning_rate}


def timestamp_text(seconds: float) -> str:
    """How Qwen3-VL writes a temporal patch's time in the prompt."""
    return f"<{seconds:.1f} seconds>"


def _qwen2_indices(s: VideoSettings, total: int, video_fps: float, name: str) -> list[int]:
    """Qwen2VLVideoProcessor.sample_frames: a whole number of temporal patches, taken at a fixed stride."""
    T = s.pixels.temporal_patch_size
    if s.num_frames is not None:
        count = round(s.num_frames / T) * T
    elif s.fps is None:
        s._check_something_to_sample_by(name)
    else:
        most = math.floor(min(s.max_frames, total) / T) * T
        count = min(max(total / video_fps * s.fps, s.min_frames), most, total)
        count = math.floor(count / T) * T
    if count > total or count <= 0:
        return []
    return torch.arange(0, total, total / count).int().tolist()  # float32 steps, truncated: as transformers


def _qwen3_indices(s: VideoSettings, total: int, video_fps: float) -> list[int]:
    """Qwen3VLVideoProcessor.sample_frames: `count` frames spread evenly from the first to the last, rounded (a
    count over the clip's frames repeats some)."""
    count = s.num_frames
    if count is None and s.fps is not None:
        count = min(max(int(total / video_fps * s.fps), s.min_frames), s.max_frames, total)
    elif count is None:  # neither a rate nor a count: every frame, between min_frames and max_frames
        count = min(max(total, s.min_frames), s.max_frames)
    if count == 1:
        return [0]
    step = (total - 1) / (count - 1)  # numpy's linspace: i * step, the last one exactly total - 1
    return [round(i * step) for i in range(count - 1)] + [total - 1]


def _clip_smart_resize(num_frames: int, height: int, width: int, temporal: int, factor: int, min_pixels: int,
                       max_pixels: int) -> tuple[int, int]:
    """Qwen3-VL's smart_resize for a clip: the budget bounds frames x height x width, the frames rounded to whole
    temporal patches; a side under `factor` is first scaled up to it."""
    if min(height, width) < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise InvalidInputError(f"absolute aspect ratio must be smaller than {MAX_ASPECT_RATIO}, "
                                f"got {max(height, width) / min(height, width)}")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    t_bar = round(num_frames / temporal) * temporal
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt(num_frames * height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar
