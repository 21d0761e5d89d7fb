"""Random checkpoints of the newer families, built by transformers' own config and model classes (the oracle).

nanomm's `make_checkpoint` writes Qwen2-VL folders from its own list of tensor names; for Qwen2.5-VL the names,
the shapes and config.json come from transformers instead (`save_pretrained`), so a checkpoint is what the
reference implementation itself would write. The tokenizer and preprocessor files are nanomm's (the tiny BPE or
the real Qwen one), since transformers cannot make those without the hub.

Weights are redrawn after construction (transformers initialises norms to exactly 1 and biases to 0, which
would hide a loader that drops them): each tensor from its own generator seeded by (seed, name), with the scale
rules of nanomm.tools.weights.random_weights.
"""

import json
import math
import shutil
from pathlib import Path

import torch
import transformers

from nanomm.tools.hf_files import generation_config, preprocessor_config, write_json
from nanomm.tools.tokenizers import write_qwen_tokenizer, write_tiny_tokenizer
from nanomm.tools.weights import QWEN_VOCAB_SIZE, _tensor_seed

TEXT_TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=4096, rms_norm_eps=1e-6, hidden_act="silu",
                 rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [4, 2, 2]})
# Qwen2.5-VL: windows of 112 px are 4x4 visual tokens; blocks 1 and 3 attend over whole frames.
QWEN2_5_VISION_TINY = dict(depth=4, hidden_size=32, intermediate_size=48, num_heads=4, out_hidden_size=64,
                           window_size=112, fullatt_block_indexes=[1, 3], hidden_act="silu", patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2, in_channels=3, tokens_per_second=2)
# Qwen2.5-VL-3B's widths (text 2048 / 16 heads / 2 kv heads, vision 1280 / 16 heads, SwiGLU 3420), depths cut.
QWEN2_5_3B_CUT = dict(
    text=dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=2, num_attention_heads=16,
              num_key_value_heads=2, max_position_embeddings=128000, rms_norm_eps=1e-6, hidden_act="silu",
              vocab_size=QWEN_VOCAB_SIZE,
              rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]}),
    vision=dict(depth=2, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=2048,
                window_size=112, fullatt_block_indexes=[1], hidden_act="silu", patch_size=14, spatial_merge_size=2,
                temporal_patch_size=2, in_channels=3, tokens_per_second=2),
    tie_word_embeddings=True)
# Qwen3-VL-2B's widths (text 2048 / 16 heads / 8 kv heads / head_dim 128, SwiGLU 6144; vision 1024 / 16 heads,
# 4096, a 48x48 position grid), depths cut: 3 decoder layers, 4 vision blocks, DeepStack from the last three.
QWEN3_2B_CUT = dict(
    text=dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=3, num_attention_heads=16,
              num_key_value_heads=8, head_dim=128, max_position_embeddings=262144, rms_norm_eps=1e-6,
              hidden_act="silu", attention_bias=False, vocab_size=QWEN_VOCAB_SIZE,
              rope_parameters={"rope_type": "default", "rope_theta": 5e6, "mrope_section": [24, 20, 20],
                               "mrope_interleaved": True}),
    vision=dict(depth=4, hidden_size=1024, intermediate_size=4096, num_heads=16, out_hidden_size=2048,
                hidden_act="gelu_pytorch_tanh", patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
                in_channels=3, num_position_embeddings=2304, deepstack_visual_indexes=[1, 2, 3]),
    tie_word_embeddings=True)
# Qwen3-VL: 16-px patches, an 8x8 learned position grid, DeepStack from blocks 0 and 2; a Qwen3 decoder whose
# head_dim (24) is not hidden / heads (16), with interleaved M-RoPE sections summing to head_dim / 2.
QWEN3_TEXT_TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=24, max_position_embeddings=4096, rms_norm_eps=1e-6,
                       hidden_act="silu", attention_bias=False,
                       rope_parameters={"rope_type": "default", "rope_theta": 5e6, "mrope_section": [4, 4, 4],
                                        "mrope_interleaved": True})
QWEN3_VISION_TINY = dict(depth=4, hidden_size=32, intermediate_size=48, num_heads=4, out_hidden_size=64,
                         hidden_act="gelu_pytorch_tanh", patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
                         in_channels=3, num_position_embeddings=64, deepstack_visual_indexes=[0, 2])
FAMILIES = {"qwen2_5_vl": (transformers.Qwen2_5_VLConfig, transformers.Qwen2_5_VLForConditionalGeneration,
                           TEXT_TINY, QWEN2_5_VISION_TINY),
            "qwen3_vl": (transformers.Qwen3VLConfig, transformers.Qwen3VLForConditionalGeneration,
                         QWEN3_TEXT_TINY, QWEN3_VISION_TINY)}
QWEN3_PIXELS = {"image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}  # Qwen3-VL's normalisation


def make_hf_checkpoint(out, family: str = "qwen2_5_vl", *, text: dict | None = None, vision: dict | None = None,
                       tie_word_embeddings: bool = False, seed: int = 0, tokenizer: str = "tiny") -> Path:
    """Write a random checkpoint of `family` with transformers' save_pretrained, plus tokenizer, preprocessor and
    generation files; returns the folder."""
    config_class, model_class, text_tiny, vision_tiny = FAMILIES[family]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    ids, tokenizer_size = (write_tiny_tokenizer if tokenizer == "tiny" else write_qwen_tokenizer)(out)
    text = {"vocab_size": tokenizer_size, **(text or text_tiny),
            "bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"]}
    vision = vision or vision_tiny
    config = config_class(text_config=text, vision_config=vision, tie_word_embeddings=tie_word_embeddings,
                          image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                          vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    model = model_class(config)
    redraw_weights(model, seed, text["hidden_size"])
    model.save_pretrained(out)
    write_json(out / "generation_config.json", generation_config(ids))
    processor = preprocessor_config({"vision_config": {
        "patch_size": vision["patch_size"], "temporal_patch_size": vision["temporal_patch_size"],
        "spatial_merge_size": vision["spatial_merge_size"]}}, "old")
    write_json(out / "preprocessor_config.json", {**processor, **(QWEN3_PIXELS if family == "qwen3_vl" else {})})
    return out


@torch.no_grad()
def redraw_weights(model: torch.nn.Module, seed: int, hidden_size: int) -> None:
    """Norm weights near 1, biases near 0 (not exactly), embeddings and head at std 2/sqrt(hidden), matrices at
    std 1/sqrt(fan_in): logits with std about 2, as in nanomm's own random checkpoints."""
    for name, param in model.named_parameters():
        g = torch.Generator().manual_seed(_tensor_seed(seed, name))
        x = torch.randn(param.shape, generator=g)
        if param.ndim == 1 and "norm" in name or name.endswith("ln_q.weight"):
            x = x.mul_(0.05).add_(1.0)
        elif name.endswith(".bias"):
            x = x.mul_(0.02)
        elif name.endswith(("embed_tokens.weight", "lm_head.weight")):
            x = x.mul_(2.0 / math.sqrt(hidden_size))
        else:
            x = x.mul_(1.0 / math.sqrt(math.prod(param.shape[1:])))
        param.copy_(x)


def render_hub_chat_template(folder: Path, messages: list[dict]) -> str:
    """A conversation rendered by a checkpoint's own chat_template.json, the way transformers renders it (a sandboxed
    jinja2 environment with trim_blocks and lstrip_blocks), with the generation prompt."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    template = json.loads((folder / "chat_template.json").read_text())["chat_template"]
    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return environment.from_string(template).render(messages=messages, add_generation_prompt=True)


def make_qwen3_text_draft(vl_folder: Path, out) -> Path:
    """A text-only Qwen3 checkpoint (transformers' Qwen3ForCausalLM, model_type "qwen3") holding a Qwen3-VL
    checkpoint's own decoder and head, with its tokenizer: a draft that agrees with its target on text."""
    vl = transformers.Qwen3VLForConditionalGeneration.from_pretrained(vl_folder, dtype=torch.float32)
    t = vl.config.text_config
    config = transformers.Qwen3Config(
        vocab_size=t.vocab_size, hidden_size=t.hidden_size, intermediate_size=t.intermediate_size,
        num_hidden_layers=t.num_hidden_layers, num_attention_heads=t.num_attention_heads,
        num_key_value_heads=t.num_key_value_heads, head_dim=t.head_dim, rms_norm_eps=t.rms_norm_eps,
        max_position_embeddings=t.max_position_embeddings, tie_word_embeddings=vl.config.tie_word_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": t.rope_parameters["rope_theta"]},
        bos_token_id=t.bos_token_id, eos_token_id=t.eos_token_id)
    draft = transformers.Qwen3ForCausalLM(config)
    draft.model.load_state_dict(vl.model.language_model.state_dict())
    draft.lm_head.load_state_dict(vl.lm_head.state_dict())
    out = Path(out)
    draft.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "generation_config.json"):
        shutil.copyfile(Path(vl_folder) / name, out / name)
    return out
