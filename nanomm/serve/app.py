"""`nanomm-serve`: an OpenAI-compatible HTTP server over one engine (Starlette routes, run by uvicorn).

    nanomm-serve --demo                                   # the trained offline demo model on 127.0.0.1:8000
    nanomm-serve Qwen/Qwen2-VL-2B-Instruct --port 8000    # a real model (cuda + bfloat16 when available)

Lesson: lessons/11-serving-under-load.md (this server under load from scripts/load.py, read through /metrics).

Endpoints: POST /v1/chat/completions and /v1/completions (OpenAI's schema, `stream: true` as server-sent
events), GET /v1/models, /health and /metrics (Prometheus). What each request goes through:

1. the body is read up to `max_body_bytes` (413 past it, before any parsing), then parsed (protocol.py):
   a malformed request is a 400 in OpenAI's error shape, before the engine sees it;
2. with `max_pending_requests` already in flight, a 503 with Retry-After (the queue is full: come back later);
3. the request goes to the engine thread (engine_loop.py); its outputs come back on an asyncio queue. Bad input
   the engine finds (a prompt too long, an image that does not decode) is a 400 too, sent before any token;
4. the answer is one JSON body, or a stream of chunks ending with a usage chunk and `data: [DONE]`;
5. a client that disconnects, or a request that runs past `request_timeout_s`, is aborted: its KV blocks are
   freed at once.
"""

import argparse
import asyncio
import contextlib
import json
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from nanomm.errors import InvalidInputError
from nanomm.serve import protocol
from nanomm.serve.engine_loop import EngineLoop
from nanomm.serve.metrics import ServerMetrics


@dataclass
class ServerConfig:
    model_name: str  # what /v1/models lists and responses name
    max_pending_requests: int = 256  # requests in flight (running, waiting, preprocessing) before a 503
    request_timeout_s: float = 600.0
    max_body_bytes: int = 32 * 2**20
    media_root: Path | None = None  # local image files are read only under this folder; None: data URLs only
    disconnect_poll_s: float = 0.5  # how often a non-streaming request checks that its client is still there


class BodyTooLarge(Exception):
    pass


class Server:
    """The routes over one LLM. `app` is the ASGI application; the engine thread runs while it is served."""

    def __init__(self, llm, config: ServerConfig):
        self.llm, self.config = llm, config
        self.metrics = ServerMetrics()
        self.metrics.latest_stats = llm.engine.stats()  # /metrics has the pool's size before the first step
        self.engine_loop = EngineLoop(llm.engine, on_step=self._keep_stats, on_finished=self.metrics.record_finished)
        self.defaults = llm.get_default_sampling_params()
        routes = [Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                  Route("/v1/completions", self.completions, methods=["POST"]),
                  Route("/v1/models", self.models), Route("/health", self.health), Route("/metrics", self.scrape)]
        self.app = Starlette(routes=routes, lifespan=self._lifespan)

    @contextlib.asynccontextmanager
    async def _lifespan(self, app):
        self.engine_loop.start()
        yield
        self.engine_loop.stop()

    def _keep_stats(self, stats: dict) -> None:
        self.metrics.latest_stats = stats

    # -- the simple endpoints -----------------------------------------------------------------------------

    async def models(self, request: Request) -> Response:
        model = {"id": self.config.model_name, "object": "model", "created": 0, "owned_by": "nanomm",
                 "max_model_len": self.llm.engine.config.max_model_len}
        return JSONResponse({"object": "list", "data": [model]})

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def scrape(self, request: Request) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    # -- completions ----------------------------------------------------------------------------------------

    async def chat_completions(self, request: Request) -> Response:
        return await self._complete(request, lambda body: protocol.parse_chat(
            body, self.llm.tokenizer, self.defaults, self.config.media_root))

    async def completions(self, request: Request) -> Response:
        return await self._complete(request, lambda body: protocol.parse_completion(body, self.defaults))

    async def _complete(self, request: Request, parse) -> Response:
        try:
            body = await self._read_json(request)
            if body.get("model") not in (None, self.config.model_name):
                return _error(f"the model {body['model']!r} does not exist; this server serves "
                              f"{self.config.model_name!r}", 404)
            parsed = parse(body)
        except BodyTooLarge:
            return _error(f"the request body is larger than {self.config.max_body_bytes} bytes", 413)
        except InvalidInputError as exc:
            return _error(str(exc), 400)
        if self.engine_loop.num_requests >= self.config.max_pending_requests:
            return _error("the server is at capacity; retry shortly", 503, {"Retry-After": "1"})
        outputs = self._submit(parsed)
        deadline = time.monotonic() + self.config.request_timeout_s
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

    def _submit(self, parsed: protocol.ChatRequest) -> asyncio.Queue:
        """Hand the request to the engine thread; its outputs (or its error) arrive on the returned queue."""
        outputs: asyncio.Queue = asyncio.Queue()
        event_loop = asyncio.get_running_loop()
        self.engine_loop.add(parsed.id, parsed.prompt, parsed.params,
                             lambda item: event_loop.call_soon_threadsafe(outputs.put_nowait, item))
        return outputs

    async def _next(self, outputs: asyncio.Queue, deadline: float, request_id: str, client: Request | None = None):
        """The request's next output, or an error Response (bad input, timeout, a client gone: then aborted)."""
        while True:
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
        if isinstance(item, Exception):
            return _error(f"internal error: {type(item).__name__}: {item}", 500)
        if item.outputs[0].finish_reason == "error":
            return _error(item.outputs[0].error or "the request's input could not be used", 400)
        return item

    async def _stream(self, parsed: protocol.ChatRequest, out, outputs: asyncio.Queue, deadline: float):
        """Server-sent events: one chunk per engine output, a usage chunk, then [DONE]. A disconnect cancels
        this generator at its await; `finally` then aborts the request."""
        logprobs_sent: dict[int, int] = {}  # completion index -> logprob entries already streamed
        done: set[int] = set()
        try:
            while True:
                choices = []
                for c in out.outputs:
                    if c.index in done or not (c.delta_token_ids or c.finish_reason or c.index not in logprobs_sent):
                        continue
                    choices.append(protocol.delta_choice(parsed, c, logprobs_sent.get(c.index, 0),
                                                         c.index not in logprobs_sent))
                    logprobs_sent[c.index] = len(c.logprobs or [])
                    if c.finish_reason:
                        done.add(c.index)
                if choices:
                    yield _event(protocol.chunk(parsed, self.config.model_name, choices))
                if out.finished:
                    yield _event(protocol.chunk(parsed, self.config.model_name, [], protocol.usage(out)))
                    yield "data: [DONE]\n\n"
                    return
                out = await self._next(outputs, deadline, parsed.id)
                if isinstance(out, Response):  # timed out (already aborted)
                    yield "data: " + out.body.decode() + "\n\n"
                    return
        finally:
            if not isinstance(out, Response) and not out.finished:
                self.engine_loop.abort(parsed.id)


def _event(body: dict) -> str:
    return f"data: {json.dumps(body)}\n\n"


def _error(message: str, status: int, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(protocol.error_body(message, status), status_code=status, headers=headers)


class BackgroundServer:
    """Serve `server.app` on a thread (tests, lessons, the load generator): `with BackgroundServer(s) as url:`."""

    def __init__(self, server: Server, host: str = "127.0.0.1", port: int = 0):
        self.uvicorn = uvicorn.Server(uvicorn.Config(server.app, host=host, port=port, log_level="warning",
                                                     lifespan="on"))
        self._thread = threading.Thread(target=self.uvicorn.run, name="nanomm-http", daemon=True)

    def __enter__(self) -> str:
        self._thread.start()
        for _ in range(1000):
            if self.uvicorn.started:
                host, port = self.uvicorn.servers[0].sockets[0].getsockname()[:2]
                return f"http://{host}:{port}"
            time.sleep(0.01)
        raise RuntimeError("the server did not start within 10 s")

    def __exit__(self, *exc) -> None:
        self.uvicorn.should_exit = True
        self._thread.join(timeout=30)


# -- the command ----------------------------------------------------------------------------------------------

def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="nanomm-serve", description="An OpenAI-compatible server for Qwen2-VL.")
    p.add_argument("model", nargs="?", help="a checkpoint folder or hub id (default: --demo)")
    p.add_argument("--demo", nargs="?", const="trained", choices=["trained", "random"],
                   help="the offline demo model: the trained one shipped with nanomm, or 'random' (made on first use)")
    p.add_argument("--host", default="127.0.0.1", help="the address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", help="the model's name in the API (default: the model argument)")
    p.add_argument("--device"), p.add_argument("--dtype")
    p.add_argument("--max-model-len", type=int), p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-pixels", type=int, help="the engine's pixel cap per image")
    p.add_argument("--generation-config", default="auto", help="'auto', 'vllm' or a folder (as in vLLM)")
    p.add_argument("--max-pending-requests", type=int, default=256, help="in flight before a 503")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds before a request is aborted")
    p.add_argument("--max-body-mib", type=float, default=32.0, help="larger request bodies get a 413")
    p.add_argument("--allowed-local-media-path", type=Path,
                   help="a folder whose image files requests may name (default: data URLs only)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level ('info' logs every request)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    from rich.console import Console

    from nanomm import LLM
    from nanomm.demo import demo_folder

    args = parse_args(argv)
    console = Console(stderr=True)
    demo = args.demo or ("trained" if args.model is None else None)
    model = str(demo_folder(demo, console)) if demo else args.model
    llm = LLM(model, device=args.device, dtype=args.dtype, max_model_len=args.max_model_len,
              max_num_seqs=args.max_num_seqs, max_pixels=args.max_pixels, generation_config=args.generation_config)
    name = args.served_model_name or ("nanomm-demo" if demo else args.model)
    config = ServerConfig(name, args.max_pending_requests, args.request_timeout, int(args.max_body_mib * 2**20),
                          args.allowed_local_media_path)
    console.print(f"serving {name} on http://{args.host}:{args.port} (OpenAI API under /v1)")
    uvicorn.run(Server(llm, config).app, host=args.host, port=args.port, log_level=args.log_level)
    llm.close()
    return 0


if __name__ == "__main__":  # python -m nanomm.serve.app: what scripts/load.py starts
    sys.exit(main())
