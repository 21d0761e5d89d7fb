"""Untrusted videos in, decoded frames out: a clip's frames and its rate, refused early when it is too big.

The loading half of a video's first stage, as `image_io.py` is for pictures; `nanomm/inputs/video.py` samples,
resizes and patchifies what `load_video` returns. lessons/17-video.md walks through both.

`load_video` turns what the caller sent (a list of PIL images, a uint8 array, or an animated GIF, WebP or APNG, or
an MP4 or WebM, as a path, bytes or data URL) into a `VideoInput`: RGB frames of one size and a frame rate. It is
untrusted input: sizes, frame counts and byte counts are checked against `VideoLimits` from the header, before any
pixel is decoded, and every problem is an `InvalidInputError` that names the input. Pillow decodes the animations;
MP4 and WebM need the `video` extra (PyAV, FFmpeg's libraries, imported only when such a file arrives:
scripts/bench_video_decoders.py measured it against the other decoders).
"""

from __future__ import annotations

import base64
import binascii
import ctypes
import io
import os
from dataclasses import dataclass, replace
from fractions import Fraction

import torch
from PIL import Image

from nanomm.errors import InvalidInputError, check_int, is_finite_number
from nanomm.inputs.image import to_rgb
from nanomm.inputs.image_io import _data_url_payload, _read_file, _short, decode_errors

DEFAULT_FPS = 2.0  # the frame rate of frames given as a list or an array, when the caller does not say
VIDEO_FORMATS = ("GIF", "WEBP", "PNG")  # Pillow's animated formats (PNG covers APNG)
# MP4 and WebM, told apart by their first bytes (never by a file name or a media type): FFmpeg's demuxer for each.
# Naming the demuxer means FFmpeg never probes the format, so no playlist, concat list or image sequence demuxer
# (which open further files or URLs) ever reads the caller's bytes.
CONTAINER_DEMUXERS = {"MP4": "mov", "WebM": "matroska"}
VIDEO_EXTRA = 'pip install "nanomm[video]"'


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


def encoded_video_bytes(source, name: str = "video") -> bytes | None:
    """A clip's encoded bytes (a path, bytes or a data URL), not decoded, for the processor cache to hash; None for
    a clip given as frames or an array, or a URL (which `load_video` takes or refuses itself)."""
    if isinstance(source, str) and source.startswith(("http://", "https://")):
        return None
    if isinstance(source, (bytes, bytearray, memoryview, str, os.PathLike)):
        return _encoded_bytes(source, name, VideoLimits())
    return None


def _encoded_bytes(source, name: str, limits: VideoLimits) -> bytes:
    """A path, bytes or data URL -> the file's bytes, refused before reading or decoding if over max_bytes."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        _check_bytes(memoryview(source).nbytes, name, limits)  # before the copy
        data = bytes(source)
    elif isinstance(source, str) and source.startswith("data:"):
        _check_bytes(len(source) * 3 // 4, name, limits)  # the base64 payload's decoded size, roughly from above
        data = _video_data_url_payload(source, name)
    elif isinstance(source, str) and source.startswith(("http://", "https://")):
        raise InvalidInputError(f"{name}: URLs are not fetched here ({_short(source)}); pass its path or bytes, "
                                "or give LLM allowed_media_domains (nanomm-serve --allowed-media-domains)")
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
        start = stream.start_time * stream.time_base if stream.start_time is not None else 0  # read while open
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


def _tensor_bytes(t: torch.Tensor) -> bytes:
    """A CPU uint8 tensor's bytes in row-major order, without numpy (not a runtime dependency)."""
    t = t.contiguous()
    return ctypes.string_at(t.data_ptr(), t.numel())
