"""`nanomm-serve --role router`: one OpenAI endpoint in front of a split engine's pools, or of whole engines.

    nanomm-serve --role router --port 8000 --encoder-url http://127.0.0.1:8001 \\
                 --prefill-url http://127.0.0.1:8002 --decode-url http://127.0.0.1:8003
    nanomm-serve --role router --port 8000 --engine-url http://127.0.0.1:8001 --engine-url http://127.0.0.1:8002

Lesson: lessons/13-three-topologies.md.

With `--engine-url` (topologies dp<N> and <X>e<Y>pd) each request goes whole, in one hop, to one engine: an
integrated engine, or one started with its own `--encoder-url` (the router names no encoder to it). The engine's
answer, streamed or not, is passed through to the client unchanged.

With `--prefill-url` and `--decode-url` (<X>e<Y>p<Z>d) a chat or completion request goes through the split
engine in two hops, the way vLLM's disaggregation proxy sends it:

1. to a prefill instance, with `kv_transfer_params: {"do_remote_decode": true, "encoder_url": E}`: it checks
   the request (a 400 comes straight back to the client), has its images encoded by the encoder service E,
   runs the prompt, samples the first token, parks the KV and answers with the handoff (engine/handoff.py);
2. to a decode instance, with the body's sampling fields and that handoff, not the messages or prompt (so not
   the pictures: the decode instance never runs the prompt): it pulls the KV from the prefill instance
   (transfer.py), replays the first token and streams or returns the answer, which the router
   passes through to the client unchanged.

Each pool is balanced by its outstanding work, each URL's sum over the requests it holds now (router_pools.py;
the router loads no model, so the work is estimated from the body): visual tokens for encoders and prefill
instances (the images' sizes at 28 x 28 pixels a token), running sequences for decode instances, and for whole
engines the prompt's tokens (those visual tokens plus the text at about 4 characters a token), held until the
answer ends. Among equals the instance sent the fewest requests so far gets the next. /metrics has each
instance's outstanding work and the requests sent to it (nanomm_router_routed_total).

Failures never hang a client: an empty pool is a 503 at once; a peer that refuses, resets or says nothing for
`peer_timeout_s` is a 502 or 504 (within a stream: an error event, then the stream ends). The prefill side frees
the KV of a handoff nobody took, after its own timeout.
"""

import asyncio
import contextlib
import json
import time

import aiohttp
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from nanomm.serve import protocol
from nanomm.serve.metrics import LATENCY_BUCKETS, HostCPUCollector
from nanomm.serve.affinity import DEFAULT_SLACK, CacheAffinity, prompt_keys
from nanomm.serve.router_pools import Pool, estimated_prompt_tokens, estimated_visual_tokens, picture_tokens

ROUTINGS = ("affinity", "load")
AFFINE_POOLS = ("engine", "prefill")  # the pools whose instances hold a prefix cache (and, whole, an encoder cache)
PEER_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError)  # a peer refused, reset, cut a stream or went quiet


def continuation_fields(body: dict) -> dict:
    """What hop 2 forwards of the client's body: all but the messages or prompt, which the prefill instance ran."""
    return {name: value for name, value in body.items() if name not in ("messages", "prompt")}


class Router:
    """The router's routes over its pools: `engine_urls` (whole requests), or encoder, prefill and decode URLs."""

    def __init__(self, encoder_urls: list[str], prefill_urls: list[str], decode_urls: list[str],
                 peer_timeout_s: float = 30.0, max_body_bytes: int = 32 * 2**20, engine_urls: list[str] = (),
                 routing: str = "load", affinity_slack: float = DEFAULT_SLACK):
        if routing not in ROUTINGS:
            raise ValueError(f"unknown routing {routing!r}; the routings are {list(ROUTINGS)}")
        if engine_urls and (encoder_urls or prefill_urls or decode_urls):
            raise ValueError("a router sends whole requests to engines (--engine-url, each with its own "
                             "--encoder-url if any) or splits them (--prefill-url, --decode-url), not both")
        self.whole = bool(engine_urls)
        roles = [("engine", engine_urls)] if self.whole else \
            [("encoder", encoder_urls), ("prefill", prefill_urls), ("decode", decode_urls)]
        self.pools = {role: Pool(role, list(urls)) for role, urls in roles}
        self.affine = routing == "affinity"
        for role in AFFINE_POOLS if self.affine else ():
            if role in self.pools:
                self.pools[role].affinity = CacheAffinity(affinity_slack)
        self.answering = self.pools["engine" if self.whole else "decode"]  # the pool whose answers go to clients
        self.peer_timeout_s, self.max_body_bytes = peer_timeout_s, max_body_bytes
        self.registry = CollectorRegistry()
        self.requests = Counter("nanomm_router_requests", "requests routed, by outcome", ["outcome"],
                                registry=self.registry)
        self.ttft = Histogram("nanomm_time_to_first_token_seconds", "arrival at the router -> first token out",
                              buckets=LATENCY_BUCKETS, registry=self.registry)
        self.registry.register(_PoolCollector(self.pools))
        self.registry.register(_AffinityCollector(self.pools))
        self.registry.register(HostCPUCollector())
        self.client: aiohttp.ClientSession | None = None
        routes = [Route("/v1/chat/completions", self.route, methods=["POST"]),
                  Route("/v1/completions", self.route, methods=["POST"]),
                  Route("/v1/models", self.models), Route("/health", self.health), Route("/metrics", self.scrape)]
        self.app = Starlette(routes=routes, lifespan=self._lifespan)

    @contextlib.asynccontextmanager
    async def _lifespan(self, app):
        # aiohttp: its C parser passes a stream through for about a third of httpx's CPU a chunk. A peer has
        # peer_timeout_s for each read (a stream may run for minutes); no cap on connections (the pools' own).
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=min(5.0, self.peer_timeout_s),
                                        sock_read=self.peer_timeout_s)
        async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as self.client:
            yield

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", "role": "router",
                             "pools": {role: pool.urls for role, pool in self.pools.items()}})

    async def scrape(self, request: Request) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)

    async def models(self, request: Request) -> Response:
        pool = self.answering
        if not pool.urls:
            return self._fail(f"no {pool.role} instance is configured", 503)
        try:
            status, content = await self._post_or_get("GET", pool.urls[0] + "/v1/models")
        except PEER_ERRORS as exc:
            return self._fail(f"the {pool.role} instance did not answer ({type(exc).__name__})", 502)
        return Response(content, status, media_type="application/json")

    async def route(self, request: Request) -> Response:
        arrival = time.perf_counter()
        for role, pool in self.pools.items():
            if role != "encoder" and not pool.urls:
                return self._fail(f"the router has no {role} instance", 503)
        body = await self._read_body(request)
        if isinstance(body, Response):
            return body
        path = request.url.path
        keys = prompt_keys(body, picture_tokens) if self.affine else None
        if self.whole:
            return await self._pass_through(self.pools["engine"], path, body, arrival, estimated_prompt_tokens(body),
                                            keys)
        handoff = await self._prefill(path, body, keys)
        if isinstance(handoff, Response):
            return handoff
        decode_body = {**continuation_fields(body), "kv_transfer_params": handoff}
        return await self._pass_through(self.pools["decode"], path, decode_body, arrival, work=1)

    async def _read_body(self, request: Request) -> dict | Response:
        """The client's JSON object, or the error to answer with (413 past max_body_bytes, 400 not an object)."""
        raw = await request.body()
        if len(raw) > self.max_body_bytes:
            return self._fail(f"the request body is larger than {self.max_body_bytes} bytes", 413)
        try:
            body = json.loads(raw)
            assert isinstance(body, dict)
        except (ValueError, AssertionError):
            return self._fail("the request body must be a JSON object", 400)
        return body

    async def _prefill(self, path: str, body: dict, keys=None):
        """Hop 1: the handoff from the least loaded prefill instance (its encoder picked the same way), or an
        error Response: the prefill instance's own (a 400 for bad input), or the router's 502/504."""
        work = estimated_visual_tokens(body)
        encoders, prefills = self.pools["encoder"], self.pools["prefill"]
        encoder = encoders.pick(work) if encoders.urls else None
        prefill = prefills.pick(work, keys)
        instruction = {"do_remote_decode": True, **({"encoder_url": encoder} if encoder else {})}
        try:
            status, content = await self._post_or_get("POST", prefill + path, {
                **body, "stream": False, "kv_transfer_params": instruction})
        except PEER_ERRORS as exc:
            return self._peer_failed("prefill", prefill, exc)
        finally:
            prefills.done(prefill, work)
            if encoder:
                encoders.done(encoder, work)
        if status != 200:
            self.requests.labels(outcome=str(status)).inc()
            return Response(content, status, media_type="application/json")
        handoff = json.loads(content)["kv_transfer_params"]
        handoff["remote_url"] = prefill  # where the decode instance pulls the KV from
        return handoff

    async def _pass_through(self, pool: Pool, path: str, body: dict, arrival: float, work: float,
                            keys=None) -> Response:
        """The last hop: `body` to the pool's least loaded instance (or, with `keys`, its cache's: affinity),
        charged `work` until its answer ends; the answer, streamed or not, goes back to the client as it comes."""
        url = pool.pick(work, keys)
        if body.get("stream"):
            return await self._stream_from(pool, url, path, body, arrival, work)
        return await self._answer_from(pool, url, path, body, arrival, work)

    async def _answer_from(self, pool: Pool, url: str, path: str, body: dict, arrival: float,
                           work: float) -> Response:
        try:
            status, content = await self._post_or_get("POST", url + path, body)
        except PEER_ERRORS as exc:
            return self._peer_failed(pool.role, url, exc)
        finally:
            pool.done(url, work)
        self.requests.labels(outcome=str(status)).inc()
        if status == 200:
            self.ttft.observe(time.perf_counter() - arrival)
        return Response(content, status, media_type="application/json")

    async def _post_or_get(self, method: str, url: str, body: dict | None = None) -> tuple[int, bytes]:
        """One whole exchange with a peer: its status and body."""
        async with self.client.request(method, url, json=body) as answer:
            return answer.status, await answer.read()

    async def _stream_from(self, pool: Pool, url: str, path: str, body: dict, arrival: float,
                           work: float) -> Response:
        """The instance's events passed through as they come; a peer that dies or goes quiet for peer_timeout_s
        ends the stream with an error event."""
        try:
            upstream = await self.client.post(url + path, json=body)
            status = upstream.status
            content = await upstream.read() if status != 200 else b""
        except PEER_ERRORS as exc:
            pool.done(url, work)
            return self._peer_failed(pool.role, url, exc)
        if status != 200:
            upstream.release()
            pool.done(url, work)
            self.requests.labels(outcome=str(status)).inc()
            return Response(content, status, media_type="application/json")

        async def events():
            first = True
            try:
                async for piece in upstream.content.iter_any():
                    if first:
                        self.ttft.observe(time.perf_counter() - arrival)
                        first = False
                    yield piece
                self.requests.labels(outcome="200").inc()
            except PEER_ERRORS as exc:
                self.requests.labels(outcome="peer_failed").inc()
                message = f"the {pool.role} instance at {url} failed mid-stream ({type(exc).__name__}: {exc})"
                yield f"data: {json.dumps(protocol.error_body(message, 502))}\n\n".encode()
            finally:
                upstream.close()  # a stream cut short (the client left) drops its connection too
                pool.done(url, work)

        return StreamingResponse(events(), media_type="text/event-stream")

    def _peer_failed(self, role: str, url: str, exc: Exception) -> Response:
        status = 504 if isinstance(exc, asyncio.TimeoutError) else 502
        return self._fail(f"the {role} instance at {url} failed ({type(exc).__name__}: {exc})", status)

    def _fail(self, message: str, status: int) -> Response:
        self.requests.labels(outcome=str(status)).inc()
        return JSONResponse(protocol.error_body(message, status), status_code=status)


class _PoolCollector:
    def __init__(self, pools: dict[str, Pool]):
        self.pools = pools

    def collect(self):
        work = GaugeMetricFamily("nanomm_router_outstanding_work", "work each instance holds now: visual tokens "
                                 "(encoder, prefill), sequences (decode) or prompt tokens (engine)",
                                 labels=["role", "url"])
        routed = CounterMetricFamily("nanomm_router_routed", "requests sent to each instance", labels=["role", "url"])
        for role, pool in self.pools.items():
            for url in pool.urls:
                work.add_metric([role, url], pool.outstanding[url])
                routed.add_metric([role, url], pool.routed[url])
        yield work
        yield routed


class _AffinityCollector:
    def __init__(self, pools: dict[str, Pool]):
        self.pools = pools

    def collect(self):
        picks = CounterMetricFamily("nanomm_router_affinity_picks", "affinity routing's picks: affine (sent where its "
                                    "prefix or pictures went), spilled (that instance was past the slack), new",
                                    labels=["role", "outcome"])
        for role, pool in self.pools.items():
            for outcome, count in (pool.affinity.outcomes.items() if pool.affinity else ()):
                picks.add_metric([role, outcome], count)
        yield picks
