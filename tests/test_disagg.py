"""The split engine, in one process: a prefill engine hands a request to a decode engine (engine/handoff.py), and
an engine with an encoder service runs no tower (transfer.py). The oracle is one integrated
engine, and the dense reference behind it: the same token ids and the same logprobs, whatever the split.
The real processes, the router and the faults across processes are tests/test_disagg_processes.py."""

import base64
import io
import json
import shutil
import socket
import threading
import time

import httpx
import pytest
import torch
from PIL import Image

from helpers import chat_prompt, data_url, random_image, random_workload, reference_tokens, run_to_completion
from nanomm import LLM, InvalidInputError, SamplingParams
from nanomm.engine.handoff import Handoff, decode_generator
from nanomm.errors import PeerError
from nanomm.serve.app import Server, ServerConfig
from nanomm.serve.encoder_server import EncoderServer, load_encoder
from nanomm.serve.router import Router
from nanomm.serve.router_pools import (HEADER_BASE64_CHARS, Pool, estimated_prompt_tokens, estimated_visual_tokens,
                                       picture_size)
from nanomm.serve.testing import BackgroundServer, free_local_port
from nanomm.transfer import HttpKVConnector, expect

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
SEEDED = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=8, ignore_eos=True, logprobs=2)
NGRAM = dict(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)


def make_llm(ckpt, **kwargs) -> LLM:
    return LLM(str(ckpt), device="cpu", dtype="float32", num_preprocess_workers=0, **kwargs)


def hand_over(prefill: LLM, decode: LLM, prompt, params: SamplingParams, request_id: str):
    """One request through a prefill engine, then a decode engine, the KV moved as the HTTP route moves it
    (export after the decode side took its cached prefix). Returns (final output, the handoff, blocks reused)."""
    prefill.engine.add_request(prompt, params, request_id=request_id, hand_off=True)
    parked = run_to_completion(prefill.engine)[request_id]
    assert parked.outputs[0].finish_reason == "handoff" and parked.outputs[0].token_ids == []
    handoff = Handoff.from_json({**parked.kv_transfer_params, "remote_url": "in-process"},
                                decode.model.config.text.vocab_size)
    cached = decode.engine.handoffs.take_cached_prefix(handoff)
    from_token = len(cached) * decode.engine.config.block_size
    kv, num_tokens = prefill.engine.handoffs.export_kv(handoff.transfer_id, from_token)
    assert num_tokens == handoff.num_tokens
    for name, (dtype, shape) in decode.engine.handoffs.kv_layout(num_tokens - from_token).items():
        assert kv[name].dtype == dtype and tuple(kv[name].shape) == shape
    decode.engine.handoffs.add_transferred(request_id, None, params, handoff, kv, cached, 0.0)
    return run_to_completion(decode.engine)[request_id], handoff, len(cached)


def same_completion(split, whole) -> None:
    a, b = split.outputs[0], whole.outputs[0]
    assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason and a.text == b.text
    if b.logprobs is not None:
        for mine, theirs in zip(a.logprobs, b.logprobs):
            assert mine.keys() == theirs.keys()
            assert all(abs(mine[t].logprob - theirs[t].logprob) < 1e-5 for t in mine)


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_prefill_then_decode_gives_the_integrated_engines_tokens(ckpt, params):
    prefill, decode, whole = make_llm(ckpt), make_llm(ckpt, block_size=4), make_llm(ckpt)  # other block sizes
    prompts = random_workload(seed=3, num_prompts=4, max_images=2)
    expected = whole.generate(prompts, params, use_tqdm=False)
    for i, (prompt, want) in enumerate(zip(prompts, expected)):
        got, handoff, _ = hand_over(prefill, decode, prompt, params, f"r{i}")
        same_completion(got, want)
        assert got.prompt_token_ids == want.prompt_token_ids
        if params.greedy:
            assert got.outputs[0].token_ids == reference_tokens(whole, prompt, params)
    assert prefill.stats()["kv_blocks_used"] == 0 and decode.stats()["kv_blocks_used"] == 0


def test_prefix_cache_hits_on_either_side_move_only_what_is_missing(ckpt):
    """The second time a prompt comes, the prefill side computes only its last block, and the decode side
    pulls only the positions after the blocks its own prefix cache holds; the tokens do not change."""
    prefill, decode, whole = make_llm(ckpt), make_llm(ckpt), make_llm(ckpt)
    prompt = chat_prompt("the cat sat on the mat and looked at the picture " * 3, [random_image(84, 56, 1)])
    want = whole.generate(prompt, SEEDED, use_tqdm=False)[0]
    first, handoff, reused = hand_over(prefill, decode, prompt, SEEDED, "a")
    again, handoff_again, reused_again = hand_over(prefill, decode, prompt, SEEDED, "b")
    same_completion(first, want), same_completion(again, want)
    assert reused == 0 and reused_again == handoff.num_tokens // decode.engine.config.block_size > 2
    assert handoff.num_cached_tokens == 0 and handoff_again.num_cached_tokens > 0


@pytest.mark.parametrize("policy", [{"method": "prune", "keep_ratio": 0.5}, {"method": "pool", "keep_ratio": 0.25}])
def test_compressed_images_hand_over_exactly(ckpt, policy):
    prefill, decode, whole = (make_llm(ckpt, visual_token_compression=policy) for _ in range(3))
    prompt = chat_prompt("what is in the picture", [random_image(112, 84, 5), random_image(56, 56, 6)])
    got, _, _ = hand_over(prefill, decode, prompt, GREEDY, "c")
    same_completion(got, whole.generate(prompt, GREEDY, use_tqdm=False)[0])


def test_an_fp8_kv_cache_travels_as_stored(ckpt):
    prefill, decode, whole = (make_llm(ckpt, kv_cache_dtype="fp8") for _ in range(3))
    prompt = chat_prompt("describe it", [random_image(70, 56, 9)])
    assert set(decode.engine.handoffs.kv_layout(1)) == {"codes", "scales"}
    got, _, _ = hand_over(prefill, decode, prompt, SEEDED, "f")
    same_completion(got, whole.generate(prompt, SEEDED, use_tqdm=False)[0])


def test_speculative_decoding_on_the_decode_side(ckpt):
    prefill, decode, whole = make_llm(ckpt), make_llm(ckpt, speculative=NGRAM), make_llm(ckpt)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompt = chat_prompt("a b c a b c a b c a b c", [random_image(56, 56, 2)])
    got, _, _ = hand_over(prefill, decode, prompt, params, "s")
    assert got.outputs[0].token_ids == whole.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    assert decode.stats()["spec_draft_tokens"] > 0


def test_prompt_logprobs_stop_rules_and_one_token_answers_carry_over(ckpt):
    prefill, decode, whole = make_llm(ckpt), make_llm(ckpt), make_llm(ckpt)
    prompt = chat_prompt("hello there", [random_image(56, 56, 4)])
    first = whole.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids[0]
    cases = {"prompt logprobs": SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=3, ignore_eos=True),
             "one token": SamplingParams(temperature=0, max_tokens=1),
             "stops at its first token": SamplingParams(temperature=0, max_tokens=6, stop_token_ids=[first])}
    for name, params in cases.items():
        want = whole.generate(prompt, params, use_tqdm=False)[0]
        got, _, _ = hand_over(prefill, decode, prompt, params, name)
        same_completion(got, want)
        assert (got.prompt_logprobs is None) == (want.prompt_logprobs is None), name
        for mine, theirs in zip(got.prompt_logprobs or [], want.prompt_logprobs or []):
            assert (mine is None and theirs is None) or {t: v.rank for t, v in mine.items()} == \
                {t: v.rank for t, v in theirs.items()}, name


def test_a_handoff_nobody_takes_is_freed_after_its_timeout(ckpt):
    prefill = make_llm(ckpt, kv_handoff_timeout_s=0.05)
    prefill.engine.add_request(chat_prompt("hi", [random_image(56, 56, 3)]), GREEDY, request_id="x", hand_off=True)
    parked = run_to_completion(prefill.engine)["x"]
    assert prefill.stats()["kv_blocks_used"] > 0 and prefill.stats()["kv_requests_parked"] == 1
    time.sleep(0.1)
    assert prefill.engine.handoffs.expire() == 1
    assert prefill.stats()["kv_blocks_used"] == 0
    with pytest.raises(InvalidInputError, match="no parked request"):
        prefill.engine.handoffs.export_kv(parked.kv_transfer_params["transfer_id"], 0)


def test_a_refused_handoff_request_leaves_no_mark_on_its_id(ckpt):
    """A prompt refused by add_request is no request: a later plain request with its id decodes, not parks."""
    llm = make_llm(ckpt)
    with pytest.raises(InvalidInputError, match="unknown keys"):
        llm.engine.add_request({"bogus": 1}, GREEDY, request_id="x", hand_off=True)
    llm.engine.add_request(chat_prompt("hi"), GREEDY, request_id="x")
    assert run_to_completion(llm.engine)["x"].outputs[0].finish_reason == "length"
    assert not llm.engine.handoffs.marked and not llm.engine.handoffs.parked


def test_a_decode_instance_out_of_blocks_fails_the_transferred_request_it_cannot_recompute(ckpt):
    """Preemption recomputes a request from its prompt; a transferred request has no pixels here, so the decode
    side fails it with a 503 instead, and frees everything."""
    prefill, decode = make_llm(ckpt), make_llm(ckpt, num_kv_blocks=24, block_size=4, enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    outs = {}
    for i in range(2):
        prompt = chat_prompt("a picture " * 2, [random_image(28, 28, 10 + i)])
        prefill.engine.add_request(prompt, params, request_id=f"p{i}", hand_off=True)
        parked = run_to_completion(prefill.engine)[f"p{i}"]
        handoff = Handoff.from_json({**parked.kv_transfer_params, "remote_url": "x"}, 10**6)
        kv, _ = prefill.engine.handoffs.export_kv(handoff.transfer_id, 0)
        decode.engine.handoffs.add_transferred(f"p{i}", None, params, handoff, kv, [], 0.0)
    outs = run_to_completion(decode.engine)
    reasons = sorted(o.outputs[0].finish_reason for o in outs.values())
    assert "error" in reasons
    failed = next(o.outputs[0] for o in outs.values() if o.outputs[0].finish_reason == "error")
    assert failed.error_status == 503 and "cannot be recomputed" in failed.error


def test_bad_handoffs_are_400s_before_anything_is_taken(ckpt):
    decode = make_llm(ckpt)
    for bad in ({}, {"transfer_id": "t"}, {"transfer_id": 1, "prompt_token_ids": [1]}):
        with pytest.raises(InvalidInputError, match="kv_transfer_params"):
            Handoff.from_json(bad, decode.model.config.text.vocab_size)
    with pytest.raises(InvalidInputError, match="sampling state"):
        decode_generator("not base64 at all!")
    assert decode.stats()["kv_blocks_used"] == 0


# -- the KV connector over HTTP --------------------------------------------------------------------------------

def test_the_http_connector_checks_what_arrives(ckpt):
    """A prefill instance in fp8 and a decode instance in float32 do not store the same KV: an error that says
    so, never silent garbage. An unknown transfer id is an error too; the parked blocks are freed either way."""
    llm = make_llm(ckpt, kv_cache_dtype="fp8")
    with BackgroundServer(Server(llm, ServerConfig("m", role="prefill"))) as url:
        llm.engine.add_request(chat_prompt("hi"), GREEDY, request_id="k", hand_off=True)
        for _ in range(50):
            if llm.engine.handoffs.parked:
                break
            time.sleep(0.05)
        transfer_id = next(iter(llm.engine.handoffs.parked.by_id))
        plain = make_llm(ckpt)
        num_tokens = llm.engine.handoffs.parked.by_id[transfer_id].num_tokens
        layout = plain.engine.handoffs.kv_layout(num_tokens)
        with pytest.raises(PeerError, match="kv_cache_dtype"):
            HttpKVConnector(5).pull(url, transfer_id, 0, num_tokens, layout)
        with pytest.raises(PeerError, match="404"):
            HttpKVConnector(5).pull(url, transfer_id, 0, 10, layout)  # taken already: the first pull freed it
        assert httpx.get(url + "/metrics").status_code == 200
    assert llm.stats()["kv_blocks_used"] == 0


def test_visual_tokens_or_kv_in_another_dtype_of_the_same_shape_are_refused(ckpt):
    """A peer's tensors must have this instance's dtype, not only its shapes: float32 visual tokens and KV reach a
    bfloat16 instance with exactly the shapes it needs, and are refused with both dtypes named (bfloat16 sent
    where float16 is stored, too). The parked blocks are freed all the same."""
    def wait_until_parked(llm):
        for _ in range(100):
            if llm.engine.handoffs.parked.by_id:
                return next(iter(llm.engine.handoffs.parked.by_id.items()))  # (transfer id, ParkedRequest)
            time.sleep(0.05)
        raise AssertionError("the request was never parked")

    with pytest.raises(PeerError, match="torch.bfloat16 \\(2, 3\\).*torch.float16 \\(2, 3\\)"):
        expect(torch.zeros(2, 3, dtype=torch.bfloat16), "embeds.0", torch.float16, (2, 3), "a peer")
    with BackgroundServer(EncoderServer(load_encoder(str(ckpt)), "m")) as url:  # float32 visual tokens
        llm = LLM(str(ckpt), device="cpu", dtype="bfloat16", num_preprocess_workers=0, encoder_url=url)
        out = llm.generate(chat_prompt("x", [random_image(56, 56, 2)]), GREEDY, use_tqdm=False)[0].outputs[0]
        assert out.finish_reason == "error" and out.error_status == 502
        assert "torch.float32" in out.error and "needs torch.bfloat16" in out.error, out.error
    prefill = make_llm(ckpt)  # float32 KV
    with BackgroundServer(Server(prefill, ServerConfig("m", role="prefill"))) as url:
        prefill.engine.add_request(chat_prompt("hi"), GREEDY, request_id="k", hand_off=True)
        transfer_id, parked = wait_until_parked(prefill)
        layout = {name: (torch.bfloat16, shape)  # what a bfloat16 decode instance stores, shape for shape
                  for name, (_, shape) in prefill.engine.handoffs.kv_layout(parked.num_tokens).items()}
        with pytest.raises(PeerError, match="as torch.float32 .*needs torch.bfloat16"):
            HttpKVConnector(5).pull(url, transfer_id, 0, parked.num_tokens, layout)
    assert prefill.stats()["kv_blocks_used"] == 0


def test_a_kv_pull_is_served_while_the_prefill_engine_is_busy(ckpt):
    """The pull reads the parked blocks on the HTTP thread: it does not wait for the engine thread (here held by
    a command that blocks) to reach the end of a step. A from_token outside the prompt is refused and leaves
    the request parked; the blocks go back to the pool on the engine thread afterwards."""
    llm = make_llm(ckpt)
    server = Server(llm, ServerConfig("m", role="prefill"))
    with BackgroundServer(server) as url:
        llm.engine.add_request(chat_prompt("hi", [random_image(56, 56, 4)]), GREEDY, request_id="b", hand_off=True)
        for _ in range(100):
            if llm.engine.handoffs.parked:
                break
            time.sleep(0.05)
        transfer_id = next(iter(llm.engine.handoffs.parked.by_id))
        num_tokens = llm.engine.handoffs.parked.by_id[transfer_id].num_tokens
        layout = llm.engine.handoffs.kv_layout(num_tokens)
        gate = threading.Event()
        held = server.engine_loop.call(lambda engine: gate.wait(30))  # the engine thread is busy until the gate opens
        try:
            with pytest.raises(PeerError, match="404"):
                HttpKVConnector(5).pull(url, transfer_id, num_tokens + 1, num_tokens, layout)
            kv, _ = HttpKVConnector(5).pull(url, transfer_id, 0, num_tokens, layout)  # a 504 if it waited
            assert llm.stats()["kv_blocks_used"] > 0  # not freed yet: that is the engine thread's to do
        finally:
            gate.set()
        held.result(timeout=30)
        for _ in range(100):
            if llm.stats()["kv_blocks_used"] == 0:
                break
            time.sleep(0.05)
    assert llm.stats()["kv_blocks_used"] == 0 and not llm.engine.handoffs.parked
    assert {name: (t.dtype, tuple(t.shape)) for name, t in kv.items()} == {
        name: (dtype, tuple(shape)) for name, (dtype, shape) in layout.items()}


# -- an encoder service ----------------------------------------------------------------------------------------

@pytest.fixture
def encoder_url(ckpt):
    with BackgroundServer(EncoderServer(load_encoder(str(ckpt)), "m")) as url:
        yield url


@pytest.mark.parametrize("policy", [None, {"method": "attention", "keep_ratio": 0.5}])
def test_an_engine_with_an_encoder_service_gives_the_same_tokens_and_logprobs(ckpt, encoder_url, policy):
    remote = make_llm(ckpt, encoder_url=encoder_url, visual_token_compression=policy)
    local = make_llm(ckpt, visual_token_compression=policy)
    assert remote.model.visual is None  # no tower to run
    prompts = random_workload(seed=8, num_prompts=4, max_images=2)
    for params in (GREEDY, SEEDED):
        for mine, theirs in zip(remote.generate(prompts, params, use_tqdm=False),
                                local.generate(prompts, params, use_tqdm=False)):
            same_completion(mine, theirs)
    stats = remote.stats()
    assert stats["visual_tokens_encoded"] == 0 and stats["visual_token_bytes_received"] > 0
    assert local.stats()["visual_tokens_encoded"] > 0
    encoded = [float(line.split()[-1]) for line in httpx.get(encoder_url + "/metrics").text.splitlines()
               if line.startswith("nanomm_encoder_visual_tokens_total")]
    assert encoded == [local.stats()["visual_tokens_encoded"]]  # each picture once: the service caches too


def test_an_encoder_service_that_is_gone_fails_only_the_requests_that_need_it(ckpt):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"  # nothing listens there once the socket closes
    llm = make_llm(ckpt, encoder_url=dead, encoder_timeout_s=2)
    with_image, text_only = chat_prompt("what is it", [random_image(56, 56, 1)]), chat_prompt("just text")
    failed, fine = llm.generate([with_image, text_only], GREEDY, use_tqdm=False)
    assert failed.outputs[0].finish_reason == "error" and failed.outputs[0].error_status == 502
    assert "encoder service" in failed.outputs[0].error
    assert fine.outputs[0].finish_reason == "length" and len(fine.outputs[0].token_ids) == 8


def test_an_encoder_for_another_preprocessing_is_refused(ckpt, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(ckpt, other)
    config = json.loads((other / "preprocessor_config.json").read_text())
    config["image_mean"] = [0.5, 0.5, 0.5]
    (other / "preprocessor_config.json").write_text(json.dumps(config))
    with BackgroundServer(EncoderServer(load_encoder(str(other)), "m")) as url:
        llm = make_llm(ckpt, encoder_url=url)
        out = llm.generate(chat_prompt("x", [random_image(56, 56, 2)]), GREEDY, use_tqdm=False)[0].outputs[0]
        assert out.finish_reason == "error" and out.error_status == 502 and "preprocessed with" in out.error
        for body in (b"not safetensors", b""):
            answer = httpx.post(url + "/v1/encode", content=body)
            assert answer.status_code == 400 and "message" in answer.json()["error"]


def test_a_router_with_an_empty_pool_answers_503_at_once():
    with BackgroundServer(Router([], [], [])) as url:
        answer = httpx.post(url + "/v1/chat/completions", json={"messages": []}, timeout=5)
    assert answer.status_code == 503 and "no prefill instance" in answer.json()["error"]["message"]


class RecordedBodies:
    """An ASGI app that hands every request on to `app` and keeps the bytes of each HTTP request's body."""

    def __init__(self, app):
        self.app, self.bodies = app, []

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        body = bytearray()

        async def recording_receive():
            message = await receive()
            if message["type"] == "http.request":
                body.extend(message.get("body", b""))
                if not message.get("more_body"):
                    self.bodies.append(bytes(body))
            return message

        await self.app(scope, recording_receive, send)


def answer_of(url: str, path: str, body: dict) -> dict:
    """One request's answer, streamed or not: its text, tokens, their logprobs, finish reason and usage."""
    reply = httpx.post(url + path, json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    if body.get("stream"):
        chunks = [json.loads(line[6:]) for line in reply.text.splitlines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    else:
        chunks = [reply.json()]
    text, tokens, logprobs, finish = "", [], [], None
    for choice in (c for chunk in chunks for c in chunk["choices"]):
        message = choice.get("message") or choice.get("delta") or {}
        text += message.get("content") or choice.get("text") or ""
        entries = choice["logprobs"] or {}
        if "content" in entries:  # chat's logprobs
            tokens += [e["token"] for e in entries["content"]]
            logprobs += [e["logprob"] for e in entries["content"]]
        else:  # /v1/completions'
            tokens += entries.get("tokens", [])
            logprobs += entries.get("token_logprobs", [])
        finish = choice["finish_reason"] or finish
    usage = chunks[-1]["usage"]
    return {"text": text, "tokens": tokens, "logprobs": logprobs, "finish": finish,
            "usage": [usage[k] for k in ("prompt_tokens", "completion_tokens", "visual_tokens")]}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_the_router_sends_the_decode_instance_no_pictures_and_it_answers_as_one_engine(ckpt, stream):
    """Hop 2 carries the sampling fields and the handoff, not the messages (their pictures) or the prompt; the
    decode instance answers from them alone, as the integrated server answers the whole body."""
    buffer = io.BytesIO()
    random_image(112, 84, 8).save(buffer, "PNG")
    picture = data_url(buffer.getvalue())
    sampling = {"model": "m", "max_tokens": 6, "temperature": 1.0, "seed": 5, "ignore_eos": True, "stream": stream}
    requests = {"/v1/chat/completions": {**sampling, "logprobs": True, "top_logprobs": 2, "messages": [
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": picture}},
                                                 {"type": "text", "text": "what is it"}]}]},
                "/v1/completions": {**sampling, "logprobs": 2, "prompt": "the cat sat on the mat"}}
    decode = Server(make_llm(ckpt), ServerConfig("m", role="decode"))
    decode.app = received = RecordedBodies(decode.app)
    with BackgroundServer(Server(make_llm(ckpt), ServerConfig("m"))) as whole_url, \
            BackgroundServer(Server(make_llm(ckpt), ServerConfig("m", role="prefill"))) as prefill_url, \
            BackgroundServer(decode) as decode_url, \
            BackgroundServer(Router([], [prefill_url], [decode_url])) as router_url:
        for path, body in requests.items():
            whole, split = answer_of(whole_url, path, body), answer_of(router_url, path, body)
            assert split["logprobs"] == pytest.approx(whole["logprobs"], abs=1e-5), path
            del split["logprobs"], whole["logprobs"]
            assert split == whole and len(whole["tokens"]) == 6 and whole["finish"] == "length", path
    assert len(received.bodies) == 2 and all(len(raw) < len(picture) for raw in received.bodies)
    for raw, client_body in zip(received.bodies, requests.values()):
        sent = json.loads(raw)
        assert "messages" not in sent and "prompt" not in sent and "transfer_id" in sent["kv_transfer_params"]
        assert {k: v for k, v in sent.items() if k != "kv_transfer_params"} == \
            {k: v for k, v in client_body.items() if k not in ("messages", "prompt")}


def test_a_pool_picks_the_instance_holding_the_least_work_and_goes_round_among_equals():
    pool = Pool("engine", ["http://a/", "http://b", "http://c"])
    assert pool.urls == ["http://a", "http://b", "http://c"]
    assert [pool.pick(work) for work in (10, 3, 5)] == ["http://a", "http://b", "http://c"]
    assert pool.pick(1) == "http://b"  # holds 3 of 10, 3, 5
    pool.done("http://a", 10)
    assert pool.pick(2) == "http://a" and pool.outstanding == {"http://a": 2, "http://b": 4, "http://c": 5}
    for url in pool.urls:
        pool.done(url, pool.outstanding[url])
    assert pool.routed == {"http://a": 2, "http://b": 2, "http://c": 1} and pool.pick(1) == "http://c"


def test_a_request_brings_its_prompt_tokens_as_its_work():
    buffer = io.BytesIO()
    random_image(112, 84, 1).save(buffer, "PNG")
    chat = {"messages": [{"role": "system", "content": "x" * 8}, {"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(buffer.getvalue())}}, {"type": "text", "text": "y" * 4}]}]}
    assert estimated_visual_tokens(chat) == 4 * 3  # 112 x 84 pixels: 4 x 3 tokens of 28 x 28
    assert estimated_prompt_tokens(chat) == 12 + 3  # and 12 characters of text
    assert estimated_prompt_tokens({"prompt": "z" * 40}) == 10 and estimated_prompt_tokens({"prompt": ""}) == 1


def test_the_router_reads_a_picture_s_size_from_its_first_bytes_only():
    """A payload whose tail past the header is not even base64 still gives its size: the router never decodes a
    whole picture it forwards. A JPEG whose size comes after a 20 KB EXIF block is read whole."""
    buffer = io.BytesIO()
    random_image(640, 480, 2).save(buffer, "PNG")
    payload = base64.b64encode(buffer.getvalue()).decode()
    assert len(payload) > 2 * HEADER_BASE64_CHARS
    assert picture_size(payload[:HEADER_BASE64_CHARS] + "!" * len(payload)) == (640, 480)
    exif = Image.Exif()
    exif[0x010E] = "x" * 20_000  # ImageDescription
    buffer = io.BytesIO()
    random_image(300, 200, 3).save(buffer, "JPEG", exif=exif)
    assert picture_size(base64.b64encode(buffer.getvalue()).decode()) == (300, 200)


@pytest.mark.parametrize("bad", [dict(encoder_urls=["http://e"]), dict(prefill_urls=["http://p"])])
def test_a_router_of_whole_engines_takes_no_split_pools(bad):
    pools = {"encoder_urls": [], "prefill_urls": [], "decode_urls": [], **bad}
    with pytest.raises(ValueError, match="not both"):
        Router(**pools, engine_urls=["http://engine"])


def test_a_router_of_whole_engines_passes_each_request_through_and_uses_every_engine(ckpt):
    """dp2: each request, chat or completion, streamed or not, goes whole and unchanged to one engine, and its
    answer comes back as an integrated engine's (greedy: the same tokens); one request at a time still reaches
    both engines (the least loaded, then the one sent fewer)."""
    buffer = io.BytesIO()
    random_image(112, 84, 8).save(buffer, "PNG")
    sampling = {"model": "m", "max_tokens": 5, "temperature": 0.0, "ignore_eos": True}
    chat = {**sampling, "logprobs": True, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(buffer.getvalue())}}, {"type": "text", "text": "what"}]}]}
    completion = {**sampling, "logprobs": 1, "prompt": "the cat sat on the mat"}
    requests = [(path, {**body, "stream": stream}) for stream in (False, True)
                for path, body in (("/v1/chat/completions", chat), ("/v1/completions", completion))]
    engines = [Server(make_llm(ckpt), ServerConfig("m")) for _ in range(2)]
    received = []
    for engine in engines:
        engine.app = recorded = RecordedBodies(engine.app)
        received.append(recorded.bodies)
    with BackgroundServer(Server(make_llm(ckpt), ServerConfig("m"))) as whole_url, \
            BackgroundServer(engines[0]) as first_url, BackgroundServer(engines[1]) as second_url, \
            BackgroundServer(Router([], [], [], engine_urls=[first_url, second_url], routing="load")) as router_url:
        for path, body in requests:
            whole, routed = answer_of(whole_url, path, body), answer_of(router_url, path, body)
            assert routed["logprobs"] == pytest.approx(whole["logprobs"], abs=1e-5), path
            del routed["logprobs"], whole["logprobs"]
            assert routed == whole and len(whole["tokens"]) == 5, path
        metrics = httpx.get(router_url + "/metrics").text
    assert [len(bodies) for bodies in received] == [2, 2]
    sent = [json.loads(raw) for bodies in received for raw in bodies]
    assert sorted(sent, key=json.dumps) == sorted((body for _, body in requests), key=json.dumps)  # unchanged
    for url in (first_url, second_url):
        assert f'nanomm_router_routed_total{{role="engine",url="{url}"}} 2.0' in metrics


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_an_engine_that_is_gone_is_a_502_from_a_router_of_whole_engines(stream):
    gone = f"http://127.0.0.1:{free_local_port()}"
    with BackgroundServer(Router([], [], [], peer_timeout_s=5.0, engine_urls=[gone])) as url:
        answer = httpx.post(url + "/v1/completions", json={"prompt": "hi", "stream": stream}, timeout=30)
    assert answer.status_code == 502 and f"the engine instance at {gone} failed" in answer.json()["error"]["message"]


def test_a_decode_instance_checks_a_continuations_fields_and_handoff_and_only_it_takes_one(ckpt):
    """A body with a handoff and no messages: its fields are checked as any request's (an unknown one named), its
    handoff as before; an instance of another role still refuses a handoff."""
    handoff = {"kv_transfer_params": {"transfer_id": "t"}, "max_tokens": 2}
    prompts = {"/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}]},
               "/v1/completions": {"prompt": "hi"}}
    with BackgroundServer(Server(make_llm(ckpt), ServerConfig("m", role="decode"))) as decode_url, \
            BackgroundServer(Server(make_llm(ckpt), ServerConfig("m"))) as whole_url:
        for path, prompt in prompts.items():
            instruction = {**prompt, "kv_transfer_params": {"do_remote_decode": True}}
            cases = [(decode_url, {**handoff, "functions": []}, "['functions']"),
                     (decode_url, {**handoff, "temperature": -1}, "temperature"),
                     (decode_url, handoff, "not a handoff from a nanomm prefill instance"),
                     (decode_url, {**handoff, **prompt}, "not a handoff from a nanomm prefill instance"),
                     (decode_url, instruction, "only a prefill instance hands off"),
                     (decode_url, {k: v for k, v in instruction.items() if k not in prompt}, "non-empty"),
                     (whole_url, handoff, "only a decode instance takes a handoff")]
            for url, body, words in cases:
                answer = httpx.post(url + path, json=body, timeout=30)
                assert answer.status_code == 400 and words in answer.json()["error"]["message"], (path, answer.text)


def test_every_role_reports_its_host_cpu(ckpt):
    """nanomm_host_cpu_seconds_total on the engine's server, the encoder service and the router: this process's
    CPU seconds (in a test, all three share one process), which grow with the work it does."""
    def cpu_seconds(url: str) -> float:
        line = next(line for line in httpx.get(url + "/metrics").text.splitlines()
                    if line.startswith("nanomm_host_cpu_seconds_total "))
        return float(line.split()[-1])

    llm = LLM(str(ckpt), device="cpu", dtype="float32", num_preprocess_workers=0)
    with BackgroundServer(EncoderServer(load_encoder(str(ckpt)), "m")) as encoder, \
            BackgroundServer(Server(llm, ServerConfig("m"))) as engine, \
            BackgroundServer(Router([encoder], [engine], [engine], 5.0)) as router:
        before = {name: cpu_seconds(url) for name, url in (("encoder", encoder), ("engine", engine),
                                                           ("router", router))}
        for _ in range(2):  # work through the engine's own server: its thread is the only one that steps it
            answer = httpx.post(engine + "/v1/chat/completions", timeout=60, json={
                "model": "m", "max_tokens": 4, "temperature": 0,
                "messages": [{"role": "user", "content": "a few words"}]})
            assert answer.status_code == 200, answer.text
        after = {name: cpu_seconds(url) for name, url in (("encoder", encoder), ("engine", engine),
                                                          ("router", router))}
    assert all(0 < before[name] < after[name] for name in before), (before, after)
    llm.close()
