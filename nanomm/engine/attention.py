"""Attention over pages, for a step that mixes decode tokens and prefill chunks of different sequences.

Lesson: lessons/04-paged-kv-cache.md.

A step's new tokens arrive packed: sequence after sequence, no padding, (tokens, heads, head_dim). Each layer
first writes the new keys and values into their cache slots (`slot_mapping`), then, per sequence, gathers
that sequence's keys and values from its blocks and runs causal attention for its new queries. A query sees
its own sequence's cached tokens and the new tokens up to itself, and nothing of any other sequence.

Two ways to run it, with the same result:
- **Per sequence** (`causal_attention`): gather, then scaled_dot_product_attention for each sequence. It is the
  readable definition, and what long prefill chunks use (the fused kernel pays off there).
- **Batched** (`batched_attention`): every short run of queries in the step (decodes and speculative
  verifications) in one call per layer. Their context slots are padded into a (sequences, longest context)
  table, keys and values are gathered from the cache once, and a mask says which key each query may see
  (lower-right causal: query i of a run of q sees the first context_len - q + 1 + i keys). GQA groups the
  query heads by KV head instead of copying K and V, and scores and softmax are float32, as in prefill. A
  step of 32 decodes is then a handful of kernels per layer instead of 32 small attention calls; the price is
  the padding, which a fused paged kernel (vLLM's PagedAttention, FlashInfer) avoids.
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
class ShortQueries:
    """The step's short query runs (decodes, verifications), padded into one batch: built on the host by
    `batch_short_queries`, used by `batched_attention`."""
    query_rows: torch.Tensor  # (B, Q) packed row of each query; padding repeats the run's first row
    query_valid: torch.Tensor  # (B, Q) bool: a real query, not padding
    context_slots: torch.Tensor  # (B, L) cache slot of each context token; padding repeats slot 0 of the run
    allowed: torch.Tensor  # (B, Q, L) bool: which keys each query may see

    def to(self, device) -> "ShortQueries":
        return ShortQueries(*(t.to(device) for t in (self.query_rows, self.query_valid, self.context_slots,
                                                      self.allowed)))


@dataclass
class StepMetadata:
    slot_mapping: torch.Tensor  # (tokens,) the cache slot each new token's k/v is written to
    context_slots: torch.Tensor  # (sum of context_len,) the slots of the sequences in `sequences`, in order
    sequences: list[SequenceSlice]  # attended one by one (long prefill chunks; all of them without `short`)
    short: ShortQueries | None = None  # attended in one batch


MAX_BATCHED_QUERIES = 16  # runs of at most this many queries go into the batch; longer chunks use SDPA alone


def batch_short_queries(query_starts: list[int], query_lens: list[int], contexts: list[torch.Tensor]) -> ShortQueries:
    """Pad short query runs and their context slots (one (context_len,) tensor each) into one batch."""
    lens, ctx = torch.tensor(query_lens), torch.tensor([len(c) for c in contexts])
    width, length = int(lens.max()), int(ctx.max())
    offsets = torch.arange(width)  # (Q,)
    valid = offsets[None, :] < lens[:, None]  # (B, Q)
    rows = torch.tensor(query_starts)[:, None] + torch.where(valid, offsets[None, :], 0)  # (B, Q)
    slots = torch.nn.utils.rnn.pad_sequence(contexts, batch_first=True)  # (B, L), zeros after each context
    slots = torch.where(torch.arange(length)[None, :] < ctx[:, None], slots, slots[:, :1])
    last_visible = (ctx - lens)[:, None] + torch.where(valid, offsets[None, :], 0)  # (B, Q); padding: as query 0
    allowed = torch.arange(length)[None, None, :] <= last_visible[:, :, None]  # (B, Q, L)
    return ShortQueries(rows, valid, slots, allowed)


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


def batched_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, short: ShortQueries) -> torch.Tensor:
    """Attention for every short query run of the step at once.

    q (tokens, heads, head_dim) packed; keys, values (slots, kv_heads, head_dim): the cache, new tokens written.
    Returns (B, Q, heads, head_dim); the rows where short.query_valid is False are padding."""
    qb = q[short.query_rows]  # (B, Q, heads, head_dim)
    kb, vb = keys[short.context_slots], values[short.context_slots]  # (B, L, kv_heads, head_dim)
    batch, width, heads, head_dim = qb.shape
    kv_heads = kb.shape[2]
    group = heads // kv_heads
    # (B, Q, kv, group, d) -> (B, kv, group * Q, d): each KV head's query heads and queries in one matrix
    qb = qb.view(batch, width, kv_heads, group, head_dim).permute(0, 2, 3, 1, 4).reshape(batch, kv_heads, -1, head_dim)
    scores = torch.matmul(qb.float(), kb.float().permute(0, 2, 3, 1)) * head_dim ** -0.5  # (B, kv, group*Q, L)
    allowed = short.allowed[:, None].expand(batch, group, width, -1).reshape(batch, 1, group * width, -1)
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1).to(vb.dtype)
    out = torch.matmul(probs, vb.permute(0, 2, 1, 3))  # (B, kv, group * Q, d)
    out = out.view(batch, kv_heads, group, width, head_dim).permute(0, 3, 1, 2, 4)  # (B, Q, kv, group, d)
    return out.reshape(batch, width, heads, head_dim)


class PagedAttention:
    """The attention backend of one engine step (see `qwen2.AttentionBackend`)."""

    def __init__(self, kv_cache: torch.Tensor, metadata: StepMetadata):
        self.kv_cache = kv_cache  # (layers, 2, slots, kv_heads, head_dim)
        self.meta = metadata

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        keys, values = self.kv_cache[layer]  # (slots, kv_heads, head_dim) each
        keys.index_copy_(0, self.meta.slot_mapping, k)
        values.index_copy_(0, self.meta.slot_mapping, v)
        out = torch.empty_like(q)
        short = self.meta.short
        if short is not None:
            out[short.query_rows[short.query_valid]] = batched_attention(q, keys, values, short)[short.query_valid]
        if not self.meta.sequences:
            return out
        # One gather for the other sequences; each then reads a contiguous slice of it.
        context_keys = keys.index_select(0, self.meta.context_slots)  # (sum of contexts, kv_heads, head_dim)
        context_values = values.index_select(0, self.meta.context_slots)
        for seq in self.meta.sequences:
            rows = slice(seq.query_start, seq.query_start + seq.query_len)
            context = slice(seq.context_start, seq.context_start + seq.context_len)
            out[rows] = causal_attention(q[rows], context_keys[context], context_values[context])
        return out
