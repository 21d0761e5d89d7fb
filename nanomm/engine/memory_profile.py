"""Size the KV pool on a GPU from measured memory: run the engine's largest steps once, before the pool exists.

Lesson: lessons/04-paged-kv-cache.md, section 6 (plan the pool before you buy the GPU).

Whatever the GPU holds besides the weights and the KV pool is activations: a prefill chunk's hidden states,
its MLP's intermediate, its attention's gathered context; the vision tower's working set while it encodes the
largest picture the cap allows (encoded whole, whatever the encoder budget); the batched attention's gathered
context and mask (and its scores, where the attention kernel writes them out), padded to the longest sequence
and the longest short run in the step (at worst max_num_seqs runs of MAX_BATCHED_QUERIES queries and
max_model_len keys). The planner estimates them from arithmetic (`sizing.estimated_reserve`). Here they are
measured: a forward pass of `max_num_batched_tokens` tokens attending to a context of `max_model_len`, an encode of the worst-case image and the worst batched step, with
the allocator's peak read before and after. With CUDA graphs on, a decode step at the largest graph bucket is
measured apart: the graphs' memory pool keeps what that step needs for as long as the engine lives, beside
whatever the other steps need, so the two add up. The pool then gets what is left of the utilisation share
(`sizing.kv_pool_budget`), as in vLLM's profile run. CUDA only; on a CPU the pool has a fixed budget and
nothing is profiled.
"""

from dataclasses import dataclass

import torch
from PIL import Image

from nanomm.accel.batched_attention import MAX_BATCHED_QUERIES, build_decode_batch
from nanomm.engine.cuda_graphs import StaticDecodeInputs, decode_forward
from nanomm.engine.attention import PagedAttention, StepMetadata
from nanomm.engine.kv_cache import allocate_kv_cache
from nanomm.inputs.image import ImageProcessorConfig, ProcessedImage, preprocess_image
from nanomm.model.attention import causal_attention
from nanomm.model.qwen2_vl import Qwen2VL
from nanomm.model.rope import text_positions


@dataclass
class MemoryProfile:
    total_bytes: int  # the device's memory
    used_bytes: int  # in use after the profile, its temporaries freed: weights, CUDA context, other processes
    activation_peak_bytes: int  # the most any profiled step held above the weights, eagerly
    decode_graph_bytes: int = 0  # what the decode graphs keep: the largest bucket's step, its inputs and logits

    @property
    def reserve_bytes(self) -> int:
        return self.activation_peak_bytes + self.decode_graph_bytes

    def as_stats(self) -> dict:
        return {"memory_total_bytes": self.total_bytes, "memory_used_bytes": self.used_bytes,
                "memory_activation_peak_bytes": self.activation_peak_bytes,
                "memory_decode_graph_bytes": self.decode_graph_bytes}


class _LongContextAttention:
    """An attention backend for the profile: each layer's queries attend to a context of `context` keys (the
    new keys repeated), so the gathered context and the score tiles are as large as the engine's worst step."""

    def __init__(self, context: int):
        self.context = context

    def attend(self, layer: int, q, k, v):
        repeats = -(-self.context // k.shape[0])
        keys, values = k.repeat(repeats, 1, 1)[-self.context:], v.repeat(repeats, 1, 1)[-self.context:]
        return causal_attention(q, keys, values)


def worst_case_pixels(image_config: ImageProcessorConfig, size: tuple[int, int]) -> ProcessedImage:
    """A blank picture of `size` (width, height) through the engine's own preprocessing: the patches and grid
    the vision tower would get."""
    return preprocess_image(Image.new("RGB", size), image_config)


def decode_step(model: Qwen2VL, batch: int, context: int, block_size: int, kv_cache_dtype: str = "auto",
                queries: int = 1):
    """A step of `batch` short query runs of `queries` tokens each (decodes: 1; speculative verifications and
    short prefill chunks: more, up to MAX_BATCHED_QUERIES), every run attending to `context` slots, through
    the batched attention (as a decode graph records it, `decode_forward`, for one query). Against a one-block
    stand-in cache: every run attends to `context` copies of slot 0, so each layer gathers as many keys and
    values, and masks and scores as many, as the real step would. Returns its logits (batch * queries, vocab)."""
    text, device = model.config.text, model.device
    cache = allocate_kv_cache(text.num_hidden_layers, 1, block_size, text.num_key_value_heads, text.head_dim,
                              model.dtype, device, kv_cache_dtype)
    if queries == 1:
        return decode_forward(model, cache, StaticDecodeInputs.allocate(batch, context, device))  # token 0, slot 0
    tokens = torch.zeros(batch * queries, dtype=torch.long, device=device)
    # The runner's own builder (model_runner.py), for runs of `queries` tokens packed one after another.
    short = build_decode_batch(list(range(0, batch * queries, queries)), [queries] * batch,
                               torch.zeros(batch, context, dtype=torch.long), [context] * batch).to(device)
    attention = PagedAttention(cache, StepMetadata(tokens, tokens[:0], [], short), text.num_attention_heads)
    hidden = model(tokens, torch.zeros(3, batch * queries, dtype=torch.long, device=device), attention)
    return model.compute_logits(hidden)


@torch.inference_mode()
def profile_memory(model: Qwen2VL, image_config: ImageProcessorConfig, worst_image: tuple[int, int],
                   max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int,
                   decode_graph_shape: tuple[int, int] | None = None, block_size: int = 16,
                   kv_cache_dtype: str = "auto") -> MemoryProfile:
    """Run the profile on the model's CUDA device; see the module docstring. decode_graph_shape: (batch,
    context) of the largest CUDA-graph bucket, or None without graphs."""
    device = model.device
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    tokens = min(max_num_batched_tokens, max_model_len)

    def prefill():
        hidden = model(torch.zeros(tokens, dtype=torch.long, device=device), text_positions(tokens).to(device),
                       _LongContextAttention(max_model_len))
        model.compute_logits(hidden[-min(tokens, max_num_seqs):])  # the rows that sample

    def encode():
        if model.visual is not None:
            image = worst_case_pixels(image_config, worst_image)
            # With the last layer's attention weights, which the "attention" compression method (lesson 10) needs.
            model.encode_images(image.pixel_values.to(device), [image.grid_thw], received_attention=True)

    # The worst batched step: every running sequence padded to the longest context, and to the longest short
    # run (one 16-token prefill tail or verification pads every decode beside it).
    def batched():
        context = -(-max_model_len // block_size) * block_size
        decode_step(model, max_num_seqs, context, block_size, kv_cache_dtype, MAX_BATCHED_QUERIES)

    peak = max(_peak_bytes(device, prefill), _peak_bytes(device, encode), _peak_bytes(device, batched))
    graph_bytes = 0
    if decode_graph_shape is not None:
        batch = decode_graph_shape[0]
        step = _peak_bytes(device, lambda: decode_step(model, *decode_graph_shape, block_size, kv_cache_dtype))
        # The step's peak (its inputs, the size of the graphs' shared input buffer, and a one-block stand-in cache
        # included), and the graphs' float32 logits buffer. A graph's warm-up runs the same step eagerly.
        graph_bytes = step + batch * model.config.text.vocab_size * 4
        peak = max(peak, step)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return MemoryProfile(total_bytes=total, used_bytes=total - free, activation_peak_bytes=peak,
                         decode_graph_bytes=graph_bytes)


def _peak_bytes(device, run) -> int:
    """The most `run()` held at once above what was allocated before it (its results freed after)."""
    torch.cuda.synchronize(device)
    start = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    run()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - start
