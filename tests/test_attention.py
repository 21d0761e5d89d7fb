"""Batched attention over pages (nanomm/engine/attention.py) against its definition, one sequence at a time."""

import random

import pytest
import torch

from nanomm.engine.attention import (PagedAttention, SequenceSlice, ShortQueries, StepMetadata, batch_short_queries,
                                     causal_attention)
from nanomm.engine.model_runner import token_slots


def random_step(seed: int, kv_heads: int, group: int, dtype=torch.float32):
    """A random KV pool and a step of sequences with random block tables, context lengths and query runs."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    block_size, num_blocks, head_dim = 4, 64, 16
    cache = torch.randn(1, 2, num_blocks * block_size, kv_heads, head_dim, generator=gen).to(dtype)
    free = list(range(num_blocks))
    rng.shuffle(free)
    query_lens, contexts = [], []
    for _ in range(rng.randint(1, 6)):
        query_len = rng.choice([1, 1, 1, 2, 4, 5])  # decodes, verifications, a short tail chunk
        context_len = rng.randint(query_len, 30)
        table = [free.pop() for _ in range(-(-context_len // block_size))]
        query_lens.append(query_len)
        contexts.append(token_slots(table, 0, context_len, block_size))
    starts = [sum(query_lens[:i]) for i in range(len(query_lens))]
    new_slots = torch.cat([c[len(c) - n:] for c, n in zip(contexts, query_lens)])
    q = torch.randn(sum(query_lens), kv_heads * group, head_dim, generator=gen).to(dtype)
    k = torch.randn(sum(query_lens), kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(sum(query_lens), kv_heads, head_dim, generator=gen).to(dtype)
    return cache, q, k, v, starts, query_lens, contexts, new_slots


def one_by_one(cache, q, k, v, starts, query_lens, contexts, new_slots):
    sequences, offset = [], 0
    for start, n, context in zip(starts, query_lens, contexts):
        sequences.append(SequenceSlice(start, n, offset, len(context)))
        offset += len(context)
    meta = StepMetadata(new_slots, torch.cat(contexts), sequences)
    return PagedAttention(cache.clone(), meta).attend(0, q, k, v)


def batched(cache, q, k, v, starts, query_lens, contexts, new_slots):
    meta = StepMetadata(new_slots, torch.zeros(0, dtype=torch.long), [],
                        batch_short_queries(starts, query_lens, contexts))
    return PagedAttention(cache.clone(), meta).attend(0, q, k, v)


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("kv_heads,group", [(2, 1), (2, 3), (1, 4)])
def test_batched_attention_equals_one_sequence_at_a_time(seed, kv_heads, group):
    step = random_step(seed, kv_heads, group)
    torch.testing.assert_close(batched(*step), one_by_one(*step), rtol=1e-5, atol=1e-5)


def test_batched_attention_in_bfloat16_scores_in_float32():
    step = random_step(3, 2, 3, torch.bfloat16)
    reference = one_by_one(*(t.float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in step))
    torch.testing.assert_close(batched(*step).float(), reference, rtol=2e-2, atol=2e-2)


def test_the_mask_is_lower_right_causal_and_padding_sees_what_the_first_query_sees():
    """A run of 3 queries at the end of a 5-token context, beside a decode with a 2-token context."""
    short = batch_short_queries([0, 3], [3, 1], [torch.arange(10, 15), torch.arange(20, 22)])
    assert isinstance(short, ShortQueries)
    assert short.query_rows.tolist() == [[0, 1, 2], [3, 3, 3]]
    assert short.query_valid.tolist() == [[True, True, True], [True, False, False]]
    assert short.context_slots.tolist() == [[10, 11, 12, 13, 14], [20, 21, 20, 20, 20]]
    assert short.allowed.int().tolist() == [
        [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]],  # query i sees context_len - 3 + 1 + i keys
        [[1, 1, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 0, 0, 0]],  # the decode sees both keys; so do its padding rows
    ]


def test_a_decode_step_is_one_attention_call_per_layer_not_one_per_sequence(ckpt, monkeypatch):
    import nanomm.engine.attention as attention
    from nanomm import LLM, SamplingParams

    calls = {"alone": 0, "batched": 0}
    alone, together = attention.causal_attention, attention.batched_attention

    def count_alone(*args):
        calls["alone"] += 1
        return alone(*args)

    def count_batched(*args):
        calls["batched"] += 1
        return together(*args)

    with LLM(ckpt, num_kv_blocks=64) as llm:
        for i in range(6):
            llm.engine.add_request(f"request number {i}", SamplingParams(max_tokens=4, ignore_eos=True))
        llm.engine.step()  # the six prefills (long enough to be attended alone)
        monkeypatch.setattr(attention, "causal_attention", count_alone)
        monkeypatch.setattr(attention, "batched_attention", count_batched)
        llm.engine.step()  # six decodes
        layers = llm.model.config.text.num_hidden_layers
        assert calls == {"alone": 0, "batched": layers}
        monkeypatch.undo()
        while llm.engine.has_unfinished_requests():
            llm.engine.step()
    assert causal_attention is alone
