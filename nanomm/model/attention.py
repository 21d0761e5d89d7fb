"""Causal self-attention of one sequence, the one definition that the dense reference, the engine and training use.

Lesson: lessons/04-paged-kv-cache.md (where the keys and values come from).

A language-model layer hands its rotated q, k, v to an *attention backend* (`AttentionBackend.attend`), which
decides where keys and values live: the dense reference keeps one contiguous cache per sequence (reference.py),
the engine a paged pool shared by many sequences (engine/attention.py). Whatever the backend, the arithmetic of
one sequence's attention is `causal_attention` below: the dense reference uses it for every token, and the
engine for every prompt chunk, so that a prompt gets the same bits whatever the chunking. The engine's decodes
go through a batched form of it (accel/batched_attention.py), tested equal to it.
"""

from typing import Protocol

import torch
import torch.nn.functional as F


class AttentionBackend(Protocol):
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q (tokens, heads, head_dim), k/v (tokens, kv_heads, head_dim) -> (tokens, heads, head_dim)."""


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The last q.shape[0] positions of one sequence attend to every key up to and including their own.

    q (new, heads, head_dim); k, v (total, kv_heads, head_dim) -> (new, heads, head_dim).
    """
    if q.shape[0] == 1:
        return _single_query_attention(q, k, v)
    new, total = q.shape[0], k.shape[0]
    if new == total:  # the whole sequence at once: plain causal
        return masked_attention(q, k, v, None)
    # A chunk after cached tokens: query i sees keys up to total - new + i.
    return masked_attention(q, k, v, torch.ones(new, total, dtype=torch.bool, device=q.device).tril(total - new))


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
    """Queries against keys where `allowed` (new, total) bool says which key each query may see; None: causal
    over one whole sequence (new == total). Also the training's packed chats, in one call (PackedCausalAttention).

    q (new, heads, head_dim); k, v (total, kv_heads, head_dim) -> (new, heads, head_dim).
    """
    group = q.shape[1] // k.shape[1]  # grouped-query attention: each kv head serves `group` query heads
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    # (1, heads, tokens, head_dim): with a batch dimension PyTorch picks its fused (flash) CPU kernel; 3-D
    # inputs fall back to the unfused math path, ~3x slower at prefill sizes.
    q, k, v = (x.transpose(0, 1)[None] for x in (q, k, v))
    if allowed is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    else:
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
