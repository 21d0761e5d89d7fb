"""OpenAI function tools in a Qwen prompt: the `# Tools` system turn, an assistant turn's `<tool_call>` blocks and the
`<tool_response>` user turn that `role: "tool"` messages become (the model's side is nanomm/serve/tool_calls.py).

Which template this follows: Qwen3-VL's own chat template has a tools section, and this module writes exactly what it
writes. Qwen2-VL's and Qwen2.5-VL's templates have none (they ignore `tools`, and print a tool message as a
`<|im_start|>tool` turn); for them this module writes what Qwen2.5's text models' template writes, the same blocks
with the family's default system prompt ("You are a helpful assistant.") ahead of `# Tools` when the chat has no
system turn. tests/test_tool_calls.py checks both against the Jinja templates, rendered by transformers.

As vLLM does, a tool call's `arguments` (a JSON string in OpenAI's schema) is parsed and printed back as JSON
(`json.dumps(..., ensure_ascii=False)`, what the templates' `tojson` prints), and each tool is printed as the client
sent it.
"""

import json

from nanomm.errors import InvalidInputError

TOOLS_HEADER = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                "You are provided with function signatures within <tools></tools> XML tags:\n<tools>")
TOOLS_FOOTER = ("\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
                "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
                "<args-json-object>}\n</tool_call>")


def check_tools(tools) -> list[dict]:
    """OpenAI's `tools`: a list of {"type": "function", "function": {"name": str, "parameters": object, ...}}."""
    if not isinstance(tools, list) or not tools:
        raise InvalidInputError("'tools' must be a non-empty list of {\"type\": \"function\", \"function\": {...}}")
    for k, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise InvalidInputError(f"tools[{k}] must be {{\"type\": \"function\", \"function\": {{...}}}}")
        function = tool["function"]
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise InvalidInputError(f"tools[{k}].function needs a non-empty string 'name'")
        if not isinstance(function.get("parameters", {}), dict):
            raise InvalidInputError(f"tools[{k}].function.parameters must be a JSON schema object")
    return tools


def tools_system_turn(system_text: str | None, tools: list[dict]) -> str:
    """The first turn of a chat with tools: the system prompt (if any), then the tools' signatures, one JSON line
    each, and how to call them."""
    lead = "" if system_text is None else system_text + "\n\n"
    signatures = "".join("\n" + json.dumps(tool, ensure_ascii=False) for tool in tools)
    return f"<|im_start|>system\n{lead}{TOOLS_HEADER}{signatures}{TOOLS_FOOTER}<|im_end|>\n"


def tool_call_blocks(content: str, tool_calls, i: int) -> str:
    """An assistant turn's body: its text, then one `<tool_call>` block per call, a newline between them."""
    if not isinstance(tool_calls, list):
        raise InvalidInputError(f"message {i}: 'tool_calls' must be a list")
    blocks = [_tool_call_block(call, i, k) for k, call in enumerate(tool_calls)]
    return "\n".join(([content] if content else []) + blocks)


def _tool_call_block(call, i: int, k: int) -> str:
    where = f"message {i} tool_calls[{k}]"
    function = call.get("function", call) if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise InvalidInputError(f"{where} must be {{\"function\": {{\"name\": str, \"arguments\": str}}}}")
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            raise InvalidInputError(f"{where}: 'arguments' is not valid JSON") from None
    return ('<tool_call>\n{"name": "' + function["name"] + '", "arguments": '
            + json.dumps(arguments, ensure_ascii=False) + "}\n</tool_call>")


def tool_response(content: str, first: bool, last: bool) -> str:
    """A `role: "tool"` message: a `<tool_response>` block; a run of them shares one user turn."""
    return (("<|im_start|>user" if first else "") + "\n<tool_response>\n" + content + "\n</tool_response>"
            + ("<|im_end|>\n" if last else ""))
