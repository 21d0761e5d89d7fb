"""Multimodal prefix caching: hits where content repeats, never across different images, exact either way."""

import pytest

from helpers import assert_engine_matches_reference, assert_no_leaks, chat_prompt, random_image, reference_tokens
from nanomm import LLM, SamplingParams
from nanomm.engine.kv_cache import BlockManager, hash_block
from nanomm.inputs.prompt import ImageSpan

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def make_llm(ckpt, **kwargs):
    return LLM(str(ckpt), device="cpu", dtype="float32", max_pixels=28 * 28 * 16, **kwargs)


def test_block_hash_covers_tokens_parent_image_and_offset():
    ids = [7] * 4
    base = hash_block(None, ids, 0, [ImageSpan(2, 6, "a" * 64)])
    assert len(base) == 32  # a full sha256 digest: cache keys are never truncated
    assert base != hash_block(None, ids, 0, [ImageSpan(2, 6, "b" * 64)])  # other picture
    assert base != hash_block(None, ids, 0, [ImageSpan(1, 6, "a" * 64)])  # same picture, other offset
    assert base != hash_block(b"parent", ids, 0, [ImageSpan(2, 6, "a" * 64)])
    assert hash_block(None, ids, 0, []) == hash_block(None, ids, 0, [ImageSpan(8, 4, "a" * 64)])  # not overlapping


def test_block_manager_reference_counts_and_lru_eviction():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = bm.allocate(2)
    hashes = bm.block_hashes([1, 2, 3, 4], [], 2, [])
    bm.register(a, hashes, 4)
    bm.free(a)
    assert bm.num_free_blocks == 4 and bm.find_cached_prefix(hashes) == a  # freed, still findable
    bm.take_cached(a)
    assert bm.num_free_blocks == 2 and bm.blocks[a[0]].ref_count == 1
    bm.free(a)
    bm.allocate(3)  # the two never-used blocks, then the least recently freed cached block (a's tail)
    assert bm.find_cached_prefix(hashes) == a[:1]
    with pytest.raises(AssertionError, match="double free"):
        bm.free([a[1], a[1]])


def test_multi_turn_chat_reuses_the_first_turn_and_skips_the_encoder(ckpt):
    llm = make_llm(ckpt, block_size=4)
    image = random_image(112, 112, 1)  # 16 visual tokens
    turn1 = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "what?"}]}]
    answer = llm.chat(turn1, GREEDY)[0]
    encoded = llm.stats()["visual_tokens_encoded"]
    turn2 = turn1 + [{"role": "assistant", "content": answer.outputs[0].text},
                     {"role": "user", "content": "and the colours?"}]
    second = llm.chat(turn2, GREEDY)[0]
    span = llm.engine.prepare({"prompt": second.prompt, "multi_modal_data": {"image": image}}, GREEDY).image_spans[0]
    assert second.metrics.num_cached_tokens >= span.end  # the whole image came from the cache...
    assert llm.stats()["visual_tokens_encoded"] == encoded  # ...so the encoder did not run again
    assert second.metrics.encode_s == 0
    text, images = llm.tokenizer.apply_chat_template(turn2)
    assert second.outputs[0].token_ids == reference_tokens(llm, {"prompt": text, "multi_modal_data": {"image": images}},
                                                           GREEDY)
    assert llm.stats()["prefix_cache_hit_rate"] > 0
    assert_no_leaks(llm)


def test_same_text_with_a_different_image_never_shares_image_blocks(ckpt):
    llm = make_llm(ckpt, block_size=2)
    first, second = random_image(112, 112, 2), random_image(112, 112, 3)
    outs = assert_engine_matches_reference(llm, [chat_prompt("same words", [first])], [GREEDY])
    outs += assert_engine_matches_reference(llm, [chat_prompt("same words", [second])], [GREEDY])
    assert outs[0].prompt_token_ids == outs[1].prompt_token_ids  # identical token ids...
    span = llm.engine.prepare(chat_prompt("same words", [second]), GREEDY).image_spans[0]
    assert 0 < outs[1].metrics.num_cached_tokens <= span.start  # ...but no hit at or past the image
    assert outs[0].outputs[0].token_ids != outs[1].outputs[0].token_ids


@pytest.mark.parametrize("encoder_cache_size", [16384, 1])
def test_prefix_hit_ending_inside_an_image(ckpt, encoder_cache_size):
    """The cached prefix ends mid-image: the image's visual tokens come from the encoder cache, or (with no
    room to keep them) the image is encoded whole again; either way the uncached rest is sliced from them."""
    image = random_image(112, 112, 4)
    first, second = chat_prompt("first question", [image]), chat_prompt("second question", [image])
    probe = make_llm(ckpt)
    span = probe.engine.prepare(second, GREEDY).image_spans[0]
    diverge = span.end + 1  # <|vision_end|> sits at span.end; the texts differ right after it
    # A block size whose last shared full block ends strictly inside the image span.
    block_size = next(bs for bs in range(2, 16) if span.start < diverge // bs * bs < span.end)
    llm = make_llm(ckpt, block_size=block_size, encoder_cache_size=encoder_cache_size)
    assert_engine_matches_reference(llm, [first], [GREEDY])
    encoded = llm.stats()["visual_tokens_encoded"]
    out = assert_engine_matches_reference(llm, [second], [GREEDY])[0]
    assert span.start < out.metrics.num_cached_tokens < span.end
    if encoder_cache_size == 1:
        assert llm.stats()["visual_tokens_encoded"] == encoded + span.length  # encoded whole for its tail
    else:
        assert llm.stats()["visual_tokens_encoded"] == encoded and out.metrics.encoder_cache_hits == 1


def computed_block_hashes(llm, prompt, out) -> list[bytes]:
    """The hashes of every full block a finished request computed: its prompt and all but its last token."""
    prepared = llm.engine.prepare(prompt, GREEDY)
    token_ids = list(prepared.token_ids) + out.outputs[0].token_ids
    bm = llm.engine.block_manager
    return bm.block_hashes(token_ids, prepared.image_spans, (len(token_ids) - 1) // bm.block_size, [])


def test_eviction_under_pressure_stays_exact(ckpt):
    num_kv_blocks = 30
    llm = make_llm(ckpt, block_size=4, num_kv_blocks=num_kv_blocks)
    bm = llm.engine.block_manager
    prompts = [chat_prompt(f"request number {i}", [random_image(56 + 8 * i, 56, i)]) for i in range(6)]
    outs = assert_engine_matches_reference(llm, prompts, [GREEDY] * 6)
    hashes = [computed_block_hashes(llm, p, o) for p, o in zip(prompts, outs)]
    workload = set().union(*hashes)
    # The workload computed more distinct blocks than the pool holds, so some had to be evicted...
    assert len(workload) > num_kv_blocks, len(workload)
    assert llm.stats()["kv_blocks_cached"] < len(workload)
    # ...and what the cache still names is this workload's blocks, each hash naming the block that holds it.
    assert set(bm.cached) <= workload
    assert all(bm.blocks[block_id].block_hash == h for h, block_id in bm.cached.items())
    # Least recently used goes first: the last request's blocks, freed last, are all still there.
    assert len(bm.find_cached_prefix(hashes[-1])) == len(hashes[-1])
    again = assert_engine_matches_reference(llm, prompts[:1], [GREEDY])[0]
    span = llm.engine.prepare(prompts[0], GREEDY).image_spans[0]
    # The shared system-prompt blocks stay hot (every request hit them); the first image's were evicted.
    assert 0 < again.metrics.num_cached_tokens <= span.start
