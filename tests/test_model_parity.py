"""nanomm's Qwen2-VL against transformers' Qwen2VLForConditionalGeneration, in float32, on random checkpoints.

The oracle runs with attn_implementation="eager" and is always given `mm_token_type_ids`: without it,
transformers' generate silently falls back to 1-D positions (see the reference notes).
"""

import pytest
import torch
from PIL import Image

from nanomm.tools.random_checkpoint import make_checkpoint
from nanomm.model.fast_linear import pack_linear_layers
from nanomm.inputs.image import ImageProcessorConfig, preprocess_image
from nanomm.model.loader import load_model
from nanomm.reference import generate
from nanomm.sampling import SamplingParams
from nanomm.inputs.tokenizer import Tokenizer

import transformers  # the oracle (dev extra); a missing oracle must fail, not skip

# Three random configs that differ in head counts, GQA ratio, mrope_section, tying and name layout,
# and in how the files are written (flat/nested config.json, old/new preprocessor keys, sharding).
CONFIGS = {
    "tiny-gqa2-untied-original": dict(preset="tiny", layout="original", config_style="flat",
                                      tie_word_embeddings=False),
    "mha-tied-new-sharded": dict(preset="tiny", layout="new", config_style="nested", preprocessor_style="new",
                                 tie_word_embeddings=True, num_shards=2, seed=1,
                                 overrides={"num_attention_heads": 2, "num_key_value_heads": 2,
                                            "mrope_section": [8, 4, 4], "num_hidden_layers": 3}),
    "gqa3-untied-new": dict(preset="tiny", layout="new", config_style="flat", tie_word_embeddings=False, seed=2,
                            overrides={"hidden_size": 96, "intermediate_size": 160, "num_attention_heads": 6,
                                       "num_key_value_heads": 2, "mrope_section": [2, 3, 3],
                                       "vision_config.embed_dim": 48, "vision_config.num_heads": 3,
                                       "vision_config.depth": 3}),
}
IMAGE_SIZES = [(60, 90), (120, 64), (33, 200)]  # (width, height): three different grids
MAX_PIXELS = 28 * 28 * 24  # small cap: keeps token counts small, and exercises the downscale branch


def random_image(width, height, seed):
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), dtype=torch.uint8, generator=g)
    return Image.frombytes("RGB", (width, height), pixels.numpy().tobytes())


def build_prompt(tokenizer: Tokenizer, num_images: int, proc_cfg):
    parts = [{"type": "image", "image": random_image(*IMAGE_SIZES[i], seed=i)} for i in range(num_images)]
    parts.append({"type": "text", "text": "Describe what you see, then count to ten."})
    text, images = tokenizer.apply_chat_template([{"role": "user", "content": parts}])
    processed = [preprocess_image(im, proc_cfg, max_pixels=MAX_PIXELS) for im in images]
    ids = tokenizer.expand_image_placeholders(tokenizer.encode(text), [p.num_tokens for p in processed])
    return ids, processed


def hf_inputs(ids, processed, image_token_id):
    input_ids = torch.tensor([ids])
    inputs = dict(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                  mm_token_type_ids=(input_ids == image_token_id).int())
    if processed:
        inputs["pixel_values"] = torch.cat([p.pixel_values for p in processed])
        inputs["image_grid_thw"] = torch.tensor([list(p.grid_thw) for p in processed])
    return inputs


@pytest.fixture(scope="module", params=list(CONFIGS))
def pair(request, tmp_path_factory):
    folder = make_checkpoint(tmp_path_factory.mktemp(request.param), **CONFIGS[request.param])
    ours = load_model(folder, dtype="float32")
    oracle = transformers.Qwen2VLForConditionalGeneration.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager").eval()
    return folder, ours, oracle


def assert_matches_oracle(folder, ours, oracle, num_images, num_tokens=32):
    tokenizer = Tokenizer.from_pretrained(folder)
    proc_cfg = ImageProcessorConfig.from_pretrained(folder)
    ids, processed = build_prompt(tokenizer, num_images, proc_cfg)
    assert ids.count(ours.config.image_token_id) == sum(p.num_tokens for p in processed)
    params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
    result = generate(ours, ids, processed, params, keep_logits=True)

    inputs = hf_inputs(ids, processed, ours.config.image_token_id)
    with torch.no_grad():
        expected_logits = oracle(**inputs).logits[0, -1].float()
        expected_tokens = oracle.generate(**inputs, max_new_tokens=num_tokens, min_new_tokens=num_tokens,
                                          do_sample=False)[0, len(ids):].tolist()
    diff = (result.logits[0] - expected_logits).abs().max().item()
    assert diff <= 1e-4, f"last-position logits differ by {diff}"
    assert expected_logits.std() > 0.05, "random weights too small to make the comparison meaningful"
    assert result.token_ids == expected_tokens


@pytest.mark.parametrize("num_images", [0, 1, 3])
def test_logits_and_greedy_tokens_match_transformers(pair, num_images):
    assert_matches_oracle(*pair, num_images)


def test_vision_tower_matches_transformers_for_batches(pair):
    folder, ours, oracle = pair
    proc_cfg = ImageProcessorConfig.from_pretrained(folder)
    images = [preprocess_image(random_image(*size, seed=7 + i), proc_cfg, max_pixels=MAX_PIXELS)
              for i, size in enumerate(IMAGE_SIZES)]
    for count in (1, 2, 3):
        batch = images[:count]
        pixels = torch.cat([p.pixel_values for p in batch])
        grids = [p.grid_thw for p in batch]
        with torch.no_grad():
            expected = oracle.model.visual(pixels, grid_thw=torch.tensor([list(g) for g in grids])).pooler_output
            got = ours.encode_images(pixels, grids)
        assert [t.shape[0] for t in got] == [p.num_tokens for p in batch]  # split back per image
        rel = ((torch.cat(got) - expected).norm() / expected.norm()).item()
        assert rel <= 1e-5, f"vision output relative error {rel}"


def test_batched_vision_equals_one_image_at_a_time(pair):
    """No image attends to another: encoding a batch gives each image what it gets alone."""
    folder, ours, _ = pair
    proc_cfg = ImageProcessorConfig.from_pretrained(folder)
    images = [preprocess_image(random_image(*size, seed=20 + i), proc_cfg, max_pixels=MAX_PIXELS)
              for i, size in enumerate(IMAGE_SIZES)]
    batched = ours.encode_images(torch.cat([p.pixel_values for p in images]), [p.grid_thw for p in images])
    for p, got in zip(images, batched):
        alone = ours.encode_images(p.pixel_values, [p.grid_thw])[0]
        torch.testing.assert_close(got, alone, rtol=1e-5, atol=1e-6)


def test_bfloat16_agrees_with_float32(pair):
    folder, ours32, _ = pair
    ours16 = load_model(folder, dtype="bfloat16")
    assert ours16.lm_head.weight.dtype == torch.bfloat16
    tokenizer = Tokenizer.from_pretrained(folder)
    ids, processed = build_prompt(tokenizer, 1, ImageProcessorConfig.from_pretrained(folder))
    params = SamplingParams(temperature=0.0, max_tokens=1)
    logits32 = generate(ours32, ids, processed, params, keep_logits=True).logits[0]
    logits16 = generate(ours16, ids, processed, params, keep_logits=True).logits[0]
    scale = logits32.abs().max().item()
    err = (logits32 - logits16).abs().max().item()
    # bf16 keeps 8 mantissa bits (~0.4% per op); a few layers of it stay within a few percent of the scale.
    assert err <= 0.05 * scale, f"bf16 logits differ by {err} at scale {scale}"
    assert err > 0, "bf16 run was not actually in bf16"


def test_2b_shaped_checkpoint_matches_transformers(tmp_path):
    """The real Qwen2-VL-2B widths (hidden 1536, 12 heads / 2 kv heads, vision 1280, tied, real vocab)."""
    folder = make_checkpoint(tmp_path / "2b", preset="2b-shaped")
    ours = load_model(folder, dtype="float32")
    assert ours.config.text.hidden_size == 1536 and ours.config.tie_word_embeddings
    oracle = transformers.Qwen2VLForConditionalGeneration.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager").eval()
    assert_matches_oracle(folder, ours, oracle, num_images=1)


@pytest.mark.parametrize("num_images", [0, 3])
def test_packed_cpu_linear_layers_match_transformers(pair, num_images):
    """The engine's CPU fast path (oneDNN-packed weights) is held to the same oracle."""
    folder, _, oracle = pair
    packed = load_model(folder, dtype="float32")
    assert pack_linear_layers(packed) > 0
    assert not any(isinstance(m, torch.nn.Linear) for m in packed.modules())
    assert_matches_oracle(folder, packed, oracle, num_images)
