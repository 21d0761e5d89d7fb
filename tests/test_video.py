"""Videos through the engine (lesson 17): Qwen2-VL's, Qwen2.5-VL's and Qwen3-VL's greedy tokens and logits equal
transformers' on clips fed as pixel_values_videos, at tiny and real widths, and the engine equals its dense reference
when chunks cut temporal groups, blocks are small, the prefix cache serves a second pass, the encoder cache a
repeated clip, and an encoder service the tower; a request's fps, num_frames and do_sample_frames keep the frames
transformers' processor of each family keeps (tests/data/video/sampling.json). The video processors themselves are
checked against transformers' in tests/test_video_processor.py; pruning in tests/test_video_pruning.py."""

import hashlib
import json
from pathlib import Path

import numpy as np
from PIL import Image
import pytest
import torch
import transformers

from helpers import assert_engine_matches_reference, assert_no_leaks, random_image
from nanomm import LLM, SamplingParams
from nanomm.errors import InvalidInputError
from nanomm.inputs.video_io import VideoInput
from nanomm.reference import whole_media
from test_model_parity import oracle_greedy, steps_fed_the_same_tokens

MAX_PIXELS = 224 * 224  # frames up to 224x224: 8x8 tokens of 28x28 pixels

# transformers 5.24 resumes the text after a video at start + max(H, W), below the video's last temporal position
# when T > max(H, W); Qwen2-VL's own rule (transformers 4.x, vLLM, nanomm) resumes at start + max(T, H, W). The two
# agree while T <= max(H, W), so the clips compared with transformers keep to that
# (test_text_after_a_long_clip_resumes_past_its_last_temporal_patch checks the other case by hand).


def clip(num_frames: int, seed: int, size: int = 56) -> np.ndarray:
    """(T, H, W, 3) uint8 frames of noise, seeded."""
    return np.stack([np.asarray(random_image(size, size, seed * 1000 + i)) for i in range(num_frames)])


def video_prompt(*videos, text: str = "what happens?", picture=None) -> dict:
    media = "<|vision_start|><|video_pad|><|vision_end|>" * len(videos)
    if picture is not None:
        media += "<|vision_start|><|image_pad|><|vision_end|>"
    prompt = {"prompt": f"<|im_start|>user\n{media}{text}<|im_end|>\n<|im_start|>assistant\n",
              "multi_modal_data": {"video": list(videos)}}
    if picture is not None:
        prompt["multi_modal_data"]["image"] = [picture]
    return prompt


def hf_video_inputs(llm, prepared) -> dict:
    """transformers' inputs for an expanded prompt whose media are videos (and pictures), in prompt order (and
    Qwen2.5-VL's seconds per temporal patch)."""
    cfg = llm.model.config
    ids = torch.tensor([prepared.token_ids])
    media = whole_media(prepared.images)
    videos = [m for m in media if getattr(m, "is_video", False)]
    pictures = [m for m in media if not getattr(m, "is_video", False)]
    inputs = dict(input_ids=ids, attention_mask=torch.ones_like(ids),
                  mm_token_type_ids=(ids == cfg.image_token_id).int() + 2 * (ids == cfg.video_token_id).int())
    if videos:
        inputs["pixel_values_videos"] = torch.cat([v.pixel_values for v in videos])
        inputs["video_grid_thw"] = torch.tensor([list(v.grid_thw) for v in videos])
        if cfg.model_type == "qwen2_5_vl":
            inputs["second_per_grid_ts"] = torch.tensor([v.second_per_grid for v in videos], dtype=torch.float32)
    if pictures:
        inputs["pixel_values"] = torch.cat([p.pixel_values for p in pictures])
        inputs["image_grid_thw"] = torch.tensor([list(p.grid_thw) for p in pictures])
    return inputs


def assert_answer_is_transformers(out, oracle, inputs: dict, label) -> None:
    """The engine's 8 greedy tokens are transformers' (up to a near-tie), and so is each step's distribution."""
    tokens, logits = oracle_greedy(oracle, inputs, 8)
    got = out.outputs[0].token_ids
    comparable = steps_fed_the_same_tokens(got, tokens, logits)
    assert comparable >= 1 and got[:comparable] == tokens[:comparable]
    for step in range(comparable):
        row = out.outputs[0].logprobs[step]
        ours = torch.tensor([row[t].logprob for t in range(len(row))])
        assert torch.allclose(ours, torch.log_softmax(logits[step], dim=-1), atol=1e-4), (label, step)


@pytest.fixture(scope="module")
def qwen2_vl(tmp_path_factory, ckpt):
    llm = LLM(str(ckpt), device="cpu", dtype="float32", max_pixels=MAX_PIXELS, num_preprocess_workers=0)
    oracle = transformers.Qwen2VLForConditionalGeneration.from_pretrained(
        str(ckpt), dtype=torch.float32, attn_implementation="eager").eval()
    yield llm, oracle
    llm.close()


CLIPS = {
    "16 frames": lambda: video_prompt(clip(16, 1, size=224)),  # 8 temporal patches of 8x8 tokens
    "an odd frame count": lambda: video_prompt(clip(5, 2, size=84)),  # padded to 6: 3 of 3x3
    "two videos": lambda: video_prompt(clip(4, 3), clip(6, 4, size=84)),
    "a video and a picture": lambda: video_prompt(clip(4, 5), picture=random_image(84, 56, 6)),
}


@pytest.mark.parametrize("name", CLIPS)
def test_greedy_tokens_and_logits_equal_transformers(qwen2_vl, name):
    llm, oracle = qwen2_vl
    prompt = CLIPS[name]()
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=llm.model.config.text.vocab_size)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    prepared = llm.engine.prepare(prompt, params)
    assert_answer_is_transformers(out, oracle, hf_video_inputs(llm, prepared), name)
    assert out.metrics.num_visual_tokens == sum(m.num_tokens for m in prepared.images)
    assert_no_leaks(llm)


def test_a_clips_tokens_count_its_temporal_patches(qwen2_vl):
    llm, _ = qwen2_vl
    prepared = llm.engine.prepare(video_prompt(clip(16, 1)), None)
    (video,) = whole_media(prepared.images)
    assert video.grid_thw == (8, 4, 4)  # 16 frames / 2, 56 / 14
    assert prepared.token_ids.count(llm.model.config.video_token_id) == 8 * 2 * 2
    # the engine's units: one per temporal patch, each the span of its own 2x2 tokens, in order
    assert [(span.start, span.length) for span in prepared.image_spans] == [
        (prepared.image_spans[0].start + 4 * g, 4) for g in range(8)]
    assert len({span.content_hash for span in prepared.image_spans}) == 8
    (odd,) = whole_media(llm.engine.prepare(video_prompt(clip(5, 2)), None).images)
    assert odd.grid_thw == (3, 4, 4)  # 5 frames padded to 6


def test_text_after_a_long_clip_resumes_past_its_last_temporal_patch(qwen2_vl):
    """16 frames of 56x56: 8 temporal patches of 2x2 tokens. The video's tokens take t = s..s+7, h and w = s..s+1;
    the text after it starts at s + 8 on all three axes (Qwen2-VL's rule), and decoding continues from there."""
    llm, _ = qwen2_vl
    prepared = llm.engine.prepare(video_prompt(clip(16, 1)), None)
    ids, positions = prepared.token_ids, prepared.positions
    first = ids.index(llm.model.config.video_token_id)
    s = first  # text before the video counts up from 0
    video = positions[:, first:first + 32]
    assert video[0].tolist() == [s + t for t in range(8) for _ in range(4)]
    assert video[1].tolist() == [s + h for _ in range(8) for h in (0, 0, 1, 1)]
    after = first + 32
    assert positions[:, after].tolist() == [s + 8] * 3
    assert prepared.rope_delta == (s + 8 + len(ids) - after) - len(ids)


@pytest.mark.parametrize("settings", [
    dict(max_num_batched_tokens=7, block_size=4),  # chunks end inside temporal groups; blocks of 4
    dict(num_kv_blocks=24, block_size=4, max_num_seqs=4),  # too few blocks: preemption
    dict(speculative={"method": "ngram", "num_speculative_tokens": 3}),
], ids=["chunks-cut-groups", "preemption", "ngram"])
def test_the_engine_equals_the_dense_reference_on_videos(ckpt, settings):
    assert_videos_equal_the_reference(str(ckpt), settings, size=56)


def assert_videos_equal_the_reference(folder: str, settings: dict, size: int) -> None:
    """Three clips and a clip with a picture, sampled and greedy, twice (the prefix cache), then the first clip
    after other text (the encoder cache): the engine's tokens are the dense reference's every time."""
    with LLM(folder, device="cpu", dtype="float32", max_pixels=MAX_PIXELS, num_preprocess_workers=0,
             **settings) as llm:
        prompts = [video_prompt(clip(6, 10 + i, size=size), text=f"clip {i}") for i in range(3)] + [
            video_prompt(clip(4, 20, size=size), picture=random_image(size, size, 21))]
        params = [SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=10, ignore_eos=True)
                  for i in range(len(prompts))]
        assert_engine_matches_reference(llm, prompts, params)
        again = assert_engine_matches_reference(llm, prompts, params)  # a second pass
        if "num_kv_blocks" in settings:
            assert llm.stats()["preemptions"] > 0
        else:
            assert all(out.metrics.num_cached_tokens > 0 for out in again)  # served by the prefix cache
        # The first clip again after other text: the prefix cache cannot serve it, the encoder cache does.
        moved = {**prompts[0], "prompt": "<|im_start|>user\nfirst this. " + prompts[0]["prompt"][len("<|im_start|>user\n"):]}
        (out,) = assert_engine_matches_reference(llm, [moved], params[:1])
        assert out.metrics.encoder_cache_hits == 3 and out.metrics.encode_s == 0  # its 3 temporal patches


def test_bad_videos_are_errors_naming_the_video(qwen2_vl):
    llm, _ = qwen2_vl
    bad = {"zero frames": video_prompt(np.zeros((0, 56, 56, 3), dtype=np.uint8)),
           "a placeholder without its video": {"prompt": "<|vision_start|><|video_pad|><|vision_end|>hi",
                                               "multi_modal_data": {"video": [clip(2, 1), clip(2, 2)]}},
           "three videos": video_prompt(clip(2, 1), clip(2, 2), clip(2, 3))}
    for what, prompt in bad.items():
        with pytest.raises(InvalidInputError, match="video"):
            llm.generate([prompt], SamplingParams(max_tokens=2), use_tqdm=False)
    assert_no_leaks(llm)


def test_a_request_samples_its_videos_within_the_engine_s_caps(qwen2_vl):
    """mm_processor_kwargs: a rate or a count of frames, used only with do_sample_frames (Qwen2-VL's default is
    false: transformers' sampling, tests/test_video_processor.py), and caps that may go down, never up. Every bad
    setting is refused before a frame is decoded."""
    llm, _ = qwen2_vl
    frames = VideoInput(tuple(Image.fromarray(f) for f in clip(16, 11)), 8.0)  # 2 s at 8 fps
    on = {"do_sample_frames": True}
    for kwargs, grid_t in (({}, 8), ({"fps": 2}, 8), ({"num_frames": 8}, 8), ({**on, "fps": 2}, 2),
                           ({**on, "num_frames": 8}, 4), ({**on, "fps": 4, "max_frames": 4}, 2)):
        prepared = llm.engine.prepare({**video_prompt(frames), "mm_processor_kwargs": kwargs}, None)
        assert whole_media(prepared.images)[0].grid_thw[0] == grid_t, kwargs
    small = llm.engine.prepare({**video_prompt(frames), "mm_processor_kwargs": {"video_max_pixels": 28 * 28}}, None)
    assert whole_media(small.images)[0].grid_thw == (8, 2, 2)
    for key, value, message in [("fps", -1, "fps must be a positive number"),
                                ("num_frames", 10_000, "num_frames=10000 is over the engine's cap of 768"),
                                ("max_frames", 769, "max_frames=769 is over the engine's cap of 768"),
                                ("video_max_pixels", MAX_PIXELS + 1, "video_max_pixels=50177 is over"),
                                ("min_frames", "4", "min_frames"), ("min_frames", 9, "min_frames \\(9\\) is over"),
                                ("do_sample_frames", "yes", "do_sample_frames must be true or false")]:
        with pytest.raises(InvalidInputError, match=message):  # a clip that cannot load: refused before that
            llm.engine.prepare({**video_prompt(lambda: None), "mm_processor_kwargs": {key: value, "max_frames": 8}
                                if key == "min_frames" and value == 9 else {key: value}}, None)
    with pytest.raises(InvalidInputError, match="fps or num_frames, not both"):
        llm.generate([{**video_prompt(frames), "mm_processor_kwargs": {"fps": 1, "num_frames": 4}}],
                     SamplingParams(max_tokens=1), use_tqdm=False)
    assert_no_leaks(llm)


def test_the_engine_s_media_io_kwargs_set_how_every_video_is_sampled(ckpt):
    frames = VideoInput(tuple(Image.fromarray(f) for f in clip(16, 12)), 8.0)
    with LLM(str(ckpt), device="cpu", dtype="float32", num_preprocess_workers=0,
             media_io_kwargs={"video": {"num_frames": 4}}) as llm:
        assert whole_media(llm.engine.prepare(video_prompt(frames), None).images)[0].grid_thw[0] == 2
        mine = llm.engine.prepare({**video_prompt(frames), "mm_processor_kwargs": {"num_frames": 6}}, None)
        assert whole_media(mine.images)[0].grid_thw[0] == 3  # a request's count replaces the engine's
    for bad, message in (({"audio": {}}, "media_io_kwargs must be a dict"), ({"video": {"fps": 0}}, "fps"),
                         ({"video": {"frames": 3}}, "unknown video settings")):
        with pytest.raises(ValueError, match=message):
            LLM(str(ckpt), device="cpu", dtype="float32", media_io_kwargs=bad)
    from nanomm.serve.cli import parse_args

    assert parse_args(["--media-io-kwargs", '{"video": {"fps": 1}}']).media_io_kwargs == {"video": {"fps": 1}}
    with pytest.raises(SystemExit):
        parse_args(["--media-io-kwargs", "fps=1"])


def test_a_clip_encoded_patch_by_patch_equals_the_clip_encoded_whole(qwen2_vl):
    """The tower attends within a temporal patch only: the engine's units, encoded one by one, give the tokens of
    the whole clip encoded at once (attention across patches, or a patch's rows out of place, would be off by
    the size of the tokens themselves)."""
    llm, _ = qwen2_vl
    prepared = llm.engine.prepare(video_prompt(clip(8, 7, size=84)), None)
    (video,) = whole_media(prepared.images)
    with torch.inference_mode():
        whole = llm.model.encode_images(video.pixel_values, [video.grid_thw])[0]
        parts = [llm.model.encode_images(g.pixel_values, [g.grid_thw])[0] for g in prepared.images]
    assert len(parts) == 4  # to float32 rounding: a matmul over fewer rows may round differently (8e-7 measured)
    torch.testing.assert_close(torch.cat(parts), whole, rtol=0, atol=1e-5)


def test_a_text_only_model_refuses_videos_by_name():
    from types import SimpleNamespace

    from nanomm.engine.config import EngineConfig
    from nanomm.engine.engine import _no_video_reason

    for family in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl"):
        assert _no_video_reason(SimpleNamespace(model_type=family)) is None
    assert "qwen2" in _no_video_reason(SimpleNamespace(model_type="qwen2"))  # a text-only draft
    assert EngineConfig(limit_mm_per_prompt={"video": 0}).limit_videos_per_prompt == 0


def demo_gif(path, num_frames: int = 4) -> list:
    """A red circle moving right over num_frames frames, saved as an animated GIF at 2 frames a second."""
    from PIL import Image, ImageDraw

    frames = []
    for i in range(num_frames):
        frame = Image.new("RGB", (168, 168), "white")
        ImageDraw.Draw(frame).ellipse((20 + 20 * i, 50, 80 + 20 * i, 110), fill="red")
        frames.append(frame)
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=500, loop=0)
    return frames


def test_the_chat_cli_takes_a_video_and_answers_as_the_engine(tmp_path):
    """`nanomm-chat --demo --video clip.gif`: the reply is the engine's greedy reply to the same clip."""
    import subprocess
    import sys

    from nanomm import demo_checkpoint

    demo_gif(tmp_path / "clip.gif")
    proc = subprocess.run([sys.executable, "-m", "nanomm.chat", "--demo", "--device", "cpu", "--video", "clip.gif",
                           "--max-tokens", "6"], input=b"What colour is the circle?\n", capture_output=True,
                          cwd=tmp_path, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr.decode()
    assert "clip.gif (4 frames)" in proc.stderr.decode()
    with LLM(demo_checkpoint(), device="cpu", num_preprocess_workers=0) as llm:
        out = llm.chat([{"role": "user", "content": [{"type": "video", "video": str(tmp_path / "clip.gif")},
                                                      {"type": "text", "text": "What colour is the circle?"}]}],
                       SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False)[0]
    assert proc.stdout.decode().strip() == " ".join(out.outputs[0].text.splitlines())
    assert out.metrics.num_visual_tokens == 2 * 12 * 12  # 4 frames: 2 temporal patches of 168 / 14 = 12 x 12


def test_the_server_takes_a_video_url_from_the_openai_client(qwen2_vl, tmp_path):
    import base64

    import openai

    from nanomm.serve.app import Server, ServerConfig
    from nanomm.serve.testing import BackgroundServer

    llm, _ = qwen2_vl
    demo_gif(tmp_path / "clip.gif")
    url = "data:image/gif;base64," + base64.b64encode((tmp_path / "clip.gif").read_bytes()).decode()
    messages = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}},
                                             {"type": "text", "text": "what moves?"}]}]
    with BackgroundServer(Server(llm, ServerConfig("tiny"))) as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0)
        with pytest.raises(openai.BadRequestError, match="video"):
            client.chat.completions.create(model="tiny", max_tokens=2, messages=[{"role": "user", "content": [
                {"type": "video_url", "video_url": {"url": "data:image/gif;base64,R0lGODlhAQAB"}}]}])
    offline = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False)[0]
    assert reply.choices[0].message.content == offline.outputs[0].text
    assert reply.usage.model_extra["visual_tokens"] == offline.metrics.num_visual_tokens > 0
    assert_no_leaks(llm)


@pytest.fixture(scope="module")
def qwen2_5_vl(tmp_path_factory):
    from hf_checkpoints import make_hf_checkpoint

    folder = make_hf_checkpoint(tmp_path_factory.mktemp("qwen2_5_vl_video"))  # tokens_per_second 2
    llm = LLM(str(folder), device="cpu", dtype="float32", max_pixels=MAX_PIXELS, num_preprocess_workers=0)
    oracle = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(
        str(folder), dtype=torch.float32, attn_implementation="eager").eval()
    yield llm, oracle
    llm.close()


@pytest.mark.parametrize("fps", [2.0, 3.0, 24.0])
def test_qwen2_5_vl_spaces_temporal_patches_by_seconds_as_transformers_does(qwen2_5_vl, fps):
    """Qwen2.5-VL's time ids: temporal patch g at trunc(g x tokens_per_second x seconds per patch), in float32.
    At 3 frames a second a patch spans 2/3 s: ids 0, 1, 2, 4 (4/3 apart, truncated); transformers is given the same
    second_per_grid_ts, and the greedy tokens and logits agree."""

    llm, oracle = qwen2_5_vl
    frames = clip(8, 9, size=224)  # 8x8 tokens a patch: the text after resumes as transformers 5.24 has it
    prompt = video_prompt(VideoInput(tuple(Image.fromarray(f) for f in frames), fps))
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=llm.model.config.text.vocab_size)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    prepared = llm.engine.prepare(prompt, params)
    (video,) = whole_media(prepared.images)
    first = prepared.token_ids.index(llm.model.config.video_token_id)
    interval = float(torch.tensor(2 / fps, dtype=torch.float32) * 2)
    expected = [first + int(torch.tensor(g, dtype=torch.float32) * torch.tensor(interval)) for g in range(4)]
    assert prepared.positions[0, first:first + 4 * 64:64].tolist() == expected
    assert_answer_is_transformers(out, oracle, hf_video_inputs(llm, prepared), fps)
    assert_no_leaks(llm)


def test_qwen2_5_vl_videos_through_the_engine_equal_the_dense_reference(qwen2_5_vl):
    """Window attention inside each temporal patch: the engine's patch-by-patch encodes, batched with pictures,
    give the reference's tokens (which encodes each clip whole)."""

    llm, _ = qwen2_5_vl
    prompts = [video_prompt(VideoInput(tuple(Image.fromarray(f) for f in clip(6, 30 + i, size=112)), 3.0),
                            picture=random_image(84, 112, 40 + i) if i else None) for i in range(3)]
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.7, seed=i, max_tokens=8, ignore_eos=True)
              for i in range(3)]
    assert_engine_matches_reference(llm, prompts, params)


# -- Qwen3-VL: frames sampled, each temporal patch a picture of its own after its time in text ----------------------

@pytest.fixture(scope="module")
def qwen3_vl(tmp_path_factory):
    from hf_checkpoints import make_hf_checkpoint

    folder = make_hf_checkpoint(tmp_path_factory.mktemp("qwen3_vl_video"), "qwen3_vl")
    llm = LLM(str(folder), device="cpu", dtype="float32", max_pixels=MAX_PIXELS, num_preprocess_workers=0)
    oracle = transformers.Qwen3VLForConditionalGeneration.from_pretrained(
        str(folder), dtype=torch.float32, attn_implementation="eager").eval()
    yield llm, oracle, folder
    llm.close()


QWEN3_CLIPS = {  # clips as arrays are 2 frames a second, Qwen3-VL's own rate: every frame is kept
    "16 frames": lambda: video_prompt(clip(16, 1, size=128)),  # 8 temporal patches of 4x4 tokens
    "an odd frame count": lambda: video_prompt(clip(5, 2, size=96)),  # padded to 6: 3 of 3x3
    "two videos": lambda: video_prompt(clip(4, 3, size=64), clip(6, 4, size=96)),
    "a video and a picture": lambda: video_prompt(clip(4, 5, size=64), picture=random_image(96, 64, 6)),
    "24 fps, sampled": lambda: video_prompt(VideoInput(tuple(Image.fromarray(f) for f in clip(24, 7, size=64)), 8.0)),
}


@pytest.mark.parametrize("name", QWEN3_CLIPS)
def test_qwen3_vl_greedy_tokens_and_logits_equal_transformers(qwen3_vl, name):
    """transformers is given the prompt nanomm expanded (the times and the inner vision markers are checked
    against Qwen3VLProcessor in tests/test_video_processor.py) and the whole clips' pixel values; it splits each
    clip into temporal patches for its positions as nanomm does, and its DeepStack levels go to the video's tokens."""
    llm, oracle, _ = qwen3_vl
    prompt = QWEN3_CLIPS[name]()
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=llm.model.config.text.vocab_size)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    prepared = llm.engine.prepare(prompt, params)
    assert_answer_is_transformers(out, oracle, hf_video_inputs(llm, prepared), name)
    assert_no_leaks(llm)


def test_qwen3_vl_lays_out_each_temporal_patch_as_a_picture_after_its_time(qwen3_vl):
    """8 frames of 64x64 at 2 a second: 4 temporal patches of 2x2 tokens at 0.25, 1.25, 2.25 and 3.25 s. Each
    is "<t seconds>" <|vision_start|> 4 pads <|vision_end|>, inside the placeholder's own markers; its tokens take
    t = s, h and w = s..s+1 from the position s where it starts, and the text after it resumes at s + 2."""
    llm, _, _ = qwen3_vl
    cfg, tok = llm.model.config, llm.tokenizer
    prepared = llm.engine.prepare(video_prompt(VideoInput(tuple(Image.fromarray(f) for f in clip(8, 8, size=64)),
                                                          2.0)), None)
    ids, positions = prepared.token_ids, prepared.positions
    begin = ids.index(cfg.vision_start_token_id)
    expected = [cfg.vision_start_token_id]
    for seconds in ("0.2", "1.2", "2.2", "3.2"):  # Python's format of 0.25 (a binary fraction, rounded to even)
        expected += tok.encode(f"<{seconds} seconds>") + [cfg.vision_start_token_id] + [cfg.video_token_id] * 4 + [
            cfg.vision_end_token_id]
    assert ids[begin:begin + len(expected) + 1] == expected + [cfg.vision_end_token_id]
    assert [(span.length, span.start) for span in prepared.image_spans] == [
        (4, i) for i, t in enumerate(ids) if t == cfg.video_token_id and ids[i - 1] != cfg.video_token_id]
    for span in prepared.image_spans:
        s = int(positions[0, span.start])
        assert positions[:, span.start:span.end].tolist() == [[s] * 4, [s, s, s + 1, s + 1], [s, s + 1, s, s + 1]]
        assert positions[:, span.end].tolist() == [s + 2] * 3  # its <|vision_end|>
    assert len({span.content_hash for span in prepared.image_spans}) == 4


def test_qwen3_vl_encoded_patch_by_patch_equals_the_clip_encoded_whole(qwen3_vl):
    """The learned position grid and the DeepStack levels too: per temporal patch, as the engine encodes, they equal
    the whole clip's (to float32 rounding)."""
    llm, _, _ = qwen3_vl
    prepared = llm.engine.prepare(video_prompt(clip(8, 9, size=96)), None)
    (video,) = whole_media(prepared.images)
    with torch.inference_mode():
        whole = llm.model.encode_images(video.pixel_values, [video.grid_thw])[0]  # (levels, tokens, hidden)
        parts = [llm.model.encode_images(g.pixel_values, [g.grid_thw])[0] for g in prepared.images]
    assert len(parts) == 4 and whole.shape[0] == 1 + len(llm.model.config.vision.deepstack_visual_indexes)
    torch.testing.assert_close(torch.cat(parts, dim=1), whole, rtol=0, atol=1e-5)


@pytest.mark.parametrize("settings", [
    dict(max_num_batched_tokens=7, block_size=4),  # chunks end inside temporal patches and between them
    dict(num_kv_blocks=30, block_size=4, max_num_seqs=4),  # too few blocks: preemption
    dict(speculative={"method": "ngram", "num_speculative_tokens": 3}),
], ids=["chunks-cut-groups", "preemption", "ngram"])
def test_qwen3_vl_videos_through_the_engine_equal_the_dense_reference(qwen3_vl, settings):
    assert_videos_equal_the_reference(str(qwen3_vl[2]), settings, size=64)


# -- fps, num_frames and do_sample_frames, read as each family's processor in transformers reads them ---------------

SAMPLING = json.loads((Path(__file__).parent / "data" / "video" / "sampling.json").read_text())


def sampling_case_id(case: dict) -> str:
    return f"{case['family']}-{case['clip']}-" + ("-".join(f"{k}={v}" for k, v in case["mm_processor_kwargs"].items())
                                                  or "default")


# The cases whose greedy tokens are compared too (the rest check frames, grid, prompt and pixels, which decide them):
# an fps that Qwen2-VL's processor ignores (the 5-frame clip kept whole), sampling on, and Qwen3-VL's default, off,
# and a rate that leaves an odd count.
GREEDY = {"qwen2_vl-odd-fps=2.0", "qwen2_vl-odd-do_sample_frames=True-fps=2.0", "qwen2_5_vl-odd-fps=2.0",
          "qwen2_5_vl-odd-do_sample_frames=True-fps=2.0", "qwen2_5_vl-long-do_sample_frames=True-num_frames=6",
          "qwen3_vl-odd-default", "qwen3_vl-odd-do_sample_frames=False", "qwen3_vl-long-fps=6.0"}


def sampling_cases(family: str) -> list:
    return [pytest.param(case, id=sampling_case_id(case)) for case in SAMPLING["cases"] if case["family"] == family]


@pytest.mark.parametrize("case", sampling_cases("qwen2_vl"))
def test_qwen2_vl_samples_only_with_do_sample_frames_as_transformers(qwen2_vl, case):
    assert_sampling_case_is_transformers(*qwen2_vl, case)


@pytest.mark.parametrize("case", sampling_cases("qwen2_5_vl"))
def test_qwen2_5_vl_samples_and_spaces_time_as_transformers(qwen2_5_vl, case):
    assert_sampling_case_is_transformers(*qwen2_5_vl, case)


@pytest.mark.parametrize("case", sampling_cases("qwen3_vl"))
def test_qwen3_vl_samples_by_default_as_transformers(qwen3_vl, case):
    assert_sampling_case_is_transformers(*qwen3_vl[:2], case)


def assert_sampling_case_is_transformers(llm, oracle, case: dict) -> None:
    """scripts/workshop/make_video_sampling_fixtures.py ran transformers' processors (Qwen2-VL's and Qwen2.5-VL's
    sample only with do_sample_frames; Qwen3-VL's by default) on these frames with these mm_processor_kwargs. nanomm
    keeps the same frames (the same grid, the same pixel values, Qwen2.5-VL's seconds per temporal patch, Qwen3-VL's
    times in the prompt), and for the GREEDY cases transformers' model given transformers' processor output answers
    with nanomm's greedy tokens."""
    frames = np.random.default_rng(case["seed"]).integers(0, 256, case["frames_thwc"], dtype=np.uint8)
    assert hashlib.sha256(frames.tobytes()).hexdigest() == case["frames_sha256"]
    prompt = {"prompt": SAMPLING["prompt"], "mm_processor_kwargs": case["mm_processor_kwargs"],
              "multi_modal_data": {"video": VideoInput(tuple(Image.fromarray(f) for f in frames), case["fps"])}}
    settings = llm.engine.processor.video_settings.with_request(case["mm_processor_kwargs"], "case")
    assert settings.frame_indices(len(frames), case["fps"], "case") == case["frames_indices"]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=llm.model.config.text.vocab_size)
    prepared = llm.engine.prepare(prompt, params)
    (video,) = whole_media(prepared.images)
    assert prepared.token_ids == case["input_ids"]
    assert list(video.grid_thw) == case["video_grid_thw"] and video.fps == case["sampled_fps"]
    pixel_values = video.pixel_values
    assert hashlib.sha256(pixel_values.numpy().tobytes()).hexdigest() == case["pixel_values_sha256"]
    if "second_per_grid_ts" in case:
        assert video.second_per_grid == case["second_per_grid_ts"][0]
    if sampling_case_id(case) not in GREEDY:
        return
    ids, cfg = torch.tensor([case["input_ids"]]), llm.model.config
    inputs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values_videos=pixel_values,  # bit for bit
                  video_grid_thw=torch.tensor([case["video_grid_thw"]]),
                  mm_token_type_ids=(ids == cfg.image_token_id).int() + 2 * (ids == cfg.video_token_id).int())
    if "second_per_grid_ts" in case:
        inputs["second_per_grid_ts"] = torch.tensor(case["second_per_grid_ts"], dtype=torch.float32)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    assert_answer_is_transformers(out, oracle, inputs, sampling_case_id(case))
    assert_no_leaks(llm)


def test_qwen2_vl_refuses_do_sample_frames_with_nothing_to_sample_by(qwen2_vl):
    """transformers' Qwen2VLVideoProcessor fails there too (a TypeError in sample_frames); Qwen3-VL has its fps 2."""
    llm, _ = qwen2_vl
    with pytest.raises(InvalidInputError, match="do_sample_frames needs an fps or a num_frames"):
        llm.engine.prepare({**video_prompt(lambda: None), "mm_processor_kwargs": {"do_sample_frames": True}}, None)
    assert_no_leaks(llm)  # (a clip that cannot load: refused before that)


# -- the encoder service encodes videos: a temporal patch at a time, cached by its own hash ----------------------

@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])
def test_an_engine_with_an_encoder_service_answers_videos_as_one_with_its_own_tower(ckpt, qwen3_vl, family):
    """Each temporal patch's two frames travel (uint8) with its hash; the service normalises them as videos are
    normalised (inputs/video.py), runs its tower, and caches each patch: the same tokens and logprobs as an engine
    with its own tower, DeepStack levels included, and a repeated clip is not encoded twice."""
    import httpx

    from nanomm.serve.encoder_server import EncoderServer, load_encoder
    from nanomm.serve.testing import BackgroundServer

    folder = str(ckpt) if family == "qwen2_vl" else str(qwen3_vl[2])
    prompts = [video_prompt(clip(6, 80, size=64), text="one"),
               video_prompt(clip(4, 81, size=64), picture=random_image(64, 96, 82), text="two"),
               video_prompt(clip(6, 80, size=64), text="the first clip again"),
               {**video_prompt(clip(4, 83, size=112), text="pruned"),  # compressed patch by patch, by the service
                "mm_processor_kwargs": {"visual_token_compression": {"method": "prune", "keep_ratio": 0.5}}}]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3)
    with BackgroundServer(EncoderServer(load_encoder(folder), "m")) as url, \
            LLM(folder, device="cpu", dtype="float32", num_preprocess_workers=0, encoder_url=url) as remote, \
            LLM(folder, device="cpu", dtype="float32", num_preprocess_workers=0) as local:
        assert remote.model.visual is None
        for mine, theirs in zip(remote.generate(prompts, params, use_tqdm=False),
                                local.generate(prompts, params, use_tqdm=False)):
            assert mine.outputs[0].token_ids == theirs.outputs[0].token_ids
            for a, b in zip(mine.outputs[0].logprobs, theirs.outputs[0].logprobs):
                assert a.keys() == b.keys() and all(abs(a[t].logprob - b[t].logprob) < 1e-5 for t in a)
        metrics = httpx.get(url + "/metrics").text
        encoded = [float(line.split()[-1]) for line in metrics.splitlines()
                   if line.startswith("nanomm_encoder_visual_tokens_total")]
        assert encoded == [local.stats()["visual_tokens_encoded"]]  # the third prompt's clip: cache hits
        assert_no_leaks(remote)


def test_the_encoder_service_checks_a_video_patch_before_encoding(ckpt):
    """A patch's frames must be whole, its kept tokens (if pruned) in its grid, pruned or compressed but not both,
    and preprocessed with this model's video constants."""
    import httpx

    from nanomm.serve.encoder_server import EncoderServer, load_encoder
    from nanomm.serve.testing import BackgroundServer
    from nanomm.transfer import encode_request, unpack, pack

    with LLM(str(ckpt), device="cpu", dtype="float32", num_preprocess_workers=0) as llm:
        group = llm.engine.prepare(video_prompt(clip(2, 90)), None).images[0]
    tensors, message = unpack(encode_request([group]), "test")
    assert message["images"][0]["video"] is True and tensors["rgb.0"].numel() == 2 * 56 * 56 * 3
    bad = {"half the frames": ({"rgb.0": tensors["rgb.0"][: 56 * 56 * 3]}, message),
           "pruned and compressed": (tensors, {**message, "images": [{**message["images"][0], "kept": [0, 1],
                                                                     "compression": {"method": "pool",
                                                                                     "keep_ratio": 0.25}}]}),
           "kept out of range": (tensors, {**message, "images": [{**message["images"][0], "kept": [0, 4]}]}),
           "other constants": (tensors, {**message, "video_preprocessing": {**message["video_preprocessing"],
                                                                            "image_mean": [0.5, 0.5, 0.5]}}),
           "video: false": (tensors, {**message, "images": [{**message["images"][0], "video": False}]})}
    with BackgroundServer(EncoderServer(load_encoder(str(ckpt)), "m")) as url:
        for what, (t, m) in bad.items():
            answer = httpx.post(url + "/v1/encode", content=pack(t, m))
            assert answer.status_code == 400, what
        assert httpx.post(url + "/v1/encode", content=pack(tensors, message)).status_code == 200


# -- the four clips of every family, at tiny and real widths ------------------------------------------------------

def four_clips(factor: int, fps: float) -> dict:
    """16 frames, an odd count, two videos, a video with a picture: frames of whole tokens (factor pixels), each
    clip with no more temporal patches than rows of tokens (where transformers 5.24's position rule agrees)."""
    def video(num_frames, seed, tokens):
        return VideoInput(tuple(Image.fromarray(f) for f in clip(num_frames, seed, size=factor * tokens)), fps)
    return {"16 frames": video_prompt(video(16, 101, 8)), "an odd frame count": video_prompt(video(5, 102, 3)),
            "two videos": video_prompt(video(4, 103, 2), video(6, 104, 3)),
            "a video and a picture": video_prompt(video(4, 105, 2), picture=random_image(3 * factor, 2 * factor, 106))}


def assert_four_clips_equal_transformers(llm, oracle, fps: float) -> None:
    factor = llm.image_config.factor
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=llm.model.config.text.vocab_size)
    for name, prompt in four_clips(factor, fps).items():
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        prepared = llm.engine.prepare(prompt, params)
        assert_answer_is_transformers(out, oracle, hf_video_inputs(llm, prepared), name)
    assert_no_leaks(llm)


def test_qwen2_5_vl_four_clips_equal_transformers(qwen2_5_vl):
    """At 4 frames a second a temporal patch spans half a second: one time id apart (tokens_per_second 2)."""
    llm, oracle = qwen2_5_vl
    assert_four_clips_equal_transformers(llm, oracle, 4.0)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_real_widths_four_clips_equal_transformers(tmp_path, family):
    """Qwen2-VL-2B's, Qwen2.5-VL-3B's and Qwen3-VL-2B's widths and the real vocabulary, depths cut
    (tests/hf_checkpoints.py); DeepStack levels, window attention and chunks that cut temporal patches included."""
    from hf_checkpoints import QWEN2_5_3B_CUT, QWEN3_2B_CUT, make_hf_checkpoint
    from nanomm.tools.random_checkpoint import make_checkpoint

    if family == "qwen2_vl":
        folder, oracle_class = make_checkpoint(tmp_path / "2b", preset="2b-shaped"), transformers.Qwen2VLForConditionalGeneration
    else:
        cut, oracle_class = ((QWEN2_5_3B_CUT, transformers.Qwen2_5_VLForConditionalGeneration) if family == "qwen2_5_vl"
                             else (QWEN3_2B_CUT, transformers.Qwen3VLForConditionalGeneration))
        folder = make_hf_checkpoint(tmp_path / family, family, text=cut["text"], vision=cut["vision"],
                                    tie_word_embeddings=True, tokenizer="qwen")
    oracle = oracle_class.from_pretrained(str(folder), dtype=torch.float32, attn_implementation="eager").eval()
    with LLM(str(folder), device="cpu", dtype="float32", num_preprocess_workers=0, max_pixels=MAX_PIXELS,
             max_num_batched_tokens=40, block_size=8) as llm:  # chunks end inside temporal patches
        assert llm.model.config.text.hidden_size >= 1536
        assert_four_clips_equal_transformers(llm, oracle, 4.0 if family == "qwen2_5_vl" else 2.0)
