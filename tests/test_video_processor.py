"""Videos: transformers' Qwen2VLVideoProcessor bit for bit (nanomm.inputs.video), untrusted clips refused early
(nanomm.inputs.video_io).

The expected pixel_values and video_grid_thw come from transformers itself: scripts/workshop/make_video_fixtures.py
runs the real Qwen2VLVideoProcessor (it needs torchvision, so in a side environment) and wrote tests/data/video/.
"""

import base64
import hashlib
import io
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageFile
from safetensors.torch import load_file

from nanomm.errors import InvalidInputError
from nanomm.inputs.image import ImageProcessorConfig, preprocess_image
from nanomm.inputs.video import ProcessedVideo, preprocess_video
from nanomm.inputs.video_io import DEFAULT_FPS, VideoInput, VideoLimits, load_video
from nanomm.inputs.video_settings import VideoSettings
from nanomm.tools.hf_files import preprocessor_config
from nanomm.tools.weights import model_spec

DATA = Path(__file__).parent / "data" / "video"
META = json.loads((DATA / "qwen2_vl_video.json").read_text())
TINY = preprocessor_config(model_spec("tiny"), "old")  # what make_checkpoint (the `ckpt` fixture) writes
CONFIG = ImageProcessorConfig.from_dict(TINY)
COLOURS = [(255, 0, 0), (0, 255, 0), (0, 0, 255)]


def noise_clip(seed: int, frames: int, height: int, width: int) -> np.ndarray:
    """The generator's frames: the same call, checked against its sha256 in the test."""
    return np.random.default_rng(seed).integers(0, 256, (frames, height, width, 3), dtype=np.uint8)


def expected_pixel_values(clip: str) -> torch.Tensor:
    """HF's pixel_values_videos: table[c, codes[:, c]] (see make_video_fixtures.py: a lossless packing)."""
    tensors = load_file(DATA / "qwen2_vl_video.safetensors")
    table, codes = tensors[f"{clip}.table"], tensors[f"{clip}.codes"]
    channel = torch.arange(table.shape[0]).view(1, -1, 1)  # (1, C, 1)
    return table[channel, codes.long()].reshape(codes.shape[0], -1)  # (rows, C*T*P*P)


def sha256(array) -> str:
    return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()


def solid_frames(size=(8, 6)) -> list:
    return [Image.new("RGB", size, colour) for colour in COLOURS]


def animation(fmt: str, frames: list, durations) -> bytes:
    buf = io.BytesIO()
    extra = {"lossless": True} if fmt == "WEBP" else {}
    frames[0].save(buf, format=fmt, save_all=True, append_images=frames[1:], duration=durations, loop=0, **extra)
    return buf.getvalue()


def gif_bytes(num_frames: int, width: int = 1, height: int = 1) -> bytes:
    """A GIF built by hand: whatever its header claims, each frame is one 1x1 pixel, a few bytes."""
    screen = b"GIF89a" + width.to_bytes(2, "little") + height.to_bytes(2, "little") + bytes([0x80, 0, 0])
    palette = b"\x00\x00\x00\xff\xff\xff"  # the global colour table: black, white
    frame = (b"\x2c" + bytes(4) + (1).to_bytes(2, "little") * 2 + b"\x00"  # a 1x1 image descriptor at (0, 0)
             + b"\x02\x02\x44\x01\x00")  # LZW code size 2, one sub-block of 2 bytes, end of the frame's data
    return screen + palette + frame * num_frames + b";"


@pytest.fixture
def decoded_frames(monkeypatch):
    """Counts the frames Pillow decodes (ImageFile.load), to show that a refusal came before any decoding."""
    calls = []
    load = ImageFile.ImageFile.load
    monkeypatch.setattr(ImageFile.ImageFile, "load", lambda self: calls.append(self) or load(self))
    return calls


# --- transformers parity ---------------------------------------------------------------------------------------

def test_fixtures_were_made_with_the_tiny_checkpoints_settings():
    assert META["preprocessor_config"] == TINY
    assert META["versions"]["transformers"].startswith("5.24")
    assert (CONFIG.patch_size, CONFIG.merge_size, CONFIG.temporal_patch_size, CONFIG.min_pixels) == (14, 2, 2, 3136)


@pytest.mark.parametrize("clip", list(META["clips"]))
def test_pixel_values_and_grid_equal_transformers(clip):
    spec = META["clips"][clip]
    frames = noise_clip(spec["seed"], *spec["frames_thwc"][:3])
    assert sha256(frames) == spec["frames_sha256"], "numpy made other frames than the generator did"
    expected = expected_pixel_values(clip)
    assert sha256(expected.numpy()) == spec["pixel_values_sha256"]

    if "sampling" in spec:  # do_sample_frames=True: a rate or a count, the clip's own rate in its metadata
        settings = VideoSettings("qwen2", CONFIG).with_request({**spec["sampling"], "do_sample_frames": True}, clip)
        video = preprocess_video(load_video(frames, fps=spec["fps"]), CONFIG, settings=settings)
        assert settings.frame_indices(len(frames), spec["fps"], clip) == spec["frames_indices"]
        assert video.fps == spec["sampled_fps"]  # what Qwen2.5-VL's second_per_grid_ts comes from
    else:
        video = preprocess_video(load_video(frames), CONFIG, min_pixels=spec["min_pixels"],
                                 max_pixels=spec["max_pixels"])
    assert list(video.grid_thw) == spec["video_grid_thw"]
    got = video.pixel_values
    assert got.dtype == torch.float32 and got.shape == expected.shape
    assert torch.equal(got, expected), f"max |difference| {(got - expected).abs().max().item()}"


QWEN3 = json.loads((DATA / "qwen3_vl_video.json").read_text())


@pytest.fixture(scope="module")
def qwen3_engine(tmp_path_factory):
    """A tiny Qwen3-VL checkpoint with the tokenizer the fixtures were tokenised with; only `prepare` is used."""
    from hf_checkpoints import make_hf_checkpoint
    from nanomm import LLM

    llm = LLM(str(make_hf_checkpoint(tmp_path_factory.mktemp("qwen3_vl"), "qwen3_vl")), device="cpu",
              dtype="float32", num_preprocess_workers=0)
    yield llm.engine
    llm.close()


@pytest.mark.parametrize("clip", list(QWEN3["clips"]))
def test_qwen3_vl_sampling_timestamps_prompt_and_pixels_equal_transformers(qwen3_engine, clip):
    """Qwen3-VL's processor as a whole: which frames it keeps (2 a second unless told), the clip's pixel budget,
    the time of each temporal patch written into the prompt, and the pixel values, against Qwen3VLProcessor's."""
    from nanomm import SamplingParams
    from nanomm.reference import whole_media

    spec = QWEN3["clips"][clip]
    frames = noise_clip(spec["seed"], *spec["frames_thwc"][:3])
    assert sha256(frames) == spec["frames_sha256"]
    prompt = {"prompt": QWEN3["prompt"], "multi_modal_data": {"video": VideoInput(
        tuple(Image.fromarray(f) for f in frames), spec["fps"])}, "mm_processor_kwargs": spec["mm_processor_kwargs"]}
    prepared = qwen3_engine.prepare(prompt, SamplingParams(max_tokens=1))
    (video,) = whole_media(prepared.images)
    assert prepared.token_ids == spec["input_ids"]
    assert list(video.grid_thw) == spec["video_grid_thw"]
    assert list(video.timestamps) == spec["timestamps"]
    assert video.fps == len(spec["frames_indices"]) / spec["frames_thwc"][0] * spec["fps"]  # HF's sampled_fps
    tensors = load_file(DATA / "qwen3_vl_video.safetensors")
    channel = torch.arange(3).view(1, -1, 1)
    expected = tensors[f"{clip}.table"][channel, tensors[f"{clip}.codes"].long()].reshape(video.pixel_values.shape)
    assert sha256(expected.numpy()) == spec["pixel_values_sha256"]
    assert torch.equal(video.pixel_values, expected)


def test_an_odd_clip_repeats_its_last_frame():
    frames = noise_clip(5, 5, 56, 56)
    video = preprocess_video(load_video(frames, fps=10), CONFIG)
    stored = np.frombuffer(video.frames_rgb, dtype=np.uint8).reshape(6, 56, 56, 3)  # (T_padded, H, W, 3)
    assert np.array_equal(stored[:5], frames) and np.array_equal(stored[5], frames[4])
    assert video.grid_thw == (3, 4, 4) and video.token_grid == (3, 2, 2)
    assert video.num_encoded_tokens == video.num_tokens == 12 and video.position_extent == 3
    assert video.second_per_grid == 0.2 and video.fps == 10.0 and video.merge_size == 2
    assert video.is_video and video.compression is None and video.with_compression(None) is video
    from nanomm.inputs.compression import CompressionPolicy

    pooled = video.with_compression(CompressionPolicy("pool", 0.25))  # each patch's 2x2 tokens pooled to 1
    assert pooled.num_tokens == 3 and pooled.content_hash != video.content_hash and video.num_tokens == 12
    assert [g.num_tokens for g in pooled.temporal_groups()] == [1, 1, 1]


# --- loading ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["GIF", "PNG", "WEBP"])
def test_animated_files_give_their_frames_and_the_rate_of_their_durations(fmt, tmp_path):
    data = animation(fmt, solid_frames(), [100, 200, 300])  # a mean of 200 ms: 5 frames per second
    path = tmp_path / f"clip.{fmt.lower()}"
    path.write_bytes(data)
    url = f"data:image/{fmt.lower()};base64," + base64.b64encode(data).decode()
    for source in (data, path, str(path), url):
        video = load_video(source)
        assert video.fps == 5.0
        assert [(f.mode, f.size, f.getpixel((4, 3))) for f in video.frames] == [("RGB", (8, 6), c) for c in COLOURS]
    assert load_video(data, fps=30).fps == 30.0  # the caller's rate wins


def test_a_list_of_images_or_an_array_is_a_clip_at_the_given_rate():
    images = [Image.new("L", (4, 2), 128), Image.new("RGBA", (4, 2), (0, 0, 0, 0)), Image.new("RGB", (4, 2), "red")]
    video = load_video(images)
    assert video.fps == DEFAULT_FPS == 2.0
    assert [f.getpixel((0, 0)) for f in video.frames] == [(128, 128, 128), (255, 255, 255), (255, 0, 0)]

    array = np.arange(2 * 3 * 4 * 3, dtype=np.uint8).reshape(2, 3, 4, 3)  # (T, H, W, 3)
    for source in (array, torch.from_numpy(array)):
        video = load_video(source, fps=24)
        assert video.fps == 24.0 and all(f.mode == "RGB" and f.size == (4, 3) for f in video.frames)
        assert np.array_equal(np.stack([np.asarray(f) for f in video.frames]), array)
    assert load_video(video) is video
    assert load_video(video, fps=12).fps == 12.0


# --- hostile input ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("data, limits, message", [
    (gif_bytes(2000), VideoLimits(), "2,000 frames, over the limit of 768"),
    (gif_bytes(1, 5000, 5000), VideoLimits(), "5000x5000 = 25,000,000 pixels"),
    (gif_bytes(1, 60000, 60000), VideoLimits(), "decompression-bomb"),  # Pillow refuses it as it opens it
    (gif_bytes(3, 64, 64), VideoLimits(max_total_pixels=10_000), "3 frames of 64x64 are 12,288 pixels"),
    (gif_bytes(3), VideoLimits(max_bytes=40), "bytes, over the limit of 40"),
])
def test_what_the_header_says_is_refused_before_any_frame_is_decoded(data, limits, message, decoded_frames):
    with pytest.raises(InvalidInputError, match=f"^clip: .*{message}"):
        load_video(data, "clip", limits=limits)
    assert decoded_frames == []
    assert len(load_video(gif_bytes(5, 2, 2)).frames) == 5 and decoded_frames  # (the counter does count)


def test_too_many_bytes_in_a_file_or_a_data_url(tmp_path):
    data = animation("GIF", solid_frames(), 100)
    path = tmp_path / "clip.gif"
    path.write_bytes(data)
    small = VideoLimits(max_bytes=len(data) - 1)
    for source in (data, path, "data:image/gif;base64," + base64.b64encode(data).decode()):
        with pytest.raises(InvalidInputError, match="max_bytes"):
            load_video(source, limits=small)


@pytest.mark.parametrize("source", [[], np.zeros((0, 4, 4, 3), np.uint8)], ids=["list", "array"])
def test_zero_frames(source):
    with pytest.raises(InvalidInputError, match="^clip: the video has no frames"):
        load_video(source, "clip")


@pytest.mark.parametrize("fmt", ["GIF", "PNG", "WEBP"])
def test_a_truncated_stream_is_corrupt(fmt):
    noise = [Image.fromarray(frame) for frame in noise_clip(0, 3, 32, 32)]
    data = animation(fmt, noise, 100)
    with pytest.raises(InvalidInputError, match="^clip: the video is truncated or corrupt"):
        load_video(data[:len(data) // 2], "clip")


@pytest.mark.parametrize("source, message", [
    (b"", "empty"),
    (b"\x00" * 100, "not a video in a supported format"),
    (b"GIF89a\x01", "not a video in a supported format"),
    ("https://example.com/clip.gif", "URLs are not fetched"),
    (42, "a video must be"),
    (["not an image"], "PIL images only"),
    (np.zeros((2, 4, 4, 3), np.float32), "must be uint8 of shape"),
    (np.zeros((2, 4, 4), np.uint8), "must be uint8 of shape"),
])
def test_what_is_not_a_video(source, message):
    with pytest.raises(InvalidInputError, match=f"^clip: .*{message}"):
        load_video(source, "clip")


@pytest.mark.parametrize("fps", [0, -1, 0.0, math.nan, math.inf, 241, True, "2"])
def test_a_frame_rate_outside_the_limits(fps):
    with pytest.raises(InvalidInputError, match=r"^clip: fps must be a number in \(0, 240\]"):
        load_video(solid_frames(), "clip", fps=fps)


def test_a_file_whose_durations_give_no_usable_rate():
    with pytest.raises(InvalidInputError, match="frames last 0 ms"):
        load_video(animation("GIF", solid_frames(), 0))
    with pytest.raises(InvalidInputError, match="fps must be a number"):  # 2 ms a frame: 500 frames per second
        load_video(animation("PNG", solid_frames(), 2))
    assert load_video(animation("PNG", solid_frames(), 2), fps=25).fps == 25.0


def test_frames_of_different_sizes():
    frames = [Image.new("RGB", (8, 6)), Image.new("RGB", (8, 7))]
    with pytest.raises(InvalidInputError, match=r"^clip: frames of different sizes \(8x6 and 8x7\)"):
        load_video(frames, "clip")
    with pytest.raises(InvalidInputError, match="^clip: frames of different sizes"):
        preprocess_video(VideoInput(tuple(frames), 2.0), CONFIG, name="clip")  # built by hand: checked too


def test_frames_over_the_pixel_limits():
    limits = VideoLimits(max_frame_pixels=100, max_frames=2)
    with pytest.raises(InvalidInputError, match="max_frame_pixels"):
        load_video([Image.new("RGB", (11, 10))], limits=limits)
    with pytest.raises(InvalidInputError, match="max_frame_pixels"):
        load_video(np.zeros((1, 10, 11, 3), np.uint8), limits=limits)
    with pytest.raises(InvalidInputError, match="3 frames, over the limit of 2"):
        load_video(np.zeros((3, 2, 2, 3), np.uint8), limits=limits)
    with pytest.raises(InvalidInputError, match="over the pixel limit"):  # min_pixels would upscale every frame
        preprocess_video(load_video(solid_frames()), CONFIG, min_pixels=10**8, max_pixels=10**9)


# --- content hash ----------------------------------------------------------------------------------------------

def test_the_content_hash_follows_the_frames_their_order_the_cap_and_the_rate():
    frames = [Image.fromarray(frame) for frame in noise_clip(1, 4, 112, 112)]

    def key(clip, fps=2.0, **cap):
        return preprocess_video(VideoInput(tuple(clip), fps), CONFIG, **cap).content_hash

    assert key(frames) == key([f.copy() for f in frames])
    assert len({key(frames), key(frames[::-1]), key(frames, max_pixels=56 * 56), key(frames, fps=4.0)}) == 4
    still = frames[0]
    assert key([still, still]) != preprocess_image(still, CONFIG).content_hash  # "video:" keeps them apart
    assert isinstance(preprocess_video(VideoInput((still,), 1.0), CONFIG), ProcessedVideo)


def test_limits_are_checked_when_made():
    for bad in ({"max_frames": 0}, {"max_bytes": -1}, {"max_fps": math.nan}, {"max_total_pixels": 1.5}):
        with pytest.raises(ValueError):
            VideoLimits(**bad)


def test_video_settings_read_a_checkpoint_s_video_preprocessor_config():
    """Qwen3-VL's shipped video_preprocessor_config.json (its values) gives the family's defaults; a file may turn
    sampling off, change the rate or the budget; a bad value names the file."""
    qwen3 = ImageProcessorConfig.from_dict({**TINY, "patch_size": 16})
    shipped = {"do_sample_frames": True, "fps": 2, "min_frames": 4, "max_frames": 768, "patch_size": 16,
               "size": {"longest_edge": 25165824, "shortest_edge": 4096}, "image_mean": [0.5] * 3,
               "image_std": [0.5] * 3, "temporal_patch_size": 2, "merge_size": 2}
    default = VideoSettings.for_model("qwen3_vl", qwen3)
    assert VideoSettings.for_model("qwen3_vl", qwen3, shipped) == default
    assert (default.fps, default.pixels.min_pixels, default.pixels.max_pixels) == (2.0, 4096, 25165824)
    off = VideoSettings.for_model("qwen3_vl", qwen3, {"do_sample_frames": False})
    assert not off.samples and off.frame_indices(50, 30.0, "clip") == list(range(50))
    assert VideoSettings.for_model("qwen3_vl", qwen3, {"do_sample_frames": True, "fps": 1}).fps == 1.0
    assert not VideoSettings.for_model("qwen2_vl", CONFIG).samples  # Qwen2-VL keeps every frame
    # Each key is the processor's attribute (from_pretrained): a rate without do_sample_frames samples nothing, and
    # turning sampling off keeps the rate for a request that turns it on again.
    assert VideoSettings.for_model("qwen2_vl", CONFIG, {"fps": 1}).frame_indices(8, 4.0, "clip") == list(range(8))
    qwen2_on = VideoSettings.for_model("qwen2_vl", CONFIG, {"do_sample_frames": True, "fps": 1})
    assert qwen2_on.frame_indices(8, 4.0, "clip") == [0, 2, 4, 6]  # 2 s at 1 a second: min_frames (4)
    assert off.with_request({"do_sample_frames": True}, "request").frame_indices(50, 25.0, "clip") == [0, 16, 33, 49]
    # The engine's media_io_kwargs: a rate or a count samples every clip (vLLM's loader), unless told otherwise.
    qwen2 = VideoSettings.for_model("qwen2_vl", CONFIG)
    assert qwen2.with_engine_kwargs({"num_frames": 4}).frame_indices(8, 4.0, "clip") == [0, 2, 4, 6]
    assert not qwen2.with_engine_kwargs({"num_frames": 4, "do_sample_frames": False}).samples
    for bad, message in (({"do_sample_frames": True}, "needs an fps or a num_frames"),
                         ({"do_sample_frames": 1}, "do_sample_frames must be true or false")):
        with pytest.raises(InvalidInputError, match=message):
            qwen2.with_engine_kwargs(bad)
        with pytest.raises(InvalidInputError, match=message):
            qwen2.with_request(bad, "request")
    with pytest.raises(InvalidInputError, match="video_preprocessor_config.json: max_frames"):
        VideoSettings.for_model("qwen3_vl", qwen3, {"max_frames": "many"})
    with pytest.raises(InvalidInputError, match="at least 2 frames"):
        default.resized(1, 64, 64, "clip")
