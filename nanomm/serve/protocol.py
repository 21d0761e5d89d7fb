"""OpenAI's JSON <-> nanomm's prompts, SamplingParams and RequestOutputs (the server's only translation layer).

Requests: `/v1/chat/completions` messages whose content is a string or a list of `text` and `image_url` parts,
and `/v1/completions` prompts (a string). The sampling fields are OpenAI's, plus vLLM's extras (top_k, min_p,
repetition_penalty, min_tokens, ignore_eos, ...); a field the request leaves out takes the model's generation
defaults (generation_config.json), as vLLM does. An unknown field is a 400 naming it, never silently dropped.

A decode instance continuing a prefill instance's handoff (kv_transfer_params) reads the sampling fields only
(`parse_continuation`): the prompt was run on the prefill instance, so the body may leave out the messages or
prompt, and those it still carries are not read (nor are their pictures).

Tools: `tools`, `tool_choice` and `parallel_tool_calls` are read by tool_calls.py; the tools go into the prompt
(nanomm/inputs/tool_prompt.py) and the answer's `<tool_call>` blocks come back as `tool_calls`.

A content part may carry a `uuid` (vLLM's): with a uuid the processor cache holds, its data may be left out (null);
an unknown one is a 400 (nanomm/inputs/processor_cache.py).

Images arrive as data URLs, as http(s) URLs whose host is listed with `--allowed-media-domains` (checked here,
fetched by app.py off the event loop: nanomm/inputs/media_fetch.py), or as local files (a path or a file:// URL)
read only under the folder given with `--allowed-local-media-path`.

Responses and stream chunks follow OpenAI's schema; the usage block also counts the visual tokens and the
encoder-cache hits.
"""

import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import unquote, urlparse

from nanomm.errors import InvalidInputError
from nanomm.inputs.tokenizer import map_media_sources, media_prompt
from nanomm.outputs import CompletionOutput, RequestOutput
from nanomm.sampling import SamplingParams

if TYPE_CHECKING:
    from nanomm.inputs.media_fetch import MediaUrlPolicy
    from nanomm.serve.tool_calls import ToolCallStream, ToolOptions

TOOL_FIELDS = ("tools", "tool_choice", "parallel_tool_calls")

# OpenAI's names -> SamplingParams fields; vLLM's extras keep their own names.
OPENAI_FIELDS = {"max_tokens": "max_tokens", "max_completion_tokens": "max_tokens", "temperature": "temperature",
                 "top_p": "top_p", "n": "n", "stop": "stop", "seed": "seed", "presence_penalty": "presence_penalty",
                 "frequency_penalty": "frequency_penalty"}
VLLM_EXTRAS = ("top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids",
               "skip_special_tokens", "include_stop_str_in_output")
IGNORED_FIELDS = ("model", "user", "stream_options", "kv_transfer_params")  # read elsewhere or meaningless here
COMMON_FIELDS = {*OPENAI_FIELDS, *VLLM_EXTRAS, *IGNORED_FIELDS, "stream", "logprobs", "mm_processor_kwargs",
                 "response_format", "structured_outputs"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls"}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "echo"}


class ChatRequest:
    """A parsed /v1/chat/completions or /v1/completions body: what the engine runs, and how to answer."""

    def __init__(self, prompt, params: SamplingParams, stream: bool, num_top_logprobs: int | None, chat: bool):
        self.prompt, self.params, self.stream = prompt, params, stream
        self.num_top_logprobs = num_top_logprobs  # None: the client asked for no logprobs
        self.chat = chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.parse_tools = False  # the answer's <tool_call> blocks become tool_calls (tool_calls.py)
        self.tool_streams: "dict[int, ToolCallStream]" = {}  # a streamed answer's parsers, by completion index

    def use_tools(self, options: "ToolOptions | None") -> "ChatRequest":
        """Parse the answer's tool calls if asked; force one through the grammar if tool_choice says so."""
        if options is not None:
            from nanomm.serve.tool_calls import constrain

            self.parse_tools = options.parse
            self.params = constrain(self.params, options.grammar)
        return self


def _tool_options(body: dict) -> "ToolOptions | None":
    """The request's tool fields, checked (tool_calls.py, loaded by the first request with one); None: none."""
    if not any(body.get(name) is not None for name in TOOL_FIELDS):
        return None
    from nanomm.serve.tool_calls import tool_options

    return tool_options(body)


def parse_chat(body, tokenizer, defaults: SamplingParams, media_root: Path | None,
               media_urls: "MediaUrlPolicy | None" = None) -> ChatRequest:
    body = _check_object(body, CHAT_FIELDS)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidInputError("'messages' must be a non-empty list of {role, content} objects")
    tools = _tool_options(body)
    text, media = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                tools=None if tools is None else tools.tools)
    # every picture and video: a data URL, an allowed URL or a path (a part sent as a uuid alone has none)
    media = map_media_sources(media, lambda source, what: _image_source(source, media_root, what, media_urls))
    prompt = media_prompt(text, media)
    return _finish(body, prompt, defaults, _chat_num_top(body), chat=True).use_tools(tools)


def parse_completion(body, defaults: SamplingParams) -> ChatRequest:
    body = _check_object(body, COMPLETION_FIELDS)
    prompt = body.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise InvalidInputError("'prompt' must be a non-empty string (one prompt per request)")
    return _finish(body, {"prompt": prompt}, defaults, _completion_num_top(body), chat=False)


def parse_continuation(body, defaults: SamplingParams, chat: bool) -> ChatRequest:
    """A decode instance's part of a /v1/chat/completions (chat) or /v1/completions body whose kv_transfer_params
    is a handoff: the sampling fields, checked as parse_chat and parse_completion check them. The messages or
    prompt may be absent; present, they are not read. The prompt's text is None: it ran on the prefill instance."""
    body = _check_object(body, CHAT_FIELDS if chat else COMPLETION_FIELDS)
    num_top = _chat_num_top(body) if chat else _completion_num_top(body)
    request = _finish(body, {"prompt": None}, defaults, num_top, chat)
    return request.use_tools(_tool_options(body)) if chat else request


def _chat_num_top(body: dict) -> int | None:
    """Chat's logprobs: a bool, with the top-n count in top_logprobs (0 when left out). None: no logprobs."""
    if _field(body, "logprobs", bool, False):
        return _field(body, "top_logprobs", int, 0)
    if "top_logprobs" in body:
        raise InvalidInputError("'top_logprobs' needs 'logprobs': true")
    return None


def _completion_num_top(body: dict) -> int | None:
    """/v1/completions' logprobs: the top-n count itself. None: no logprobs. `echo` is refused."""
    if body.get("echo"):
        raise InvalidInputError("'echo' is not supported")
    num_top = body.get("logprobs")
    if num_top is not None and (isinstance(num_top, bool) or not isinstance(num_top, int)):
        raise InvalidInputError(f"'logprobs' must be an integer (top-n) for /v1/completions, got {num_top!r}")
    return num_top


def _finish(body: dict, prompt: dict, defaults: SamplingParams, num_top: int | None, chat: bool) -> ChatRequest:
    if "mm_processor_kwargs" in body:
        prompt["mm_processor_kwargs"] = body["mm_processor_kwargs"]
    fields = {ours: body[theirs] for theirs, ours in OPENAI_FIELDS.items() if body.get(theirs) is not None}
    fields.update({name: body[name] for name in VLLM_EXTRAS if body.get(name) is not None})
    if num_top is not None:
        fields["logprobs"] = num_top
    if body.get("response_format") is not None or body.get("structured_outputs") is not None:
        from nanomm.serve.structured_outputs import structured_outputs  # parsed where a body asks for a shape

        fields["structured_outputs"] = structured_outputs(body)
    # A field the client leaves out takes the model's default; max_tokens left out: until EOS or the context ends.
    params = replace(defaults, **{"max_tokens": None, **fields})
    return ChatRequest(prompt, params, _field(body, "stream", bool, False), num_top, chat)


def _check_object(body, allowed: set) -> dict:
    if not isinstance(body, dict):
        raise InvalidInputError("the request body must be a JSON object")
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise InvalidInputError(f"unsupported field(s) {unknown}")
    return body


def _field(body: dict, name: str, kind: type, default):
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise InvalidInputError(f"'{name}' must be a {kind.__name__}, got {value!r}")
    return value


def _image_source(url, media_root: Path | None, what: str = "an image",
                  media_urls: "MediaUrlPolicy | None" = None) -> str:
    """An image or video source as load_image and load_video take it: a data URL as is, an http(s) URL if its host
    is allowed (app.py fetches it), a local path only under media_root. Every picture and video of the
    conversation comes through here (*_url parts and nanomm's own image and video parts alike)."""
    if not isinstance(url, str):
        raise InvalidInputError(f"{what} must be a data URL string, got {type(url).__name__}")
    if url.startswith("data:"):
        return url
    parsed = urlparse(url)
    if parsed.scheme in ("http", "https"):
        from nanomm.inputs.media_fetch import check_media_url  # loaded by the first URL

        check_media_url(url, media_urls, what)  # a host off the list: a 400 naming it and the flag
        return url
    path = unquote(parsed.path) if parsed.scheme == "file" else url
    if media_root is None:
        raise InvalidInputError("local image paths are refused: start the server with --allowed-local-media-path "
                                "DIR, or send the image as a data URL")
    resolved = Path(path).resolve()
    if not resolved.is_relative_to(media_root.resolve()):
        raise InvalidInputError(f"{path!r} is outside the allowed local media folder")
    return str(resolved)


# -- responses -------------------------------------------------------------------------------------------------

FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "abort"}


def usage(out: RequestOutput) -> dict:
    """OpenAI's usage block (prompt_tokens_details.cached_tokens: the prefix cache's hits), plus nanomm's extras:
    visual_tokens (the prompt's, counted in prompt_tokens) and encoder_cache_hits (its images that the encoder
    cache held, so the vision tower did not run on them)."""
    completion = sum(len(c.token_ids) for c in out.outputs)
    prompt = len(out.prompt_token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "visual_tokens": out.metrics.num_visual_tokens, "encoder_cache_hits": out.metrics.encoder_cache_hits,
            "prompt_tokens_details": {"cached_tokens": out.metrics.num_cached_tokens}}


def response(request: ChatRequest, out: RequestOutput, model: str) -> dict:
    """The whole answer, once every completion finished."""
    choices = [_choice(request, c, c.text, c.logprobs or [], c.finish_reason) for c in out.outputs]
    kind = "chat.completion" if request.chat else "text_completion"
    return {"id": request.id, "object": kind, "created": request.created, "model": model, "choices": choices,
            "usage": usage(out)}


def chunk(request: ChatRequest, model: str, choices: list[dict], usage_block: dict | None = None) -> dict:
    kind = "chat.completion.chunk" if request.chat else "text_completion"
    body = {"id": request.id, "object": kind, "created": request.created, "model": model, "choices": choices}
    if usage_block is not None:
        body["usage"] = usage_block
    return body


def delta_choice(request: ChatRequest, completion: CompletionOutput, logprobs_sent: int, first: bool) -> dict:
    """One completion's news in a stream chunk: its new text and the logprobs of its new tokens."""
    new_logprobs = (completion.logprobs or [])[logprobs_sent:]
    choice = _choice(request, completion, completion.delta_text, new_logprobs, completion.finish_reason)
    if request.chat:
        choice["delta"] = choice.pop("message")
        if request.parse_tools:
            _tool_delta(request, completion, choice)
        if not first:
            del choice["delta"]["role"]
    return choice


def _tool_delta(request: ChatRequest, completion: CompletionOutput, choice: dict) -> None:
    """A streamed choice's content replaced by what its tool-call parser lets out (tool_calls.py)."""
    from nanomm.serve.tool_calls import ToolCallStream, stream_delta

    stream = request.tool_streams.setdefault(completion.index, ToolCallStream())
    deltas = stream.feed(completion.delta_text, final=completion.finish_reason is not None)
    choice["delta"] = {"role": "assistant", **stream_delta(deltas)}
    if completion.finish_reason and stream.num_calls:
        choice["finish_reason"] = "tool_calls"


def _choice(request: ChatRequest, completion: CompletionOutput, text: str, logprobs: list, finish) -> dict:
    choice = {"index": completion.index, "finish_reason": FINISH_REASONS.get(finish)}
    if request.chat:
        choice["message"] = {"role": "assistant", "content": text}
        if request.parse_tools and not request.stream:
            _tool_message(choice, text)
        choice["logprobs"] = None if request.num_top_logprobs is None else {
            "content": [_chat_logprob(entry, token, request.num_top_logprobs)
                        for entry, token in zip(logprobs, _new_tokens(completion, logprobs))]}
    else:
        choice["text"] = text
        choice["logprobs"] = None if request.num_top_logprobs is None else _completion_logprobs(
            logprobs, _new_tokens(completion, logprobs), request.num_top_logprobs)
    return choice


def _tool_message(choice: dict, text: str) -> None:
    """A whole answer's <tool_call> blocks as the message's tool_calls (finish_reason "tool_calls" if any)."""
    from nanomm.serve.tool_calls import parse_tool_calls

    content, calls = parse_tool_calls(text)
    choice["message"]["content"] = content
    if calls:
        choice["message"]["tool_calls"] = calls
        choice["finish_reason"] = "tool_calls"


def _new_tokens(completion: CompletionOutput, logprobs: list) -> list[int]:
    """The token ids that `logprobs` (the last len(logprobs) entries) belong to."""
    return completion.token_ids[len(completion.token_ids) - len(logprobs):] if logprobs else []


def _chat_logprob(entry: dict, token: int, num_top: int) -> dict:
    def one(lp):
        return {"token": lp.decoded_token, "logprob": _finite(lp.logprob), "bytes": list(lp.decoded_token.encode())}
    top = sorted((lp for lp in entry.values() if lp.rank <= num_top), key=lambda lp: lp.rank)
    return {**one(entry[token]), "top_logprobs": [one(lp) for lp in top]}


def _completion_logprobs(logprobs: list, tokens: list[int], num_top: int) -> dict:
    chosen = [entry[token] for entry, token in zip(logprobs, tokens)]
    return {"tokens": [lp.decoded_token for lp in chosen], "token_logprobs": [_finite(lp.logprob) for lp in chosen],
            "top_logprobs": [{lp.decoded_token: _finite(lp.logprob) for lp in entry.values() if lp.rank <= num_top}
                             for entry in logprobs]}


def _finite(logprob: float) -> float:
    """JSON has no -Infinity: a token a grammar masked out (structured outputs) reads -9999.0, as in vLLM."""
    return max(logprob, -9999.0)


def error_body(message: str, status: int) -> dict:
    """OpenAI's error shape (the openai client raises BadRequestError & co. from it)."""
    kind = {400: "invalid_request_error", 404: "not_found_error", 413: "invalid_request_error",
            503: "service_unavailable", 504: "timeout"}.get(status, "server_error")
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}
