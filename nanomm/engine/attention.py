"""Attention over pages, for a step that mixes decode tokens and prefill chunks of different sequences.

Lesson: lessons/04-paged-kv-cache.md.

A step's new tokens arrive packed: sequence after sequence, no padding, (tokens, heads, head_dim). Each layer
first writes the new keys and values into their cache slots (`slot_mapping`), then, per sequence, gathers
that sequence's keys and values from its blocks and runs causal attention for its new queries. A query sees
its own sequence's cached tokens and the new tokens up to itself, and nothing of any other sequence.

Two ways to run it, with the same result:
- **Per sequence** (`causal_attention`, nanomm/model/attention.py): gather, then the model's own attention for
  each sequence. It is the definition, and what long prefill chunks use (the fused kernel pays off there).
- **Batched** (`batched_attention`): every short run of queries in the step (decodes and speculative
  verifications) in one call per layer. Their context slots are padded into a (sequences, longest context)
  table, keys and values are gathered from the cache once, and a mask says which key each query may see
  (lower-right causal: query i of a run of q sees the first context_len - q + 1 + i keys). GQA groups the
  query heads by KV head instead of copying K and V, and scores and softmax are float32, as in prefill. A
  step of 32 decodes is then a handful of kernels per layer instead of 32 small attention calls; the price is
  the padding, which a fused paged kernel (vLLM's PagedAttention, FlashInfer) avoids. What every layer reads
  (the rows to gather, the additive mask) is derived once per step (`BatchLayout`), and it never reads a value
  back to the host, so a CUDA graph can record it (cuda_graphs.py).

Writes and gathers go through the pool's storage: `PlainKVCache` (kv_cache.py) for a pool in the model's dtype,
`Fp8KVCache` (kv_fp8.py) for `kv_cache_dtype="fp8"`, which quantizes on write and dequantizes what it gathers.
Attention itself only ever sees keys and values in the model's dtype.
"""

from dataclasses import dataclass

import torch

from nanomm.engine.kv_cache import PlainKVCache
from nanomm.engine.kv_fp8 import Fp8KVCache
from nanomm.model.attention import causal_attention


@dataclass
class PrefillSequence:
    """A sequence attended on its own (vLLM's "prefill" side of a step): a prompt chunk, or any run too long to batch."""
    query_start: int  # where this sequence's new tokens start in the packed batch
    query_len: int
    context_start: int  # where its slots start in StepMetadata.context_slots
    context_len: int  # all its tokens so far, the new ones included


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
    visible: torch.Tensor  # (B, Q, L) float32: 0 where a key is visible, -inf where not
    kv_heads: int
    group: int
    runs_per_slice: int
    whole: tuple[torch.Tensor, torch.Tensor] | None  # (kv rows, mask) of the whole step when it is one slice

    @classmethod
    def build(cls, short: DecodeBatch, num_slots: int, kv_heads: int, group: int, head_dim: int) -> "BatchLayout":
        batch, width = short.query_rows.shape
        length = short.context_slots.shape[1]
        heads_offset = torch.arange(kv_heads, device=short.context_slots.device)[None, :, None]  # (1, kv, 1)
        key_rows = (short.context_slots[:, None, :] * kv_heads + heads_offset).view(batch, -1)  # (B, kv * L)
        visible = torch.zeros(short.last_visible.shape + (length,), dtype=torch.float32,
                              device=short.context_slots.device)
        visible.masked_fill_(~short.allowed, float("-inf"))  # (B, Q, L)
        runs = runs_per_slice(batch, length, kv_heads, head_dim, kv_heads * group, width)
        layout = cls(key_rows, num_slots * kv_heads, visible, kv_heads, group, runs, None)
        if runs == batch:
            layout.whole = layout.slice_rows_and_mask(slice(0, batch))
        return layout

    def slice_rows_and_mask(self, runs: slice) -> tuple[torch.Tensor, torch.Tensor]:
        """The cache rows (keys, then values) and the mask of these runs. The mask is (B, Q, L) -> (B, kv, Q,
        group, L) -> (B * kv, Q * group, L), the layout of the queries in `batched_attention`; a decode (Q = 1)
        needs one row per KV head: its query heads all see the same keys, and baddbmm broadcasts it."""
        keys = self.key_rows[runs].flatten()
        visible = self.visible[runs]
        batch, width, _ = visible.shape
        rows = 1 if width == 1 else self.group
        mask = visible[:, None, :, None, :].expand(batch, self.kv_heads, width, rows, -1).reshape(
            batch * self.kv_heads, width * rows, -1)
        return torch.cat([keys, keys + self.values_offset]), mask


@dataclass
class StepMetadata:
    slot_mapping: torch.Tensor  # (tokens,) the cache slot each new token's k/v is written to
    context_slots: torch.Tensor  # (sum of context_len,) the slots of the sequences in `sequences`, in order
    sequences: list[PrefillSequence]  # attended one by one (long prefill chunks; all of them without `short`)
    short: DecodeBatch | None = None  # attended in one batch


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
    (`BatchLayout.slice_rows_and_mask`), the new tokens written; query_rows (B, Q): each run's rows of q (with
    rows_in_place, q's rows 0..B-1 are the B runs' single queries); mask (B * kv, Q * group or 1, L). Returns
    (B * Q, heads, head_dim), one row per (run, query) slot, padding included."""
    heads, head_dim = q.shape[1], q.shape[2]
    batch, width = query_rows.shape
    group = heads // kv_heads
    keys, values = keys_values.view(2, batch * kv_heads, -1, head_dim)  # (B * kv, L, d) each
    if rows_in_place:  # decodes in packed rows 0..B-1: (B, heads, d) is already (B, kv, group, d)
        queries = q[:batch].reshape(batch * kv_heads, group, head_dim)
    else:  # (B * Q, kv, group, d) -> (B, kv, Q, group, d): each KV head's queries and query heads together
        queries = q.index_select(0, query_rows.flatten()).view(batch, width, kv_heads, group, head_dim)
        queries = queries.permute(0, 2, 1, 3, 4).reshape(batch * kv_heads, width * group, head_dim)
    # Scores in float32 (as prefill's), scaled and masked in one call: mask + scale * q k^T.
    scores = torch.baddbmm(mask, queries.float(), keys.float().transpose(1, 2), alpha=head_dim ** -0.5)
    probs = torch.softmax(scores, dim=-1).to(values.dtype)  # (B * kv, Q * group, L)
    out = torch.bmm(probs, values)  # (B * kv, Q * group, d)
    if rows_in_place:
        return out.view(batch, heads, head_dim)
    out = out.view(batch, kv_heads, width, group, head_dim).permute(0, 2, 1, 3, 4)  # (B, Q, kv, group, d)
    return out.reshape(batch * width, heads, head_dim)


class PagedAttention:
    """The attention backend of one engine step (see `qwen2.AttentionBackend`)."""

    def __init__(self, kv_cache: "torch.Tensor | Fp8KVCache", metadata: StepMetadata, num_heads: int | None = None):
        """kv_cache: the pool, a (layers, 2, slots, kv_heads, head_dim) tensor of the model's dtype or an
        `Fp8KVCache` (kv_fp8.py). num_heads: the model's query heads, needed when the step has short queries."""
        self.store = PlainKVCache(kv_cache) if isinstance(kv_cache, torch.Tensor) else kv_cache  # write, read_*
        self.meta = metadata
        self.layout = None  # what every layer's batched call reads, derived once for the step
        if metadata.short is not None:
            slots, kv_heads, head_dim = kv_cache.shape[2], kv_cache.shape[3], kv_cache.shape[4]
            self.layout = BatchLayout.build(metadata.short, slots, kv_heads, num_heads // kv_heads, head_dim)

    def _attend_short(self, layer: int, q: torch.Tensor, short: DecodeBatch) -> torch.Tensor:
        """Every short run through `batched_attention`: at once, or slice by slice (BatchLayout) -> (B * Q, ...)."""
        layout, outs = self.layout, []
        for start in range(0, short.query_rows.shape[0], layout.runs_per_slice):
            runs = slice(start, start + layout.runs_per_slice)
            kv_rows, mask = layout.whole or layout.slice_rows_and_mask(runs)
            # In order, run i's query is q's row i: the slice's queries are q's rows from `start`.
            queries = q[start:] if short.rows_in_place else q
            outs.append(batched_attention(queries, self.store.read_rows(layer, kv_rows), short.query_rows[runs],
                                          short.rows_in_place, mask, layout.kv_heads))
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    @torch.compiler.disable  # LLM(compile=True) compiles the layers around this call, not the call itself
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.store.write(layer, self.meta.slot_mapping, k, v)
        short = self.meta.short
        if short is not None:
            batch_out = self._attend_short(layer, q, short)
            if short.rows_in_place and not self.meta.sequences:
                return batch_out  # a pure decode step: no scatter either
        out = torch.empty_like(q)
        if short is not None:
            if short.valid_index is not None:
                batch_out = batch_out.index_select(0, short.valid_index)  # (B * Q, heads, head_dim) -> real rows
            out.index_copy_(0, short.dest_rows, batch_out)
        if not self.meta.sequences:
            return out
        # One gather for the other sequences; each then reads a contiguous slice of it.
        context_keys, context_values = self.store.read_slots(layer, self.meta.context_slots)  # (contexts, kv, d)
        for seq in self.meta.sequences:
            rows = slice(seq.query_start, seq.query_start + seq.query_len)
            context = slice(seq.context_start, seq.context_start + seq.context_len)
            out[rows] = causal_attention(q[rows], context_keys[context], context_values[context])
        return out
