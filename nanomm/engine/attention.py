"""Attention over pages, for a step that mixes decode tokens and prefill chunks of different sequences.

Lesson: lessons/04-paged-kv-cache.md.

A step's new tokens arrive packed: sequence after sequence, no padding, (tokens, heads, head_dim). Each layer
first writes the new keys and values into their cache slots (`slot_mapping`), then, per sequence, gathers
that sequence's keys and values from its blocks and runs causal attention for its new queries. A query sees
its own sequence's cached tokens and the new tokens up to itself, and nothing of any other sequence.

Why gather + scaled_dot_product_attention per sequence: it is exact, runs the same on CPU and CUDA, and every
line can be read. The price is one small attention call per sequence per layer; a fused paged kernel
(vLLM's PagedAttention, FlashInfer) or FlexAttention with a block mask removes it, at the cost of a kernel
the reader cannot step through.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class SequenceSlice:
    query_start: int  # where this sequence's new tokens start in the packed batch
    query_len: int
    context_start: int  # where its slots start in StepMetadata.context_slots
    context_len: int  # all its tokens so far, the new ones included


@dataclass
class StepMetadata:
    slot_mapping: torch.Tensor  # (tokens,) the cache slot each new token's k/v is written to
    context_slots: torch.Tensor  # (sum of context_len,) every sequence's slots, sequence after sequence
    sequences: list[SequenceSlice]


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The last q.shape[0] positions of one sequence attend to every key up to and including their own.

    q (new, heads, head_dim); k, v (total, kv_heads, head_dim) -> (new, heads, head_dim).
    """
    if q.shape[0] == 1:
        return _single_query_attention(q, k, v)
    new, total = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]  # grouped-query attention: each kv head serves `group` query heads
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    # (1, heads, tokens, head_dim): with a batch dimension PyTorch picks its fused (flash) CPU kernel; 3-D
    # inputs fall back to the unfused math path, ~3x slower at prefill sizes.
    q, k, v = (x.transpose(0, 1)[None] for x in (q, k, v))
    if new == total:  # the whole sequence at once: plain causal
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    else:  # a chunk after cached tokens: query i sees keys up to total - new + i
        allowed = torch.ones(new, total, dtype=torch.bool, device=q.device).tril(total - new)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
    return out[0].transpose(0, 1)


def _single_query_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Decode: one query that sees every key, so no mask. Two small matmuls beat a fused attention call here,
    whose fixed cost dominates at this size (measured ~2x on CPU), and grouping the query heads by kv head
    avoids copying k and v for GQA."""
    heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = k.shape[1]
    q = q.view(kv_heads, heads // kv_heads, head_dim)  # (kv_heads, group, head_dim)
    scores = torch.matmul(q, k.permute(1, 2, 0)) * head_dim ** -0.5  # (kv_heads, group, total)
    probs = torch.softmax(scores.float(), dim=-1).to(v.dtype)
    out = torch.matmul(probs, v.transpose(0, 1))  # (kv_heads, group, head_dim)
    return out.reshape(1, heads, head_dim)


class PagedAttention:
    """The attention backend of one engine step (see `qwen2.AttentionBackend`)."""

    def __init__(self, kv_cache: torch.Tensor, metadata: StepMetadata):
        self.kv_cache = kv_cache  # (layers, 2, slots, kv_heads, head_dim)
        self.meta = metadata

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        keys, values = self.kv_cache[layer]  # (slots, kv_heads, head_dim) each
        keys.index_copy_(0, self.meta.slot_mapping, k)
        values.index_copy_(0, self.meta.slot_mapping, v)
        # One gather for the whole step; each sequence then reads a contiguous slice of it.
        context_keys = keys.index_select(0, self.meta.context_slots)  # (sum of contexts, kv_heads, head_dim)
        context_values = values.index_select(0, self.meta.context_slots)
        out = torch.empty_like(q)
        for seq in self.meta.sequences:
            rows = slice(seq.query_start, seq.query_start + seq.query_len)
            context = slice(seq.context_start, seq.context_start + seq.context_len)
            out[rows] = causal_attention(q[rows], context_keys[context], context_values[context])
        return out
