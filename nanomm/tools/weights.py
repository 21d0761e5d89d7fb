"""Model shapes and random weights for the random-weight checkpoints of `nanomm.tools.random_checkpoint`.

Tooling outside the request path: the presets (`tiny`, `small`, `2b-shaped`), the tensor names and shapes of a
Qwen2-VL (or text-only Qwen2) checkpoint, seeded random values, and the safetensors files that hold them. Used by
`make_checkpoint`, the draft-checkpoint tool, tests/test_checkpoint.py and lesson 08 (which counts the bytes a
decode step reads from `text_param_shapes`).
"""

from __future__ import annotations

import copy
import ctypes
import hashlib
import json
import math
import struct
import sys
from pathlib import Path

import torch
from safetensors import safe_open

from nanomm.tools.hf_files import write_json

QWEN_VOCAB_SIZE = 151936  # embedding rows of Qwen2-VL-2B; rows past the tokenizer's 151657 ids are padding

_VISION = dict(mlp_ratio=4, hidden_act="quick_gelu", patch_size=14, temporal_patch_size=2,
               spatial_merge_size=2, in_channels=3)
_TEXT = dict(hidden_act="silu", rms_norm_eps=1e-6, rope_theta=1e6)

_QWEN2_VL_2B = dict(_TEXT, vocab_size=QWEN_VOCAB_SIZE, hidden_size=1536, intermediate_size=8960,
                    num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768,
                    mrope_section=[16, 24, 24], tie_word_embeddings=True,
                    vision_config=dict(_VISION, depth=32, embed_dim=1280, num_heads=16))

# Model shapes. vocab_size None means "the tokenizer's size" (tiny tokenizer) or QWEN_VOCAB_SIZE (real one).
# The vision tower's output width (vision_config.hidden_size) always equals the text hidden_size.
PRESETS: dict[str, dict] = {
    "tiny": dict(_TEXT, vocab_size=None, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                 mrope_section=[4, 2, 2], tie_word_embeddings=False,
                 vision_config=dict(_VISION, depth=2, embed_dim=32, num_heads=4)),
    "small": dict(_TEXT, vocab_size=QWEN_VOCAB_SIZE, hidden_size=512, intermediate_size=1536, num_hidden_layers=6,
                  num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=32768,
                  mrope_section=[8, 12, 12], tie_word_embeddings=True,
                  vision_config=dict(_VISION, depth=4, embed_dim=256, num_heads=4)),
    # The real Qwen2-VL-2B widths, but 1 text layer and 1 vision block (of 28 and 32) by default.
    "2b-shaped": dict(_QWEN2_VL_2B, num_hidden_layers=1, vision_config=dict(_QWEN2_VL_2B["vision_config"], depth=1)),
    # Qwen2-VL-2B's whole shape: 28 text layers and 32 vision blocks (scripts/gpu_check.sh's GPU step).
    "2b": _QWEN2_VL_2B,
}


# ---------------------------------------------------------------------------------------------------------
# Model shape


def model_spec(preset: str, overrides: dict | None = None, tie_word_embeddings: bool | None = None,
               text_only: bool = False) -> dict:
    """The preset's fields with overrides applied. Vision fields: {"vision_config": {...}} or "vision_config.depth".

    text_only: the text fields only (a Qwen2ForCausalLM has no vision tower, and 1-D RoPE: no mrope_section).
    """
    spec = copy.deepcopy(PRESETS[preset])
    if text_only:
        del spec["vision_config"], spec["mrope_section"]
    vision = spec.get("vision_config", {})
    for key, value in _dotted(overrides or {}).items():
        fields, name = (vision, key.removeprefix("vision_config.")) if key.startswith("vision_config.") else (spec, key)
        if name not in fields or name == "vision_config":
            known = [k for k in spec if k != "vision_config"] + [f"vision_config.{k}" for k in vision]
            raise ValueError(f"unknown model field {key!r}; known fields: {', '.join(known)}")
        fields[name] = value
    if tie_word_embeddings is not None:
        spec["tie_word_embeddings"] = bool(tie_word_embeddings)
    _check_spec(spec)
    return spec


def _dotted(overrides: dict) -> dict:
    """{"vision_config": {"depth": 1}} -> {"vision_config.depth": 1}; other keys unchanged."""
    out = {}
    for key, value in overrides.items():
        if key == "vision_config" and isinstance(value, dict):
            out.update({f"vision_config.{k}": v for k, v in value.items()})
        else:
            out[key] = value
    return out


def _check_spec(spec: dict) -> None:
    heads, kv = spec["num_attention_heads"], spec["num_key_value_heads"]
    if spec["hidden_size"] % heads or heads % kv:
        raise ValueError("hidden_size must divide by num_attention_heads, and that by num_key_value_heads")
    head_dim = spec["hidden_size"] // heads
    if "mrope_section" in spec and 2 * sum(spec["mrope_section"]) != head_dim:
        raise ValueError(f"mrope_section {spec['mrope_section']} must sum to head_dim/2 = {head_dim // 2}")
    vision = spec.get("vision_config")
    if vision and (vision["embed_dim"] % vision["num_heads"] or (vision["embed_dim"] // vision["num_heads"]) % 4):
        raise ValueError("vision embed_dim/num_heads must be a whole multiple of 4 (2-D rotary halves)")


def param_shapes(spec: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor of the checkpoint, by its on-disk name in the original layout, with its shape."""
    shapes = text_param_shapes(spec)
    if "vision_config" in spec:  # absent: a text-only Qwen2 checkpoint
        shapes.update(vision_param_shapes(spec))
    return shapes


def text_param_shapes(spec: dict) -> dict[str, tuple[int, ...]]:
    """The language model's tensors: embeddings, decoder layers, final norm, LM head unless tied."""
    H, I, V = spec["hidden_size"], spec["intermediate_size"], spec["vocab_size"]
    kv_dim = spec["num_key_value_heads"] * (H // spec["num_attention_heads"])
    shapes = {"model.embed_tokens.weight": (V, H)}
    for n in range(spec["num_hidden_layers"]):
        p = f"model.layers.{n}."
        shapes.update({
            p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
            p + "self_attn.q_proj.weight": (H, H), p + "self_attn.q_proj.bias": (H,),
            p + "self_attn.k_proj.weight": (kv_dim, H), p + "self_attn.k_proj.bias": (kv_dim,),
            p + "self_attn.v_proj.weight": (kv_dim, H), p + "self_attn.v_proj.bias": (kv_dim,),
            p + "self_attn.o_proj.weight": (H, H),
            p + "mlp.gate_proj.weight": (I, H), p + "mlp.up_proj.weight": (I, H), p + "mlp.down_proj.weight": (H, I),
        })
    shapes["model.norm.weight"] = (H,)
    if not spec["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (V, H)
    return shapes


def vision_param_shapes(spec: dict) -> dict[str, tuple[int, ...]]:
    """The vision tower's tensors: patch embedding, ViT blocks, and the merger that projects to hidden_size."""
    H, vc = spec["hidden_size"], spec["vision_config"]
    E, P, T, C = vc["embed_dim"], vc["patch_size"], vc["temporal_patch_size"], vc["in_channels"]
    F, M = E * vc["mlp_ratio"], E * vc["spatial_merge_size"] ** 2  # MLP width; merger input (2x2 patches)
    shapes = {"visual.patch_embed.proj.weight": (E, C, T, P, P)}
    for n in range(vc["depth"]):
        p = f"visual.blocks.{n}."
        shapes.update({
            p + "norm1.weight": (E,), p + "norm1.bias": (E,), p + "norm2.weight": (E,), p + "norm2.bias": (E,),
            p + "attn.qkv.weight": (3 * E, E), p + "attn.qkv.bias": (3 * E,),
            p + "attn.proj.weight": (E, E), p + "attn.proj.bias": (E,),
            p + "mlp.fc1.weight": (F, E), p + "mlp.fc1.bias": (F,),
            p + "mlp.fc2.weight": (E, F), p + "mlp.fc2.bias": (E,),
        })
    shapes.update({
        "visual.merger.ln_q.weight": (E,), "visual.merger.ln_q.bias": (E,),
        "visual.merger.mlp.0.weight": (M, M), "visual.merger.mlp.0.bias": (M,),
        "visual.merger.mlp.2.weight": (H, M), "visual.merger.mlp.2.bias": (H,),
    })
    return shapes


def num_parameters(spec: dict) -> int:
    return sum(math.prod(shape) for shape in param_shapes(spec).values())


# ---------------------------------------------------------------------------------------------------------
# Weights


def random_weights(spec: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """float32 weights by original on-disk name.

    Matrices get std 1/sqrt(fan_in), so every layer's output stays O(1) whatever the width (a fixed std would
    make a 1536-wide model's activations 5x larger than a 64-wide one's). Embeddings and the LM head get
    std 2/sqrt(hidden): the final RMSNorm output has unit scale, so logits come out with std about 2, far from
    uniform but not saturated. Norm weights sit near 1 and biases near 0, but not exactly, so a loader that
    drops one of them changes the output.
    """
    H = spec["hidden_size"]
    weights = {}
    for name, shape in param_shapes(spec).items():
        g = torch.Generator().manual_seed(_tensor_seed(seed, name))
        x = torch.randn(shape, generator=g)
        if name.endswith(("norm.weight", "layernorm.weight", "norm1.weight", "norm2.weight", "ln_q.weight")):
            x = x.mul_(0.05).add_(1.0)
        elif name.endswith(".bias"):
            x = x.mul_(0.02)
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            x = x.mul_(2.0 / math.sqrt(H))
        else:
            x = x.mul_(1.0 / math.sqrt(math.prod(shape[1:])))  # fan_in: everything but the output dim
        weights[name] = x
    return weights


def _tensor_seed(seed: int, name: str) -> int:
    # A stable hash (Python's hash() is salted per process) of (seed, name), as a 63-bit generator seed.
    return int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:8], "little") >> 1


def rename(name: str, layout: str) -> str:
    """Original Hub name -> the name in `layout`. "new" is what transformers ~4.52-4.57 saved."""
    if layout == "new" and name.startswith("model."):
        return "model.language_model." + name.removeprefix("model.")
    if layout == "new" and name.startswith("visual."):
        return "model." + name
    return name


def write_safetensors(out: Path, weights: dict[str, torch.Tensor], num_shards: int = 1) -> None:
    """One model.safetensors, or num_shards files plus the model.safetensors.index.json that lists them."""
    if num_shards == 1:
        save_safetensors(weights, out / "model.safetensors")
        return
    if not 1 <= num_shards <= len(weights):
        raise ValueError(f"num_shards must be between 1 and {len(weights)}, got {num_shards}")
    weight_map = {}
    for i, names in enumerate(_split_into_shards(weights, num_shards)):
        filename = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        save_safetensors({n: weights[n] for n in names}, out / filename)
        weight_map.update({n: filename for n in names})
    total = sum(t.numel() * t.element_size() for t in weights.values())
    write_json(out / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map})


SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def save_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """Write the safetensors format directly: an 8-byte little-endian header length, a JSON header (each tensor's
    dtype, shape and byte range), then the raw little-endian bytes. The safetensors package reads it back;
    its own writer needs numpy, which is not one of nanomm's runtime dependencies (`nanomm-chat --demo`
    writes a checkpoint on first use)."""
    assert sys.byteorder == "little", "safetensors stores little-endian bytes"
    tensors = {name: t.detach().cpu().contiguous() for name, t in sorted(tensors.items())}
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, t in tensors.items():
        size = t.numel() * t.element_size()
        header[name] = {"dtype": SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the format pads the header to 8 bytes with spaces
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)) + encoded)
        for t in tensors.values():
            if t.numel():
                f.write(ctypes.string_at(t.data_ptr(), t.numel() * t.element_size()))  # the bytes, no numpy


def _split_into_shards(weights: dict[str, torch.Tensor], num_shards: int) -> list[list[str]]:
    """Consecutive groups of about equal bytes; never an empty group."""
    target = sum(t.numel() * t.element_size() for t in weights.values()) / num_shards
    groups, size = [[]], 0
    for i, (name, t) in enumerate(weights.items()):
        shards_left, tensors_left = num_shards - len(groups), len(weights) - i
        if groups[-1] and shards_left > 0 and (size >= target or tensors_left <= shards_left):
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += t.numel() * t.element_size()
    return groups


def checkpoint_size(folder) -> tuple[int, int]:
    """(number of parameters, bytes of tensor data) of the safetensors files in a folder."""
    params = nbytes = 0
    for path in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                s = f.get_slice(name)
                n = math.prod(s.get_shape())
                params += n
                nbytes += n * {"F32": 4, "BF16": 2, "F16": 2}[s.get_dtype()]
    return params, nbytes
