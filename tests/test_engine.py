"""The serving engine against the dense reference: batching, chunking, paging, preemption, prefix caching."""

import random
import subprocess
import sys
import threading

import pytest
import torch

from helpers import (assert_engine_matches_reference, assert_no_leaks, chat_prompt, force_first_token, random_image,
                     random_workload, reference_tokens, run_to_completion)
from nanomm import LLM, InvalidInputError, SamplingParams
from nanomm.reference import ContiguousKVCache
from nanomm.reference import generate as reference_generate

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
MAX_PIXELS = 28 * 28 * 16  # images of up to 16 visual tokens: keeps the tiny model's tests fast


def make_llm(ckpt, **kwargs):
    kwargs.setdefault("max_pixels", MAX_PIXELS)
    return LLM(str(ckpt), device="cpu", dtype="float32", **kwargs)


def record_chunks(llm):
    """Wrap the scheduler so the test can see every chunk it scheduled: (request id, start, end)."""
    seen, schedule = [], llm.engine.scheduler.schedule

    def recording():
        chunks = schedule()
        seen.extend((c.request.request_id, c.start, c.end, c.request.prompt.image_spans) for c in chunks)
        return chunks

    llm.engine.scheduler.schedule = recording
    return seen


STRESS = {
    "default": dict(),
    "block-1": dict(block_size=1),
    "block-16-tiny-budget": dict(block_size=16, max_num_batched_tokens=7),
    "tiny-pool-preemption": dict(block_size=4, num_kv_blocks=36, max_num_batched_tokens=24),
    "no-prefix-cache": dict(enable_prefix_caching=False, block_size=2, max_num_batched_tokens=11),
    "tiny-pool-no-prefix-cache": dict(enable_prefix_caching=False, block_size=4, num_kv_blocks=36,
                                      max_num_batched_tokens=24),
    "few-seqs": dict(max_num_seqs=2, block_size=8),
}


def record_logit_rows(llm) -> dict[str, list[torch.Tensor]]:
    """Wrap the model runner so the test sees the logits row each request sampled from, step by step."""
    rows, run = {}, llm.engine.runner.run

    def recording(chunks):
        logits = run(chunks)  # no speculation here, so one sampling row per sampling chunk
        for chunk, row in zip([c for c in chunks if c.samples_next_token], logits.sampling):
            rows.setdefault(chunk.request.request_id, []).append(row.clone())
        return logits

    llm.engine.runner.run = recording
    return rows


@pytest.mark.parametrize("setting", ["default", "block-16-tiny-budget", "tiny-pool-preemption"])
def test_every_step_logits_match_reference(ckpt, setting):
    """Not only the argmax: every row of logits the engine sampled from equals the dense reference's at that
    step (float rounding apart), under chunking that cuts images and under preemption. Random tiny models fall
    into loops, so token ids alone carry little information; a position off by one still moves the logits."""
    llm = make_llm(ckpt, **STRESS[setting])
    prompts = random_workload(seed=3, num_prompts=6)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    rows = record_logit_rows(llm)
    ids = [llm.engine.add_request(p, params) for p in prompts]
    run_to_completion(llm.engine)
    for request_id, prompt in zip(ids, prompts):
        prepared = llm.engine.prepare(prompt, params)
        reference = reference_generate(llm.model, prepared.token_ids, prepared.images, params, keep_logits=True)
        assert len(rows[request_id]) == len(reference.logits) == params.max_tokens
        for step, (ours, theirs) in enumerate(zip(rows[request_id], reference.logits)):
            torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4,
                                       msg=lambda m: f"request {request_id}, step {step}: {m}")
    if setting == "tiny-pool-preemption":
        assert llm.stats()["preemptions"] > 0
    assert_no_leaks(llm)


@pytest.mark.parametrize("setting", list(STRESS))
def test_mixed_workload_matches_reference(ckpt, setting):
    llm = make_llm(ckpt, **STRESS[setting])
    prompts = random_workload(seed=1, num_prompts=8)
    # Half greedy, half seeded sampling: both must match the reference token for token.
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.8, top_k=40, top_p=0.95, seed=i,
                             max_tokens=4 + 3 * (i % 4), ignore_eos=True) for i in range(8)]
    chunks = record_chunks(llm)
    assert_engine_matches_reference(llm, prompts, params)
    if setting.startswith("tiny-pool"):
        assert llm.stats()["preemptions"] > 0
    if setting == "block-16-tiny-budget":
        assert any(any(s.start < end < s.end for s in spans) for _, _, end, spans in chunks), \
            "no chunk boundary fell inside an image span"


@pytest.mark.parametrize("seed", range(6))
def test_randomised_settings_and_workloads(ckpt, seed):
    rng = random.Random(seed)
    settings = dict(block_size=rng.choice([1, 2, 3, 8, 16]), max_num_batched_tokens=rng.choice([5, 17, 64, 2048]),
                    max_num_seqs=rng.choice([1, 3, 64]), enable_prefix_caching=rng.random() < 0.7)
    settings["num_kv_blocks"] = rng.choice([None, 200 // settings["block_size"] + 8])
    llm = make_llm(ckpt, **settings)
    prompts = random_workload(seed=100 + seed, num_prompts=rng.randrange(3, 9))
    prompts += prompts[:2]  # repeats: prefix-cache hits
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randrange(1, 12), ignore_eos=True) for _ in prompts]
    assert_engine_matches_reference(llm, prompts, params)


def test_image_straddling_chunk_boundary(ckpt):
    """A budget of 5 tokens per step cuts a 16-token image into several chunks; it is encoded once."""
    llm = make_llm(ckpt, max_num_batched_tokens=5, block_size=4)
    prompt = chat_prompt("what is it?", [random_image(112, 112, 0)])
    chunks = record_chunks(llm)
    assert_engine_matches_reference(llm, [prompt], [GREEDY])
    span = chunks[0][3][0]
    assert span.length == 16 and sum(1 for _, s, e, _ in chunks if s < span.end and e > span.start) >= 4
    assert llm.stats()["visual_tokens_encoded"] == 16  # encoded once, sliced per chunk


def test_preemption_during_image_prefill(ckpt):
    """A request whose image prefill is under way is preempted, recomputed later, and still exact."""
    llm = make_llm(ckpt, block_size=4, num_kv_blocks=26, max_num_batched_tokens=4, max_pixels=28 * 28 * 64)
    preempted_inside_image = []
    scheduler = llm.engine.scheduler
    preempt = scheduler.preempt

    def spying_preempt(request):
        done = request.num_computed_tokens
        preempted_inside_image.append(any(s.start < done < s.end for s in request.prompt.image_spans))
        preempt(request)

    scheduler.preempt = spying_preempt
    long_decode = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    prompts = [chat_prompt(" ".join(["hi"] * 10)), chat_prompt("look", [random_image(224, 224, 3)])]
    assert_engine_matches_reference(llm, prompts, [long_decode, GREEDY])
    assert any(preempted_inside_image), "the scenario no longer preempts inside an image"


def test_abort_frees_blocks_and_leaves_others_exact(ckpt):
    llm = make_llm(ckpt, block_size=4, max_num_batched_tokens=16)
    prompts = random_workload(seed=5, num_prompts=4)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    ids = [llm.engine.add_request(p, params) for p in prompts]
    for _ in range(3):
        llm.engine.step()
    llm.engine.abort_request(ids[1])  # running
    llm.engine.abort_request(ids[3])  # maybe still waiting or prefilling
    finished = run_to_completion(llm.engine)
    assert finished[ids[1]].outputs[0].finish_reason == "abort"
    assert finished[ids[3]].outputs[0].finish_reason == "abort"
    for i in (0, 2):
        assert finished[ids[i]].outputs[0].token_ids == reference_tokens(llm, prompts[i], params)
    assert_no_leaks(llm)


def test_abort_in_the_middle_of_an_image_prefill_releases_everything(ckpt):
    """Aborted while its chunks are inside an image: the request holds the image's encoder-cache entry and
    some KV blocks at that moment; afterwards nothing is held and the other request is still exact."""
    llm = make_llm(ckpt, block_size=4, max_num_batched_tokens=8, max_pixels=28 * 28 * 64)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    victim_prompt, other_prompt = chat_prompt("look", [random_image(224, 224, 7)]), chat_prompt("hello there")
    victim, other = engine.add_request(victim_prompt, params), engine.add_request(other_prompt, params)
    for _ in range(100):  # bounded: its pixels are ready after a worker decodes them
        if victim in engine.requests:
            break
        engine.step()
    request = engine.requests[victim]
    span = request.prompt.image_spans[0]
    for _ in range(100):  # bounded: the image span starts within a few 8-token steps
        if span.start < request.num_computed_tokens < span.end:
            break
        engine.step()
    assert span.start < request.num_computed_tokens < span.end, "the victim never stopped inside its image"
    assert request.held_images and request.block_table  # it holds the picture's tokens and KV blocks now
    engine.abort_request(victim)
    finished = run_to_completion(engine)
    assert finished[victim].outputs[0].finish_reason == "abort"
    assert finished[other].outputs[0].token_ids == reference_tokens(llm, other_prompt, params)
    assert_no_leaks(llm)


@pytest.mark.parametrize("when", ["while the worker runs", "after the worker finished"])
def test_abort_while_preprocessing(ckpt, when):
    """Aborted while its image is still with the worker pool: the abort is reported by the next step, the
    worker's result is dropped whether the job was still running or had just finished (the race), and the
    request never reaches the scheduler."""
    llm = make_llm(ckpt, num_preprocess_workers=1)
    engine, preprocess = llm.engine, llm.engine.processor.preprocess
    release, finished_job = threading.Event(), threading.Event()

    def slow_preprocess(validated):
        assert release.wait(timeout=30)
        try:
            return preprocess(validated)
        finally:
            finished_job.set()

    engine.processor.preprocess = slow_preprocess
    rid = engine.add_request(chat_prompt("look", [random_image(60, 60, 5)]), GREEDY)
    assert rid in engine.intake.preprocessing
    if when == "after the worker finished":
        release.set()
        assert finished_job.wait(timeout=30)
    engine.abort_request(rid)
    engine.abort_request(rid)  # a second abort of the same request is a no-op
    release.set()
    assert finished_job.wait(timeout=30)
    finished = run_to_completion(engine)
    assert list(finished) == [rid] and finished[rid].outputs[0].finish_reason == "abort"
    assert engine.stats()["computed_tokens"] == 0  # it never ran
    engine.processor.preprocess = preprocess
    assert_no_leaks(llm)
    assert llm.generate(chat_prompt("again", [random_image(60, 60, 5)]), GREEDY)[0].finished  # the engine goes on


def test_n_completions_refuse_ids_already_taken(ckpt):
    """With n = 2, request "a" runs as requests "0_a" and "1_a" (parallel_sampling.child_request_ids). Either
    order of arrival is refused, also while "a" is still on the worker pool and its children do not exist yet;
    the refused request leaves nothing behind, and the running ones finish as the reference says."""
    llm = make_llm(ckpt, num_preprocess_workers=1)
    engine, preprocess = llm.engine, llm.engine.processor.preprocess
    two = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, n=2)
    engine.add_request(chat_prompt("first"), GREEDY, request_id="1_b")
    with pytest.raises(InvalidInputError, match=r"n=2 its completions are requests \['0_b', '1_b'\]"):
        engine.add_request(chat_prompt("second"), two, request_id="b")
    release = threading.Event()
    engine.processor.preprocess = lambda validated: release.wait(timeout=30) and preprocess(validated)
    image_prompt = chat_prompt("look", [random_image(60, 60, 5)])
    engine.add_request(image_prompt, two, request_id="a")
    assert "a" in engine.intake.preprocessing  # its children are not requests yet
    with pytest.raises(InvalidInputError, match="'0_a' is already in use"):
        engine.add_request(chat_prompt("clash"), GREEDY, request_id="0_a")
    release.set()
    finished = run_to_completion(engine)
    engine.processor.preprocess = preprocess
    assert sorted(finished) == ["1_b", "a"]
    assert [c.token_ids for c in finished["a"].outputs] == [reference_tokens(llm, image_prompt, GREEDY)[:4]] * 2
    assert_no_leaks(llm)


def test_prompt_one_token_short_of_max_model_len(ckpt):
    """A prompt of max_model_len - 1 tokens has room for exactly one token; one more token is refused."""
    llm = make_llm(ckpt, max_model_len=40, block_size=4)
    ids = llm.tokenizer.encode(" ".join(["word"] * 80))[:39]
    assert len(ids) == 39
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 1 and out.outputs[0].finish_reason == "length"
    assert out.outputs[0].token_ids == reference_tokens(llm, {"prompt_token_ids": ids}, GREEDY)[:1]
    with pytest.raises(InvalidInputError, match="max_model_len=40"):
        llm.generate({"prompt_token_ids": ids + ids[:1]}, GREEDY)
    assert_no_leaks(llm)


def test_max_model_len_must_fit_the_model(ckpt):
    limit = make_llm(ckpt).model.config.text.max_position_embeddings
    assert make_llm(ckpt, max_model_len=limit).engine.config.max_model_len == limit
    with pytest.raises(ValueError, match=f"max_model_len={limit + 1} is beyond .*max_position_embeddings={limit}"):
        make_llm(ckpt, max_model_len=limit + 1)
    for bad in (0, -5):
        with pytest.raises(ValueError, match=f"max_model_len must be a positive int, got {bad}"):
            make_llm(ckpt, max_model_len=bad)


def test_chunk_boundaries_inside_every_image_of_a_multi_image_prompt(ckpt):
    llm = make_llm(ckpt, max_num_batched_tokens=5, max_num_encoder_tokens=64, block_size=4)
    prompt = chat_prompt("compare them", [random_image(112, 112, i) for i in (11, 12, 13)])  # 16 tokens each
    chunks = record_chunks(llm)
    out = assert_engine_matches_reference(llm, [prompt], [GREEDY])[0]
    spans = llm.engine.prepare(prompt, GREEDY).image_spans
    assert len(spans) == 3 and out.prompt_token_ids == llm.engine.prepare(prompt, GREEDY).token_ids
    for span in spans:
        assert any(span.start < end < span.end for _, _, end, _ in chunks), f"no chunk ends inside {span}"


def dense_continuation(model, prepared, first_token: int, num_tokens: int) -> list[int]:
    """An oracle written out here: prefill the prompt with its images, then feed `first_token` back as an
    ordinary text token (no image mask) and continue greedily for num_tokens tokens."""
    cfg, kv_cache = model.config, ContiguousKVCache(model.config.text.num_hidden_layers)
    ids = torch.tensor(prepared.token_ids)
    pixels = torch.cat([im.pixel_values for im in prepared.images])
    visual = torch.cat(model.encode_images(pixels, [im.grid_thw for im in prepared.images]))
    model(ids, prepared.positions, kv_cache, visual, ids == cfg.image_token_id)
    token, position, out = first_token, len(ids) + prepared.rope_delta, []
    for _ in range(num_tokens):
        hidden = model(torch.tensor([token]), torch.full((3, 1), position), kv_cache)
        token, position = int(model.compute_logits(hidden[-1]).argmax()), position + 1
        out.append(token)
    return out


def test_a_generated_image_pad_is_text(ckpt, monkeypatch):
    """A model may generate <|image_pad|>; it has no picture behind it, so it is embedded as text (as in
    transformers) and the image bookkeeping (spans, encoder cache, prefix hashes) never sees it."""
    llm = make_llm(ckpt, block_size=2)
    image_pad = llm.model.config.image_token_id
    prompt = chat_prompt("look", [random_image(56, 56, 3)])
    force_first_token(monkeypatch, image_pad)
    out = llm.generate(prompt, GREEDY)[0]
    tokens = out.outputs[0].token_ids
    assert tokens[0] == image_pad and len(tokens) == GREEDY.max_tokens
    prepared = llm.engine.prepare(prompt, GREEDY)
    assert tokens[1:] == dense_continuation(llm.model, prepared, image_pad, GREEDY.max_tokens - 1)
    assert_no_leaks(llm)


def test_long_prefill_does_not_stall_running_decodes(ckpt):
    """Decodes are scheduled first: a 300-token prompt arriving mid-stream is chunked around them."""
    llm = make_llm(ckpt, max_num_batched_tokens=16)
    engine = llm.engine
    streaming = engine.add_request(chat_prompt("hello"), SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    engine.step()  # prefill + first token
    engine.add_request(chat_prompt(" ".join(["tree"] * 300)), GREEDY)
    steps_with_token = 0
    for _ in range(10):
        outs = {o.request_id: o for o in engine.step()}
        steps_with_token += streaming in outs
    assert steps_with_token == 10  # one token every step while the long prompt prefills


def test_seeded_sampling_is_independent_of_batch_composition(ckpt):
    llm = make_llm(ckpt, block_size=4, max_num_batched_tokens=9)
    target = chat_prompt("tell me a story", [random_image(64, 64, 9)])
    params = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, max_tokens=16, seed=1234, ignore_eos=True)
    alone = llm.generate([target], [params])[0].outputs[0].token_ids
    others = random_workload(seed=11, num_prompts=5)
    other_params = [SamplingParams(temperature=1.0, max_tokens=8, seed=i) for i in range(5)]
    crowded = llm.generate(others[:2] + [target] + others[2:], other_params[:2] + [params] + other_params[2:])
    assert crowded[2].outputs[0].token_ids == alone
    assert alone == reference_tokens(llm, target, params)  # the reference samples the same way
    different_seed = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, max_tokens=16, seed=99, ignore_eos=True)
    assert llm.generate([target], [different_seed])[0].outputs[0].token_ids != alone


def test_stop_tokens_eos_and_length(ckpt):
    llm = make_llm(ckpt)
    prompt = chat_prompt("count with me")
    free_run = reference_tokens(llm, prompt, GREEDY)
    stop_at = free_run[5]
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_at]))[0]
    assert out.outputs[0].token_ids == free_run[:free_run.index(stop_at) + 1]
    assert out.outputs[0].finish_reason == "stop"
    # EOS comes from the checkpoint's generation_config.json, and ignore_eos switches it off.
    eos = llm.tokenizer.eos_token_ids
    assert len(eos) == 2 and llm.tokenizer.encode("<|im_end|>")[0] in eos
    request_id = llm.engine.add_request(prompt, SamplingParams(temperature=0))
    assert llm.engine.requests[request_id].stop_token_ids == frozenset(eos)
    llm.engine.abort_request(request_id)
    llm.engine.step()
    out = llm.generate(prompt, GREEDY)[0]
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 12


def test_max_model_len_ends_generation(ckpt):
    llm = make_llm(ckpt, max_model_len=40)
    prompt = chat_prompt("hi")
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))[0]
    assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 40
    assert out.outputs[0].finish_reason == "length"


def test_streaming_deltas_add_up(ckpt):
    llm = make_llm(ckpt)
    engine = llm.engine
    rid = engine.add_request(chat_prompt("stream please", [random_image(50, 50, 1)]),
                             SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    ids, text, last = [], "", None
    for _ in range(100):  # bounded: 20 tokens after a short prefill
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            assert out.request_id == rid
            ids += out.outputs[0].delta_token_ids
            text += out.outputs[0].delta_text
            last = out
    assert last.finished and ids == last.outputs[0].token_ids and text == last.outputs[0].text
    assert len(ids) == 20


def test_metrics_and_stats(ckpt):
    llm = make_llm(ckpt, block_size=4)
    prompt = chat_prompt("describe", [random_image(112, 56, 4)])
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0]
    m = out.metrics
    assert m.num_visual_tokens == 8 and m.num_prompt_tokens == len(out.prompt_token_ids)
    assert m.ttft_s > 0 and m.e2e_s >= m.ttft_s and m.tpot_s > 0 and m.encode_s > 0 and m.preprocess_s > 0
    assert m.ttft_s >= m.encode_s + m.prefill_s
    stats = llm.stats()
    text = llm.model.config.text
    assert stats["kv_bytes_per_token"] == 2 * text.num_hidden_layers * text.num_key_value_heads * text.head_dim * 4
    assert llm.engine.runner.kv_cache.numel() * 4 == stats["kv_blocks_total"] * 4 * stats["kv_bytes_per_token"]
    assert stats["generated_tokens"] == 5 and stats["kv_blocks_used"] == 0 and stats["tokens_per_s"] > 0


def test_preemption_takes_the_newest_request_not_an_older_one(ckpt):
    """A decode of a newer request must not preempt an older request mid-prefill (decodes run first)."""
    llm = make_llm(ckpt, block_size=4, num_kv_blocks=20, max_num_encoder_tokens=12, max_num_batched_tokens=256,
                   num_preprocess_workers=0, enable_prefix_caching=False)
    engine, scheduler = llm.engine, llm.engine.scheduler
    text_of_24 = next(t for t in ["b", "b b", "b b b", "bb b", "hello b", "b c d"]
                      if len(engine.prepare(chat_prompt(t), None).token_ids) == 24)
    prompts = [chat_prompt("x", [random_image(84, 84, 1)]), chat_prompt("a " * 20, [random_image(84, 84, 2)]),
               chat_prompt(text_of_24)]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (10, 1, 10)]
    victims, preempt = [], scheduler.preempt

    def spying(request):
        victims.append(request is scheduler.running[-1])  # the most recently admitted one still running
        preempt(request)

    scheduler.preempt = spying
    assert_engine_matches_reference(llm, prompts, params)
    assert victims and all(victims)


def test_generate_leaves_nothing_behind_when_a_step_fails(ckpt):
    llm = make_llm(ckpt)
    engine, step, calls = llm.engine, llm.engine.step, []

    def failing_step():
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("simulated failure")
        return step()

    engine.step = failing_step
    with pytest.raises(RuntimeError, match="simulated"):
        llm.generate([chat_prompt("a"), chat_prompt("b", [random_image(50, 50, 1)])], GREEDY)
    engine.step = step
    assert_no_leaks(llm)
    # A caller-chosen id that looks like an automatic one does not break later automatic ids.
    engine.add_request(chat_prompt("mine"), GREEDY, request_id="7")
    outs = llm.generate([chat_prompt(f"p{i}") for i in range(9)], GREEDY)
    assert "7" not in {o.request_id for o in outs}
    run_to_completion(engine)


def test_sampling_params_are_checked_when_used_and_tiny_temperatures_are_greedy(ckpt):
    llm = make_llm(ckpt)
    prompt = chat_prompt("temperature")
    tiny = SamplingParams(temperature=1e-300, max_tokens=6, ignore_eos=True, seed=1)
    greedy6 = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    assert llm.generate(prompt, tiny)[0].outputs[0].token_ids == reference_tokens(llm, prompt, greedy6)
    mutated = SamplingParams(max_tokens=4)
    mutated.top_p = 0.0  # changed after construction: caught when used, before any compute
    with pytest.raises(InvalidInputError, match="prompt 0: top_p"):
        llm.generate(prompt, mutated)
    with pytest.raises(InvalidInputError, match="seed"):
        SamplingParams(seed=2**64)
    small_pool = make_llm(ckpt, num_kv_blocks=8)  # 128 token slots
    prepared = small_pool.engine.prepare(prompt, SamplingParams(max_tokens=1))
    with pytest.raises(InvalidInputError, match="KV blocks"):  # prepared for 1 token, asked for 500
        small_pool.engine.add_request(prompt, SamplingParams(max_tokens=500, ignore_eos=True), prepared=prepared)
    assert not small_pool.engine.has_unfinished_requests()


POOL_RESIDENCY = """
import torch
from nanomm.engine.kv_cache import allocate_kv_cache

def resident_bytes():
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))

before = resident_bytes()
pool = allocate_kv_cache(1, 1024, 16, 2, 256, torch.float32, "cpu")  # 1 layer x k, v x 16,384 slots x 512
print(pool.numel() * 4, resident_bytes() - before)
"""


def test_the_kv_pool_s_memory_is_committed_when_it_is_allocated():
    # A 64 MiB pool: resident at once, so a server's memory does not creep up as its free list rotates
    # (and a pool too large for the machine fails at start). torch.empty would leave the pages untouched.
    # Measured in a fresh process: in this one, the allocator may hand back pages that earlier tests touched
    # and freed, and the resident set would not grow by the pool's size.
    run = subprocess.run([sys.executable, "-c", POOL_RESIDENCY], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    pool_bytes, grown = map(int, run.stdout.split())
    assert pool_bytes == 64 * 2**20
    assert grown > 0.9 * 64 * 2**20
