"""The dense reference generator: the simplest correct way to run Qwen2-VL, kept forever as the oracle.

One sequence, a contiguous KV cache that grows by concatenation, one token per step. No paging, no batching,
no caching across requests. The serving engine must produce exactly what this produces; this must produce
exactly what transformers produces (tests/test_model_parity.py).
"""

from dataclasses import dataclass, field

import torch

from nanomm.inputs.compression import encode_visual_tokens
from nanomm.inputs.prompt import placed_units
from nanomm.model.attention import causal_attention
from nanomm.model.fp8 import fp8_round_trip
from nanomm.model.qwen2_vl import Qwen2VL
from nanomm.model.rope import mrope_positions, text_positions, video_time_interval
from nanomm.sampling import SamplingParams, adjust_logits, sample


class ContiguousKVCache:
    """Keys and values of one sequence, position 0..n-1 in order, per layer. kv_cache_dtype="fp8" keeps them as
    they come back from an fp8 cache (engine/kv_fp8.py): rounded to float8 with their scales."""

    def __init__(self, num_layers: int, kv_cache_dtype: str = "auto"):
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.kv_cache_dtype = kv_cache_dtype

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.kv_cache_dtype == "fp8":
            k, v = fp8_round_trip(k), fp8_round_trip(v)
        if self.keys[layer] is not None:
            k = torch.cat([self.keys[layer], k])  # (past + new, kv_heads, head_dim)
            v = torch.cat([self.values[layer], v])
        self.keys[layer], self.values[layer] = k, v
        return causal_attention(q, k, v)


@dataclass
class ReferenceOutput:
    token_ids: list[int]
    finish_reason: str  # "stop" or "length"
    logits: list[torch.Tensor] = field(default_factory=list)  # raw float32 (vocab,) per generated token


def whole_media(units: list) -> list:
    """The pictures and videos of a prepared prompt, as the caller gave them: the engine splits each video into
    its temporal patches (inputs/prompt.py); here they are one clip again."""
    media = []
    for unit in units:
        video = getattr(unit, "video", None)  # a video's temporal patch (inputs/video.py `VideoGroup`)
        if video is None:
            media.append(unit)
        elif not media or media[-1] is not video:
            media.append(video)
    return media


def _placed_layout(unit, interval: float | None, packed):
    """mrope_positions' `compressed` entry for one placed run, from its item's encoded coordinates: a picture's as
    compression gave them; a clip's or a Qwen3-VL patch's from its own `layout` (inputs/video.py), the patch with
    its own share of its clip's coordinates."""
    if not getattr(unit, "is_video", False):
        return packed
    coords = None if packed is None else packed[1]
    if coords is not None and getattr(unit, "video", None) is not None:  # a temporal patch of a Qwen3-VL clip
        coords = coords[:, unit.index * unit.num_tokens:(unit.index + 1) * unit.num_tokens]
    return unit.layout(interval, coords)


@torch.inference_mode()
def generate(model: Qwen2VL, prompt_ids: list[int], images=(), params: SamplingParams | None = None,
             eos_token_ids=(), keep_logits: bool = False, kv_cache_dtype: str = "auto") -> ReferenceOutput:
    """Generate from an expanded prompt and its preprocessed images (`nanomm.inputs.image.ProcessedImage`) and
    videos (`nanomm.inputs.video.ProcessedVideo`), in prompt order, each
    image's visual tokens compressed by its policy (inputs/compression.py), if it has one.
    A quantized model (accel/quant.py) is its own reference: its layers are the quantized ones. kv_cache_dtype:
    "fp8" keeps the keys and values as an fp8 cache would return them."""
    params = params or SamplingParams(temperature=0.0)
    cfg, device = model.config, model.device
    images = whole_media(images)  # a video whole, as the model defines it: one encode, its positions
    image_embeds, compressed = None, None
    if images:
        visual = encode_visual_tokens(model, images)  # each image compressed by its own policy, if it has one
        image_embeds = torch.cat([v.embeds for v in visual], dim=-2)  # (tokens, hidden); DeepStack: (levels, ...)
        compressed = [None if v.coords is None else (im.position_extent, v.coords)
                      for v, im in zip(visual, images)]
    videos = any(getattr(im, "is_video", False) for im in images)
    visual_ids = {cfg.image_token_id} | ({cfg.video_token_id} if videos else set())  # prompt pads = its media
    if cfg.has_vision:
        placed, compressed = placed_units(images, compressed or [None] * len(images))  # Qwen3-VL: patch by patch
        intervals = [video_time_interval(m, cfg.vision.tokens_per_second) for m in placed]
        compressed = [_placed_layout(m, interval, packed) for m, interval, packed in zip(placed, intervals, compressed)]
        positions, delta = mrope_positions(prompt_ids, [tuple(m.grid_thw) for m in placed], cfg.image_token_id,
                                           cfg.vision.spatial_merge_size, compressed,
                                           video_token_id=cfg.video_token_id if videos else None,
                                           time_intervals=intervals)
    else:  # a text-only Qwen2 model: every token is text
        positions, delta = text_positions(len(prompt_ids)), 0
    kv_cache = ContiguousKVCache(cfg.text.num_hidden_layers, kv_cache_dtype)
    generator = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
    stop_ids = set(params.stop_token_ids or ()) | (set() if params.ignore_eos else set(eos_token_ids))

    ids = torch.tensor(prompt_ids, device=device)
    hidden = model(ids, positions.to(device), kv_cache, image_embeds,
                   torch.isin(ids, torch.tensor(sorted(visual_ids), device=device)))
    out = ReferenceOutput(token_ids=[], finish_reason="length")
    while True:
        raw = model.compute_logits(hidden[-1:])[0]  # a (1, hidden) row, as the engine computes it: not a gemv
        logits = raw
        if params.reads_history:  # penalties and min_tokens see the prompt and the output so far
            logits = adjust_logits(raw, params, prompt_ids, out.token_ids, stop_ids)
        token = sample(logits, params, generator)
        out.token_ids.append(token)
        if keep_logits:
            out.logits.append(raw)
        if token in stop_ids:
            out.finish_reason = "stop"
            return out
        if len(out.token_ids) >= params.token_limit:
            return out
        position = len(prompt_ids) + len(out.token_ids) - 1 + delta  # the same on all three axes
        hidden = model(torch.tensor([token], device=device), torch.full((3, 1), position, device=device), kv_cache)
