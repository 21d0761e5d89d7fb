"""The operator's metrics (nanomm/serve/metrics.py): encoder and LM busy seconds, the OOM count, each request's
visual tokens, device seconds and cost, checked by value against what the engine and its requests report."""

import base64
import io
import math
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from helpers import assert_no_leaks, random_image
from nanomm import LLM, SamplingParams
from nanomm.serve.app import Server, ServerConfig
from nanomm.serve.cli import parse_args
from nanomm.serve.encoder_server import EncoderServer, load_encoder
from nanomm.serve.metrics import LATENCY_BUCKETS, ServerMetrics
from nanomm.serve.testing import BackgroundServer

PRICE = 3.6  # dollars per device hour: a millidollar per device second


def make_llm(ckpt, **kwargs):
    return LLM(str(ckpt), device="cpu", dtype="float32", max_pixels=28 * 28 * 16, num_preprocess_workers=0,
               **kwargs)


def samples(text: str) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def pictured(i: int, size: int = 56) -> dict:
    return {"prompt": f"<|vision_start|><|image_pad|><|vision_end|>picture {i}",
            "multi_modal_data": {"image": random_image(size, size, seed=i)}}


def test_busy_seconds_and_device_seconds_account_for_every_step(ckpt):
    """The encoder's busy seconds are the encodes charged to the requests; the encoder's and the LM's together
    are what the requests' device seconds add up to; and both lie between the time the runner's forward calls
    took and the time the steps took, each timed from outside the engine."""
    llm = make_llm(ckpt)
    engine = llm.engine
    run, step = engine.runner.run, engine.step
    timed = {"run": 0.0, "step": 0.0}

    def timed_call(name, fn):
        def call(*args):
            start = time.perf_counter()
            try:
                return fn(*args)
            finally:
                timed[name] += time.perf_counter() - start
        return call

    engine.runner.run, engine.step = timed_call("run", run), timed_call("step", step)
    prompts = [pictured(i) for i in range(3)] + ["text only", pictured(0)]  # the last one hits the encoder cache
    params = [SamplingParams(max_tokens=5, ignore_eos=True)] * 4 + [SamplingParams(n=2, max_tokens=5, seed=1)]
    outputs = llm.generate(prompts, params, use_tqdm=False)  # the last: two completions, each its own sequence
    stats = engine.stats()
    encoder, lm = stats["encoder_busy_s"], stats["lm_busy_s"]
    assert encoder > 0 and lm > 0
    assert encoder == pytest.approx(sum(out.metrics.encode_s for out in outputs), rel=1e-9)
    assert encoder + lm == pytest.approx(sum(out.metrics.device_s for out in outputs), rel=1e-9)
    assert timed["run"] <= encoder + lm <= timed["step"]
    assert outputs[-1].metrics.encode_s == 0 and outputs[-1].metrics.device_s > 0  # a cache hit still pays its steps
    assert_no_leaks(llm)
    llm.close()


def test_an_admission_refused_for_kv_counts_once_however_long_it_waits(ckpt):
    """Room for one request at a time: the second waits many steps at the head of the queue, which is one
    allocation failure; nobody is preempted."""
    llm = make_llm(ckpt, num_kv_blocks=8, block_size=16, enable_prefix_caching=False)
    long_prompt = {"prompt_token_ids": list(range(10, 110))}  # 100 tokens + 20 generated: 8 blocks
    other = {"prompt_token_ids": list(range(200, 300))}
    llm.generate([long_prompt, other], SamplingParams(max_tokens=20, ignore_eos=True), use_tqdm=False)
    stats = llm.engine.stats()
    assert stats["steps"] > 20  # the second request waited through the first one's decode
    assert (stats["kv_allocation_failures"], stats["preemptions"]) == (1, 0)
    assert_no_leaks(llm)
    llm.close()


def test_a_preemption_is_an_allocation_failure(ckpt):
    """Both fit at first and then outgrow the pool: each preemption counts, and so does the preempted request's
    refused re-admission."""
    llm = make_llm(ckpt, num_kv_blocks=8, block_size=16, enable_prefix_caching=False)
    prompts = [{"prompt_token_ids": list(range(10, 70))}, {"prompt_token_ids": list(range(100, 160))}]
    llm.generate(prompts, SamplingParams(max_tokens=40, ignore_eos=True), use_tqdm=False)
    stats = llm.engine.stats()
    assert stats["preemptions"] >= 1  # each preemption is one failure; its refused re-admissions are the same one
    assert stats["kv_allocation_failures"] == stats["preemptions"]
    assert_no_leaks(llm)
    llm.close()


def test_the_server_exports_each_requests_visual_tokens_device_seconds_and_cost(ckpt):
    llm = make_llm(ckpt)
    with BackgroundServer(Server(llm, ServerConfig("tiny", gpu_hourly_price=PRICE))) as url:
        bodies = [{"model": "tiny", "prompt": "text only", "max_tokens": 3}]
        for size in (56, 112):  # 4 and 16 visual tokens
            buffer = io.BytesIO()
            random_image(size, size, seed=size).save(buffer, "PNG")
            image = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
            bodies.append({"model": "tiny", "max_tokens": 3, "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": image}}, {"type": "text", "text": "what?"}]}]})
        for body in bodies:
            route = "/v1/chat/completions" if "messages" in body else "/v1/completions"
            assert httpx.post(url + route, json=body, timeout=60).status_code == 200
        text = httpx.get(url + "/metrics").text
    got = samples(text)
    visual = [got[("nanomm_request_visual_tokens_bucket", (("le", le),))] for le in ("0.0", "64.0")]
    assert got[("nanomm_request_visual_tokens_count", ())] == 3
    assert got[("nanomm_request_visual_tokens_sum", ())] == 4 + 16
    assert visual == [1, 3]
    device = got[("nanomm_request_device_seconds_sum", ())]
    stats = llm.engine.stats()
    assert device == pytest.approx(stats["encoder_busy_s"] + stats["lm_busy_s"], rel=1e-9)
    assert got[("nanomm_request_cost_dollars_sum", ())] == pytest.approx(device * PRICE / 3600, rel=1e-9)
    assert got[("nanomm_encoder_busy_seconds_total", ())] == pytest.approx(stats["encoder_busy_s"])
    assert got[("nanomm_lm_busy_seconds_total", ())] == pytest.approx(stats["lm_busy_s"])
    assert got[("nanomm_kv_allocation_failures_total", ())] == stats["kv_allocation_failures"]
    assert_no_leaks(llm)
    llm.close()


def test_without_a_price_there_is_no_cost_metric():
    names = {f.name for f in text_string_to_metric_families(ServerMetrics().render().decode())}
    assert "nanomm_request_cost_dollars" not in names and "nanomm_request_device_seconds" in names
    assert parse_args(["--demo", "--gpu-hourly-price", "2.5"]).gpu_hourly_price == 2.5
    for bad in ("-1", "0", "nan", "inf", "free"):
        with pytest.raises(SystemExit):
            parse_args(["--demo", "--gpu-hourly-price", bad])


def test_the_encoder_service_counts_its_busy_seconds(ckpt):
    service = load_encoder(str(ckpt))
    with BackgroundServer(EncoderServer(service, "m")) as url:
        llm = make_llm(ckpt, encoder_url=url)
        outputs = llm.generate([pictured(i) for i in range(2)], SamplingParams(max_tokens=2), use_tqdm=False)
        got = samples(httpx.get(url + "/metrics").text)
        local = llm.engine.stats()
        assert_no_leaks(llm)
        llm.close()
    busy = got[("nanomm_encoder_busy_seconds_total", ())]
    assert busy > 0 and busy == pytest.approx(got[("nanomm_encoder_encode_seconds_sum", ())], rel=1e-9)
    assert local["encoder_busy_s"] == 0 and local["lm_busy_s"] > 0  # the instance's own tower never ran
    assert sum(out.metrics.device_s for out in outputs) == pytest.approx(local["lm_busy_s"], rel=1e-9)


def test_latency_buckets_resolve_ten_milliseconds_to_a_minute():
    inside = [b for b in LATENCY_BUCKETS if 0.01 <= b <= 60]
    assert inside[0] == 0.01 and inside[-1] == 60
    assert max(b / a for a, b in zip(inside, inside[1:])) <= 1.5 + 1e-9
    assert math.isclose(min(LATENCY_BUCKETS), 0.005)


def test_prefill_and_decode_instances_each_account_for_their_own_part(ckpt):
    """Split in two behind a router, each instance's device seconds add up to its own busy seconds: the prefill
    instance's include the encode and the prompt, the decode instance's only the decode steps it ran."""
    from nanomm.serve.router import Router

    prefill_llm, decode_llm = make_llm(ckpt), make_llm(ckpt)
    picture = io.BytesIO()
    random_image(112, 84, seed=4).save(picture, "PNG")
    image = "data:image/png;base64," + base64.b64encode(picture.getvalue()).decode()
    body = {"model": "m", "max_tokens": 6, "ignore_eos": True, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": image}}, {"type": "text", "text": "what is it"}]}]}
    with BackgroundServer(Server(prefill_llm, ServerConfig("m", role="prefill", gpu_hourly_price=PRICE))) as prefill, \
            BackgroundServer(Server(decode_llm, ServerConfig("m", role="decode", gpu_hourly_price=PRICE))) as decode, \
            BackgroundServer(Router([], [prefill], [decode])) as router:
        for _ in range(2):
            assert httpx.post(router + "/v1/chat/completions", json=body, timeout=60).status_code == 200
        by_role = {"prefill": (samples(httpx.get(prefill + "/metrics").text), prefill_llm.engine.stats()),
                   "decode": (samples(httpx.get(decode + "/metrics").text), decode_llm.engine.stats())}
    for role, (got, stats) in by_role.items():
        assert got[("nanomm_request_device_seconds_count", ())] == 2, role
        assert got[("nanomm_request_device_seconds_sum", ())] == pytest.approx(
            stats["encoder_busy_s"] + stats["lm_busy_s"], rel=1e-9), role
        assert got[("nanomm_request_cost_dollars_sum", ())] == pytest.approx(
            got[("nanomm_request_device_seconds_sum", ())] * PRICE / 3600, rel=1e-9), role
    assert by_role["prefill"][1]["encoder_busy_s"] > 0 and by_role["decode"][1]["encoder_busy_s"] == 0
    assert by_role["prefill"][0][("nanomm_request_visual_tokens_sum", ())] == 2 * 12  # 112x84: 4 x 3 tokens
    for llm in (prefill_llm, decode_llm):
        assert_no_leaks(llm)
        llm.close()
