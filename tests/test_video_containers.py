"""MP4 and WebM through load_video (the `video` extra: PyAV). Every clip is made here, with PyAV, from seeded frames:
H.264 in MP4 and VP9 (and VP8) in WebM are lossy, so the frames that come back are compared with a tolerance
measured on these clips. Hostile files are refused from their headers (or their own sizes) before a frame is
decoded; without the extra, an MP4 or WebM is refused with the command that installs it."""

import base64
import io
import re
import struct
import sys

import numpy as np
import pytest

from nanomm.errors import InvalidInputError
from nanomm.inputs import video_io as video_module
from nanomm.inputs.image import ImageProcessorConfig
from nanomm.inputs.video import preprocess_video
from nanomm.inputs.video_io import VideoLimits, load_video
from nanomm.tools.hf_files import preprocessor_config
from nanomm.tools.weights import model_spec

try:
    import av
except ImportError:  # without the extra only the test of its error message runs
    av = None
requires_av = pytest.mark.skipif(av is None, reason='the video extra is not installed (pip install -e ".[video]")')

CONFIG = ImageProcessorConfig.from_dict(preprocessor_config(model_spec("tiny"), "old"))
CODECS = {"mp4": "libx264", "webm": "libvpx-vp9"}
# Mean |decoded - source| of a frame, in levels of 255. These clips' colours change within a few pixels, so
# 4:2:0 chroma alone (yuv420p and back, no codec) costs 2.8; with the codecs' losses the worst frame measured 4.0
# (H.264), 4.0 (VP9) and 4.4 (VP8). A frame off by one is 10+ off, swapped channels 60+.
MEAN_ERROR = 5.0


def source_frames(frames: int, height: int, width: int, seed: int = 0) -> np.ndarray:
    """(T, H, W, 3) uint8: a sine wave per channel (along x, y and the diagonal), each with a seeded phase and
    speed, so that every frame differs from the next and from the channels' order."""
    rng = np.random.default_rng(seed)
    phase, speed = rng.uniform(0, 2 * np.pi, 3), rng.uniform(0.1, 0.3, 3)
    y, x = np.mgrid[0:height, 0:width]
    t = np.arange(frames).reshape(-1, 1, 1)
    waves = [x / width, y / height, (x + y) / (width + height)]
    clip = np.stack([128 + 100 * np.sin(2 * np.pi * w + p + v * t) for w, p, v in zip(waves, phase, speed)], -1)
    return clip.round().astype(np.uint8)


def encode(frames: np.ndarray, container: str, fps: int = 24, codec: str | None = None) -> bytes:
    buf = io.BytesIO()
    options = {"deadline": "realtime", "cpu-used": "8"} if "vpx" in (codec or CODECS[container]) else {}
    with av.open(buf, "w", format=container) as out:
        stream = out.add_stream(codec or CODECS[container], rate=fps, options=options)
        stream.width, stream.height, stream.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
        for frame in frames:
            out.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        out.mux(stream.encode())
    return buf.getvalue()


CLIP = source_frames(9, 48, 80, seed=1)  # an odd count: preprocessing pads it
FILES = {container: encode(CLIP, container) if av else b"" for container in CODECS}


def as_array(video) -> np.ndarray:
    return np.stack([np.asarray(frame) for frame in video.frames])


@pytest.fixture
def frames_converted(monkeypatch) -> list:
    """Each decoded frame load_video turns into a picture, counted: a refusal before decoding leaves it empty."""
    converted, frame_image = [], video_module._frame_image
    monkeypatch.setattr(video_module, "_frame_image", lambda *args: converted.append(1) or frame_image(*args))
    return converted


# --- what comes back -------------------------------------------------------------------------------------------

@requires_av
@pytest.mark.parametrize("container", list(CODECS))
def test_frames_size_and_rate_as_encoded(container, tmp_path):
    data = FILES[container]
    path = tmp_path / "clip.bin"  # the bytes decide, not the name
    path.write_bytes(data)
    url = f"data:video/{container};base64," + base64.b64encode(data).decode()
    for source in (data, path, str(path), url, memoryview(data)):
        video = load_video(source, "clip")
        assert video.fps == 24.0 and len(video.frames) == 9
        assert all(frame.mode == "RGB" and frame.size == (80, 48) for frame in video.frames)
    error = np.abs(as_array(video).astype(np.int16) - CLIP).mean(axis=(1, 2, 3))  # per frame
    assert error.max() < MEAN_ERROR, error
    assert load_video(data, fps=2).fps == 2.0  # the caller's rate wins


@requires_av
def test_vp8_and_mpeg4_too():
    for container, codec in (("webm", "libvpx"), ("mp4", "mpeg4")):
        video = load_video(encode(CLIP, container, fps=10, codec=codec))
        assert video.fps == 10.0 and len(video.frames) == 9
        error = np.abs(as_array(video).astype(np.int16) - CLIP).mean(axis=(1, 2, 3))
        assert error.max() < (MEAN_ERROR if codec == "libvpx" else 12), error  # MPEG-4 part 2: 9.4 measured


@requires_av
@pytest.mark.parametrize("container", list(CODECS))
def test_through_preprocessing_to_the_expected_grid(container):
    video = preprocess_video(load_video(FILES[container]), CONFIG)
    # 9 frames padded to 10: 5 temporal patches; 48x80 resized to 56x84 (multiples of 28): 4x6 patches
    assert video.grid_thw == (5, 4, 6) and video.token_grid == (5, 2, 3) and video.fps == 24.0
    assert video.pixel_values.shape == (5 * 4 * 6, 3 * 2 * 14 * 14)


@requires_av
def test_a_portrait_clip_turns_as_its_display_matrix_says():
    frames = np.zeros((2, 32, 48, 3), np.uint8)
    frames[:, :8, :8] = 255  # a white corner at the top left, as stored
    data = encode(frames, "mp4")
    identity = struct.pack(">9I", 0x10000, 0, 0, 0, 0x10000, 0, 0, 0, 0x40000000)
    at = data.index(identity, data.index(b"tkhd"))  # the track header's matrix: turn 90 degrees clockwise
    turned = data[:at] + struct.pack(">9i", 0, 0x10000, 0, -0x10000, 0, 0, 0, 0, 0x40000000) + data[at + 36:]
    frame = np.asarray(load_video(turned).frames[0])
    assert frame.shape == (48, 32, 3)  # portrait
    assert frame[:8, -8:].mean() > 240 and frame[:8, :8].mean() < 15  # the corner went to the top right


# --- hostile input ---------------------------------------------------------------------------------------------

def with_duration(webm: bytes, milliseconds: float, track_tag: bool = False) -> bytes:
    """The WebM with its segment's Duration (EBML ID 0x4489, a float of milliseconds) set to claim this, and with
    track_tag, the DURATION tag that FFmpeg writes for the video track too (its text, the same length)."""
    at = webm.index(b"\x44\x89")
    size = webm[at + 2] & 0x7F
    value = struct.pack(">d" if size == 8 else ">f", milliseconds)
    webm = webm[:at + 3] + value + webm[at + 3 + size:]
    if track_tag:
        old = b"00:00:00.375000000"  # 9 frames at 24 fps
        assert webm.count(old) == 1
        seconds, ms = divmod(int(milliseconds), 1000)
        webm = webm.replace(old, f"00:00:{seconds:02d}.{ms:03d}000000".encode())
    return webm


@requires_av
def test_the_files_are_what_the_hostile_cases_assume():
    assert FILES["mp4"][4:8] == b"ftyp" and FILES["webm"][:4] == b"\x1a\x45\xdf\xa3"
    with av.open(io.BytesIO(with_duration(FILES["webm"], 1e7))) as box:  # 10,000 s at 24 fps
        assert box.duration == 10_000 * 10**6 and box.streams.video[0].average_rate == 24


@requires_av
@pytest.mark.parametrize("container, limits, message", [
    ("mp4", VideoLimits(max_frames=8), "9 frames, over the limit of 8 (max_frames)"),
    ("webm", VideoLimits(max_frames=8), "9 frames, over the limit of 8 (max_frames)"),
    ("mp4", VideoLimits(max_frame_pixels=80 * 48 - 1), "80x48 = 3,840 pixels, over the limit of 3,839"),
    ("webm", VideoLimits(max_frame_pixels=80 * 48 - 1), "(max_frame_pixels)"),
    ("mp4", VideoLimits(max_total_pixels=9 * 80 * 48 - 1), "9 frames of 80x48 are 34,560 pixels"),
    ("webm", VideoLimits(max_total_pixels=9 * 80 * 48 - 1), "(max_total_pixels)"),
    ("mp4", VideoLimits(max_bytes=100), "bytes, over the limit of 100 (max_bytes)"),
])
def test_what_the_header_says_is_refused_before_any_frame_is_decoded(container, limits, message, frames_converted):
    with pytest.raises(InvalidInputError, match=f"^clip: .*{re.escape(message)}"):
        load_video(FILES[container], "clip", limits=limits)
    assert frames_converted == []
    assert len(load_video(FILES[container]).frames) == 9 and frames_converted  # (the counter does count)


@requires_av
def test_a_webm_claiming_hours_is_refused_from_its_header(frames_converted):
    with pytest.raises(InvalidInputError, match=r"^clip: the video has 240,000 frames, over the limit of 768"):
        load_video(with_duration(FILES["webm"], 1e7), "clip")
    assert frames_converted == []


@requires_av
def test_a_header_that_claims_too_few_frames_is_caught_while_decoding(frames_converted):
    """A WebM whose duration says 2 frames but holds 9: the running count refuses the 5th frame."""
    with pytest.raises(InvalidInputError, match="^clip: the video has 5 frames, over the limit of 4"):
        load_video(with_duration(FILES["webm"], 2 * 1000 / 24, track_tag=True), "clip",
                   limits=VideoLimits(max_frames=4))
    assert len(frames_converted) == 4


@requires_av
@pytest.mark.parametrize("container", list(CODECS))
@pytest.mark.parametrize("fraction", [0.3, 0.9, 0.999])
def test_a_truncated_file_is_corrupt(container, fraction):
    data = FILES[container]
    with pytest.raises(InvalidInputError, match="^clip: the video is truncated or corrupt"):
        load_video(data[:int(len(data) * fraction)], "clip")


@requires_av
def test_a_webm_damaged_midway_is_corrupt():
    """FFmpeg's Matroska reader stops where its structure is damaged, without an error: the frames end early."""
    data = bytearray(encode(source_frames(48, 32, 32), "webm"))  # 2 s at 24 fps
    with av.open(io.BytesIO(data)) as box:
        where = [packet.pos for packet in box.demux(box.streams.video[0]) if packet.size][20]
    data[where - 4:where] = bytes(4)  # the 21st frame's block header: its ID and size
    with pytest.raises(InvalidInputError, match=r"^clip: the video is truncated or corrupt: its frames end at "
                                                r"0\.83 s of the 2\.00 s its header gives"):
        load_video(bytes(data), "clip")


@requires_av
@pytest.mark.parametrize("data, message", [
    (b"", "the video data is empty"),
    (b"\x00\x00\x00\x08ftyp", "truncated or corrupt"),
    (FILES["mp4"][:40] + bytes(2000), "truncated or corrupt"),
    (b"\x1a\x45\xdf\xa3", "truncated or corrupt"),
    (FILES["webm"][:48] + np.random.default_rng(0).integers(0, 256, 2000, dtype=np.uint8).tobytes(),
     "truncated or corrupt"),
])
def test_what_is_not_a_playable_file(data, message):
    with pytest.raises(InvalidInputError, match=f"^clip: .*{message}"):
        load_video(data, "clip")


# --- without the extra -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("start", [b"\x00\x00\x00\x18ftypisom", b"\x1a\x45\xdf\xa3\x9f\x42\x86\x81\x01"],
                         ids=["mp4", "webm"])
def test_without_the_extra_the_error_says_how_to_install_it(start, monkeypatch):
    monkeypatch.setitem(sys.modules, "av", None)  # what Python does for a package that is not installed
    with pytest.raises(InvalidInputError, match=r'^clip: .*needs the video extra.*pip install "nanomm\[video\]"'):
        load_video(start + bytes(100), "clip")  # the first bytes decide, before anything is decoded
    gif = io.BytesIO()
    frames = [video_module.Image.new("RGB", (4, 4), c) for c in ("red", "blue")]
    frames[0].save(gif, format="GIF", save_all=True, append_images=frames[1:], duration=100)
    assert len(load_video(gif.getvalue()).frames) == 2  # Pillow's formats need no extra
