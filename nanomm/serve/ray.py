"""nanomm on Ray Serve: each role a deployment, the router the ingress, each pool autoscaled on its own load.

    pip install -e ".[ray]"
    serve run nanomm.serve.ray:app topology=1e1p1d demo=trained            # the demo model, split three ways
    serve run nanomm.serve.ray:app topology=1e1p1d emulate=h200:qwen2-vl-2b policy=load max_replicas=4
    serve deploy scripts/ray_serve.yaml                                     # the same, from a config file

Lesson: lessons/15-scaling-each-pool.md. The processes-and-router path (nanomm-serve --role ..., lesson 13)
stays as it is; this module is the same instances under an orchestrator, and nothing else imports it.

The application (`app(args)`, Ray's application-builder convention, so `key=value` on `serve run` or `args:`
in the YAML) takes `AppSpec`'s arguments (app_spec.py); `topology=` is the one grammar (nanomm/topology.py),
its counts each pool's first replicas:

- `topology=integrated` or `dp<N>`: one pool of whole engines behind the router.
- `topology=<X>e<Y>p<Z>d` (e.g. `1e1p1d`): an encoder pool, a prefill pool and a decode pool. The router sends
  each request to a prefill replica; that replica leases an encoder replica for the request (a streamed Ray call that stays open,
  so Ray counts it as that encoder's ongoing request) and runs the prompt there; the router then sends the
  handoff to a decode replica, which pulls the KV from the prefill replica and streams the answer.

Each replica is one ordinary nanomm instance (the Starlette app of `nanomm-serve --role ROLE`, made by the
command's own `build_server`, cli.py) served on its own port: the visual tokens and the KV move between replicas
through the existing connectors (transfer.py), not through Ray's object store. Ray carries the requests: it places,
restarts and drains replicas, counts each one's ongoing requests, and routes each call to the replica of the pool
that holds the least outstanding work (`LeastWorkRouter`, a Ray request router): visual tokens for encoders and
prefill instances, running sequences for decode instances. With `routing=affinity` (not the default) the integrated
and prefill pools route by `CacheAffinityRouter` instead: a call goes to the replica its prompt's prefix and
pictures were sent to before, unless that replica holds more than `affinity_slack` prompt tokens beyond the least
loaded one (serve/affinity.py, the policy lesson 13's router runs too).

Each replica reports its load to Ray (`record_autoscaling_stats`, from a `LoadWindow`), and `policy=` picks
how each pool's replica count follows it (serve/autoscaling.py): Ray's `default` (ongoing requests), `load`
(visual tokens per second per encoder and prefill replica, running sequences per decode replica, against one
replica's capacity from the cost model) or `slo` (each pool's first-answer p95 against its share of the TTFT
target).

Failures: a replica that dies mid-request gives the client a 502, or an error event inside a stream, never a
hang; Ray restarts it, and a prefill replica frees the KV of a handoff no decode replica took (its own timeout).
Bad arguments (an unknown topology or policy, a model that is not there) raise before any replica starts.
"""

import asyncio
import json
import time
from dataclasses import asdict

import httpx
import ray
from ray import serve
from ray.exceptions import RayError
from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import FIFOMixin, RequestRouter
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from nanomm.serve import protocol
from nanomm.serve.affinity import DEFAULT_SLACK, CacheAffinity, prompt_keys
from nanomm.serve.app_spec import AppSpec
from nanomm.serve.autoscaling import SLO_SHARES, LoadWindow
from nanomm.serve.cli import build_server
from nanomm.serve.router import Router, continuation_fields, estimated_visual_tokens
from nanomm.serve.router_pools import estimated_prompt_tokens, picture_tokens

ROUTER_MAX_ONGOING_REQUESTS = 4096  # the router only waits on its pools: it holds every request in flight


# -- one replica: a nanomm instance on its own port ---------------------------------------------------------------

class Instance:
    """One nanomm instance as a Ray Serve replica. Ray calls `answer`, `stream` or `lease`; the replica passes
    the request to its own HTTP server and keeps its LoadWindow."""

    def __init__(self, role: str, spec: dict, encoder=None):
        from nanomm.serve.testing import BackgroundServer

        self.role, self.spec = role, AppSpec(**spec)
        self.encoder = encoder  # epd prefill: a handle to the encoder pool
        self.window = LoadWindow(self.spec.window_s)
        self.server = build_server(role, self.spec.instance(role))
        host = self.spec.host if self.spec.host != "node" else ray.util.get_node_ip_address()
        served = TimedEncodes(self.server, self.window) if role == "encoder" else self.server
        self.http = BackgroundServer(served, host)
        self.url = self.http.__enter__()
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(self.spec.peer_timeout_s, connect=5.0))

    def __del__(self):  # Ray stops a replica (scaled down, or the app deleted): its port closes with it
        if hasattr(self, "http"):
            self.http.__exit__()

    def record_autoscaling_stats(self) -> dict[str, float]:
        return self.window.report(time.monotonic())

    async def where(self) -> str:
        return self.url

    async def lease(self, work: float):
        """An encoder, held for one request: yields this replica's URL, then stays open until the caller
        closes it (Ray counts it as an ongoing request all along)."""
        self.window.arrive(time.monotonic(), work)
        try:
            yield self.url
            while True:
                await asyncio.sleep(3600)
        finally:
            self.window.leave()

    async def answer(self, path: str, body: dict, work: float, affinity=None) -> tuple[int, bytes, str]:
        """A whole answer: (HTTP status, body, this replica's URL)."""
        arrival = time.monotonic()
        self.window.arrive(arrival, work)
        lease = None
        try:
            if self.encoder is not None:
                lease, body = await self._with_encoder(body, work)
            reply = await self.client.post(self.url + path, json=body)
            self.window.first_answer(time.monotonic(), time.monotonic() - arrival)
            return reply.status_code, reply.content, self.url
        finally:
            if lease is not None:
                lease.cancel()
            self.window.leave()

    async def stream(self, path: str, body: dict, work: float, affinity=None):
        """A streamed answer: first the HTTP status, then the body's pieces as they come."""
        arrival = time.monotonic()
        self.window.arrive(arrival, work)
        upstream = None
        try:
            request = self.client.build_request("POST", self.url + path, json=body)
            upstream = await self.client.send(request, stream=True)
            yield upstream.status_code
            first = True
            async for piece in upstream.aiter_raw():
                if first:
                    self.window.first_answer(time.monotonic(), time.monotonic() - arrival)
                    first = False
                yield piece
        finally:  # also when the caller goes away mid-stream: the local stream closes, its request aborts
            if upstream is not None:
                await upstream.aclose()
            self.window.leave()

    async def _with_encoder(self, body: dict, work: float):
        lease = self.encoder.options(stream=True).lease.remote(work=work)
        encoder_url = await lease.__anext__()
        self.server.allow_encoder(encoder_url)
        params = {**body["kv_transfer_params"], "encoder_url": encoder_url}
        return lease, {**body, "kv_transfer_params": params}


class TimedEncodes:
    """An encoder service's app whose POST /v1/encode times go into the replica's window as its first answers
    (the encode, the wait for the one tower included): the latency the encoder pool itself causes."""

    def __init__(self, server, window: LoadWindow):
        self.inner, self.window = server.app, window
        self.app = self  # what BackgroundServer serves

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] != "/v1/encode":
            return await self.inner(scope, receive, send)
        start = time.monotonic()
        try:
            await self.inner(scope, receive, send)
        finally:
            self.window.first_answer(time.monotonic(), time.monotonic() - start)


# -- routing within a pool: the least outstanding work -----------------------------------------------------------

class LeastWorkRouter(FIFOMixin, RequestRouter):
    """Ray's request router for nanomm's pools: each call goes to the replica holding the least outstanding work,
    the `work=` the call names (visual tokens for an encoder or prefill replica, 1 for a decode replica's sequence),
    counted from routing to completion, the first of equals first. As lesson 13's router does; each caller (a
    handle) counts the calls it made itself: the router for the prefill and decode pools, each prefill replica for
    the leases it took."""

    def initialize_state(self, **kwargs):
        self.outstanding: dict = {}  # replica id -> work
        self.charged: dict = {}  # request id -> (replica id, work)

    async def choose_replicas(self, candidate_replicas: list, pending_request=None) -> list[list]:
        ranked = sorted(candidate_replicas, key=lambda replica: self.outstanding.get(replica.replica_id, 0.0))
        return [[replica] for replica in ranked]  # the least loaded first, then the others in order

    def on_request_routed(self, pending_request, replica_id, result) -> None:
        work = float(pending_request.kwargs.get("work", 1.0))
        self.charged[pending_request.metadata.internal_request_id] = (replica_id, work)
        self.outstanding[replica_id] = self.outstanding.get(replica_id, 0.0) + work

    def on_request_completed(self, replica_id, internal_request_id: str) -> None:
        replica, work = self.charged.pop(internal_request_id, (replica_id, 0.0))
        self.outstanding[replica] = self.outstanding.get(replica, 0.0) - work

    def on_replica_actor_died(self, replica_id) -> None:
        super().on_replica_actor_died(replica_id)
        self.outstanding.pop(replica_id, None)


class CacheAffinityRouter(LeastWorkRouter):
    """LeastWorkRouter, with serve/affinity.py's policy in front: a call that names `affinity=(keys, tokens)` goes
    first to the replica its keys were sent to, unless that replica holds more than `slack` prompt tokens beyond
    the least loaded one (each replica's tokens counted here, from routing to completion); the others follow in
    the load order. The keys are remembered at `on_request_routed`, for the replica Ray actually sent them to."""

    def initialize_state(self, slack: float = DEFAULT_SLACK, **kwargs):
        super().initialize_state()
        self.policy = CacheAffinity(slack)
        self.tokens: dict = {}  # replica id -> prompt tokens
        self.charged_tokens: dict = {}  # request id -> (replica id, tokens)

    async def choose_replicas(self, candidate_replicas: list, pending_request=None) -> list[list]:
        ranked = await super().choose_replicas(candidate_replicas, pending_request)
        affinity = pending_request.kwargs.get("affinity") if pending_request is not None else None
        if not affinity or not ranked:
            return ranked
        outstanding = {replica.replica_id: self.tokens.get(replica.replica_id, 0.0) for replica in candidate_replicas}
        chosen, _ = self.policy.choose(affinity[0], outstanding, ranked[0][0].replica_id)
        return sorted(ranked, key=lambda rank: rank[0].replica_id != chosen)  # stable: the load order after it

    def on_request_routed(self, pending_request, replica_id, result) -> None:
        super().on_request_routed(pending_request, replica_id, result)
        affinity = pending_request.kwargs.get("affinity")
        if affinity:
            keys, tokens = affinity
            self.policy.map.record(keys, replica_id)
            self.charged_tokens[pending_request.metadata.internal_request_id] = (replica_id, tokens)
            self.tokens[replica_id] = self.tokens.get(replica_id, 0.0) + tokens

    def on_request_completed(self, replica_id, internal_request_id: str) -> None:
        super().on_request_completed(replica_id, internal_request_id)
        replica, tokens = self.charged_tokens.pop(internal_request_id, (replica_id, 0.0))
        self.tokens[replica] = self.tokens.get(replica, 0.0) - tokens

    def on_replica_actor_died(self, replica_id) -> None:
        super().on_replica_actor_died(replica_id)
        self.tokens.pop(replica_id, None)
        self.policy.map.forget(replica_id)


# -- the ingress: the router over deployment handles -----------------------------------------------------------

class RayRouter(Router):
    """lesson 13's router, over Ray deployment handles instead of URLs (same OpenAI API, same errors)."""

    def __init__(self, topology: str, pools: dict, model_name: str, peer_timeout_s: float,
                 routing: str = "load"):
        super().__init__([], [], [], peer_timeout_s, routing="load")  # Ray's request routers pick, not the pools
        self.topology, self.handles, self.model_name = topology, pools, model_name
        self.with_affinity = routing == "affinity"
        self.split = "prefill" in pools  # <X>e<Y>p<Z>d: prefill, then decode; dp<N>: integrated engines
        self.last_pool = "decode" if self.split else "integrated"

    async def __call__(self, request: Request) -> Response:
        path = request.url.path
        if request.method == "POST" and path in ("/v1/chat/completions", "/v1/completions"):
            return await self.route(request)
        pages = {"/v1/models": self.models, "/health": self.health, "/metrics": self.scrape}
        if path in pages:
            return await pages[path](request)
        return self._fail(f"no route {request.method} {path}", 404)

    async def route(self, request: Request) -> Response:
        arrival = time.perf_counter()
        body = await self._read_body(request)
        if isinstance(body, Response):
            return body
        path = request.url.path
        if self.split:
            handoff = await self._prefill(path, body)
            if isinstance(handoff, Response):
                return handoff
            body = {**continuation_fields(body), "kv_transfer_params": handoff}
        if body.get("stream"):
            return await self._stream_from_decode(path, body, arrival)
        return await self._answer_from_decode(path, body, arrival)

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", "role": "router", "topology": self.topology,
                             "pools": sorted(self.handles)})

    async def models(self, request: Request) -> Response:
        model = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "nanomm"}
        return JSONResponse({"object": "list", "data": [model]})

    async def _prefill(self, path: str, body: dict):
        request = {**body, "stream": False, "kv_transfer_params": {"do_remote_decode": True}}
        try:
            status, content, prefill_url = await self.handles["prefill"].answer.remote(
                path, request, work=estimated_visual_tokens(body), **self._affinity(body))
        except RayError as exc:
            return self._fail(f"a prefill replica failed ({type(exc).__name__})", 502)
        if status != 200:
            self.requests.labels(outcome=str(status)).inc()
            return Response(content, status, media_type="application/json")
        handoff = json.loads(content)["kv_transfer_params"]
        handoff["remote_url"] = prefill_url
        return handoff

    def _affinity(self, body: dict) -> dict:
        """The keyword that CacheAffinityRouter reads (the prompt's keys and tokens), for a call that runs the
        prompt; nothing with routing=load."""
        if not self.with_affinity or "kv_transfer_params" in body and self.split:
            return {}
        return {"affinity": (prompt_keys(body, picture_tokens), estimated_prompt_tokens(body))}

    async def _answer_from_decode(self, path: str, body: dict, arrival: float) -> Response:
        try:
            status, content, _ = await self.handles[self.last_pool].answer.remote(path, body, work=1,
                                                                                  **self._affinity(body))
        except RayError as exc:
            return self._fail(f"a {self.last_pool} replica failed ({type(exc).__name__})", 502)
        self.requests.labels(outcome=str(status)).inc()
        if status == 200:
            self.ttft.observe(time.perf_counter() - arrival)
        return Response(content, status, media_type="application/json")

    async def _stream_from_decode(self, path: str, body: dict, arrival: float) -> Response:
        upstream = self.handles[self.last_pool].options(stream=True).stream.remote(path, body, work=1,
                                                                                 **self._affinity(body))
        try:
            status = await upstream.__anext__()
            if status != 200:
                content = b"".join([piece async for piece in upstream])
                self.requests.labels(outcome=str(status)).inc()
                return Response(content, status, media_type="application/json")
        except (RayError, StopAsyncIteration) as exc:
            return self._fail(f"a {self.last_pool} replica failed ({type(exc).__name__})", 502)

        async def events():
            first = True
            try:
                async for piece in upstream:
                    if first:
                        self.ttft.observe(time.perf_counter() - arrival)
                        first = False
                    yield piece
                self.requests.labels(outcome="200").inc()
            except RayError as exc:
                self.requests.labels(outcome="peer_failed").inc()
                message = f"a {self.last_pool} replica failed mid-stream ({type(exc).__name__})"
                yield f"data: {json.dumps(protocol.error_body(message, 502))}\n\n".encode()

        return StreamingResponse(events(), media_type="text/event-stream")


# -- the application -------------------------------------------------------------------------------------------

def autoscaling_config(role: str, spec: AppSpec) -> dict:
    """Ray's AutoscalingConfig for one pool under spec.policy."""
    config = {"min_replicas": spec.min_replicas, "max_replicas": spec.max_replicas,
              "initial_replicas": spec.initial_replicas_of(role),
              "upscale_delay_s": spec.upscale_delay_s, "downscale_delay_s": spec.downscale_delay_s,
              "metrics_interval_s": spec.metrics_interval_s, "look_back_period_s": spec.look_back_period_s,
              "target_ongoing_requests": spec.target_ongoing_requests}
    if spec.policy == "load":
        config["policy"] = {"policy_function": "nanomm.serve.autoscaling:LoadPolicy",
                            "policy_kwargs": {"role": role, "capacity": spec.capacity(role),
                                              "utilization": spec.utilization}}
    elif spec.policy == "slo":
        config["policy"] = {"policy_function": "nanomm.serve.autoscaling:SLOPolicy",
                            "policy_kwargs": {"target_s": SLO_SHARES[role] * spec.ttft_slo_s}}
    return config


def build(spec: AppSpec):
    """The Ray Serve application for a checked spec."""
    resources = {"num_cpus": spec.num_cpus, "num_gpus": spec.num_gpus}

    def pool(role: str, *extra):
        affine = spec.routing == "affinity" and role in ("integrated", "prefill")
        routing = RequestRouterConfig(request_router_class=CacheAffinityRouter if affine else LeastWorkRouter,
                                      request_router_kwargs={"slack": spec.affinity_slack} if affine else {})
        deployment = serve.deployment(Instance, name=role, ray_actor_options=resources,
                                      autoscaling_config=autoscaling_config(role, spec),
                                      request_router_config=routing,
                                      max_ongoing_requests=max(spec.max_num_seqs, 64), health_check_period_s=2,
                                      graceful_shutdown_timeout_s=spec.peer_timeout_s)
        return deployment.bind(role, asdict(spec), *extra)

    handles = {}
    if spec.split:
        handles["prefill"] = pool("prefill", pool("encoder"))
        handles["decode"] = pool("decode")
    else:
        handles["integrated"] = pool("integrated")
    # Ray's default of 5 requests at a time would queue every request past the fifth in front of the router
    router = serve.deployment(RayRouter, name="router", ray_actor_options={"num_cpus": 0},
                              max_ongoing_requests=ROUTER_MAX_ONGOING_REQUESTS)
    return router.bind(spec.topology, handles, spec.name, spec.peer_timeout_s, spec.routing)


def app(args: dict):
    """`serve run nanomm.serve.ray:app key=value ...` (and a YAML's `args:`): checked before any replica starts."""
    return build(AppSpec.from_args(dict(args)))
