"""`nanomm-serve --role router`: one OpenAI endpoint in front of encoder, prefill and decode pools.

    nanomm-serve --role router --port 8000 --encoder-url http://127.0.0.1:8001 \\
                 --prefill-url http://127.0.0.1:8002 --decode-url http://127.0.0.1:8003

Lesson: lessons/13-three-topologies.md.

A chat or completion request goes through the split engine in two hops, the way vLLM's disaggregation proxy
sends it:

1. to a prefill instance, with `kv_transfer_params: {"do_remote_decode": true, "encoder_url": E}`: it checks
   the request (a 400 comes straight back to the client), has its images encoded by the encoder service E,
   runs the prompt, samples the first token, parks the KV and answers with the handoff (engine/handoff.py);
2. to a decode instance, with the body's sampling fields and that handoff, not the messages or prompt (so not
   the pictures: the decode instance never runs the prompt): it pulls the KV from the prefill instance
   (transfer.py), replays the first token and streams or returns the answer, which the router
   passes through to the client unchanged.

Each pool is balanced by its outstanding work, each URL's sum over the requests it holds now: visual tokens
for encoders and prefill instances (estimated from the images' sizes as 28 x 28 pixels a token, since the
router loads no model), running sequences for decode instances.

Failures never hang a client: an empty pool is a 503 at once; a peer that refuses, resets or says nothing for
`peer_timeout_s` is a 502 or 504 (within a stream: an error event, then the stream ends). The prefill side frees
the KV of a handoff nobody took, after its own timeout.
"""

import base64
import binascii
import contextlib
import io
import json
import math
import time
from dataclasses import dataclass, field

import httpx
from PIL import Image
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from nanomm.serve import protocol
from nanomm.serve.metrics import LATENCY_BUCKETS, HostCPUCollector

PIXELS_PER_TOKEN = 28 * 28  # Qwen2-VL: 14 x 14 patches, 2 x 2 of them merged into one token


@dataclass
class Pool:
    """One role's instances and the work each holds now."""
    role: str
    urls: list[str]
    outstanding: dict[str, float] = field(default_factory=dict)

    def __post_init__(self):
        self.urls = [u.rstrip("/") for u in self.urls]
        self.outstanding = {u: 0.0 for u in self.urls}

    def pick(self, work: float) -> str:
        """The instance with the least outstanding work (the first of equals), charged `work` until `done`."""
        url = min(self.urls, key=self.outstanding.__getitem__)
        self.outstanding[url] += work
        return url

    def done(self, url: str, work: float) -> None:
        self.outstanding[url] -= work


def estimated_visual_tokens(body: dict) -> float:
    """The visual tokens of a chat request's data-URL images, from their sizes alone (headers are enough)."""
    tokens = 0.0
    for message in body.get("messages") or []:
        content = message.get("content") if isinstance(message, dict) else None
        for part in content if isinstance(content, list) else []:
            url = (part.get("image_url") or {}).get("url", "") if isinstance(part, dict) else ""
            if isinstance(url, str) and url.startswith("data:") and "," in url:
                try:
                    width, height = Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).size
                    tokens += max(1, math.ceil(width / 28) * math.ceil(height / 28))
                except (binascii.Error, OSError, ValueError):
                    tokens += 1  # the prefill instance will name what is wrong with it
    return tokens


def continuation_fields(body: dict) -> dict:
    """What hop 2 forwards of the client's body: all but the messages or prompt, which the prefill instance ran."""
    return {name: value for name, value in body.items() if name not in ("messages", "prompt")}


class Router:
    def __init__(self, encoder_urls: list[str], prefill_urls: list[str], decode_urls: list[str],
                 peer_timeout_s: float = 30.0, max_body_bytes: int = 32 * 2**20):
        self.pools = {role: Pool(role, urls) for role, urls in
                      (("encoder", encoder_urls), ("prefill", prefill_urls), ("decode", decode_urls))}
        self.peer_timeout_s, self.max_body_bytes = peer_timeout_s, max_body_bytes
        self.registry = CollectorRegistry()
        self.requests = Counter("nanomm_router_requests", "requests routed, by outcome", ["outcome"],
                                registry=self.registry)
        self.ttft = Histogram("nanomm_time_to_first_token_seconds", "arrival at the router -> first token out",
                              buckets=LATENCY_BUCKETS, registry=self.registry)
        self.registry.register(_PoolCollector(self.pools))
        self.registry.register(HostCPUCollector())
        self.client: httpx.AsyncClient | None = None
        routes = [Route("/v1/chat/completions", self.route, methods=["POST"]),
                  Route("/v1/completions", self.route, methods=["POST"]),
                  Route("/v1/models", self.models), Route("/health", self.health), Route("/metrics", self.scrape)]
        self.app = Starlette(routes=routes, lifespan=self._lifespan)

    @contextlib.asynccontextmanager
    async def _lifespan(self, app):
        timeout = httpx.Timeout(self.peer_timeout_s, connect=min(5.0, self.peer_timeout_s))
        async with httpx.AsyncClient(timeout=timeout) as self.client:
            yield

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", "role": "router",
                             "pools": {role: pool.urls for role, pool in self.pools.items()}})

    async def scrape(self, request: Request) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)

    async def models(self, request: Request) -> Response:
        if not self.pools["decode"].urls:
            return self._fail("no decode instance is configured", 503)
        try:
            answer = await self.client.get(self.pools["decode"].urls[0] + "/v1/models")
        except httpx.HTTPError as exc:
            return self._fail(f"the decode instance did not answer ({type(exc).__name__})", 502)
        return Response(answer.content, answer.status_code, media_type="application/json")

    async def route(self, request: Request) -> Response:
        arrival = time.perf_counter()
        for role in ("prefill", "decode"):
            if not self.pools[role].urls:
                return self._fail(f"the router has no {role} instance", 503)
        body = await self._read_body(request)
        if isinstance(body, Response):
            return body
        handoff = await self._prefill(request.url.path, body)
        if isinstance(handoff, Response):
            return handoff
        decode_body = {**continuation_fields(body), "kv_transfer_params": handoff}
        if body.get("stream"):
            return await self._stream_from_decode(request.url.path, decode_body, arrival)
        return await self._answer_from_decode(request.url.path, decode_body, arrival)

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

    async def _prefill(self, path: str, body: dict):
        """Hop 1: the handoff from the least loaded prefill instance (its encoder picked the same way), or an
        error Response: the prefill instance's own (a 400 for bad input), or the router's 502/504."""
        work = estimated_visual_tokens(body)
        encoders, prefills = self.pools["encoder"], self.pools["prefill"]
        encoder = encoders.pick(work) if encoders.urls else None
        prefill = prefills.pick(work)
        instruction = {"do_remote_decode": True, **({"encoder_url": encoder} if encoder else {})}
        try:
            answer = await self.client.post(prefill + path, json={**body, "stream": False,
                                                                  "kv_transfer_params": instruction})
        except httpx.HTTPError as exc:
            return self._peer_failed("prefill", prefill, exc)
        finally:
            prefills.done(prefill, work)
            if encoder:
                encoders.done(encoder, work)
        if answer.status_code != 200:
            self.requests.labels(outcome=str(answer.status_code)).inc()
            return Response(answer.content, answer.status_code, media_type="application/json")
        handoff = answer.json()["kv_transfer_params"]
        handoff["remote_url"] = prefill  # where the decode instance pulls the KV from
        return handoff

    async def _answer_from_decode(self, path: str, body: dict, arrival: float) -> Response:
        decodes = self.pools["decode"]
        decode = decodes.pick(1)
        try:
            answer = await self.client.post(decode + path, json=body)
        except httpx.HTTPError as exc:
            return self._peer_failed("decode", decode, exc)
        finally:
            decodes.done(decode, 1)
        self.requests.labels(outcome=str(answer.status_code)).inc()
        if answer.status_code == 200:
            self.ttft.observe(time.perf_counter() - arrival)
        return Response(answer.content, answer.status_code, media_type="application/json")

    async def _stream_from_decode(self, path: str, body: dict, arrival: float) -> Response:
        """Hop 2, streamed: the decode instance's events passed through as they come; a peer that dies or goes
        quiet for peer_timeout_s ends the stream with an error event."""
        decodes = self.pools["decode"]
        decode = decodes.pick(1)
        try:
            upstream = await self.client.send(self.client.build_request("POST", decode + path, json=body), stream=True)
        except httpx.HTTPError as exc:
            decodes.done(decode, 1)
            return self._peer_failed("decode", decode, exc)
        if upstream.status_code != 200:
            content = await upstream.aread()
            await upstream.aclose()
            decodes.done(decode, 1)
            self.requests.labels(outcome=str(upstream.status_code)).inc()
            return Response(content, upstream.status_code, media_type="application/json")

        async def events():
            first = True
            try:
                async for piece in upstream.aiter_raw():
                    if first:
                        self.ttft.observe(time.perf_counter() - arrival)
                        first = False
                    yield piece
                self.requests.labels(outcome="200").inc()
            except httpx.HTTPError as exc:
                self.requests.labels(outcome="peer_failed").inc()
                message = f"the decode instance at {decode} failed mid-stream ({type(exc).__name__}: {exc})"
                yield f"data: {json.dumps(protocol.error_body(message, 502))}\n\n".encode()
            finally:
                await upstream.aclose()
                decodes.done(decode, 1)

        return StreamingResponse(events(), media_type="text/event-stream")

    def _peer_failed(self, role: str, url: str, exc: Exception) -> Response:
        status = 504 if isinstance(exc, httpx.TimeoutException) else 502
        return self._fail(f"the {role} instance at {url} failed ({type(exc).__name__}: {exc})", status)

    def _fail(self, message: str, status: int) -> Response:
        self.requests.labels(outcome=str(status)).inc()
        return JSONResponse(protocol.error_body(message, status), status_code=status)


class _PoolCollector:
    def __init__(self, pools: dict[str, Pool]):
        self.pools = pools

    def collect(self):
        family = GaugeMetricFamily("nanomm_router_outstanding_work", "work each instance holds now: visual tokens "
                                   "(encoder, prefill) or sequences (decode)", labels=["role", "url"])
        for role, pool in self.pools.items():
            for url, work in pool.outstanding.items():
                family.add_metric([role, url], work)
        yield family
