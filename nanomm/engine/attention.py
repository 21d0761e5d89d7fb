"""Attention over pages, for a step that mixes decode tokens and prefill chunks of different sequences.

Lesson: lessons/04-paged-kv-cache.md.

A step's new tokens arrive packed: sequence after sequence, no padding, (tokens, heads, head_dim). Each layer
first writes the new keys and values into their cache slots (`slot_mapping`), then, per sequence, gathers
that sequence's keys and values from its blocks and runs causal attention for its new queries. A query sees
its own sequence's cached tokens and the new tokens up to itself, and nothing of any other sequence.

Two ways to run it, with the same result:
- **Per sequence** (`causal_attention`, nanomm/model/attention.py): gather, then the model's own attention for
  each sequence. It is the definition (`ModelRunner(batched_attention=False)`), what the dense reference does.
- **Batched** (nanomm/accel/batched_attention.py), the engine's default: every short run of queries in the step
  (decodes and speculative verifications, a `DecodeBatch`) in one call per layer over keys and values gathered
  once and a mask, and every prompt chunk in one padded fused-attention call per layer (`prefill_attention`).
  The kernels a step launches then do not grow with the number of sequences in it.

Writes and gathers go through the pool's storage: `PlainKVCache` (kv_cache.py) for a pool in the model's dtype,
`Fp8KVCache` (kv_fp8.py) for `kv_cache_dtype="fp8"`, which quantizes on write and dequantizes what it gathers.
Attention itself only ever sees keys and values in the model's dtype.
"""

from dataclasses import dataclass

import torch

from nanomm.accel.batched_attention import (BatchLayout, DecodeBatch, PrefillLayout, batched_attention,
                                            prefill_attention)
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
class StepMetadata:
    slot_mapping: torch.Tensor  # (tokens,) the cache slot each new token's k/v is written to
    context_slots: torch.Tensor  # (sum of context_len,) the slots of the sequences in `sequences`, in order
    sequences: list[PrefillSequence]  # attended one by one (the definition: every run, when nothing is batched)
    short: DecodeBatch | None = None  # short runs past the prompt, attended in one batch
    prompt_chunks: DecodeBatch | None = None  # prompt chunks and long runs, attended in one padded batch


class PagedAttention:
    """The attention backend of one engine step (see `model.attention.AttentionBackend`)."""

    def __init__(self, kv_cache: "torch.Tensor | Fp8KVCache", metadata: StepMetadata, num_heads: int | None = None):
        """kv_cache: the pool, a (layers, 2, slots, kv_heads, head_dim) tensor of the model's dtype or an
        `Fp8KVCache` (kv_fp8.py). num_heads: the model's query heads, needed when the step has short queries."""
        self.store = PlainKVCache(kv_cache) if isinstance(kv_cache, torch.Tensor) else kv_cache  # write, read_*
        self.meta = metadata
        self.layout = self.prefill_layout = None  # what every layer's batched calls read, derived once a step
        slots, kv_heads, head_dim = kv_cache.shape[2], kv_cache.shape[3], kv_cache.shape[4]
        if metadata.short is not None:
            self.layout = BatchLayout.build(metadata.short, slots, kv_heads, num_heads // kv_heads, head_dim,
                                           kv_cache.dtype)
        if metadata.prompt_chunks is not None:
            self.prefill_layout = PrefillLayout.build(metadata.prompt_chunks, num_heads, head_dim)

    def _attend_short(self, layer: int, q: torch.Tensor, short: DecodeBatch) -> torch.Tensor:
        """Every short run through `batched_attention`: at once, or slice by slice (BatchLayout) -> (B * Q, ...)."""
        layout, outs = self.layout, []
        for start in range(0, short.query_rows.shape[0], layout.runs_per_slice):
            runs = slice(start, start + layout.runs_per_slice)
            kv_rows, mask = layout.whole or layout.slice_rows_and_mask(runs)
            # Rows in place: run i's query is q's row i, so the slice's queries are q's rows from `start`.
            queries = q[start:] if short.rows_in_place else q
            outs.append(batched_attention(queries, self.store.read_rows(layer, kv_rows), short.query_rows[runs],
                                          short.rows_in_place, mask, layout.kv_heads))
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _attend_prompt_chunks(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """Every prompt chunk through `prefill_attention`, slice by slice (PrefillLayout) -> (B * Q, heads, d)."""
        outs = []
        for query_rows, slots, allowed in self.prefill_layout.slices:
            keys, values = self.store.read_slots(layer, slots)  # (slice runs * L, kv_heads, head_dim) each
            outs.append(prefill_attention(q, keys, values, query_rows, allowed))
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    @torch.compiler.disable  # LLM(compile=True) compiles the layers around this call, not the call itself
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.store.write(layer, self.meta.slot_mapping, k, v)
        short, chunks = self.meta.short, self.meta.prompt_chunks
        if short is not None:
            batch_out = self._attend_short(layer, q, short)
            if short.rows_in_place and chunks is None and not self.meta.sequences:
                return batch_out  # a pure decode step: no scatter either
        out = torch.empty_like(q)
        if short is not None:
            _scatter(out, batch_out, short)
        if chunks is not None:
            _scatter(out, self._attend_prompt_chunks(layer, q), chunks)
        if not self.meta.sequences:
            return out
        # One gather for the other sequences; each then reads a contiguous slice of it.
        context_keys, context_values = self.store.read_slots(layer, self.meta.context_slots)  # (contexts, kv, d)
        for seq in self.meta.sequences:
            rows = slice(seq.query_start, seq.query_start + seq.query_len)
            context = slice(seq.context_start, seq.context_start + seq.context_len)
            out[rows] = causal_attention(q[rows], context_keys[context], context_values[context])
        return out


def _scatter(out: torch.Tensor, batch_out: torch.Tensor, runs: DecodeBatch) -> None:
    """A padded batch's output (B * Q, heads, head_dim) into the packed rows of its real queries."""
    if runs.valid_index is not None:
        batch_out = batch_out.index_select(0, runs.valid_index)  # (B * Q, heads, head_dim) -> real rows
    out.index_copy_(0, runs.dest_rows, batch_out)
