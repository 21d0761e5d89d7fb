"""Qwen2.5-VL: nanomm against transformers' Qwen2_5_VLForConditionalGeneration in float32, and the engine's levers
against the dense reference, on random checkpoints that transformers' own classes wrote (tests/hf_checkpoints.py).

What Qwen2.5-VL changes is the vision tower (model/vision_windowed.py): window attention in window order, RMSNorm,
SwiGLU. Every image here is big enough for several windows, some cut short at the right and bottom edges, so a
tower that ignored the window order, the full-attention blocks or the norms would give other visual tokens.
"""

import json
from dataclasses import replace
from pathlib import Path


import pytest
import torch
import transformers
from safetensors import safe_open

from family_checks import (ALONE_CASES, LEVERS, chat_cli_answers_as_the_engine, engine_gives_transformers_tokens,
                           expanded_prompt, lever_matches_reference, metric, quantized_alone_matches_reference,
                           real_width_cut_matches_transformers, reference_matches_transformers,
                           split_and_integrated_answers, static_decode_matches_reference)
from hf_checkpoints import QWEN2_5_3B_CUT, make_hf_checkpoint, render_hub_chat_template
from helpers import chat_prompt, random_image
from nanomm.engine.sizing import image_tokens, kv_bytes_per_token
from nanomm.inputs.image import ImageProcessorConfig, preprocess_image
from nanomm.inputs.tokenizer import Tokenizer
from nanomm.model.config import ModelConfig
from nanomm.model.loader import canonical_name, load_model
from nanomm.model.qwen2_vl import Qwen2VL
from nanomm.model.vision_windowed import WindowedVisionTransformer, window_order
from nanomm.planner import load_configs

MAX_PIXELS = 28 * 28 * 160  # up to 160 visual tokens: 10x16 tokens is 3x4 windows of 4x4, the last ones cut
IMAGE_SIZES = [(300, 200), (90, 60), (448, 336)]  # (width, height)
NUM_TOKENS = 12


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_hf_checkpoint(tmp_path_factory.mktemp("qwen2_5_vl"))


@pytest.fixture(scope="module")
def oracle(folder):
    return transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager").eval()


def images(count: int, seed: int = 0):
    return [random_image(*IMAGE_SIZES[i], seed + i) for i in range(count)]


def test_the_checkpoint_is_what_the_hub_names(folder):
    """config.json's architectures and model_type, and the weight names of the real checkpoints."""
    config = json.loads((folder / "config.json").read_text())
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert config["architectures"] == ["Qwen2_5_VLForConditionalGeneration"] and config["model_type"] == "qwen2_5_vl"
    assert {"visual.blocks.0.mlp.gate_proj.weight", "visual.blocks.0.norm1.weight", "visual.merger.ln_q.weight",
            "model.layers.0.self_attn.q_proj.bias", "lm_head.weight"} <= names


def test_windows_tile_each_frame_from_the_top_left():
    # 6x10 tokens in windows of 4x4: a 4x4, a 4x4, a 4x2, then the bottom row 2x4, 2x4, 2x2 (patches: x4).
    order, lengths = window_order([(1, 12, 20)], 2, 4)
    assert lengths == [64, 64, 32, 32, 32, 16]
    assert order[:4].tolist() == [0, 1, 2, 3] and order[4:8].tolist() == [10, 11, 12, 13]
    assert sorted(order.tolist()) == list(range(60))
    second, _ = window_order([(1, 4, 4), (2, 4, 4)], 2, 4)  # images and frames follow each other
    assert second.tolist() == list(range(12))


def test_the_vision_tower_matches_transformers_for_batches(folder, oracle):
    ours = load_model(folder)
    assert isinstance(ours.visual, WindowedVisionTransformer)
    config = ImageProcessorConfig.from_pretrained(folder)
    batch = [preprocess_image(im, config, max_pixels=MAX_PIXELS) for im in images(3, seed=5)]
    assert any(p.grid_thw[1] // 2 > 4 for p in batch), "no image has more than one window"
    pixels, grids = torch.cat([p.pixel_values for p in batch]), [p.grid_thw for p in batch]
    with torch.no_grad():
        expected = oracle.model.visual(pixels, grid_thw=torch.tensor([list(g) for g in grids])).pooler_output
        got = ours.encode_images(pixels, grids)
    assert [t.shape[0] for t in got] == [p.num_tokens for p in batch]
    rel = ((torch.cat(got) - expected).norm() / expected.norm()).item()
    assert rel <= 1e-5, f"vision output relative error {rel}"


@pytest.mark.parametrize("num_images", [0, 1, 3])
def test_every_step_logits_and_greedy_tokens_match_transformers(folder, oracle, num_images):
    ids, processed = expanded_prompt(folder, images(num_images), MAX_PIXELS)
    assert reference_matches_transformers(load_model(folder), oracle, ids, processed, NUM_TOKENS) >= NUM_TOKENS // 2


@pytest.mark.slow
def test_qwen2_5_vl_3b_widths_match_transformers(tmp_path):
    """Qwen2.5-VL-3B's widths, real vocabulary and tied head; two decoder layers and two vision blocks (one windowed,
    one full): the dense reference, then the engine under default and tight settings."""
    made = make_hf_checkpoint(tmp_path / "3b", text=QWEN2_5_3B_CUT["text"], vision=QWEN2_5_3B_CUT["vision"],
                              tie_word_embeddings=True, tokenizer="qwen")
    ours = load_model(made)
    assert (ours.config.vision.embed_dim, ours.config.vision.hidden_size) == (1280, 2048)
    real_width_cut_matches_transformers(made, ours, transformers.Qwen2_5_VLForConditionalGeneration, images,
                                        MAX_PIXELS, TIGHT)


# -- the engine ---------------------------------------------------------------------------------------------------

TIGHT = dict(block_size=4, num_kv_blocks=72, max_num_batched_tokens=24)  # chunks cut images; preemption


@pytest.mark.parametrize("settings", [{}, TIGHT], ids=["default", "tight"])
def test_the_engine_gives_transformers_greedy_tokens(folder, oracle, settings):
    """0-3 images a prompt through the engine (all at once, so they batch, chunk and preempt one another), then again:
    the second pass hits the prefix cache. Every answer is transformers' greedy answer."""
    prompts = [chat_prompt("Describe, then count.", images(n, seed=10 * n)) for n in range(4)]
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


def test_attention_compression_reads_the_last_block_in_grid_order(folder):
    """The attention each visual token receives comes back in grid order: within a windowed last block, each
    window's patches receive one query-average of attention in all, so the tokens of each window sum to 1/4
    (four patches a token) wherever the window lies. Read in window order, the sums would mix windows."""
    ours = load_model(folder)
    last = len(ours.visual.blocks) - 1
    ours.visual.cfg = replace(ours.visual.cfg, fullatt_block_indexes=tuple(
        i for i in ours.visual.cfg.fullatt_block_indexes if i != last))  # the last block windowed
    p = preprocess_image(random_image(300, 200, 3), ImageProcessorConfig.from_pretrained(folder), max_pixels=MAX_PIXELS)
    _, (received,) = ours.encode_images(p.pixel_values, [p.grid_thw], received_attention=True)
    _, rows, cols = p.token_grid
    grid = received.view(rows, cols)
    for top in range(0, rows, 4):
        for left in range(0, cols, 4):
            assert grid[top:top + 4, left:left + 4].sum().item() == pytest.approx(0.25, abs=1e-5)


# -- serving: the chat, the server, and the split roles -------------------------------------------------------

def test_the_chat_serves_a_local_qwen2_5_vl_folder(folder, tmp_path):
    chat_cli_answers_as_the_engine(folder, tmp_path)


def test_the_server_the_encoder_service_and_a_prefill_decode_pair_answer_alike(folder):
    """nanomm-serve FOLDER, and the same model split into encoder, prefill and decode instances behind a router:
    the same greedy tokens for a chat about a picture several windows wide."""
    whole, split, encoder_metrics, _ = split_and_integrated_answers(folder, MAX_PIXELS)
    assert whole["choices"][0]["message"]["content"] == split["choices"][0]["message"]["content"]
    assert [whole["usage"][k] for k in ("prompt_tokens", "completion_tokens")] == \
        [split["usage"][k] for k in ("prompt_tokens", "completion_tokens")]
    encoded = metric(encoder_metrics, "nanomm_encoder_visual_tokens_total")
    assert encoded == whole["usage"]["visual_tokens"] > 16  # the service ran the windowed tower


# -- the real checkpoint's files (tests/data/Qwen2.5-VL-3B-Instruct: public copies of the hub files) ----------

REAL_3B = Path(__file__).parent / "data" / "Qwen2.5-VL-3B-Instruct"


def test_the_real_3b_config_and_weight_names_load_into_nanomm_s_model():
    """Qwen2.5-VL-3B-Instruct's config.json parses into the right shapes, and the 824 names of its
    model.safetensors.index.json are exactly the tensors nanomm's model has (the head is tied: no lm_head)."""
    config = ModelConfig.from_pretrained(REAL_3B)
    assert config.model_type == "qwen2_5_vl" and config.tie_word_embeddings
    v = config.vision
    assert (v.embed_dim, v.hidden_size, v.mlp_dim, v.depth, v.window_size) == (1280, 2048, 3420, 32, 112)
    assert v.fullatt_block_indexes == (7, 15, 23, 31) and config.text.mrope_section == (16, 24, 24)
    assert config.eos_token_ids == (151645, 151643)  # generation_config.json
    names = json.loads((REAL_3B / "model.safetensors.index.json").read_text())["weight_map"]
    with torch.device("meta"):
        model = Qwen2VL(config)
    ours = set(model.state_dict()) - {"lm_head.weight"}
    assert {canonical_name(n) for n in names} == ours and len(names) == 824
    assert sum(p.numel() for n, p in model.named_parameters() if n != "lm_head.weight") * 2 == \
        json.loads((REAL_3B / "model.safetensors.index.json").read_text())["metadata"]["total_size"]
    processor = ImageProcessorConfig.from_pretrained(REAL_3B)
    assert (processor.patch_size, processor.merge_size, processor.max_pixels) == (14, 2, 12845056)


def test_the_planner_reads_the_real_3b_files():
    config, images = load_configs(str(REAL_3B))
    assert image_tokens(1024, 768, replace(images, max_pixels=1_003_520)) == 27 * 37  # 14-px patches, 2x2 merge
    assert kv_bytes_per_token(config.text.num_hidden_layers, config.text.num_key_value_heads, config.text.head_dim,
                              torch.bfloat16) == 2 * 36 * 2 * 128 * 2


@pytest.mark.parametrize("turns", [1, 3])
def test_the_chat_renders_as_the_real_qwen2_5_vl_template(folder, turns):
    picture_and_question = [{"type": "image", "image": "a.png"}, {"type": "text", "text": "What?"}]
    conversation = [{"role": "user", "content": picture_and_question},
                    {"role": "assistant", "content": "A cat."}, {"role": "user", "content": "And?"}][:turns]
    text, _ = Tokenizer.from_pretrained(folder).apply_chat_template(conversation)
    assert text == render_hub_chat_template(REAL_3B, conversation)
