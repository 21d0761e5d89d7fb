"""Structured outputs (nanomm/engine/structured.py): every constrained answer is checked by a validator written
here (json.loads and a schema check, re.fullmatch, membership), and stays the same under chunked prefill,
preemption, the prefix cache and speculative decoding; neighbours in the batch are untouched; bad constraints are
a 400 / InvalidInputError before any compute; without llguidance the error names the extra."""

import json
import math
import re
import sys

import httpx
import pytest

from helpers import assert_no_leaks
from nanomm import LLM, InvalidInputError, SamplingParams, StructuredOutputsParams
from nanomm.serve.app import Server, ServerConfig
from nanomm.serve.testing import BackgroundServer

pytest.importorskip("llguidance")

PROMPTS = ["Hello there", "Describe a cat in one word", "1 2 3 4 5 6 1 2 3"]
COLOURS = ["red", "green", "blue"]
# Compact JSON (llguidance's x-guidance option): random weights otherwise wander through whitespace for ever.
PERSON = {"type": "object", "properties": {"colour": {"enum": COLOURS}, "n": {"type": "integer", "minimum": 0,
                                                                               "maximum": 99}},
          "required": ["colour", "n"], "additionalProperties": False, "x-guidance": {"whitespace_flexible": False}}
REGEX = r"[0-9]{3}-[a-z]{2}"
LARK = 'start: greeting " " name "!"\ngreeting: "Hi" | "Hello"\nname: /[a-z]{2,4}/'
CONSTRAINTS = {
    "regex": StructuredOutputsParams(regex=REGEX),
    "choice": StructuredOutputsParams(choice=["yes", "no", "maybe"]),
    "json": StructuredOutputsParams(json=PERSON),
    "json enum": StructuredOutputsParams(json=json.dumps({"enum": COLOURS})),
    "grammar": StructuredOutputsParams(grammar=LARK),
}


def is_person(value) -> bool:
    return (isinstance(value, dict) and set(value) == {"colour", "n"} and value["colour"] in COLOURS
            and isinstance(value["n"], int) and not isinstance(value["n"], bool) and 0 <= value["n"] <= 99)


def satisfies(kind: str, text: str) -> bool:
    """The answer checked without llguidance."""
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    if kind == "choice":
        return text in ("yes", "no", "maybe")
    if kind == "json":
        return is_person(json.loads(text))
    if kind == "json enum":
        return json.loads(text) in COLOURS
    if kind == "grammar":
        return re.fullmatch(r"(Hi|Hello) [a-z]{2,4}!", text) is not None
    raise ValueError(kind)


def make_llm(ckpt, **kwargs):
    kwargs.setdefault("max_model_len", 256)
    return LLM(str(ckpt), device="cpu", dtype="float32", max_pixels=28 * 28 * 16, **kwargs)


def constrained(kind: str, **kwargs) -> SamplingParams:
    kwargs.setdefault("temperature", 0)
    return SamplingParams(max_tokens=48, structured_outputs=CONSTRAINTS[kind], **kwargs)


@pytest.fixture(scope="module")
def llm(ckpt):
    llm = make_llm(ckpt)
    yield llm
    assert_no_leaks(llm)
    llm.close()


# -- the parameters -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("fields, words", [({}, "exactly one"), ({"regex": "a", "choice": ["a"]}, "exactly one"),
                                           ({"choice": []}, "choice"), ({"choice": "yes"}, "choice"),
                                           ({"regex": 3}, "regex"), ({"json": [1]}, "json"),
                                           ({"json_object": 1}, "json_object")])
def test_a_constraint_sets_exactly_one_valid_kind(fields, words):
    with pytest.raises(InvalidInputError, match=words):
        StructuredOutputsParams(**fields)


def test_sampling_params_take_only_a_structured_outputs_params():
    with pytest.raises(InvalidInputError, match="structured_outputs"):
        SamplingParams(structured_outputs={"regex": "a"})


# -- answers in their shape ---------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", CONSTRAINTS)
def test_greedy_answers_take_the_shape_and_stop(llm, kind):
    outs = llm.generate(PROMPTS, constrained(kind))
    for out in outs:
        completion = out.outputs[0]
        assert satisfies(kind, completion.text), completion.text
        assert completion.finish_reason == "stop"


@pytest.mark.parametrize("kind", CONSTRAINTS)
def test_sampled_answers_take_the_shape(llm, kind):
    outs = llm.generate(PROMPTS, constrained(kind, temperature=1.0, seed=7, top_k=0))
    for out in outs:
        completion = out.outputs[0]
        assert completion.finish_reason in ("stop", "length")
        if completion.finish_reason == "stop":
            assert satisfies(kind, completion.text), completion.text


def test_json_object_is_a_json_object(llm):
    params = SamplingParams(temperature=1.0, seed=2, max_tokens=60,
                            structured_outputs=StructuredOutputsParams(json_object=True))
    finished = 0
    for out in llm.generate(PROMPTS, params):
        completion = out.outputs[0]
        assert completion.text.lstrip().startswith("{")
        if completion.finish_reason == "stop":
            assert isinstance(json.loads(completion.text), dict)
            finished += 1
    assert finished >= 1


def test_logprobs_are_those_of_the_masked_distribution(llm):
    """vLLM masks the logits before its sampler: the tokens outside the grammar have probability zero, the
    allowed ones share all of it. Allowed first tokens: those whose text starts one of the choices."""
    choices = ["yes", "no", "maybe"]
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=50,
                            structured_outputs=StructuredOutputsParams(choice=choices))
    completion = llm.generate(PROMPTS[0], params)[0].outputs[0]
    first = completion.logprobs[0]
    finite = {t: lp for t, lp in first.items() if lp.logprob > -math.inf}
    assert finite and all(any(c.startswith(lp.decoded_token) for c in choices) for lp in finite.values())
    assert math.isclose(sum(math.exp(lp.logprob) for lp in finite.values()), 1.0, rel_tol=1e-4)


# -- levers that must not change a constrained answer ------------------------------------------------------

NGRAM = dict(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)
LEVERS = {
    "chunked prefill": dict(block_size=4, max_num_batched_tokens=7),
    "preemption": dict(block_size=4, num_kv_blocks=20, max_num_batched_tokens=24),
    "ngram speculation": dict(speculative_config=NGRAM),
    "draft speculation": "draft",
}


@pytest.fixture(scope="module")
def plain_answers(llm):
    return {kind: [o.outputs[0].token_ids for o in llm.generate(PROMPTS, constrained(kind))] for kind in CONSTRAINTS}


@pytest.mark.parametrize("lever", LEVERS)
def test_levers_keep_the_constrained_answers(ckpt, plain_answers, lever):
    engine_args = LEVERS[lever]
    if engine_args == "draft":
        engine_args = dict(speculative_config=dict(method="draft", model=str(ckpt), num_speculative_tokens=3))
    llm = make_llm(ckpt, **engine_args)
    kinds = list(CONSTRAINTS)
    params = [constrained(kind) for kind in kinds for _ in PROMPTS]
    outs = llm.generate(PROMPTS * len(kinds), params)
    got = {kind: [o.outputs[0].token_ids for o in outs[i * len(PROMPTS):(i + 1) * len(PROMPTS)]]
           for i, kind in enumerate(kinds)}
    assert got == plain_answers
    stats = llm.stats()
    if lever == "preemption":
        assert stats["preemptions"] > 0
    if "speculation" in lever:
        assert stats["spec_draft_tokens"] > 0
    assert_no_leaks(llm)
    llm.close()


def test_a_prefix_cache_hit_keeps_the_answer(ckpt):
    llm = make_llm(ckpt, block_size=4, enable_prefix_caching=True)
    params = constrained("json")
    first = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    hits_before = llm.stats()["prefix_cache_hit_tokens"]
    second = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    assert llm.stats()["prefix_cache_hit_tokens"] > hits_before
    assert first == second
    assert_no_leaks(llm)
    llm.close()


def test_each_of_n_completions_has_its_own_matcher(llm):
    """Completion i of n draws with seed + i: it equals the single request with that seed."""
    params = constrained("regex", temperature=1.0, seed=11, n=3)
    together = [c.token_ids for c in llm.generate(PROMPTS[1], params)[0].outputs]
    alone = [llm.generate(PROMPTS[1], constrained("regex", temperature=1.0, seed=11 + i))[0].outputs[0].token_ids
             for i in range(3)]
    assert together == alone
    assert all(re.fullmatch(REGEX, llm.get_tokenizer().decode(ids)) for ids in together)


def test_an_unconstrained_neighbour_is_untouched(llm):
    free = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
            SamplingParams(temperature=0.8, seed=5, max_tokens=12, ignore_eos=True)]
    alone = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], free)]
    mixed = llm.generate(PROMPTS[:2] + PROMPTS[2:] * 2, free + [constrained("json"), constrained("regex", seed=3,
                                                                                                  temperature=1.0)])
    assert [o.outputs[0].token_ids for o in mixed[:2]] == alone
    assert satisfies("json", mixed[2].outputs[0].text)


# -- bad constraints, offline and over HTTP ------------------------------------------------------------------

BAD = {
    "regex": (StructuredOutputsParams(regex="[0-9"), "regex"),
    "schema": (StructuredOutputsParams(json={"type": "no-such-type"}), "json"),
    "schema text": (StructuredOutputsParams(json='{"type": '), "not valid JSON"),
    "grammar": (StructuredOutputsParams(grammar='start: "a" rule_that_is_missing'), "grammar"),
    "too large": (StructuredOutputsParams(choice=["x" * 70_000]), "at most"),
}


@pytest.mark.parametrize("case", BAD)
def test_a_bad_constraint_is_refused_before_compute(llm, case):
    constraint, words = BAD[case]
    steps = llm.engine.num_steps
    with pytest.raises(InvalidInputError, match=words):
        llm.generate(PROMPTS[0], SamplingParams(structured_outputs=constraint))
    with pytest.raises(InvalidInputError, match=words):
        llm.engine.add_request(PROMPTS[0], SamplingParams(structured_outputs=constraint))
    assert llm.engine.num_steps == steps and not llm.engine.has_unfinished_requests()


def test_without_llguidance_the_error_names_the_extra(ckpt, monkeypatch):
    monkeypatch.setitem(sys.modules, "llguidance", None)  # what Python does for a package that is not installed
    llm = make_llm(ckpt)
    with pytest.raises(InvalidInputError, match=re.escape("pip install nanomm[structured]")):
        llm.generate(PROMPTS[0], constrained("regex"))
    assert llm.generate(PROMPTS[0], SamplingParams(max_tokens=2))[0].outputs[0].token_ids  # the rest still works
    llm.close()


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


HTTP_BAD = {
    "bad regex": ({"structured_outputs": {"regex": "[0-9"}}, "regex"),
    "bad schema": ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "no-such-type"}}}}, "json"),
    "unknown format": ({"response_format": {"type": "yaml"}}, "response_format"),
    "schema not an object": ({"response_format": {"type": "json_schema", "json_schema": {"schema": [1]}}},
                             "json_schema"),
    "two kinds": ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one"),
    "unknown kind": ({"structured_outputs": {"xml": "<a/>"}}, "xml"),
    "both fields": ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "not both"),
}


def test_over_http_answers_take_the_shape_and_bad_ones_are_400s(ckpt):
    llm = make_llm(ckpt)
    with BackgroundServer(Server(llm, ServerConfig("tiny"))) as base:
        url = base + "/v1/chat/completions"
        body = {"messages": user("Pick a colour"), "max_tokens": 48, "temperature": 0,
                "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                                           "strict": True}}}
        reply = httpx.post(url, json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        assert is_person(json.loads(reply.json()["choices"][0]["message"]["content"]))
        body = {"messages": user("Say yes or no"), "max_tokens": 8, "temperature": 0, "logprobs": True,
                "top_logprobs": 5, "structured_outputs": {"choice": ["yes", "no"]}}
        reply = httpx.post(url, json=body, timeout=60)
        assert reply.status_code == 200, reply.text  # masked tokens' logprobs are finite numbers in the JSON
        assert reply.json()["choices"][0]["message"]["content"] in ("yes", "no")
        body = {"prompt": "Digits:", "max_tokens": 16, "temperature": 0, "structured_outputs": {"regex": REGEX}}
        reply = httpx.post(base + "/v1/completions", json=body, timeout=60)
        assert re.fullmatch(REGEX, reply.json()["choices"][0]["text"])
        for case, (fields, words) in HTTP_BAD.items():
            reply = httpx.post(url, json={"messages": user("hi"), "max_tokens": 4, **fields}, timeout=60)
            assert reply.status_code == 400, (case, reply.text)
            assert words in reply.json()["error"]["message"], (case, reply.text)
    assert_no_leaks(llm)
    llm.close()


# -- the trained demo model ------------------------------------------------------------------------------------

def test_the_demo_model_names_colours_from_a_choice():
    """The shipped model, its answer confined to the palette's names: every answer one of them, and (graded as
    test_demo_model.py grades) about as often right as unconstrained (0.925 on 40 colour questions there)."""
    import nanomm
    from nanomm.demo.evaluation import conversation, held_out_items
    from nanomm.demo.scenes import COLOURS as PALETTE
    from nanomm.demo.tasks import grade

    items = held_out_items("colour", 12, seed=1)
    params = SamplingParams(temperature=0, max_tokens=8,
                            structured_outputs=StructuredOutputsParams(choice=list(PALETTE)))
    with LLM(str(nanomm.demo_checkpoint())) as demo:
        replies = [out.outputs[0].text for out in demo.chat([conversation(item, []) for item in items], params)]
    assert all(reply in PALETTE for reply in replies), replies
    assert sum(grade(item.turns[-1], reply) for item, reply in zip(items, replies)) >= 10, replies


def test_a_prefill_instance_refuses_a_constrained_hand_off(llm):
    """The grammar's state does not travel with the KV: a constrained request is served by an integrated engine."""
    with pytest.raises(InvalidInputError, match="integrated engine"):
        llm.engine.add_request(PROMPTS[0], constrained("regex"), hand_off=True)
    assert not llm.engine.has_unfinished_requests()


def test_a_constraint_compiles_once_per_engine(ckpt, monkeypatch):
    from nanomm.engine.structured import GrammarCompiler

    compiled = []
    original = GrammarCompiler._compile
    monkeypatch.setattr(GrammarCompiler, "_compile", lambda self, kind, text: compiled.append(kind) or
                        original(self, kind, text))
    llm = make_llm(ckpt)
    same = [StructuredOutputsParams(json=PERSON), StructuredOutputsParams(json=json.dumps(PERSON, sort_keys=True))]
    llm.generate(PROMPTS, [SamplingParams(temperature=0, max_tokens=40, structured_outputs=s, n=2)
                           for s in same + same[:1]])
    llm.generate(PROMPTS[0], constrained("choice"))
    assert compiled == ["json", "choice"]
    llm.close()


def test_a_forced_tool_call_through_the_tool_grammar(llm):
    """The server's tool_choice="required" grammar (nanomm/serve/tool_calls.py) run by the engine: each answer is
    one well-formed call, parsed back by the tool-call parser and its arguments checked against the schema here."""
    from nanomm.serve.tool_calls import parse_tool_calls, tool_call_grammar

    cities = ["Paris", "Oslo"]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"enum": cities}}, "required": ["city"],
        "additionalProperties": False}}}]
    grammar = tool_call_grammar(tools, "required", parallel=False)
    params = SamplingParams(temperature=1.0, seed=2, max_tokens=100,
                            structured_outputs=StructuredOutputsParams(grammar=grammar))
    for out in llm.generate(["Weather?", "Hi"], params):
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", completion.text
        content, calls = parse_tool_calls(completion.text)
        assert content is None and len(calls) == 1
        assert calls[0]["function"]["name"] == "get_weather"
        assert json.loads(calls[0]["function"]["arguments"]) in [{"city": c} for c in cities]


def test_the_openai_clients_parse_fills_a_pydantic_model_on_the_demo_model():
    """`client.chat.completions.parse(response_format=Model)`, as an application calls it: the client sends the
    model's strict JSON schema, and the answer (compact JSON, on the shipped model) parses into the model."""
    import base64
    import io
    from typing import Literal

    import openai
    from pydantic import BaseModel

    import nanomm
    from nanomm.demo.evaluation import held_out_items
    from nanomm.demo.scenes import COLOURS as PALETTE

    class Answer(BaseModel):
        colour: Literal[tuple(PALETTE)]

    item = held_out_items("colour", 1, seed=1)[0]
    picture = io.BytesIO()
    item.images[0].save(picture, "PNG")
    url = "data:image/png;base64," + base64.b64encode(picture.getvalue()).decode()
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": item.turns[0].question}]}]
    with LLM(str(nanomm.demo_checkpoint())) as demo, BackgroundServer(Server(demo, ServerConfig("demo"))) as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        reply = client.chat.completions.parse(model="demo", messages=messages, response_format=Answer,
                                              max_tokens=24, temperature=0)
    choice = reply.choices[0]
    assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Answer)
    assert json.loads(choice.message.content) == {"colour": choice.message.parsed.colour}
    assert choice.message.parsed.colour in PALETTE


def test_a_named_tool_round_trip_through_the_openai_client(ckpt):
    """The engine itself behind the server (random weights): a named tool_choice gives one call whose arguments
    fit the schema, the same streamed as whole, and the tool's result sent back is answered."""
    import openai

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
        "additionalProperties": False}}}]
    ask = {"model": "tiny", "tools": tools, "max_tokens": 150, "temperature": 1.0, "seed": 3, "parallel_tool_calls": False,
           "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    messages = user("What is the weather in Oslo?")
    llm = make_llm(ckpt, max_model_len=1024)  # the tools' system turn is long
    with BackgroundServer(Server(llm, ServerConfig("tiny"))) as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        first = client.chat.completions.create(messages=messages, **ask)
        whole = first.choices[0]
        streamed = {}
        for chunk in client.chat.completions.create(messages=messages, stream=True, **ask):
            for call in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
                piece = streamed.setdefault(call.index, {"name": "", "arguments": ""})
                piece["name"] += call.function.name or ""
                piece["arguments"] += call.function.arguments or ""
        (call,) = whole.message.tool_calls
        assert whole.finish_reason == "tool_calls" and call.function.name == "get_weather"
        assert json.loads(call.function.arguments) in ({"city": "Paris"}, {"city": "Oslo"})
        assert streamed == {0: {"name": "get_weather", "arguments": call.function.arguments}}
        answer = client.chat.completions.create(
            model="tiny", tools=tools, tool_choice="none", max_tokens=4, temperature=0, messages=[
                *messages, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                {"role": "tool", "tool_call_id": call.id, "content": '{"celsius": 3}'}])
        # the call and its result are in the prompt now: the first prompt, then at least the call's own tokens
        assert answer.usage.prompt_tokens > first.usage.prompt_tokens + first.usage.completion_tokens
        assert answer.usage.completion_tokens == 4 and answer.choices[0].message.content is not None
    assert_no_leaks(llm)
    llm.close()
