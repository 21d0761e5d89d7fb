"""The step timeline (nanomm/engine/trace.py): a well-formed Chrome/Perfetto trace that agrees with the metrics."""

import json
import os
import subprocess
import sys
from collections import defaultdict

import pytest

from helpers import chat_prompt, random_image
from nanomm import LLM, SamplingParams

STEP_PARTS = {"step", "schedule", "propose", "encode", "forward", "sample", "commit"}
REQUEST_EVENTS = {"preprocess", "waiting", "prefill", "encode", "prefill chunk", "decode", "verify", "preempted",
                  "finish"}
US = 1e-6  # the trace's unit, in seconds


def load_trace(path) -> dict:
    trace = json.loads(path.read_text())
    assert set(trace) >= {"traceEvents"} and trace["displayTimeUnit"] == "ms"
    for event in trace["traceEvents"]:
        assert event["ph"] in {"X", "i", "C", "M"}, event
        assert isinstance(event["pid"], int) and isinstance(event["name"], str)
        if event["ph"] != "M":
            assert isinstance(event["ts"], (int, float)) and event["ts"] >= 0, event
        if event["ph"] == "X":
            assert isinstance(event["tid"], int) and event["dur"] >= 0, event
    return trace


def lanes(trace) -> tuple[dict, dict]:
    """(lane name -> its X and i events in time order, counters by name)."""
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"]
             if e["ph"] == "M" and e["name"] == "thread_name"}
    by_lane, counters = defaultdict(list), defaultdict(list)
    for e in trace["traceEvents"]:
        if e["ph"] in "Xi":
            by_lane[names[e["pid"], e["tid"]]].append(e)
        elif e["ph"] == "C":
            counters[e["name"]].append(e["args"])
    return {k: sorted(v, key=lambda e: (e["ts"], -e.get("dur", 0))) for k, v in by_lane.items()}, counters


def assert_nested_or_disjoint(events) -> None:
    """Spans on one lane never half-overlap: the timeline viewers draw them as a stack."""
    stack = []
    for e in (e for e in events if e["ph"] == "X"):
        while stack and e["ts"] >= stack[-1]["ts"] + stack[-1]["dur"] - 1e-3:
            stack.pop()
        if stack:
            parent = stack[-1]
            assert e["ts"] + e["dur"] <= parent["ts"] + parent["dur"] + 1e-3, (parent, e)
        stack.append(e)


def traced_run(ckpt, path, prompts, params, **engine_args):
    with LLM(ckpt, trace_path=str(path), **engine_args) as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.stats()
    assert path.is_file()  # written as the LLM closed
    return outputs, stats, load_trace(path)


def test_each_request_s_ttft_stages_are_its_lane_s_spans(ckpt, tmp_path):
    images = [random_image(90, 60, 1), random_image(120, 100, 2)]
    prompts = [chat_prompt("Describe both pictures.", images), chat_prompt("Hello there"),
               chat_prompt("And this one?", images[:1])]
    params = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0)
    # A small budget cuts the image prompts into chunks that interleave with the text request's decodes.
    outputs, stats, trace = traced_run(ckpt, tmp_path / "run.json", prompts, params, max_num_batched_tokens=24,
                                       max_num_encoder_tokens=24, num_kv_blocks=64, block_size=8)
    by_lane, counters = lanes(trace)
    steps = by_lane["engine steps"]
    assert {e["name"] for e in steps} <= STEP_PARTS and {"step", "schedule", "forward", "sample", "commit"} <= {
        e["name"] for e in steps}
    assert sum(e["name"] == "step" for e in steps) == stats["steps"]
    assert_nested_or_disjoint(steps)
    for out in outputs:
        m, events = out.metrics, by_lane[f"request {out.request_id}"]
        assert {e["name"] for e in events} <= REQUEST_EVENTS
        assert_nested_or_disjoint(events)
        first = {name: next(e for e in events if e["name"] == name) for name in ("preprocess", "waiting", "prefill")}
        # The lane's spans are the TTFT stages, end to end, and add up to the measured TTFT.
        assert first["preprocess"]["ts"] + first["preprocess"]["dur"] == pytest.approx(first["waiting"]["ts"], abs=2)
        assert first["waiting"]["ts"] + first["waiting"]["dur"] == pytest.approx(first["prefill"]["ts"], abs=2)
        total = sum(e["dur"] for e in first.values()) * US
        assert total == pytest.approx(m.ttft_s, abs=5e-6)
        assert first["preprocess"]["dur"] * US == pytest.approx(m.preprocess_s, abs=2e-6)
        assert first["waiting"]["dur"] * US == pytest.approx(m.queue_s, abs=2e-6)
        encode = sum(e["dur"] for e in events if e["name"] == "encode") * US
        assert encode == pytest.approx(m.encode_s, abs=5e-6)
        assert first["prefill"]["dur"] * US - encode == pytest.approx(m.prefill_s, abs=1e-5)
        assert first["prefill"]["args"]["ttft_s"] == m.ttft_s
        chunks = [e for e in events if e["name"] == "prefill chunk"]
        assert sum(e["args"]["positions"][1] - e["args"]["positions"][0] for e in chunks) == m.num_prompt_tokens - m.num_cached_tokens
        assert sum(e["name"] == "decode" for e in events) == m.num_decode_steps == 5
        [finish] = [e for e in events if e["name"] == "finish"]
        assert finish["args"] == {"reason": "length", "output_tokens": 6}
    image_requests = [o for o in outputs if o.metrics.num_visual_tokens]
    assert any(len([e for e in by_lane[f"request {o.request_id}"] if e["name"] == "prefill chunk"]) > 1
               for o in image_requests)  # the budget did cut a prefill into chunks
    assert counters["KV blocks"][-1] == {"used": 0, "free": 64}
    assert max(c["used"] for c in counters["KV blocks"]) > 0
    assert {"prefix", "encoder"} == set(counters["cache hit rate"][-1])


def test_verification_and_preemption_are_on_the_timeline(ckpt, tmp_path):
    prompts = [chat_prompt("one two three one two three one two three " * 2) for _ in range(3)]
    params = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0)
    outputs, stats, trace = traced_run(ckpt, tmp_path / "spec.json", prompts, params, num_kv_blocks=18,
                                       block_size=8, enable_prefix_caching=False,
                                       speculative={"method": "ngram", "num_speculative_tokens": 3})
    by_lane, _ = lanes(trace)
    assert stats["preemptions"] > 0
    preempted = sum(e["name"] == "preempted" for events in by_lane.values() for e in events)
    assert preempted == stats["preemptions"]
    assert any(e["name"] == "propose" for e in by_lane["engine steps"])
    for out in outputs:
        events = by_lane[f"request {out.request_id}"]
        verify = [e for e in events if e["name"] == "verify"]
        m = out.metrics
        assert sum(e["args"]["proposed"] for e in verify) == m.num_draft_tokens
        assert sum(e["args"]["accepted"] for e in verify) == m.num_accepted_tokens
        assert_nested_or_disjoint(events)


def test_no_trace_path_writes_nothing(ckpt, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with LLM(ckpt, num_kv_blocks=32) as llm:
        llm.generate("hi", SamplingParams(max_tokens=2), use_tqdm=False)
        assert type(llm.engine.trace).__name__ == "NoTrace"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_the_chat_writes_a_trace(tmp_path):
    trace_file = tmp_path / "chat.json"
    run = subprocess.run([sys.executable, "-m", "nanomm.chat", "--demo", "random", "--max-tokens", "3", "--trace",
                          str(trace_file)], input="hello\n/quit\n", capture_output=True, text=True, timeout=240,
                         env={**os.environ, "NANOMM_CACHE": str(tmp_path / "cache")})
    assert run.returncode == 0, run.stderr[-2000:]
    by_lane, _ = lanes(load_trace(trace_file))
    [lane] = [name for name in by_lane if name.startswith("request ")]
    assert [e["name"] for e in by_lane[lane] if e["name"] in ("preprocess", "waiting", "prefill", "finish")] == [
        "preprocess", "waiting", "prefill", "finish"]
    assert "trace written to" in run.stderr
