"""Causal self-attention of one sequence, the one definition that the dense reference, the engine and training use.

Lesson: lessons/04-paged-kv-cache.md (where the keys and values come from).

A language-model layer hands its rotated q, k, v to an *attention backend* (`AttentionBackend.attend`), which
decides where keys and values live: the dense reference keeps one contiguous cache per sequence (reference.py),
the engine a paged pool shared by many sequences (engine/attention.py). Whatever the backend, the arithmetic of
one sequence's attention is `causal_attention` below. The engine's batched forms (accel/batched_attention.py)
make the very same fused call, in the same layout, with more sequences in it: a sequence alone in the engine gets
the same bits as in the dense reference on every CPU, because the two run one kernel on the same tensors. (Two
forms that are equal in exact arithmetic need not be equal in float32: PyTorch's causal flag and an explicit mask
take different paths through the CPU's fused kernel, and two small matmuls are other kernels again. The
quantized layers round to bfloat16 (accel/quant.py), which turns a last-bit difference into a visible one.)
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
        return single_query_attention(q, k, v)
    new, total = q.shape[0], k.shape[0]
    # Query i sees keys up to total - new + i: lower-right causal, a whole sequence (new == total) included. An
    # explicit mask, as the engine's batched form passes, where the causal flag would let a fused kernel skip the
    # masked half: the price is new x total bytes, and no flash kernel on a GPU.
    return masked_attention(q, k, v, torch.ones(new, total, dtype=torch.bool, device=q.device).tril(total - new))


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Queries against keys where `allowed` (new, total) bool says which key each query may see. Also the
    training's packed chats, in one call (PackedCausalAttention). The call of `prefill_attention` for one run.

    q (new, heads, head_dim); k, v (total, kv_heads, head_dim) -> (new, heads, head_dim).
    """
    group = q.shape[1] // k.shape[1]  # grouped-query attention: each kv head serves `group` query heads
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    q = q.contiguous()  # a slice of the fused qkv projection; the engine's queries are gathered, so contiguous
    # (1, heads, tokens, head_dim): with a batch dimension PyTorch picks its fused (flash) CPU kernel; 3-D
    # inputs fall back to the unfused math path, ~3x slower at prefill sizes.
    q, k, v = (x.transpose(0, 1)[None] for x in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[None, None])  # (1, heads, new, head_dim)
    return out[0].transpose(0, 1)


def single_query_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Decode: one query that sees every key. The call of `batched_attention` for one decode: each KV head's query
    heads are one row block, (1, kv_heads, group, head_dim), against that head's keys, so k and v are not copied
    for GQA; an additive mask of zeros in the model's dtype, as the batch has.

    q (1, heads, head_dim); k, v (total, kv_heads, head_dim) -> (1, heads, head_dim).
    """
    heads, head_dim = q.shape[1], q.shape[2]
    kv_heads, total = k.shape[1], k.shape[0]
    queries = q.reshape(1, kv_heads, heads // kv_heads, head_dim)  # (1, kv_heads, group, head_dim)
    keys, values = (x.transpose(0, 1).contiguous()[None] for x in (k, v))  # (1, kv_heads, total, head_dim)
    visible = torch.zeros(1, 1, 1, total, dtype=q.dtype, device=q.device)
    out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=visible)  # (1, kv_heads, group, head_dim)
    return out.reshape(1, heads, head_dim)
