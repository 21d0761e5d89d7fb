"""Batched attention over pages (nanomm/accel/batched_attention.py, through nanomm/engine/attention.py) against its
definition, one sequence at a time."""

import random

import pytest
import torch

from nanomm.accel.batched_attention import DecodeBatch, build_decode_batch
from nanomm.engine.attention import PagedAttention, PrefillSequence, StepMetadata, causal_attention
from nanomm.engine.model_runner import token_slots


def random_step(seed: int, kv_heads: int, group: int, dtype=torch.float32, run_lengths=(1, 1, 1, 2, 4, 5)):
    """A random KV pool and a step of sequences with random block tables, context lengths and query runs (of the
    lengths in run_lengths)."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    block_size, num_blocks, head_dim = 4, 64, 16
    cache = torch.randn(1, 2, num_blocks * block_size, kv_heads, head_dim, generator=gen).to(dtype)
    free = list(range(num_blocks))
    rng.shuffle(free)
    query_lens, contexts = [], []
    for _ in range(rng.randint(1, 6)):
        query_len = rng.choice(run_lengths)  # by default decodes, verifications, a short tail chunk
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
        sequences.append(PrefillSequence(start, n, offset, len(context)))
        offset += len(context)
    meta = StepMetadata(new_slots, torch.cat(contexts), sequences)
    return PagedAttention(cache.clone(), meta).attend(0, q, k, v)


def batched(cache, q, k, v, starts, query_lens, contexts, new_slots):
    padded = torch.nn.utils.rnn.pad_sequence(contexts, batch_first=True)  # (B, L), slot 0 after each context
    meta = StepMetadata(new_slots, torch.zeros(0, dtype=torch.long), [],
                        build_decode_batch(starts, query_lens, padded, [len(c) for c in contexts]))
    return PagedAttention(cache.clone(), meta, q.shape[1]).attend(0, q, k, v)


def prompt_chunks_batched(cache, q, k, v, starts, query_lens, contexts, new_slots):
    padded = torch.nn.utils.rnn.pad_sequence(contexts, batch_first=True)  # (B, L), slot 0 after each context
    meta = StepMetadata(new_slots, torch.zeros(0, dtype=torch.long), [],
                        prompt_chunks=build_decode_batch(starts, query_lens, padded, [len(c) for c in contexts]))
    return PagedAttention(cache.clone(), meta, q.shape[1]).attend(0, q, k, v)


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("kv_heads,group", [(2, 1), (2, 3), (1, 4)])
@pytest.mark.parametrize("slice_elements", [1, 6000, 1 << 27])  # one run per slice; a few; all in one call
def test_prompt_chunks_in_one_padded_call_equal_one_sequence_at_a_time(seed, kv_heads, group, slice_elements,
                                                                       monkeypatch):
    """Whole prompts (query run = context) and chunks after cached tokens, of different lengths, padded into one
    fused-attention call (accel/batched_attention.py, `prefill_attention`), or a few when the step is large."""
    import nanomm.accel.batched_attention as batched_module
    monkeypatch.setattr(batched_module, "SLICE_ELEMENTS", slice_elements)
    step = random_step(seed, kv_heads, group, run_lengths=(1, 3, 7, 12, 30))
    torch.testing.assert_close(prompt_chunks_batched(*step), one_by_one(*step), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("kv_heads,group", [(2, 1), (2, 3), (1, 4)])
def test_batched_attention_equals_one_sequence_at_a_time(seed, kv_heads, group):
    step = random_step(seed, kv_heads, group)
    torch.testing.assert_close(batched(*step), one_by_one(*step), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("slice_elements", [1, 1500])  # one run per slice; one or a few
def test_a_step_too_large_for_one_slice_goes_slice_by_slice_and_equals_the_definition(seed, slice_elements,
                                                                                     monkeypatch):
    import nanomm.accel.batched_attention as batched_attention
    step = random_step(seed, 2, 3)
    cache, q, k, v, starts, query_lens, contexts, new_slots = step
    monkeypatch.setattr(batched_attention, "SLICE_ELEMENTS", slice_elements)
    padded = torch.nn.utils.rnn.pad_sequence(contexts, batch_first=True)
    short = build_decode_batch(starts, query_lens, padded, [len(c) for c in contexts])
    attend = PagedAttention(cache.clone(), StepMetadata(new_slots, torch.zeros(0, dtype=torch.long), [], short),
                            q.shape[1])
    if len(contexts) > 1 and slice_elements == 1:
        assert attend.layout.whole is None and attend.layout.runs_per_slice == 1
    torch.testing.assert_close(attend.attend(0, q, k, v), one_by_one(*step), rtol=1e-5, atol=1e-5)


def test_decodes_in_packed_order_slice_by_slice(monkeypatch):
    import nanomm.accel.batched_attention as batched_attention
    monkeypatch.setattr(batched_attention, "SLICE_ELEMENTS", 1)
    gen = torch.Generator().manual_seed(8)
    cache = torch.randn(1, 2, 256, 2, 16, generator=gen)
    contexts = [token_slots([5, 9, 2], 0, 11, 4), token_slots([7], 0, 3, 4), token_slots([1, 3], 0, 6, 4)]
    new_slots = torch.stack([c[-1] for c in contexts])
    q, (k, v) = torch.randn(3, 6, 16, generator=gen), torch.randn(2, 3, 2, 16, generator=gen)
    short = build_decode_batch([0, 1, 2], [1, 1, 1], torch.nn.utils.rnn.pad_sequence(contexts, batch_first=True),
                                [11, 3, 6])
    assert short.rows_in_place
    meta = StepMetadata(new_slots, torch.zeros(0, dtype=torch.long), [], short)
    sliced = PagedAttention(cache.clone(), meta, 6)
    assert sliced.layout.runs_per_slice == 1
    torch.testing.assert_close(sliced.attend(0, q, k, v), one_by_one(cache, q, k, v, [0, 1, 2], [1, 1, 1], contexts,
                                                                       new_slots), rtol=1e-5, atol=1e-5)


def test_the_engine_gives_the_reference_s_tokens_when_every_step_is_sliced(ckpt, monkeypatch):
    import nanomm.accel.batched_attention as batched_attention
    from helpers import assert_no_leaks, random_workload, reference_tokens
    from nanomm import LLM, SamplingParams
    monkeypatch.setattr(batched_attention, "SLICE_ELEMENTS", 1)
    llm = LLM(str(ckpt), device="cpu", dtype="float32", num_kv_blocks=128)
    prompts = random_workload(seed=3, num_prompts=4)
    params = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True) for _ in prompts]
    for prompt, p, out in zip(prompts, params, llm.generate(prompts, params)):
        assert out.outputs[0].token_ids == reference_tokens(llm, prompt, p)
    assert_no_leaks(llm)


def test_batched_attention_in_bfloat16_scores_in_float32():
    step = random_step(3, 2, 3, torch.bfloat16)
    reference = one_by_one(*(t.float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in step))
    torch.testing.assert_close(batched(*step).float(), reference, rtol=2e-2, atol=2e-2)


def test_the_mask_is_lower_right_causal_and_padding_sees_what_the_first_query_sees():
    """A run of 3 queries at the end of a 5-token context, beside a decode with a 2-token context."""
    slots = torch.tensor([[10, 11, 12, 13, 14], [20, 21, 0, 0, 0]])
    short = build_decode_batch([0, 3], [3, 1], slots, [5, 2])
    assert isinstance(short, DecodeBatch)
    assert short.query_rows.tolist() == [[0, 1, 2], [3, 3, 3]]
    assert short.valid_index.tolist() == [0, 1, 2, 3]  # of the 6 (run, query) slots, the real queries
    assert short.dest_rows.tolist() == [0, 1, 2, 3] and not short.rows_in_place
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


def test_decodes_in_packed_order_take_the_path_without_gathers_and_match_beside_a_long_chunk():
    """Decodes in rows 0..B-1 read q and write the output in place; with a long chunk after them in the same
    step (attended alone), both still equal the definition."""
    rng = torch.Generator().manual_seed(5)
    block_size, kv_heads, group, head_dim = 4, 2, 3, 16
    cache = torch.randn(1, 2, 64 * block_size, kv_heads, head_dim, generator=rng)
    contexts = [token_slots([5, 9, 2], 0, 11, block_size), token_slots([7], 0, 3, block_size),
                token_slots([1, 3, 4, 6, 8], 0, 20, block_size)]
    query_lens, starts = [1, 1, 20], [0, 1, 2]  # two decodes, then a whole 20-token prefill
    new_slots = torch.cat([c[len(c) - n:] for c, n in zip(contexts, query_lens)])
    q = torch.randn(22, kv_heads * group, head_dim, generator=rng)
    k, v = torch.randn(2, 22, kv_heads, head_dim, generator=rng)
    reference = one_by_one(cache, q, k, v, starts, query_lens, contexts, new_slots)
    padded = torch.nn.utils.rnn.pad_sequence(contexts[:2], batch_first=True)
    short = build_decode_batch(starts[:2], query_lens[:2], padded, [11, 3])
    assert short.rows_in_place and short.valid_index is None
    meta = StepMetadata(new_slots, contexts[2], [PrefillSequence(2, 20, 0, 20)], short)
    mixed = PagedAttention(cache.clone(), meta, kv_heads * group).attend(0, q, k, v)
    torch.testing.assert_close(mixed, reference, rtol=1e-5, atol=1e-5)
    decodes_only = StepMetadata(new_slots[:2], torch.zeros(0, dtype=torch.long), [], short)
    alone = PagedAttention(cache.clone(), decodes_only, kv_heads * group).attend(0, q[:2], k[:2], v[:2])
    torch.testing.assert_close(alone, reference[:2], rtol=1e-5, atol=1e-5)


def test_padded_context_slots_are_token_slots_row_by_row():
    from nanomm.engine.model_runner import padded_context_slots
    tables, lengths = [[5, 9, 2], [7], [1, 3, 4, 6, 8]], [11, 3, 20]
    padded = padded_context_slots(tables, lengths, 4)
    assert padded.shape == (3, 20)
    for row, table, n in zip(padded, tables, lengths):
        assert row[:n].tolist() == token_slots(table, 0, n, 4).tolist()
        assert all(0 <= s < 64 for s in row.tolist())  # padding: valid slots (never attended)


def test_the_packed_host_to_device_copy_gives_back_every_tensor():
    """model_runner.packed_copy (what copy_to_device does on a GPU; run here on the CPU): one int64 buffer, then
    each tensor back in its shape and dtype, None kept in its place."""
    from nanomm.engine.model_runner import packed_copy
    tensors = [torch.arange(5), None, torch.arange(6).view(3, 2), torch.tensor([True, False, True]),
               torch.zeros(0, dtype=torch.long)]
    copied = packed_copy(tensors, torch.device("cpu"))
    assert copied[1] is None
    for original, back in zip(tensors, copied):
        if original is not None:
            assert back.dtype == original.dtype and torch.equal(back, original)


def fused_attention_calls(monkeypatch) -> list[tuple]:
    """Record every fused attention call from now on: what decides its bits on a given CPU (the shapes, the
    layout, the dtypes, the mask's values, the causal flag), not what it is called with by name."""
    calls, fused = [], torch.nn.functional.scaled_dot_product_attention

    def layout(t: torch.Tensor) -> tuple:
        return tuple(t.shape), tuple(s for s, n in zip(t.stride(), t.shape) if n > 1), t.dtype

    def recording(q, k, v, attn_mask=None, **kwargs):
        mask = None if attn_mask is None else (tuple(attn_mask.shape), attn_mask.dtype, attn_mask.tolist())
        calls.append((layout(q), layout(k), layout(v), mask, sorted(kwargs.items())))
        return fused(q, k, v, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    return calls


def test_a_request_alone_makes_the_reference_s_attention_calls(ckpt, monkeypatch):
    """The engine's batched forms hold a lone request's prompt and decodes in the tensors the dense reference
    attends with, and make the same fused call: the same kernel on the same data gives the same bits on every CPU.
    (The reference once used the causal flag where the engine passes a mask, and two matmuls for a decode: for a
    lone int8 prompt those were the only calls that differed, and on an Intel Xeon its first sampled token was
    not the reference's.) Every other call of the step, the quantized layers' included, sees the same rows."""
    from helpers import random_workload
    from nanomm import LLM, SamplingParams
    from nanomm.reference import generate
    prompt = random_workload(seed=3, num_prompts=1)[0]
    params = SamplingParams(temperature=0.8, top_k=40, seed=0, max_tokens=3, ignore_eos=True)
    with LLM(str(ckpt), device="cpu", dtype="float32", num_preprocess_workers=0, quantization="int8") as llm:
        prepared = llm.engine.prepare(prompt, params)
        calls = fused_attention_calls(monkeypatch)
        engine_tokens = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
        engine_calls = calls[:]
        calls.clear()
        reference_tokens = generate(llm.model, prepared.token_ids, prepared.images, params).token_ids
    layers = llm.model.config.text.num_hidden_layers
    assert len(engine_calls) >= 3 * layers  # the prompt and two decodes (and the tower), each one call a layer
    assert engine_calls == calls
    assert engine_tokens == reference_tokens
