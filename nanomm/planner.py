"""The KV budget planner: how many requests fit, from a checkpoint's config alone (no weights are loaded).

Lesson: lessons/04-paged-kv-cache.md ("Plan the pool before you buy the GPU").

    nanomm-plan Qwen/Qwen2-VL-2B-Instruct --device-memory 80 --max-pixels 1003520
    nanomm-plan checkpoints/small --kv-cache-memory 2 --images 2 --json
    nanomm-plan Qwen/Qwen2-VL-2B-Instruct --device-memory 80 --videos 1 --video-seconds 20 --video-size 448x448

The arithmetic, in the order a request meets it:
1. **Visual tokens per image.** smart_resize (inputs/image.py) bounds an image by `max_pixels`; the worst case
   is the largest token count any image can produce under that cap, found by trying the image shapes that
   reach it, each through smart_resize itself. A thin image can beat max_pixels / 784: a side is never cut
   below 28 pixels, so at a small cap a 200:1 strip gets more tokens than the cap's area allows.
   **Visual tokens per video** (lesson 17): a clip of S seconds at F frames a second has round(S x F) frames
   (at least one), padded to an even count; each pair is a temporal patch with the tokens of one picture of
   the frame's size under the same cap (a per-frame cap: inputs/video.py), compressed as one. A 20 s clip at
   2 fps of 448x448 frames: 40 frames, 20 temporal patches x 16 x 16 = 5,120 tokens. Qwen3-VL samples the clip
   at 2 frames a second, bounds the whole clip's pixels, and adds each patch's time as text
   (inputs/video_settings.py).
2. **Tokens per request** = prompt text + per image or video (visual tokens + <|vision_start|> + <|vision_end|>)
   + output.
   The KV cache holds every token but the last: the final output token is sampled and never fed back.
3. **KV bytes per token** = 2 (k and v) x layers x KV heads x head_dim x bytes per element.
4. **Blocks per request** = ceil(KV tokens / block_size); **concurrency** = KV blocks // blocks per request,
   capped by max_num_seqs. The scheduler grows block tables a step at a time and preempts the newest request
   when the pool runs dry, so this is the number of requests that hold their whole length at once.
5. **The pool** is sized by the rule `LLM` uses (engine/sizing.py, shared): on a GPU, utilisation x memory,
   less what is already used (the weights, here), less an activation reserve (here an estimate: at least 1 GiB,
   more when the vision tower's working set for the largest image or the worst decode step is larger, plus
   what the CUDA graphs of decode steps keep; `LLM` measures it instead, with a profiling pass,
   engine/memory_profile.py); on a CPU, a fixed budget.

The weights' bytes are counted on PyTorch's "meta" device: the real module tree, no memory.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import sys
from dataclasses import asdict, dataclass, field, replace

import torch

from nanomm.accel.batched_attention import MAX_BATCHED_QUERIES
from nanomm.engine.sizing import (ELEMENT_BYTES, GiB, estimated_reserve, image_tokens, kv_bytes_per_token,
                                  kv_pool_blocks, kv_pool_budget, worst_case_image)
from nanomm.errors import InvalidInputError, check_int, is_finite_number
from nanomm.inputs.compression import CompressionPolicy, kept_layout, parse_policy, policy_argument
from nanomm.inputs.image import MAX_ASPECT_RATIO, ImageProcessorConfig
from nanomm.model.config import ModelConfig
from nanomm.model.loader import DTYPES
from nanomm.accel.quant import quantized_layers, quantized_weight_bytes

KV_DTYPES = {**DTYPES, "fp8": torch.float8_e4m3fn}  # the model's dtypes, and an fp8 cache
# inputs/video_io.py's DEFAULT_FPS. That module (and its VideoLimits) is imported only where videos are planned: the
# engine logs a plan at start-up, and a pictures-only engine loads no video code (tests/test_runtime_imports.py).
DEFAULT_VIDEO_FPS = 2.0
CONFIG_FILES = ["config.json", "preprocessor_config.json", "video_preprocessor_config.json", "generation_config.json"]


@dataclass
class Workload:
    """What one request looks like, for planning."""
    images_per_request: int = 1
    prompt_tokens: int = 64  # text tokens, image placeholders not counted
    output_tokens: int = 256
    typical_image: tuple[int, int] = (1024, 768)  # (width, height): a photo shrunk for the web
    videos_per_request: int = 0
    video_seconds: float = 0.0  # each clip's length: > 0 when there are videos
    video_fps: float = DEFAULT_VIDEO_FPS  # frames a second, as sent (the engine keeps every frame it is sent)
    video_size: tuple[int, int] | None = None  # (width, height) of every frame; None: the cap's worst-case frame

    def __post_init__(self):
        if check_int(self.videos_per_request, "videos_per_request", minimum=0, error=InvalidInputError) == 0:
            return  # the video fields are not used
        from nanomm.inputs.video_io import VideoLimits

        max_fps = VideoLimits().max_fps  # what load_video accepts
        if not is_finite_number(self.video_fps) or not 0 < self.video_fps <= max_fps:
            raise InvalidInputError(f"video fps must be a number in (0, {max_fps:g}] (VideoLimits.max_fps), "
                                    f"got {self.video_fps!r}")
        if not is_finite_number(self.video_seconds) or self.video_seconds <= 0:
            raise InvalidInputError(f"video seconds must be a number > 0, got {self.video_seconds!r}")
        if self.video_size is not None:
            width, height = self.video_size
            check_int(width, "video width", error=InvalidInputError)
            check_int(height, "video height", error=InvalidInputError)

    @property
    def video_frames(self) -> int:
        """Frames in each clip: seconds x fps, rounded half up, at least one (padding to temporal patches aside)."""
        return video_frames(self.video_seconds, self.video_fps) if self.videos_per_request else 0


@dataclass
class Plan:
    model: str
    dtype: str
    quantization: str | None  # of the language model's weights: None, "int8" or "int4"
    kv_dtype: str
    compression: CompressionPolicy | None  # visual-token compression (inputs/compression.py)
    min_pixels: int
    max_pixels: int
    block_size: int
    max_num_seqs: int
    max_model_len: int
    workload: Workload
    worst_image: tuple[int, int]  # (width, height) of an image that reaches the worst case
    visual_tokens_worst: int  # per image
    visual_tokens_typical: int
    video_temporal_patches: int  # per video: frames padded to whole temporal patches, over temporal_patch_size
    worst_video_frame: tuple[int, int]  # (width, height) of a frame that reaches the most tokens a patch
    video_frame_tokens_worst: int  # per temporal patch of a worst-case frame (compressed as a picture, if a policy)
    video_frame_tokens_typical: int  # per temporal patch at workload.video_size (the worst without one)
    video_tokens_worst: int  # per video: temporal patches x frame tokens; 0 without videos
    video_tokens_typical: int
    kv_bytes_per_token: int
    kv_tokens_worst: int  # per request: the tokens whose KV is stored
    kv_tokens_typical: int
    blocks_worst: int  # per request
    blocks_typical: int
    weights_bytes: int
    vision_peak_bytes: int  # the vision tower's working set for the worst-case image (an estimate: see below)
    decode_peak_bytes: int  # the worst decode step's working set (an estimate: `decode_step_bytes`)
    decode_graph_bytes: int  # what CUDA graphs of decode steps keep (an estimate; 0 without them)
    max_seq_len_to_capture: int  # the longest context a decode graph covers (as the engine's argument)
    kv_budget_bytes: int
    num_kv_blocks: int
    fit_worst: int  # requests the KV pool holds at once, at their full length
    fit_typical: int
    concurrency_worst: int  # the same, capped by max_num_seqs: what the engine runs at once
    concurrency_typical: int
    budget_rule: str  # how the pool was sized, in words
    alternatives: list[dict] = field(default_factory=list)  # what a smaller cap, compression or quantization buys
    video_settings: object = field(default=None, repr=False)  # the VideoSettings planned with (None: the family's)

    @property
    def kv_memory_bytes(self) -> int:
        return self.num_kv_blocks * self.block_size * self.kv_bytes_per_token

    def to_json(self) -> dict:
        return {key: value for key, value in asdict(self).items() if key != "video_settings"} | {
            "kv_memory_bytes": self.kv_memory_bytes}


# ---------------------------------------------------------------------------------------------------------
# 1. Visual tokens


def video_frames(seconds: float, fps: float) -> int:
    """The frames of a clip of `seconds` at `fps`: rounded half up, and at least one (a clip shows a frame)."""
    return max(1, math.floor(seconds * fps + 0.5))


def video_token_counts(config: ModelConfig, image_config: ImageProcessorConfig,
                       workload: Workload, settings=None,
                       compression: CompressionPolicy | None = None) -> tuple[int, tuple[int, int], int, int, int]:
    """Per video: (temporal patches, the (width, height) of a frame that reaches the most tokens, visual tokens per
    patch at that size, at workload.video_size, and the text tokens the family adds inside the placeholder). Qwen2-VL and Qwen2.5-VL keep every frame and cap each
    one like a picture; Qwen3-VL samples 2 frames a second, caps the whole clip, and writes each patch's time
    ("<12.5 seconds>": a token per digit, "<", ".", " seconds", ">") between its own two markers.
    settings: the engine's video settings (None: the family's); a per-frame cap is the plan's image cap.
    compression: the engine's policy, which compresses each temporal patch as a picture (inputs/compression.py)."""
    if not workload.videos_per_request:
        return 0, (0, 0), 0, 0, 0
    from nanomm.inputs.video_settings import VideoSettings

    settings = settings or VideoSettings.for_model(config.model_type, image_config)
    if settings.rules == "qwen2":
        settings = replace(settings, pixels=image_config)
    fps, T = workload.video_fps, image_config.temporal_patch_size
    kept = settings.frame_indices(workload.video_frames, fps, "the planned video")
    patches = -(-len(kept) // T)
    if settings.rules == "qwen2":
        worst_frame, worst = worst_case_image(image_config, compression)
        typical = image_tokens(*workload.video_size, image_config, compression) if workload.video_size else worst
        return patches, worst_frame, worst, typical, 0

    def frame_tokens(width: int, height: int) -> int:
        h_bar, w_bar = settings.resized(len(kept), height, width, "the planned video")
        return kept_layout((1, h_bar // settings.pixels.factor, w_bar // settings.pixels.factor), compression)[0]

    worst, worst_frame = max((frame_tokens(w, h), (w, h)) for w, h in clip_frame_candidates(settings, len(kept)))
    typical = frame_tokens(*workload.video_size) if workload.video_size else worst
    # "<12.5 seconds>" is a token per character of "12.5", then "<", " seconds" and ">"; then the patch's two markers
    text = sum(len(f"{seconds:.1f}") + 3 + 2 for seconds in settings.timestamps(kept, fps))
    return patches, worst_frame, worst, typical, text


def clip_frame_candidates(settings, num_frames: int) -> list[tuple[int, int]]:
    """Frame sizes that may reach the most tokens under a clip budget (Qwen3-VL): whole tokens filling the frame's
    share of the budget, and strips at the largest aspect ratio, whose floor of one token a side can exceed it."""
    f = settings.pixels.factor
    t_bar = max(settings.pixels.temporal_patch_size, round(num_frames / settings.pixels.temporal_patch_size)
                * settings.pixels.temporal_patch_size)
    cap = max(1, settings.pixels.max_pixels // (min(t_bar, num_frames) * f * f))
    candidates = [(min(cap // a, a * int(MAX_ASPECT_RATIO)) * f, a * f) for a in range(1, math.isqrt(cap) + 1)]
    return candidates + [(int(height * MAX_ASPECT_RATIO), height) for height in (32, 64, 128)]


def request_kv_tokens(visual_tokens_per_image: int, workload: Workload, visual_tokens_per_video: int = 0) -> int:
    """Tokens a request holds in the KV cache at its longest: all but the last output token."""
    per_image = visual_tokens_per_image + 2  # <|vision_start|> pads <|vision_end|>
    per_video = visual_tokens_per_video + 2  # <|vision_start|> <|video_pad|> x N <|vision_end|>
    return (workload.prompt_tokens + workload.images_per_request * per_image
            + workload.videos_per_request * per_video + workload.output_tokens - 1)


# ---------------------------------------------------------------------------------------------------------
# 2. Memory


def meta_model(config: ModelConfig):
    """The model nanomm builds from this config, on the meta device (shapes only, no memory used)."""
    from nanomm.model.qwen2_vl import Qwen2VL  # the model code, only to read its shapes

    with torch.device("meta"):
        return Qwen2VL(config)


def parameter_count(config: ModelConfig) -> int:
    """Parameters of the model nanomm builds from this config."""
    return sum(p.numel() for p in meta_model(config).parameters())  # a tied head is one tensor, counted once


def model_weight_bytes(config: ModelConfig, dtype: str, quantization: str | None = None,
                       num_parameters: int | None = None, group_size: int = 128) -> int:
    """Bytes of the weights as nanomm holds them: every parameter in dtype, except that quantization
    (accel/quant.py) stores the language model's linear layers and the LM head as int8 codes with a bfloat16
    scale per row, or int4 codes with a bfloat16 scale and zero per group, and keeps a tied embedding as it is."""
    total = (num_parameters or parameter_count(config)) * ELEMENT_BYTES[dtype]
    if quantization is None:
        return int(total)
    model = meta_model(config)
    for layer in quantized_layers(model):  # the layers quantize_language_model replaces
        total += quantized_weight_bytes(layer.out_features, layer.in_features, quantization, group_size)
        if layer is not model.lm_head or not config.tie_word_embeddings:  # a tied head's matrix stays, embedding
            total -= layer.weight.numel() * ELEMENT_BYTES[dtype]  # the float matrix it replaces
    return int(total)


# ---------------------------------------------------------------------------------------------------------
# 3. The plan


def make_plan(config: ModelConfig, image_config: ImageProcessorConfig, *, model: str = "model",
              dtype: str = "bfloat16", kv_dtype: str = "auto", block_size: int = 16, max_num_seqs: int = 64,
              max_model_len: int | None = None, workload: Workload | None = None,
              device_memory_gib: float | None = None, gpu_memory_utilization: float = 0.9,
              kv_cache_memory_gib: float | None = None, num_kv_blocks: int | None = None,
              quantization: str | None = None, quantization_group_size: int = 128, num_parameters: int | None = None,
              visual_token_compression=None, alternatives: bool = True, cuda_graphs: bool = True,
              max_seq_len_to_capture: int = 8192, video_settings=None) -> Plan:
    """Plan the KV pool for a workload: on a GPU of device_memory_gib, in a fixed kv_cache_memory_gib, or in a
    pool already decided (num_kv_blocks: a running engine's); else the CPU default.
    quantization: None, "int8" or "int4" (the weights, model_weight_bytes), int4 in groups of quantization_group_size.
    num_parameters: the model's, if already counted (parameter_count). visual_token_compression: the engine's policy
    ({"method": .., "keep_ratio": ..}, inputs/compression.py), which every image's tokens go through.
    cuda_graphs, max_seq_len_to_capture: on a GPU, as `LLM(enforce_eager=not cuda_graphs, ...)` would run.
    video_settings: the engine's (inputs/video_settings.py `VideoSettings`); None: the family's defaults."""
    workload = workload or Workload()
    if workload.videos_per_request:
        from nanomm.engine.engine import VIDEO_FAMILIES  # the families whose video path the engine serves

        if config.model_type not in VIDEO_FAMILIES:
            raise InvalidInputError(f"videos are served for {', '.join(VIDEO_FAMILIES)} models only so far, "
                                    f"not {config.model_type}")
    compression = parse_policy(visual_token_compression)
    kv_dtype = dtype if kv_dtype == "auto" else kv_dtype
    max_model_len = max_model_len or config.text.max_position_embeddings
    worst_image, worst = worst_case_image(image_config, compression)
    typical = image_tokens(*workload.typical_image, image_config, compression)
    text = config.text
    per_token = kv_bytes_per_token(text.num_hidden_layers, text.num_key_value_heads, text.head_dim,
                                   KV_DTYPES[kv_dtype], "fp8" if kv_dtype == "fp8" else "auto")
    patches, worst_frame, frame_worst, frame_typical, video_text = video_token_counts(config, image_config, workload,
                                                                                      video_settings, compression)
    video_worst, video_typical = patches * frame_worst, patches * frame_typical
    kv_worst = request_kv_tokens(worst, workload, video_worst + video_text)
    kv_typical = request_kv_tokens(typical, workload, video_typical + video_text)
    num_parameters = num_parameters or parameter_count(config)
    weights = model_weight_bytes(config, dtype, quantization, num_parameters, quantization_group_size)
    reserve = estimated_reserve(config, image_config, dtype, kv_dtype, max_num_seqs, max_model_len, block_size,
                                cuda_graphs and device_memory_gib is not None, max_seq_len_to_capture)
    if num_kv_blocks is None:
        device = "cuda" if device_memory_gib is not None else "cpu"
        budget, rule = kv_pool_budget(device, total_bytes=int((device_memory_gib or 0) * GiB), used_bytes=weights,
                                      gpu_memory_utilization=gpu_memory_utilization,
                                      kv_cache_memory_gib=kv_cache_memory_gib,
                                      reserve_bytes=reserve.total_bytes)
        num_kv_blocks = kv_pool_blocks(budget, block_size * per_token, max_num_seqs, max_model_len, block_size)
        if num_kv_blocks < budget // (block_size * per_token):
            rule += "; capped at max_num_seqs x max_model_len"
    else:
        budget, rule = num_kv_blocks * block_size * per_token, f"num_kv_blocks={num_kv_blocks}, given"
    plan = Plan(model=model, dtype=dtype, quantization=quantization, kv_dtype=kv_dtype,
                compression=compression, min_pixels=image_config.min_pixels,
                max_pixels=image_config.max_pixels, block_size=block_size, max_num_seqs=max_num_seqs,
                max_model_len=max_model_len, workload=workload, worst_image=worst_image, visual_tokens_worst=worst,
                visual_tokens_typical=typical, video_temporal_patches=patches,
                worst_video_frame=worst_frame, video_frame_tokens_worst=frame_worst, video_frame_tokens_typical=frame_typical,
                video_tokens_worst=video_worst, video_tokens_typical=video_typical, kv_bytes_per_token=per_token,
                kv_tokens_worst=kv_worst, kv_tokens_typical=kv_typical, blocks_worst=0, blocks_typical=0,
                weights_bytes=weights,
                vision_peak_bytes=reserve.vision_peak_bytes, decode_peak_bytes=reserve.decode_peak_bytes,
                decode_graph_bytes=reserve.decode_graph_bytes,
                max_seq_len_to_capture=max_seq_len_to_capture,
                kv_budget_bytes=budget, num_kv_blocks=num_kv_blocks,
                fit_worst=0, fit_typical=0, concurrency_worst=0, concurrency_typical=0, budget_rule=rule,
                video_settings=video_settings)
    _count_requests(plan)
    if alternatives:
        pool = dict(device_memory_gib=device_memory_gib, gpu_memory_utilization=gpu_memory_utilization,
                    kv_cache_memory_gib=kv_cache_memory_gib)
        if num_kv_blocks is not None and device_memory_gib is None and kv_cache_memory_gib is None:
            pool["kv_cache_memory_gib"] = plan.kv_memory_bytes / GiB  # a given pool keeps its bytes
        plan.alternatives = _alternatives(config, image_config, plan, pool, num_parameters, quantization_group_size)
    return plan


def _count_requests(plan: Plan) -> None:
    """Blocks per request and the requests that fit, from the plan's KV tokens and pool."""
    plan.blocks_worst = -(-plan.kv_tokens_worst // plan.block_size)
    plan.blocks_typical = -(-plan.kv_tokens_typical // plan.block_size)
    plan.fit_worst = plan.num_kv_blocks // plan.blocks_worst
    plan.fit_typical = plan.num_kv_blocks // plan.blocks_typical
    plan.concurrency_worst = min(plan.max_num_seqs, plan.fit_worst)
    plan.concurrency_typical = min(plan.max_num_seqs, plan.fit_typical)


def _alternatives(config, image_config, plan: Plan, pool: dict, num_parameters: int,
                  quantization_group_size: int) -> list[dict]:
    """What each lever would buy, one change at a time: a smaller cap, visual-token compression
    (inputs/compression.py), an fp8 KV cache (engine/kv_fp8.py), int8/int4 weights (accel/quant.py)."""
    same = dict(model=plan.model, dtype=plan.dtype, quantization=plan.quantization, kv_dtype=plan.kv_dtype,
                visual_token_compression=plan.compression,
                block_size=plan.block_size, max_num_seqs=plan.max_num_seqs, max_model_len=plan.max_model_len,
                workload=plan.workload, quantization_group_size=quantization_group_size, num_parameters=num_parameters,
                alternatives=False, cuda_graphs=plan.decode_graph_bytes > 0,
                max_seq_len_to_capture=plan.max_seq_len_to_capture, video_settings=plan.video_settings, **pool)
    rows = []
    for tokens in (4096, 1280, 256, 64):  # visual-token caps people use, below the current one
        max_pixels = tokens * image_config.factor**2
        if max_pixels < plan.max_pixels:
            cap = replace(image_config, max_pixels=max_pixels, min_pixels=min(image_config.min_pixels, max_pixels))
            rows.append(_row(f"max_pixels {max_pixels:,} ({tokens} tok)", make_plan(config, cap, **same)))
    if plan.compression is None:
        for method, ratio in (("prune", 0.5), ("pool", 0.25)):
            policy = {"visual_token_compression": {"method": method, "keep_ratio": ratio}}
            rows.append(_row(f"{method}, keep {ratio:.0%} of visual tokens", make_plan(config, image_config,
                                                                                     **(same | policy))))
    if plan.kv_dtype != "fp8":
        rows.append(_row("fp8 KV cache", make_plan(config, image_config, **(same | {"kv_dtype": "fp8"}))))
    if pool["device_memory_gib"] is not None:  # smaller weights leave more of the GPU to the KV pool
        for method in ("int8", "int4"):
            if method != plan.quantization:
                quantized = make_plan(config, image_config, **(same | {"quantization": method}))
                rows.append(_row(f"{method} weights", quantized))
    return rows


def _row(change: str, p: Plan) -> dict:
    return {"change": change, "visual_tokens_worst": p.visual_tokens_worst, "video_tokens_worst": p.video_tokens_worst,
            "blocks_worst": p.blocks_worst, "num_kv_blocks": p.num_kv_blocks, "fit_worst": p.fit_worst,
            "fit_typical": p.fit_typical}


# ---------------------------------------------------------------------------------------------------------
# 4. Showing it


def _gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


def _video_lines(plan: Plan) -> list[tuple[str, str]]:
    """The per-video row, when the workload has videos."""
    w = plan.workload
    if not w.videos_per_request:
        return []
    width, height = plan.worst_video_frame
    patches = plan.video_temporal_patches
    at_size = (f"{patches:,} x {plan.video_frame_tokens_typical:,} at {w.video_size[0]}x{w.video_size[1]}"
               if w.video_size else "no frame size given: the worst")
    return [("visual tokens per video", f"worst {plan.video_tokens_worst:,} ({patches:,} temporal patches x "
                                        f"{plan.video_frame_tokens_worst:,}, frames of {width}x{height}), "
                                        f"typical {plan.video_tokens_typical:,} ({at_size})")]


def _video_warnings(plan: Plan) -> list[tuple[str, str]]:
    """Clips that load_video refuses (VideoLimits, inputs/video_io.py): the plan counts them, the engine does not."""
    w, frames = plan.workload, plan.workload.video_frames
    if not frames:
        return []
    from nanomm.inputs.video_io import VideoLimits

    limits = VideoLimits()
    rows = []
    if frames > limits.max_frames:
        rows.append(("warning", f"a clip of {frames:,} frames is over the limit of {limits.max_frames:,} "
                                f"(VideoLimits.max_frames): the engine refuses it"))
    clips = [("worst-case", plan.worst_video_frame)] + ([("typical", w.video_size)] if w.video_size else [])
    for which, (width, height) in clips:
        if width * height > limits.max_frame_pixels:
            rows.append(("warning", f"a {which} frame of {width}x{height} is over the limit of "
                                    f"{limits.max_frame_pixels:,} pixels (VideoLimits.max_frame_pixels): "
                                    "the engine refuses it"))
        elif frames <= limits.max_frames and frames * width * height > limits.max_total_pixels:
            rows.append(("warning", f"a {which} clip of {frames:,} frames of {width}x{height} is over the limit "
                                    f"of {limits.max_total_pixels:,} pixels (VideoLimits.max_total_pixels): "
                                    "the engine refuses it"))
    return rows


def plan_lines(plan: Plan) -> list[tuple[str, str]]:
    """(what, value) pairs: the table's rows, and the lines the engine logs at start-up."""
    w = plan.workload
    width, height = plan.worst_image
    tw, th = w.typical_image
    visual_worst = plan.visual_tokens_worst * w.images_per_request + plan.video_tokens_worst * w.videos_per_request
    visual_typical = (plan.visual_tokens_typical * w.images_per_request
                      + plan.video_tokens_typical * w.videos_per_request)
    videos = (f"{w.videos_per_request} video(s) of {w.video_seconds:g} s at {w.video_fps:g} fps "
              f"({w.video_frames:,} frames), " if w.videos_per_request else "")
    return [
        ("model", f"{plan.model} ({plan.dtype} weights" + (f", {plan.quantization} language model"
                                                            if plan.quantization else "") + f", {plan.kv_dtype} KV)"),
        ("pixel cap", f"max_pixels={plan.max_pixels:,} min_pixels={plan.min_pixels:,}"
                      + (f", then {plan.compression.method} keeping {plan.compression.keep_ratio:.0%} of the tokens"
                         if plan.compression else "")),
        ("request", f"{w.images_per_request} image(s), {videos}{w.prompt_tokens} prompt + {w.output_tokens} "
                    "output tokens"),
        ("visual tokens per image", f"worst {plan.visual_tokens_worst:,} (a {width}x{height} image), "
                                    f"typical {plan.visual_tokens_typical:,} (a {tw}x{th} photo)"),
        *_video_lines(plan),
        ("visual tokens per request", f"worst {visual_worst:,}, typical {visual_typical:,}"),
        ("KV tokens per request", f"worst {plan.kv_tokens_worst:,}, typical {plan.kv_tokens_typical:,}"),
        ("KV bytes per token", f"{plan.kv_bytes_per_token:,}"),
        ("blocks per request", f"worst {plan.blocks_worst:,}, typical {plan.blocks_typical:,} "
                               f"(block_size {plan.block_size})"),
        ("weights", _gib(plan.weights_bytes)),
        ("vision peak, largest image", f"{_gib(plan.vision_peak_bytes)} (estimate)"),
        ("worst batched step", f"{_gib(plan.decode_peak_bytes)} (at most: {plan.max_num_seqs} x "
                               f"{MAX_BATCHED_QUERIES} queries, {plan.max_model_len:,} keys)"
                               + (f"; CUDA graphs keep {_gib(plan.decode_graph_bytes)}" if plan.decode_graph_bytes
                                  else "")),
        ("KV pool", f"{plan.num_kv_blocks:,} blocks = {_gib(plan.kv_memory_bytes)} ({plan.budget_rule})"),
        ("requests the pool holds", f"worst {plan.fit_worst:,}, typical {plan.fit_typical:,}"),
        ("concurrency", f"worst {plan.concurrency_worst:,}, typical {plan.concurrency_typical:,} "
                        f"(at most max_num_seqs {plan.max_num_seqs})"),
    ] + ([("warning", f"a worst-case request ({plan.kv_tokens_worst + 1:,} tokens) is longer than max_model_len "
                      f"{plan.max_model_len:,}: the engine refuses it")]
         if plan.kv_tokens_worst + 1 > plan.max_model_len else []) + _video_warnings(plan)


def render(plan: Plan, width: int = 118) -> str:
    """The plan as rich tables, in plain text."""
    from rich.console import Console
    from rich.table import Table

    console = Console(width=width, record=True, file=io.StringIO(), color_system=None)
    table = Table(title="KV budget plan", show_header=False)
    for what, value in plan_lines(plan):
        table.add_row(what, value)
    console.print(table)
    if plan.alternatives:
        alt = Table(title="What each lever buys, one change at a time")
        videos = bool(plan.workload.videos_per_request)  # a tokens/video column only for a workload with videos
        for column in ("change", "tokens/image", *(["tokens/video"] if videos else []), "blocks/request",
                       "KV blocks", "holds (worst)", "holds (typical)"):
            alt.add_column(column, justify="left" if column == "change" else "right")
        for row in [_row("(this plan)", plan), *plan.alternatives]:
            alt.add_row(row["change"], f"{row['visual_tokens_worst']:,}",
                        *([f"{row['video_tokens_worst']:,}"] if videos else []), f"{row['blocks_worst']:,}",
                        f"{row['num_kv_blocks']:,}", f"{row['fit_worst']:,}", f"{row['fit_typical']:,}")
        console.print(alt)
    return console.export_text()


# ---------------------------------------------------------------------------------------------------------
# 5. nanomm-plan


def load_configs(model: str, revision: str | None = None) -> tuple[ModelConfig, ImageProcessorConfig]:
    """The model and image-processor configs of a folder or hub id (a hub id downloads the JSON files only)."""
    from nanomm.model.loader import resolve_checkpoint

    folder = resolve_checkpoint(model, revision, allow_patterns=CONFIG_FILES)
    return ModelConfig.from_pretrained(folder), ImageProcessorConfig.from_pretrained(folder)


def load_video_settings(model: str, config: ModelConfig, image_config: ImageProcessorConfig,
                        revision: str | None = None):
    """The engine's video settings for a folder or hub id: the family's, then its video_preprocessor_config.json."""
    from nanomm.inputs.video_settings import VideoSettings
    from nanomm.model.config import read_checkpoint_json
    from nanomm.model.loader import resolve_checkpoint

    folder = resolve_checkpoint(model, revision, allow_patterns=CONFIG_FILES)
    return VideoSettings.for_model(config.model_type, image_config,
                                   read_checkpoint_json(folder / "video_preprocessor_config.json", required=False))


def parse_size(text: str) -> tuple[int, int]:
    width, sep, height = text.lower().partition("x")
    if not sep or not width.isdigit() or not height.isdigit() or int(width) < 1 or int(height) < 1:
        raise argparse.ArgumentTypeError(f"expected WIDTHxHEIGHT such as 1024x768, got {text!r}")
    return int(width), int(height)


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return int(text)


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


def _fps(text: str) -> float:
    from nanomm.inputs.video_io import VideoLimits

    value, max_fps = _positive_float(text), VideoLimits().max_fps
    if value > max_fps:
        raise argparse.ArgumentTypeError(f"expected at most {max_fps:g} frames a second (what load_video "
                                         f"accepts, VideoLimits.max_fps), got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nanomm-plan", description="Plan the KV memory of a Qwen2-VL deployment "
                                "from its config alone: visual tokens, blocks and concurrency.")
    p.add_argument("model", help="checkpoint folder or hub id (only its JSON files are read)")
    memory = p.add_mutually_exclusive_group()
    memory.add_argument("--device-memory", type=_positive_float, metavar="GIB", help="the GPU's memory, in GiB")
    memory.add_argument("--kv-cache-memory", type=_positive_float, metavar="GIB",
                        help="a fixed KV budget instead (default on CPU: 2)")
    p.add_argument("--gpu-memory-utilization", type=_positive_float, default=0.9)
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], help="default: bfloat16 with "
                   "--device-memory, else float32 (nanomm's CPU default)")
    p.add_argument("--kv-dtype", choices=["auto", "fp8"], default="auto", help="auto: the weights' dtype")
    p.add_argument("--quantization", choices=["int8", "int4"], help="the language model's weights (default: none)")
    p.add_argument("--compression", type=policy_argument, metavar="METHOD:RATIO",
                   help="visual-token compression, e.g. pool:0.25 or prune:0.5 (default: none)")
    p.add_argument("--max-pixels", type=_positive_int, help="default: the checkpoint's preprocessor config")
    p.add_argument("--min-pixels", type=_positive_int)
    p.add_argument("--images", type=int, default=1, help="images per request")
    p.add_argument("--prompt-tokens", type=_positive_int, default=64, help="text tokens per prompt")
    p.add_argument("--output-tokens", type=_positive_int, default=256)
    p.add_argument("--typical-image", type=parse_size, default=(1024, 768), metavar="WxH")
    p.add_argument("--videos", type=int, default=0, help="videos per request (default: none)")
    p.add_argument("--video-seconds", type=_positive_float, metavar="S", help="each clip's length (with --videos)")
    p.add_argument("--video-fps", type=_fps, default=DEFAULT_VIDEO_FPS, metavar="F",
                   help="frames a second sent (default: 2); frames = S x F rounded, padded to an even count")
    p.add_argument("--video-size", type=parse_size, metavar="WxH",
                   help="every frame's size (default: only the pixel cap's worst-case frame)")
    p.add_argument("--block-size", type=_positive_int, default=16)
    p.add_argument("--max-num-seqs", type=_positive_int, default=64)
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for decode steps (as LLM's switch)")
    p.add_argument("--revision")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from nanomm.errors import CheckpointError, InvalidInputError

    if args.images < 0:
        build_parser().error(f"--images must be >= 0, got {args.images}")
    if args.videos < 0:
        build_parser().error(f"--videos must be >= 0, got {args.videos}")
    if args.videos and args.video_seconds is None:
        build_parser().error("--videos needs --video-seconds, each clip's length")
    try:
        config, image_config = load_configs(args.model, args.revision)
        if not config.has_vision:
            raise CheckpointError(f"{args.model} is a text-only Qwen2 model; the planner plans Qwen2-VL")
        cap = {k: getattr(args, k) for k in ("min_pixels", "max_pixels") if getattr(args, k) is not None}
        image_config = replace(image_config, **cap)
        dtype = args.dtype or ("bfloat16" if args.device_memory is not None else "float32")
        plan = make_plan(config, image_config, model=args.model, dtype=dtype, kv_dtype=args.kv_dtype,
                         quantization=args.quantization, visual_token_compression=args.compression,
                         block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                         workload=Workload(args.images, args.prompt_tokens, args.output_tokens, args.typical_image,
                                           args.videos, args.video_seconds or 0.0, args.video_fps, args.video_size),
                         device_memory_gib=args.device_memory, gpu_memory_utilization=args.gpu_memory_utilization,
                         kv_cache_memory_gib=args.kv_cache_memory, cuda_graphs=not args.enforce_eager,
                         video_settings=load_video_settings(args.model, config, image_config, args.revision)
                         if args.videos else None)
    except (CheckpointError, InvalidInputError) as exc:
        print(f"nanomm-plan: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(plan.to_json(), indent=2) if args.json else render(plan), end="\n" if args.json else "")
    if plan.num_kv_blocks < plan.blocks_worst:
        print("nanomm-plan: the KV pool cannot hold even one worst-case request", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
