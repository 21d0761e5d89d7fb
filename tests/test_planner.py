"""The KV budget planner (nanomm/planner.py) against independent counts and against real engines.

Oracles: the Hub's own byte count for Qwen2-VL-2B, a brute-force search over image sizes through smart_resize,
the engine's own expansion of a prompt, and the requests a real engine actually ran at once."""

import json
import logging
import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from helpers import chat_prompt
from nanomm import LLM, SamplingParams
from nanomm.inputs.image import ImageProcessorConfig, smart_resize
from nanomm.model.config import ModelConfig
from nanomm.model.loader import load_model
from nanomm.engine.sizing import GiB, image_tokens, kv_pool_budget, worst_case_image
from nanomm.errors import InvalidInputError
from nanomm.planner import (DEFAULT_VIDEO_FPS, Workload, load_configs, main, make_plan, parameter_count, plan_lines,
                            render)

ROOT = Path(__file__).resolve().parents[1]
QWEN2_VL_2B = ROOT / "tests" / "data" / "Qwen2-VL-2B-Instruct"


def test_the_weights_of_qwen2_vl_2b_are_counted_from_its_config_alone():
    config, _ = load_configs(QWEN2_VL_2B)
    # The Hub's model.safetensors.index.json for Qwen2-VL-2B: total_size 4,417,971,200 bytes of bfloat16.
    assert parameter_count(config) == 4_417_971_200 // 2
    plan = make_plan(config, ImageProcessorConfig(), dtype="bfloat16", device_memory_gib=24)
    assert plan.weights_bytes == 4_417_971_200
    # 2 (k, v) x 28 layers x 2 KV heads x 128 head_dim x 2 bytes
    assert plan.kv_bytes_per_token == 2 * 28 * 2 * 128 * 2 == 28_672


def test_parameter_count_equals_a_loaded_model(ckpt):
    model = load_model(ckpt)
    assert parameter_count(ModelConfig.from_pretrained(ckpt)) == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("max_tokens", [4, 16, 100, 256])
def test_the_worst_case_image_is_the_worst_of_every_size(max_tokens):
    """Every image size up to a bound, through smart_resize: none gets more tokens than the planner's worst."""
    config = ImageProcessorConfig(min_pixels=min(3136, max_tokens * 784), max_pixels=max_tokens * 784)
    brute = 0
    for height in range(1, 64):  # up to the 200:1 limit; past 64 px of height, no strip beats the area cap
        for width in range(height, 200 * height + 1):
            h, w = smart_resize(height, width, 28, config.min_pixels, config.max_pixels)
            brute = max(brute, (h // 28) * (w // 28))
    (width, height), tokens = worst_case_image(config)
    assert tokens == brute
    assert image_tokens(width, height, config) == tokens  # the witness image reaches it
    if max_tokens == 4:  # a 200:1 strip keeps a whole token of height: more than the area allows
        assert tokens > max_tokens


def test_worst_case_at_the_hub_cap_is_16384_tokens():
    _, image_config = load_configs(QWEN2_VL_2B)
    assert image_config.max_pixels == 12_845_056
    assert worst_case_image(image_config)[1] == 16_384
    assert image_tokens(1024, 768, image_config) == 37 * 27  # smart_resize: 1036 x 756


def test_the_gpu_pool_rule_by_hand():
    budget, rule = kv_pool_budget("cuda", total_bytes=24 * GiB, used_bytes=4 * GiB, gpu_memory_utilization=0.9,
                                  reserve_bytes=GiB)
    assert budget == int(0.9 * 24 * GiB) - 5 * GiB
    assert "0.9 x 24.0 GiB" in rule
    assert kv_pool_budget("cpu")[0] == 2 * GiB
    assert kv_pool_budget("cuda", total_bytes=80 * GiB, kv_cache_memory_gib=3)[0] == 3 * GiB


def test_the_vision_reserve_grows_with_the_pixel_cap():
    config, image_config = load_configs(QWEN2_VL_2B)
    # Few sequences and no CUDA graphs: the decode step's reserve stays under the 1 GiB floor (next test).
    quiet = dict(max_num_seqs=4, cuda_graphs=False, device_memory_gib=24, alternatives=False)
    big = make_plan(config, image_config, **quiet)
    small = make_plan(config, replace(image_config, max_pixels=1280 * 784), **quiet)
    # 65,536 patches: pixels (1176 floats in float32 and bfloat16) + the MLP step (2 x 1280 + 3 x 5120) in bfloat16
    assert big.vision_peak_bytes == 65_536 * 1176 * 6 + 65_536 * (2 * 1280 + 3 * 5120) * 2
    assert big.vision_peak_bytes > GiB  # so the reserve is the vision peak, and the pool is smaller
    assert big.kv_budget_bytes == int(0.9 * 24 * GiB) - 4_417_971_200 - big.vision_peak_bytes
    assert small.kv_budget_bytes == int(0.9 * 24 * GiB) - 4_417_971_200 - GiB


def test_the_decode_reserve_is_the_worst_batched_step_slice_by_slice():
    config, image_config = load_configs(QWEN2_VL_2B)
    # Qwen2-VL-2B: 2 KV heads of 128, 12 query heads, vocab 151,936; bfloat16. The worst batched step: 64 runs of
    # 16 queries (MAX_BATCHED_QUERIES) padded to 32,768 keys. A run gathers 32,768 x (2 x 2 x 128) elements and
    # scores 32,768 x 12 x 16: 2**27 elements (SLICE_ELEMENTS) hold 5 runs per slice.
    def step_bytes(rows, keys, queries, runs):
        # the mask's source, the key rows, the logits
        whole = rows * queries * keys * 4 + rows * 2 * keys * 8 + rows * queries * 151_936 * 4
        gathered = 2 * runs * keys * 2 * 128
        scores = runs * queries * 12 * keys * (4 + 4 + 4 + 2)  # mask, scores, softmax in float32; probabilities
        one_slice = gathered * 2 + gathered // 128 * 8 + gathered // 2 * 4 + scores
        return whole + one_slice
    eager = step_bytes(64, 32_768, 16, runs=5)
    # CUDA graphs cover decodes (1 query) up to 8,192 keys: 31 runs a slice; that step and the logits buffer stay.
    graphs = step_bytes(64, 8192, 1, runs=31) + 64 * 151_936 * 4
    plan = make_plan(config, image_config, device_memory_gib=24, alternatives=False)
    assert (plan.decode_peak_bytes, plan.decode_graph_bytes) == (eager, graphs)
    reserve = max(plan.vision_peak_bytes, eager) + graphs
    assert plan.kv_budget_bytes == int(0.9 * 24 * GiB) - 4_417_971_200 - reserve
    eager_only = make_plan(config, image_config, device_memory_gib=24, alternatives=False, cuda_graphs=False)
    assert eager_only.decode_graph_bytes == 0
    assert eager_only.kv_budget_bytes == int(0.9 * 24 * GiB) - 4_417_971_200 - max(plan.vision_peak_bytes, eager)
    # An fp8 pool dequantizes what it gathers: 1-byte codes and a float32 copy more per gathered element.
    fp8 = make_plan(config, image_config, device_memory_gib=24, alternatives=False, kv_dtype="fp8")
    assert fp8.decode_peak_bytes == eager + 2 * 5 * 32_768 * 2 * 128 * 5


def _engine_plan(llm, workload):
    return llm.plan(images_per_request=workload.images_per_request, prompt_tokens=workload.prompt_tokens,
                    output_tokens=workload.output_tokens, typical_image=workload.typical_image)


def test_visual_tokens_and_request_length_are_the_engine_s(ckpt):
    with LLM(ckpt, max_pixels=64 * 784, min_pixels=4 * 784, num_kv_blocks=400, block_size=4) as llm:
        plan = llm.plan(images_per_request=2)
        (width, height), worst = plan.worst_image, plan.visual_tokens_worst
        images = [Image.new("RGB", (width, height), "red"), Image.new("RGB", plan.workload.typical_image, "blue")]
        prompt = chat_prompt("What is in these pictures?", images)
        prepared = llm.engine.prepare(prompt, SamplingParams(max_tokens=8))
        assert [im.num_tokens for im in prepared.images] == [worst, plan.visual_tokens_typical]
        text_tokens = len(llm.tokenizer.encode(prompt["prompt"])) - 2 * 3  # less each image's 3 placeholders
        workload = Workload(2, text_tokens, 8)
        plan = _engine_plan(llm, workload)
        # The engine holds KV for every token but the last sampled one.
        assert plan.kv_tokens_worst + 1 - 8 == text_tokens + 2 * (worst + 2)
        mixed = len(prepared.token_ids) + 8 - 1  # one worst image, one typical
        assert mixed == text_tokens + (worst + 2) + (plan.visual_tokens_typical + 2) + 8 - 1


@pytest.mark.parametrize("spare_blocks", [0, -1])
def test_the_requests_a_real_engine_runs_at_once_are_the_plan_s(ckpt, spare_blocks):
    """A pool of exactly C requests' worth of blocks (or one block short): the engine runs C (or C - 1) requests
    at their full length at once, the plan says so, and the rest wait or are preempted, as the scheduler does."""
    block_size, copies = 4, 3
    image = Image.new("RGB", (56, 56), "green")
    prompt = chat_prompt("Describe the picture in detail.", [image])
    with LLM(ckpt, max_pixels=16 * 784, num_kv_blocks=1000, block_size=block_size) as probe:
        text_tokens = len(probe.tokenizer.encode(prompt["prompt"])) - 3
        visual = probe.engine.prepare(prompt, None).images[0].num_tokens
    prompt_tokens = text_tokens + visual + 2
    output_tokens = 8 + (-(prompt_tokens + 8 - 1)) % block_size  # the KV fills its last block exactly
    kv_tokens = prompt_tokens + output_tokens - 1  # the last output token is sampled, never fed back
    assert kv_tokens % block_size == 0  # so a count one token too long would need one more block
    blocks = -(-kv_tokens // block_size)  # counted here by hand, not by the planner
    pool = copies * blocks + spare_blocks
    # Pictures prepared inline: each request is waiting from add_request on, in order. On the worker pool a request
    # joins when its picture is ready, so when each is admitted varies from run to run (with the pool, about 1 run
    # in 20 saw only 2 requests at full length at once).
    with LLM(ckpt, max_pixels=16 * 784, num_kv_blocks=pool, block_size=block_size, max_num_seqs=16,
             enable_prefix_caching=False, num_preprocess_workers=0) as llm:
        plan = llm.plan(images_per_request=1, prompt_tokens=text_tokens, output_tokens=output_tokens,
                        typical_image=(56, 56))
        assert plan.blocks_typical == blocks and plan.num_kv_blocks == pool
        params = SamplingParams(max_tokens=output_tokens, ignore_eos=True, temperature=0)
        for _ in range(copies + 2):
            llm.engine.add_request(prompt, params)
        most_at_full_length = 0
        while llm.engine.has_unfinished_requests():
            llm.engine.step()
            full = [r for r in llm.engine.scheduler.running if len(r.block_table) == blocks]
            most_at_full_length = max(most_at_full_length, len(full))
    expected = copies if spare_blocks >= 0 else copies - 1
    assert most_at_full_length == plan.fit_typical == plan.concurrency_typical == expected


def test_a_given_kv_budget_gives_the_engine_s_pool(ckpt):
    with LLM(ckpt, kv_cache_memory_gib=0.001, block_size=8) as llm:
        plan = llm.plan()
        standalone = make_plan(llm.model.config, llm.image_config, dtype="float32", block_size=8,
                               kv_cache_memory_gib=0.001, max_model_len=llm.engine.config.max_model_len)
    per_block = 8 * 2 * 2 * 2 * 16 * 4  # block_size x (k, v) x 2 layers x 2 KV heads x head_dim 16 x float32
    assert llm.engine.config.num_kv_blocks == int(0.001 * GiB) // per_block == plan.num_kv_blocks
    assert standalone.num_kv_blocks == plan.num_kv_blocks


@pytest.mark.parametrize("engine_args", [dict(max_model_len=256, max_num_seqs=4),  # the CPU default, capped
                                         dict(kv_cache_memory_gib=0.002, block_size=8)], ids=["default", "given"])
def test_the_plan_and_the_engine_size_the_pool_by_one_rule(ckpt, engine_args):
    """`LLM` and nanomm-plan size through one module (engine/sizing.py): a plan made from the config alone, with the
    engine's arguments, holds the pool the engine allocated, in the same budget, at the same bytes per token."""
    with LLM(ckpt, **engine_args) as llm:
        config, stats = llm.engine.config, llm.stats()
        standalone = make_plan(llm.model.config, llm.image_config, dtype="float32", block_size=config.block_size,
                               max_num_seqs=config.max_num_seqs, max_model_len=config.max_model_len,
                               kv_cache_memory_gib=engine_args.get("kv_cache_memory_gib"), alternatives=False)
        plan = llm.plan()
    assert standalone.num_kv_blocks == plan.num_kv_blocks == config.num_kv_blocks == stats["kv_blocks_total"]
    assert standalone.kv_budget_bytes == stats["kv_budget_bytes"]
    assert standalone.kv_bytes_per_token == plan.kv_bytes_per_token == stats["kv_bytes_per_token"]
    if "max_num_seqs" in engine_args:  # the budget holds more than 4 sequences of 256 tokens could ever use
        assert config.num_kv_blocks == 4 * 256 // config.block_size < stats["kv_budget_bytes"] // (
            config.block_size * stats["kv_bytes_per_token"])


def test_the_engine_logs_its_plan_at_start_up(ckpt, caplog):
    with caplog.at_level(logging.INFO, logger="nanomm"):
        with LLM(ckpt, num_kv_blocks=64) as llm:
            blocks = llm.engine.config.num_kv_blocks
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert f"KV plan: KV pool: {blocks} blocks" in logged and "KV plan: visual tokens per image: worst" in logged


def test_the_command_line(capsys, tmp_path):
    assert main([str(QWEN2_VL_2B), "--device-memory", "24", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["visual_tokens_worst"] == 16_384 and plan["weights_bytes"] == 4_417_971_200
    assert main([str(tmp_path / "nothing")]) == 2
    assert "no such checkpoint folder" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main([str(QWEN2_VL_2B), "--typical-image", "big"])
    assert exit_info.value.code == 2 and "WIDTHxHEIGHT" in capsys.readouterr().err
    # A pool that cannot hold one worst-case request is an error exit, after the plan is shown.
    assert main([str(QWEN2_VL_2B), "--kv-cache-memory", "0.01"]) == 1
    assert "cannot hold even one" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------------------------
# Videos (lesson 17): frames = seconds x fps, padded to whole temporal patches of 2 frames, each the tokens of a picture


def _video_plan(image_config=None, **workload):
    config, hub_images = load_configs(QWEN2_VL_2B)
    return make_plan(config, image_config or hub_images, device_memory_gib=80, alternatives=False,
                     workload=Workload(**({"images_per_request": 0} | workload)))


def test_video_tokens_by_hand():
    # 20 s at 2 fps of 448x448: 40 frames -> 20 temporal patches x (448 / 28)^2 = 5,120 tokens; at the Hub's cap a
    # worst-case frame has 16,384 (test_worst_case_at_the_hub_cap_is_16384_tokens): 20 x 16,384.
    plan = _video_plan(videos_per_request=1, video_seconds=20, video_fps=2, video_size=(448, 448))
    assert plan.workload.video_frames == 40 and plan.video_temporal_patches == 20
    assert (plan.video_frame_tokens_typical, plan.video_frame_tokens_worst) == (256, 16_384)
    assert plan.video_tokens_typical == 20 * 16 * 16 == 5_120
    assert plan.video_tokens_worst == 20 * 16_384 == 327_680
    # 64 prompt tokens + <|vision_start|> 5,120 x <|video_pad|> <|vision_end|> + 256 output, less the last one
    assert plan.kv_tokens_typical == 64 + 5_122 + 256 - 1 == 5_441
    assert plan.blocks_typical == 341 and plan.fit_typical == plan.num_kv_blocks // 341  # ceil(5,441 / 16)
    assert plan.kv_tokens_worst == 64 + 327_682 + 256 - 1 and plan.fit_worst == plan.num_kv_blocks // 20_501
    # At a cap of 1,280 tokens a frame (1,003,520 pixels), 20 temporal patches of the worst frame: 25,600.
    _, hub_images = load_configs(QWEN2_VL_2B)
    capped = _video_plan(replace(hub_images, max_pixels=1_003_520), videos_per_request=1, video_seconds=20)
    assert capped.video_tokens_worst == capped.video_tokens_typical == 20 * 1_280  # no size given: the worst
    # Frames are seconds x fps rounded half up (at least one), then padded to an even count.
    for seconds, fps, frames, patches in [(2.5, 2, 5, 3), (1.3, 3, 4, 2), (1.25, 2, 3, 2), (0.1, 2, 1, 1),
                                          (4, 0.5, 2, 1), (60, 30, 1_800, 900)]:
        plan = _video_plan(videos_per_request=1, video_seconds=seconds, video_fps=fps, video_size=(56, 56))
        assert (plan.workload.video_frames, plan.video_temporal_patches) == (frames, patches), (seconds, fps)
        assert plan.video_tokens_typical == patches * 4  # 56x56: 2 x 2 tokens a temporal patch
    # Pictures and videos together, each with its two markers.
    both = _video_plan(images_per_request=2, videos_per_request=3, video_seconds=20, video_size=(448, 448),
                       typical_image=(448, 448))
    assert both.kv_tokens_typical == 64 + 2 * (256 + 2) + 3 * (5_120 + 2) + 256 - 1
    assert both.kv_tokens_worst == 64 + 2 * (16_384 + 2) + 3 * (327_680 + 2) + 256 - 1


def test_without_videos_the_plan_is_the_pictures_plan():
    plan = _video_plan(images_per_request=1)
    assert (plan.video_temporal_patches, plan.video_tokens_worst, plan.video_tokens_typical) == (0, 0, 0)
    assert plan.kv_tokens_worst == 64 + 16_384 + 2 + 256 - 1
    assert not any("video" in what for what, _ in plan_lines(plan))
    # An fps or length given with no video changes nothing, and is not checked (the engine never meets it).
    assert _video_plan(images_per_request=1, video_fps=0, video_seconds=-1).kv_tokens_worst == plan.kv_tokens_worst


def test_the_planner_s_video_tokens_are_the_video_processor_s():
    """The planner's arithmetic against the real processor (inputs/video.py) on tiny clips."""
    from nanomm.inputs.video import preprocess_video
    from nanomm.inputs.video_io import DEFAULT_FPS, load_video

    assert DEFAULT_VIDEO_FPS == DEFAULT_FPS
    _, hub_images = load_configs(QWEN2_VL_2B)
    # 4 s at 2 fps of 448x448: 8 frames, (4, 16, 16).
    clip = np.zeros((8, 448, 448, 3), dtype=np.uint8)
    processed = preprocess_video(load_video(clip, fps=2.0), hub_images)
    plan = _video_plan(videos_per_request=1, video_seconds=4, video_fps=2, video_size=(448, 448))
    assert plan.video_tokens_typical == processed.num_tokens == 1_024
    # 1.5 s at 2 fps of 1280x720 under a 448x448 cap: 3 frames padded to 4, each frame resized to 336x588: (2, 12, 21)
    capped = replace(hub_images, max_pixels=448 * 448)
    clip = np.zeros((3, 720, 1280, 3), dtype=np.uint8)
    processed = preprocess_video(load_video(clip, fps=2.0), capped)
    plan = _video_plan(capped, videos_per_request=1, video_seconds=1.5, video_fps=2, video_size=(1280, 720))
    assert plan.video_tokens_typical == processed.num_tokens == 2 * 12 * 21
    # The worst-case frame, at a small cap (64 tokens): 2 frames of the planner's witness reach its count.
    small = replace(hub_images, max_pixels=64 * 784)
    plan = _video_plan(small, videos_per_request=1, video_seconds=1, video_fps=2)
    width, height = plan.worst_image
    processed = preprocess_video(load_video(np.zeros((2, height, width, 3), dtype=np.uint8)), small)
    assert plan.video_tokens_worst == processed.num_tokens == plan.video_frame_tokens_worst


def test_qwen3_vl_video_tokens_and_times_are_the_engine_s(tmp_path, capsys):
    """Qwen3-VL samples 2 frames a second, caps the whole clip, and writes each patch's time as text: the plan's
    visual tokens, and its visual and text tokens together, are what the engine expands a clip to (the real Qwen
    tokenizer, so the times cost what they cost there). The worst-case frame reaches the plan's count too."""
    from hf_checkpoints import make_hf_checkpoint
    from nanomm.inputs.video_io import VideoInput

    folder = make_hf_checkpoint(tmp_path / "qwen3", "qwen3_vl", tokenizer="qwen")
    config, images = load_configs(folder)
    cases = [(5.0, 6.0, (96, 64)), (60.0, 2.0, (64, 64)), (0.5, 30.0, (320, 64))]  # 10, 120 and min_frames frames
    with LLM(str(folder), device="cpu", dtype="float32", num_preprocess_workers=0) as llm:
        for seconds, fps, (width, height) in cases:
            plan = make_plan(config, images, alternatives=False, workload=Workload(
                images_per_request=0, videos_per_request=1, video_seconds=seconds, video_fps=fps,
                video_size=(width, height)))
            frames = tuple(Image.new("RGB", (width, height), (i, 0, 0)) for i in range(round(seconds * fps)))
            prompt = {"prompt": "<|vision_start|><|video_pad|><|vision_end|>what happens?",
                      "multi_modal_data": {"video": VideoInput(frames, fps)}}
            prepared = llm.engine.prepare(prompt, None)
            expanded = len(prepared.token_ids) - len(llm.tokenizer.encode(prompt["prompt"])) + 1
            assert plan.video_tokens_typical == prepared.num_visual_tokens, (seconds, fps)
            assert plan.kv_tokens_typical - plan.video_tokens_typical == (
                plan.workload.prompt_tokens + plan.workload.output_tokens - 1 + 2 + expanded
                - prepared.num_visual_tokens), (seconds, fps)
    # The worst-case frame, under a small clip budget from the checkpoint's video_preprocessor_config.json (which
    # the engine and the planner both read): a clip of such frames reaches the plan's count.
    (folder / "video_preprocessor_config.json").write_text(json.dumps({"size": {"shortest_edge": 4096,
                                                                                "longest_edge": 4 * 32 * 32 * 40}}))
    assert main([str(folder), "--videos", "1", "--video-seconds", "2", "--images", "0", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    width, height = plan["worst_video_frame"]
    assert plan["video_frame_tokens_worst"] > 40 and plan["video_temporal_patches"] == 2  # a strip beats 40 a frame
    frames = tuple(Image.new("RGB", (width, height)) for _ in range(4))
    with LLM(str(folder), device="cpu", dtype="float32", num_preprocess_workers=0) as llm:
        prepared = llm.engine.prepare({**prompt, "multi_modal_data": {"video": VideoInput(frames, 2.0)}}, None)
        assert prepared.num_visual_tokens == plan["video_tokens_worst"]
        assert llm.plan(images_per_request=0, videos_per_request=1, video_seconds=2).video_tokens_worst == \
            plan["video_tokens_worst"]


def test_a_video_request_s_length_is_the_engine_s(ckpt):
    """The engine's own expansion of a prompt with a clip: as many <|video_pad|> and tokens as the plan counts."""
    frames, (width, height) = 5, (84, 56)  # 2.5 s at 2 fps: 5 frames, padded to 6
    prompt = {"prompt": "<|im_start|>user\n<|vision_start|><|video_pad|><|vision_end|>what moves?<|im_end|>\n"
                        "<|im_start|>assistant\n",
              "multi_modal_data": {"video": np.zeros((frames, height, width, 3), dtype=np.uint8)}}
    with LLM(ckpt, max_pixels=64 * 784, num_kv_blocks=400, block_size=4, num_preprocess_workers=0) as llm:
        prepared = llm.engine.prepare(prompt, SamplingParams(max_tokens=8))
        text_tokens = len(llm.tokenizer.encode(prompt["prompt"])) - 3  # less the clip's 3 placeholder tokens
        plan = llm.plan(images_per_request=0, videos_per_request=1, video_seconds=2.5, video_fps=2,
                        video_size=(width, height), prompt_tokens=text_tokens, output_tokens=8)
        pads = prepared.token_ids.count(llm.model.config.video_token_id)
    assert pads == plan.video_tokens_typical == 3 * 2 * 3  # 3 temporal patches of 2 x 3 tokens
    assert plan.kv_tokens_typical == len(prepared.token_ids) + 8 - 1
    # Under the engine's compression each temporal patch is compressed as a picture: 2 x 3 pooled 2x2 -> 1 x 2.
    prompt["multi_modal_data"]["video"] = np.zeros((frames, 112, 168, 3), dtype=np.uint8)  # 4 x 6 tokens a patch
    with LLM(ckpt, max_pixels=64 * 784, block_size=4, num_preprocess_workers=0,
             visual_token_compression={"method": "pool", "keep_ratio": 0.25}) as llm:
        pads = llm.engine.prepare(prompt, None).token_ids.count(llm.model.config.video_token_id)
        plan = llm.plan(images_per_request=0, videos_per_request=1, video_seconds=2.5, video_fps=2,
                        video_size=(168, 112))
    assert pads == plan.video_tokens_typical == 3 * 2 * 3 and plan.video_frame_tokens_worst < 64


def test_video_options_on_the_command_line(capsys):
    argv = [str(QWEN2_VL_2B), "--device-memory", "80", "--images", "0", "--videos", "1", "--video-seconds", "20"]
    assert main(argv + ["--video-size", "448x448", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["video_tokens_typical"] == 5_120 and plan["video_tokens_worst"] == 327_680
    assert plan["workload"]["videos_per_request"] == 1 and plan["workload"]["video_fps"] == 2.0
    assert plan["kv_tokens_typical"] == 64 + 5_122 + 256 - 1
    # The table: a row per video, the request's clips, a tokens/video column of the levers.
    assert main(argv + ["--video-size", "448x448", "--video-fps", "1", "--max-pixels", "1003520"]) == 0
    table = capsys.readouterr().out
    assert "visual tokens per video" in table and "tokens/video" in table
    _, hub_images = load_configs(QWEN2_VL_2B)
    lines = dict(plan_lines(_video_plan(replace(hub_images, max_pixels=1_003_520), videos_per_request=1,
                                        video_seconds=20, video_fps=1, video_size=(448, 448))))
    assert lines["request"] == "0 image(s), 1 video(s) of 20 s at 1 fps (20 frames), 64 prompt + 256 output tokens"
    assert lines["visual tokens per video"] == ("worst 12,800 (10 temporal patches x 1,280, frames of 8960x112), "
                                                "typical 2,560 (10 x 256 at 448x448)")
    assert lines["visual tokens per request"] == "worst 12,800, typical 2,560"
    # A clip longer than load_video takes is planned, with a warning that the engine refuses it.
    assert main([str(QWEN2_VL_2B), "--videos", "1", "--video-seconds", "400", "--video-size", "56x56"]) in (0, 1)
    assert "over the limit of 768 (VideoLimits.max_frames)" in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize("options, message", [
    (["--videos", "1", "--video-seconds", "-5"], "--video-seconds: expected a number > 0, got '-5'"),
    (["--videos", "1", "--video-seconds", "0"], "--video-seconds: expected a number > 0, got '0'"),
    (["--videos", "1", "--video-seconds", "4", "--video-fps", "0"], "--video-fps: expected a number > 0, got '0'"),
    (["--videos", "1", "--video-seconds", "4", "--video-fps", "-2"], "--video-fps: expected a number > 0"),
    (["--videos", "1", "--video-seconds", "4", "--video-fps", "nan"], "--video-fps: expected a number > 0"),
    (["--videos", "1", "--video-seconds", "4", "--video-fps", "10000"], "at most 240 frames a second"),
    (["--videos", "1", "--video-seconds", "4", "--video-size", "big"], "WIDTHxHEIGHT"),
    (["--videos", "-1", "--video-seconds", "4"], "--videos must be >= 0"),
    (["--videos", "1"], "--videos needs --video-seconds"),
])
def test_bad_video_options_are_clear_errors(capsys, options, message):
    with pytest.raises(SystemExit) as exit_info:
        main([str(QWEN2_VL_2B), *options])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_bad_video_workloads_and_families_are_clear_errors(capsys):
    for fields, message in [(dict(video_seconds=-1), "video seconds must be a number > 0, got -1"),
                            (dict(video_seconds=0), "video seconds must be a number > 0"),
                            (dict(video_seconds=4, video_fps=0), "video fps must be a number in (0, 240]"),
                            (dict(video_seconds=4, video_fps=float("nan")), "got nan"),
                            (dict(video_seconds=4, video_fps=10_000), "got 10000"),
                            (dict(video_seconds=4, video_size=(0, 10)), "video width must be a positive int")]:
        with pytest.raises(InvalidInputError, match=re.escape(message)):
            Workload(videos_per_request=1, **fields)
    with pytest.raises(InvalidInputError, match="videos_per_request must be an int >= 0"):
        Workload(videos_per_request=-1)


README_PLAN = re.compile(r"<!-- plan: (.*?) -->\n```text\n(.*?)```", re.S)
README_SUMMARY = re.compile(r"<!-- plan-summary -->\n.*?\n\|---.*?\n(.*?)<!-- /plan-summary -->", re.S)


def _readme_plan(memory: float, max_pixels: int):
    config, image_config = load_configs(QWEN2_VL_2B)
    return make_plan(config, replace(image_config, max_pixels=max_pixels), model="Qwen/Qwen2-VL-2B-Instruct",
                     device_memory_gib=memory)


def test_the_readme_shows_the_planner_s_output_for_qwen2_vl_2b():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    shown = README_PLAN.findall(readme)
    settings = set()
    for args, text in shown:
        argv = args.split()
        assert argv[0] == "Qwen/Qwen2-VL-2B-Instruct"
        memory, max_pixels = float(argv[argv.index("--device-memory") + 1]), int(argv[argv.index("--max-pixels") + 1])
        settings.add((memory, max_pixels))
        assert render(_readme_plan(memory, max_pixels)) == text, f"the README's plan for {args} is stale"
    # One full plan is shown (the README keeps one short example); the summary has all four settings.
    assert settings and settings <= {(m, p) for m in (24.0, 80.0) for p in (12_845_056, 1_003_520)}
    [summary] = README_SUMMARY.findall(readme)
    rows = [line.strip("| ").split(" | ") for line in summary.strip().splitlines()]
    assert {(r[0], r[1]) for r in rows} == {(f"{m} GiB", f"{p:,}") for m in (24, 80) for p in (12_845_056, 1_003_520)}
    for memory, max_pixels, worst, pool, holds_worst, holds_typical in rows:
        plan = _readme_plan(float(memory.split()[0]), int(max_pixels.replace(",", "")))
        assert worst == f"{plan.visual_tokens_worst:,}"
        assert pool == f"{plan.num_kv_blocks:,} ({plan.kv_memory_bytes / GiB:.1f} GiB)"
        assert (holds_worst, holds_typical) == (f"{plan.fit_worst:,}", f"{plan.fit_typical:,}")


def test_the_memory_profile_encodes_as_many_visual_tokens_as_the_planner_s_worst_case(ckpt):
    """The profiling pass (engine/memory_profile.py, CUDA only) encodes the planner's worst-case image through
    the engine's preprocessing: as many patches as the planner counts visual tokens (4 patches per token)."""
    from nanomm import LLM
    from nanomm.engine.memory_profile import worst_case_pixels
    with LLM(str(ckpt), max_pixels=28 * 28 * 40) as llm:
        size, tokens = worst_case_image(llm.image_config)
        image = worst_case_pixels(llm.image_config, size)
    _, rows, cols = image.grid_thw
    assert image.pixel_values.shape[0] == rows * cols == tokens * 4 and image.num_tokens == tokens
