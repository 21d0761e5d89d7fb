"""Videos in, pixel patches out: load the frames safely, keep some, resize each one, pair them up, patchify.

A video is a stack of frames, and Qwen2-VL's vision tower already eats time: every patch row is
C x T x P x P = 3 x 2 x 14 x 14 values, two frames deep. A still image fills the two slots with the same
frame (nanomm/inputs/image.py); a video puts two consecutive frames there. So a clip of 16 frames at 56x84
becomes 8 temporal patches of 4x6 14-px patches (grid_thw (8, 4, 6), 192 rows of 1176), and after the 2x2
merge 8 x 2 x 3 = 48 visual tokens: <|video_pad|> x 48 in the prompt. lessons/17-video.md walks through it.

Two stages, as for images:
  1. `load_video` turns what the caller sent (a list of PIL images, a uint8 array, or an animated GIF, WebP or
     APNG, or an MP4 or WebM, as a path, bytes or data URL) into a `VideoInput`: RGB frames of one size and a
     frame rate. It is untrusted input: sizes, frame counts and byte counts are checked against `VideoLimits` from
     the header, before any pixel is decoded, and every problem is an `InvalidInputError` that names the input.
     Pillow decodes the animations; MP4 and WebM need the `video` extra (PyAV, FFmpeg's libraries, imported only
     when such a file arrives: scripts/bench_video_decoders.py measured it against the other decoders).
  2. `preprocess_video` reproduces transformers 5.24's video processors bit for bit: `Qwen2VLVideoProcessor`
     (Qwen2-VL, Qwen2.5-VL) and `Qwen3VLVideoProcessor` (tests/test_video_processor.py checks both against
     fixtures that transformers itself wrote). Which frames are kept, the pixel cap and Qwen3-VL's timestamps are
     the family's rules (inputs/video_settings.py); the rest is shared:
       - the kept frames: every one for Qwen2-VL unless a rate or a count is asked for, 2 a second for Qwen3-VL;
       - smart_resize, with the cap of each frame (Qwen2-VL: the image processor's min_pixels / max_pixels) or of
         the whole clip (Qwen3-VL);
       - torch's antialiased bicubic resize of the uint8 frames, which is what torchvision runs on the CPU.
         It is not PIL's resize (the image path): along one axis the two agree to +-1, but where one side
         shrinks and the other grows they differ by up to about 20 levels;
       - an odd frame count is padded by repeating the last frame, up to a multiple of temporal_patch_size;
       - rescale and normalise fused the way HF's torch backend does it: (x - mean*255) / (std*255) in float32,
         which differs from the image path's float64 rescale in the last bit of some values;
       - patchify in the image layout, rows (t-group, merged row, merged col, row in block, col in block).
"""

from __future__ import annotations

import base64
import binascii
import ctypes
import hashlib
import io
import json
import math
import os
from dataclasses import dataclass, field, replace
from fractions import Fraction
from functools import cached_property

import torch
import torch.nn.functional as F
from PIL import Image

from nanomm.errors import InvalidInputError, check_int, is_finite_number
from nanomm.inputs.compression import CompressionPolicy, kept_layout
from nanomm.inputs.image import ImageProcessorConfig, _pixel_cap, to_rgb
from nanomm.inputs.image_io import _data_url_payload, _read_file, _short, decode_errors
from nanomm.inputs.video_pruning import kept_per_patch
from nanomm.inputs.video_settings import VideoSettings
from nanomm.model.rope import spaced_in_time

DEFAULT_FPS = 2.0  # the frame rate of frames given as a list or an array, when the caller does not say
VIDEO_FORMATS = ("GIF", "WEBP", "PNG")  # Pillow's animated formats (PNG covers APNG)
# MP4 and WebM, told apart by their first bytes (never by a file name or a media type): FFmpeg's demuxer for each.
# Naming the demuxer means FFmpeg never probes the format, so no playlist, concat list or image sequence demuxer
# (which open further files or URLs) ever reads the caller's bytes.
CONTAINER_DEMUXERS = {"MP4": "mov", "WebM": "matroska"}
VIDEO_EXTRA = 'pip install "nanomm[video]"'
HASH_VERSION = "nanomm-video-v2"  # bump when the preprocessing changes, so old cache keys stop matching


@dataclass(frozen=True)
class VideoLimits:
    """What `load_video` accepts. Each is checked before the frames are decoded, wherever the header tells."""

    max_frames: int = 768  # HF's max_frames for Qwen2-VL video sampling
    max_frame_pixels: int = 4096 * 4096  # width x height of one frame
    max_bytes: int = 256 * 2**20  # an encoded file, bytes or data URL (a decoded array is bounded by the two above)
    max_fps: float = 240.0
    # frames x width x height of the whole clip. A GIF of a few KB can claim 768 frames of 4096x4096: 38 GB of RGB.
    max_total_pixels: int = 2**30

    def __post_init__(self):
        for key in ("max_frames", "max_frame_pixels", "max_bytes", "max_total_pixels"):
            check_int(getattr(self, key), f"video limits: {key}")
        if not is_finite_number(self.max_fps) or self.max_fps <= 0:
            raise ValueError(f"video limits: max_fps must be a positive number, got {self.max_fps!r}")


@dataclass(frozen=True)
class VideoInput:
    """A decoded clip: RGB frames, all the same size, and the rate they were taken at (frames per second)."""

    frames: tuple  # PIL.Image.Image in mode RGB
    fps: float


def load_video(source, name: str = "video", *, fps: float | None = None,
               limits: VideoLimits = VideoLimits()) -> VideoInput:
    """A VideoInput, a list of PIL images, a (T, H, W, 3) uint8 numpy array or torch tensor, or an animated GIF,
    WebP or APNG, or an MP4 or WebM (the `video` extra), as a path, bytes or a data URL -> a VideoInput.

    fps is the clip's frame rate: for frames given as a list or an array it defaults to DEFAULT_FPS; for an
    animation it defaults to 1000 / (the mean frame duration in ms), for an MP4 or WebM to the stream's average
    frame rate. Given for a VideoInput, it replaces the clip's rate.
    """
    if fps is not None:
        fps = _check_fps(fps, name, limits)  # before anything is decoded
    if isinstance(source, VideoInput):  # its rate is checked as any other (Qwen2.5-VL spaces time ids by it)
        if fps is None:
            _check_fps(source.fps, name, limits)
            return source
        return replace(source, fps=fps)
    if isinstance(source, (list, tuple)):
        frames = _frames_from_images(source, name, limits)
        return VideoInput(frames, DEFAULT_FPS if fps is None else fps)
    if isinstance(source, torch.Tensor) or _is_numpy_array(source):
        frames = _frames_from_array(source, name, limits)
        return VideoInput(frames, DEFAULT_FPS if fps is None else fps)
    data = _encoded_bytes(source, name, limits)
    if container := _container_of(data):
        frames, file_fps = _decode_container(data, container, name, limits)
    else:
        frames, file_fps = _decode_animation(data, name, limits)
    if fps is None:
        fps = DEFAULT_FPS if file_fps is None else _check_fps(file_fps, name, limits)
    return VideoInput(frames, fps)


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


# ---------------------------------------------------------------------------------------------------------------
# Loading


def _frames_from_images(images, name: str, limits: VideoLimits) -> tuple:
    """A list of PIL images -> RGB frames. Their sizes come from their headers: checked before any is decoded."""
    if not all(isinstance(im, Image.Image) for im in images):
        raise InvalidInputError(f"{name}: a list of frames must hold PIL images only")
    _check_clip_shape(len(images), [im.size for im in images], name, limits)
    with _decoding(name):
        return tuple(to_rgb(im) for im in images)  # to_rgb converts, which loads a lazily opened image


def _is_numpy_array(x) -> bool:
    """numpy is a test tool, never imported at runtime: an array is recognised by its type's module."""
    return type(x).__module__ == "numpy" and hasattr(x, "__array_interface__")


def _frames_from_array(array, name: str, limits: VideoLimits) -> tuple:
    """A (T, H, W, 3) uint8 numpy array or torch tensor -> RGB frames."""
    shape = tuple(array.shape)
    if str(array.dtype).removeprefix("torch.") != "uint8" or len(shape) != 4 or shape[-1] != 3:
        raise InvalidInputError(f"{name}: an array of frames must be uint8 of shape (frames, height, width, 3), "
                                f"got {array.dtype} of shape {shape}")
    num_frames, height, width, _ = shape
    _check_clip_shape(num_frames, [(width, height)] * num_frames, name, limits)
    data = _tensor_bytes(array.detach().cpu()) if isinstance(array, torch.Tensor) else array.tobytes()
    n = height * width * 3
    return tuple(Image.frombytes("RGB", (width, height), data[i * n:(i + 1) * n]) for i in range(num_frames))


def _encoded_bytes(source, name: str, limits: VideoLimits) -> bytes:
    """A path, bytes or data URL -> the file's bytes, refused before reading or decoding if over max_bytes."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        _check_bytes(memoryview(source).nbytes, name, limits)  # before the copy
        data = bytes(source)
    elif isinstance(source, str) and source.startswith("data:"):
        _check_bytes(len(source) * 3 // 4, name, limits)  # the base64 payload's decoded size, roughly from above
        data = _video_data_url_payload(source, name)
    elif isinstance(source, str) and source.startswith(("http://", "https://")):
        raise InvalidInputError(f"{name}: URLs are not fetched ({_short(source)}); download the video and pass "
                                "its path or bytes")
    elif isinstance(source, (str, os.PathLike)):
        try:
            size = os.stat(source).st_size  # a FIFO says 0: _read_file refuses it, and says what else is wrong
        except (OSError, ValueError):
            size = 0
        _check_bytes(size, name, limits)
        data = _read_file(source, name)
    else:
        raise InvalidInputError(f"{name}: a video must be a list of PIL images, a (frames, height, width, 3) uint8 "
                                "array, or an animated GIF, WebP or PNG, or an MP4 or WebM, as a path, bytes or "
                                "data:image/...;base64 or data:video/...;base64 URL, got "
                                f"{type(source).__module__}.{type(source).__qualname__}")
    _check_bytes(len(data), name, limits)
    if not data:
        raise InvalidInputError(f"{name}: the video data is empty (0 bytes)")
    return data


def _decode_animation(data: bytes, name: str, limits: VideoLimits) -> tuple[tuple, float | None]:
    """An animated GIF, WebP or PNG -> (RGB frames, fps from the frame durations, or None when there are none).
    A still one is a clip of one frame.

    The canvas size and the frame count come from the file before any frame is decoded. For WebP and APNG the
    count is in the header; for GIF Pillow's n_frames walks the blocks to the end, reading no pixels (linear in
    the bytes, which max_bytes bounds). Frames decode one at a time; a GIF frame may grow the canvas, so each
    frame's size is checked again after the seek that parses its header and before it is decoded.
    """
    with _decoding(name):
        im = Image.open(io.BytesIO(data), formats=_open_formats())
        num_frames, first_size = getattr(im, "n_frames", 1), im.size
        _check_clip_shape(num_frames, [first_size], name, limits)
        frames, durations = [], []
        for index in range(num_frames):
            im.seek(index)
            _check_clip_shape(num_frames, [first_size, im.size], name, limits)
            frames.append(to_rgb(im))  # converting decodes this frame, composited over the ones before it
            durations.append(im.info.get("duration"))  # after the decode: WebP sets it there
    return tuple(frames), _fps_from_durations(durations, name)


def _open_formats() -> list[str]:
    Image.init()  # registers every plugin, so a format that this Pillow build lacks is left out, not a KeyError
    return [f for f in VIDEO_FORMATS if f in Image.OPEN]


def _fps_from_durations(durations: list, name: str) -> float | None:
    """1000 / the mean frame duration in ms; None if the file gives no durations (the caller's default then)."""
    known = [d for d in durations if d is not None]
    if not known:
        return None
    mean_ms = sum(known) / len(known)
    if mean_ms <= 0:
        raise InvalidInputError(f"{name}: the file's frames last 0 ms (an unplayable frame rate); pass fps=")
    return 1000.0 / mean_ms


def _decoding(name: str):
    """Everything Pillow or the decoder raises on bad data becomes an InvalidInputError naming the video."""
    return decode_errors(name, "the video", "a video in a supported format (animated GIF, WebP or PNG, MP4, WebM)")


def _container_of(data: bytes) -> str | None:
    """"MP4" (an ISO BMFF file: its first box is "ftyp"), "WebM" (an EBML header: WebM, or Matroska at large), or
    None (left to Pillow). The bytes decide, never a file name or a data URL's media type."""
    if data[4:8] == b"ftyp":
        return "MP4"
    if data[:4] == b"\x1a\x45\xdf\xa3":
        return "WebM"
    return None


def _import_av(container: str, name: str):
    """PyAV, the `video` extra, imported only when an MP4 or WebM arrives."""
    try:
        import av.video.reformatter  # binds av, and loads the submodule that _decode_container uses
    except ImportError:
        raise InvalidInputError(f"{name}: decoding an {container} video needs the video extra (PyAV): "
                                f"{VIDEO_EXTRA}") from None
    return av


def _decode_container(data: bytes, container: str, name: str, limits: VideoLimits) -> tuple[tuple, float | None]:
    """An MP4 or WebM -> (RGB frames, the stream's average frame rate, or None if it has none), with PyAV.

    Before any frame is decoded: a file cut short is refused from its bytes alone (its last box or its segment
    runs past the end), then FFmpeg reads the header (the demuxer named, never probed), and the frame size (the
    codec parameters) and the frame count (an MP4 lists its samples; a WebM gives its duration, which times the
    frame rate is the count) are checked against the limits. A stream may still lie about its length or change
    size midway, so as the frames come each one's size and the running count are checked again before it is kept,
    and FFmpeg itself refuses to allocate a frame far over the pixel limit (the codec's max_pixels). Frames come
    out turned as the stream's display matrix says (a phone stores a portrait clip sideways), as players show it.
    """
    av = _import_av(container, name)
    if _cut_short(data, container):
        raise InvalidInputError(f"{name}: the video is truncated or corrupt: the {container} file ends before its "
                                f"{'last box' if container == 'MP4' else 'segment'} does")
    # FFmpeg counts a frame's pixels with its width padded to the stride alignment and its height to the codec's
    # block size: the cap leaves room for that. It is the allocation bound; the limit itself is checked here.
    codec_options = {"max_pixels": str(2 * limits.max_frame_pixels + 2**20)}
    frames = []
    with _decoding(name), av.open(io.BytesIO(data), format=CONTAINER_DEMUXERS[container],
                                  options=codec_options) as box:
        stream = next(iter(box.streams.video), None)
        if stream is None or stream.codec_context is None:
            raise InvalidInputError(f"{name}: the {container} file has no video stream that can be decoded")
        width, height = stream.codec_context.width, stream.codec_context.height
        rate = stream.average_rate or stream.guessed_rate  # a Fraction, or None
        own_seconds, file_seconds = _header_seconds(av, box, stream)
        claimed = _claimed_frames(stream, max(own_seconds or 0, file_seconds or 0), rate)
        _check_clip_shape(claimed or 1, [(width, height)], name, limits)
        stream.codec_context.options = dict(codec_options)
        reformatter, rotation, end = av.video.reformatter.VideoReformatter(), None, None
        for frame in box.decode(stream):
            _check_clip_shape(len(frames) + 1, [(width, height), (frame.width, frame.height)], name, limits)
            rotation = frame.rotation if rotation is None else rotation  # the first frame's turn, for all of them
            frames.append(_frame_image(frame, reformatter, rotation))
            end = frame.time
    if not frames:
        raise InvalidInputError(f"{name}: the video has no frames")
    # A WebM whose middle is damaged ends early without an error from FFmpeg: its frames stop short of the
    # video's duration in the header (by more than a second and a tenth of it, which rounding does not explain).
    # Only the video's own duration tells: a file's may be its sound track's, which may run on past the picture.
    if own_seconds and end is not None and rate:
        start = stream.start_time * stream.time_base if stream.start_time is not None else 0
        shown, seconds = end - float(start) + 1 / float(rate), float(own_seconds)
        if seconds - shown > max(1.0, seconds / 10):
            raise InvalidInputError(f"{name}: the video is truncated or corrupt: its frames end at {shown:.2f} s "
                                    f"of the {seconds:.2f} s its header gives")
    return tuple(frames), None if not rate else float(rate)


def _header_seconds(av, box, stream) -> tuple[Fraction | None, Fraction | None]:
    """(the video stream's own duration, the file's), each None where the header does not say. The video's own:
    an MP4 track's, or the DURATION tag that FFmpeg's Matroska muxer writes for each track, or a WebM segment's
    when the video is its only stream. The file's is its longest stream's (a sound track may outlast the
    picture). Both count for the limits: a header may lie in either."""
    whole = None if box.duration is None else Fraction(box.duration, av.time_base)  # microseconds
    if stream.duration is not None and stream.time_base:
        return stream.duration * stream.time_base, whole
    tag = _tag_seconds(stream.metadata.get("DURATION", ""))
    if tag is not None:
        return tag, whole
    return (whole if len(box.streams) == 1 else None), whole


def _tag_seconds(text: str) -> Fraction | None:
    """'00:00:02.667000000' -> 2.667 s as a Fraction; None unless it is exactly that shape."""
    hours, _, rest = text.partition(":")
    minutes, _, secs = rest.partition(":")
    whole, _, fraction = secs.partition(".")
    parts = (hours, minutes, whole, fraction or "0")
    if not all(p.isascii() and p.isdigit() and len(p) <= 9 for p in parts):
        return None
    return Fraction(int(hours) * 3600 + int(minutes) * 60 + int(whole)) + Fraction(int(parts[3]), 10 ** len(parts[3]))


def _claimed_frames(stream, seconds: Fraction, rate) -> int | None:
    """The frame count the header tells, or None where it tells none (a WebM recorded live has no duration):
    an MP4's sample count, else the duration times the frame rate, in exact fractions (a hostile duration cannot
    overflow)."""
    if stream.frames > 0:
        return stream.frames
    if not rate or not seconds:
        return None
    frames = round(seconds * rate)
    return frames if frames > 0 else None


_TURNS = {90: Image.Transpose.ROTATE_90, -90: Image.Transpose.ROTATE_270,  # counterclockwise degrees
          180: Image.Transpose.ROTATE_180, -180: Image.Transpose.ROTATE_180}


def _frame_image(frame, reformatter, rotation: int):
    """A decoded frame -> a PIL RGB image: FFmpeg's conversion (the frame's own colour space and range) through
    one reusable converter (a new one per frame, as VideoFrame.to_image makes, costs twice the time), copied once
    into Pillow, then turned by the display matrix's multiple of 90 degrees.

    The picture is allocated before FFmpeg's converted frame: freed, that frame leaves the hole that the next
    picture fills. In the other order glibc's heap fragments, and a clip holds about twice its frames' bytes
    (465 MiB for 300 frames of 640x360, 198 MiB of pixels; 266 MiB this way: scripts/bench_video_decoders.py)."""
    image = Image.new("RGB", (frame.width, frame.height))
    plane = reformatter.reformat(frame, format="rgb24").planes[0]
    image.frombytes(plane, "raw", ("RGB", plane.line_size, 1))
    del plane
    turn = _TURNS.get(rotation)
    return image if turn is None else image.transpose(turn)


def _cut_short(data: bytes, container: str) -> bool:
    """Whether the file's own sizes say it was cut short, from the bytes alone. An MP4 is a run of boxes, each
    starting with its size: one that runs past the end was cut (the walk stops at anything that is not a box,
    and after 1,000 boxes). A WebM is an EBML header, then one segment whose size (unless written as unknown,
    as a live recording does) is in its header."""
    if container == "MP4":
        pos = 0
        for _ in range(1000):
            if len(data) - pos < 8:
                return False
            size, kind = int.from_bytes(data[pos:pos + 4], "big"), data[pos + 4:pos + 8]
            header = 8
            if size == 1:  # a 64-bit size follows the type
                if len(data) - pos < 16:
                    return True
                size, header = int.from_bytes(data[pos + 8:pos + 16], "big"), 16
            if size == 0:  # the box runs to the end of the file
                return False
            if size < header or not all(0x20 <= c < 0x7F for c in kind):
                return False  # not a box: FFmpeg says what is wrong
            if pos + size > len(data):
                return True
            pos += size
        return False
    pos = 4  # past the EBML header's ID
    header_size, length, _ = _ebml_size(data, pos)
    if header_size is None:
        return True  # cut inside the EBML header itself
    pos += length + header_size
    if data[pos:pos + 4] != b"\x18\x53\x80\x67":  # not a segment next (or nothing at all)
        return len(data) <= pos
    segment_size, length, unknown = _ebml_size(data, pos + 4)
    if segment_size is None:
        return True
    return not unknown and pos + 4 + length + segment_size > len(data)


def _ebml_size(data: bytes, pos: int) -> tuple[int | None, int, bool]:
    """An EBML variable-length size at pos -> (value, its length in bytes, whether it says "unknown");
    (None, 0, False) if the data ends inside it or it is malformed."""
    if pos >= len(data) or data[pos] == 0:
        return None, 0, False
    length = 8 - data[pos].bit_length() + 1  # the leading zeros, plus the marker bit
    if pos + length > len(data):
        return None, 0, False
    value = int.from_bytes(data[pos:pos + length], "big") & ((1 << (7 * length)) - 1)  # the marker bit dropped
    return value, length, value == (1 << (7 * length)) - 1


def _video_data_url_payload(url: str, name: str) -> bytes:
    """'data:video/mp4;base64,...' (or data:image/..., as for an animated GIF) -> the decoded bytes. As for
    pictures, the media type is not trusted: the bytes decide what the file is."""
    header, comma, payload = url.partition(",")
    if not (comma and header.startswith("data:video/") and header.endswith(";base64")):
        return _data_url_payload(url, name)  # data:image/..., and what is said about a malformed URL
    try:
        return base64.b64decode("".join(payload.split()), validate=True)
    except (binascii.Error, ValueError) as e:
        raise InvalidInputError(f"{name}: the data URL's base64 payload is invalid ({e})") from e


# ---------------------------------------------------------------------------------------------------------------
# Checks


def _check_clip_shape(num_frames: int, sizes: list[tuple[int, int]], name: str, limits: VideoLimits) -> None:
    """The frame count and the (width, height) of each frame against the limits, and all frames one size."""
    if num_frames == 0:
        raise InvalidInputError(f"{name}: the video has no frames")
    if num_frames > limits.max_frames:
        raise InvalidInputError(f"{name}: the video has {num_frames:,} frames, over the limit of "
                                f"{limits.max_frames:,} (max_frames)")
    width, height = sizes[0]
    if width <= 0 or height <= 0:
        raise InvalidInputError(f"{name}: the frames have zero size ({width}x{height})")
    if width * height > limits.max_frame_pixels:
        raise InvalidInputError(f"{name}: a frame is {width}x{height} = {width * height:,} pixels, over the "
                                f"limit of {limits.max_frame_pixels:,} (max_frame_pixels)")
    if num_frames * width * height > limits.max_total_pixels:
        raise InvalidInputError(f"{name}: {num_frames:,} frames of {width}x{height} are {num_frames * width * height:,}"
                                f" pixels, over the limit of {limits.max_total_pixels:,} (max_total_pixels)")
    if odd := next((size for size in sizes if size != sizes[0]), None):
        raise InvalidInputError(f"{name}: frames of different sizes ({width}x{height} and {odd[0]}x{odd[1]}); "
                                "every frame of a video must be the same size")


def _check_bytes(num_bytes: int, name: str, limits: VideoLimits) -> None:
    if num_bytes > limits.max_bytes:
        raise InvalidInputError(f"{name}: the video is {num_bytes:,} bytes, over the limit of "
                                f"{limits.max_bytes:,} (max_bytes)")


def _check_fps(fps, name: str, limits: VideoLimits) -> float:
    if not is_finite_number(fps) or not 0 < fps <= limits.max_fps:
        raise InvalidInputError(f"{name}: fps must be a number in (0, {limits.max_fps:g}], got {fps!r}")
    return float(fps)


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


def _tensor_bytes(t: torch.Tensor) -> bytes:
    """A CPU uint8 tensor's bytes in row-major order, without numpy (not a runtime dependency)."""
    t = t.contiguous()
    return ctypes.string_at(t.data_ptr(), t.numel())


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

    fps and which frames were kept are in it: they change no pixel, but Qwen2.5-VL spaces the video's M-RoPE time ids by it and Qwen3-VL writes
    times into the prompt, so two rates give different KV for the same frames (the prefix cache keys on this hash)."""
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
