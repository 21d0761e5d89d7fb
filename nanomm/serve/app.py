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
import random
import socket
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

from nanomm.engine.handoff import Handoff, kv_layout
from nanomm.errors import InvalidInputError, PeerError
from nanomm.serve import protocol
from nanomm.serve.engine_loop import EngineLoop
from nanomm.serve.metrics import ServerMetrics
from nanomm.transfer import MEDIA_TYPE, HttpKVConnector


@dataclass
class ServerConfig:
    model_name: str  # what /v1/models lists and responses name
    max_pending_requests: int = 256  # requests in flight (running, waiting, preprocessing) before a 503
    request_timeout_s: float = 600.0
    max_body_bytes: int = 32 * 2**20
    media_root: Path | None = None  # local image files are read only under this folder; None: data URLs only
    disconnect_poll_s: float = 0.5  # how often a non-streaming request checks that its client is still there
    role: str = "integrated"  # "prefill": hands requests off after their first token; "decode": takes them over
    encoder_urls: tuple[str, ...] = ()  # encoder services a request may name (kv_transfer_params "encoder_url")
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
        self.engine_loop = EngineLoop(llm.engine, on_step=self._keep_stats, on_finished=self.metrics.record_finished)
        self.defaults = llm.get_default_sampling_params()
        # the emulated device's connector moves placeholders and counts the real KV's bytes (nanomm/emulate)
        emulated = getattr(llm, "emulated", None)
        self.kv_connector = (HttpKVConnector(config.kv_pull_timeout_s) if emulated is None
                             else emulated.kv_connector(config.kv_pull_timeout_s))
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
            body, self.llm.tokenizer, self.defaults, self.config.media_root))

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
        deadline = time.monotonic() + self.config.request_timeout_s
        if isinstance(transfer, Handoff):  # a decode instance takes over a prefilled request
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

    def _submit(self, parsed: protocol.ChatRequest, add=None) -> asyncio.Queue:
        """Hand the request to the engine thread; its outputs (or its error) arrive on the returned queue.
        add(engine): how the engine takes it (default: add_request)."""
        outputs: asyncio.Queue = asyncio.Queue()
        event_loop = asyncio.get_running_loop()
        add = add or (lambda engine: engine.add_request(parsed.prompt, parsed.params, request_id=parsed.id))
        self.engine_loop.admit(parsed.id, add, lambda item: event_loop.call_soon_threadsafe(outputs.put_nowait, item))
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
            if url is not None and url not in self.config.encoder_urls:
                raise InvalidInputError(f"encoder_url {url!r} is not one of this instance's --encoder-url")
            return params
        if role != "decode":
            raise InvalidInputError(f"this instance's role is {role!r}: only a decode instance takes a handoff")
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

    async def _take_over(self, parsed: protocol.ChatRequest, handoff: Handoff):
        """Take this instance's cached prefix of the prompt, pull the rest of its KV from the prefill instance,
        then hand the request to the engine. The outputs' queue, or an error Response (the blocks freed)."""
        cached = await asyncio.wrap_future(self.engine_loop.call(lambda engine: engine.take_cached_prefix(handoff)))
        kv_cache = self.llm.engine.runner.kv_cache
        from_token = len(cached) * self.llm.engine.config.block_size
        owned = False
        try:
            start = time.perf_counter()
            tensors, num_bytes = await asyncio.to_thread(
                self.kv_connector.pull, handoff.remote_url, handoff.transfer_id, from_token, handoff.num_tokens,
                kv_layout(kv_cache, handoff.num_tokens - from_token))
            transfer_s = time.perf_counter() - start
            self.metrics.kv_transfer_bytes.labels(direction="received").inc(num_bytes)
            text = parsed.prompt.get("prompt") if isinstance(parsed.prompt, dict) else None
            outputs = self._submit(parsed, lambda engine: engine.add_transferred(
                parsed.id, text, parsed.params, handoff, tensors, cached, transfer_s))
            owned = True  # from here the engine owns the cached blocks, whatever happens
            return outputs
        except PeerError as exc:
            return _error(str(exc), exc.status)
        finally:
            if not owned:
                self.engine_loop.call(lambda engine: engine.free_blocks(cached))

    async def export_kv(self, request: Request) -> Response:
        """GET /v1/kv/{transfer_id}?from_token=K: a parked request's KV, once; its blocks are freed as it leaves."""
        transfer_id = request.path_params["transfer_id"]
        from_token = request.query_params.get("from_token", "0")
        if not from_token.isdigit():
            return _error("from_token must be a non-negative integer", 400)
        engine = self.llm.engine
        try:  # read on this thread: waiting for the engine's step to end would put a step's time into every pull
            tensors, num_tokens, block_table = await asyncio.to_thread(engine.take_parked_kv, transfer_id,
                                                                       int(from_token))
        except InvalidInputError as exc:
            return _error(str(exc), 404)
        self.engine_loop.call(lambda engine: engine.free_blocks(block_table))  # on the engine thread, not awaited
        body, num_bytes = await asyncio.to_thread(self.kv_connector.export, tensors, int(from_token), num_tokens)
        self.metrics.kv_transfer_bytes.labels(direction="sent").inc(num_bytes)
        return Response(body, media_type=MEDIA_TYPE)

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
        if isinstance(item, PeerError):
            return _error(str(item), item.status)
        if isinstance(item, Exception):
            return _error(f"internal error: {type(item).__name__}: {item}", 500)
        if item.outputs[0].finish_reason == "error":
            failed = item.outputs[0]
            return _error(failed.error or "the request's input could not be used", failed.error_status)
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


def _is_prefill_instruction(params: dict) -> bool:
    """{"do_remote_decode": true[, "encoder_url"]}: what the router sends a prefill instance."""
    return params.get("do_remote_decode") is True and set(params) <= {"do_remote_decode", "encoder_url"}


def _carries_handoff(body: dict) -> bool:
    """Whether kv_transfer_params is a handoff to continue: an object, not the prefill instruction
    (Server._transfer_params reads and checks either)."""
    params = body.get("kv_transfer_params")
    return isinstance(params, dict) and not _is_prefill_instruction(params)


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


def free_local_port(rng: random.Random | None = None) -> int:
    """A free port on 127.0.0.1 for a server process that starts later (tests, lesson 13's clusters, the load
    generator), chosen below the kernel's ephemeral range (Linux: ip_local_port_range, 32768 and up by default).
    Asking the kernel for port 0 and closing it would hand out a port from that range, which any outgoing
    connection made before the server binds (a health check, a peer's request) may take: then the server dies
    with "address already in use"."""
    rng = rng or random.Random()
    top = min(32768, ephemeral_ports_start())
    for _ in range(200):
        port = rng.randrange(max(1024, top - 12768), top)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:  # taken: try another
                continue
        return port
    raise RuntimeError(f"no free port below {top} on 127.0.0.1")


def ephemeral_ports_start() -> int:
    """The first port the kernel hands out to outgoing connections (32768 where it does not say)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


# -- the command ----------------------------------------------------------------------------------------------

def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="nanomm-serve", description="An OpenAI-compatible server for Qwen2-VL.")
    p.add_argument("model", nargs="?", help="a checkpoint folder or hub id (default: --demo; none for the router)")
    p.add_argument("--role", default="integrated", choices=["integrated", "encoder", "prefill", "decode", "router"],
                   help="what this instance does in a split engine (default: everything, one engine)")
    p.add_argument("--encoder-url", action="append", default=[], metavar="URL",
                   help="an encoder service: the engine runs no vision tower (repeatable: the router picks one "
                        "per request, the first is this engine's default)")
    p.add_argument("--prefill-url", action="append", default=[], metavar="URL", help="router: a prefill instance")
    p.add_argument("--decode-url", action="append", default=[], metavar="URL", help="router: a decode instance")
    p.add_argument("--peer-timeout", type=float, default=30.0,
                   help="seconds a peer may stay silent (a KV pull, an encode, a stream) before it is an error")
    p.add_argument("--kv-handoff-timeout", type=float, default=30.0,
                   help="prefill: seconds a parked request's KV waits for its decode instance before it is freed")
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
    p.add_argument("--emulate", type=_emulate_value, metavar="GPU:MODEL",
                   help="serve on an emulated device, no weights: e.g. h200:qwen2-vl-2b (nanomm/emulate; every "
                        "role: the router, which runs no model, takes it and changes nothing)")
    p.add_argument("--emulate-cost-file", metavar="JSON", help="with --emulate: GPU figures measured on a real GPU")
    p.add_argument("--gpu-hourly-price", type=_price, metavar="DOLLARS",
                   help="the device's price per hour: /metrics then has each request's cost (nanomm_request_cost_dollars)")
    p.add_argument("--old-image-policy", help="long chats: what becomes of pictures older than the last "
                   "--keep-last-images: keep (default), drop, downscale:MAX_PIXELS or compress:METHOD:RATIO")
    p.add_argument("--keep-last-images", type=int, help="long chats: the last pictures of a prompt that stay whole")
    p.add_argument("--media-io-kwargs", type=_json_object, metavar="JSON",
                   help='how videos are sampled and capped, as in vLLM: \'{"video": {"num_frames": 32}}\' (keys: fps, '
                        "num_frames, min_frames, max_frames, video_min_pixels, video_max_pixels)")
    p.add_argument("--video-pruning-rate", type=float, default=0.0,
                   help="drop this share of each later temporal patch's least-changed tokens (EVS, lesson 17)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level ('info' logs every request)")
    return p.parse_args(argv)


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a JSON object")
    return value


def _price(text: str) -> float:
    try:
        price = float(text)
    except ValueError:
        price = -1.0
    if not 0 < price < float("inf"):  # NaN too; 0 would make every cost bucket the same
        raise argparse.ArgumentTypeError(f"{text!r}: a price is a number of dollars per hour, more than 0")
    return price


def _emulate_value(text: str) -> str:
    from nanomm.emulate import parse_emulate  # only when --emulate is given

    try:
        parse_emulate(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def main(argv=None) -> int:
    from rich.console import Console

    args = parse_args(argv)
    console = Console(stderr=True)
    where = f"http://{args.host}:{args.port}"
    if args.emulate and (args.model or args.demo or args.device or args.dtype):
        raise SystemExit("nanomm-serve --emulate loads no model: drop the model, --demo, --device and --dtype")
    if args.role == "router":
        from nanomm.serve.router import Router

        if args.model or args.demo:
            raise SystemExit("nanomm-serve --role router loads no model: give it --prefill-url and --decode-url")
        router = Router(args.encoder_url, args.prefill_url, args.decode_url, args.peer_timeout,
                        int(args.max_body_mib * 2**20))
        console.print(f"routing on {where}: prefill {args.prefill_url}, decode {args.decode_url}, "
                      f"encoders {args.encoder_url or '(the prefill instances own)'}")
        uvicorn.run(router.app, host=args.host, port=args.port, log_level=args.log_level)
        return 0
    model, name = (None, args.served_model_name or args.emulate) if args.emulate else _model_and_name(args, console)
    if args.role == "encoder":
        from nanomm.serve.encoder_server import EncoderServer, load_emulated_encoder, load_encoder

        if args.emulate:
            service = load_emulated_encoder(args.emulate, args.max_pixels, args.emulate_cost_file)
        else:
            service = load_encoder(model, args.device, args.dtype, args.max_pixels)
        console.print(f"encoding for {name} on {where} (POST /v1/encode)")
        uvicorn.run(EncoderServer(service, name).app, host=args.host, port=args.port, log_level=args.log_level)
        return 0
    from nanomm import LLM

    llm = LLM(model, device=args.device, dtype=args.dtype, max_model_len=args.max_model_len,
              max_num_seqs=args.max_num_seqs, max_pixels=args.max_pixels, generation_config=args.generation_config,
              encoder_url=args.encoder_url[0] if args.encoder_url else None, encoder_timeout_s=args.peer_timeout,
              kv_handoff_timeout_s=args.kv_handoff_timeout, emulate=args.emulate,
              emulate_cost_file=args.emulate_cost_file, media_io_kwargs=args.media_io_kwargs,
              video_pruning_rate=args.video_pruning_rate, **_long_chat_args(args))
    config = ServerConfig(name, args.max_pending_requests, args.request_timeout, int(args.max_body_mib * 2**20),
                          args.allowed_local_media_path, role=args.role, encoder_urls=tuple(args.encoder_url),
                          kv_pull_timeout_s=args.peer_timeout, gpu_hourly_price=args.gpu_hourly_price)
    console.print(f"serving {name} on {where} (OpenAI API under /v1, role {args.role})")
    uvicorn.run(Server(llm, config).app, host=args.host, port=args.port, log_level=args.log_level)
    llm.close()
    return 0


def _long_chat_args(args) -> dict:
    """--old-image-policy and --keep-last-images, as engine arguments (those given; the engine checks them)."""
    given = {"old_image_policy": args.old_image_policy, "keep_last_images": args.keep_last_images}
    return {name: value for name, value in given.items() if value is not None}


def _model_and_name(args, console) -> tuple[str, str]:
    """The checkpoint folder (or hub id) to load, and the name the API gives it."""
    from nanomm.demo import demo_folder

    demo = args.demo or ("trained" if args.model is None else None)
    model = str(demo_folder(demo, console)) if demo else args.model
    return model, args.served_model_name or ("nanomm-demo" if demo else args.model)


if __name__ == "__main__":  # python -m nanomm.serve.app: what scripts/load.py starts
    sys.exit(main())
