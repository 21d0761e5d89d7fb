"""Draft models for speculative decoding, cut from a target checkpoint: its first decoder layers.

Tooling outside the request path. `make_draft_checkpoint` writes a Qwen2-VL checkpoint, or a text-only Qwen2 one,
that keeps the target's embeddings, first decoder layers, final norm, LM head and tokenizer files unchanged.
Lesson 08 (speculative decoding), tests/test_draft_checkpoint.py, tests/test_speculative.py,
scripts/bench_spec.py and `scripts/make_checkpoint.py --draft-from` use it.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open

from nanomm.model.config import ModelConfig
from nanomm.model.loader import canonical_name, resolve_checkpoint, safetensors_files
from nanomm.tools.hf_files import text_only_config, write_json
from nanomm.tools.weights import write_safetensors

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
    write_json(out / "config.json", draft_config)
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
