"""The models the emulated device knows: the real checkpoints' config files, shipped with the package (no weights),
and the shapes the cost model needs, read off the module tree nanomm would build (on the meta device).

Lesson: lessons/13-topologies.md (the emulated device).
"""

from pathlib import Path

import torch

from nanomm.emulate.costs import ModelShape
from nanomm.engine.sizing import kv_bytes_per_token
from nanomm.inputs.image import ImageProcessorConfig
from nanomm.model.config import ModelConfig

FOLDER = Path(__file__).parent / "models"
MODELS = {  # the name --emulate takes -> the hub id whose config.json and preprocessor_config.json are shipped
    "qwen2-vl-2b": "Qwen/Qwen2-VL-2B-Instruct",
    "qwen2.5-vl-3b": "Qwen/Qwen2.5-VL-3B-Instruct",
    "qwen3-vl-2b": "Qwen/Qwen3-VL-2B-Instruct",
}
WEIGHT_DTYPE = torch.bfloat16  # what the emulated GPU serves in


def model_folder(name: str) -> Path:
    return FOLDER / name


def load_configs(name: str) -> tuple[ModelConfig, ImageProcessorConfig]:
    folder = model_folder(name)
    return ModelConfig.from_pretrained(folder), ImageProcessorConfig.from_pretrained(folder)


def _params(module: torch.nn.Module, skip: tuple = ()) -> int:
    skipped = {id(p) for m in skip for p in m.parameters()}
    return sum(p.numel() for p in module.parameters() if id(p) not in skipped)


def model_shape(config: ModelConfig) -> ModelShape:
    """The cost model's view of a model: parameters a step multiplies (the decoder and the head; the embedding
    is a lookup), the tower's, widths, and the bytes a token's KV and a visual token take in bfloat16."""
    from nanomm.planner import meta_model  # the module tree on the meta device: shapes, no memory

    model = meta_model(config)
    lm = model.language_model
    lm_params = _params(lm, skip=(lm.embed_tokens,)) + model.lm_head.weight.numel()
    vision = config.vision
    size = WEIGHT_DTYPE.itemsize
    window = (vision.window_size // vision.patch_size) ** 2 if vision.window_size else 0
    full_blocks = len(vision.fullatt_block_indexes) if window else vision.depth
    text = config.text
    levels = 1 + len(vision.deepstack_visual_indexes)
    return ModelShape(
        lm_params=lm_params, lm_weight_bytes=lm_params * size, layers=text.num_hidden_layers,
        attention_width=text.num_attention_heads * text.head_dim,
        kv_bytes_per_token=kv_bytes_per_token(text.num_hidden_layers, text.num_key_value_heads, text.head_dim,
                                              WEIGHT_DTYPE),
        vision_params=_params(model.visual), vision_weight_bytes=_params(model.visual) * size,
        vision_depth=vision.depth, vision_width=vision.embed_dim, vision_window_patches=window,
        vision_full_blocks=full_blocks, visual_token_bytes=levels * text.hidden_size * size)
