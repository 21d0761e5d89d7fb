"""OpenAI tool calls over Qwen's `<tool_call>` blocks: the request's options, the model's text parsed into `tool_calls`
(whole, and as stream deltas), and a grammar that forces a call (the prompt's side is nanomm/inputs/tool_prompt.py).

A Qwen model calls a function by writing

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

one block per call. `parse_tool_calls` turns each well-formed block into OpenAI's
{"id": "call_...", "type": "function", "function": {"name", "arguments": <JSON string>}}; the text outside the blocks
is the message's content (None when it is only whitespace). A block whose JSON does not parse, or lacks a string
"name", is left in the content as written (vLLM leaves the whole text as content then; here only that block).

Streaming (`ToolCallStream`): text outside blocks goes out as content deltas, holding back a tail that may be the
start of `<tool_call>`; a call goes out whole when its closing tag arrives (index, id, type, name and arguments in
one delta, which the openai client assembles as it does pieces), so that the stream adds up to exactly the
non-streamed answer, a malformed or cut-off block included. `stream_delta` merges one step's deltas into a chunk's.

tool_choice: "none" renders the tools but parses nothing (vLLM's default); "auto" parses; "required" or a named
function needs constrained decoding: `tool_call_grammar` writes a Lark grammar (llguidance's dialect, `%json` rules
for the arguments) that the sampler enforces through `nanomm.sampling.StructuredOutputsParams` where nanomm has it;
without it such a request is a 400 (`constrain`).
"""

import json
import re
import uuid
from dataclasses import dataclass, field

from nanomm.errors import InvalidInputError
from nanomm.inputs.tool_prompt import check_tools

OPEN, CLOSE = "<tool_call>", "</tool_call>"
BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)
# `{"name": "...", "arguments": ` at a block's start: the arguments' own text follows it
HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"(?:[^"\\]|\\.)*"\s*,\s*"arguments"\s*:\s*')


@dataclass(frozen=True)
class ToolOptions:
    """What a chat request asked of tools: `parse` the output into tool_calls, and the grammar that forces a call
    (None: the model is free)."""
    tools: list[dict] | None = None
    parse: bool = False
    grammar: str | None = None


def tool_options(body: dict) -> ToolOptions:
    """The request's tools, tool_choice and parallel_tool_calls, checked (a 400 naming what is wrong)."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise InvalidInputError(f"'parallel_tool_calls' must be a bool, got {parallel!r}")
    if tools is None:
        if choice not in (None, "none"):
            raise InvalidInputError("'tool_choice' needs 'tools'")
        return ToolOptions()
    tools = check_tools(tools)
    choice = "auto" if choice is None else choice
    if choice in ("none", "auto"):
        return ToolOptions(tools, parse=choice == "auto")
    return ToolOptions(tools, parse=True, grammar=tool_call_grammar(tools, choice, parallel))


def _forced_functions(tools: list[dict], tool_choice) -> list[dict]:
    """The functions a "required" or named tool_choice lets the model call."""
    functions = [tool["function"] for tool in tools]
    if tool_choice == "required":
        return functions
    name = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, dict) else None
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function" or not isinstance(name, str):
        raise InvalidInputError("'tool_choice' must be \"none\", \"auto\", \"required\" or "
                                "{\"type\": \"function\", \"function\": {\"name\": ...}}")
    named = [f for f in functions if f["name"] == name]
    if not named:
        raise InvalidInputError(f"'tool_choice' names {name!r}, which is not one of the tools")
    return named


def tool_call_grammar(tools: list[dict], tool_choice, parallel: bool = True) -> str:
    """A Lark grammar (llguidance's dialect) whose sentences are one `<tool_call>` block (several, a newline apart,
    when `parallel`) calling one of the functions tool_choice allows, its arguments valid for the function's
    parameters schema."""
    from nanomm.engine.structured import compact_json_schema  # as response_format's JSON: compact

    functions = _forced_functions(tools, tool_choice)
    rules = ["start: call" + (' ("\\n" call)*' if parallel else ""),
             "call: " + " | ".join(f"call_{k}" for k in range(len(functions)))]
    for k, function in enumerate(functions):
        head = json.dumps('<tool_call>\n{"name": ' + json.dumps(function["name"]) + ', "arguments": ')
        schema = function.get("parameters") or {"type": "object"}
        rules.append(f'call_{k}: {head} args_{k} "}}\\n</tool_call>"')
        rules.append(f"args_{k}: %json {compact_json_schema(json.dumps(schema))}")  # no free whitespace
    return "\n".join(rules) + "\n"


def constrain(params, grammar: str | None):
    """params with the grammar as its structured output; a 400 where this nanomm has no constrained decoding.
    The seam for it: nanomm.sampling.StructuredOutputsParams(grammar=...) on SamplingParams.structured_outputs."""
    if grammar is None:
        return params
    try:
        from nanomm.sampling import StructuredOutputsParams
    except ImportError:
        raise InvalidInputError("a 'required' or named 'tool_choice' needs constrained decoding, which this server "
                                "does not have; use \"auto\"") from None
    from dataclasses import replace

    return replace(params, structured_outputs=StructuredOutputsParams(grammar=grammar))


# -- the model's output ---------------------------------------------------------------------------------------

def _call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def parse_block(body: str) -> tuple[str, str] | None:
    """A block's text between the tags -> (name, arguments as a JSON string), or None if it is not a call.
    The arguments keep the model's own text where the block starts with "name" then "arguments"."""
    try:
        call = json.loads(body)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or "arguments" not in call:
        return None
    return call["name"], _arguments_text(body, call["arguments"])


def _arguments_text(body: str, arguments) -> str:
    """The arguments as the model wrote them (the text between `"arguments": ` and the block's last `}`), or
    printed back as JSON where that text is not them (keys in another order, a key after "arguments")."""
    head = HEADER.match(body)
    written = body[head.end():].rstrip()[:-1].rstrip() if head else ""
    try:
        if head and json.loads(written) == arguments:
            return written
    except ValueError:
        pass
    return json.dumps(arguments, ensure_ascii=False)


def _openai_call(name: str, arguments: str, call_id: str) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def parse_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """The model's whole output -> (content, tool_calls)."""
    content, calls, start = [], [], 0
    for block in BLOCK.finditer(text):
        parsed = parse_block(block.group(1))
        content.append(text[start:block.start()] if parsed else text[start:block.end()])
        start = block.end()
        if parsed:
            calls.append(_openai_call(*parsed, _call_id()))
    content.append(text[start:])
    joined = "".join(content)
    return (joined if joined.strip() else None), calls


@dataclass
class ToolCallStream:
    """One completion's text deltas -> OpenAI chat deltas ({"content": ...} or {"tool_calls": [...]})."""
    pending: str = ""  # text not yet sent: a possible `<tool_call>` start, a block still open, or blank text
    content_started: bool = False  # blank text is held until some content is not blank (see parse_tool_calls)
    blank: str = ""  # the blank text held so far
    num_calls: int = 0
    _out: list = field(default_factory=list)  # this feed's deltas

    def feed(self, text: str, final: bool = False) -> list[dict]:
        """The deltas that `text` (new model output) lets go out; `final`: the output ended, send what is left."""
        self.pending += text
        self._out = []
        while self._step():
            pass
        if final and self.pending:
            self._content(self.pending)
            self.pending = ""
        return self._out

    def _step(self) -> bool:
        """Send what the pending text settles; True if it should be looked at again."""
        start = self.pending.find(OPEN)
        if start < 0:
            keep = _partial_tag_length(self.pending)
            self._content(self.pending[:len(self.pending) - keep])
            self.pending = self.pending[len(self.pending) - keep:]
            return False
        end = self.pending.find(CLOSE, start)
        if end < 0:  # a block still open: send the text before it, hold the block
            self._content(self.pending[:start])
            self.pending = self.pending[start:]
            return False
        block_end = end + len(CLOSE)
        parsed = parse_block(self.pending[start + len(OPEN):end])
        if parsed is None:
            self._content(self.pending[:block_end])
        else:
            self._content(self.pending[:start])
            self._call(*parsed)
        self.pending = self.pending[block_end:]
        return True

    def _content(self, text: str) -> None:
        if not text:
            return
        if not self.content_started and not text.strip():
            self.blank += text
            return
        self.content_started = True
        self._out.append({"content": self.blank + text})
        self.blank = ""

    def _call(self, name: str, arguments: str) -> None:
        index, self.num_calls = self.num_calls, self.num_calls + 1
        self._out.append({"tool_calls": [{"index": index, **_openai_call(name, arguments, _call_id())}]})


def stream_delta(deltas: list[dict]) -> dict:
    """One step's deltas as one chunk's delta: the content pieces joined, the calls listed."""
    merged = {}
    content = "".join(d["content"] for d in deltas if "content" in d)
    if content:
        merged["content"] = content
    calls = [call for d in deltas for call in d.get("tool_calls", [])]
    if calls:
        merged["tool_calls"] = calls
    return merged


def _partial_tag_length(text: str) -> int:
    """How many of text's last characters could begin `<tool_call>`."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0
