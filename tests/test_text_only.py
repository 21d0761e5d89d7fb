"""Text-only Qwen2 checkpoints (draft models): nanomm against transformers' Qwen2ForCausalLM, in float32.

A model_type "qwen2" checkpoint loads into the same `Qwen2VL` class with no vision tower. Its rotary embedding
is M-RoPE with every band on the first axis (mrope_section = (head_dim/2, 0, 0)), which is 1-D RoPE.
"""

import json
import shutil

import pytest
import torch

import transformers  # the oracle (dev extra); a missing oracle must fail, not skip
from nanomm.tools.random_checkpoint import make_checkpoint
from nanomm.model.config import ModelConfig
from nanomm.errors import CheckpointError
from nanomm.inputs.image import ImageProcessorConfig, preprocess_image
from nanomm.model.loader import load_model
from nanomm.reference import ContiguousKVCache, generate
from nanomm.model.rope import inverse_frequencies, mrope_cos_sin, mrope_positions, text_positions
from nanomm.sampling import SamplingParams
from nanomm.inputs.tokenizer import Tokenizer
from tests.helpers import random_image

CONFIGS = {
    "tiny-untied": dict(preset="tiny"),
    "mha-tied-3-layers": dict(preset="tiny", tie_word_embeddings=True, seed=1, num_shards=2,
                              overrides={"num_attention_heads": 2, "num_key_value_heads": 2, "num_hidden_layers": 3}),
    "gqa3-head-dim-16": dict(preset="tiny", seed=2, dtype="bfloat16",
                             overrides={"hidden_size": 96, "intermediate_size": 160, "num_attention_heads": 6,
                                        "num_key_value_heads": 2}),
}
PROMPTS = [
    "<|im_start|>user\nWhat colour is the cat?<|im_end|>\n<|im_start|>assistant\n",
    "The sky is blue, the sun is bright, and the trees are",
    # The target's prompt with an image, as a text-only draft sees it: the vision tokens are plain text.
    "<|im_start|>user\n<|vision_start|><|image_pad|><|image_pad|><|vision_end|>Describe it.<|im_end|>\n",
]


@pytest.fixture(scope="module", params=list(CONFIGS))
def pair(request, tmp_path_factory):
    folder = make_checkpoint(tmp_path_factory.mktemp(request.param), text_only=True, **CONFIGS[request.param])
    ours = load_model(folder, dtype="float32")
    oracle = transformers.Qwen2ForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    return folder, ours, oracle


def test_loads_as_a_model_without_vision_tower(pair):
    folder, ours, _ = pair
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "qwen2" and "vision_config" not in config and "image_token_id" not in config
    assert not (folder / "preprocessor_config.json").exists()
    assert ours.visual is None and not ours.config.has_vision
    assert ours.config.text.mrope_section == (ours.config.text.head_dim // 2, 0, 0)
    assert not any(name.startswith("visual.") for name in ours.state_dict())


def test_transformers_loads_every_tensor(pair):
    folder, ours, _ = pair
    _, info = transformers.Qwen2ForCausalLM.from_pretrained(folder, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info


@pytest.mark.parametrize("prompt", range(len(PROMPTS)))
def test_logits_and_greedy_tokens_match_transformers(pair, prompt, num_tokens=24):
    folder, ours, oracle = pair
    ids = Tokenizer.from_pretrained(folder).encode(PROMPTS[prompt])
    params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
    result = generate(ours, ids, params=params, keep_logits=True)

    input_ids = torch.tensor([ids])
    with torch.no_grad():
        expected_logits = oracle(input_ids=input_ids).logits[0, -1].float()
        expected_tokens = oracle.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                          max_new_tokens=num_tokens, min_new_tokens=num_tokens,
                                          do_sample=False)[0, len(ids):].tolist()
    diff = (result.logits[0] - expected_logits).abs().max().item()
    assert diff <= 1e-4, f"last-position logits differ by {diff}"
    assert expected_logits.std() > 0.05, "random weights too small to make the comparison meaningful"
    assert result.token_ids == expected_tokens


def test_direct_forward_with_1d_positions_matches_transformers(pair):
    """The forward pass itself, every position: positions arange(n) on all three axes."""
    folder, ours, oracle = pair
    ids = Tokenizer.from_pretrained(folder).encode(PROMPTS[0])
    kv = ContiguousKVCache(ours.config.text.num_hidden_layers)
    with torch.no_grad():
        logits = ours.compute_logits(ours(torch.tensor(ids), text_positions(len(ids)), kv))
        expected = oracle(input_ids=torch.tensor([ids])).logits[0].float()
    assert (logits - expected).abs().max().item() <= 1e-4


def test_mrope_with_empty_bands_is_1d_rope_on_the_first_axis():
    t = torch.arange(9)
    positions = torch.stack([t, t * 7 + 3, torch.zeros_like(t)])  # h and w rows must be ignored
    cos, sin = mrope_cos_sin(positions, 16, 1e4, (8, 0, 0), torch.float32)
    angles = t[:, None].float() * inverse_frequencies(16, 1e4)  # (9, 8)
    angles = torch.cat((angles, angles), dim=-1)  # (9, 16): rotate_half layout
    assert torch.equal(cos, angles.cos()) and torch.equal(sin, angles.sin())


def test_same_text_model_as_the_vision_language_checkpoint(tmp_path):
    """Same preset and seed: the text-only checkpoint is the Qwen2-VL one minus its vision tower, and on text
    (equal position rows) M-RoPE with any mrope_section equals 1-D RoPE, so the logits are the same."""
    text_only = load_model(make_checkpoint(tmp_path / "t", text_only=True))
    vision_language = load_model(make_checkpoint(tmp_path / "vl"))
    vl_state = vision_language.state_dict()
    for name, tensor in text_only.state_dict().items():
        assert torch.equal(tensor, vl_state[name]), name
    ids = Tokenizer.from_pretrained(tmp_path / "t").encode(PROMPTS[1])
    positions, _ = mrope_positions(ids, [], vision_language.config.image_token_id, 2)
    with torch.no_grad():
        a = text_only(torch.tensor(ids), text_positions(len(ids)), ContiguousKVCache(2))
        b = vision_language(torch.tensor(ids), positions, ContiguousKVCache(2))
    torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_encode_images_says_the_model_is_text_only(pair):
    folder, ours, _ = pair
    pixels = torch.zeros(16, 3 * 2 * 14 * 14)
    with pytest.raises(ValueError, match=r"text-only .*\(no vision tower\)"):
        ours.encode_images(pixels, [(1, 4, 4)])

    image = preprocess_image(random_image(56, 56, seed=0), ImageProcessorConfig())
    tokenizer = Tokenizer.from_pretrained(folder)
    ids = tokenizer.encode("<|vision_start|><|image_pad|><|vision_end|>Describe it.")
    ids = tokenizer.expand_image_placeholders(ids, [image.num_tokens])
    with pytest.raises(ValueError, match="cannot encode images"):  # the reference refuses it too
        generate(ours, ids, [image])


def test_qwen2_config_defaults_are_qwen2s():
    """Missing fields take Qwen2Config's class defaults (not Qwen2-VL's); vision token ids keep Qwen2-VL's."""
    config = ModelConfig.from_dict({"model_type": "qwen2", "hidden_size": 896, "num_attention_heads": 14,
                                    "num_key_value_heads": 2})
    reference = transformers.Qwen2Config(hidden_size=896, num_attention_heads=14, num_key_value_heads=2)
    assert config.text.rms_norm_eps == reference.rms_norm_eps == 1e-6
    assert config.text.rope_theta == reference.rope_parameters["rope_theta"] == 10_000.0
    assert (config.text.vocab_size, config.text.num_hidden_layers, config.text.intermediate_size) == \
        (reference.vocab_size, reference.num_hidden_layers, reference.intermediate_size)
    assert config.vision is None and config.text.mrope_section == (32, 0, 0)
    assert (config.image_token_id, config.vision_start_token_id, config.vision_end_token_id) == (151655, 151652, 151653)


def test_qwen2_config_in_transformers_5_keys():
    config = ModelConfig.from_dict({"model_type": "qwen2", "hidden_size": 64, "num_attention_heads": 4,
                                    "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"},
                                    "dtype": "bfloat16"})
    assert config.text.rope_theta == 1e6 and config.text.num_key_value_heads == 4 and config.torch_dtype == "bfloat16"


@pytest.mark.parametrize("rope", [{"type": "yarn", "factor": 4.0}, {"rope_type": "linear", "factor": 2.0}])
def test_rope_scaling_nanomm_does_not_compute_is_refused(rope):
    with pytest.raises(CheckpointError, match="rope type .* not supported"):
        ModelConfig.from_dict({"model_type": "qwen2", "hidden_size": 64, "num_attention_heads": 4,
                               "rope_scaling": rope})


@pytest.mark.parametrize("model_type", ["qwen3_moe", "llama", None])
def test_other_model_types_say_what_is_supported(tmp_path, model_type):
    folder = shutil.copytree(make_checkpoint(tmp_path / "t", text_only=True), tmp_path / "edited")
    config = json.loads((folder / "config.json").read_text())
    config["model_type"] = model_type
    (folder / "config.json").write_text(json.dumps(config))
    supported = r".*'qwen2_vl'.*'qwen2_5_vl'.*'qwen3_vl'.*'qwen2'.*'qwen3'"
    with pytest.raises(CheckpointError, match=rf"model_type={model_type!r}{supported}"):
        load_model(folder)


def test_vision_weights_in_a_text_only_checkpoint_are_refused(tmp_path):
    folder = make_checkpoint(tmp_path / "vl")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(config, model_type="qwen2")))
    with pytest.raises(CheckpointError, match="unexpected .*visual"):
        load_model(folder)


def test_text_only_needs_the_one_qwen2_layout(tmp_path):
    with pytest.raises(ValueError, match="layout='original'"):
        make_checkpoint(tmp_path / "x", text_only=True, layout="new")
    with pytest.raises(ValueError, match="unknown model field 'vision_config.depth'"):
        make_checkpoint(tmp_path / "x", text_only=True, overrides={"vision_config.depth": 1})
    assert not (tmp_path / "x").exists()
