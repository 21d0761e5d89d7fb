"""Random-weight Qwen2-VL checkpoints in Hugging Face layout, for tests, lessons and benchmarks.

nanomm never downloads weights in its tests. Instead `make_checkpoint` writes a folder that looks exactly like
a Hub checkpoint (config.json, generation_config.json, preprocessor_config.json, safetensors weights, tokenizer
files) but holds random weights. transformers loads these folders with no missing or unexpected keys, so the
same folder feeds both nanomm and the oracle.

Two more kinds of folder serve speculative decoding, whose draft model is "any Qwen2-VL or Qwen2 checkpoint with
the same tokenizer": `make_checkpoint(..., text_only=True)` writes a text-only Qwen2 checkpoint
(Qwen2ForCausalLM layout, model_type "qwen2") with the same tokenizer and text shapes, and
`nanomm.tools.draft_checkpoint.make_draft_checkpoint` cuts an existing checkpoint down to its first decoder layers.

The folder can imitate each variant a real loader meets: the original flat config.json or the nested one that
transformers 5 writes; the original weight names (`model.*`, `visual.*`) or the ones of transformers ~4.52-4.57
(`model.language_model.*`, `model.visual.*`); tied or untied embeddings; one file or several shards; float32,
bfloat16 or float16. Each tensor is drawn from its own generator seeded by (seed, tensor name), so a tensor's
values depend only on its name and shape, never on which other tensors exist or how the folder is laid out.

This module ties the parts together; they live beside it: `weights` (presets, shapes, random values,
safetensors files), `hf_files` (config.json and the other JSON files), `tokenizers` (the tokenizer files).
"""

from __future__ import annotations

from pathlib import Path

from nanomm.model.loader import DTYPES
from nanomm.tools.hf_files import (flat_config, generation_config, nested_config, preprocessor_config,
                                   text_only_config, write_json)
from nanomm.tools.tokenizers import write_qwen_tokenizer, write_tiny_tokenizer
from nanomm.tools.weights import PRESETS, QWEN_VOCAB_SIZE, model_spec, random_weights, rename, write_safetensors


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
    write_json(out / "config.json", config)
    write_json(out / "generation_config.json", generation_config(special_ids))
    if not text_only:
        write_json(out / "preprocessor_config.json", preprocessor_config(spec, preprocessor_style))

    weights = random_weights(spec, seed)
    weights = {rename(name, layout): t.to(DTYPES[dtype]) for name, t in weights.items()}
    write_safetensors(out, weights, num_shards)
    return out


def _check_choice(what: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{what} must be one of {', '.join(map(repr, choices))}, got {value!r}")
