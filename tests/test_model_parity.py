"""nanomm's Qwen2-VL against transformers' Qwen2VLForConditionalGeneration, in float32, on random checkpoints.

The oracle runs with attn_implementation="eager" and is always given `mm_token_type_ids`: without it,
transformers' generate silently falls back to 1-D positions (see the reference notes).
"""

import warnings

import pytest
import torch
from PIL import Image

from nanomm import LLM
from nanomm.tools.random_checkpoint import make_checkpoint
from nanomm.accel.packed_linear import pack_linear_layers
from nanomm.inputs.image import ImageProcessorConfig, preprocess_image
from nanomm.model.loader import load_model
from nanomm.reference import generate
from nanomm.sampling import SamplingParams
from nanomm.inputs.tokenizer import IMAGE_PLACEHOLDER, Tokenizer
from helpers import hf_inputs

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
LOGITS_ATOL = 1e-4  # float32 logits, nanomm against transformers, at any generated step
# Two rows that each agree with the true logits within LOGITS_ATOL can only rank two tokens differently when
# those tokens are within 2 * LOGITS_ATOL of each other: that is a near-tie, not a bug.
NEAR_TIE_GAP = 2 * LOGITS_ATOL


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
        # eos_token_id=None, not min_new_tokens: min_new_tokens forbids EOS, while ignore_eos lets nanomm pick it
        # (and go on), so a checkpoint whose greedy choice is EOS would differ for no fault of either.
        expected_tokens = oracle.generate(**inputs, max_new_tokens=num_tokens, do_sample=False, eos_token_id=None,
                                          pad_token_id=0)[0, len(ids):].tolist()
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


def test_a_smaller_vision_patch_matches_transformers(tmp_path):
    # patch_size and spatial_merge_size are config fields: 7-pixel patches make the vision tower more local,
    # which the demo model's recipe may need. Preprocessing, the patch embedding, the merger and the 2-D rotary
    # positions must all follow them.
    # With a 4x4 merge, a visual token is again a 28x28-pixel block, of 16 patches.
    folder = make_checkpoint(tmp_path, preset="tiny", overrides={"vision_config.patch_size": 7,
                                                                 "vision_config.spatial_merge_size": 4})
    ours = load_model(folder, dtype="float32")
    assert ours.config.vision.patch_size == 7 and ImageProcessorConfig.from_pretrained(folder).patch_size == 7
    assert ours.config.vision.spatial_merge_size == 4
    oracle = transformers.Qwen2VLForConditionalGeneration.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager").eval()
    assert_matches_oracle(folder, ours, oracle, num_images=3)


def test_the_demo_model_s_vision_shape_matches_transformers(tmp_path):
    # The trained demo model's tower: 7-pixel patches with a 2x2 merge (a visual token is a 14x14-pixel block)
    # and exact GELU instead of quick_gelu. tests/test_demo_model.py checks the trained weights themselves.
    folder = make_checkpoint(tmp_path, preset="tiny", overrides={"vision_config.patch_size": 7,
                                                                 "vision_config.spatial_merge_size": 2,
                                                                 "vision_config.hidden_act": "gelu"})
    ours = load_model(folder, dtype="float32")
    assert ImageProcessorConfig.from_pretrained(folder).factor == 14 and ours.config.vision.hidden_act == "gelu"
    oracle = transformers.Qwen2VLForConditionalGeneration.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager").eval()
    assert oracle.config.vision_config.hidden_act == "gelu"
    assert_matches_oracle(folder, ours, oracle, num_images=3)


@pytest.mark.slow
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
    assert pack_linear_layers(packed, min_side=1) > 0  # every layer, however small
    assert not any(isinstance(m, torch.nn.Linear) for m in packed.modules())
    assert_matches_oracle(folder, packed, oracle, num_images)


def steps_fed_the_same_tokens(ours: list[int], oracle: list[int], oracle_logits: list[torch.Tensor],
                              tie_gap: float = NEAR_TIE_GAP) -> int:
    """How many generated steps of two greedy runs saw the same input, so that their logits are comparable.

    Each run feeds back its own tokens: up to and including the first step where the two argmaxes differ both
    runs were given the same sequence; after it, nothing is comparable. A divergence is acceptable only at a
    near-tie: transformers' logit for nanomm's token must be within `tie_gap` of transformers' top logit (so its
    top-2 gap is below `tie_gap` too). Such a near-tie is reported with `warnings.warn` (step and gaps) and the
    steps up to it are returned; any other divergence fails the test. Returns len(ours) when all tokens agree.
    """
    assert len(ours) == len(oracle) == len(oracle_logits), (len(ours), len(oracle), len(oracle_logits))
    for step, (mine, theirs) in enumerate(zip(ours, oracle)):
        if mine == theirs:
            continue
        row = oracle_logits[step].float()
        gap = (row.max() - row[mine]).item()
        top2 = row.topk(2).values
        top2_gap = (top2[0] - top2[1]).item()
        assert gap < tie_gap, (f"step {step}: nanomm chose token {mine}, transformers {theirs}, and it is no near-tie: "
                               f"transformers scores nanomm's token {gap:.3g} below its top (top-2 gap {top2_gap:.3g})")
        warnings.warn(f"near-tie at generated step {step}: nanomm chose token {mine}, transformers {theirs}; "
                      f"gap {gap:.3g} (top-2 gap {top2_gap:.3g}); the steps after it are not compared")
        return step + 1
    return len(ours)


def oracle_greedy(oracle, inputs, num_tokens):
    """transformers' greedy tokens and raw (unprocessed) logits for `num_tokens` new tokens; never stops at EOS.

    eos_token_id=None rather than min_new_tokens: min_new_tokens works by masking EOS in the scores, so the tokens
    would no longer be the argmax of the raw logits that nanomm's rows are compared with.
    """
    with torch.no_grad():
        out = oracle.generate(**inputs, max_new_tokens=num_tokens, do_sample=False, eos_token_id=None,
                              output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, inputs["input_ids"].shape[1]:].tolist()
    logits = [row[0].float() for row in out.logits]
    assert len(tokens) == len(logits) == num_tokens
    assert tokens == [row.argmax().item() for row in logits], "transformers' greedy tokens are not its logits' argmax"
    return tokens, logits


def test_steps_fed_the_same_tokens_accepts_only_near_ties():
    rows = [torch.tensor([0.0, 1.0, 0.5]), torch.tensor([2.0, 2.0 + NEAR_TIE_GAP / 4, 0.0]),
            torch.tensor([0.0, 0.0, 1.0])]
    assert steps_fed_the_same_tokens([1, 1, 2], [1, 1, 2], rows) == 3
    with pytest.warns(UserWarning, match="near-tie at generated step 1"):
        assert steps_fed_the_same_tokens([1, 0, 0], [1, 1, 2], rows) == 2  # step 1 compared, step 2 not
    with pytest.raises(AssertionError, match="step 0: .* no near-tie"):
        steps_fed_the_same_tokens([2, 1, 2], [1, 1, 2], rows)  # 0.5 below the top: a real divergence


EVERY_STEP_TOKENS = 16


@pytest.mark.parametrize("num_images", [0, 1])
def test_every_step_logits_match_transformers(pair, num_images):
    """Not just the first position: every generated step's logits (so every decode position's M-RoPE ids, the
    KV cache and the rope delta after images) agree with transformers' raw logits within LOGITS_ATOL."""
    folder, ours, oracle = pair
    ids, processed = build_prompt(Tokenizer.from_pretrained(folder), num_images,
                                  ImageProcessorConfig.from_pretrained(folder))
    params = SamplingParams(temperature=0.0, max_tokens=EVERY_STEP_TOKENS, ignore_eos=True)
    result = generate(ours, ids, processed, params, keep_logits=True)
    expected_tokens, expected_logits = oracle_greedy(oracle, hf_inputs(ids, processed, ours.config.image_token_id),
                                                     EVERY_STEP_TOKENS)
    assert len(result.logits) == EVERY_STEP_TOKENS

    # Up to and including the first step whose tokens differ, both were fed the same sequence: logits first (the
    # clearer message when a position or the cache is wrong), then whether that divergence is a near-tie.
    same_input = next((i + 1 for i, (a, b) in enumerate(zip(result.token_ids, expected_tokens)) if a != b),
                      EVERY_STEP_TOKENS)
    diffs = [(got - want).abs().max().item() for got, want in zip(result.logits[:same_input], expected_logits)]
    bad = [(step, f"{d:.3g}") for step, d in enumerate(diffs) if not d <= LOGITS_ATOL]
    assert not bad, f"logits differ from transformers' at (step, max abs diff) {bad}"
    comparable = steps_fed_the_same_tokens(result.token_ids, expected_tokens, expected_logits)
    assert comparable == same_input
    assert comparable >= EVERY_STEP_TOKENS // 2, f"a near-tie after {comparable} steps left too little compared"
    # The steps really differ from one another, so a stale position or cache could not pass by accident.
    assert min((a - b).abs().max().item() for a, b in zip(expected_logits, expected_logits[1:])) > 1e-2


# ---- prompts that end a few tokens below the model's position limit -------------------------------------------

LIMIT = 96  # max_position_embeddings of the limit checkpoint; the engine's max_model_len defaults to it
LIMIT_MAX_PIXELS = 28 * 28 * 16


@pytest.fixture(scope="module")
def limit_pair(tmp_path_factory):
    folder = make_checkpoint(tmp_path_factory.mktemp("limit"), preset="tiny", seed=3,
                             overrides={"max_position_embeddings": LIMIT})
    oracle = transformers.Qwen2VLForConditionalGeneration.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager").eval()
    return folder, oracle


def prompt_of_length(tokenizer: Tokenizer, length: int, processed):
    """Chat-template token ids (one image placeholder per processed image) padded with filler words so that the
    prompt is exactly `length` tokens once the placeholders are expanded: (unexpanded ids, expanded ids)."""
    head = tokenizer.encode("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
                            + IMAGE_PLACEHOLDER * len(processed) + "Describe")
    tail = tokenizer.encode("<|im_end|>\n<|im_start|>assistant\n")
    words = tokenizer.encode(" the cat sat on the mat and looked at the red house")
    counts = [p.num_tokens for p in processed]
    fill = length - len(tokenizer.expand_image_placeholders(head + tail, counts))
    assert fill >= 0, f"the prompt frame alone is longer than {length} tokens"
    ids = head + [words[i % len(words)] for i in range(fill)] + tail
    expanded = tokenizer.expand_image_placeholders(ids, counts)
    assert len(expanded) == length
    return ids, expanded


def test_prompts_near_the_position_limit_finish_at_max_model_len_like_transformers(limit_pair):
    """Greedy, ignore_eos, max_tokens past the limit: each request stops with "length" exactly when prompt +
    output reaches max_model_len (take_tokens: the token that makes num_tokens == max_model_len is the last),
    and its tokens are transformers' greedy tokens for that many new tokens; one prompt leaves room for one."""
    folder, oracle = limit_pair
    tokenizer = Tokenizer.from_pretrained(folder)
    proc_cfg = ImageProcessorConfig.from_pretrained(folder)
    image = random_image(60, 90, seed=11)
    processed = [preprocess_image(image, proc_cfg, max_pixels=LIMIT_MAX_PIXELS)]
    cases = [(LIMIT - 1, []), (LIMIT - 4, []), (LIMIT - 6, processed)]  # (prompt length, images)
    prompts, expanded = [], []
    for length, imgs in cases:
        ids, full = prompt_of_length(tokenizer, length, imgs)
        prompt = {"prompt_token_ids": ids}
        if imgs:
            prompt["multi_modal_data"] = {"image": [image]}
        prompts.append(prompt)
        expanded.append(full)
    params = SamplingParams(temperature=0.0, max_tokens=LIMIT, ignore_eos=True)

    with LLM(str(folder), device="cpu", dtype="float32", max_pixels=LIMIT_MAX_PIXELS) as llm:
        assert llm.engine.config.max_model_len == LIMIT
        outputs = llm.generate(prompts, params)

    image_token_id = oracle.config.image_token_id
    for (length, imgs), full, out in zip(cases, expanded, outputs):
        assert out.prompt_token_ids == full, "the engine expanded the prompt differently"
        completion = out.outputs[0]
        assert completion.finish_reason == "length"
        assert len(full) + len(completion.token_ids) == LIMIT, (len(full), len(completion.token_ids))
        expected_tokens, expected_logits = oracle_greedy(oracle, hf_inputs(full, imgs, image_token_id),
                                                         LIMIT - length)
        comparable = steps_fed_the_same_tokens(completion.token_ids, expected_tokens, expected_logits)
        assert completion.token_ids[:comparable] == expected_tokens[:comparable]
