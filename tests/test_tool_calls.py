"""OpenAI tool calls: the prompt against the real Jinja templates (Qwen3-VL's own, Qwen2.5's text template for the
Qwen2-VL and Qwen2.5-VL families), the parser against hand-written answers, the stream adding up to the whole answer,
the forcing grammar through llguidance, and the round trip through the openai client.

The end-to-end tests run the real HTTP server, request parsing and rendering, response and stream formatting and the
openai client, but NOT the engine: a random-weight model does not call tools, so `ScriptedServer` answers every
request with fixed text (token by token, as the engine's outputs arrive), at the server's `_submit` seam."""

import asyncio
import json
from pathlib import Path

import llguidance
import openai
import pytest
import transformers

from nanomm.errors import InvalidInputError
from nanomm.inputs.tokenizer import IncrementalDetokenizer, Tokenizer
from nanomm.outputs import CompletionOutput, RequestMetrics, RequestOutput
from nanomm.serve import protocol
from nanomm.serve.app import Server, ServerConfig
from nanomm.serve.testing import BackgroundServer
from nanomm.serve.tool_calls import ToolCallStream, parse_tool_calls, tool_call_grammar, tool_options

DATA = Path(__file__).parent / "data"
# Qwen2.5's text chat template with its tools section, in the variant whose default system prompt is the VL families'
# ("You are a helpful assistant."; the Instruct models' says "You are Qwen, created by Alibaba Cloud. ..."). Copied
# from a public llama.cpp dump of a Qwen2.5-3B GGUF's template (the hub cannot be reached); not hash-verified.
QWEN2_5_TEMPLATE = (DATA / "qwen2_5_tools.jinja").read_text()
QWEN3_VL_TEMPLATE = json.loads((DATA / "Qwen3-VL-2B-Instruct" / "chat_template.json").read_text())["chat_template"]

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Météo d'une ville",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
TOOLS = [WEATHER, TIME]

PARIS = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
LYON = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lyon", "days": 2}}\n</tool_call>'


def conversation(arguments_as_text: bool) -> list[dict]:
    """A two-step tool round trip; OpenAI's clients send arguments as JSON text, the templates want objects."""
    def args(value):
        return json.dumps(value) if arguments_as_text else value
    return [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather in Paris and Lyon?"},
            {"role": "assistant", "content": None if arguments_as_text else "", "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": args(
                    {"city": "Paris"})}},
                {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": args(
                    {"city": "Lyon", "days": 2})}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
            {"role": "tool", "tool_call_id": "call_2", "content": "19 C"},
            {"role": "assistant", "content": "Warm in both."},
            {"role": "user", "content": "Thanks"}]


# -- the prompt --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("template, default_system", [(QWEN2_5_TEMPLATE, "You are a helpful assistant."),
                                                     (QWEN3_VL_TEMPLATE, None)], ids=["qwen2.5", "qwen3-vl"])
@pytest.mark.parametrize("with_system", [True, False])
@pytest.mark.parametrize("with_tools", [True, False])
def test_the_prompt_is_the_templates(ckpt, template, default_system, with_system, with_tools):
    hf = transformers.AutoTokenizer.from_pretrained(ckpt)
    ours = Tokenizer.from_pretrained(ckpt)
    ours.default_system_prompt = default_system  # the family's: Qwen2-VL's and Qwen2.5-VL's, or Qwen3-VL's none
    start = 0 if with_system else 1
    tools = TOOLS if with_tools else None
    expected = hf.apply_chat_template(conversation(False)[start:], tools=tools, chat_template=template,
                                      tokenize=False, add_generation_prompt=True)
    text, media = ours.apply_chat_template(conversation(True)[start:], tools=tools)
    assert text == expected and media == []
    assert ("# Tools" in text) == with_tools and text.count("<tool_response>") == 2


def test_bad_tools_and_tool_calls_are_400s(ckpt):
    tokenizer = Tokenizer.from_pretrained(ckpt)
    user = [{"role": "user", "content": "hi"}]
    for tools in ([], [{"type": "function"}], [{"type": "function", "function": {"name": ""}}],
                  [{"type": "function", "function": {"name": "f", "parameters": []}}]):
        with pytest.raises(InvalidInputError, match="tools"):
            tokenizer.apply_chat_template(user, tools=tools)
    bad_call = [*user, {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]
    with pytest.raises(InvalidInputError, match="arguments"):
        tokenizer.apply_chat_template(bad_call)
    for body in ({"tool_choice": "auto"}, {"tools": TOOLS, "tool_choice": "sometimes"},
                 {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
                 {"tools": TOOLS, "parallel_tool_calls": "yes"}):
        with pytest.raises(InvalidInputError):
            tool_options(body)


# -- the parser ------------------------------------------------------------------------------------------------

def calls_of(calls: list[dict]) -> list[tuple]:
    for call in calls:
        assert call["type"] == "function" and call["id"].startswith("call_")
    return [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


def test_the_parser_reads_one_call_several_and_text_around_them():
    assert parse_tool_calls("The capital is Paris.") == ("The capital is Paris.", [])
    content, calls = parse_tool_calls(PARIS)
    assert content is None and calls_of(calls) == [("get_weather", '{"city": "Paris"}')]
    content, calls = parse_tool_calls("Checking both.\n" + PARIS + "\n" + LYON)
    assert content == "Checking both.\n\n"
    assert calls_of(calls) == [("get_weather", '{"city": "Paris"}'), ("get_weather", '{"city": "Lyon", "days": 2}')]
    assert len({c["id"] for c in calls}) == 2
    # keys in the other order: the arguments are printed back as JSON
    content, calls = parse_tool_calls('<tool_call>{"arguments": {"a": [1, 2]}, "name": "f"}</tool_call>')
    assert content is None and calls_of(calls) == [("f", '{"a": [1, 2]}')]
    content, calls = parse_tool_calls('<tool_call>{"name": "f", "arguments": {"a":1}, "id": 3}</tool_call>')
    assert content is None and calls_of(calls) == [("f", '{"a": 1}')]
    # the model's own spacing is kept
    assert calls_of(parse_tool_calls('<tool_call>{"name": "f", "arguments": {"a":1} }</tool_call>')[1]) == [
        ("f", '{"a":1}')]


def test_a_malformed_or_unfinished_block_stays_in_the_content():
    broken = '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>'
    content, calls = parse_tool_calls(broken + "\n" + PARIS)
    assert content == broken + "\n" and calls_of(calls) == [("get_weather", '{"city": "Paris"}')]
    assert parse_tool_calls('<tool_call>\n{"nom": "f"}\n</tool_call>') == ('<tool_call>\n{"nom": "f"}\n</tool_call>',
                                                                             [])
    assert parse_tool_calls(PARIS[:30]) == (PARIS[:30], [])


# -- the stream ------------------------------------------------------------------------------------------------

def assemble(deltas: list[dict]) -> tuple[str | None, list[dict]]:
    """Deltas put together the way the openai client does: content concatenated, calls merged by index."""
    content, calls = None, {}
    for delta in deltas:
        if delta.get("content"):
            content = (content or "") + delta["content"]
        for piece in delta.get("tool_calls") or []:
            call = calls.setdefault(piece["index"], {"function": {"name": "", "arguments": ""}})
            call.update({k: piece[k] for k in ("id", "type") if piece.get(k)})
            for key in ("name", "arguments"):
                call["function"][key] += (piece.get("function") or {}).get(key) or ""
    return content, [calls[k] for k in sorted(calls)]


TEXTS = ["No tools needed.", PARIS, "Checking.\n" + PARIS + "\n" + LYON + "\nDone.", "a < b <tool", "<tool_call>\n{",
         '<tool_call>{"name": "f", "arguments": {"x": "</tool"}}</tool_call>', "\n\n" + PARIS + "\n",
         'x <tool_call>\n{bad}\n</tool_call> y ' + LYON]


@pytest.mark.parametrize("text", TEXTS)
def test_a_stream_fed_token_by_token_adds_up_to_the_whole_answer(ckpt, text):
    tokenizer = Tokenizer.from_pretrained(ckpt)
    detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
    stream, deltas = ToolCallStream(), []
    ids = tokenizer.encode(text)
    for k, token in enumerate(ids):
        deltas += stream.feed(detokenizer.step(token), final=k == len(ids) - 1)
    content, calls = parse_tool_calls(text)
    streamed_content, streamed_calls = assemble(deltas)
    assert streamed_content == content
    assert calls_of(streamed_calls) == calls_of(calls)


def test_text_that_may_open_a_call_is_held_back():
    stream = ToolCallStream()
    assert stream.feed("Sure <tool") == [{"content": "Sure "}]
    assert stream.feed("_call>\n{") == []
    assert stream.feed("", final=True) == [{"content": "<tool_call>\n{"}]


# -- the grammar -----------------------------------------------------------------------------------------------

class ByteTokens:
    """A tokenizer whose tokens are the 256 bytes (and an EOS): the grammar is checked on text, not on a vocabulary."""
    eos_token_id, bos_token_id = 256, None
    tokens = [bytes([b]) for b in range(256)] + [b"<eos>"]

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


def accepts(grammar: str, text: str) -> bool:
    tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(ByteTokens()))
    matcher = llguidance.LLMatcher(tokenizer, llguidance.LLMatcher.grammar_from_lark(grammar))
    assert not matcher.is_error(), matcher.get_error()
    return matcher.consume_tokens(list(text.encode())) and matcher.is_accepting()


def test_the_required_grammar_forces_calls_valid_for_their_schemas():
    grammar = tool_call_grammar(TOOLS, "required", parallel=True)
    assert accepts(grammar, PARIS) and accepts(grammar, PARIS + "\n" + LYON)
    assert accepts(grammar, '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    for refused in ("Hello", "", PARIS + "\nHello", PARIS.replace('"Paris"', "3"),
                    PARIS.replace("get_weather", "get_wether"), PARIS.replace('"Paris"}', '"Paris", "zip": 1}'),
                    '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>'):
        assert not accepts(grammar, refused), refused


def test_a_named_choice_without_parallel_calls_allows_one_call_of_that_function():
    grammar = tool_call_grammar(TOOLS, {"type": "function", "function": {"name": "get_weather"}}, parallel=False)
    assert accepts(grammar, PARIS) and accepts(grammar, LYON)
    assert not accepts(grammar, PARIS + "\n" + LYON)
    assert not accepts(grammar, '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')


def test_a_forced_choice_needs_constrained_decoding(ckpt):
    tokenizer = Tokenizer.from_pretrained(ckpt)
    from nanomm import sampling

    body = {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, "tool_choice": "required"}
    if hasattr(sampling, "StructuredOutputsParams"):
        request = protocol.parse_chat(body, tokenizer, sampling.SamplingParams(), None)
        assert request.params.structured_outputs.grammar == tool_call_grammar(TOOLS, "required")
    else:
        with pytest.raises(InvalidInputError, match="constrained decoding"):
            protocol.parse_chat(body, tokenizer, sampling.SamplingParams(), None)


# -- through the server and the openai client --------------------------------------------------------------------

class ScriptedServer(Server):
    """The real server, answering every request with `answer` instead of running the engine; the prompts it was
    given are kept in `prompts`."""

    def __init__(self, llm, answer: str):
        super().__init__(llm, ServerConfig("tiny"))
        self.answer, self.prompts = answer, []

    def _submit(self, parsed, add=None) -> asyncio.Queue:
        self.prompts.append(parsed.prompt["prompt"])
        outputs: asyncio.Queue = asyncio.Queue()
        tokenizer = self.llm.tokenizer
        detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
        ids = tokenizer.encode(self.answer)
        text = ""
        for k, token in enumerate(ids):
            delta = detokenizer.step(token)
            text += delta
            done = k == len(ids) - 1
            completion = CompletionOutput(0, ids[:k + 1], text, "stop" if done else None, [token], delta)
            outputs.put_nowait(RequestOutput(parsed.id, None, [1, 2, 3], [completion], done, RequestMetrics(0.0)))
        return outputs


@pytest.fixture
def scripted(ckpt):
    from nanomm import LLM

    llm = LLM(str(ckpt), device="cpu", dtype="float32")

    def serve(answer):
        server = ScriptedServer(llm, answer)
        return server, BackgroundServer(server)
    return serve


def test_a_tool_round_trip_through_the_openai_client(scripted):
    server, background = scripted("Let me look.\n" + PARIS + "\n" + LYON)
    with background as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        asked = [{"role": "user", "content": "Weather in Paris and Lyon?"}]
        reply = client.chat.completions.create(model="tiny", messages=asked, tools=TOOLS)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me look.\n\n"
        called = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
        assert called == [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Lyon", "days": 2})]
        assert "# Tools" in server.prompts[0] and json.dumps(WEATHER, ensure_ascii=False) in server.prompts[0]

        with client.chat.completions.stream(model="tiny", messages=asked, tools=TOOLS) as stream:
            streamed = stream.get_final_completion().choices[0]
        assert streamed.finish_reason == "tool_calls" and streamed.message.content == choice.message.content
        assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == [
            (c.function.name, c.function.arguments) for c in choice.message.tool_calls]

        answered = asked + [choice.message.model_dump(exclude_none=True)] + [
            {"role": "tool", "tool_call_id": c.id, "content": "20 C"} for c in choice.message.tool_calls]
        client.chat.completions.create(model="tiny", messages=answered, tools=TOOLS)
        assert server.prompts[-1].endswith(
            "<|im_start|>assistant\nLet me look.\n\n\n" + PARIS + "\n" + LYON + "<|im_end|>\n<|im_start|>user\n"
            "<tool_response>\n20 C\n</tool_response>\n<tool_response>\n20 C\n</tool_response><|im_end|>\n"
            "<|im_start|>assistant\n")


def test_tool_choice_none_leaves_the_calls_in_the_text(scripted):
    server, background = scripted(PARIS)
    with background as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                               tools=TOOLS, tool_choice="none")
        assert reply.choices[0].message.content == PARIS and not reply.choices[0].message.tool_calls
        assert reply.choices[0].finish_reason == "stop" and "# Tools" in server.prompts[0]
        plain = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
        assert plain.choices[0].message.content == PARIS and "# Tools" not in server.prompts[1]


def test_llm_chat_takes_tools_as_vllm_does(ckpt):
    from nanomm import LLM, SamplingParams

    with LLM(str(ckpt), device="cpu", dtype="float32") as llm:
        messages = [{"role": "user", "content": "Weather?"}]
        out = llm.chat(messages, SamplingParams(max_tokens=1), use_tqdm=False, tools=TOOLS)[0]
        assert out.prompt == llm.tokenizer.apply_chat_template(messages, tools=TOOLS)[0]
        assert "# Tools" in out.prompt and out.prompt.count("<|im_start|>system\n") == 1
