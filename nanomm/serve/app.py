"""One engine instance behind OpenAI's HTTP API: the Starlette routes, run by uvicorn (the `nanomm-serve` command,
cli.py) or on a thread (testing.py), and a split engine's prefill and decode sides of the KV handoff.

Lessons: lessons/11-serving-under-load.md (this server under load from `nanomm-bench load`, read through /metrics) and
lessons/13-three-topologies.md (`ServerConfig.role`: prefill parks a request after its first token, decode takes
it over).

Endpoints: POST /v1/chat/completions and /v1/completions (OpenAI's schema, `stream: true` as server-sent
events), GET /v1/models, /health and /metrics (Prometheus). What each request goes through:

1. the body is read up to `max_body_bytes` (413 past it, before any parsing), then parsed (protocol.py):
   a malformed request is a 400 in OpenAI's error shape, before the engine sees it;
2. with `max_pending_requests` already in flight, a 503 with Retry-After (the queue is full: come back later);
   then the request's http(s) pictures and videos are fetched, all at once, on threads off the event loop
   (`media_urls`, nanomm/inputs/media_fetch.py): a failed fetch is a 400, a client gone stops the fetches;
3. the request goes to the engine thread (engine_loop.py); its outputs come back on an asyncio queue. Bad input
   the engine finds (a prompt too long, an image that does not decode) is a 400 too, sent before any token;
4. the answer is one JSON body, or a stream of chunks ending with a usage chunk and `data: [DONE]`;
5. a client that disconnects, or a request that runs past `request_timeout_s`, is aborted: its KV blocks are
   freed at once.
"""

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from nanomm.errors import InvalidInputError, PeerError
from nanomm.serve import protocol
from nanomm.serve.engine_loop import EngineLoop, OutputMailbox
from nanomm.serve.metrics import ServerMetrics

if TYPE_CHECKING:
    from nanomm.inputs.media_fetch import MediaUrlPolicy


@dataclass
class ServerConfig:
    model_name: str  # what /v1/models lists and responses name
    max_pending_requests: int = 256  # requests in flight (running, waiting, preprocessing) before a 503
    request_timeout_s: float = 600.0
    max_body_bytes: int = 32 * 2**20
    media_root: Path | None = None  # local image files are read only under this folder; None: data URLs only
    media_urls: "MediaUrlPolicy | None" = None  # the http(s) URLs a request may name (media_fetch.py); None: none
    disconnect_poll_s: float = 0.5  # how often a non-streaming request checks that its client is still there
    role: str = "integrated"  # "prefill": hands requests off after their first token; "decode": takes them over
    encoder_urls: tuple[str, ...] = ()  # encoder services a request may name (kv_transfer_params "encoder_url");
    #                                     Server.allow_encoder adds more while it serves
    kv_pull_timeout_s: float = 30.0  # a decode instance: how long a KV pull from a prefill instance may take
    gpu_hourly_price: float | None = None  # dollars per device hour: /metrics then has each request's cost


class BodyTooLarge(Exception):
    pass


class Server:
    """The routes over one LLM. `app` is the ASGI application; the engine thread runs while it is served."""

    def __init__(self, llm, config: ServerConfig):
        self.llm, self.config = llm, config
        self.metrics = ServerMetrics(config.gpu_hourly_price)
        self.metrics.latest_stats = llm.engine.stats()  # /metrics has the pool's size before the first step
        self.engine_loop = EngineLoop(llm.engine, on_step=self._keep_stats, on_finished=self.metrics.record_finished,
                                      parks_kv=config.role == "prefill")
        self.defaults = llm.get_default_sampling_params()
        self.mailbox: OutputMailbox | None = None  # made on the event loop, by the first request
        self.encoder_urls = set(config.encoder_urls)  # a prefill instance's: the encoders its requests may name
        self.kv_connector = _kv_connector(llm, config) if config.role in ("prefill", "decode") else None
        routes = [Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                  Route("/v1/completions", self.completions, methods=["POST"]),
                  Route("/v1/models", self.models), Route("/health", self.health), Route("/metrics", self.scrape)]
        if config.role == "prefill":
            routes.append(Route("/v1/kv/{transfer_id}", self.export_kv))
        self.app = Starlette(routes=routes, lifespan=self._lifespan)

    @contextlib.asynccontextmanager
    async def _lifespan(self, app):
        self.engine_loop.start()
        yield
        self.engine_loop.stop()

    def _keep_stats(self, stats: dict) -> None:
        self.metrics.latest_stats = stats

    def allow_encoder(self, url: str) -> None:
        """Let requests name this encoder service too (a Ray prefill replica allows each encoder it leases)."""
        self.encoder_urls.add(url)

    # -- the simple endpoints -----------------------------------------------------------------------------

    async def models(self, request: Request) -> Response:
        model = {"id": self.config.model_name, "object": "model", "created": 0, "owned_by": "nanomm",
                 "max_model_len": self.llm.engine.config.max_model_len}
        return JSONResponse({"object": "list", "data": [model]})

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", "role": self.config.role})

    async def scrape(self, request: Request) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    # -- completions ----------------------------------------------------------------------------------------

    async def chat_completions(self, request: Request) -> Response:
        return await self._complete(request, lambda body: protocol.parse_chat(
            body, self.llm.tokenizer, self.defaults, self.config.media_root, self.config.media_urls))

    async def completions(self, request: Request) -> Response:
        return await self._complete(request, lambda body: protocol.parse_completion(body, self.defaults))

    async def _complete(self, request: Request, parse) -> Response:
        try:
            body = await self._read_json(request)
            if body.get("model") not in (None, self.config.model_name):
                return _error(f"the model {body['model']!r} does not exist; this server serves "
                              f"{self.config.model_name!r}", 404)
            if _carries_handoff(body):  # a decode instance's part: the prompt ran on a prefill instance
                chat = request.url.path.endswith("/chat/completions")
                parsed = protocol.parse_continuation(body, self.defaults, chat)
            else:
                parsed = parse(body)
            transfer = self._transfer_params(body)
        except BodyTooLarge:
            return _error(f"the request body is larger than {self.config.max_body_bytes} bytes", 413)
        except InvalidInputError as exc:
            return _error(str(exc), 400)
        if self.engine_loop.num_requests >= self.config.max_pending_requests:
            return _error("the server is at capacity; retry shortly", 503, {"Retry-After": "1"})
        failed = await self._fetch_media(parsed, request)
        if failed is not None:
            return failed
        deadline = time.monotonic() + self.config.request_timeout_s
        if transfer is not None and self.config.role == "decode":  # a decode instance takes over a prefilled request
            outputs = await self._take_over(parsed, transfer)
            if isinstance(outputs, Response):
                return outputs
        elif transfer is not None:  # a prefill instance: run the prompt, park it, answer with the handoff
            return await self._prefill_only(parsed, transfer, deadline)
        else:
            outputs = self._submit(parsed)
        first = await self._next(outputs, deadline, parsed.id)
        if isinstance(first, Response):
            return first
        if parsed.stream:
            return StreamingResponse(self._stream(parsed, first, outputs, deadline), media_type="text/event-stream")
        final = first
        while not final.finished:
            final = await self._next(outputs, deadline, parsed.id, request)
            if isinstance(final, Response):
                return final
        return JSONResponse(protocol.response(parsed, final, self.config.model_name))

    async def _read_json(self, request: Request) -> dict:
        """The body as JSON, read no further than max_body_bytes (a declared length past it is refused unread)."""
        limit = self.config.max_body_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise BodyTooLarge()
        body = bytearray()
        async for piece in request.stream():
            body += piece
            if len(body) > limit:
                raise BodyTooLarge()
        try:
            parsed = json.loads(body)
        except ValueError as exc:
            raise InvalidInputError(f"the body is not valid JSON ({exc})") from None
        if not isinstance(parsed, dict):
            raise InvalidInputError("the request body must be a JSON object")
        return parsed

    async def _fetch_media(self, parsed: protocol.ChatRequest, request: Request) -> Response | None:
        """Replace the prompt's http(s) pictures and videos by their bytes; an error Response if a fetch failed or
        the client went away (then every fetch still running is stopped). None: done, or nothing to fetch."""
        if self.config.media_urls is None:  # then parsing refused every URL
            return None
        from nanomm.inputs.media_fetch import fetch_prompt_media_async, remote_parts

        if not remote_parts(parsed.prompt):
            return None
        fetch = asyncio.ensure_future(fetch_prompt_media_async(parsed.prompt, self.config.media_urls))
        try:
            while not (await asyncio.wait({fetch}, timeout=self.config.disconnect_poll_s))[0]:
                if await request.is_disconnected():
                    return _error("the client disconnected", 499)
            parsed.prompt = fetch.result()
            return None
        except InvalidInputError as exc:
            return _error(str(exc), 400)
        finally:
            fetch.cancel()  # a no-op once done; else the fetches' sockets are shut

    def _submit(self, parsed: protocol.ChatRequest, add=None) -> asyncio.Queue:
        """Hand the request to the engine thread; its outputs (or its error) arrive on the returned queue.
        add(engine): how the engine takes it (default: add_request)."""
        outputs: asyncio.Queue = asyncio.Queue()
        event_loop = asyncio.get_running_loop()
        if self.mailbox is None or self.mailbox.event_loop is not event_loop:
            self.mailbox = OutputMailbox(event_loop)
        mailbox = self.mailbox
        add = add or (lambda engine: engine.add_request(parsed.prompt, parsed.params, request_id=parsed.id))
        self.engine_loop.admit(parsed.id, add, lambda item: mailbox.post(outputs, item))
        return outputs

    # -- prefill here, decode there (engine/handoff.py, transfer.py) --------------------------------

    def _transfer_params(self, body: dict):
        """None (an ordinary request), the prefill instruction {"do_remote_decode": true[, "encoder_url"]}, or a
        Handoff for a decode instance; anything else is a 400, before any compute."""
        params = body.get("kv_transfer_params")
        role = self.config.role
        if params is None:
            return None
        if not isinstance(params, dict):
            raise InvalidInputError("kv_transfer_params must be an object")
        if _is_prefill_instruction(params):
            if role != "prefill":
                raise InvalidInputError(f"this instance's role is {role!r}: only a prefill instance hands off")
            url = params.get("encoder_url")
            if url is not None and url not in self.encoder_urls:
                raise InvalidInputError(f"encoder_url {url!r} is not one of this instance's --encoder-url")
            return params
        if role != "decode":
            raise InvalidInputError(f"this instance's role is {role!r}: only a decode instance takes a handoff")
        from nanomm.engine.handoff import Handoff  # a split engine's part, loaded by its roles only

        return Handoff.from_json(params, self.llm.model.config.text.vocab_size)

    async def _prefill_only(self, parsed: protocol.ChatRequest, params: dict, deadline: float) -> Response:
        """Run the prompt and sample the first token; the answer is the handoff a decode instance continues from."""
        url = params.get("encoder_url")
        outputs = self._submit(parsed, lambda engine: engine.add_request(
            parsed.prompt, parsed.params, request_id=parsed.id, hand_off=True, encoder_url=url))
        out = await self._next(outputs, deadline, parsed.id)
        if isinstance(out, Response):
            return out
        return JSONResponse({"id": parsed.id, "object": "kv_handoff", "kv_transfer_params": out.kv_transfer_params})

    async def _take_over(self, parsed: protocol.ChatRequest, handoff):
        """Take this instance's cached prefix of the prompt, pull the rest of its KV from the prefill instance,
        then hand the request to the engine. The outputs' queue, or an error Response (the blocks freed)."""
        cached = await asyncio.wrap_future(self.engine_loop.call(
            lambda engine: engine.handoffs.take_cached_prefix(handoff)))
        from_token = len(cached) * self.llm.engine.config.block_size
        owned = False
        try:
            start = time.perf_counter()
            tensors, num_bytes = await asyncio.to_thread(
                self.kv_connector.pull, handoff.remote_url, handoff.transfer_id, from_token, handoff.num_tokens,
                self.llm.engine.handoffs.kv_layout(handoff.num_tokens - from_token))
            transfer_s = time.perf_counter() - start
            self.metrics.kv_transfer_bytes.labels(direction="received").inc(num_bytes)
            text = parsed.prompt.get("prompt") if isinstance(parsed.prompt, dict) else None
            outputs = self._submit(parsed, lambda engine: engine.handoffs.add_transferred(
                parsed.id, text, parsed.params, handoff, tensors, cached, transfer_s))
            owned = True  # from here the engine owns the cached blocks, whatever happens
            return outputs
        except PeerError as exc:
            return _error(str(exc), exc.status)
        finally:
            if not owned:
                self.engine_loop.call(lambda engine: engine.handoffs.free_blocks(cached))

    async def export_kv(self, request: Request) -> Response:
        """GET /v1/kv/{transfer_id}?from_token=K: a parked request's KV, once; its blocks are freed as it leaves."""
        transfer_id = request.path_params["transfer_id"]
        from_token = request.query_params.get("from_token", "0")
        if not from_token.isdigit():
            return _error("from_token must be a non-negative integer", 400)
        engine = self.llm.engine
        try:  # read on this thread: waiting for the engine's step to end would put a step's time into every pull
            tensors, num_tokens, block_table = await asyncio.to_thread(engine.handoffs.take_parked_kv, transfer_id,
                                                                       int(from_token))
        except InvalidInputError as exc:
            return _error(str(exc), 404)
        self.engine_loop.call(lambda engine: engine.handoffs.free_blocks(block_table))  # engine thread, not awaited
        body, num_bytes = await asyncio.to_thread(self.kv_connector.export, tensors, int(from_token), num_tokens)
        self.metrics.kv_transfer_bytes.labels(direction="sent").inc(num_bytes)
        return Response(body, media_type=self.kv_connector.media_type)

    async def _next(self, outputs: asyncio.Queue, deadline: float, request_id: str, client: Request | None = None):
        """The request's next output, or an error Response (bad input, timeout, a client gone: then aborted)."""
        while True:
            if not outputs.empty():  # already here: no timer, no task
                item = outputs.get_nowait()
                break
            wait_s = min(deadline - time.monotonic(), self.config.disconnect_poll_s)
            try:
                item = await asyncio.wait_for(outputs.get(), timeout=max(wait_s, 0.0))
                break
            except asyncio.TimeoutError:
                if time.monotonic() >= deadline:
                    self.engine_loop.abort(request_id)
                    return _error(f"the request ran past {self.config.request_timeout_s} s", 504)
                if client is not None and await client.is_disconnected():
                    self.engine_loop.abort(request_id)
                    return _error("the client disconnected", 499)
        if isinstance(item, InvalidInputError):
            return _error(str(item), 400)
        if isinstance(item, PeerError):
            return _error(str(item), item.status)
        if isinstance(item, Exception):
            return _error(f"internal error: {type(item).__name__}: {item}", 500)
        if item.outputs[0].finish_reason == "error":
            failed = item.outputs[0]
            return _error(failed.error or "the request's input could not be used", failed.error_status)
        return item

    async def _stream(self, parsed: protocol.ChatRequest, out, outputs: asyncio.Queue, deadline: float):
        """Server-sent events: one chunk per engine output, a usage chunk, then [DONE]. The chunks of outputs
        that are already waiting go out in one write (a client that reads slower than the engine steps costs one
        send, not one a token). A disconnect cancels this generator at its await; `finally` then aborts it."""
        logprobs_sent: dict[int, int] = {}  # completion index -> logprob entries already streamed
        done: set[int] = set()
        events: list[str] = []
        try:
            while True:
                events += self._events(parsed, out, logprobs_sent, done)
                if out.finished:
                    yield "".join(events)
                    return
                if events and outputs.empty():  # about to wait: send what is ready
                    yield "".join(events)
                    events = []
                out = await self._next(outputs, deadline, parsed.id)
                if isinstance(out, Response):  # timed out, or failed (already aborted)
                    yield "".join(events) + "data: " + out.body.decode() + "\n\n"
                    return
        finally:
            if not isinstance(out, Response) and not out.finished:
                self.engine_loop.abort(parsed.id)

    def _events(self, parsed: protocol.ChatRequest, out, logprobs_sent: dict[int, int], done: set[int]) -> list[str]:
        """The server-sent events one engine output makes: a chunk of the completions' news; at the end a usage
        chunk and [DONE]."""
        choices = []
        for c in out.outputs:
            if c.index in done or not (c.delta_token_ids or c.finish_reason or c.index not in logprobs_sent):
                continue
            choices.append(protocol.delta_choice(parsed, c, logprobs_sent.get(c.index, 0),
                                                 c.index not in logprobs_sent))
            logprobs_sent[c.index] = len(c.logprobs or [])
            if c.finish_reason:
                done.add(c.index)
        events = [_event(protocol.chunk(parsed, self.config.model_name, choices))] if choices else []
        if out.finished:
            events += [_event(protocol.chunk(parsed, self.config.model_name, [], protocol.usage(out))),
                       "data: [DONE]\n\n"]
        return events


def _is_prefill_instruction(params: dict) -> bool:
    """{"do_remote_decode": true[, "encoder_url"]}: what the router sends a prefill instance."""
    return params.get("do_remote_decode") is True and set(params) <= {"do_remote_decode", "encoder_url"}


def _kv_connector(llm, config: ServerConfig):
    """A prefill or decode instance's KV transport (transfer.py); the emulated device's moves placeholders and
    counts the real KV's bytes (nanomm/emulate)."""
    emulated = getattr(llm, "emulated", None)
    if emulated is not None:
        return emulated.kv_connector(config.kv_pull_timeout_s)
    from nanomm.transfer import HttpKVConnector

    return HttpKVConnector(config.kv_pull_timeout_s)


def _carries_handoff(body: dict) -> bool:
    """Whether kv_transfer_params is a handoff to continue: an object, not the prefill instruction
    (Server._transfer_params reads and checks either)."""
    params = body.get("kv_transfer_params")
    return isinstance(params, dict) and not _is_prefill_instruction(params)


def _event(body: dict) -> str:
    return f"data: {json.dumps(body)}\n\n"


def _error(message: str, status: int, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(protocol.error_body(message, status), status_code=status, headers=headers)
