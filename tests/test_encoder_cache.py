"""The vision-encoding cache, the per-step encoder budget, and the preprocessing worker pool."""

import base64
import io
import threading

import pytest
import torch

from helpers import (assert_engine_matches_reference, assert_no_leaks, chat_prompt, random_image, reference_tokens,
                     run_to_completion)
from nanomm import LLM, InvalidInputError, SamplingParams
from nanomm.tools.random_checkpoint import make_checkpoint
from nanomm.engine.encoder_cache import EncoderCache, encoder_cache_key

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def make_llm(ckpt, **kwargs):
    kwargs.setdefault("max_pixels", 28 * 28 * 16)
    return LLM(str(ckpt), device="cpu", dtype="float32", **kwargs)


def png_bytes(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def test_cache_unit_lru_and_holds():
    cache = EncoderCache(capacity_tokens=10)
    for key in "abc":
        cache.add(key, torch.zeros(4, 2))
        cache.trim()
    assert list(cache.entries) == ["b", "c"] and cache.evictions == 1  # 12 tokens > 10: "a" went first
    cache.hold("b")
    assert cache.lookup("b") is not None and cache.lookup("a") is None
    cache.add("d", torch.zeros(8, 2))
    cache.trim()
    assert list(cache.entries) == ["b"]  # c went first (least recent), then d: no room for it beside held b
    cache.add("e", torch.zeros(12, 2))  # bigger than the whole budget, but a running request needs it
    cache.hold("e")
    cache.trim()
    assert list(cache.entries) == ["b", "e"] and cache.num_tokens == 16  # held entries stay, over budget
    cache.release("e")  # released while over budget: the next trim (end of the engine step) evicts it
    assert "e" in cache
    cache.trim()
    assert list(cache.entries) == ["b"] and cache.num_tokens <= 10
    assert (cache.hits, cache.misses) == (1, 1)


def test_key_covers_the_model():
    assert encoder_cache_key("pixels", "model-a:torch.float32") != encoder_cache_key("pixels", "model-b:torch.float32")
    assert encoder_cache_key("pixels", "m:torch.float32") != encoder_cache_key("pixels", "m:torch.bfloat16")


def test_path_bytes_and_pil_forms_of_one_image_hit(ckpt, tmp_path):
    llm = make_llm(ckpt, enable_prefix_caching=False)  # so only the encoder cache can skip work
    image = random_image(112, 84, 1)
    path = tmp_path / "picture.png"
    image.save(path)
    data_url = "data:image/png;base64," + base64.b64encode(png_bytes(image)).decode()
    forms = [image, str(path), png_bytes(image), data_url]
    outputs = [llm.generate(chat_prompt(f"question {i}", [form]), GREEDY)[0] for i, form in enumerate(forms)]
    tokens = outputs[0].metrics.num_visual_tokens
    assert llm.stats()["visual_tokens_encoded"] == tokens  # encoded once, for the first form
    assert [o.metrics.encoder_cache_hits for o in outputs] == [0, 1, 1, 1]
    assert outputs[0].metrics.encode_s > 0 and all(o.metrics.encode_s == 0 for o in outputs[1:])
    for i, out in enumerate(outputs):
        assert out.outputs[0].token_ids == reference_tokens(llm, chat_prompt(f"question {i}", [forms[i]]), GREEDY)
    assert_no_leaks(llm)


def test_a_different_max_pixels_or_model_misses(ckpt, tmp_path):
    llm = make_llm(ckpt, max_pixels=28 * 28 * 64)
    image = random_image(224, 224, 2)
    llm.generate(chat_prompt("a", [image]), GREEDY)
    capped = {**chat_prompt("b", [image]), "mm_processor_kwargs": {"max_pixels": 28 * 28 * 16}}
    out = llm.generate(capped, GREEDY)[0]
    assert out.metrics.encoder_cache_hits == 0 and llm.stats()["encoder_cache_misses"] == 2
    assert out.outputs[0].token_ids == reference_tokens(llm, capped, GREEDY)
    # Another checkpoint (other weights) never sees this engine's entries: its identity is in every key.
    other = make_llm(make_checkpoint(tmp_path / "other", preset="tiny", seed=5))
    assert other.engine.model_identity != llm.engine.model_identity
    key = llm.engine.encoder_cache_key_for(llm.engine.prepare(chat_prompt("a", [image]), GREEDY).images[0])
    assert key in llm.engine.encoder_cache
    assert other.engine.encoder_cache_key_for(other.engine.prepare(chat_prompt("a", [image]), GREEDY).images[0]) != key


def test_eviction_under_a_tiny_budget_stays_exact(ckpt):
    llm = make_llm(ckpt, encoder_cache_size=20, max_num_batched_tokens=9, block_size=4)
    images = [random_image(112, 112, 10 + i) for i in range(4)]  # 16 tokens each: one fits at a time
    prompts = [chat_prompt(f"image {i % 4}", [images[i % 4]]) for i in range(8)]
    assert_engine_matches_reference(llm, prompts, [GREEDY] * len(prompts))
    stats = llm.stats()
    assert stats["encoder_cache_evictions"] > 0 and stats["encoder_cache_tokens"] <= 20
    assert_no_leaks(llm)


def test_an_entry_in_use_is_never_evicted(ckpt):
    """A tiny budget forces eviction while a request's chunked prefill is still inside its image."""
    llm = make_llm(ckpt, encoder_cache_size=16, max_num_batched_tokens=6, block_size=4)
    runner, seen = llm.engine.runner, []
    visual_slices = runner._visual_slices

    def checking(chunk, *args):
        for i in chunk.request.held_images:  # everything a running prefill holds is still cached
            seen.append(chunk.request.held_images[i] in llm.engine.encoder_cache)
        return visual_slices(chunk, *args)

    runner._visual_slices = checking
    prompts = [chat_prompt(f"look {i}", [random_image(112, 112, 20 + i)]) for i in range(3)]
    assert_engine_matches_reference(llm, prompts, [GREEDY] * 3)
    assert seen and all(seen)
    assert llm.stats()["encoder_cache_evictions"] > 0
    assert_no_leaks(llm)


def test_identical_images_admitted_together_encode_once(ckpt):
    llm = make_llm(ckpt, enable_prefix_caching=False)
    image = random_image(112, 112, 30)
    prompts = [chat_prompt("first", [image]), chat_prompt("second, longer question", [image])]
    outs = assert_engine_matches_reference(llm, prompts, [GREEDY, GREEDY])
    assert llm.stats()["visual_tokens_encoded"] == 16
    assert sorted(o.metrics.encoder_cache_hits for o in outs) == [0, 1]


def test_encoder_budget_per_step(ckpt):
    """At most max_num_encoder_tokens visual tokens are encoded per step; a chunk stops before an image that
    does not fit, and an image larger than the whole budget runs alone."""
    llm = make_llm(ckpt, max_pixels=28 * 28 * 64, max_num_encoder_tokens=20)
    encoded_per_step, encode = [], llm.engine.runner.model.encode_images

    def counting(pixels, grids):
        out = encode(pixels, grids)
        encoded_per_step.append(sum(e.shape[0] for e in out))
        return out

    llm.engine.runner.model.encode_images = counting
    small = [random_image(112, 112, 40 + i) for i in range(3)]  # 16 tokens each
    big = random_image(224, 224, 50)  # 64 tokens: larger than the budget
    prompts = [chat_prompt("two small", small[:2]), chat_prompt("one small", small[2:]), chat_prompt("big", [big])]
    outs = llm.generate(prompts, GREEDY)
    assert encoded_per_step == [16, 16, 16, 64]  # never two small ones together (32 > 20); the big one alone
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == reference_tokens(llm, prompt, GREEDY)
    assert_no_leaks(llm)


def test_preprocessing_runs_beside_engine_steps(ckpt):
    """While one request's image is still being preprocessed, the engine keeps decoding the others."""
    llm = make_llm(ckpt, num_preprocess_workers=2)
    engine, release = llm.engine, threading.Event()
    preprocess = engine.processor.preprocess

    def slow(validated):
        if validated.raw_images:
            assert release.wait(timeout=30), "the test never released the worker"
        return preprocess(validated)

    engine.processor.preprocess = slow
    streaming = engine.add_request(chat_prompt("stream"), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    waiting = engine.add_request(chat_prompt("with image", [random_image(60, 60, 60)]), GREEDY)
    tokens_while_blocked = 0
    for _ in range(5):
        tokens_while_blocked += sum(len(o.outputs[0].delta_token_ids) for o in engine.step() if o.request_id == streaming)
    assert tokens_while_blocked == 5 and engine.stats()["preprocess_queue"] == 1
    release.set()
    finished = run_to_completion(engine)
    assert finished[waiting].outputs[0].token_ids == reference_tokens(llm, chat_prompt("with image", [random_image(60, 60, 60)]), GREEDY)
    assert finished[waiting].metrics.preprocess_s > 0
    assert_no_leaks(llm)


def test_ttft_breakdown_adds_up(ckpt):
    llm = make_llm(ckpt)
    out = llm.generate(chat_prompt("hi", [random_image(100, 80, 70)]), GREEDY)[0]
    m = out.metrics
    parts = m.preprocess_s + m.queue_s + m.encode_s + m.prefill_s
    assert min(m.preprocess_s, m.queue_s, m.encode_s, m.prefill_s) >= 0
    assert abs(parts - m.ttft_s) < 1e-6


def test_per_request_pixel_caps_are_bounded_by_the_engine(ckpt):
    llm = make_llm(ckpt, max_pixels=28 * 28 * 16)
    with pytest.raises(InvalidInputError, match="exceed the engine's max_pixels"):
        llm.generate({**chat_prompt("x", [random_image(50, 50, 1)]), "mm_processor_kwargs": {"max_pixels": 10**7}})
    assert_no_leaks(llm)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_corrupt_image_finishes_its_own_request_inline_or_on_the_pool(ckpt, workers):
    llm = make_llm(ckpt, num_preprocess_workers=workers)
    engine = llm.engine
    good = chat_prompt("fine", [random_image(70, 50, 80)])
    ok, bad = engine.add_request(good, GREEDY), engine.add_request(chat_prompt("broken", [b"\xff\xd8 no jpeg"]), GREEDY)
    finished = run_to_completion(engine)
    assert finished[bad].outputs[0].finish_reason == "error" and "image 0" in finished[bad].outputs[0].error
    assert finished[ok].outputs[0].token_ids == reference_tokens(llm, good, GREEDY)
    assert_no_leaks(llm)


def test_pixel_floats_are_built_on_the_engine_thread_and_never_for_cache_hits(ckpt):
    """Workers only decode and resize (PIL); the float patches are built when the encoder first needs them."""
    llm = make_llm(ckpt)
    image = random_image(112, 112, 90)
    prepared = llm.engine.prepare_all([chat_prompt("a", [image])], [GREEDY])[0]
    assert "pixel_values" not in vars(prepared.images[0])  # not built by the preprocessing
    llm.generate(chat_prompt("first", [image]), GREEDY)
    engine = llm.engine
    rid = engine.add_request(chat_prompt("second", [image]), GREEDY)
    for _ in range(1000):  # bounded: wait for the worker (each idle step waits up to 50 ms for it)
        if rid in engine.requests:
            break
        engine.step()
    request = engine.requests[rid]
    run_to_completion(engine)
    assert request.metrics.encoder_cache_hits == 1
    assert "pixel_values" not in vars(request.prompt.images[0])  # a cache hit never needed the floats
