"""Encode-ahead (nanomm/engine/encode_ahead.py): with an encoder service, a request waits for its visual tokens off
the step. Shown by value, never by a clock: the encoder service is held at a gate the test opens, and while it is
shut the engine steps the other requests; the waiting request has taken no KV block, and once its tokens land its
answer is the integrated engine's. A failed service, or an abort, leaves nothing held."""

import threading

import pytest

from helpers import assert_no_leaks, chat_prompt, random_image
from nanomm import LLM, SamplingParams
from nanomm.serve.encoder_server import EncoderServer, load_encoder
from nanomm.serve.testing import BackgroundServer, free_local_port

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture
def encoder_url(ckpt):
    with BackgroundServer(EncoderServer(load_encoder(str(ckpt)), "m")) as url:
        yield url


def gated(llm) -> threading.Event:
    """Hold every call to the encoder service until the returned gate opens; each call records its pictures."""
    gate, remote = threading.Event(), llm.engine.runner.remote_encoder
    encode, remote.calls = remote.encode, []

    def held(images, url=None):
        remote.calls.append(len(images))
        assert gate.wait(timeout=60), "the test never opened the gate"
        return encode(images, url)

    remote.encode = held
    return gate


def step_until(engine, done, max_steps: int = 400) -> list:
    outputs = []
    for _ in range(max_steps):
        outputs += engine.step()
        if done(outputs):
            return outputs
    raise AssertionError("not done within the steps allowed")


def integrated_tokens(ckpt, prompts) -> list[list[int]]:
    with LLM(str(ckpt), device="cpu", dtype="float32", num_preprocess_workers=0) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("workers", [0, 2])  # preprocessed inline, or on the pool
def test_other_requests_step_while_a_remote_encode_is_outstanding(ckpt, encoder_url, workers):
    text, picture = chat_prompt("the cat sat"), chat_prompt("what is it?", [random_image(112, 84, 5)])
    with LLM(str(ckpt), device="cpu", dtype="float32", num_preprocess_workers=workers,
             encoder_url=encoder_url) as llm:
        engine, gate = llm.engine, gated(llm)
        engine.add_request(picture, GREEDY, request_id="picture")
        engine.add_request(text, GREEDY, request_id="text")
        early = step_until(engine, lambda outs: any(o.request_id == "text" and o.finished for o in outs))
        # The text request ran every one of its steps; the picture's request was never scheduled meanwhile.
        assert {o.request_id for o in early} == {"text"} and engine.num_steps >= GREEDY.max_tokens
        assert "picture" in engine.intake.encode_ahead.fetching and "picture" not in engine.requests
        assert engine.runner.remote_encoder.calls == [1]  # its one picture went out before any step
        assert engine.stats()["remote_encodes_waiting"] == 1 and engine.block_manager.num_free_blocks == \
            engine.block_manager.num_blocks  # waiting, it holds no KV block
        gate.set()
        late = step_until(engine, lambda outs: any(o.request_id == "picture" and o.finished for o in outs))
        answer = next(o for o in late if o.finished)
        text_answer = next(o for o in early if o.finished)
        assert engine.runner.encode_s == 0.0  # no step encoded: the tokens were in the cache when it was scheduled
        m = answer.metrics
        assert m.encoder_cache_hits == 0 and m.encode_s == m.encode_ahead_s > 0  # charged its wait, off the step
        assert min(m.preprocess_s, m.queue_s, m.prefill_s) >= 0  # the stages still add up to TTFT, none negative
        assert m.preprocess_s + m.queue_s + m.encode_s + m.prefill_s + m.transfer_s == pytest.approx(m.ttft_s)
        assert engine.stats()["requests_encoded_ahead"] == 1
        assert_no_leaks(llm)
    assert [text_answer.outputs[0].token_ids, answer.outputs[0].token_ids] == integrated_tokens(ckpt, [text, picture])


def test_a_picture_already_cached_is_not_fetched_again(ckpt, encoder_url):
    picture = chat_prompt("what is it?", [random_image(112, 84, 6)])
    with LLM(str(ckpt), device="cpu", dtype="float32", num_preprocess_workers=0, encoder_url=encoder_url,
             enable_prefix_caching=False) as llm:  # so the second prompt needs its picture again
        first = llm.generate(picture, GREEDY, use_tqdm=False)[0]
        gate = gated(llm)  # shut: a second fetch would hang this test
        second = llm.generate(picture, GREEDY, use_tqdm=False)[0]
        gate.set()
        assert llm.engine.runner.remote_encoder.calls == [] and second.metrics.encoder_cache_hits == 1
        assert second.outputs[0].token_ids == first.outputs[0].token_ids
        assert_no_leaks(llm)


def test_a_dead_encoder_service_fails_that_request_alone_and_leaks_nothing(ckpt):
    dead = f"http://127.0.0.1:{free_local_port()}"  # nothing listens there
    with LLM(str(ckpt), device="cpu", dtype="float32", num_preprocess_workers=0, encoder_url=dead,
             encoder_timeout_s=5) as llm:
        outs = llm.generate([chat_prompt("what is it?", [random_image(56, 56, 1)]), chat_prompt("hello")], GREEDY,
                            use_tqdm=False)
        failed, text = outs
        assert failed.outputs[0].finish_reason == "error" and failed.outputs[0].error_status == 502
        assert "encoder service" in failed.outputs[0].error and dead in failed.outputs[0].error
        assert text.outputs[0].finish_reason == "length" and len(text.outputs[0].token_ids) == GREEDY.max_tokens
        assert_no_leaks(llm)


def test_an_abort_while_the_tokens_come_leaves_nothing_held(ckpt, encoder_url):
    with LLM(str(ckpt), device="cpu", dtype="float32", num_preprocess_workers=0, encoder_url=encoder_url) as llm:
        engine, gate = llm.engine, gated(llm)
        engine.add_request(chat_prompt("what is it?", [random_image(84, 84, 2)]), GREEDY, request_id="a")
        engine.abort_request("a")
        (out,) = engine.step()
        assert out.request_id == "a" and out.outputs[0].finish_reason == "abort"
        gate.set()  # the fetch still lands on its thread: nothing may keep what it brings
        engine.intake.encode_ahead.executor.shutdown(wait=True)
        engine.step()
        assert not any(entry.holders for entry in engine.encoder_cache.entries.values())
        assert_no_leaks(llm)
