"""Model configuration: every hyper-parameter of a Qwen2-VL, Qwen2.5-VL or Qwen3-VL checkpoint in two dataclasses.

`model_type` picks the family. Each family's config.json names some fields its own way (Qwen2.5-VL and Qwen3-VL
call the tower's width `hidden_size` and the language model's `out_hidden_size`); they parse into nanomm's names,
and a field a file leaves out takes that family's transformers class default.

Real checkpoints store `config.json` in two layouts (see lessons/02-vision-encoder.md and the reference
notes): the original flat one (text fields at the top level, `rope_scaling: {"type": "mrope", ...}`) and the
nested one newer transformers writes (`text_config`, `vision_config`, `rope_parameters`). Both parse into
the same `ModelConfig`. Missing fields take transformers' class defaults, so a sparse config means the same
model here as there.

Text-only Qwen2 and Qwen3 checkpoints (model_type "qwen2" / "qwen3": Qwen2ForCausalLM, Qwen3ForCausalLM) parse
into the same `ModelConfig` with `vision=None`: they serve as draft models for speculative decoding. Their
language model is Qwen2-VL's (or Qwen3-VL's) minus M-RoPE; with `mrope_section = (head_dim/2, 0, 0)` every
rotary band follows the first position axis, which is ordinary 1-D RoPE.
"""

import json
from dataclasses import dataclass, replace
from pathlib import Path

from nanomm.errors import CheckpointError

SUPPORTED_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen2", "qwen3")  # the VL families; text-only drafts
TEXT_ONLY_TYPES = ("qwen2", "qwen3")  # Qwen2ForCausalLM, Qwen3ForCausalLM: draft models, 1-D RoPE, no tower
# Rotary variants nanomm computes; others (yarn, dynamic, ...) would silently change the positions.
SUPPORTED_ROPE_TYPES = ("default", "mrope")


@dataclass(frozen=True)
class TextConfig:
    vocab_size: int = 152064
    hidden_size: int = 8192
    intermediate_size: int = 29568
    num_hidden_layers: int = 80
    num_attention_heads: int = 64
    num_key_value_heads: int = 8
    rms_norm_eps: float = 1e-5  # the class default; real checkpoints say 1e-6
    rope_theta: float = 1_000_000.0
    mrope_section: tuple[int, int, int] = (16, 24, 24)  # rotary bands driven by the t, h, w positions
    max_position_embeddings: int = 32768
    hidden_act: str = "silu"
    attention_bias: bool = True  # q/k/v biases (Qwen2); Qwen3 has none
    qk_norm: bool = False  # Qwen3: an RMSNorm over each head of q and of k, before the rotation
    mrope_interleaved: bool = False  # Qwen3-VL: rotary bands cycle t, h, w instead of three contiguous runs
    explicit_head_dim: int | None = None  # config.json's head_dim where it is not hidden_size / heads (Qwen3)

    @property
    def head_dim(self) -> int:
        return self.explicit_head_dim or self.hidden_size // self.num_attention_heads


# transformers' Qwen2Config class defaults, which differ from Qwen2-VL's text defaults above.
QWEN2_TEXT_DEFAULTS = TextConfig(vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
                                 num_attention_heads=32, num_key_value_heads=32, rms_norm_eps=1e-6,
                                 rope_theta=10_000.0, mrope_section=(64, 0, 0), max_position_embeddings=32768)


@dataclass(frozen=True)
class VisionConfig:
    depth: int = 32
    embed_dim: int = 1280
    num_heads: int = 16
    mlp_ratio: float = 4
    hidden_size: int = 3584  # the projector's output width = the language model's hidden size
    in_channels: int = 3
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    hidden_act: str = "quick_gelu"
    rope_theta: float = 10_000.0
    intermediate_size: int | None = None  # Qwen2.5-VL's SwiGLU width; Qwen2-VL's MLP is embed_dim x mlp_ratio
    window_size: int = 0  # Qwen2.5-VL: blocks attend within windows of this many pixels a side (0: no windows)
    fullatt_block_indexes: tuple[int, ...] = ()  # Qwen2.5-VL: the blocks that attend over whole frames
    tokens_per_second: float = 0  # Qwen2.5-VL: a video's M-RoPE time ids per second of clip (0: one per patch)
    num_position_embeddings: int = 0  # Qwen3-VL: a learned square grid of position embeddings, resampled per image
    deepstack_visual_indexes: tuple[int, ...] = ()  # Qwen3-VL: blocks whose outputs feed the first decoder layers

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads

    @property
    def mlp_dim(self) -> int:
        return self.intermediate_size or int(self.embed_dim * self.mlp_ratio)


# transformers' Qwen2_5_VLVisionConfig class defaults, in nanomm's names (its hidden_size is our embed_dim, its
# out_hidden_size our hidden_size).
QWEN2_5_VISION_DEFAULTS = VisionConfig(depth=32, embed_dim=3584, num_heads=16, hidden_size=3584, hidden_act="silu",
                                       intermediate_size=3420, window_size=112, fullatt_block_indexes=(7, 15, 23, 31),
                                       tokens_per_second=4)


# transformers' Qwen3VL class defaults, in nanomm's names.
QWEN3_TEXT_DEFAULTS = TextConfig(vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
                                 num_attention_heads=32, num_key_value_heads=32, rms_norm_eps=1e-6,
                                 rope_theta=500_000.0, mrope_section=(24, 20, 20), max_position_embeddings=128000,
                                 attention_bias=False,
                                 qk_norm=True, mrope_interleaved=True, explicit_head_dim=128)
QWEN3_VISION_DEFAULTS = VisionConfig(depth=27, embed_dim=1152, num_heads=16, hidden_size=3584, patch_size=16,
                                     hidden_act="gelu_pytorch_tanh", intermediate_size=4304,
                                     num_position_embeddings=2304, deepstack_visual_indexes=(8, 16, 24))
# transformers' Qwen3Config (the text-only Qwen3 family, draft models for Qwen3-VL).
QWEN3_TEXT_ONLY_DEFAULTS = replace(QWEN3_TEXT_DEFAULTS, rope_theta=10_000.0, max_position_embeddings=32768,
                                   mrope_interleaved=False)
TEXT_DEFAULTS = {"qwen2": QWEN2_TEXT_DEFAULTS, "qwen3_vl": QWEN3_TEXT_DEFAULTS,  # others: TextConfig()
                 "qwen3": QWEN3_TEXT_ONLY_DEFAULTS}
VISION_DEFAULTS = {"qwen2_5_vl": QWEN2_5_VISION_DEFAULTS, "qwen3_vl": QWEN3_VISION_DEFAULTS}  # others: VisionConfig()
NEWER_VISION_FIELDS = {"qwen2_5_vl": ("window_size", "fullatt_block_indexes", "tokens_per_second"),  # their own
                       "qwen3_vl": ("num_position_embeddings", "deepstack_visual_indexes")}


@dataclass(frozen=True)
class ModelConfig:
    text: TextConfig
    vision: VisionConfig | None  # None: a text-only Qwen2 checkpoint (no vision tower)
    model_type: str = "qwen2_vl"  # config.json's: which family, and so which vision tower (qwen2_vl.py)
    image_token_id: int = 151655
    video_token_id: int = 151656
    vision_start_token_id: int = 151652
    vision_end_token_id: int = 151653
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None  # the dtype the checkpoint was saved in (informational)

    @property
    def has_vision(self) -> bool:
        return self.vision is not None

    @classmethod
    def from_dict(cls, raw: dict) -> "ModelConfig":
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise CheckpointError(
                f"config.json has model_type={model_type!r}; nanomm serves Qwen2-VL ('qwen2_vl'), Qwen2.5-VL "
                f"('qwen2_5_vl'), Qwen3-VL ('qwen3_vl') and text-only Qwen2 or Qwen3 ('qwen2', 'qwen3', as "
                f"draft models) only"
            )
        text_raw = raw.get("text_config") or raw  # the original checkpoints keep text fields at the top level
        text = _parse_text_config(text_raw, model_type)
        vision = None
        if model_type not in TEXT_ONLY_TYPES:
            vision = _parse_vision_config(raw.get("vision_config") or {}, model_type)
            if vision.hidden_size != text.hidden_size:
                name = "hidden_size" if model_type == "qwen2_vl" else "out_hidden_size"
                raise CheckpointError(f"vision_config.{name}={vision.hidden_size} must equal the text "
                                      f"hidden_size={text.hidden_size}")
        tie = bool(raw.get("tie_word_embeddings", False) or text_raw.get("tie_word_embeddings", False))
        ids = {k: raw[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id",
                                   "vision_end_token_id") if k in raw}  # absent from qwen2: Qwen2-VL's ids
        eos = text_raw.get("eos_token_id", raw.get("eos_token_id"))
        return cls(text=text, vision=vision, model_type=model_type, tie_word_embeddings=tie,
                   eos_token_ids=_as_tuple(eos),
                   torch_dtype=raw.get("torch_dtype", raw.get("dtype", text_raw.get("dtype"))), **ids)

    @classmethod
    def from_pretrained(cls, folder) -> "ModelConfig":
        """Read `config.json`, and the end-of-sequence ids from `generation_config.json` when present."""
        folder = Path(folder)
        config = cls.from_dict(read_checkpoint_json(folder / "config.json"))
        eos = read_checkpoint_json(folder / "generation_config.json", required=False).get("eos_token_id")
        if eos is not None:
            config = replace(config, eos_token_ids=_as_tuple(eos))
        return config


def _parse_text_config(raw: dict, model_type: str) -> TextConfig:
    """The language model's fields; the ones `raw` lacks take the class defaults of `model_type`."""
    fields = {k: raw[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                  "num_attention_heads", "num_key_value_heads", "rms_norm_eps",
                                  "max_position_embeddings", "hidden_act", "attention_bias") if raw.get(k) is not None}
    if raw.get("head_dim") is not None:
        fields["explicit_head_dim"] = int(raw["head_dim"])
    if "num_key_value_heads" not in fields and "num_attention_heads" in fields:
        fields["num_key_value_heads"] = fields["num_attention_heads"]
    # rope lives in `rope_parameters` (new), `rope_scaling` + top-level `rope_theta` (original), or nowhere.
    rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise CheckpointError(f"rope type {rope_type!r} is not supported (nanomm computes plain RoPE and M-RoPE)")
    theta = rope.get("rope_theta", raw.get("rope_theta"))
    if theta is not None:
        fields["rope_theta"] = float(theta)
    if rope.get("mrope_section") is not None:
        fields["mrope_section"] = tuple(int(s) for s in rope["mrope_section"])
    if raw.get("use_sliding_window"):
        raise CheckpointError("sliding-window attention (use_sliding_window=true) is not supported")
    text = replace(TEXT_DEFAULTS.get(model_type, TextConfig()), **fields)
    if model_type in TEXT_ONLY_TYPES:
        # 1-D RoPE: M-RoPE with every band on the first axis. A stray mrope_section is ignored, as in transformers.
        text = replace(text, mrope_section=(text.head_dim // 2, 0, 0))
    if text.hidden_act != "silu":
        raise CheckpointError(f"text hidden_act={text.hidden_act!r} is not supported (Qwen2 uses 'silu')")
    if sum(text.mrope_section) * 2 != text.head_dim:
        raise CheckpointError(f"mrope_section {text.mrope_section} must sum to head_dim/2 = {text.head_dim // 2}")
    return text


def _parse_vision_config(raw: dict, model_type: str) -> VisionConfig:
    """The tower's fields, in nanomm's names. The trap: Qwen2.5-VL's `hidden_size` is the tower's own width (Qwen2-VL
    calls it embed_dim) and its `out_hidden_size` the language model's (Qwen2-VL's `hidden_size`)."""
    same = ["depth", "num_heads", "in_channels", "patch_size", "temporal_patch_size", "spatial_merge_size",
            "hidden_act"]  # the same name in every family
    if model_type == "qwen2_vl":
        same += ["embed_dim", "hidden_size", "mlp_ratio"]
        keys = {}
    else:  # their config name -> ours
        same += ["intermediate_size", *NEWER_VISION_FIELDS[model_type]]
        keys = {"hidden_size": "embed_dim", "out_hidden_size": "hidden_size"}
    keys.update({k: k for k in same})
    fields = {ours: raw[theirs] for theirs, ours in keys.items() if raw.get(theirs) is not None}
    for name in ("fullatt_block_indexes", "deepstack_visual_indexes"):
        if name in fields:
            fields[name] = tuple(int(i) for i in fields[name])
    rope = raw.get("rope_parameters") or {}
    if rope.get("rope_type", "axial") != "axial":
        raise CheckpointError(f"vision rope_type={rope['rope_type']!r} is not supported (Qwen2-VL uses 'axial')")
    if rope.get("rope_theta") is not None:
        fields["rope_theta"] = float(rope["rope_theta"])
    vision = replace(VISION_DEFAULTS.get(model_type, VisionConfig()), **fields)
    if vision.hidden_act not in ("quick_gelu", "gelu", "gelu_pytorch_tanh", "silu"):
        raise CheckpointError(f"vision hidden_act={vision.hidden_act!r} is not supported")
    if vision.head_dim % 4:
        raise CheckpointError(f"vision head_dim={vision.head_dim} must be a multiple of 4 (2-D rotary)")
    return vision


def read_checkpoint_json(path: Path, required: bool = True) -> dict:
    """A JSON object from a checkpoint folder. A missing file is a CheckpointError if required, else {}; a file
    that is not a JSON object is always a CheckpointError."""
    if not required and not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{path.parent} is not a Qwen2-VL or Qwen2 checkpoint: it has no {path.name}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"cannot read {path} as JSON: {exc}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _as_tuple(value) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(int(v) for v in value) if isinstance(value, (list, tuple)) else (int(value),)

