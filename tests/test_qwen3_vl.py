"""Qwen3-VL: nanomm's model against transformers' Qwen3VLForConditionalGeneration in float32, on random checkpoints
that transformers' own classes wrote (tests/hf_checkpoints.py), and the real Qwen3-VL-2B-Instruct files.

What Qwen3-VL changes, each of which a test here would catch if ignored: 16-px patches and a resampled learned
position grid (the tower's output), DeepStack levels added after the first decoder layers (the logits with
images), interleaved M-RoPE sections (the logits after an image), a Qwen3 decoder with q/k norms, no q/k/v
biases and a head_dim that is not hidden / heads (every logit).
"""

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import transformers

from family_checks import (ALONE_CASES, LEVERS, chat_cli_answers_as_the_engine, engine_gives_transformers_tokens,
                           expanded_prompt, lever_matches_reference, metric, quantized_alone_matches_reference,
                           real_width_cut_matches_transformers, reference_matches_transformers,
                           split_and_integrated_answers, static_decode_matches_reference)
from hf_checkpoints import QWEN3_2B_CUT, make_hf_checkpoint, make_qwen3_text_draft, render_hub_chat_template
from helpers import assert_engine_matches_reference, chat_prompt, random_image, random_workload
from nanomm import LLM
from nanomm.accel.fused_layers import fuse_language_model
from nanomm.engine.sizing import image_tokens, kv_bytes_per_token
from nanomm.inputs.compression import CompressionPolicy, compress
from nanomm.inputs.image import ImageProcessorConfig, preprocess_image
from nanomm.inputs.tokenizer import Tokenizer
from nanomm.model.config import ModelConfig
from nanomm.model.loader import canonical_name, load_model
from nanomm.model.qwen2_vl import Qwen2VL
from nanomm.model.rope import band_axes
from nanomm.model.vision_deepstack import DeepStackVisionTransformer, position_grid_taps
from nanomm.planner import load_configs
from nanomm.reference import generate
from nanomm.sampling import SamplingParams

MAX_PIXELS = 32 * 32 * 60  # up to 60 visual tokens of 32x32 px
IMAGE_SIZES = [(300, 200), (90, 60), (40, 260)]  # (width, height)
NUM_TOKENS = 12
REAL_2B = Path(__file__).parent / "data" / "Qwen3-VL-2B-Instruct"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_hf_checkpoint(tmp_path_factory.mktemp("qwen3_vl"), "qwen3_vl")


@pytest.fixture(scope="module")
def oracle(folder):
    return transformers.Qwen3VLForConditionalGeneration.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager").eval()


def pictures(count: int) -> list:
    return [random_image(*IMAGE_SIZES[i], i) for i in range(count)]


def test_interleaved_sections_cycle_the_axes():
    assert band_axes(8, (4, 2, 2), interleaved=False).tolist() == [0, 0, 0, 0, 1, 1, 2, 2]
    assert band_axes(8, (4, 2, 2), interleaved=True).tolist() == [0, 1, 2, 0, 1, 2, 0, 0]
    assert band_axes(64, (24, 20, 20), interleaved=True)[57:].tolist() == [0, 1, 2, 0, 0, 0, 0]


def test_the_position_grid_resamples_with_corners_aligned():
    index, weight = position_grid_taps(3, 2, side=5)  # rows at 0, 2, 4 of the table; columns at 0 and 4
    assert torch.allclose(weight.sum(1), torch.ones(6))
    picked = (index * (weight > 0)).max(1).values
    assert picked.tolist() == [0, 4, 10, 14, 20, 24]


def test_the_vision_tower_and_its_deepstack_levels_match_transformers(folder, oracle):
    ours = load_model(folder)
    assert isinstance(ours.visual, DeepStackVisionTransformer)
    config = ImageProcessorConfig.from_pretrained(folder)
    batch = [preprocess_image(random_image(*size, 5 + i), config, max_pixels=MAX_PIXELS)
             for i, size in enumerate(IMAGE_SIZES)]
    assert config.patch_size == 16 and config.image_mean == (0.5, 0.5, 0.5)
    pixels, grids = torch.cat([p.pixel_values for p in batch]), [p.grid_thw for p in batch]
    with torch.no_grad():
        theirs = oracle.model.visual(pixels, grid_thw=torch.tensor([list(g) for g in grids]))
        got = ours.encode_images(pixels, grids)
    assert [t.shape[:2] for t in got] == [(3, p.num_tokens) for p in batch]  # 1 + 2 DeepStack levels
    mine = torch.cat(got, dim=1)
    for level, expected in enumerate([theirs.pooler_output, *theirs.deepstack_features]):
        rel = ((mine[level] - expected).norm() / expected.norm()).item()
        assert rel <= 1e-5, f"level {level}: relative error {rel}"


@pytest.mark.parametrize("num_images", [0, 1, 3])
def test_every_step_logits_and_greedy_tokens_match_transformers(folder, oracle, num_images):
    ids, processed = expanded_prompt(folder, pictures(num_images), MAX_PIXELS)
    assert reference_matches_transformers(load_model(folder), oracle, ids, processed, NUM_TOKENS) >= NUM_TOKENS // 2


@pytest.mark.slow
def test_qwen3_vl_2b_widths_match_transformers(tmp_path):
    """Qwen3-VL-2B's widths, real vocabulary and tied head, its 48x48 position grid and three DeepStack levels; three
    decoder layers and four vision blocks: the dense reference, then the engine under default and tight settings."""
    made = make_hf_checkpoint(tmp_path / "2b", "qwen3_vl", text=QWEN3_2B_CUT["text"], vision=QWEN3_2B_CUT["vision"],
                              tie_word_embeddings=True, tokenizer="qwen")
    ours = load_model(made)
    assert (ours.config.text.head_dim, ours.config.vision.embed_dim, len(ours.visual.deepstack_merger_list)) == \
        (128, 1024, 3)
    real_width_cut_matches_transformers(made, ours, transformers.Qwen3VLForConditionalGeneration, pictures,
                                        MAX_PIXELS, TIGHT)


def test_the_fused_layers_the_engine_serves_keep_the_q_k_norms_and_deepstack(folder, oracle):
    fused = load_model(folder)
    fuse_language_model(fused)
    ids, processed = expanded_prompt(folder, pictures(2), MAX_PIXELS)
    assert reference_matches_transformers(fused, oracle, ids, processed, 4) >= 2


def test_deepstack_moves_the_logits(folder):
    """Without its levels the same prompt gives other logits: the comparison above would see a dropped DeepStack."""
    ours = load_model(folder)
    ids, processed = expanded_prompt(folder, pictures(1), MAX_PIXELS)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    with_levels = generate(ours, ids, processed, params, keep_logits=True).logits[0]
    for merger in ours.visual.deepstack_merger_list:
        merger.linear_fc2.weight.data.zero_()
        merger.linear_fc2.bias.data.zero_()
    without = generate(ours, ids, processed, params, keep_logits=True).logits[0]
    assert not torch.allclose(with_levels, without, atol=1e-3)


# -- the engine: DeepStack levels through the encoder cache, chunks that cut images, compression, the services ----

TIGHT = dict(block_size=4, num_kv_blocks=30, max_num_batched_tokens=20)  # chunks cut images and their levels


@pytest.mark.parametrize("settings", [{}, TIGHT], ids=["default", "tight"])
def test_the_engine_gives_transformers_greedy_tokens(folder, oracle, settings):
    """0-3 images a prompt through the engine at once, then again (the prefix cache): transformers' greedy answers.
    Tight settings cut images (and so every DeepStack level) across chunks and preempt."""
    pictures = [random_image(*IMAGE_SIZES[i], 10 + i) for i in range(3)]
    prompts = [chat_prompt("Describe, then count.", pictures[:n]) for n in range(4)]
    stats = engine_gives_transformers_tokens(folder, oracle, prompts, NUM_TOKENS, MAX_PIXELS, **settings)
    assert stats["prefix_cache_hit_tokens"] > 0
    if settings:
        assert stats["preemptions"] > 0


def test_the_static_decode_path_cuda_graphs_record_matches_the_dense_reference(folder):
    static_decode_matches_reference(folder, MAX_PIXELS)


@pytest.mark.parametrize("lever", list(LEVERS))
def test_each_lever_matches_the_dense_reference(folder, lever, monkeypatch):
    lever_matches_reference(folder, lever, MAX_PIXELS, monkeypatch)


@pytest.mark.parametrize("method, path", ALONE_CASES)
def test_a_quantized_request_alone_is_the_reference_bit_for_bit(folder, method, path, monkeypatch):
    quantized_alone_matches_reference(folder, method, path, MAX_PIXELS, monkeypatch)


def test_a_qwen3_text_draft_speculates_for_its_target(folder, tmp_path):
    """A text-only Qwen3 checkpoint (Qwen3ForCausalLM: q/k norms, its own head_dim, 1-D RoPE) holding the target's
    own decoder: on text it is the target exactly, so every proposal is accepted; on image prompts it reads the
    image pads as text (no tower, no DeepStack), guesses worse, and the output is still the target's."""
    draft = make_qwen3_text_draft(folder, tmp_path / "draft")
    params = SamplingParams(temperature=0.0, max_tokens=13, ignore_eos=True)
    with LLM(str(folder), device="cpu", dtype="float32", max_pixels=MAX_PIXELS,
             speculative={"method": "draft", "model": str(draft), "num_speculative_tokens": 3}) as llm:
        assert llm.engine.proposer.model.config.model_type == "qwen3" and llm.engine.proposer.model.visual is None
        text = assert_engine_matches_reference(llm, [chat_prompt("the cat sat on the mat")], [params])[0]
        assert text.metrics.acceptance_rate == 1.0
        prompts = random_workload(seed=6, num_prompts=4, max_images=2)
        outputs = assert_engine_matches_reference(llm, prompts, [params] * len(prompts))
        assert sum(o.metrics.num_draft_tokens for o in outputs) > 0


@pytest.mark.parametrize("method", ["pool", "prune", "attention"])
def test_compression_keeps_the_same_tokens_at_every_level(folder, method):
    """Level i of a compressed image is what the policy makes of level i alone when it keeps level 0's choice:
    the kept coordinates are level 0's, and each level is pooled, picked or merged the same way."""
    ours = load_model(folder)
    image = preprocess_image(random_image(300, 200, 4), ImageProcessorConfig.from_pretrained(folder),
                             max_pixels=MAX_PIXELS)
    (levels,), (attention,) = ours.encode_images(image.pixel_values, [image.grid_thw], received_attention=True)
    policy = CompressionPolicy(method, 0.5)
    together = compress(levels, image.token_grid, policy, attention=attention)
    alone = compress(levels[0], image.token_grid, policy, attention=attention)
    assert torch.equal(together.coords, alone.coords) and torch.allclose(together.embeds[0], alone.embeds)
    if method != "attention":  # a pure selection or average: each level's own result, at the same places
        for level in range(1, levels.shape[0]):
            if method == "pool":
                own = compress(levels[level], image.token_grid, policy).embeds
            else:
                own = levels[level][[int(i) for i in _kept_indices(together.coords, image.token_grid)]]
            assert torch.allclose(together.embeds[level], own)


def _kept_indices(coords, grid):
    _, h, w = grid
    return coords[0] * h * w + coords[1] * w + coords[2]


def test_an_encoder_service_and_a_prefill_decode_pair_carry_every_level(folder):
    """An engine that gets its visual tokens from an encoder service, and a prefill/decode pair behind the router,
    give the integrated engine's tokens: the service sends all 1 + levels tensors of each image."""
    whole, split, _, prefill_metrics = split_and_integrated_answers(folder, MAX_PIXELS)
    assert whole["choices"][0]["message"]["content"] == split["choices"][0]["message"]["content"]
    received = metric(prefill_metrics, 'nanomm_visual_token_transfer_bytes_total{direction="received"}')
    assert received > 3 * whole["usage"]["visual_tokens"] * 64 * 4  # three levels of float32 tokens, and a header


# -- the real checkpoint's files (tests/data/Qwen3-VL-2B-Instruct: public copies of the hub files) ------------

def test_the_real_2b_config_and_weights_fit_nanomm_s_model():
    """Qwen3-VL-2B-Instruct's config.json parses into the right shapes; its 625 tensors (names and shapes, from
    weight_shapes.json) are exactly nanomm's model's (the head is tied)."""
    config = ModelConfig.from_pretrained(REAL_2B)
    t, v = config.text, config.vision
    assert config.model_type == "qwen3_vl" and config.tie_word_embeddings
    assert (t.head_dim, t.qk_norm, t.attention_bias, t.mrope_interleaved, t.mrope_section) == \
        (128, True, False, True, (24, 20, 20))
    assert (v.embed_dim, v.hidden_size, v.patch_size, v.deepstack_visual_indexes, v.num_position_embeddings) == \
        (1024, 2048, 16, (5, 11, 17), 2304)
    shapes = json.loads((REAL_2B / "weight_shapes.json").read_text())
    with torch.device("meta"):
        model = Qwen2VL(config)
    ours = {name: tuple(p.shape) for name, p in model.state_dict().items() if name != "lm_head.weight"}
    assert {canonical_name(n): tuple(s) for n, s in shapes.items()} == ours and len(shapes) == 625
    processor = ImageProcessorConfig.from_pretrained(REAL_2B)
    assert (processor.patch_size, processor.factor, processor.image_mean) == (16, 32, (0.5, 0.5, 0.5))


@pytest.mark.parametrize("size", [(300, 200), (40, 260), (1000, 700)])
def test_pixels_match_transformers_processor_under_the_real_2b_settings(size):
    """16-px patches, a 32-px resize factor, mean and std 0.5 and the hub's pixel bounds (256x256 up to 4096x4096),
    read from the real preprocessor_config.json by nanomm and by transformers' PIL processor: the same grid and
    pixel values. (The hub names the torchvision-backed fast processor, which resizes slightly differently from
    PIL; the dev tools carry no torchvision, so that path is not compared.)"""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    picture = random_image(*size, 7)
    expected = Qwen2VLImageProcessorPil.from_pretrained(REAL_2B)(images=picture, return_tensors="pt")
    ours = preprocess_image(picture, ImageProcessorConfig.from_pretrained(REAL_2B))
    assert ours.grid_thw == tuple(expected["image_grid_thw"][0].tolist())
    assert ours.pixel_values.shape == expected["pixel_values"].shape
    assert (ours.pixel_values - expected["pixel_values"]).abs().max().item() <= 1e-6
    assert ours.grid_thw[1] * ours.grid_thw[2] >= 256 * 256 // 16 ** 2  # at least the hub's minimum pixels


CONVERSATIONS = [
    [{"role": "user", "content": [{"type": "image", "image": "a.png"}, {"type": "text", "text": "What is it?"}]}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    [{"role": "user", "content": [{"type": "text", "text": "Two:"}, {"type": "image", "image": "a.png"},
                                  {"type": "image", "image": "b.png"}]},
     {"role": "assistant", "content": "A cat and a dog."}, {"role": "user", "content": "Which is bigger?"}],
]


@pytest.mark.parametrize("conversation", CONVERSATIONS, ids=["image", "system", "turns"])
def test_the_chat_renders_as_the_real_qwen3_vl_template(folder, conversation):
    """Qwen3-VL's template (tests/data, the hub's) adds no default system turn, unlike Qwen2-VL's and Qwen2.5-VL's."""
    text, _ = Tokenizer.from_pretrained(folder).apply_chat_template(conversation)
    assert text == render_hub_chat_template(REAL_2B, conversation)


def test_the_chat_serves_a_local_qwen3_vl_folder(folder, tmp_path):
    chat_cli_answers_as_the_engine(folder, tmp_path)


def test_the_planner_counts_32_pixel_tokens_for_the_real_2b():
    """The same photo at the same pixel cap: 16-px patches (32-px tokens) give about (28/32)^2 of Qwen2-VL's tokens."""
    config, images = load_configs(str(REAL_2B))
    qwen3 = image_tokens(1024, 768, replace(images, max_pixels=1_003_520))
    assert qwen3 == 24 * 32  # 768x1024 is under the cap: it only rounds to multiples of 32 px
    assert kv_bytes_per_token(config.text.num_hidden_layers, config.text.num_key_value_heads, config.text.head_dim,
                              torch.bfloat16) == 2 * 28 * 8 * 128 * 2
