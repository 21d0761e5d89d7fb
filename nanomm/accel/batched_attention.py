"""Attention for every query run of a step in two calls per layer, whatever the number of sequences: the batched
path of the paged attention (engine/attention.py), which the engine takes by default. Short runs (decodes and
speculative verifications) go through `batched_attention`; prompt chunks through `prefill_attention`.

Lesson: lessons/04-paged-kv-cache.md, section 3 (attention over pages: one call for every decode).

The definition is per sequence: gather the sequence's keys and values, then `causal_attention`. Here every short
run of queries in the step goes through at once. Their context slots are padded into a (sequences, longest
context) table, keys and values are gathered from the cache once, and a mask says which key each query may see
(lower-right causal: query i of a run of q sees the first context_len - q + 1 + i keys). GQA groups the query
heads by KV head instead of copying K and V, and one fused `scaled_dot_product_attention` call computes scores,
softmax and values, the scores in float32 inside the kernel and never written out: in bf16 no dtype copy around
it. A step of 32 decodes is then a handful of kernels per layer instead of 32 small attention calls; the price is
the padding, which a fused paged kernel (vLLM's PagedAttention, FlashInfer) avoids. What every layer reads (the
rows to gather, the additive mask) is derived once per step (`BatchLayout`), and it never reads a value back to
the host, so a CUDA graph can record it (engine/cuda_graphs.py). `ModelRunner(batched_attention=False)` attends
every sequence alone, the definition; tests/test_attention.py holds the two equal.

Prompt chunks are long and few, so they are padded the other way: into one (runs, heads, longest chunk,
head_dim) batch of queries against (runs, heads, longest context, head_dim) keys and values, with a (runs, 1,
longest chunk, longest context) mask, through PyTorch's fused `scaled_dot_product_attention` (flash or
memory-efficient kernels: the scores are never written out). The same `DecodeBatch` describes them: a padding
query sees what the run's first query sees and its output is dropped.
"""

import dataclasses
import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F


@dataclass
class DecodeBatch:
    """The step's short query runs past the prompt (decodes and speculative verifications: vLLM's "decode" side of a
    step), padded into one batch: built on the host by `build_decode_batch`, used by `batched_attention`."""
    query_rows: torch.Tensor  # (B, Q) packed row of each query; padding repeats the run's first row
    context_slots: torch.Tensor  # (B, L) cache slot of each context token; any valid slot after the context
    last_visible: torch.Tensor  # (B, Q) the last key each query may see; padding sees what query 0 sees
    valid_index: torch.Tensor | None  # positions of the real queries among the B * Q slots; None: all are real
    dest_rows: torch.Tensor  # (real queries,) their packed rows
    rows_in_place: bool  # one query per run, the runs are packed rows 0..B-1: q and the output need no gather
    TENSORS: ClassVar[tuple[str, ...]] = ("query_rows", "context_slots", "last_visible", "valid_index", "dest_rows")

    def to(self, device) -> "DecodeBatch":
        """The same batch with its tensors on `device` (the runner packs them into its one copy instead)."""
        moved = {name: None if (t := getattr(self, name)) is None else t.to(device) for name in self.TENSORS}
        return dataclasses.replace(self, **moved)

    @property
    def allowed(self) -> torch.Tensor:
        """(B, Q, L) bool: which keys each query may see (lower-right causal)."""
        keys = torch.arange(self.context_slots.shape[1], device=self.context_slots.device)
        return keys[None, None, :] <= self.last_visible[:, :, None]


SLICE_ELEMENTS = 1 << 27  # a slice of the batched attention gathers and scores about this many elements at most


def runs_per_slice(batch: int, length: int, kv_heads: int, head_dim: int, heads: int, width: int) -> int:
    """How many of `batch` runs of `width` queries over `length` keys one slice holds: each run gathers its keys
    and values (2 x kv_heads x head_dim per key) and scores its queries (heads x width per key)."""
    per_run = length * (2 * kv_heads * head_dim + heads * width)
    return max(1, min(batch, SLICE_ELEMENTS // max(1, per_run)))


MASK_ALIGNMENT = 16  # the mask's rows start 16 elements apart: CUDA's memory-efficient SDPA pads them otherwise


@dataclass
class BatchLayout:
    """What every layer's `batched_attention` reads, derived once per step from DecodeBatch (the same for
    every layer: only the cache and q change).

    Runs are padded to the step's longest context and longest run, so a step with one long sequence among
    many would gather (and score) that length for every run: 64 runs of 32k keys are gigabytes. Such a step
    goes through the attention in slices of `runs_per_slice` runs, each gathering only its own keys; a step
    that fits SLICE_ELEMENTS is one slice, built once (every step of the tests and benchmarks here)."""
    key_rows: torch.Tensor  # (B, kv_heads * L) rows of the layer's cache viewed as (2 * slots * kv_heads, d)
    values_offset: int  # the same rows' values are this many rows further
    visible: torch.Tensor  # (B, Q, L rounded up to MASK_ALIGNMENT) model dtype: 0 where a key is visible, else -inf
    length: int  # L, the step's longest context
    kv_heads: int
    group: int
    runs_per_slice: int
    whole: tuple[torch.Tensor, torch.Tensor] | None  # (kv rows, mask) of the whole step when it is one slice

    @classmethod
    def build(cls, short: DecodeBatch, num_slots: int, kv_heads: int, group: int, head_dim: int,
              dtype: torch.dtype) -> "BatchLayout":
        """dtype: the model's (what the cache reads return)."""
        batch, width = short.query_rows.shape
        length, device = short.context_slots.shape[1], short.context_slots.device
        heads_offset = torch.arange(kv_heads, device=device)[None, :, None]  # (1, kv, 1)
        key_rows = (short.context_slots[:, None, :] * kv_heads + heads_offset).view(batch, -1)  # (B, kv * L)
        padded = math.ceil(length / MASK_ALIGNMENT) * MASK_ALIGNMENT
        visible = torch.full((batch, width, padded), float("-inf"), dtype=dtype, device=device)  # an additive mask
        visible[:, :, :length].masked_fill_(short.allowed, 0.0)  # (B, Q, padded)
        runs = runs_per_slice(batch, length, kv_heads, head_dim, kv_heads * group, width)
        layout = cls(key_rows, num_slots * kv_heads, visible, length, kv_heads, group, runs, None)
        if runs == batch:
            layout.whole = layout.slice_rows_and_mask(slice(0, batch))
        return layout

    def slice_rows_and_mask(self, runs: slice) -> tuple[torch.Tensor, torch.Tensor]:
        """The cache rows (keys, then values) and the mask of these runs. The mask is laid out as
        `batched_attention`'s queries, (B, kv, Q * group, d), and broadcast over the KV heads: (B, Q, L) -> (B, 1,
        Q, group, L) -> (B, 1, Q * group, L). A decode (Q = 1) needs one row: its query heads all see the same
        keys. Each row starts MASK_ALIGNMENT elements after the last; the mask is the first L of them."""
        keys = self.key_rows[runs].flatten()
        visible = self.visible[runs]
        batch, width, padded = visible.shape
        rows_per_query = 1 if width == 1 else self.group
        mask = visible[:, None, :, None, :].expand(batch, 1, width, rows_per_query, padded).reshape(
            batch, 1, width * rows_per_query, padded)[..., :self.length]
        return torch.cat([keys, keys + self.values_offset]), mask


MAX_BATCHED_QUERIES = 16  # runs of at most this many queries go into the batch; longer chunks use SDPA alone


def build_decode_batch(query_starts: list[int], query_lens: list[int], context_slots: torch.Tensor,
                        context_lens: list[int]) -> DecodeBatch:
    """Short query runs in one batch, on the host. context_slots (B, L): each run's context slots, padded
    with any valid slot (`model_runner.padded_context_slots`)."""
    lens, ctx = torch.tensor(query_lens), torch.tensor(context_lens)
    width = max(query_lens)
    offsets = torch.arange(width)  # (Q,)
    valid = offsets[None, :] < lens[:, None]  # (B, Q)
    rows = torch.tensor(query_starts)[:, None] + torch.where(valid, offsets[None, :], 0)  # (B, Q)
    last_visible = (ctx - lens)[:, None] + torch.where(valid, offsets[None, :], 0)  # (B, Q); padding: as query 0
    valid_index = None if width == min(query_lens) else valid.flatten().nonzero().flatten()
    rows_in_place = width == 1 and list(query_starts) == list(range(len(query_starts)))
    return DecodeBatch(rows, context_slots[:, :max(context_lens)], last_visible, valid_index,
                        rows.flatten()[valid.flatten()], rows_in_place)


def batched_attention(q: torch.Tensor, keys_values: torch.Tensor, query_rows: torch.Tensor, rows_in_place: bool,
                      mask: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Attention for short query runs at once, over keys and values gathered once.

    q (tokens, heads, head_dim) packed; keys_values (2 * B * kv_heads * L, head_dim): the runs' cache rows
    (`BatchLayout.slice_rows_and_mask`, with the mask), the new tokens written; query_rows (B, Q): each run's
    rows of q (with rows_in_place, q's rows 0..B-1 are the B runs' single queries). Returns (B * Q, heads,
    head_dim), one row per (run, query) slot, padding included."""
    heads, head_dim = q.shape[1], q.shape[2]
    batch, width = query_rows.shape
    group = heads // kv_heads
    keys, values = keys_values.view(2, batch, kv_heads, -1, head_dim)  # (B, kv, L, d) each
    if rows_in_place:  # decodes in packed rows 0..B-1: (B, heads, d) is already (B, kv, group, d)
        queries = q[:batch].view(batch, kv_heads, group, head_dim)
    else:  # (B * Q, kv, group, d) -> (B, kv, Q, group, d): each KV head's queries and query heads together
        queries = q.index_select(0, query_rows.flatten()).view(batch, width, kv_heads, group, head_dim)
        queries = queries.permute(0, 2, 1, 3, 4).reshape(batch, kv_heads, width * group, head_dim)
    # Each KV head's queries are one "head" of queries against its keys: (B, kv, Q * group, d)
    out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask)
    if rows_in_place:
        return out.reshape(batch, heads, head_dim)  # (B, kv, group, d) -> (B, heads, d)
    out = out.view(batch, kv_heads, width, group, head_dim).permute(0, 2, 1, 3, 4)  # (B, Q, kv, group, d)
    return out.reshape(batch * width, heads, head_dim)


@dataclass
class PrefillLayout:
    """What every layer's `prefill_attention` reads, derived once per step from the prompt chunks' DecodeBatch: the
    padded context slots and the mask, in slices of runs whose keys, values and mask hold about SLICE_ELEMENTS."""
    slices: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # per slice: (query rows, slots, allowed)

    @classmethod
    def build(cls, runs: DecodeBatch, heads: int, head_dim: int) -> "PrefillLayout":
        batch, width = runs.query_rows.shape
        length = runs.context_slots.shape[1]
        # Keys and values repeated for every query head; the scores are never written out, one mask row a query.
        per_slice = runs_per_slice(batch, length, heads, head_dim, 1, width)
        allowed = runs.allowed[:, None]  # (B, 1, Q, L): one mask for every head
        return cls([(runs.query_rows[i:i + per_slice], runs.context_slots[i:i + per_slice].flatten(),
                     allowed[i:i + per_slice]) for i in range(0, batch, per_slice)])


def prefill_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, query_rows: torch.Tensor,
                      allowed: torch.Tensor) -> torch.Tensor:
    """Prompt chunks at once: q (tokens, heads, head_dim) packed; keys, values (B * L, kv_heads, head_dim), each
    run's padded context gathered from the pool; query_rows (B, Q) each run's rows of q; allowed (B, 1, Q, L).
    Returns (B * Q, heads, head_dim), one row per (run, query) slot, padding included."""
    heads, head_dim = q.shape[1], q.shape[2]
    batch, width = query_rows.shape
    group = heads // keys.shape[1]
    queries = q.index_select(0, query_rows.flatten()).view(batch, width, heads, head_dim).transpose(1, 2)
    # (B * L, kv, d) -> (B, heads, L, d): each KV head repeated for its query heads, as `causal_attention` does
    keys, values = (x.view(batch, -1, x.shape[1], head_dim).repeat_interleave(group, dim=2).transpose(1, 2)
                    for x in (keys, values))
    out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=allowed)  # (B, heads, Q, d)
    return out.transpose(1, 2).reshape(batch * width, heads, head_dim)
