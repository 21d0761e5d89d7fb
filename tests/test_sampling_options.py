"""vLLM's sampling surface: each SamplingParams option against transformers' logits processors or an obvious
reference written here, through the greedy path, the batched sampler and speculative verification."""

import pytest
import torch
import transformers
from transformers import (MinNewTokensLengthLogitsProcessor, MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                          TemperatureLogitsWarper)

from helpers import (assert_no_leaks, chat_prompt, force_first_token, random_image, reference_tokens,
                     run_to_completion)
from nanomm import LLM, InvalidInputError, SamplingParams
from nanomm.engine import speculative
from nanomm.reference import generate as reference_generate
from nanomm.sampling import adjust_logits, probabilities

VOCAB = 50
NGRAM = dict(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)


def make_llm(ckpt, **kwargs):
    kwargs.setdefault("max_pixels", 28 * 28 * 16)
    return LLM(str(ckpt), device="cpu", dtype="float32", **kwargs)


@pytest.fixture(scope="module")
def oracle(ckpt):
    return transformers.Qwen2VLForConditionalGeneration.from_pretrained(
        ckpt, dtype=torch.float32, attn_implementation="eager").eval()


# -- the logits processors, one at a time, against transformers and plain loops ------------------------------

def test_repetition_penalty_is_transformers_rule():
    g = torch.Generator().manual_seed(0)
    logits, prompt, output = torch.randn(VOCAB, generator=g) * 3, [3, 7, 7, 20], [20, 41, 2]
    expected = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([prompt + output]), logits[None].clone())[0]
    got = adjust_logits(logits, SamplingParams(repetition_penalty=1.7), prompt, output)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert not torch.equal(got, logits)


def test_frequency_and_presence_penalties_follow_openai():
    g = torch.Generator().manual_seed(1)
    logits, output = torch.randn(VOCAB, generator=g), [4, 4, 4, 9, 30, 9]
    got = adjust_logits(logits, SamplingParams(frequency_penalty=0.5, presence_penalty=-1.25), [4, 5], output)
    expected = logits.clone()
    for token in range(VOCAB):  # OpenAI: logit - count * frequency - (count > 0) * presence; output tokens only
        count = output.count(token)
        expected[token] -= count * 0.5 + (1 if count else 0) * -1.25
    torch.testing.assert_close(got, expected)
    assert got[5] == logits[5]  # a prompt token alone is not penalised


def test_min_tokens_masks_the_stop_tokens_like_transformers():
    g = torch.Generator().manual_seed(2)
    logits, prompt = torch.randn(VOCAB, generator=g), [1, 2, 3]
    params = SamplingParams(min_tokens=3)
    for output in ([], [5], [5, 6], [5, 6, 7]):
        processor = MinNewTokensLengthLogitsProcessor(len(prompt), 3, eos_token_id=[11, 12])
        expected = processor(torch.tensor([prompt + output]), logits[None].clone())[0]
        torch.testing.assert_close(adjust_logits(logits, params, prompt, output, {11, 12}), expected)
    assert adjust_logits(logits, params, prompt, [], {11})[11] == float("-inf")


@pytest.mark.parametrize("temperature, min_p", [(1.0, 0.1), (0.7, 0.3), (1.3, 0.05)])
def test_min_p_is_transformers_rule_after_temperature(temperature, min_p):
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, VOCAB, generator=g) * 2
    scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
    expected = torch.softmax(MinPLogitsWarper(min_p)(None, scores), dim=-1)
    got = probabilities(logits, SamplingParams(temperature=temperature, min_p=min_p))
    torch.testing.assert_close(got, expected)
    assert (got == 0).any()


@pytest.mark.parametrize("bad", [dict(n=0), dict(presence_penalty=2.5), dict(frequency_penalty=float("nan")),
                                 dict(repetition_penalty=0), dict(min_p=1.5), dict(stop=""), dict(stop=[3]),
                                 dict(min_tokens=-1), dict(min_tokens=20, max_tokens=5), dict(logprobs=-2),
                                 dict(prompt_logprobs=1.5), dict(skip_special_tokens="no"),
                                 dict(include_stop_str_in_output=1)])
def test_bad_values_are_invalid_input(bad):
    with pytest.raises(InvalidInputError):
        SamplingParams(**bad)


# -- penalties through the engine: transformers' generate is the oracle -----------------------------------------

def oracle_generate(oracle, ids: list[int], images=(), **kwargs) -> list[int]:
    input_ids = torch.tensor([ids])
    inputs = dict(input_ids=input_ids, attention_mask=torch.ones_like(input_ids))
    if images:
        inputs.update(pixel_values=torch.cat([im.pixel_values for im in images]),
                      image_grid_thw=torch.tensor([list(im.grid_thw) for im in images]),
                      mm_token_type_ids=(input_ids == oracle.config.image_token_id).int())
    with torch.no_grad():
        out = oracle.generate(**inputs, do_sample=False, **kwargs)
    return out[0, len(ids):].tolist()


def test_repetition_penalty_greedy_matches_transformers_generate(ckpt, oracle):
    llm = make_llm(ckpt)
    prompt = chat_prompt("red blue red blue red blue green")
    ids = llm.engine.prepare(prompt, None).token_ids
    params = SamplingParams(temperature=0, repetition_penalty=1.3, max_tokens=24, ignore_eos=True)
    ours = llm.generate(prompt, params)[0].outputs[0].token_ids
    assert ours == oracle_generate(oracle, ids, max_new_tokens=24, repetition_penalty=1.3, eos_token_id=None)
    plain = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
    assert plain.outputs[0].token_ids != ours  # the penalty changed something here
    assert_no_leaks(llm)


def test_repetition_penalty_with_an_image_matches_transformers_generate(ckpt, oracle):
    """The penalty reads the prompt as transformers' input_ids hold it: every <|image_pad|> included. Below 1 it
    favours the tokens seen, so here the model ends up generating <|image_pad|> itself, as transformers does."""
    llm = make_llm(ckpt)
    prompt = chat_prompt("what is this? red blue red", [random_image(84, 56, 8)])
    prepared = llm.engine.prepare(prompt, None)
    params = SamplingParams(temperature=0, repetition_penalty=0.3, max_tokens=24, ignore_eos=True)
    ours = llm.generate(prompt, params)[0].outputs[0].token_ids
    assert ours == oracle_generate(oracle, prepared.token_ids, prepared.images, max_new_tokens=24,
                                   repetition_penalty=0.3, eos_token_id=None)
    assert llm.model.config.image_token_id in ours  # the pads' penalty decided a token
    plain = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
    assert plain.outputs[0].token_ids != ours  # the penalty changed something here
    assert_no_leaks(llm)


def test_min_tokens_matches_transformers_min_new_tokens(ckpt, oracle):
    llm = make_llm(ckpt)
    prompt = chat_prompt("a cat sat on the mat")
    ids = llm.engine.prepare(prompt, None).token_ids
    first = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1))[0].outputs[0].token_ids[0]
    params = SamplingParams(temperature=0, stop_token_ids=[first], ignore_eos=True, min_tokens=4, max_tokens=30)
    out = llm.generate(prompt, params)[0].outputs[0]
    expected = oracle_generate(oracle, ids, max_new_tokens=30, min_new_tokens=4, eos_token_id=first)
    assert out.token_ids == expected and len(out.token_ids) > 4
    without = llm.generate(prompt, SamplingParams(temperature=0, stop_token_ids=[first], ignore_eos=True))[0]
    assert without.outputs[0].token_ids == [first] and without.outputs[0].stop_reason == first


PENALTIES = {
    "repetition": dict(repetition_penalty=1.4),
    "frequency+presence": dict(frequency_penalty=1.5, presence_penalty=0.8),
    "min_tokens": dict(min_tokens=6),
}
STRESS = {"default": dict(), "block-1-tiny-budget": dict(block_size=1, max_num_batched_tokens=9),
          "ngram": dict(speculative_config=NGRAM), "draft": "draft"}


@pytest.mark.parametrize("setting", STRESS)
@pytest.mark.parametrize("penalty", PENALTIES)
def test_engine_with_penalties_matches_reference(ckpt, setting, penalty):
    """Greedy with each penalty, under batching, chunking and speculation (proposals are verified with the
    history each position would have had): token for token the dense reference's."""
    engine_args = dict(speculative_config=dict(method="draft", model=str(ckpt), num_speculative_tokens=3)) \
        if setting == "draft" else STRESS[setting]
    llm = make_llm(ckpt, **engine_args)
    prompts = [chat_prompt("red blue red blue red", [random_image(56, 56, 4)]), chat_prompt("the cat the cat the"),
               chat_prompt("a dog", [random_image(84, 56, 5), random_image(28, 56, 6)])]
    params = SamplingParams(temperature=0, max_tokens=20, **PENALTIES[penalty])
    outputs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outputs):
        assert out.outputs[0].token_ids == reference_tokens(llm, prompt, params)
    if setting == "draft":  # (penalties break the loops prompt lookup feeds on: n-gram proposals are rare here)
        assert llm.stats()["spec_accepted_tokens"] > 0
    assert_no_leaks(llm)


def vllm_order_probabilities(logits, temperature, min_p, top_k, top_p):
    """vLLM's order, written out: temperature, then min_p (against the most likely token), then top-k, then
    top-p (the most likely tokens, one by one, until their probabilities add up to top_p)."""
    scaled = logits / temperature
    probs = torch.softmax(scaled, dim=-1)
    scaled = torch.where(probs < min_p * probs.max(), float("-inf"), scaled)
    kth = torch.sort(scaled, descending=True).values[top_k - 1]
    probs = torch.softmax(torch.where(scaled < kth, float("-inf"), scaled), dim=-1)
    kept, total = torch.zeros_like(probs, dtype=torch.bool), 0.0
    for token in torch.argsort(probs, descending=True).tolist():
        kept[token], total = True, total + float(probs[token])
        if total >= top_p:
            break
    return torch.softmax(torch.where(kept, scaled, float("-inf")), dim=-1)


def test_sampled_verification_uses_each_positions_history(ckpt, monkeypatch):
    """Sampled speculation with penalties: the distribution verified at each proposed position is the one plain
    decoding would use there, penalties recomputed with the proposals before it (checked with a plain loop)."""
    llm = make_llm(ckpt, speculative_config=dict(method="draft", model=str(ckpt), num_speculative_tokens=3))
    params = SamplingParams(temperature=0.8, frequency_penalty=1.0, repetition_penalty=1.2, min_p=0.02, top_k=40,
                            top_p=0.9, max_tokens=16, seed=3)
    seen = []
    accept = speculative.accept_sampled

    def recording(proposed, p, q, generator):
        seen.append((list(proposed), p.clone()))
        return accept(proposed, p, q, generator)

    monkeypatch.setattr(speculative, "accept_sampled", recording)  # what the sampler calls for proposals
    raw_rows = []
    run = llm.engine.runner.run

    def keep_logits(chunks):  # the steps that verify proposals (plain sampling does not go through accept_sampled)
        logits = run(chunks)
        if chunks[0].spec_token_ids:
            raw_rows.append((chunks[0].request.output_token_ids, logits.sampling.clone()))
        return logits

    llm.engine.runner.run = keep_logits
    prompt = chat_prompt("red blue red blue red blue red blue")
    out = llm.generate(prompt, params)[0]
    prompt_ids = out.prompt_token_ids
    checked = 0
    for (proposed, p), (output_before, raw) in zip(seen, raw_rows):
        for i in range(len(proposed) + 1):
            history = output_before + proposed[:i]
            logits = raw[i].clone()
            for token in set(prompt_ids + history):  # repetition: prompt and output
                logits[token] = logits[token] / 1.2 if logits[token] > 0 else logits[token] * 1.2
            for token in set(history):  # frequency: output only
                logits[token] -= 1.0 * history.count(token)
            torch.testing.assert_close(p[i], vllm_order_probabilities(logits, temperature=0.8, min_p=0.02, top_k=40,
                                                                        top_p=0.9))
            checked += i > 0
    assert checked > 0, "no proposal was verified"
    assert_no_leaks(llm)


# -- stop strings --------------------------------------------------------------------------------------------

def stop_string_case(llm, prompt):
    """A greedy run's output and a stop string from its middle that straddles a token boundary (its start is
    streamed one step before its end), seen only once in the text."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    full = llm.generate(prompt, params)[0].outputs[0]
    ends = [len(llm.tokenizer.decode(full.token_ids[:i], True)) for i in range(1, len(full.token_ids) + 1)]
    for end in ends[len(ends) // 2:]:
        stop = full.text[end - 2:end + 1]
        if len(stop) == 3 and full.text.count(stop) == 1 and stop.strip():
            return full, stop
    raise AssertionError(f"no usable stop string in {full.text!r}")


@pytest.mark.parametrize("speculative", [None, NGRAM])
@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_cut_the_text_and_the_tokens_after_them(ckpt, speculative, include):
    llm = make_llm(ckpt, speculative_config=speculative)
    prompt = chat_prompt("the cat the cat the cat")
    full, stop = stop_string_case(llm, prompt)
    at = full.text.find(stop)
    # The tokens kept: the shortest prefix whose text holds the stop string (vLLM keeps the token that completed it).
    n = next(i for i in range(1, len(full.token_ids) + 1) if stop in llm.tokenizer.decode(full.token_ids[:i], True))
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=["zzz-never", stop],
                            include_stop_str_in_output=include)
    out = llm.generate(prompt, params)[0].outputs[0]
    assert out.text == full.text[:at + len(stop) if include else at]
    assert out.token_ids == full.token_ids[:n]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert_no_leaks(llm)


def test_streamed_deltas_never_show_a_stop_string(ckpt):
    llm = make_llm(ckpt)
    prompt = chat_prompt("the cat the cat the cat")
    full, stop = stop_string_case(llm, prompt)
    request_id = llm.engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                                                               stop=stop))
    deltas = []
    while llm.engine.has_unfinished_requests():
        for out in llm.engine.step():
            deltas.append(out.outputs[0].delta_text)
            final = out
    assert final.request_id == request_id
    assert "".join(deltas) == final.outputs[0].text == full.text[:full.text.find(stop)]
    assert all(stop not in "".join(deltas[:i + 1]) for i in range(len(deltas)))
    assert_no_leaks(llm)


def test_stop_strings_wait_for_min_tokens(ckpt):
    llm = make_llm(ckpt)
    prompt = chat_prompt("the cat the cat the cat")
    full, _ = stop_string_case(llm, prompt)
    first_piece = llm.tokenizer.decode(full.token_ids[:1], True)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=first_piece, min_tokens=5)
    out = llm.generate(prompt, params)[0].outputs[0]
    assert len(out.token_ids) > 5 or out.finish_reason == "length"
    assert out.text.startswith(first_piece)  # text from the first min_tokens tokens never matches


# -- logprobs --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("speculative", [None, NGRAM])
def test_logprobs_are_the_models_raw_log_softmax(ckpt, speculative):
    """logprobs=3: the top 3 and the chosen token, with ranks, from log_softmax of the raw logits (vLLM's
    default), whatever the penalties; the dense reference's logits are the oracle."""
    llm = make_llm(ckpt, speculative_config=speculative)
    prompt = chat_prompt("red blue red blue red blue", [random_image(56, 28, 8)])
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3, repetition_penalty=1.5)
    out = llm.generate(prompt, params)[0].outputs[0]
    prepared = llm.engine.prepare(prompt, params)
    ref = reference_generate(llm.model, prepared.token_ids, prepared.images, params, keep_logits=True)
    assert out.token_ids == ref.token_ids and len(out.logprobs) == 12
    total = 0.0
    for token, entry, logits in zip(out.token_ids, out.logprobs, ref.logits):
        logprobs = torch.log_softmax(logits, dim=-1)
        top = torch.topk(logprobs, 3).indices.tolist()
        assert set(entry) == set(top) | {token}
        for t, lp in entry.items():
            assert lp.logprob == pytest.approx(float(logprobs[t]), abs=1e-4)
            assert lp.rank == int((logprobs > logprobs[t]).sum()) + 1
            assert lp.decoded_token == llm.tokenizer.decode([t])
        total += float(logprobs[token])
    assert out.cumulative_logprob == pytest.approx(total, abs=1e-3)
    plain = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=2))[0].outputs[0]
    assert plain.logprobs is None and plain.cumulative_logprob is None


@pytest.mark.parametrize("speculative", [None, NGRAM])
def test_prompt_logprobs_match_transformers(ckpt, oracle, speculative):
    llm = make_llm(ckpt, block_size=4, max_num_batched_tokens=7, speculative_config=speculative)  # chunks cut it
    prompt = chat_prompt("a red circle and a blue square")
    llm.generate(prompt, SamplingParams(max_tokens=1))  # the prompt's blocks are in the prefix cache now
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2))[0]
    ids = out.prompt_token_ids
    with torch.no_grad():
        logits = oracle(input_ids=torch.tensor([ids])).logits[0]  # (tokens, vocab)
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    for position, entry in enumerate(out.prompt_logprobs[1:], start=1):
        row = logprobs[position - 1]
        assert set(entry) == set(torch.topk(row, 2).indices.tolist()) | {ids[position]}
        assert entry[ids[position]].logprob == pytest.approx(float(row[ids[position]]), abs=1e-4)
    assert out.metrics.num_cached_tokens == 0  # cached positions have no logits: computed again
    assert_no_leaks(llm)


# -- n > 1 -----------------------------------------------------------------------------------------------------

def test_n_completions_prefill_the_prompt_once(ckpt):
    """n=3: one output with three completions, each what a single request with seed + i gives; the prompt is
    computed once (the others find its full blocks in the prefix cache) and its image encoded once."""
    llm = make_llm(ckpt, block_size=8)
    prompt = chat_prompt("describe it", [random_image(112, 84, 9)])
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=8, ignore_eos=True)
    out = llm.generate(prompt, params)[0]
    stats = llm.stats()
    length = len(out.prompt_token_ids)
    full_blocks = (length - 1) // 8 * 8
    assert [c.index for c in out.outputs] == [0, 1, 2] and out.finished
    assert stats["prefix_cache_hit_tokens"] == 2 * full_blocks  # the second and third completion
    assert stats["computed_tokens"] == length + 2 * (length - full_blocks) + 3 * 7  # + 7 decodes each
    assert stats["visual_tokens_encoded"] == out.metrics.num_visual_tokens
    assert_no_leaks(llm)
    singles = [make_llm(ckpt).generate(prompt, SamplingParams(seed=11 + i, max_tokens=8, ignore_eos=True))[0]
               for i in range(3)]
    assert [c.token_ids for c in out.outputs] == [s.outputs[0].token_ids for s in singles]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1


@pytest.mark.parametrize("speculative", ["ngram", "draft"])
def test_n_completions_with_speculation(ckpt, speculative):
    """Greedy completions are all the reference's; sampled ones with seeds are each a seeded single request's
    (through the same speculative engine: proposals consume draws, so compare like with like)."""
    spec = NGRAM if speculative == "ngram" else dict(method="draft", model=str(ckpt), num_speculative_tokens=2)
    prompt = chat_prompt("red blue red blue red", [random_image(56, 56, 10)])
    llm = make_llm(ckpt, speculative_config=spec)
    greedy = SamplingParams(n=2, temperature=0, max_tokens=16, ignore_eos=True, repetition_penalty=1.1)
    out = llm.generate(prompt, greedy)[0]
    expected = reference_tokens(llm, prompt, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                                                            repetition_penalty=1.1))
    assert [c.token_ids for c in out.outputs] == [expected, expected]
    sampled = llm.generate(prompt, SamplingParams(n=3, seed=20, max_tokens=10, ignore_eos=True, stop="zz"))[0]
    for i, completion in enumerate(sampled.outputs):
        single = make_llm(ckpt, speculative_config=spec).generate(
            prompt, SamplingParams(seed=20 + i, max_tokens=10, ignore_eos=True, stop="zz"))[0]
        assert completion.token_ids == single.outputs[0].token_ids
    assert llm.stats()["spec_draft_tokens"] > 0
    assert_no_leaks(llm)


def test_n_completions_stream_and_abort_as_one_request(ckpt):
    llm = make_llm(ckpt, speculative_config=NGRAM)
    request_id = llm.engine.add_request(chat_prompt("hello"), SamplingParams(n=2, max_tokens=30, ignore_eos=True))
    outputs = [o for o in llm.engine.step() + llm.engine.step() + llm.engine.step()]
    assert {o.request_id for o in outputs} == {request_id}
    llm.engine.abort_request(request_id)
    final = run_to_completion(llm.engine)[request_id]
    assert [c.finish_reason for c in final.outputs] == ["abort", "abort"]
    assert_no_leaks(llm)


def test_n_completion_ids_never_take_a_callers_request(ckpt):
    llm = make_llm(ckpt)
    llm.engine.add_request("hi", SamplingParams(max_tokens=2), request_id="1_job")
    with pytest.raises(InvalidInputError, match="1_job"):
        llm.engine.add_request("hello", SamplingParams(n=2, max_tokens=2), request_id="job")
    assert set(run_to_completion(llm.engine)) == {"1_job"}
    assert_no_leaks(llm)


def test_max_tokens_none_runs_to_the_context_length(ckpt):
    llm = make_llm(ckpt, max_model_len=64)
    out = llm.generate(chat_prompt("hi"), SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))[0]
    assert out.outputs[0].finish_reason == "length"
    assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 64
    assert_no_leaks(llm)


# -- skip_special_tokens ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("speculative", [None, NGRAM])
def test_skip_special_tokens_false_keeps_them_in_the_text(ckpt, monkeypatch, speculative):
    llm = make_llm(ckpt, speculative_config=speculative)
    im_end = llm.tokenizer.encode("<|im_end|>")[0]
    force_first_token(monkeypatch, im_end)  # a special token that does not stop (ignore_eos)
    prompt = chat_prompt("hi")
    shown = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                skip_special_tokens=False))[0].outputs[0]
    hidden = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0].outputs[0]
    assert shown.text == llm.tokenizer.decode(shown.token_ids) and shown.text.startswith("<|im_end|>")
    assert hidden.text == llm.tokenizer.decode(hidden.token_ids, skip_special_tokens=True)
    assert "<|im_end|>" not in hidden.text
