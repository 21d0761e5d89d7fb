"""Speculative decoding: greedy outputs identical to the engine without it (and to the dense reference) under
batching, chunked prefill, preemption and prefix caching; rollback by position; the rejection-sampling rule
checked statistically (and shown to catch wrong rules); proposers; metrics; configuration errors."""

import random
import sys

import pytest
import torch

from helpers import (assert_engine_matches_reference, assert_no_leaks, chat_prompt, random_workload, reference_tokens,
                     run_to_completion)
from nanomm import LLM, SamplingParams
from nanomm.engine import speculative
from nanomm.tools.draft_checkpoint import make_draft_checkpoint
from nanomm.tools.random_checkpoint import make_checkpoint
from nanomm.errors import CheckpointError
from nanomm.reference import generate as reference_generate
from nanomm.sampling import probabilities
from nanomm.engine.sampler import accept_greedy
from nanomm.engine.speculative import Proposal, SpeculativeConfig, accept_sampled, ngram_lookup

MAX_PIXELS = 28 * 28 * 16
NGRAM = dict(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)


@pytest.fixture(scope="module")
def other_ckpt(tmp_path_factory):
    """A different random model with the same tokenizer: a deliberately bad draft."""
    return make_checkpoint(tmp_path_factory.mktemp("other"), preset="tiny", seed=7)


@pytest.fixture(scope="module")
def weak_ckpt(ckpt, tmp_path_factory):
    """The target's first decoder layer (of 2), its embeddings, head and vision tower: a draft that is often right."""
    return make_draft_checkpoint(ckpt, tmp_path_factory.mktemp("weak"), num_layers=1)


@pytest.fixture(scope="module")
def text_only_ckpt(ckpt, tmp_path_factory):
    """The whole target's language model as a text-only Qwen2 checkpoint (no vision tower)."""
    return make_draft_checkpoint(ckpt, tmp_path_factory.mktemp("text"), num_layers=2, text_only=True)


def make_llm(ckpt, speculative=None, **kwargs):
    kwargs.setdefault("max_pixels", MAX_PIXELS)
    return LLM(str(ckpt), device="cpu", dtype="float32", speculative=speculative, **kwargs)


def proposer_config(name, ckpt, other_ckpt):
    return {"ngram": NGRAM,
            "draft-identical": dict(method="draft", model=str(ckpt), num_speculative_tokens=3),
            "draft-bad": dict(method="draft", model=str(other_ckpt), num_speculative_tokens=2)}[name]


# -- the engine with speculation against the dense reference --------------------------------------------------

SETTINGS = {
    "default": dict(),
    "block-1": dict(block_size=1),
    "tiny-budget-chunked": dict(block_size=16, max_num_batched_tokens=7),
    "tiny-pool-preemption": dict(block_size=4, num_kv_blocks=40, max_num_batched_tokens=24),
    "no-prefix-cache": dict(enable_prefix_caching=False, block_size=2, max_num_batched_tokens=11),
    "few-seqs": dict(max_num_seqs=2, block_size=8),
}


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("proposer", ["ngram", "draft-identical", "draft-bad"])
def test_greedy_outputs_match_reference_in_mixed_batches(ckpt, other_ckpt, proposer, setting):
    llm = make_llm(ckpt, proposer_config(proposer, ckpt, other_ckpt), **SETTINGS[setting])
    prompts = random_workload(seed=2, num_prompts=8)
    greedy = [SamplingParams(temperature=0.0, max_tokens=6 + 5 * (i % 4), ignore_eos=True) for i in range(8)]
    # Seeded sampled requests share the batches: they must not disturb the greedy ones.
    sampled = [SamplingParams(temperature=0.9, top_k=20, max_tokens=8, seed=i, ignore_eos=True) for i in range(3)]
    outputs = llm.generate(prompts + prompts[:3], greedy + sampled)
    for i, (prompt, params, out) in enumerate(zip(prompts, greedy, outputs)):
        assert out.outputs[0].token_ids == reference_tokens(llm, prompt, params), f"prompt {i} differs"
    for out, params in zip(outputs, greedy + sampled):
        assert len(out.outputs[0].token_ids) == params.max_tokens
        assert out.metrics.num_decode_tokens + 1 == params.max_tokens  # every token after the first: a decode step
    assert_no_leaks(llm)
    stats = llm.stats()
    assert stats["spec_draft_tokens"] > 0
    if proposer == "draft-identical":
        assert all(o.metrics.acceptance_rate == 1.0 for o in outputs[:8] if o.metrics.num_draft_tokens)
    else:  # proposals are rejected (rollback ran); n-gram ones are also accepted (verification emitted several)
        assert stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]
        assert stats["spec_accepted_tokens"] > 0 or proposer == "draft-bad"
    if setting == "tiny-pool-preemption":
        assert stats["preemptions"] > 0


@pytest.mark.parametrize("proposer", ["ngram", "draft-bad"])
def test_same_outputs_as_engine_without_speculation(ckpt, other_ckpt, proposer):
    prompts = random_workload(seed=3, num_prompts=6)
    params = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)] * len(prompts)
    plain = make_llm(ckpt, block_size=4).generate(prompts, params)
    spec = make_llm(ckpt, proposer_config(proposer, ckpt, other_ckpt), block_size=4).generate(prompts, params)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]


def test_prefix_cache_hits_after_speculation_stay_exact(ckpt):
    """A second round of the same prompts reuses blocks written during speculative steps: only committed
    tokens were ever registered, so the hits are right."""
    llm = make_llm(ckpt, NGRAM, block_size=2)
    prompts = [chat_prompt(text) for text in ("the cat sat on the mat", "a dog looked at the sky", "red house")]
    params = [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)] * len(prompts)
    first = llm.generate(prompts, params)
    # Each prompt plus its output: the cached blocks include blocks of tokens generated speculatively.
    follow_ups = [{"prompt_token_ids": o.prompt_token_ids + o.outputs[0].token_ids} for o in first]
    outputs = assert_engine_matches_reference(llm, follow_ups, [params[0]] * len(follow_ups))
    assert llm.stats()["prefix_cache_hit_tokens"] > 0
    assert sum(o.metrics.num_cached_tokens for o in outputs) > 0
    assert_no_leaks(llm)


def test_identical_draft_accepts_everything(ckpt):
    llm = make_llm(ckpt, dict(method="draft", model=str(ckpt), num_speculative_tokens=4))
    prompts = [chat_prompt("the cat sat on the mat"), *random_workload(seed=5, num_prompts=3)]
    outputs = assert_engine_matches_reference(
        llm, prompts, [SamplingParams(temperature=0.0, max_tokens=21, ignore_eos=True)] * len(prompts))
    for out in outputs:
        assert out.metrics.num_draft_tokens == 20 - out.metrics.num_decode_steps  # k per step, less the last step's
        assert out.metrics.acceptance_rate == 1.0
        assert out.metrics.num_decode_steps == 4  # 20 decode tokens in 4 steps of 5
    assert llm.stats()["mean_tokens_per_decode_step"] == 5.0
    # Sampled: the draft's q and the target's p agree up to rounding, so (nearly) every proposal stands.
    sampled = llm.generate(prompts, [SamplingParams(temperature=1.0, max_tokens=21, seed=i, ignore_eos=True)
                                     for i in range(len(prompts))])
    assert sum(o.metrics.num_accepted_tokens for o in sampled) >= 0.99 * sum(o.metrics.num_draft_tokens for o in sampled)
    assert_no_leaks(llm)


def test_a_draft_with_the_target_s_vision_tower_shares_its_encoder_cache(ckpt, weak_ckpt, other_ckpt):
    # weak_ckpt keeps the target's vision tower bit for bit: the draft reads the target's visual tokens from the
    # target's cache, and encodes nothing. other_ckpt's tower differs: it keeps a cache (and encodes) of its own.
    prompts = random_workload(seed=11, num_prompts=4, max_images=2)
    num_images = sum(len(p["multi_modal_data"]["image"]) for p in prompts if isinstance(p, dict))
    assert num_images > 0
    params = [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)] * len(prompts)
    plain = [o.outputs[0].token_ids for o in make_llm(ckpt).generate(prompts, params)]
    for draft, shared in ((weak_ckpt, True), (other_ckpt, False)):
        llm = make_llm(ckpt, dict(method="draft", model=str(draft), num_speculative_tokens=3))
        proposer, encoded = llm.engine.proposer, []
        assert (proposer.runner.encoder_cache is llm.engine.encoder_cache) == shared
        tower = proposer.model.visual
        tower.forward = lambda pixels, grids, *rest, run=tower.forward: (encoded.extend(grids)
                                                                        or run(pixels, grids, *rest))
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == plain
        assert len(encoded) == (0 if shared else num_images)  # pictures the draft's own tower encoded
        assert_no_leaks(llm)


@pytest.mark.parametrize("draft", ["bad", "text-only"])
def test_draft_proposals_are_the_draft_models_own_continuation(ckpt, other_ckpt, text_only_ckpt, draft):
    """Whatever was rejected before, the draft's KV is rolled back right: every proposal is exactly what the
    draft model alone (dense reference, fresh cache) generates greedily from the request's committed tokens."""
    path = {"bad": other_ckpt, "text-only": text_only_ckpt}[draft]
    llm = make_llm(ckpt, dict(method="draft", model=str(path), num_speculative_tokens=3), block_size=2,
                   max_num_batched_tokens=16)
    proposer = llm.engine.proposer
    seen, propose = [], proposer.propose

    def recording(requests, budgets):
        proposals = propose(requests, budgets)
        seen.extend((r.prompt, list(r.token_ids), p.tokens) for r, p in zip(requests, proposals) if p.tokens)
        return proposals

    proposer.propose = recording
    prompts = random_workload(seed=8, num_prompts=4, max_images=2)
    outputs = assert_engine_matches_reference(
        llm, prompts, [SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)] * len(prompts))
    assert sum(o.metrics.num_draft_tokens - o.metrics.num_accepted_tokens for o in outputs) > 10  # rejections
    assert len(seen) > 10
    for prompt, tokens, proposed in seen:
        images = prompt.images if proposer.sees_images else ()
        expected = reference_generate(proposer.model, tokens, images, SamplingParams(temperature=0.0,
                                      max_tokens=len(proposed), ignore_eos=True)).token_ids
        assert proposed == expected
    assert_no_leaks(llm)


# -- rollback -------------------------------------------------------------------------------------------------

class WrongProposer:
    """Proposes the same unlikely token k times: the target rejects (almost) all of it."""

    def __init__(self, token, k):
        self.token, self.k = token, k

    def propose(self, requests, budgets):
        return [Proposal([self.token] * min(self.k, b)) for b in budgets]

    def release(self, request):
        pass

    def check_no_leaks(self):
        pass


def test_rejected_positions_roll_back_blocks_and_hashes(ckpt):
    llm = make_llm(ckpt, NGRAM, block_size=2, max_num_batched_tokens=64)
    engine = llm.engine
    engine.proposer = WrongProposer(token=3, k=6)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompt = chat_prompt("a b c d e f g")
    request_id = engine.add_request(prompt, params)
    request = engine.requests[request_id]
    engine.step()  # prefill + first token
    rejected_somewhere = False
    for _ in range(100):  # bounded: max_tokens steps at most
        engine.step()
        if request.status.value == "finished":
            break
        accepted = request.metrics.num_accepted_tokens
        # Only the committed tokens keep blocks, and only full committed blocks are named for the prefix cache.
        assert len(request.block_table) == engine.block_manager.blocks_needed(request.num_computed_tokens)
        assert request.num_computed_tokens == request.num_tokens - 1
        assert len(engine.block_manager.cached) == request.num_computed_tokens // 2
        rejected_somewhere |= request.metrics.num_draft_tokens > accepted
    assert request.status.value == "finished"
    assert rejected_somewhere
    assert_no_leaks(llm)
    out = llm.generate(prompt, params)[0]  # and the tokens are still the reference's
    assert out.outputs[0].token_ids == reference_tokens(llm, prompt, params)


def test_stop_token_inside_accepted_proposals_ends_there(ckpt):
    """A stop token among accepted proposals ends the request at that token; later ones are dropped."""
    llm = make_llm(ckpt, dict(method="draft", model=str(ckpt), num_speculative_tokens=4))
    prompt = chat_prompt("the cat sat")
    free_run = reference_tokens(llm, prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    stop = free_run[6]
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop],
                                              ignore_eos=True))[0]
    assert out.outputs[0].token_ids == free_run[:free_run.index(stop) + 1]
    assert out.outputs[0].finish_reason == "stop"
    assert_no_leaks(llm)


def stream_steps(engine, prompt, params) -> list[list[int]]:
    """The tokens each step emitted for one request, step by step."""
    request_id, steps = engine.add_request(prompt, params), []
    for _ in range(200):
        for out in engine.step():
            if out.request_id == request_id and out.outputs[0].delta_token_ids:
                steps.append(out.outputs[0].delta_token_ids)
        if not engine.has_unfinished_requests():
            return steps
    raise AssertionError("the request did not finish")


@pytest.mark.parametrize("stop_kind", ["stop_token_ids", "eos"])
def test_stop_or_eos_inside_accepted_proposals_of_a_sampled_request(ckpt, stop_kind):
    """Sampled, with a draft identical to the target (every proposal accepted, several tokens per step): a stop
    token that arrives in the middle of a step's tokens ends the request right there; the rest of that step's
    tokens are dropped, and the stream before it is the same as without the stop token."""
    llm = make_llm(ckpt, dict(method="draft", model=str(ckpt), num_speculative_tokens=4))
    prompt = chat_prompt("the cat sat on")
    sampled = dict(temperature=0.8, top_k=5, max_tokens=16, seed=7)
    steps = stream_steps(llm.engine, prompt, SamplingParams(ignore_eos=True, **sampled))
    tokens = [t for step in steps for t in step]
    # A token that first appears inside a step of several tokens, not at the step's end.
    before = 0
    for step in steps:
        middle = [i for i, t in enumerate(step[:-1]) if t not in tokens[:before + i]]
        if middle:
            stop, end = step[middle[0]], before + middle[0] + 1
            break
        before += len(step)
    else:
        raise AssertionError(f"no step emitted a new token before its last one: {steps}")
    if stop_kind == "eos":
        llm.engine.tokenizer.eos_token_ids = [stop]  # this checkpoint's "end of sequence", for this test
        params = SamplingParams(**sampled)
    else:
        params = SamplingParams(stop_token_ids=[stop], ignore_eos=True, **sampled)
    out = llm.generate(prompt, params)[0]
    assert out.outputs[0].token_ids == tokens[:end] and out.outputs[0].finish_reason == "stop"
    assert_no_leaks(llm)


# -- acceptance rules -------------------------------------------------------------------------------------------

def test_accept_greedy_keeps_the_matching_prefix_and_adds_one():
    assert accept_greedy([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]  # all accepted + bonus
    assert accept_greedy([5, 6, 7], [5, 9, 7, 8]) == [5, 9]  # correction at the first mismatch
    assert accept_greedy([5, 6, 7], [1, 6, 7, 8]) == [1]
    assert accept_greedy([], [4]) == [4]


def chi_square_p_value(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """Pearson's chi-square goodness of fit; cells expecting fewer than 5 are pooled into one."""
    n = counts.sum()
    expected = expected_probs * n
    small = expected < 5
    if small.any():
        counts = torch.cat([counts[~small], counts[small].sum(0, keepdim=True)])
        expected = torch.cat([expected[~small], expected[small].sum(0, keepdim=True)])
    statistic = ((counts - expected) ** 2 / expected).sum()
    dof = len(counts) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), statistic.double() / 2))


# A target and a draft over 4 tokens whose next-token distributions depend on the previous token (Markov
# chains): row a of M is the target's p(. | a), row a of N the draft's q(. | a). Each row of p and q in a
# verification step is then different, so a rule that reads the wrong row cannot pass.
M = torch.tensor([[0.50, 0.30, 0.15, 0.05],
                  [0.10, 0.20, 0.30, 0.40],
                  [0.25, 0.25, 0.25, 0.25],
                  [0.05, 0.05, 0.10, 0.80]], dtype=torch.float64)
N = torch.tensor([[0.10, 0.20, 0.30, 0.40],
                  [0.40, 0.30, 0.20, 0.10],
                  [0.70, 0.10, 0.10, 0.10],
                  [0.25, 0.25, 0.25, 0.25]], dtype=torch.float64)


def transition_counts(num_tokens: int, k: int, deterministic_draft: bool, seed: int = 0) -> torch.Tensor:
    """Speculative steps against the Markov target M: counts of (token, next token) over the emitted stream,
    which must follow M whatever the draft. A deterministic draft proposes (previous token + 1) mod 4."""
    g = torch.Generator().manual_seed(seed)
    stream = [0]
    while len(stream) < num_tokens:
        proposed, q_rows = [], []
        for _ in range(k):
            last = (proposed or stream)[-1]
            token = (last + 1) % 4 if deterministic_draft else int(torch.multinomial(N[last], 1, generator=g))
            proposed.append(token)
            q_rows.append(N[last])
        p_rows = M[[stream[-1]] + proposed]  # (k + 1, vocab): p after the last token, then after each proposal
        stream += accept_sampled(proposed, p_rows, None if deterministic_draft else torch.stack(q_rows), g)
    pairs = torch.tensor(stream[:num_tokens])
    return torch.bincount(pairs[:-1] * 4 + pairs[1:], minlength=16).double().view(4, 4)


def markov_p_value(counts: torch.Tensor) -> float:
    """Chi-square of every row of transition counts against M's row (the rows' totals as given)."""
    expected = (counts.sum(1, keepdim=True) * M).flatten()
    return chi_square_p_value(counts.flatten(), expected / expected.sum())


WRONG_RULES = {
    "always-accept": dict(acceptance_probability=lambda p_x, q_x: torch.ones_like(p_x)),
    "accept-with-p": dict(acceptance_probability=lambda p_x, q_x: p_x),
    "resample-from-p": dict(residual_distribution=lambda p, q: p),
}


@pytest.mark.parametrize("draft", ["sampled-draft", "deterministic"])
def test_rejection_sampling_reproduces_the_target_distribution(draft):
    counts = transition_counts(40000, k=3, deterministic_draft=draft == "deterministic")
    assert markov_p_value(counts) > 1e-3


@pytest.mark.parametrize("rule", list(WRONG_RULES))
def test_chi_square_catches_a_wrong_acceptance_rule(monkeypatch, rule):
    for name, wrong in WRONG_RULES[rule].items():
        monkeypatch.setattr(speculative, name, wrong)
    assert markov_p_value(transition_counts(40000, k=3, deterministic_draft=False)) < 1e-6


def test_chi_square_catches_a_bonus_token_from_the_wrong_row(monkeypatch):
    right = speculative.accept_sampled

    def bonus_from_first_row(proposed, target_probs, draft_probs, generator):
        emitted = right(proposed, target_probs, draft_probs, generator)
        if len(emitted) == len(proposed) + 1:  # all accepted: redraw the bonus from row 0 instead of row k
            emitted[-1] = int(torch.multinomial(target_probs[0], 1, generator=generator))
        return emitted

    monkeypatch.setattr(sys.modules[__name__], "accept_sampled", bonus_from_first_row)
    assert markov_p_value(transition_counts(40000, k=3, deterministic_draft=False)) < 1e-6


def test_without_proposals_accept_sampled_is_plain_sampling():
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    draws = [accept_sampled([], M[:1], None, g1)[0] for _ in range(50)]
    # Plain sampling, written out: the generator's next float32 in [0, 1), then the first token whose cumulative
    # probability passes it.
    cumulative = M[0].double().cumsum(0).tolist()
    expected = []
    for _ in range(50):
        target = torch.rand(1, generator=g2).item() * cumulative[-1]
        expected.append(next(i for i, c in enumerate(cumulative) if c > target))
    assert draws == expected and len(set(draws)) > 1


def test_residual_of_p_and_q_a_rounding_error_apart_falls_back_to_p():
    p = torch.tensor([0.5, 0.5])
    q = torch.tensor([0.50000006, 0.5])  # p - q <= 0 everywhere in float32
    assert torch.equal(speculative.residual_distribution(p, q), p)


def target_joint_distribution(llm, prompt_ids, params, length=3):
    """P(t1, ..., t_length) of the target model under params, from the dense reference's logits: a dict over
    the sequences with non-zero probability (top-k keeps it small)."""
    model, greedy_one = llm.model, SamplingParams(temperature=0.0, max_tokens=1)

    def next_probs(ids):
        logits = reference_generate(model, ids, (), greedy_one, keep_logits=True).logits[0]
        return probabilities(logits.double(), params)

    joint = {(): 1.0}
    for _ in range(length):
        joint = {seq + (t,): prob * float(p[t]) for seq, prob in joint.items()
                 for p in [next_probs(prompt_ids + list(seq))] for t in p.nonzero().flatten().tolist()}
    return joint


def engine_sample_p_value(llm, prompt, params_list, joint) -> float:
    outputs = llm.generate([prompt] * len(params_list), params_list)
    cells = sorted(joint)
    length = len(cells[0])
    counts = torch.zeros(len(cells), dtype=torch.float64)
    for out in outputs:
        seq = tuple(out.outputs[0].token_ids[:length])
        if seq not in joint:
            return 0.0  # a sequence the target can never produce
        counts[cells.index(seq)] += 1
    return chi_square_p_value(counts, torch.tensor([joint[c] for c in cells], dtype=torch.float64))


@pytest.mark.slow
@pytest.mark.parametrize("proposer", ["draft-weak", "ngram"])
def test_engine_sampled_distribution_matches_target(ckpt, weak_ckpt, monkeypatch, proposer):
    """Many seeded requests through the engine with speculation: the first three tokens follow the target's
    exact joint distribution (chi-square), and the same test fails with a wrong acceptance rule. Token 1 comes
    from the prefill; with one proposal per step, token 2 is an accepted proposal or a draw from the residual,
    and token 3 the bonus after an acceptance, or the next step's."""
    spec = (dict(NGRAM, num_speculative_tokens=1) if proposer == "ngram"
            else dict(method="draft", model=str(weak_ckpt), num_speculative_tokens=1))
    llm = make_llm(ckpt, spec, max_num_seqs=256, block_size=4)
    prompt_ids = llm.engine.prepare(chat_prompt("red blue red blue red blue"), None).token_ids
    # The model's own greedy continuation, appended: it loops, so prompt lookup finds proposals that often hold.
    prompt_ids += reference_generate(llm.model, prompt_ids, (), SamplingParams(temperature=0, max_tokens=48)).token_ids
    prompt = {"prompt_token_ids": prompt_ids}
    params = [SamplingParams(temperature=1.5, top_k=3, max_tokens=4, seed=i, ignore_eos=True) for i in range(2000)]
    joint = target_joint_distribution(llm, prompt_ids, params[0])
    assert engine_sample_p_value(llm, prompt, params, joint) > 1e-3
    stats = llm.stats()
    assert stats["spec_draft_tokens"] > 500 and 200 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]
    monkeypatch.setattr(speculative, "acceptance_probability", lambda p_x, q_x: torch.ones_like(p_x))
    assert engine_sample_p_value(make_llm(ckpt, spec, max_num_seqs=256, block_size=4), prompt, params, joint) < 1e-6


# -- proposers ----------------------------------------------------------------------------------------------------

def test_ngram_lookup():
    # The longest suffix that occurred before wins, at its most recent earlier occurrence.
    assert ngram_lookup([1, 2, 3, 9, 1, 2, 3, 7, 5, 2, 3], k=2, min_n=1, max_n=3) == [7, 5]
    assert ngram_lookup([4, 2, 3, 8, 1, 2, 3], k=3, min_n=1, max_n=3) == [8, 1, 2]
    assert ngram_lookup([1, 2, 3, 4], k=2, min_n=1, max_n=3) == []  # the last token never occurred before
    assert ngram_lookup([5, 1, 2, 6, 2], k=2, min_n=2, max_n=3) == []  # only a 1-gram matches; min is 2
    # A short cycle continues for all k tokens (the copy runs into its own proposals).
    assert ngram_lookup([7, 1, 2, 1, 2], k=5, min_n=2, max_n=2) == [1, 2, 1, 2, 1]
    assert ngram_lookup([3], k=2, min_n=1, max_n=3) == []


def obvious_ngram_lookup(token_ids, k, min_n, max_n):
    """The same rule as ngram_lookup, written as plainly as possible: the oracle for its byte search."""
    for n in range(min(max_n, len(token_ids) - 1), min_n - 1, -1):
        for start in range(len(token_ids) - n - 1, -1, -1):
            if token_ids[start:start + n] == token_ids[-n:]:
                sequence = list(token_ids)
                for i in range(k):
                    sequence.append(sequence[start + n + i])
                return sequence[len(token_ids):]
    return []


def test_ngram_lookup_byte_search_matches_the_obvious_loop():
    rng = random.Random(0)
    # Ids like 256 and 65536 share bytes with 0 and 1: a byte match that straddles two tokens must not count.
    alphabet = [0, 1, 2, 256, 65536, 2**20, 151655]
    for _ in range(5000):
        tokens = [rng.choice(alphabet) for _ in range(rng.randrange(0, 40))]
        k, min_n = rng.randrange(1, 6), rng.randrange(1, 4)
        max_n = rng.randrange(min_n, 5)
        assert ngram_lookup(tokens, k, min_n, max_n) == obvious_ngram_lookup(tokens, k, min_n, max_n), tokens


def test_proposals_stop_at_max_tokens_and_max_model_len(ckpt):
    llm = make_llm(ckpt, dict(method="draft", model=str(ckpt), num_speculative_tokens=8), max_model_len=64)
    prompt = chat_prompt("hello there")
    n_prompt = len(llm.engine.prepare(prompt, None).token_ids)
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 7 and out.metrics.num_draft_tokens == 5  # 6 left after the first: 5 + bonus
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))[0]
    assert n_prompt + len(out.outputs[0].token_ids) == 64 and out.outputs[0].finish_reason == "length"
    assert_no_leaks(llm)


def test_draft_without_room_in_its_pool_just_proposes_nothing(ckpt):
    llm = make_llm(ckpt, dict(method="draft", model=str(ckpt), num_speculative_tokens=3), block_size=4)
    draft = llm.engine.proposer
    taken = draft.block_manager.allocate(draft.block_manager.num_free_blocks - 2)  # someone else holds almost all
    prompt = chat_prompt("a much longer prompt than two blocks of four tokens can hold")
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    out = llm.generate(prompt, params)[0]
    assert out.outputs[0].token_ids == reference_tokens(llm, prompt, params)
    assert out.metrics.num_draft_tokens == 0
    assert not draft.sequences
    draft.block_manager.free(taken)  # the test's own hold, given back for the leak check


# -- configuration -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bad,message", [
    ({"method": "medusa", "num_speculative_tokens": 2}, "method"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2.5}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "larger"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 0}, "prompt_lookup_max"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "not for method 'ngram'"),
    ({"method": "draft", "num_speculative_tokens": 2}, "model"),
    ({"method": "draft", "model": "x", "num_speculative_tokens": 2, "prompt_lookup_max": 0}, "not for method 'draft'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "lookahead"),
    ({"method": "ngram"}, "num_speculative_tokens is required"),
    ("ngram", "dict"),
])
def test_bad_speculative_config_raises(ckpt, bad, message):
    with pytest.raises(ValueError, match=message):
        make_llm(ckpt, bad)


def test_missing_draft_checkpoint_is_a_clear_error(ckpt, tmp_path):
    with pytest.raises(CheckpointError, match="no such checkpoint"):
        make_llm(ckpt, {"method": "draft", "model": str(tmp_path / "nope"), "num_speculative_tokens": 2})


def test_config_defaults():
    config = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4})
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (2, 4)


def test_text_only_draft_sees_image_pads_and_stays_exact(ckpt, text_only_ckpt):
    """A Qwen2 (text-only) draft: on text prompts it is the target's language model exactly, so it is always
    right; on image prompts it sees <|image_pad|> tokens instead of the picture, guesses worse, and the
    output is still the target's."""
    llm = make_llm(ckpt, dict(method="draft", model=str(text_only_ckpt), num_speculative_tokens=3))
    assert llm.engine.proposer.model.visual is None
    params = SamplingParams(temperature=0.0, max_tokens=13, ignore_eos=True)
    text = assert_engine_matches_reference(llm, [chat_prompt("the cat sat on the mat")], [params])[0]
    assert text.metrics.acceptance_rate == 1.0
    images = random_workload(seed=6, num_prompts=4, max_images=2)
    outputs = assert_engine_matches_reference(llm, images, [params] * len(images))
    assert sum(o.metrics.num_draft_tokens for o in outputs) > 0
    assert_no_leaks(llm)


def test_text_only_model_cannot_be_the_target(text_only_ckpt):
    with pytest.raises(CheckpointError, match="text-only"):
        make_llm(text_only_ckpt)


def test_draft_with_a_smaller_vocabulary_skips_ids_it_lacks(ckpt, tmp_path):
    """A target whose vocabulary is wider than the draft's (151936 vs 152064 in real pairs): ids past the
    draft's end, in the prompt or generated, make the draft stand aside for that request; nothing crashes."""
    draft_vocab = llm_vocab = make_llm(ckpt).model.config.text.vocab_size
    wide = make_checkpoint(tmp_path / "wide", preset="tiny", overrides={"vocab_size": llm_vocab + 256})
    llm = make_llm(wide, dict(method="draft", model=str(ckpt), num_speculative_tokens=3))
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    prompts = [{"prompt_token_ids": [1, 2, 3, draft_vocab + 5, 4, 5]}, {"prompt_token_ids": [1, 2, 3, 4, 5]}]
    outputs = assert_engine_matches_reference(llm, prompts, [params] * 2)
    assert any(t >= draft_vocab for t in outputs[1].outputs[0].token_ids)  # the target generated one too
    assert outputs[0].metrics.num_draft_tokens == 0
    assert_no_leaks(llm)


def test_abort_during_speculation_frees_both_pools(ckpt, other_ckpt):
    llm = make_llm(ckpt, dict(method="draft", model=str(other_ckpt), num_speculative_tokens=3), block_size=2)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    prompts = random_workload(seed=9, num_prompts=3, max_images=1)
    ids = [engine.add_request(p, params) for p in prompts]
    for _ in range(200):  # bounded: the first two start decoding within a few steps
        if all(engine.requests.get(i) and engine.requests[i].metrics.num_draft_tokens for i in ids[:2]):
            break
        engine.step()
    assert engine.proposer.sequences  # the draft holds state for the running requests
    engine.abort_request(ids[0])
    finished = run_to_completion(engine)
    assert finished[ids[0]].outputs[0].finish_reason == "abort"
    for i in ids[1:]:
        assert finished[i].outputs[0].token_ids == reference_tokens(llm, prompts[ids.index(i)], params)
    assert not engine.proposer.sequences
    assert_no_leaks(llm)


def test_proposals_never_cause_preemption(ckpt):
    """Proposals are optional: a decode that fits without them is never preempted (nor makes others be) for
    their sake, even when every proposal is wrong and the pool is tight."""
    prompts = [chat_prompt("a b c d e f g h i j"), chat_prompt("k l m n o p q r s t"), chat_prompt("u v w x")]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    for num_kv_blocks in (20, 26, 32):
        counts = []
        for k in (0, 6):  # no proposals (the plain engine), then 6 wrong ones every step
            llm = make_llm(ckpt, NGRAM, block_size=4, num_kv_blocks=num_kv_blocks, enable_prefix_caching=False)
            llm.engine.proposer = WrongProposer(token=3, k=k)
            outputs = llm.generate(prompts, params)
            counts.append(llm.stats()["preemptions"])
            assert [o.outputs[0].token_ids for o in outputs] == [reference_tokens(llm, p, params) for p in prompts]
        assert counts[1] <= counts[0], f"{num_kv_blocks} blocks: {counts[0]} preemptions plain, {counts[1]} with proposals"


def test_rejected_proposals_do_not_evict_the_prefix_cache(ckpt, other_ckpt):
    """Blocks freed by rollback hold nothing findable, so they are handed out again before any cached block."""
    cached = []
    prompt, other = chat_prompt("the quick brown fox jumps over the lazy dog and runs far"), chat_prompt("x y z")
    for spec in (None, dict(method="draft", model=str(other_ckpt), num_speculative_tokens=3)):
        llm = make_llm(ckpt, spec, block_size=4, num_kv_blocks=60)
        llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
        llm.generate(other, SamplingParams(temperature=0.0, max_tokens=150, ignore_eos=True))
        cached.append(llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=2))[0].metrics.num_cached_tokens)
    assert cached[1] == cached[0] > 0
