"""EVS-style pruning (inputs/video_pruning.py): each later temporal patch keeps its most-changed tokens, chosen
from the pixels before the tower runs, each at the position it had unpruned. The oracle is the dense reference
(transformers has no pruning): the engine gives its tokens under chunks, small blocks, preemption, the prefix and
encoder caches, an encoder service, and for all three families' layouts of time."""

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw

from helpers import assert_engine_matches_reference, assert_no_leaks
from nanomm import LLM, SamplingParams
from nanomm.errors import InvalidInputError
from nanomm.inputs.video_io import VideoInput
from nanomm.inputs.video_pruning import kept_per_patch
from nanomm.reference import whole_media
from test_video import MAX_PIXELS, clip, video_prompt


def moving_square(num_frames: int, size: int = 112, step: int = 28, seed: int = 0) -> VideoInput:
    """A white square crossing a still grey field with a little fixed noise: only where it goes changes."""
    rng = np.random.default_rng(seed)
    field = (128 + rng.integers(-8, 9, (size, size, 3))).astype(np.uint8)
    frames = []
    for i in range(num_frames):
        frame = Image.fromarray(field)
        x = (i // 2 * step) % (size - 27)
        ImageDraw.Draw(frame).rectangle((x, 28, x + 27, 55), fill="white")
        frames.append(frame)
    return VideoInput(tuple(frames), 2.0)


def test_each_later_patch_keeps_its_most_changed_tokens_by_hand():
    """4 frames of 2x2 tokens of 28 px (2 patches): the second patch's token 3 changed most, then 1; at rate 0.5
    it keeps those two, in raster order; the first patch keeps all four."""
    frames = torch.zeros(4, 56, 56, 3, dtype=torch.uint8)
    frames[2:, 28:, 28:] = 200  # token 3 of patch 1 changes by 200
    frames[3, :28, 28:] = 50  # token 1 by 25 (one of its two frames)
    kept = kept_per_patch(frames, 28, 2, 0.5)
    assert [k.tolist() for k in kept] == [[0, 1, 2, 3], [1, 3]]
    assert [k.tolist() for k in kept_per_patch(frames, 28, 2, 0.75)] == [[0, 1, 2, 3], [3]]
    assert [k.tolist() for k in kept_per_patch(frames, 28, 2, 0.0)] == [[0, 1, 2, 3]] * 2
    still = torch.zeros(4, 56, 56, 3, dtype=torch.uint8)  # nothing changes: ties go to the earlier tokens
    assert [k.tolist() for k in kept_per_patch(still, 28, 2, 0.5)] == [[0, 1, 2, 3], [0, 1]]


@pytest.fixture(scope="module")
def qwen2_vl(ckpt):
    with LLM(str(ckpt), device="cpu", dtype="float32", max_pixels=MAX_PIXELS, num_preprocess_workers=0) as llm:
        yield llm


def test_a_pruned_clip_keeps_the_moving_tokens_at_their_own_positions(qwen2_vl):
    llm = qwen2_vl
    video = moving_square(8)
    whole = llm.engine.prepare(video_prompt(video), None)
    pruned = llm.engine.prepare({**video_prompt(video), "mm_processor_kwargs": {"video_pruning_rate": 0.75}}, None)
    (full,), (cut,) = whole_media(whole.images), whole_media(pruned.images)
    assert full.num_tokens == 4 * 16 and cut.num_tokens == 16 + 3 * 4  # 4 patches of 4x4; later ones keep 4
    for g, kept in enumerate(cut.kept[1:], start=1):  # the square's old and new places are among the kept
        x_old, x_new = ((g - 1) * 28) % 85 // 28, (g * 28) % 85 // 28
        assert {4 + x_old, 4 + x_new} <= set(kept.tolist()), g
    video_pad = llm.model.config.video_token_id
    first = whole.token_ids.index(video_pad)
    rows = first + cut.kept_rows
    assert torch.equal(pruned.positions[:, first:first + cut.num_tokens], whole.positions[:, rows])
    after = first + cut.num_tokens
    assert torch.equal(pruned.positions[:, after], whole.positions[:, first + full.num_tokens])  # text goes on
    assert [s.length for s in pruned.image_spans] == [16, 4, 4, 4]
    assert len({s.content_hash for s in pruned.image_spans} & {s.content_hash for s in whole.image_spans}) == 0
    with pytest.raises(InvalidInputError, match="video_pruning_rate must be a number in \\[0, 1\\)"):
        llm.engine.prepare({**video_prompt(video), "mm_processor_kwargs": {"video_pruning_rate": 1.0}}, None)


SETTINGS = [dict(max_num_batched_tokens=7, block_size=4), dict(num_kv_blocks=24, block_size=4, max_num_seqs=4)]


@pytest.mark.parametrize("settings", SETTINGS, ids=["chunks-cut-groups", "preemption"])
def test_pruned_videos_through_the_engine_equal_the_dense_reference(ckpt, settings):
    with LLM(str(ckpt), device="cpu", dtype="float32", max_pixels=MAX_PIXELS, num_preprocess_workers=0,
             video_pruning_rate=0.5, **settings) as llm:
        prompts = [video_prompt(moving_square(6, seed=i), text=f"clip {i}") for i in range(3)] + [
            {**video_prompt(clip(4, 7)), "mm_processor_kwargs": {"video_pruning_rate": 0.9}}]
        params = [SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=8, ignore_eos=True)
                  for i in range(len(prompts))]
        assert_engine_matches_reference(llm, prompts, params)
        again = assert_engine_matches_reference(llm, prompts, params)
        if "num_kv_blocks" in settings:
            assert llm.stats()["preemptions"] > 0
        else:
            assert all(out.metrics.num_cached_tokens > 0 for out in again)
        moved = {**prompts[0], "prompt": "first this. " + prompts[0]["prompt"]}
        (out,) = assert_engine_matches_reference(llm, [moved], params[:1])
        assert out.metrics.encoder_cache_hits == 3 and out.metrics.num_visual_tokens == 16 + 2 * 8


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_pruning_keeps_each_family_s_time_layout(tmp_path, family):
    """Qwen2.5-VL spaces patches by seconds; Qwen3-VL places each patch as a picture after its time: pruned, the
    kept tokens sit where they did, and the engine equals the reference, also with an encoder service."""
    from hf_checkpoints import make_hf_checkpoint
    from nanomm.serve.encoder_server import EncoderServer, load_encoder
    from nanomm.serve.testing import BackgroundServer

    folder = str(make_hf_checkpoint(tmp_path / family, family))
    video = VideoInput(moving_square(8, size=128, step=32).frames, 3.0 if family == "qwen2_5_vl" else 2.0)
    prompts = [{**video_prompt(video, text=f"q{i}"), "mm_processor_kwargs": {"video_pruning_rate": rate}}
               for i, rate in enumerate((0.0, 0.5, 0.8))]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
    with LLM(folder, device="cpu", dtype="float32", num_preprocess_workers=0, max_num_batched_tokens=9,
             block_size=4) as llm:
        local = assert_engine_matches_reference(llm, prompts, [params] * 3)
        whole = llm.engine.prepare(prompts[0], None)
        pruned = llm.engine.prepare(prompts[2], None)
        (cut,) = whole_media(pruned.images)
        pads = [i for i, t in enumerate(whole.token_ids) if t == llm.model.config.video_token_id]
        kept_pads = [i for i, t in enumerate(pruned.token_ids) if t == llm.model.config.video_token_id]
        assert len(kept_pads) == cut.num_tokens < len(pads)
        first_text = pads[0] - 1  # everything before the clip's first pad is the same text
        shift = [whole.positions[:, pads[r]] for r in cut.kept_rows.tolist()]
        assert all(torch.equal(pruned.positions[:, p], s) for p, s in zip(kept_pads, shift))
        assert torch.equal(pruned.positions[:, :first_text], whole.positions[:, :first_text])
        with BackgroundServer(EncoderServer(load_encoder(folder), "m")) as url, \
                LLM(folder, device="cpu", dtype="float32", num_preprocess_workers=0, encoder_url=url) as remote:
            for mine, theirs in zip(remote.generate(prompts, params, use_tqdm=False), local):
                assert mine.outputs[0].token_ids == theirs.outputs[0].token_ids
            assert_no_leaks(remote)


# -- lesson 10's compression, temporal patch by temporal patch ---------------------------------------------------

@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_compressed_videos_equal_the_reference_that_compresses_each_patch(ckpt, tmp_path, family):
    """A request's visual_token_compression applies to its videos too, each temporal patch as a picture: the
    engine (patch by patch, positions completed by the runner) equals the dense reference (the clip whole, cut into
    patches after the tower) for each method, in every family's time layout; a pruned clip is not compressed too."""
    from hf_checkpoints import make_hf_checkpoint

    folder = str(ckpt) if family == "qwen2_vl" else str(make_hf_checkpoint(tmp_path / family, family))
    fps = 3.0 if family == "qwen2_5_vl" else 2.0
    video = VideoInput(tuple(Image.fromarray(f) for f in clip(6, 77, size=112 if family != "qwen3_vl" else 128)), fps)
    methods = [{"method": m, "keep_ratio": r} for m, r in (("pool", 0.25), ("random", 0.5), ("prune", 0.3),
                                                           ("attention", 0.5))]
    prompts = [{**video_prompt(video, text=f"q{i}"), "mm_processor_kwargs": {"visual_token_compression": m}}
               for i, m in enumerate(methods)]
    prompts.append({**video_prompt(video, picture=moving_square(2).frames[0], text="both"),
                    "mm_processor_kwargs": {"visual_token_compression": methods[0]}})
    params = [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)] * len(prompts)
    with LLM(folder, device="cpu", dtype="float32", num_preprocess_workers=0, max_pixels=MAX_PIXELS,
             max_num_batched_tokens=7, block_size=4) as llm:
        assert_engine_matches_reference(llm, prompts, params)
        (pooled,) = whole_media(llm.engine.prepare(prompts[0], None).images)
        assert pooled.num_tokens == 3 * pooled.num_encoded_tokens // 3 // 4 and pooled.compression.method == "pool"
        both = {**prompts[1], "mm_processor_kwargs": {"visual_token_compression": methods[1],
                                                      "video_pruning_rate": 0.5}}
        (pruned,) = whole_media(llm.engine.prepare(both, None).images)
        assert pruned.compression is None and pruned.kept is not None
