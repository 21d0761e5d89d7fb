"""The Hugging Face JSON files of the random-weight checkpoints: config.json, generation_config.json and
preprocessor_config.json.

Tooling outside the request path. `nanomm.tools.random_checkpoint.make_checkpoint` writes these files; the
draft-checkpoint tool reuses `text_only_config`. tests/test_checkpoint.py and tests/test_text_only.py check that
transformers reads them as it reads the Hub's.
"""

from __future__ import annotations

import json
from pathlib import Path

from nanomm.inputs.image import DEFAULT_MAX_PIXELS, DEFAULT_MIN_PIXELS, OPENAI_CLIP_MEAN, OPENAI_CLIP_STD


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
        pixels = {"min_pixels": DEFAULT_MIN_PIXELS, "max_pixels": DEFAULT_MAX_PIXELS}
    else:
        pixels = {"size": {"shortest_edge": DEFAULT_MIN_PIXELS, "longest_edge": DEFAULT_MAX_PIXELS}, "do_resize": True,
                  "do_rescale": True, "do_normalize": True, "do_convert_rgb": True, "resample": 3,
                  "rescale_factor": 1 / 255}
    return {**pixels, "patch_size": vc["patch_size"], "temporal_patch_size": vc["temporal_patch_size"],
            "merge_size": vc["spatial_merge_size"], "image_mean": list(OPENAI_CLIP_MEAN),
            "image_std": list(OPENAI_CLIP_STD), "image_processor_type": "Qwen2VLImageProcessor",
            "processor_class": "Qwen2VLProcessor"}


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
