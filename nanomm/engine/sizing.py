"""How big everything is, decided in one place: the KV pool, the encoder budget, the activation reserve (the
vision tower's and the batched attention's working sets) and the CUDA-graph buckets.

Lesson: lessons/04-paged-kv-cache.md, section 6 (plan the pool before you buy the GPU).

`LLM` sizes the engine it builds with `size_engine`; `nanomm-plan` (planner.py) predicts the same numbers from a
checkpoint's config alone, through the same functions, so the plan and the engine cannot disagree
(tests/test_planner.py holds them to it; a draft model's KV, which shares the engine's pool, is the engine's alone). The one difference is the reserve on a GPU: the plan estimates it from
arithmetic (`estimated_reserve`), the engine measures it with a profiling pass (engine/memory_profile.py), as
vLLM's profile run does. On a CPU the pool has a fixed budget and nothing is profiled.

The rule for the pool, in the order it is applied:
1. a fixed `kv_cache_memory_gib` if given; else on a GPU `gpu_memory_utilization` x its memory, less what is in
   use once the weights are loaded and less the activation reserve; else the CPU default (`kv_pool_budget`);
2. as many blocks as that holds, but no more than max_num_seqs sequences of max_model_len tokens can ever use
   (`kv_pool_blocks`), at `kv_bytes_per_token` (the target's and a draft model's, which share the pool).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from nanomm.accel.batched_attention import MAX_BATCHED_QUERIES, runs_per_slice
from nanomm.inputs.compression import CompressionPolicy, kept_layout
from nanomm.inputs.image import MAX_ASPECT_RATIO, ImageProcessorConfig, smart_resize
from nanomm.model.config import ModelConfig
from nanomm.model.fp8 import FP8, SCALE_DTYPE

GiB = 2**30
CPU_KV_CACHE_GIB = 2.0  # the KV pool on CPU when neither num_kv_blocks nor kv_cache_memory_gib is given
MIN_ACTIVATION_RESERVE = GiB  # GPU memory kept back from the KV pool for activations, at the least
ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}  # of weights and activations, by dtype name


# ---------------------------------------------------------------------------------------------------------
# The KV pool


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                       kv_cache_dtype: str = "auto") -> int:
    """Bytes one token's keys and values take in the pool: head_dim values per KV head per layer, twice; in fp8,
    one byte per value plus a bfloat16 scale per head."""
    if kv_cache_dtype == "fp8":
        return 2 * num_layers * num_kv_heads * (head_dim * FP8.itemsize + SCALE_DTYPE.itemsize)
    return 2 * num_layers * num_kv_heads * head_dim * dtype.itemsize


def kv_pool_budget(device_type: str, *, total_bytes: int = 0, used_bytes: int = 0,
                   gpu_memory_utilization: float = 0.9, kv_cache_memory_gib: float | None = None,
                   reserve_bytes: int = MIN_ACTIVATION_RESERVE) -> tuple[int, str]:
    """(bytes for the KV pool, the rule in words). `LLM` sizes its pool with this too."""
    if kv_cache_memory_gib is not None:
        return int(kv_cache_memory_gib * GiB), f"kv_cache_memory_gib={kv_cache_memory_gib:g}"
    if device_type == "cuda":
        budget = int(total_bytes * gpu_memory_utilization - used_bytes - reserve_bytes)
        return budget, (f"{gpu_memory_utilization:g} x {total_bytes / GiB:.1f} GiB, less {used_bytes / GiB:.2f} GiB "
                        f"in use and a {reserve_bytes / GiB:.2f} GiB activation reserve")
    return int(CPU_KV_CACHE_GIB * GiB), f"the CPU default of {CPU_KV_CACHE_GIB:g} GiB"


def kv_pool_blocks(budget_bytes: int, bytes_per_block: int, max_num_seqs: int, max_model_len: int,
                   block_size: int) -> int:
    """Blocks in the budget, capped at what max_num_seqs sequences of max_model_len tokens could ever use."""
    useful = max_num_seqs * -(-max_model_len // block_size)
    return max(0, min(budget_bytes // bytes_per_block, useful))


# ---------------------------------------------------------------------------------------------------------
# The activation reserve: the vision tower's worst image, the worst batched step, and the CUDA graphs


def image_tokens(width: int, height: int, config: ImageProcessorConfig,
                 compression: CompressionPolicy | None = None) -> int:
    """The visual tokens of one width x height image under config's cap (what the engine expands it to), after
    visual-token compression if a policy is given (inputs/compression.py)."""
    h_bar, w_bar = smart_resize(height, width, config.factor, config.min_pixels, config.max_pixels)
    return kept_layout((1, h_bar // config.factor, w_bar // config.factor), compression)[0]


def worst_case_image(config: ImageProcessorConfig,
                     compression: CompressionPolicy | None = None) -> tuple[tuple[int, int], int]:
    """((width, height), tokens) of an image with the most visual tokens any image can have under the cap (and the
    compression policy, if any).

    Candidates: exact multiples of the token size with a x b <= max_pixels / factor^2 (no resize happens, so the
    area is used to the last token), and strips at the largest allowed aspect ratio, at which smart_resize's
    floor of one token per side can exceed the area cap. Every candidate is measured by smart_resize itself."""
    f = config.factor
    cap = config.max_pixels // (f * f)  # whole tokens within the area cap
    candidates = []
    for a in range(1, math.isqrt(max(cap, 1)) + 1):
        b = min(cap // a, a * int(MAX_ASPECT_RATIO))
        if b >= a:
            candidates.append((b * f, a * f))
    for height in (1, 2, 4, 7, 14, 28, 56, 112):  # strips: the floor at one token can beat the area cap
        candidates.append((int(height * MAX_ASPECT_RATIO), height))
    scored = [(image_tokens(w, h, config, compression), (w, h)) for w, h in candidates]
    tokens, size = max(scored)
    return size, tokens


def vision_peak_bytes(config: ModelConfig, visual_tokens: int, dtype: str) -> int:
    """An estimate of the vision tower's largest working set while it encodes one image of visual_tokens.

    The image's patches arrive as float32 and are cast to the model's dtype; then the largest single step is a
    block's MLP: the residual, its LayerNorm, and fc1's output with the activation's two temporaries
    (quick_gelu is x * sigmoid(1.702 x)). Attention is not counted: scaled_dot_product_attention's fused
    kernels never hold the patches x patches score matrix. Measured peaks belong to the GPU check
    (issue: decode near the roofline); this is arithmetic."""
    vision = config.vision
    patches = visual_tokens * vision.spatial_merge_size**2
    patch_values = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    b = ELEMENT_BYTES[dtype]
    pixels = patches * patch_values * (4 + b)
    temporaries = 4 if vision.intermediate_size else 3  # SwiGLU (Qwen2.5-VL): gate, up, silu(gate), product
    mlp = patches * (2 * vision.embed_dim + temporaries * vision.mlp_dim) * b
    return int(pixels + mlp)


def decode_step_bytes(config: ModelConfig, batch: int, context: int, dtype: str, kv_dtype: str = "auto",
                      queries: int = 1) -> int:
    """An upper bound on what a step of `batch` short runs of `queries` tokens (decodes: 1), each attending to
    `context` keys, holds at once in the batched attention (accel/batched_attention.py, `BatchLayout`, which goes slice
    by slice when a step is large), plus its float32 logits. For the step: the visibility mask's source and the
    key rows. For a slice: its gathered keys and values and their int64 rows (an fp8 pool also dequantizes:
    1-byte codes and a float32 copy), the keys cast to float32, the float32 mask, scores and softmax, the
    probabilities in the model's dtype."""
    text, b = config.text, ELEMENT_BYTES[dtype]
    kv_heads, head_dim, heads = text.num_key_value_heads, text.head_dim, text.num_attention_heads
    runs = runs_per_slice(batch, context, kv_heads, head_dim, heads, queries)
    step = batch * queries * context * 4 + batch * kv_heads * context * 8 + batch * queries * text.vocab_size * 4
    gathered = 2 * runs * context * kv_heads * head_dim  # a slice's keys and values
    kv = gathered * (b + (1 + 4 if kv_dtype == "fp8" else 0)) + gathered // head_dim * 8
    float_keys = gathered // 2 * 4 if b != 4 else 0
    return int(step + kv + float_keys + runs * queries * heads * context * (3 * 4 + b))


@dataclass
class Reserve:
    """What the KV pool leaves for activations: the largest working set of any step, plus what CUDA graphs keep."""
    vision_peak_bytes: int  # the vision tower encoding the worst-case image
    decode_peak_bytes: int  # the worst batched step (every running sequence padded to the longest)
    decode_graph_bytes: int = 0  # the largest graph bucket's step and the graphs' logits buffer; 0 without graphs

    @property
    def total_bytes(self) -> int:
        return max(MIN_ACTIVATION_RESERVE, self.vision_peak_bytes, self.decode_peak_bytes) + self.decode_graph_bytes


def estimated_reserve(config: ModelConfig, image_config: ImageProcessorConfig, dtype: str, kv_dtype: str,
                      max_num_seqs: int, max_model_len: int, block_size: int, cuda_graphs: bool,
                      max_seq_len_to_capture: int) -> Reserve:
    """The reserve from arithmetic, for the plan (the engine measures it instead: engine/memory_profile.py)."""
    vision = vision_peak_bytes(config, worst_case_image(image_config)[1], dtype)  # the tower sees every token
    decode = decode_step_bytes(config, max_num_seqs, max_model_len, dtype, kv_dtype, MAX_BATCHED_QUERIES)
    graphs = 0
    if cuda_graphs:
        batch, context = largest_bucket(max_num_seqs, graph_context(max_model_len, max_seq_len_to_capture),
                                        block_size)
        graphs = decode_step_bytes(config, batch, context, dtype, kv_dtype) + batch * config.text.vocab_size * 4
    return Reserve(vision, decode, graphs)


# ---------------------------------------------------------------------------------------------------------
# CUDA-graph buckets (engine/cuda_graphs.py records one graph per bucket)


BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def batch_bucket(batch: int) -> int | None:
    """The smallest bucket that holds `batch` decodes; None past the largest."""
    return next((b for b in BATCH_BUCKETS if b >= batch), None)


def context_bucket(tokens: int, block_size: int, max_tokens: int | None = None) -> int:
    """Context tokens padded to a power of two of blocks, or to max_tokens' blocks if that is fewer."""
    blocks = -(-tokens // block_size)
    padded = 1 << (blocks - 1).bit_length()
    return block_size * (padded if max_tokens is None else min(padded, -(-max_tokens // block_size)))


def largest_bucket(max_num_seqs: int, max_context: int, block_size: int) -> tuple[int, int]:
    """(batch, context) of the largest graph an engine may record: what the memory profile runs."""
    return batch_bucket(max_num_seqs) or BATCH_BUCKETS[-1], context_bucket(max_context, block_size, max_context)


def graph_context(max_model_len: int, max_seq_len_to_capture: int) -> int:
    """The longest context a decode graph covers (the engine arguments of the same names)."""
    return min(max_model_len, max_seq_len_to_capture)


# ---------------------------------------------------------------------------------------------------------
# The engine's sizes


def size_engine(config, models: list, image_config: ImageProcessorConfig, profile_memory=None) -> tuple:
    """An `EngineConfig` with what depends on the loaded models filled in: the context length, the token and
    encoder budgets, and the KV pool (num_kv_blocks). models: the target, then a draft model if any (its KV
    shares the pool). profile_memory: on a GPU, the function that measures the activation reserve by running the
    model (`engine.memory_profile.profile_memory`, which `LLM` passes in: sizing runs nothing itself, and so
    imports nothing from accel/ that imports the engine back). Returns (that config, how the memory was split: a
    dict for `LLM.stats()`)."""
    model = models[0]
    max_model_len, token_budget = context_and_token_budget(config, model.config.text.max_position_embeddings)
    memory, num_kv_blocks = {}, config.num_kv_blocks
    if num_kv_blocks is None:
        per_block = config.block_size * sum(
            kv_bytes_per_token(m.config.text.num_hidden_layers, m.config.text.num_key_value_heads,
                               m.config.text.head_dim, m.dtype, config.kv_cache_dtype) for m in models)
        budget = _kv_budget(config, model, image_config, max_model_len, token_budget, memory, profile_memory)
        num_kv_blocks = kv_pool_blocks(budget, per_block, config.max_num_seqs, max_model_len, config.block_size)
        if num_kv_blocks < 1:
            raise ValueError("no memory left for the KV cache; lower the model size or raise "
                             "gpu_memory_utilization")
    return sized_config(config, max_model_len, token_budget, num_kv_blocks), memory


def context_and_token_budget(config, limit: int) -> tuple[int, int]:
    """(max_model_len, tokens a step) of an engine whose model knows `limit` positions."""
    max_model_len = config.max_model_len or limit
    if max_model_len > limit:  # positions past the trained range: the model was never taught them
        raise ValueError(f"max_model_len={max_model_len} is beyond this model's max_position_embeddings={limit}")
    token_budget = config.max_num_batched_tokens
    if not config.enable_chunked_prefill:  # every prompt must fit one step, as in vLLM
        token_budget = max(token_budget, max_model_len)
    return max_model_len, token_budget


def sized_config(config, max_model_len: int, token_budget: int, num_kv_blocks: int):
    """The config with its sizes filled in (the encoder's budget defaults to the step's)."""
    return replace(config, max_model_len=max_model_len, num_kv_blocks=num_kv_blocks,
                   max_num_batched_tokens=token_budget,
                   max_num_encoder_tokens=config.max_num_encoder_tokens or token_budget)


def _kv_budget(config, model, image_config: ImageProcessorConfig, max_model_len: int, token_budget: int,
               memory: dict, profile_memory) -> int:
    """Bytes for the KV pool (`kv_pool_budget`). On a GPU: what is free of the utilisation share once the weights
    are loaded, less the reserve that a profiling pass measures (engine/memory_profile.py): the activations of
    the engine's largest step (token_budget tokens against max_model_len), the worst image's encode, and, with
    CUDA graphs, what the largest graph's decode step keeps. Elsewhere: the fixed budget. How it was split
    lands in `memory`."""
    profiled = {}
    if model.device.type == "cuda" and config.kv_cache_memory_gib is None:
        if profile_memory is None:
            raise ValueError("sizing a GPU engine's KV pool needs the memory profile (size_engine's "
                             "profile_memory), or a fixed kv_cache_memory_gib")
        graphs = None if config.enforce_eager else largest_bucket(
            config.max_num_seqs, graph_context(max_model_len, config.max_seq_len_to_capture), config.block_size)
        profile = profile_memory(model, image_config, worst_case_image(image_config)[0], token_budget,
                                 config.max_num_seqs, max_model_len, graphs, config.block_size, config.kv_cache_dtype)
        profiled = dict(total_bytes=profile.total_bytes, used_bytes=profile.used_bytes,
                        reserve_bytes=profile.reserve_bytes)
        memory.update(profile.as_stats(), memory_activation_reserve_bytes=profile.reserve_bytes)
    budget, rule = kv_pool_budget(model.device.type, gpu_memory_utilization=config.gpu_memory_utilization,
                                  kv_cache_memory_gib=config.kv_cache_memory_gib, **profiled)
    memory.update(kv_budget_rule=rule, kv_budget_bytes=budget)
    return budget
