"""nanomm-serve through the real OpenAI client (and httpx where the client hides what is tested): answers equal
to the dense reference's, streaming, images, n, stop strings, logprobs, disconnects that free the KV, the 503
of a full queue, timeouts, 400s for bad input, and /metrics parsed with Prometheus' own parser."""

import base64
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from helpers import assert_no_leaks, data_url, random_image, reference_tokens
from nanomm import LLM, SamplingParams
from nanomm.inputs.tokenizer import IncrementalDetokenizer
from nanomm.serve.app import Server, ServerConfig
from nanomm.serve.testing import BackgroundServer, free_local_port

MODEL = "tiny"


def make_llm(ckpt, **kwargs):
    return LLM(str(ckpt), device="cpu", dtype="float32", max_pixels=28 * 28 * 16, **kwargs)


def slow_steps(llm, seconds: float = 0.01):
    """Each engine step takes at least this long, so that a long request is still running when the test acts
    (the tiny model would otherwise finish 4,000 tokens in a few seconds)."""
    step = llm.engine.step

    def slow_step():
        time.sleep(seconds)
        return step()

    llm.engine.step = slow_step
    return llm


def png_url(seed: int, width: int = 56, height: int = 56) -> str:
    buffer = io.BytesIO()
    random_image(width, height, seed).save(buffer, "PNG")
    return data_url(buffer.getvalue())


def user(text: str, *image_urls: str) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": url}} for url in image_urls]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def engine_prompt(llm, messages) -> dict:
    """The prompt the server builds for these messages, for the dense reference."""
    text, images = llm.tokenizer.apply_chat_template(messages)
    return {"prompt": text, "multi_modal_data": {"image": images}}


def text_of(llm, token_ids: list[int]) -> str:
    """The text the engine streams for these tokens (a trailing half UTF-8 character is held back)."""
    detokenizer = IncrementalDetokenizer(llm.tokenizer)
    return "".join(map(detokenizer.step, token_ids))


def reference_text(llm, messages, params: SamplingParams) -> str:
    return text_of(llm, reference_tokens(llm, engine_prompt(llm, messages), params))


def metrics(base: str) -> dict:
    """Every sample of /metrics by name and labels, parsed by prometheus_client's parser."""
    families = text_string_to_metric_families(httpx.get(base + "/metrics").text)
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families for s in f.samples}


def wait_until_idle(llm, timeout_s: float = 20.0) -> None:
    """The engine thread finishes what is left; the test waits (bounded) without touching the engine."""
    deadline = time.monotonic() + timeout_s
    while llm.engine.has_unfinished_requests() or llm.engine.requests:
        assert time.monotonic() < deadline, "the engine did not go idle"
        time.sleep(0.02)


@pytest.fixture
def served(ckpt):
    """A server on 127.0.0.1 (a free port) over a fresh LLM; yields (llm, base url, OpenAI client)."""
    llm = make_llm(ckpt)
    with BackgroundServer(Server(llm, ServerConfig(MODEL))) as base:
        yield llm, base, openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    assert_no_leaks(llm)


# -- answers --------------------------------------------------------------------------------------------------

def test_chat_answer_is_the_references(served):
    llm, _, client = served
    messages = user("What is in this picture?", png_url(1))
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    expected = reference_text(llm, messages, SamplingParams(temperature=0, max_tokens=12))
    choice = reply.choices[0]
    assert (choice.message.role, choice.message.content) == ("assistant", expected)
    prepared = llm.engine.prepare(engine_prompt(llm, messages), None)
    assert reply.usage.prompt_tokens == len(prepared.token_ids)
    assert reply.usage.model_extra["visual_tokens"] == prepared.num_visual_tokens > 0
    assert reply.model == MODEL and reply.object == "chat.completion"


def test_streamed_chat_adds_up_to_the_whole_answer(served):
    llm, _, client = served
    messages = user("Tell me about these.", png_url(2), png_url(3, 84, 28))
    params = dict(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    whole = client.chat.completions.create(**params)
    chunks = list(client.chat.completions.create(**params, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content == reference_text(llm, messages, SamplingParams(
        temperature=0, max_tokens=16))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_completions_endpoint(served):
    llm, _, client = served
    prompt = "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, logprobs=2)
    params = SamplingParams(temperature=0, max_tokens=8)
    assert reply.choices[0].text == text_of(llm, reference_tokens(llm, prompt, params))
    logprobs = reply.choices[0].logprobs
    assert len(logprobs.token_logprobs) == 8 and all(len(top) >= 2 for top in logprobs.top_logprobs)
    streamed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == reply.choices[0].text


def test_n_stop_and_logprobs(served):
    llm, base, client = served
    messages = user("Count with me.")
    full = reference_text(llm, messages, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    stop = full[8:11]
    assert stop.strip() and full.count(stop) == 1, full
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0, n=2,
                                           stop=[stop], logprobs=True, top_logprobs=3,
                                           extra_body={"ignore_eos": True})
    assert [c.index for c in reply.choices] == [0, 1]
    for choice in reply.choices:
        assert choice.message.content == full[:full.index(stop)] and choice.finish_reason == "stop"
        entries = choice.logprobs.content
        assert entries and all(len(e.top_logprobs) == 3 for e in entries)
        for e in entries:  # the chosen token is greedy: the most likely one, listed first
            assert e.top_logprobs[0].logprob == e.logprob >= e.top_logprobs[1].logprob >= e.top_logprobs[2].logprob
    assert llm.stats()["prefix_cache_hit_tokens"] > 0  # the second completion reused the first's prompt blocks
    sampled = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=1.0, n=3,
                                             seed=7, extra_body={"ignore_eos": True})
    again = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=1.0, n=3,
                                           seed=7, extra_body={"ignore_eos": True})
    texts = [c.message.content for c in sampled.choices]
    assert texts == [c.message.content for c in again.choices] and len(set(texts)) > 1


def test_streamed_n_and_logprobs(served):
    _, _, client = served
    params = dict(model=MODEL, messages=user("hi"), max_tokens=10, temperature=0.8, seed=3, n=2, logprobs=True,
                  top_logprobs=1, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**params)
    texts, logprobs = {0: "", 1: ""}, {0: [], 1: []}
    for c in client.chat.completions.create(**params, stream=True):
        for choice in c.choices:
            texts[choice.index] += choice.delta.content or ""
            logprobs[choice.index] += choice.logprobs.content if choice.logprobs else []
    for choice in whole.choices:
        assert texts[choice.index] == choice.message.content
        # The same tokens, and their logprobs to float rounding: decode attention is batched (attention.py), so a
        # request's numbers depend on which other sequences shared its steps, at the level of 1e-7.
        assert [e.token for e in logprobs[choice.index]] == [e.token for e in choice.logprobs.content]
        assert [e.logprob for e in logprobs[choice.index]] == pytest.approx(
            [e.logprob for e in choice.logprobs.content], abs=1e-5)
        assert len(logprobs[choice.index]) == 10


# -- load and failure -------------------------------------------------------------------------------------------

def long_request(base: str) -> httpx.Response:
    body = {"model": MODEL, "messages": user("go on"), "max_tokens": 100000, "ignore_eos": True, "stream": True}
    return httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=30)


def test_a_disconnect_mid_stream_aborts_and_frees_the_kv(served):
    llm, base, _ = served
    slow_steps(llm)
    with long_request(base) as stream:
        lines = stream.iter_lines()
        first = next(lines)
        assert json.loads(first[6:])["choices"][0]["delta"]["role"] == "assistant"
        assert llm.stats()["kv_blocks_used"] > 0
    wait_until_idle(llm)
    assert llm.stats()["kv_blocks_used"] == 0
    assert metrics(base)[("nanomm_requests_total", (("finish_reason", "abort"),))] == 1


def test_a_full_queue_answers_503_with_retry_after(ckpt):
    llm = slow_steps(make_llm(ckpt))
    with BackgroundServer(Server(llm, ServerConfig(MODEL, max_pending_requests=1))) as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        with long_request(base) as stream:
            lines = stream.iter_lines()  # kept: a closed line iterator closes the connection
            assert next(lines).startswith("data: ")
            refused = httpx.post(base + "/v1/chat/completions", json={"messages": user("hi"), "max_tokens": 2})
            assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
            assert refused.json()["error"]["type"] == "service_unavailable"
            with pytest.raises(openai.InternalServerError):
                client.chat.completions.create(model=MODEL, messages=user("hi"), max_tokens=2)
        wait_until_idle(llm)
        reply = client.chat.completions.create(model=MODEL, messages=user("hi"), max_tokens=2)  # room again
        assert reply.choices[0].finish_reason in ("length", "stop")
    assert_no_leaks(llm)


def test_a_request_past_its_timeout_is_aborted(ckpt):
    llm = slow_steps(make_llm(ckpt))
    with BackgroundServer(Server(llm, ServerConfig(MODEL, request_timeout_s=0.5))) as base:
        body = {"messages": user("go on"), "max_tokens": 100000, "ignore_eos": True}
        answer = httpx.post(base + "/v1/chat/completions", json=body, timeout=30)
        assert answer.status_code == 504 and "0.5 s" in answer.json()["error"]["message"]
        with httpx.stream("POST", base + "/v1/chat/completions", json={**body, "stream": True}, timeout=30) as s:
            events = [line for line in s.iter_lines() if line.startswith("data: ")]
        assert json.loads(events[-1][6:])["error"]["code"] == 504
        wait_until_idle(llm)
        assert llm.stats()["kv_blocks_used"] == 0
    assert_no_leaks(llm)


def corrupt_png_url() -> str:
    return "data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\nnot really").decode()


BAD_BODIES = {
    "unknown field": ({"messages": user("hi"), "functions": []}, "functions"),
    "no messages": ({"max_tokens": 2}, "messages"),
    "bad temperature": ({"messages": user("hi"), "temperature": -1}, "temperature"),
    "n is zero": ({"messages": user("hi"), "n": 0}, "n"),
    "stop not strings": ({"messages": user("hi"), "stop": [3]}, "stop"),
    "top_logprobs alone": ({"messages": user("hi"), "top_logprobs": 2}, "logprobs"),
    "stream not a bool": ({"messages": user("hi"), "stream": "yes"}, "stream"),
    "a part of no known type": ({"messages": [{"role": "user", "content": [{"type": "video"}]}]}, "video"),
    "an http image": ({"messages": user("hi", "https://example.com/cat.png")}, "data URL"),
    "a local path": ({"messages": user("hi", "/etc/passwd")}, "allowed-local-media-path"),
    "an image part naming a path": ({"messages": [{"role": "user", "content": [
        {"type": "image", "image": "/etc/passwd"}, {"type": "text", "text": "hi"}]}]}, "allowed-local-media-path"),
    "a corrupt image": ({"messages": user("hi", corrupt_png_url())}, "image"),
    "too many images": ({"messages": user("hi", *[png_url(i) for i in range(17)])}, "image"),
    "pixel cap above the engine's": ({"messages": user("hi", png_url(1)),
                                      "mm_processor_kwargs": {"max_pixels": 10**9}}, "max_pixels"),
    "a prompt too long": ({"messages": user("word " * 40000)}, "max_model_len"),
}


@pytest.mark.parametrize("case", BAD_BODIES)
def test_bad_requests_get_a_400_in_openais_shape(served, case):
    llm, base, client = served
    body, words = BAD_BODIES[case]
    answer = httpx.post(base + "/v1/chat/completions", json=body, timeout=30)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["type"] == "invalid_request_error" and words in error["message"], error
    assert client.chat.completions.create(model=MODEL, messages=user("hi"), max_tokens=2).choices  # still serving
    wait_until_idle(llm)


def test_malformed_bodies_wrong_models_and_oversized_bodies(ckpt):
    llm = make_llm(ckpt)
    with BackgroundServer(Server(llm, ServerConfig(MODEL, max_body_bytes=4096))) as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        not_json = httpx.post(base + "/v1/chat/completions", content=b"{not json", timeout=30)
        assert not_json.status_code == 400 and "JSON" in not_json.json()["error"]["message"]
        with pytest.raises(openai.NotFoundError, match="does not exist"):
            client.chat.completions.create(model="gpt-4", messages=user("hi"))
        big = {"messages": user("hi", png_url(1, 448, 448))}
        too_big = httpx.post(base + "/v1/chat/completions", json=big, timeout=30)
        assert too_big.status_code == 413 and "4096 bytes" in too_big.json()["error"]["message"]
        chunked = httpx.post(base + "/v1/chat/completions", content=iter([json.dumps(big).encode()]), timeout=30)
        assert chunked.status_code == 413  # no Content-Length to trust: counted while reading
        assert llm.stats()["steps"] == 0  # none of it reached the engine
    assert_no_leaks(llm)


def test_local_images_only_under_the_allowed_folder(ckpt, tmp_path):
    llm = make_llm(ckpt)
    allowed = tmp_path / "media"
    allowed.mkdir()
    random_image(56, 56, 4).save(allowed / "cat.png")
    random_image(56, 56, 5).save(tmp_path / "secret.png")
    with BackgroundServer(Server(llm, ServerConfig(MODEL, media_root=allowed))) as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        for url in (str(allowed / "cat.png"), (allowed / "cat.png").as_uri()):
            reply = client.chat.completions.create(model=MODEL, messages=user("hi", url), max_tokens=2)
            assert reply.usage.model_extra["visual_tokens"] > 0
        for url in (str(tmp_path / "secret.png"), str(allowed / ".." / "secret.png")):
            with pytest.raises(openai.BadRequestError, match="outside the allowed"):
                client.chat.completions.create(model=MODEL, messages=user("hi", url), max_tokens=2)
    assert_no_leaks(llm)


# -- the other endpoints ----------------------------------------------------------------------------------------

def test_metrics_show_the_kv_pool_before_the_first_request(served):
    llm, base, _ = served
    samples = metrics(base)
    assert llm.stats()["steps"] == 0  # nothing has run yet
    assert samples[("nanomm_kv_blocks_total", ())] == len(llm.engine.block_manager.blocks) > 0
    assert samples[("nanomm_kv_blocks_used", ())] == 0


def test_models_health_and_metrics(served):
    llm, base, client = served
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(base + "/health").json() == {"status": "ok", "role": "integrated"}
    replies = [client.chat.completions.create(model=MODEL, messages=user("hi", png_url(i)), max_tokens=3,
                                              temperature=0, extra_body={"ignore_eos": True}) for i in range(3)]
    wait_until_idle(llm)
    samples = metrics(base)
    assert samples[("nanomm_time_to_first_token_seconds_count", ())] == 3
    stages = sum(samples[(f"nanomm_ttft_{s}_seconds_sum", ())] for s in ("preprocess", "queue", "encode", "prefill"))
    assert stages == pytest.approx(samples[("nanomm_time_to_first_token_seconds_sum", ())], rel=1e-6)
    assert samples[("nanomm_generation_tokens_total", ())] == 9
    assert samples[("nanomm_prompt_tokens_total", ())] == sum(r.usage.prompt_tokens for r in replies)
    assert samples[("nanomm_visual_tokens_total", ())] == sum(r.usage.model_extra["visual_tokens"] for r in replies)
    assert samples[("nanomm_requests_total", (("finish_reason", "length"),))] == 3
    assert samples[("nanomm_kv_blocks_total", ())] == llm.stats()["kv_blocks_total"]
    assert samples[("nanomm_kv_blocks_used", ())] == 0 and samples[("nanomm_requests_running", ())] == 0
    assert samples[("nanomm_engine_steps_total", ())] == llm.stats()["steps"] > 0


# -- the command and the README's examples --------------------------------------------------------------------

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_block(language: str, containing: str) -> str:
    blocks = re.findall(r"```(\w+)\n(.*?)```", README.read_text(encoding="utf-8"), re.S)
    return next(code for lang, code in blocks if lang == language and containing in code)


def free_port() -> int:
    return free_local_port()


def wait_for_health(base: str, server: subprocess.Popen, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert server.poll() is None, server.stdout.read()
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.2)
    raise AssertionError("nanomm-serve did not come up")


@pytest.mark.slow
def test_nanomm_serve_demo_runs_the_readme_examples(tmp_path):
    """`nanomm-serve --demo` as the README starts it; its curl and openai-client examples, run as written (on
    another port); Ctrl-C stops it cleanly."""
    command = shutil.which("nanomm-serve")
    assert command, "nanomm-serve is not installed (pip install -e '.[serve]')"
    port = free_port()
    env = {**os.environ, "NANOMM_CACHE": str(tmp_path)}
    server = subprocess.Popen([command, "--demo", "--port", str(port)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    try:
        wait_for_health(f"http://127.0.0.1:{port}", server)
        curl = readme_block("bash", "curl -s").replace("8000", str(port))
        answer = json.loads(subprocess.run(["bash", "-c", curl], capture_output=True, text=True, timeout=60).stdout)
        assert answer["model"] == "nanomm-demo" and answer["usage"]["completion_tokens"] > 0
        client = readme_block("py", "OpenAI(").replace("8000", str(port))
        run = subprocess.run([sys.executable, "-c", client], capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr[-2000:]
        counts = re.search(r"(\d+) prompt tokens, (\d+) visual$", run.stdout.strip())
        assert counts and int(counts.group(1)) > int(counts.group(2)) > 0, run.stdout
    finally:
        server.send_signal(signal.SIGINT)
        output = server.communicate(timeout=60)[0]
    assert server.returncode == 0, output[-2000:]


def test_a_port_for_a_later_server_is_outside_the_range_outgoing_connections_take():
    """Ports picked for servers that start later come from below Linux's ephemeral range, so no health check or
    peer request made in the meantime can take one (the split-engine tests start six servers that way)."""
    import random
    import socket
    low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    ports = {free_local_port(random.Random(seed)) for seed in range(20)}
    assert all(1024 <= port < min(low, 32768) for port in ports) and len(ports) > 10
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports.pop()))
