"""Qwen3-VL: nanomm's model against transformers' Qwen3VLForConditionalGeneration in float32, on random checkpoints
that transformers' own classes wrote (tests/hf_checkpoints.py), and the real Qwen3-VL-2B-Instruct files.

What Qwen3-VL changes, each of which a test here would catch if ignored: 16-px patches and a resampled learned
position grid (the tower's output), DeepStack levels added after the first decoder layers (the logits with
images), interleaved M-RoPE sections (the logits after an image), a Qwen3 decoder with q/k norms, no q/k/v
biases and a head_dim that is not hidden / heads (every logit).
"""

import json
from pathlib import Path

import pytest
import torch
import transformers

from hf_checkpoints import make_hf_checkpoint
from helpers import hf_inputs, random_image
from nanomm.accel.fused_layers import fuse_language_model
from nanomm.inputs.image import ImageProcessorConfig, preprocess_image
from nanomm.inputs.tokenizer import Tokenizer
from nanomm.model.config import ModelConfig
from nanomm.model.loader import canonical_name, load_model
from nanomm.model.qwen2_vl import Qwen2VL
from nanomm.model.rope import band_axes
from nanomm.model.vision_deepstack import DeepStackVisionTransformer, position_grid_taps
from nanomm.reference import generate
from nanomm.sampling import SamplingParams
from test_model_parity import LOGITS_ATOL, oracle_greedy, steps_fed_the_same_tokens

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


def expanded_prompt(folder, count: int):
    tokenizer = Tokenizer.from_pretrained(folder)
    config = ImageProcessorConfig.from_pretrained(folder)
    pictures = [random_image(*IMAGE_SIZES[i], i) for i in range(count)]
    text, found = tokenizer.apply_chat_template([{"role": "user", "content": [
        *({"type": "image", "image": im} for im in pictures), {"type": "text", "text": "Describe, then count."}]}])
    processed = [preprocess_image(im, config, max_pixels=MAX_PIXELS) for im in found]
    return tokenizer.expand_image_placeholders(tokenizer.encode(text), [p.num_tokens for p in processed]), processed


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
    ours = load_model(folder)
    ids, processed = expanded_prompt(folder, num_images)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    result = generate(ours, ids, processed, params, keep_logits=True)
    tokens, logits = oracle_greedy(oracle, hf_inputs(ids, processed, ours.config.image_token_id), NUM_TOKENS)
    comparable = steps_fed_the_same_tokens(result.token_ids, tokens, logits)
    diffs = [(a - b).abs().max().item() for a, b in zip(result.logits[:comparable], logits)]
    assert max(diffs) <= LOGITS_ATOL, diffs
    assert comparable >= NUM_TOKENS // 2 and logits[0].std() > 0.05


def test_the_fused_layers_the_engine_serves_keep_the_q_k_norms_and_deepstack(folder, oracle):
    fused = load_model(folder)
    fuse_language_model(fused)
    ids, processed = expanded_prompt(folder, 2)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    result = generate(fused, ids, processed, params, keep_logits=True)
    tokens, logits = oracle_greedy(oracle, hf_inputs(ids, processed, fused.config.image_token_id), 4)
    comparable = steps_fed_the_same_tokens(result.token_ids, tokens, logits)
    assert max((a - b).abs().max().item() for a, b in zip(result.logits[:comparable], logits)) <= LOGITS_ATOL


def test_deepstack_moves_the_logits(folder):
    """Without its levels the same prompt gives other logits: the comparison above would see a dropped DeepStack."""
    ours = load_model(folder)
    ids, processed = expanded_prompt(folder, 1)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    with_levels = generate(ours, ids, processed, params, keep_logits=True).logits[0]
    for merger in ours.visual.deepstack_merger_list:
        merger.linear_fc2.weight.data.zero_()
        merger.linear_fc2.bias.data.zero_()
    without = generate(ours, ids, processed, params, keep_logits=True).logits[0]
    assert not torch.allclose(with_levels, without, atol=1e-3)


def test_the_engine_refuses_qwen3_vl_until_it_carries_deepstack_levels(folder):
    from nanomm import LLM
    from nanomm.errors import CheckpointError
    with pytest.raises(CheckpointError, match="DeepStack"):
        LLM(str(folder), device="cpu", dtype="float32")


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
