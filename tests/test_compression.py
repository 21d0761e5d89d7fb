"""Visual-token compression (nanomm/inputs/compression.py): each method worked out by hand, the policy in the
cache keys, and the engine against the dense reference that applies the same compression."""

import pytest
import torch
import torch.nn.functional as F

from helpers import (assert_engine_matches_reference, assert_no_leaks, chat_prompt, random_image, random_workload,
                     reference_tokens)
from nanomm import LLM, InvalidInputError, SamplingParams
from nanomm.inputs.compression import (CompressionPolicy, _nearest_neighbour_distances, compress, kept_layout,
                                       max_min_diverse, parse_policy, pool_window)
from nanomm.model.rope import apply_rotary, mrope_positions, vision_cos_sin
from nanomm.model.vision import attention_weights, block_diagonal_attention
from nanomm.tools.random_checkpoint import make_checkpoint

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
METHODS = ("pool", "random", "prune", "attention")


def make_llm(ckpt, **kwargs):
    kwargs.setdefault("num_preprocess_workers", 0)  # which images share a vision forward: the same every run
    return LLM(str(ckpt), device="cpu", dtype="float32", **kwargs)


def policy(method: str, keep_ratio: float) -> dict:
    return {"method": method, "keep_ratio": keep_ratio}


# -- the policy -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [policy("crop", 0.5), policy("pool", 0), policy("pool", 1.5), policy("pool", -0.1),
                                 policy("pool", True), policy("pool", "0.5"), {"method": "pool"},
                                 {"method": "pool", "keep_ratio": 0.5, "seed": 1}, "pool", 0.5])
def test_a_bad_policy_is_an_invalid_input_error_naming_what_is_wrong(bad):
    with pytest.raises(InvalidInputError, match="visual_token_compression"):
        parse_policy(bad)


def test_keep_ratio_one_is_no_compression():
    assert parse_policy(policy("prune", 1)) is None and parse_policy(None) is None
    assert parse_policy(policy("prune", 0.25)) == CompressionPolicy("prune", 0.25)


@pytest.mark.parametrize("ratio, window", [(1, (1, 1)), (0.5, (1, 2)), (0.25, (2, 2)), (0.2, (2, 3)), (0.1, (3, 4)),
                                           (1 / 9, (3, 3)), (0.9, (1, 2)), (1e-30, (10**15, 10**15))])
def test_the_pool_window_is_the_first_whose_area_is_at_least_one_over_the_ratio(ratio, window):
    assert pool_window(ratio) == window


def test_a_policy_checks_its_fields_however_it_is_made():
    for method, ratio in (("crop", 0.5), ("pool", 0), ("pool", -1), ("pool", 1.5), ("pool", float("nan"))):
        with pytest.raises(InvalidInputError):
            CompressionPolicy(method, ratio)
    assert parse_policy(CompressionPolicy("pool", 1)) is None


def test_tiny_ratios_keep_one_token_and_rounding_does_not_add_one():
    assert kept_layout((1, 10, 10), CompressionPolicy("random", 0.07)) == (7, 10)  # 100 x 0.07 = 7.000000000000001
    assert kept_layout((1, 10, 10), CompressionPolicy("prune", 1e-9)) == (1, 10)
    assert kept_layout((1, 10, 10), CompressionPolicy("pool", 1e-30)) == (1, 1)  # the whole grid in one window
    out = compress(torch.arange(100.0).view(100, 1), (1, 10, 10), CompressionPolicy("pool", 1e-30))
    assert out.embeds.tolist() == [[49.5]] and out.coords.tolist() == [[0], [0], [0]]


def test_kept_layout_counts_by_hand():
    grid = (1, 12, 12)  # the demo model's 144 tokens
    assert kept_layout(grid, None) == (144, 12)
    assert kept_layout(grid, CompressionPolicy("prune", 0.5)) == (72, 12)  # selection: the text resumes as before
    assert kept_layout(grid, CompressionPolicy("random", 0.1)) == (15, 12)  # ceil(14.4)
    assert kept_layout(grid, CompressionPolicy("pool", 0.25)) == (36, 6)  # a 6x6 grid
    assert kept_layout((1, 5, 7), CompressionPolicy("pool", 0.1)) == (4, 2)  # 3x4 windows: ceil(5/3) x ceil(7/4)
    assert kept_layout((1, 1, 1), CompressionPolicy("attention", 0.1)) == (1, 1)  # never fewer than one


# -- the methods, by hand ---------------------------------------------------------------------------------


def test_pool_averages_windows_and_the_edges_average_what_they_cover():
    embeds = torch.arange(9.0).view(9, 1)  # a 3x3 grid whose token (h, w) holds 3h + w
    out = compress(embeds, (1, 3, 3), CompressionPolicy("pool", 0.25))
    # windows: {0,1,3,4} {2,5} {6,7} {8}
    assert out.embeds.flatten().tolist() == [2.0, 3.5, 6.5, 8.0]
    assert out.coords.tolist() == [[0, 0, 0, 0], [0, 0, 1, 1], [0, 1, 0, 1]]  # the pooled 2x2 grid's cells


def test_random_keeps_the_same_tokens_for_the_same_seed_in_raster_order():
    embeds = torch.randn(20, 4)
    first = compress(embeds, (1, 4, 5), CompressionPolicy("random", 0.25), seed=7)
    again = compress(embeds, (1, 4, 5), CompressionPolicy("random", 0.25), seed=7)
    other = compress(embeds, (1, 4, 5), CompressionPolicy("random", 0.25), seed=8)
    assert torch.equal(first.coords, again.coords) and not torch.equal(first.coords, other.coords)
    index = (first.coords[1] * 5 + first.coords[2]).tolist()  # flat index of each kept token
    assert len(index) == 5 and index == sorted(index) and torch.equal(first.embeds, embeds[index])


def test_max_min_diversity_keeps_one_of_each_cluster():
    # Tokens 0, 1, 2 point almost the same way; 3 and 4 are orthogonal to them and to each other.
    embeds = torch.tensor([[1.0, 0, 0], [1.0, 0.01, 0], [1.0, 0, 0.01], [0, 1.0, 0], [0, 0, 1.0]])
    kept = max_min_diverse(embeds, 3).tolist()
    assert sorted(kept)[1:] == [3, 4] and sorted(kept)[0] in (0, 1, 2)
    assert kept[0] in (3, 4)  # the most isolated token comes first (its nearest neighbour is farthest)
    out = compress(embeds, (1, 1, 5), CompressionPolicy("prune", 0.6))
    assert out.coords[2].tolist() == sorted(kept)  # in raster order, each at its own column


def test_attention_keeps_the_most_attended_tokens_and_merges_the_rest_into_contextual_ones():
    # 12 tokens on a 3x4 grid, 0.5 kept -> 6: int(6 / 6) = 1 contextual and 5 dominant.
    embeds = torch.tensor([[1.0, 0], [0, 1], [1, 0.2], [0.2, 1], [2, 0], [0, 2], [3, 3], [1, 1], [0, 3], [3, 0],
                           [1, 2], [2, 1]])
    attention = torch.tensor([0.01, 0.02, 0.30, 0.03, 0.04, 0.25, 0.05, 0.20, 0.06, 0.15, 0.07, 0.08])
    out = compress(embeds, (1, 3, 4), CompressionPolicy("attention", 0.5), attention=attention)
    # Dominant: the five most attended, 2, 5, 7, 9, 11. The rest is 0, 1, 3, 4, 6, 8, 10; its first token, 0, is
    # the one contextual target, and all the rest join it (there is no other target): their mean.
    flat = (out.coords[1] * 4 + out.coords[2]).tolist()
    assert flat == [0, 2, 5, 7, 9, 11] and out.coords[0].tolist() == [0] * 6
    assert torch.allclose(out.embeds[0], embeds[[0, 1, 3, 4, 6, 8, 10]].mean(dim=0))
    assert torch.equal(out.embeds[1:], embeds[[2, 5, 7, 9, 11]])


def test_contextual_tokens_average_the_rest_tokens_most_similar_to_them():
    # 13 tokens, keep 12/13 -> 12: int(12 / 6) = 2 contextual, 10 dominant (the attention is on 3..12). The rest
    # is 0, 1, 2; the targets are every (3 // 2)-th of it: 0 and 1. Token 2 points like token 1, so it joins 1.
    embeds = torch.tensor([[1.0, 0]] + [[0, 1.0]] + [[0.1, 1.0]] + [[5.0, float(i)] for i in range(10)])
    attention = torch.tensor([0.0] * 3 + [1.0] * 10)
    out = compress(embeds, (1, 1, 13), CompressionPolicy("attention", 12 / 13), attention=attention)
    assert out.coords[2].tolist() == [0, 1] + list(range(3, 13))
    assert torch.equal(out.embeds[0], embeds[0])  # alone in its group
    assert torch.allclose(out.embeds[1], (embeds[1] + embeds[2]) / 2)


def test_received_attention_is_the_softmax_that_the_fused_kernel_applies(ckpt):
    """The explicit last-layer weights, multiplied by V, give what scaled_dot_product_attention gives."""
    llm = make_llm(ckpt)
    attn = llm.model.visual.blocks[-1].attn
    n, heads, dim = 12, attn.num_heads, attn.head_dim
    q, k, v = (torch.randn(n, heads, dim, generator=torch.Generator().manual_seed(i)) for i in range(3))
    weights = attention_weights(q, k)  # what received_attention averages
    whole = block_diagonal_attention(q, k, v, [q.shape[0]])  # one segment: plain bidirectional attention
    assert torch.allclose(torch.einsum("hqk,khd->qhd", weights, v), whole, atol=1e-5)
    image = llm.engine.prepare(chat_prompt("x", [random_image(84, 56, 1)]), GREEDY).images[0]
    tokens, received = llm.model.encode_images(image.pixel_values, [image.grid_thw], received_attention=True)
    assert received[0].shape == (image.num_tokens,)
    assert torch.allclose(received[0].sum() * 4, torch.tensor(1.0), atol=1e-5)  # patches' shares sum to 1
    assert torch.equal(tokens[0], llm.model.encode_images(image.pixel_values, [image.grid_thw])[0])


# -- positions and prompts --------------------------------------------------------------------------------


def test_kept_tokens_keep_their_grid_positions_and_the_text_resumes_after_the_grid():
    ids = [1, 9, 9, 9, 2, 3]  # text, 3 kept tokens of a 1x4x4 token grid (patch grid 8x8, merge 2), text
    coords = torch.tensor([[0, 0, 0], [0, 1, 3], [2, 0, 3]])  # (t, h, w) of the kept tokens
    positions, delta = mrope_positions(ids, [(1, 8, 8)], 9, 2, compressed=[(4, coords)])
    assert positions.tolist() == [[0, 1, 1, 1, 5, 6], [0, 1, 2, 4, 5, 6], [0, 3, 1, 4, 5, 6]]
    assert delta == 7 - 6


def test_a_request_overrides_the_engine_default_and_the_metrics_count_before_and_after(ckpt):
    llm = make_llm(ckpt, visual_token_compression=policy("pool", 0.25))
    image = random_image(112, 112, 3)  # a 4x4 token grid on the tiny preset
    default = chat_prompt("look", [image])
    override = dict(default, mm_processor_kwargs={"visual_token_compression": policy("prune", 0.5)})
    none = dict(default, mm_processor_kwargs={"visual_token_compression": None})
    outs = llm.generate([default, override, none], GREEDY)
    assert [o.metrics.num_visual_tokens for o in outs] == [4, 8, 16]
    assert [o.metrics.num_encoded_visual_tokens for o in outs] == [16, 16, 16]
    assert [llm.engine.prepare(p, GREEDY).token_ids.count(llm.model.config.image_token_id)
            for p in (default, override, none)] == [4, 8, 16]


def test_a_call_s_policy_applies_to_prompts_that_set_only_their_pixel_cap(ckpt):
    llm = make_llm(ckpt)
    image = random_image(112, 112, 3)  # a 4x4 token grid
    own_cap = dict(chat_prompt("look", [image]), mm_processor_kwargs={"max_pixels": 112 * 112})
    own_policy = dict(chat_prompt("look", [image]),
                      mm_processor_kwargs={"visual_token_compression": policy("prune", 0.5)})
    outs = llm.generate([own_cap, own_policy, chat_prompt("look", [image])], GREEDY,
                        mm_processor_kwargs={"visual_token_compression": policy("pool", 0.25)})
    assert [o.metrics.num_visual_tokens for o in outs] == [4, 8, 4]


@pytest.mark.parametrize("bad", [policy("fastv", 0.5), policy("prune", 0.0), {"keep_ratio": 0.5}])
def test_a_bad_request_policy_is_rejected_before_any_compute_and_leaks_nothing(ckpt, bad):
    llm = make_llm(ckpt)
    prompt = dict(chat_prompt("look", [random_image(56, 56, 1)]), mm_processor_kwargs={"visual_token_compression": bad})
    with pytest.raises(InvalidInputError, match="prompt 1: mm_processor_kwargs visual_token_compression"):
        llm.generate([chat_prompt("fine"), prompt], GREEDY)
    assert llm.engine.runner.visual_tokens_encoded == 0 and llm.engine.num_steps == 0
    with pytest.raises(InvalidInputError):
        llm.engine.add_request(prompt, GREEDY)
    assert_no_leaks(llm)


def test_a_bad_engine_policy_fails_at_construction(ckpt):
    with pytest.raises(InvalidInputError, match="unknown method 'fastv'"):
        make_llm(ckpt, visual_token_compression=policy("fastv", 0.5))
    with pytest.raises(ValueError, match="given twice"):
        make_llm(ckpt, visual_token_compression=policy("pool", 0.5),
                 mm_processor_kwargs={"visual_token_compression": policy("prune", 0.5)})
    same = make_llm(ckpt, visual_token_compression=policy("pool", 0.5),
                    mm_processor_kwargs={"visual_token_compression": policy("pool", 0.5)})
    assert same.engine.config.visual_token_compression == CompressionPolicy("pool", 0.5)
    llm = make_llm(ckpt, mm_processor_kwargs={"visual_token_compression": policy("pool", 0.5), "max_pixels": 12544})
    assert llm.engine.config.visual_token_compression == CompressionPolicy("pool", 0.5)


# -- caches: two policies never share tokens -------------------------------------------------------------


def test_two_policies_never_reuse_each_others_tokens(ckpt):
    """The same picture and text under three policies: every policy encodes on its own (encoder-cache misses) and
    finds no prefix-cache block past the text before the image; asked again, each hits its own entries."""
    llm = make_llm(ckpt, block_size=4)
    image = random_image(112, 112, 5)
    prompts = [dict(chat_prompt("what is it", [image]), mm_processor_kwargs={"visual_token_compression": p})
               for p in (policy("pool", 0.5), policy("prune", 0.5), policy("random", 0.5))]
    keys, hashes = set(), []
    for prompt in prompts:
        out = llm.generate(prompt, GREEDY)[0]
        assert out.metrics.encoder_cache_hits == 0
        assert out.outputs[0].token_ids == reference_tokens(llm, prompt, GREEDY)
        prepared = llm.engine.prepare(prompt, GREEDY)
        keys.add(llm.engine.encoder_cache_key_for(prepared.images[0]))
        span = prepared.image_spans[0]
        hashes.append(llm.engine.block_manager.block_hashes(prepared.token_ids, prepared.image_spans,
                                                            span.end // 4, [])[span.start // 4:])
        assert out.metrics.num_cached_tokens <= span.start  # nothing of another policy's image was reused
    assert len(keys) == 3
    for a, b in ((0, 1), (1, 2), (0, 2)):
        assert not set(hashes[a]) & set(hashes[b])
    for prompt in prompts:  # again: each policy finds its own tokens
        out = llm.generate(prompt, GREEDY)[0]
        assert out.metrics.num_cached_tokens > llm.engine.prepare(prompt, GREEDY).image_spans[0].end - 4


def test_keep_ratio_one_equals_no_compression_token_for_token(ckpt):
    llm = make_llm(ckpt)
    prompts = random_workload(seed=4, num_prompts=4)
    plain = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    again = make_llm(ckpt, visual_token_compression=policy("prune", 1.0))
    assert [o.outputs[0].token_ids for o in again.generate(prompts, GREEDY)] == plain
    assert again.stats()["encoder_cache_misses"] == llm.stats()["encoder_cache_misses"]


# -- the engine against the dense reference --------------------------------------------------------------

STRESS = {
    "chunked-tiny-budget": dict(block_size=16, max_num_batched_tokens=7),
    "preemption": dict(block_size=4, num_kv_blocks=36, max_num_batched_tokens=24),
    "prefix-cache-block-1": dict(block_size=1),
    "ngram-speculation": dict(speculative={"method": "ngram", "num_speculative_tokens": 3}),
    "encoder-cache-only": dict(enable_prefix_caching=False, max_num_batched_tokens=16),
}


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("setting", list(STRESS))
def test_the_engine_matches_the_reference_that_compresses_the_same_way(ckpt, method, setting):
    llm = make_llm(ckpt, visual_token_compression=policy(method, 0.5), **STRESS[setting])
    prompts = random_workload(seed=2, num_prompts=8)
    params = [SamplingParams(temperature=0.0 if i % 2 or "speculation" in setting else 0.8, top_k=40, seed=i,
                             max_tokens=4 + 3 * (i % 4), ignore_eos=True) for i in range(len(prompts))]
    outputs = assert_engine_matches_reference(llm, prompts, params)
    assert sum(o.metrics.num_visual_tokens for o in outputs) < sum(o.metrics.num_encoded_visual_tokens
                                                                   for o in outputs)
    if setting == "preemption":
        assert llm.stats()["preemptions"] > 0
    assert_engine_matches_reference(llm, prompts[:3], params[:3])  # again: prefixes or tokens from the caches
    stats = llm.stats()
    assert stats["encoder_cache_hits"] > 0 if setting == "encoder-cache-only" else stats["prefix_cache_hit_tokens"] > 0


@pytest.mark.parametrize("method", METHODS)
def test_compression_moves_the_answer_against_no_compression(ckpt, method):
    """The reference check above would pass if neither side compressed: here the logits must differ."""
    from nanomm.reference import generate
    llm = make_llm(ckpt, visual_token_compression=policy(method, 0.25))
    prompt = chat_prompt("describe", [random_image(112, 84, 9)])
    prepared = llm.engine.prepare(prompt, GREEDY)
    compressed = generate(llm.model, prepared.token_ids, prepared.images, GREEDY, keep_logits=True).logits[0]
    plain = make_llm(ckpt).engine.prepare(prompt, GREEDY)
    full = generate(llm.model, plain.token_ids, plain.images, GREEDY, keep_logits=True).logits[0]
    assert len(prepared.token_ids) < len(plain.token_ids) and not torch.allclose(compressed, full, atol=1e-4)


@pytest.fixture(scope="module")
def other_ckpt(tmp_path_factory):
    """Another random model with the same tokenizer and its own vision tower."""
    return make_checkpoint(tmp_path_factory.mktemp("other"), preset="tiny", seed=7)


@pytest.mark.parametrize("method", ["prune", "attention"])
def test_a_draft_model_with_its_own_tower_selects_its_own_tokens(ckpt, other_ckpt, method):
    """Draft speculation: the draft's tower picks by its own features, into its own encoder cache; the target
    stays exact."""
    llm = make_llm(ckpt, visual_token_compression=policy(method, 0.5),
                   speculative={"method": "draft", "model": str(other_ckpt), "num_speculative_tokens": 3})
    assert llm.engine.proposer.runner.encoder_cache is not llm.engine.encoder_cache
    prompts = random_workload(seed=5, num_prompts=5)
    outputs = assert_engine_matches_reference(llm, prompts, [GREEDY] * len(prompts))
    assert sum(o.metrics.num_draft_tokens for o in outputs) > 0


def test_the_pooled_features_are_what_the_reference_computes_from_the_tower(ckpt):
    """Pool on a real tower output, against F.avg_pool2d (an independent implementation) on an even grid."""
    llm = make_llm(ckpt)
    image = llm.engine.prepare(chat_prompt("x", [random_image(112, 112, 2)]), GREEDY).images[0]
    embeds = llm.model.encode_images(image.pixel_values, [image.grid_thw])[0]  # (16, hidden): a 4x4 grid
    pooled = compress(embeds, (1, 4, 4), CompressionPolicy("pool", 0.25)).embeds
    grid = embeds.view(4, 4, -1).permute(2, 0, 1)  # (hidden, 4, 4)
    expected = F.avg_pool2d(grid, 2).flatten(1).T  # (4, hidden)
    assert torch.allclose(pooled, expected, atol=1e-6)


# -- the planner -------------------------------------------------------------------------------------------


def test_the_planner_counts_the_tokens_a_policy_keeps_as_the_engine_does(ckpt):
    from nanomm.planner import load_configs, make_plan
    config, image_config = load_configs(str(ckpt))
    plain = make_plan(config, image_config)
    pruned = make_plan(config, image_config, visual_token_compression=policy("prune", 0.5))
    assert pruned.visual_tokens_worst == -(-plain.visual_tokens_worst // 2)  # ceil(tokens x 0.5)
    assert pruned.vision_peak_bytes == plain.vision_peak_bytes  # the tower still sees every token
    assert pruned.fit_worst > plain.fit_worst
    llm = make_llm(ckpt, visual_token_compression=policy("pool", 0.25))
    plan = llm.plan(typical_image=(300, 200))
    assert plan.compression == CompressionPolicy("pool", 0.25)
    prepared = llm.engine.prepare(chat_prompt("x", [random_image(300, 200, 1)]), GREEDY)
    assert plan.visual_tokens_typical == prepared.num_visual_tokens < prepared.images[0].num_encoded_tokens


def test_nanomm_plan_takes_a_compression_policy(ckpt, capsys):
    import json
    from nanomm.planner import main
    assert main([str(ckpt), "--compression", "pool:0.25", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["compression"] == {"method": "pool", "keep_ratio": 0.25}
    assert main([str(ckpt), "--json"]) == 0
    assert plan["visual_tokens_worst"] < json.loads(capsys.readouterr().out)["visual_tokens_worst"]
    with pytest.raises(SystemExit):
        main([str(ckpt), "--compression", "pool"])
    assert "write METHOD:KEEP_RATIO" in capsys.readouterr().err


def test_the_chunked_computations_equal_the_whole_ones(ckpt):
    """Large images go a chunk at a time (received attention by query rows, nearest neighbours by rows): the
    chunks give what one whole matrix gives."""
    unit = F.normalize(torch.randn(50, 8, generator=torch.Generator().manual_seed(0)), dim=-1)
    whole = 1 - unit @ unit.T + torch.eye(50) * 9
    assert torch.allclose(_nearest_neighbour_distances(unit, rows_per_chunk=7), whole.min(dim=1).values, atol=1e-6)
    llm = make_llm(ckpt)
    attn, cfg = llm.model.visual.blocks[-1].attn, llm.model.config.vision
    x = torch.randn(32, cfg.embed_dim, generator=torch.Generator().manual_seed(1))
    cos, sin = vision_cos_sin([(1, 4, 4), (1, 4, 4)], cfg.head_dim, cfg.rope_theta, cfg.spatial_merge_size)
    chunked = attn.received_attention(x, cos, sin, [16, 16], max_weights=attn.num_heads * 16 * 3)  # 3 rows a chunk
    assert torch.allclose(chunked, attn.received_attention(x, cos, sin, [16, 16]), atol=1e-6)
    q, k, _ = attn.qkv(x).view(32, 3, attn.num_heads, attn.head_dim).unbind(1)
    q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    by_hand = torch.cat([attention_weights(q[s:s + 16], k[s:s + 16]).mean(dim=(0, 1)) for s in (0, 16)])
    assert torch.allclose(chunked, by_hand, atol=1e-6) and torch.allclose(chunked.sum(), torch.tensor(2.0))
