"""Load nanomm-serve the way its users do: Poisson arrivals, a mix of image sizes and counts, streaming clients.

    nanomm-bench load --mix thumbnails --rate 1 2 4          # starts nanomm-serve on the tiny checkpoint
    nanomm-bench load --mix scans --rate 0.5 1 --num-requests 40 --json scans.json
    nanomm-bench load --url http://127.0.0.1:8000 --model nanomm-demo --mix "1x224x224:3,2x112x112:1"
    nanomm-bench load --demo --topology 1e1p1d --rate 2 --slo-ttft 0.5 --slo-tpot 0.05   # a split engine
    nanomm-bench load --demo --sessions 8 --turns 6 --images-per-turn 1 --think-time 2   # multi-turn chats

Lessons: lessons/11-serving-under-load.md (why requests per second lie, and what to scale on instead),
lessons/13-three-topologies.md (one engine against encoder, prefill and decode instances).

For each request rate: `--num-requests` arrivals with exponential gaps (a Poisson process, seeded), each a
streamed chat request with the images its mix entry says, sent on schedule whether or not the server keeps up
(an open loop: a closed loop, where each client waits for its answer, would hide the queue). Every picture is
new (no encoder-cache hits) and every answer is `--max-tokens` long (ignore_eos). What comes back, per rate:

- TTFT p50/p95/p99 (send -> first streamed token, at the client) and TPOT (the rest of the answer per token);
- goodput: requests per second that met the TTFT SLO (`--slo-ttft`), and with `--slo-tpot` the TPOT SLO too,
  and the share that did;
- visual tokens per second, offered (the rate x the visual tokens per request) and served;
- where the server says TTFT went: the mean of each stage (preprocess, queue, encode, prefill, and a decode
  instance's KV transfer), from /metrics;
- the bytes that moved between instances (visual tokens, KV), read from every instance's /metrics;
- the requests each instance finished (its own nanomm_requests_total): how the router spread the load.

Without `--url` the servers are started here, each as its own process (`python -m nanomm.serve.cli`), so that
the load generator and the engines do not share an interpreter, on free ports of 127.0.0.1; `--topology` says
which, in the one grammar (nanomm/topology.py): `integrated` (one engine); `dp<N>` (N integrated engines behind
the router); `1e1pd` (an encoder service and one engine that runs no vision tower, which takes the load itself);
`<X>e<Y>pd` (X encoders and Y such engines behind the router, engine i started with encoder i mod X, so X <= Y);
`<X>e<Y>p<Z>d` (X encoders, Y prefill instances and Z decode instances behind the router, which picks the
encoder of each request). The router sends each request to its pool's least loaded instance (serve/router.py).
Each process is named by its role, numbered where a pool has several (`integrated 2`, `lm 1`, `prefill 2`): the
per-process figures (CPU, bytes moved, requests finished) use those names. All of them are stopped at the end.
Not a test: the smallest runs are in tests/test_scripts.py, and nothing asserts a
timing. The JSON holds every request as the client saw it (`records`), so a run can be replayed elsewhere
(the simulator in lesson 13 replays them).

`--sessions N` runs a different load instead of the sweep: N multi-turn chats at once, each a closed loop of
`--turns` requests. Turn t sends the whole conversation so far (every earlier user message with its pictures,
each followed by the answer the server actually gave) and a new user message: `--images-per-turn` new pictures
of `--image-size` and a short question, all drawn from --seed, the session and the turn. The next turn goes out
once the answer is in and a think time has passed: exponential, of mean `--think-time` seconds (seeded by --seed
and the session; the first turn of every session is sent at once). `--old-image-policy` and
`--keep-last-images` go to the server in every request's mm_processor_kwargs. What comes back:

- per turn: TTFT (mean, p50), the prompt's tokens, visual tokens and prefix-cache hits (usage's cached_tokens,
  and their share of the prompt), and the pictures the encoder cache held (usage's encoder_cache_hits);
- per session: its peak tokens (the largest prompt + completion of its turns: the KV it holds at its end), its
  KV bytes (x the KV bytes per token) and how many sessions that size the KV budget holds at once (the budget
  in tokens // the peak; whole blocks and the engine's own overheads left aside). KV bytes per token come from
  the checkpoint's config.json for a server started here (the engine's formula, at its dtype) or from
  `--kv-bytes-per-token`; the budget from the server's /metrics (KV blocks x block size) or `--kv-budget-tokens`.
"""

import argparse
import asyncio
import base64
import io
import json
import os
import random
import shlex
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp
import httpx
import torch
from PIL import Image

from nanomm.bench.cli import topology_arg
from nanomm.bench.machine import machine_info
from nanomm.bench.requests import WORDS, load_checkpoint, random_image
from nanomm.engine.config import EngineConfig
from nanomm.engine.sizing import kv_bytes_per_token
from nanomm.errors import InvalidInputError
from nanomm.inputs.old_images import check_keep_last_images, parse_old_image_policy
from nanomm.model.config import ModelConfig
from nanomm.model.loader import resolve_dtype
from nanomm.serve.metrics import TTFT_STAGES  # (preprocess, queue, encode, prefill)
from nanomm.serve.testing import free_local_port
from nanomm.serve.top import Snapshot, parse_metrics
from nanomm.sim.stats import percentile
from nanomm.topology import parse_topology
from nanomm.sim.workload import MIXES, MixEntry, parse_mix


@dataclass
class RequestRecord:
    """One request as the client saw it. Times are seconds since the run's start."""
    sent_at: float
    num_images: int
    first_token_at: float | None = None
    finished_at: float | None = None
    prompt_tokens: int = 0
    visual_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None
    cached_tokens: int = 0  # prompt positions the server's prefix cache held
    encoder_cache_hits: int = 0  # pictures the server's encoder cache held (usage.encoder_cache_hits, nanomm's)
    body_bytes: int = 0  # the request's JSON body
    phase: str = ""  # a trace's phase (--trace)

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.sent_at

    @property
    def tpot_s(self) -> float | None:
        if self.finished_at is None or self.first_token_at is None or self.completion_tokens < 2:
            return None
        return (self.finished_at - self.first_token_at) / (self.completion_tokens - 1)


def poisson_arrivals(rate: float, count: int, rng: random.Random) -> list[float]:
    """Send times (s) of `count` requests arriving at `rate` per second: exponential gaps, the first at 0."""
    times, now = [], 0.0
    for _ in range(count):
        times.append(now)
        now += rng.expovariate(rate)
    return times


def smooth_image(width: int, height: int, seed: int) -> Image.Image:
    """Random colours 32 pixels apart, blended between: every picture new, its JPEG the size of a photo's
    (about 0.13 bytes a pixel at quality 90, where noise takes 0.9)."""
    rng = random.Random(seed)
    small = (max(1, width // 32), max(1, height // 32))
    coarse = Image.frombytes("RGB", small, rng.randbytes(small[0] * small[1] * 3))
    return coarse.resize((width, height), Image.BILINEAR)


PICTURES = {"noise": random_image, "smooth": smooth_image}  # --pictures: what each picture is made of


def image_data_url(width: int, height: int, seed: int, kind: str = "JPEG", pictures: str = "noise") -> str:
    """A new random picture as a data URL: JPEG (quality 90) or PNG, of noise or smooth."""
    buffer = io.BytesIO()
    PICTURES[pictures](width, height, seed).save(buffer, kind, **({"quality": 90} if kind == "JPEG" else {}))
    return f"data:image/{kind.lower()};base64," + base64.b64encode(buffer.getvalue()).decode()


def request_body(entry: MixEntry, rng: random.Random, model: str, max_tokens: int, pictures: str = "noise") -> dict:
    """A streamed chat request: the entry's images (new pictures) and a short question of random words."""
    images = [{"type": "image_url", "image_url": {"url": image_data_url(
        entry.width, entry.height, rng.randrange(2**31), pictures=pictures)}} for _ in range(entry.num_images)]
    question = " ".join(rng.choice(WORDS) for _ in range(12))
    return {"model": model, "stream": True, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0,
            "messages": [{"role": "user", "content": [*images, {"type": "text", "text": question}]}]}


def client_session(url: str, timeout_s: float) -> aiohttp.ClientSession:
    """The load generator's HTTP client: a fresh connection per request, as from independent users (a kept-alive
    connection that the server closes for idleness just as a request goes out on it would fail that request).
    aiohttp, whose C parser reads a stream for about a third of httpx's CPU, which the run would otherwise count
    against the host."""
    return aiohttp.ClientSession(url, connector=aiohttp.TCPConnector(limit=0, force_close=True),
                                 timeout=aiohttp.ClientTimeout(total=timeout_s))


async def send_one(http: aiohttp.ClientSession, body: bytes, record: RequestRecord, clock,
                   texts: list[str] | None = None) -> None:
    """Send a JSON body at record.sent_at, read the stream to [DONE]; fill in when each part arrived, or the error.
    texts: if given, each streamed piece of the (first) answer's text is appended to it."""
    await asyncio.sleep(max(0.0, record.sent_at - clock()))
    record.sent_at = clock()  # the actual send time (the event loop may be a little late)
    try:
        async with http.post("/v1/chat/completions", data=body,
                             headers={"content-type": "application/json"}) as answer:
            if answer.status != 200:
                record.error = f"HTTP {answer.status}: {(await answer.read()).decode()[:200]}"
                return
            buffer = b""
            async for piece in answer.content.iter_any():
                *events, buffer = (buffer + piece).split(b"\n\n")
                for event in events:
                    if needs_reading(event, record, texts) and not read_event(json.loads(event[6:]), record, clock,
                                                                               texts):
                        return
            record.finished_at = clock()
            if record.first_token_at is None or not record.completion_tokens:
                record.error = "the stream ended without a token or without its usage chunk"
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"


def needs_reading(event: bytes, record: RequestRecord, texts: list[str] | None) -> bool:
    """Whether a server-sent event must be parsed: the first with a token, an error, the usage chunk, or any when
    the text is kept. The others (most of a long answer) are only counted by the server's usage chunk, so the load
    generator's own CPU stays out of the measurement. Inside a JSON string a quote is escaped, so the bare words
    "usage" and "error" in quotes are keys."""
    if not event.startswith(b"data: ") or event == b"data: [DONE]":
        return False
    return texts is not None or record.first_token_at is None or b'"usage"' in event or b'"error"' in event


def read_event(chunk: dict, record: RequestRecord, clock, texts: list[str] | None) -> bool:
    """Take one streamed chunk into the record; False if it was an error (the stream is over)."""
    if "error" in chunk:
        record.error = chunk["error"].get("message", str(chunk))
        return False
    if chunk["choices"] and record.first_token_at is None:
        record.first_token_at = clock()  # a chunk with a choice carries the first token
    if texts is not None:
        texts.extend((c.get("delta") or {}).get("content") or "" for c in chunk["choices"] if not c.get("index"))
    if chunk.get("usage"):
        usage = chunk["usage"]
        record.prompt_tokens, record.completion_tokens = usage["prompt_tokens"], usage["completion_tokens"]
        record.visual_tokens = usage.get("visual_tokens", 0)
        record.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        record.encoder_cache_hits = usage.get("encoder_cache_hits", 0)
    return True


async def run_load(url: str, model: str, mix: list[MixEntry], rate: float, num_requests: int, max_tokens: int,
                   seed: int, content_seed: int, timeout_s: float = 600.0, on_start=None,
                   pictures: str = "noise") -> list[RequestRecord]:
    """Open-loop load: every request is sent on its Poisson schedule, answered or not. `seed` draws the arrival
    gaps (one seed at every rate: the same pattern, squeezed); `content_seed` the mix entries, pictures and
    words. on_start(): called once the bodies are made, as the first request is due (where a CPU count starts)."""
    arrivals = poisson_arrivals(rate, num_requests, random.Random(seed))  # one seed: the same gaps, scaled
    rng = random.Random(content_seed)
    entries = rng.choices(mix, weights=[e.weight for e in mix], k=num_requests)
    schedule = [Arrival(t, e, max_tokens) for t, e in zip(arrivals, entries)]
    return await run_schedule(url, model, schedule, rng, timeout_s, on_start, pictures)


@dataclass(frozen=True)
class Arrival:
    """One request of a schedule: when it is sent, what it carries, how long its answer is."""
    at: float
    entry: MixEntry
    max_tokens: int
    phase: str = ""


async def run_schedule(url: str, model: str, schedule: list[Arrival], rng: random.Random, timeout_s: float = 600.0,
                       on_start=None, pictures: str = "noise") -> list[RequestRecord]:
    """Send each request of the schedule on time, answered or not. Bodies are made first (pictures and words
    from rng), so that encoding pictures on the client does not delay the schedule."""
    bodies = [json.dumps(request_body(a.entry, rng, model, a.max_tokens, pictures)).encode() for a in schedule]
    records = [RequestRecord(a.at, a.entry.num_images, body_bytes=len(b), phase=a.phase)
               for a, b in zip(schedule, bodies)]
    async with client_session(url, timeout_s) as http:
        if on_start is not None:
            on_start()
        start = time.monotonic()

        def clock():
            return time.monotonic() - start

        await asyncio.gather(*(send_one(http, b, r, clock) for b, r in zip(bodies, records)))
    return records


# -- traces: a mix that moves over time (--trace) ---------------------------------------------------------------

@dataclass(frozen=True)
class Phase:
    name: str
    seconds: float
    rate: float  # requests per second, Poisson, at the phase's start ...
    rate_end: float  # ... and at its end, in a straight line between
    mix: str  # parse_mix's form
    max_tokens: int  # every answer's length (ignore_eos)

    def rate_at(self, t: float) -> float:
        return self.rate + (self.rate_end - self.rate) * t / self.seconds


TRACES = {
    # A day in three acts, each ramping up: chat with no pictures; image-heavy pages (one 1400 x 1400 picture
    # each: 2,500 visual tokens on Qwen2-VL's and Qwen2.5-VL's 28-pixel tokens); long answers about a thumbnail.
    "day": (Phase("chat", 60, 0.5, 1.0, "0x28x28:1", 32), Phase("pages", 90, 1.0, 4.0, "1x1400x1400:1", 16),
            Phase("long answers", 90, 0.5, 1.5, "1x224x224:1", 256)),
}


def trace_schedule(trace: tuple[Phase, ...], seed: int) -> list[Arrival]:
    """Each phase's arrivals, one phase after the other: a Poisson process whose rate moves in a straight line
    (drawn at the phase's highest rate, each arrival kept with probability rate now / highest)."""
    rng, schedule, start = random.Random(seed), [], 0.0
    for phase in trace:
        mix, peak = parse_mix(phase.mix), max(phase.rate, phase.rate_end)
        t = rng.expovariate(peak)
        while t < phase.seconds:
            if rng.random() < phase.rate_at(t) / peak:
                entry = rng.choices(mix, weights=[e.weight for e in mix])[0]
                schedule.append(Arrival(start + t, entry, phase.max_tokens, phase.name))
            t += rng.expovariate(peak)
        start += phase.seconds
    return schedule


def summarize(records: list[RequestRecord], rate: float, slo_ttft_s: float, slo_tpot_s: float | None = None) -> dict:
    """The run's figures. Duration: from the first send to the last answer (or the last send, if later). A good
    request met the TTFT SLO, and the TPOT SLO too when one is given (a one-token answer has no TPOT: it meets it)."""
    done = [r for r in records if r.error is None and r.finished_at is not None]
    ends = [r.finished_at for r in done] + [r.sent_at for r in records]
    duration = max(ends) - min(r.sent_at for r in records)
    ttfts = [r.ttft_s for r in done]
    tpots = [r.tpot_s for r in done if r.tpot_s is not None]
    visual = sum(r.visual_tokens for r in done)
    within_slo = sum(r.ttft_s <= slo_ttft_s and (slo_tpot_s is None or r.tpot_s is None or r.tpot_s <= slo_tpot_s)
                     for r in done)
    mean_visual = visual / len(done) if done else 0.0
    sends = sorted(r.sent_at for r in records)
    span = sends[-1] - sends[0]
    arrival_rate = (len(sends) - 1) / span if span > 0 else rate  # what the Poisson draw actually sent
    return {
        "rate": rate, "arrival_rate": arrival_rate, "requests": len(records), "completed": len(done),
        "errors": len(records) - len(done),
        "first_errors": [r.error for r in records if r.error][:3], "duration_s": duration, "arrival_span_s": span,
        "throughput_rps": len(done) / duration if duration else 0.0,
        "ttft_s": {f"p{q}": percentile(ttfts, q) for q in (50, 95, 99)},
        "tpot_s": {f"p{q}": percentile(tpots, q) for q in (50, 95)},
        "slo_ttft_s": slo_ttft_s, "slo_tpot_s": slo_tpot_s, "within_slo": within_slo,
        "slo_attainment": within_slo / len(records),
        "goodput_rps": within_slo / duration if duration else 0.0,
        "visual_tokens": visual, "visual_tokens_per_request": mean_visual,
        "offered_visual_tokens_per_s": arrival_rate * mean_visual,
        "served_visual_tokens_per_s": visual / duration if duration else 0.0,
        "completion_tokens": sum(r.completion_tokens for r in done),
    }


def read_metrics(url: str) -> Snapshot:
    """An instance's /metrics, parsed as nanomm-top parses it (nanomm/serve/top.py)."""
    return parse_metrics(url, httpx.get(url + "/metrics", timeout=30).text, time.monotonic())


def scrape(url: str) -> dict[str, float]:
    """Every unlabelled sample of the server's /metrics, by name (a histogram's _sum and _count among them)."""
    return {name: by_labels[()] for name, by_labels in read_metrics(url).samples.items() if () in by_labels}


TRANSFER_METRICS = {"kv": "nanomm_kv_transfer_bytes_total", "visual": "nanomm_visual_token_transfer_bytes_total"}


def transfer_bytes(url: str) -> dict[str, float]:
    """{"kv sent": bytes, "visual received": ...}: an instance's transfer counters (the ones it has)."""
    samples, moved = read_metrics(url).samples, {}
    for what, metric in TRANSFER_METRICS.items():
        for labels, value in samples.get(metric, {}).items():
            if "direction" in dict(labels):
                moved[f"{what} {dict(labels)['direction']}"] = value
    return moved


def transfer_delta(urls: dict[str, str], before: dict[str, dict]) -> dict[str, dict[str, float]]:
    """Each role's bytes moved since `before` (that role's transfer_bytes then); roles that moved none are left out."""
    out = {}
    for role, url in urls.items():
        after = transfer_bytes(url)
        moved = {k: v - before.get(role, {}).get(k, 0.0) for k, v in after.items()}
        if any(moved.values()):
            out[role] = {k: v for k, v in moved.items() if v}
    return out


def ttft_stage_sums(url: str) -> dict[str, tuple[float, float]]:
    """{stage: (sum of seconds, count)} of the server's TTFT histograms ({} from a server without them)."""
    names = {stage: f"nanomm_ttft_{stage}_seconds" for stage in TTFT_STAGES}
    names["ttft"] = "nanomm_time_to_first_token_seconds"
    samples = scrape(url)
    return {stage: (samples[f"{name}_sum"], samples[f"{name}_count"])
            for stage, name in names.items() if f"{name}_sum" in samples}


def ttft_stage_sums_of(urls: list[str]) -> dict[str, tuple[float, float]]:
    """ttft_stage_sums added up over several instances (a pool that finishes requests: every engine of dp<N>)."""
    sums = {}
    for url in urls:
        for stage, (total, count) in ttft_stage_sums(url).items():
            total_before, count_before = sums.get(stage, (0.0, 0.0))
            sums[stage] = (total_before + total, count_before + count)
    return sums


FINISHED_METRIC = "nanomm_requests_total"


def finished_requests(urls: dict[str, str]) -> dict[str, float]:
    """Each instance's finished requests so far, by its own count (nanomm_requests_total, every finish reason; a
    prefill instance's handoffs too); instances without that counter (encoders, the router) are left out."""
    finished = {}
    for role, url in urls.items():
        samples = read_metrics(url).samples
        if FINISHED_METRIC in samples:
            finished[role] = sum(samples[FINISHED_METRIC].values())
    return finished


def finishing_urls(started: dict[str, tuple], front_url: str) -> list[str]:
    """The instances that finish requests, whose /metrics time the TTFT stages: the decode instances if there are
    any, else the engines (all but encoders and the router); `front_url` for a server not started here."""
    kinds = {name: name.split()[0] for name in started}
    decodes = [url for name, (_, url) in started.items() if kinds[name] == "decode"]
    engines = [url for name, (_, url) in started.items() if kinds[name] not in ("encoder", "router")]
    return decodes or engines or [front_url]


def mean_stages(before: dict, after: dict) -> dict[str, float]:
    """The mean of each TTFT stage over the requests that finished between two /metrics reads."""
    means = {}
    for stage, (total, count) in after.items():
        total_before, count_before = before.get(stage, (0.0, 0.0))
        means[stage] = (total - total_before) / (count - count_before) if count > count_before else None
    return means


# -- multi-turn chat sessions (--sessions) ---------------------------------------------------------------------

@dataclass(frozen=True)
class SessionPlan:
    """What each of `sessions` concurrent chats does: `turns` questions, each with `images_per_turn` new pictures
    of `image_size` (width, height), asked after the previous answer and a pause (think time) drawn from an
    exponential distribution of mean `think_time_s` (0: none). mm_processor_kwargs: sent with every request."""
    sessions: int
    turns: int
    images_per_turn: int
    think_time_s: float = 0.0
    image_size: tuple[int, int] = (448, 448)
    max_tokens: int = 32
    pictures: str = "noise"
    seed: int = 0
    mm_processor_kwargs: dict | None = None


@dataclass(frozen=True)
class UserTurn:
    """One user message of a session: its new pictures (data URLs) and its question."""
    images: tuple[str, ...]
    question: str


@dataclass
class TurnRecord(RequestRecord):
    """One turn of a session as the client saw it: RequestRecord's fields (num_images: every picture of the
    conversation so far, all of which the request carries), which turn it was, and the answer sent back after."""
    session: int = 0
    turn: int = 0  # 1, 2, ...
    answer: str = ""


def seeded(what: str, plan: SessionPlan, session: int, turn: int = 0) -> random.Random:
    """A generator of its own for each (purpose, seed, session, turn): every draw deterministic, none shared."""
    return random.Random(f"{what} {plan.seed} {session} {turn}")  # a str seed: hashed the same on every run


def user_turn(plan: SessionPlan, session: int, turn: int) -> UserTurn:
    """Turn `turn`'s user message in session `session`: new pictures and a question of eight random words."""
    rng = seeded("turn", plan, session, turn)
    width, height = plan.image_size
    images = tuple(image_data_url(width, height, rng.randrange(2**31), pictures=plan.pictures)
                   for _ in range(plan.images_per_turn))
    return UserTurn(images, f"Turn {turn}: " + " ".join(rng.choice(WORDS) for _ in range(8)) + "?")


def think_times(plan: SessionPlan, session: int) -> list[float]:
    """The pause before each turn (s): none before the first, then exponential gaps of mean think_time_s."""
    rng = seeded("think", plan, session)
    return [0.0] + [rng.expovariate(1 / plan.think_time_s) if plan.think_time_s > 0 else 0.0
                    for _ in range(plan.turns - 1)]


def user_message(turn: UserTurn) -> dict:
    images = [{"type": "image_url", "image_url": {"url": url}} for url in turn.images]
    return {"role": "user", "content": [*images, {"type": "text", "text": turn.question}]}


def conversation_body(model: str, turns: list[UserTurn], answers: list[str], max_tokens: int,
                      mm_processor_kwargs: dict | None = None) -> dict:
    """The request of the last of `turns`: every user message with its pictures, each earlier one followed by
    its answer (len(answers) == len(turns) - 1) as an assistant message. Streamed, with the usage chunk. Each
    answer ends where the model ends it (no ignore_eos), so that the chat sent back is what the model said."""
    assert len(answers) == len(turns) - 1, "every earlier turn needs its answer"
    messages = []
    for turn, answer in zip(turns, [*answers, None]):
        messages.append(user_message(turn))
        if answer is not None:
            messages.append({"role": "assistant", "content": answer})
    body = {"model": model, "stream": True, "stream_options": {"include_usage": True}, "max_tokens": max_tokens,
            "temperature": 0.0, "messages": messages}
    if mm_processor_kwargs:
        body["mm_processor_kwargs"] = mm_processor_kwargs
    return body


async def run_session(http: aiohttp.ClientSession, model: str, plan: SessionPlan, session: int, turns: list[UserTurn],
                      clock) -> list[TurnRecord]:
    """One chat, a turn at a time: each turn is sent once the previous answer is in and its think time has
    passed. A failed turn ends the session (the next one has no answer to carry)."""
    records, answers = [], []
    for number, (turn, pause) in enumerate(zip(turns, think_times(plan, session)), start=1):  # at most `turns`
        body = conversation_body(model, turns[:number], answers, plan.max_tokens, plan.mm_processor_kwargs)
        encoded = json.dumps(body).encode()
        record = TurnRecord(clock() + pause, number * plan.images_per_turn, body_bytes=len(encoded),
                            session=session, turn=number)
        texts = []
        await send_one(http, encoded, record, clock, texts)
        record.answer = "".join(texts)
        records.append(record)
        if record.error is not None:
            break
        answers.append(record.answer)
    return records


async def run_sessions(url: str, model: str, plan: SessionPlan, timeout_s: float = 600.0) -> list[TurnRecord]:
    """Every session at once, each a closed loop of its own (a user waits for the answer before the next
    question); the pictures are made first. The records, by session, then turn."""
    turns = [[user_turn(plan, s, t) for t in range(1, plan.turns + 1)] for s in range(plan.sessions)]
    async with client_session(url, timeout_s) as http:
        start = time.monotonic()

        def clock():
            return time.monotonic() - start

        sessions = await asyncio.gather(*(run_session(http, model, plan, s, turns[s], clock)
                                          for s in range(plan.sessions)))
    return [record for session in sessions for record in session]


def mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def turn_rows(records: list[TurnRecord], turns: int) -> list[dict]:
    """Per turn, over the sessions whose turn was answered: TTFT, prompt / visual / cached tokens, the share of
    prompt tokens the prefix cache held (cached / prompt, summed), and the encoder-cache hits."""
    rows = []
    for turn in range(1, turns + 1):
        sent = [r for r in records if r.turn == turn]
        done = [r for r in sent if r.error is None]
        prompt = sum(r.prompt_tokens for r in done)
        rows.append({
            "turn": turn, "requests": len(sent), "completed": len(done),
            "ttft_s_mean": mean([r.ttft_s for r in done]), "ttft_s_p50": percentile([r.ttft_s for r in done], 50),
            "prompt_tokens_mean": mean([r.prompt_tokens for r in done]),
            "visual_tokens_mean": mean([r.visual_tokens for r in done]),
            "completion_tokens_mean": mean([r.completion_tokens for r in done]),
            "cached_tokens_mean": mean([r.cached_tokens for r in done]),
            "cached_share": sum(r.cached_tokens for r in done) / prompt if prompt else None,
            "encoder_cache_hits_mean": mean([r.encoder_cache_hits for r in done])})
    return rows


def held_at_once(budget_tokens: int | None, peak_tokens: int | None) -> int | None:
    """Sessions of `peak_tokens` each that the KV budget holds at once: budget // peak."""
    return None if not budget_tokens or not peak_tokens else budget_tokens // peak_tokens


def session_rows(records: list[TurnRecord], sessions: int, kv: dict) -> list[dict]:
    """Per session: its peak tokens (the largest prompt + completion of its answered turns: what its KV holds at
    the end of that turn), their KV bytes, and how many sessions that size the KV budget holds at once."""
    rows = []
    for session in range(sessions):
        done = [r for r in records if r.session == session and r.error is None]
        peak = max((r.prompt_tokens + r.completion_tokens for r in done), default=None)
        per_token = kv["kv_bytes_per_token"]
        rows.append({"session": session, "turns_completed": len(done), "peak_tokens": peak,
                     "kv_bytes": None if peak is None or per_token is None else peak * per_token,
                     "sessions_in_budget": held_at_once(kv["budget_tokens"], peak)})
    return rows


def kv_summary(kv: dict, sessions: list[dict]) -> dict:
    """The KV figures of the run: the budget, and the heaviest session's peak against it."""
    peak = max((s["peak_tokens"] for s in sessions if s["peak_tokens"] is not None), default=None)
    per_token, budget = kv["kv_bytes_per_token"], kv["budget_tokens"]
    return {**kv, "budget_bytes": None if per_token is None or budget is None else budget * per_token,
            "peak_tokens_per_session": peak,
            "kv_bytes_per_session": None if peak is None or per_token is None else peak * per_token,
            "sessions_in_budget": held_at_once(budget, peak)}


def kv_budget_tokens(url: str) -> int | None:
    """The KV pool in tokens: nanomm_kv_blocks_total (from /metrics) x the engine's block size (nanomm-serve
    has no option for it: EngineConfig's default). None from a server without the metric."""
    blocks = scrape(url).get("nanomm_kv_blocks_total")
    return None if blocks is None else int(blocks) * EngineConfig.block_size


def engine_dtype(server_args: list[str]) -> str:
    """The dtype a nanomm-serve given these arguments runs in: its --dtype, else LLM's default (bfloat16 on
    CUDA, float32 on CPU; its device: --device, else CUDA when there is one)."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--dtype"), parser.add_argument("--device")
    known, _ = parser.parse_known_args(server_args)
    device = known.device or ("cuda" if torch.cuda.is_available() else "cpu")
    return known.dtype or ("bfloat16" if torch.device(device).type == "cuda" else "float32")


def kv_bytes_per_token_of(model_args: list[str], server_args: list[str]) -> tuple[int | None, str]:
    """(KV bytes per token, where it came from) of the engine started here with model_args: its checkpoint's
    config.json at the engine's dtype (an --emulate twin: its real model's config, in bfloat16), through the
    engine's own formula (engine/sizing.py). None when there is no local config.json (a hub id)."""
    if model_args[0] == "--emulate":
        from nanomm.emulate import WEIGHT_DTYPE, model_folder, parse_emulate

        folder, dtype = model_folder(parse_emulate(model_args[1])[1]), WEIGHT_DTYPE
    else:
        folder, dtype = Path(model_args[0]), resolve_dtype(engine_dtype(server_args))
    if not (folder / "config.json").is_file():
        return None, f"unknown: no {folder / 'config.json'} here (give --kv-bytes-per-token)"
    text = ModelConfig.from_pretrained(folder).text
    per_token = kv_bytes_per_token(text.num_hidden_layers, text.num_key_value_heads, text.head_dim, dtype)
    return per_token, f"{folder / 'config.json'} in {str(dtype).removeprefix('torch.')}"


def chat_kv(url: str, args, kv_here: tuple[int, str] | None) -> dict:
    """What the KV figures rest on: bytes per token (--kv-bytes-per-token, else kv_here: computed for the engine
    started here) and the budget in tokens (--kv-budget-tokens, else read from the server's /metrics)."""
    per_token, per_token_from = (args.kv_bytes_per_token, "--kv-bytes-per-token") if args.kv_bytes_per_token \
        else (kv_here or (None, "unknown: give --kv-bytes-per-token"))
    budget, budget_from = args.kv_budget_tokens, "--kv-budget-tokens"
    if budget is None:
        budget, budget_from = kv_budget_tokens(url), f"/metrics: nanomm_kv_blocks_total x {EngineConfig.block_size}"
    return {"kv_bytes_per_token": per_token, "kv_bytes_per_token_from": per_token_from,
            "budget_tokens": budget, "budget_tokens_from": budget_from if budget is not None else None}


def session_plan(args) -> SessionPlan:
    """The --sessions options as a SessionPlan."""
    kwargs = {k: v for k, v in (("old_image_policy", args.old_image_policy),
                                ("keep_last_images", args.keep_last_images)) if v is not None}
    return SessionPlan(args.sessions, args.turns, args.images_per_turn, args.think_time, args.image_size,
                       args.max_tokens, args.pictures, args.seed, kwargs or None)


def run_chat(url: str, args, log, stats_url: str | None = None, kv_here: tuple[int, str] | None = None) -> dict:
    """The multi-turn load against `url` after a one-request warm-up: per turn, per session and KV figures
    (stats_url: the instance whose /metrics has the KV pool), records included."""
    plan = session_plan(args)
    width, height = plan.image_size
    asyncio.run(run_load(url, args.model, parse_mix(f"{plan.images_per_turn}x{width}x{height}:1"), rate=1e6,
                         num_requests=1, max_tokens=2, seed=0, content_seed=-1))  # one-off costs paid here
    log(f"{plan.sessions} sessions x {plan.turns} turns, {plan.images_per_turn} new {width}x{height} picture(s) a "
        f"turn, think time {plan.think_time_s:g} s (mean, exponential), mm_processor_kwargs {plan.mm_processor_kwargs}")
    records = asyncio.run(run_sessions(url, args.model, plan))
    kv = chat_kv(stats_url or url, args, kv_here)
    sessions = session_rows(records, plan.sessions, kv)
    errors = [r.error for r in records if r.error]
    return {"plan": asdict(plan), "requests": len(records), "errors": len(errors), "first_errors": errors[:3],
            "turns": turn_rows(records, plan.turns), "sessions": sessions, "kv": kv_summary(kv, sessions),
            "records": [asdict(r) for r in records]}


def chat_markdown(result: dict) -> str:
    """The per-turn and per-session tables, and the KV budget in a sentence."""
    def ms(v):
        return "-" if v is None else f"{v * 1000:,.0f}"

    def num(v, fmt=",.1f"):
        return "-" if v is None else format(v, fmt)

    rows = ["| turn | done | TTFT mean / p50 (ms) | prompt tokens | visual tokens | cached tokens (prefix hits) | "
            "hit share | encoder-cache hits |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for t in result["turns"]:
        rows.append(f"| {t['turn']} | {t['completed']}/{t['requests']} | {ms(t['ttft_s_mean'])} / "
                    f"{ms(t['ttft_s_p50'])} | {num(t['prompt_tokens_mean'])} | {num(t['visual_tokens_mean'])} | "
                    f"{num(t['cached_tokens_mean'])} | {num(t['cached_share'], '.0%')} | "
                    f"{num(t['encoder_cache_hits_mean'], '.2f')} |")
    rows += ["", "| session | turns done | peak tokens (prompt + completion) | KV per session (MiB) | "
             "sessions in the KV budget |", "|---:|---:|---:|---:|---:|"]
    for s in result["sessions"]:
        mib = None if s["kv_bytes"] is None else s["kv_bytes"] / 2**20
        rows.append(f"| {s['session']} | {s['turns_completed']} | {num(s['peak_tokens'], ',')} | {num(mib, ',.2f')} | "
                    f"{num(s['sessions_in_budget'], ',')} |")
    kv = result["kv"]
    budget_mib = None if kv["budget_bytes"] is None else kv["budget_bytes"] / 2**20
    rows += ["", f"KV budget {num(kv['budget_tokens'], ',')} tokens ({kv['budget_tokens_from']}) x "
             f"{num(kv['kv_bytes_per_token'], ',')} bytes per token ({kv['kv_bytes_per_token_from']}) = "
             f"{num(budget_mib, ',.1f')} MiB; the heaviest session peaks at {num(kv['peak_tokens_per_session'], ',')} "
             f"tokens: {num(kv['sessions_in_budget'], ',')} sessions held at once"]
    return "\n".join(rows)


def server_command(port: int, role_args: list[str]) -> list[str]:
    return [sys.executable, "-m", "nanomm.serve.cli", *role_args, "--port", str(port), "--log-level", "warning"]


def startable_topology(name: str) -> str:
    """A topology of the one grammar (nanomm/topology.py) that this tool starts: any but <X>e<Y>pd with more
    encoders than engines (each such engine is started with one encoder, round robin, so encoders past the Y-th
    would serve nobody). For argparse: its canonical name, or an error saying why not."""
    topology = topology_arg(name)
    if topology.shape == "<X>e<Y>pd" and topology.encoders > topology.prefill:
        raise argparse.ArgumentTypeError(
            f"{name!r}: each engine takes its images to one encoder, so of {topology.encoders} encoders at most "
            f"{topology.prefill} would work: ask for {topology.prefill}e{topology.prefill}pd or fewer encoders")
    return topology.name


def instance_commands(role: str, count: int, role_args) -> dict[str, list[str]]:
    """{name: command} of `count` instances of a role on fresh 127.0.0.1 ports, named `role` when alone and
    `role 1`, `role 2` ... otherwise; role_args(i): the i-th instance's nanomm-serve arguments."""
    names = [role] if count == 1 else [f"{role} {i + 1}" for i in range(count)]
    return {name: server_command(free_local_port(), role_args(i)) for i, name in enumerate(names)}


def url_flags(flag: str, commands: dict[str, list[str]]) -> list[str]:
    """`flag URL` for each instance: how a router or a prefill instance is told of a pool."""
    return [arg for command in commands.values() for arg in (flag, url_of(command))]


def topology_commands(topology: str, model_args: list[str], model: str, extra: list[str],
                      peer_timeout_s: float = 600.0) -> tuple[dict[str, list[str]], str]:
    """({name: its nanomm-serve command}, the name of the instance that takes the load) on fresh 127.0.0.1 ports.
    model_args: what names the model to nanomm-serve (a checkpoint folder, or `--emulate GPU:MODEL`). `extra`
    goes to every instance that loads the model (an encoder takes the engine's --max-pixels, so the two agree).
    Names: `integrated`, `encoder`, `lm` (an engine with an encoder service), `prefill`, `decode` and `router`,
    numbered (`integrated 1`, `lm 2`) where a pool has several."""
    shape = parse_topology(startable_topology(topology))
    served = [*model_args, "--served-model-name", model, *extra]

    def router(pool_flags: list[str]) -> dict[str, list[str]]:
        return {"router": server_command(free_local_port(), ["--role", "router", "--peer-timeout",
                                                              str(peer_timeout_s), *pool_flags])}

    if shape.shape == "dp<N>":
        engines = instance_commands("integrated", shape.prefill, lambda i: served)
        if shape.prefill == 1:
            return engines, "integrated"
        return {**engines, **router(url_flags("--engine-url", engines))}, "router"
    encoders = instance_commands("encoder", shape.encoders, lambda i: [*served, "--role", "encoder"])
    encoder_urls = [url_of(command) for command in encoders.values()]
    if shape.shape == "<X>e<Y>pd":  # each engine takes one encoder, round robin
        engines = instance_commands("lm", shape.prefill,
                                    lambda i: [*served, "--encoder-url", encoder_urls[i % len(encoder_urls)]])
        if shape.prefill == 1:  # 1e1pd: the engine takes the load itself
            return {**encoders, **engines}, "lm"
        return {**encoders, **engines, **router(url_flags("--engine-url", engines))}, "router"
    prefills = instance_commands("prefill", shape.prefill,
                                 lambda i: [*served, "--role", "prefill", *url_flags("--encoder-url", encoders)])
    decodes = instance_commands("decode", shape.decode, lambda i: [*served, "--role", "decode"])
    split = [*url_flags("--encoder-url", encoders), *url_flags("--prefill-url", prefills),
             *url_flags("--decode-url", decodes)]
    return {**encoders, **prefills, **decodes, **router(split)}, "router"


def url_of(command: list[str]) -> str:
    return f"http://127.0.0.1:{command[command.index('--port') + 1]}"


def start_servers(commands: dict[str, list[str]], log, timeout_s: float = 180.0,
                  threads: int | None = None) -> dict[str, tuple]:
    """Start every instance at once, each its own process (with `threads` torch threads, if given), then wait
    until each answers /health. {role: (process, url)}; on any failure the ones started are stopped and the
    error says which one failed."""
    env = None if threads is None else {**os.environ, "OMP_NUM_THREADS": str(threads)}
    started = {}
    for role, cmd in commands.items():
        log(f"starting {role}: {'' if threads is None else f'OMP_NUM_THREADS={threads} '}"
            f"{' '.join(shlex.quote(c) for c in cmd)}")
        started[role] = (subprocess.Popen(cmd, stdout=subprocess.DEVNULL, env=env), url_of(cmd))
    deadline = time.monotonic() + timeout_s
    try:
        for role, (process, url) in started.items():
            while True:
                if process.poll() is not None:
                    raise RuntimeError(f"nanomm-serve ({role}) exited with code {process.returncode}")
                try:
                    if httpx.get(url + "/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"nanomm-serve ({role}) did not answer /health within {timeout_s:g} s")
                time.sleep(0.2)
    except BaseException:
        stop_servers(started)
        raise
    return started


def stop_servers(started: dict[str, tuple]) -> None:
    """Stop the instances this script started (the front first, so no request is left half way)."""
    for process, _ in reversed(list(started.values())):
        if process.poll() is None:
            process.terminate()
    for process, _ in started.values():
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def start_server(checkpoint: Path, model: str, extra: list[str], log) -> tuple[subprocess.Popen, str]:
    """One integrated nanomm-serve as its own process on 127.0.0.1; returns once /health answers."""
    commands, front = topology_commands("integrated", [str(checkpoint)], model, extra)
    return start_servers(commands, log)[front]


def report_line(s: dict) -> str:
    """One rate's progress line; the Markdown table at the end has the rest."""
    ttft = " / ".join("-" if v is None else f"{v * 1000:,.0f}" for v in s["ttft_s"].values())
    tpot = "-" if s["tpot_s"]["p50"] is None else f"{s['tpot_s']['p50'] * 1000:,.1f}"
    moved = s.get("transfer_bytes_per_request", {})
    moved = "" if not any(moved.values()) else ", bytes moved per request: " + ", ".join(
        f"{what.split()[0]} {v:,.0f}" for what, v in moved.items() if v)
    other = s.get("other_cpu_share")
    other = "" if other is None or other < 0.05 else f" [other processes used {other:.0%} of the CPU: noisy]"
    each = s.get("cpu_share_by_process")
    other += "" if not each else f"; CPU share {sum(each.values()):.0%} (" + ", ".join(
        f"{name} {share:.0%}" for name, share in each.items()) + ")"
    return (f"rate {s['rate']:g} req/s (arrived at {s['arrival_rate']:.2f}): {s['completed']}/{s['requests']} "
            f"done, TTFT p50/p95/p99 {ttft} ms, TPOT p50 {tpot} ms, goodput {s['goodput_rps']:.2f} req/s "
            f"({s['slo_attainment']:.0%} within SLO), visual tokens/s offered {s['offered_visual_tokens_per_s']:,.0f}, "
            f"served {s['served_visual_tokens_per_s']:,.0f}{moved}{other}")


def markdown_table(results: list[dict]) -> str:
    """The sweep as a Markdown table (what BENCHMARKS.md shows)."""
    def ms(v):
        return "-" if v is None else f"{v * 1000:,.0f}"

    rows = ["| rate (req/s) | arrived (req/s) | TTFT p50 / p95 / p99 (ms) | TPOT p50 (ms) | goodput (req/s) | "
            "within SLO | visual tokens/s offered / served | queue / encode / prefill, mean (ms) |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for s in results:
        t, stages = s["ttft_s"], s["server_ttft_stages_s"]  # stages: {} from a server without nanomm's metrics
        rows.append(f"| {s['rate']:g} | {s['arrival_rate']:.2f} | {ms(t['p50'])} / {ms(t['p95'])} / {ms(t['p99'])} | "
                    f"{ms(s['tpot_s']['p50'])} | {s['goodput_rps']:.2f} | {s['slo_attainment']:.0%} | "
                    f"{s['offered_visual_tokens_per_s']:,.0f} / {s['served_visual_tokens_per_s']:,.0f} | "
                    f"{ms(stages.get('queue'))} / {ms(stages.get('encode'))} / {ms(stages.get('prefill'))} |")
    return "\n".join(rows)


def cpu_seconds(pids: list[int]) -> tuple[float, float] | None:
    """(CPU seconds the whole machine spent busy, CPU seconds of these processes) so far; None off Linux."""
    try:
        ticks = os.sysconf("SC_CLK_TCK")
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
        busy = sum(int(v) for i, v in enumerate(fields[:8]) if i not in (3, 4))  # all but idle and iowait
    except (OSError, ValueError, AttributeError):
        return None
    own = process_cpu_seconds(dict(enumerate(pids)))
    return None if own is None else (busy / ticks, sum(own.values()))


def other_cpu_share(before, after, wall_s: float) -> float | None:
    """The share of the machine's CPU time that processes other than the load and its servers used in a run:
    above a few percent, something else ran and the timings are not this topology's alone."""
    if before is None or after is None or wall_s <= 0:
        return None
    other = (after[0] - before[0]) - (after[1] - before[1])
    return max(0.0, other) / (wall_s * usable_cores())


def usable_cores() -> int:
    """The cores this process may run on (a container may allow fewer than the machine has)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def process_cpu_seconds(pids: dict[str, int]) -> dict[str, float] | None:
    """User + system CPU seconds of each named process so far; None off Linux or once one is gone."""
    try:
        ticks, seconds = os.sysconf("SC_CLK_TCK"), {}
        for name, pid in pids.items():
            stat = Path(f"/proc/{pid}/stat").read_text()
            seconds[name] = sum(int(v) for v in stat[stat.rindex(")") + 2:].split()[11:13]) / ticks  # utime, stime
        return seconds
    except (OSError, ValueError, AttributeError):
        return None


def cpu_shares(before: dict | None, after: dict | None, wall_s: float) -> dict[str, float] | None:
    """Each process's share of the machine's CPU time in a run (its CPU seconds over wall time x cores)."""
    if before is None or after is None or wall_s <= 0:
        return None
    return {name: (after[name] - before[name]) / (wall_s * usable_cores()) for name in before if name in after}


HOST_CPU_METRIC = "nanomm_host_cpu_seconds_total"


def host_cpu_seconds(urls: dict[str, str]) -> dict[str, float]:
    """Each role's CPU seconds so far, from its own clock (nanomm_host_cpu_seconds_total, exact where /proc counts
    10 ms ticks), and the load generator's own as "load"."""
    seconds = {"load": time.process_time()}
    for role, url in urls.items():
        samples = read_metrics(url).samples.get(HOST_CPU_METRIC, {})
        if () in samples:
            seconds[role] = samples[()]
    return seconds


def cpu_ms_per_request(before: dict | None, after: dict | None, completed: int) -> dict[str, float] | None:
    """Each process's CPU milliseconds per answered request in a run: the host's cost of a request, by role."""
    if before is None or after is None or completed < 1:
        return None
    return {name: 1000 * (after[name] - before[name]) / completed for name in before if name in after}


def sweep(url: str, args, log, role_urls: dict[str, str] | None = None, stage_urls: list[str] | None = None,
          started: dict[str, tuple] | None = None) -> list[dict]:
    """One run per rate against `url`. role_urls: every instance, for the bytes moved and the requests each
    finished; stage_urls: the instances that finish requests (their TTFT stage histograms, added up); started:
    the processes started here, {role: (process, url)}, for the CPU each used (the load generator's own is counted
    too) and other_cpu_share."""
    role_urls, stage_urls, started = role_urls or {}, stage_urls or [url], started or {}
    pids = {role: process.pid for role, (process, _) in started.items()}
    cpu_urls = {role: role_url for role, (_, role_url) in started.items()}
    processes = {"load": os.getpid(), **pids}
    mix = parse_mix(args.mix)
    asyncio.run(run_load(url, args.model, mix, rate=1e6, num_requests=len(mix) * len(stage_urls), max_tokens=2,
                         seed=0, content_seed=-1))  # warm-up, of every engine: one-off costs paid here
    results = []
    for i, rate in enumerate(args.rate):
        before = ttft_stage_sums_of(stage_urls)
        moved_before = {role: transfer_bytes(u) for role, u in role_urls.items()}
        finished_before = finished_requests(role_urls)
        window = {}

        def start_counting():  # once the bodies are made: the CPU the run itself takes
            window["cpu"], window["start"] = cpu_seconds(list(processes.values())), time.monotonic()
            window["clocks"] = host_cpu_seconds(cpu_urls)

        records = asyncio.run(run_load(url, args.model, mix, rate, args.num_requests, args.max_tokens,
                                       seed=args.seed, content_seed=args.seed + 1 + i,  # new pictures per rate
                                       on_start=start_counting, pictures=args.pictures))
        wall_s = time.monotonic() - window["start"]
        cpu_before, cpu_after = window["cpu"], cpu_seconds(list(processes.values()))
        clocks_after = host_cpu_seconds(cpu_urls)
        by_process = cpu_shares(window["clocks"], clocks_after, wall_s)  # from the same clocks as the ms a request
        summary = summarize(records, rate, args.slo_ttft, args.slo_tpot)
        summary["server_ttft_stages_s"] = mean_stages(before, ttft_stage_sums_of(stage_urls))
        summary["requests_finished_by_process"] = {
            role: count - finished_before.get(role, 0.0) for role, count in finished_requests(role_urls).items()}
        moved = transfer_delta(role_urls, moved_before)
        summary["transfer_bytes"] = moved
        summary["transfer_bytes_per_request"] = {
            what: sum(v.get(what, 0.0) for v in moved.values()) / max(1, summary["completed"])
            for what in ("visual received", "kv received")}
        summary["other_cpu_share"] = other_cpu_share(cpu_before if pids else None, cpu_after, wall_s)
        summary["cpu_share_by_process"] = by_process
        summary["cluster_cpu_share"] = None if by_process is None else sum(by_process.values())
        summary["cpu_ms_per_request_by_process"] = cpu_ms_per_request(window["clocks"], clocks_after,
                                                                      summary["completed"])
        summary["records"] = [asdict(r) for r in records]
        log(report_line(summary))
        if summary["cpu_ms_per_request_by_process"]:
            log("  CPU a request: " + ", ".join(f"{name} {ms:.1f} ms" for name, ms in
                                                summary["cpu_ms_per_request_by_process"].items()))
        if len(summary["requests_finished_by_process"]) > 1:
            log("  requests finished: " + ", ".join(f"{name} {count:g}" for name, count in
                                                     summary["requests_finished_by_process"].items()))
        results.append(summary)
    return results


def run_trace(url: str, args, log) -> list[dict]:
    """One run of the trace against `url`; a summary per phase (its mean rate as the rate), records included."""
    trace = TRACES[args.trace]
    records = asyncio.run(run_schedule(url, args.model, trace_schedule(trace, args.seed),
                                       random.Random(args.seed + 1), pictures=args.pictures))
    results = []
    for phase in trace:
        mine = [r for r in records if r.phase == phase.name]
        summary = {"phase": phase.name, **summarize(mine, (phase.rate + phase.rate_end) / 2, args.slo_ttft,
                                                      args.slo_tpot), "records": [asdict(r) for r in mine]}
        log(f"{phase.name:13} " + report_line(summary))
        results.append(summary)
    return results


def image_size(text: str) -> tuple[int, int]:
    """"WxH" -> (width, height), each at least 28 pixels."""
    try:
        width, height = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not WIDTHxHEIGHT (for example 448x448)") from None
    if min(width, height) < 28:
        raise argparse.ArgumentTypeError(f"{text!r}: a picture is at least 28 x 28 pixels")
    return width, height


def check_chat_args(p: argparse.ArgumentParser, args) -> None:
    """The --sessions options make sense together (the server checks the policy's details)."""
    chat_only = {"--old-image-policy": args.old_image_policy, "--keep-last-images": args.keep_last_images}
    if args.sessions is None:
        given = [name for name, value in chat_only.items() if value is not None]
        if given:
            p.error(f"{', '.join(given)} go with --sessions")
        return
    if args.trace:
        p.error("--sessions and --trace are two different loads: pick one")
    if min(args.sessions, args.turns) < 1 or args.images_per_turn < 0 or args.think_time < 0:
        p.error("--sessions and --turns must be >= 1, --images-per-turn and --think-time >= 0")
    try:  # the engine's own checks, before any server starts
        if args.old_image_policy is not None:
            parse_old_image_policy(args.old_image_policy, "--old-image-policy")
        if args.keep_last_images is not None:
            check_keep_last_images(args.keep_last_images, "--keep-last-images")
    except InvalidInputError as exc:
        p.error(str(exc))


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rate", type=float, nargs="+", default=[1.0, 2.0], help="request rates to sweep (req/s)")
    p.add_argument("--mix", default="thumbnails", help=f"{', '.join(MIXES)}, or COUNTxWIDTHxHEIGHT:WEIGHT,...")
    p.add_argument("--num-requests", type=int, default=40, help="requests per rate")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per answer (ignore_eos)")
    p.add_argument("--pictures", default="noise", choices=PICTURES, help="noise (the largest JPEGs: the worst "
                   "case for the host) or smooth (a photo's JPEG size)")
    p.add_argument("--slo-ttft", type=float, default=1.0, help="the TTFT SLO for goodput (s)")
    p.add_argument("--slo-tpot", type=float, help="a TPOT SLO (s): goodput counts requests within both SLOs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--url", help="a running server (default: start the --topology here on the checkpoint)")
    p.add_argument("--metrics-url", action="append", default=[],
                   help="with --url: another instance whose /metrics has transfer bytes to report (repeatable)")
    p.add_argument("--topology", default="integrated", type=startable_topology,
                   help="what to start without --url: integrated, dp<N>, <X>e<Y>pd (X <= Y) or <X>e<Y>p<Z>d "
                        "(nanomm/topology.py); several instances are put behind the router")
    p.add_argument("--model", default="load", help="the model name the server serves")
    p.add_argument("--preset", default="tiny"), p.add_argument("--cache-dir", default="checkpoints/load")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--checkpoint", help="serve this checkpoint folder instead of the preset")
    which.add_argument("--demo", action="store_true", help="serve the trained demo model instead of the preset")
    which.add_argument("--emulate", metavar="GPU:MODEL", help="serve on the emulated device, e.g. h200:qwen2-vl-2b "
                       "(nanomm/emulate: no weights, each step sleeps its cost-model time; every topology)")
    p.add_argument("--instance-threads", type=int, help="torch threads of each instance started here (default: "
                   "torch's, one per core: several instances on one machine then oversubscribe its cores)")
    p.add_argument("--server-arg", action="append", default=[],
                   help="passed on to every nanomm-serve that loads the model (repeatable)")
    p.add_argument("--trace", choices=sorted(TRACES), help="instead of the rate sweep: one run of a trace whose "
                   "rate and mix move over time (its own mixes and answer lengths), summarized per phase")
    chat = p.add_argument_group("multi-turn chat sessions (instead of the rate sweep)")
    chat.add_argument("--sessions", type=int, help="concurrent chat sessions; each waits for an answer (and its "
                      "think time) before its next turn, and sends the whole conversation every turn")
    chat.add_argument("--turns", type=int, default=4, help="turns per session")
    chat.add_argument("--images-per-turn", type=int, default=1, help="new pictures in each user message")
    chat.add_argument("--image-size", type=image_size, default=(448, 448), metavar="WxH",
                      help="each picture's size (default 448x448)")
    chat.add_argument("--think-time", type=float, default=0.0, help="mean pause (s) between an answer and the "
                      "next question: exponential, seeded by --seed and the session (0: none)")
    chat.add_argument("--old-image-policy", help="sent in mm_processor_kwargs: keep | drop | downscale:<max_pixels> "
                      "| compress:<method>:<ratio> (what the server does with the pictures of earlier turns)")
    chat.add_argument("--keep-last-images", type=int, help="sent in mm_processor_kwargs: the newest pictures the "
                      "policy spares (>= 1)")
    chat.add_argument("--kv-bytes-per-token", type=int, help="the engine's KV bytes per token (default: computed "
                      "from the checkpoint's config.json for a server started here; none with --url)")
    chat.add_argument("--kv-budget-tokens", type=int, help="the KV pool in tokens (default: the server's "
                      f"/metrics, nanomm_kv_blocks_total x {EngineConfig.block_size})")
    p.add_argument("--json")


def check_args(p: argparse.ArgumentParser, args) -> None:
    check_chat_args(p, args)
    try:
        parse_mix(args.mix)  # fail before starting anything
    except ValueError as exc:
        p.error(str(exc))
    if min(args.rate) <= 0 or args.num_requests < 1:
        p.error("--rate must be > 0 and --num-requests >= 1")
    if args.emulate:
        from nanomm.emulate import parse_emulate
        try:
            parse_emulate(args.emulate)
        except ValueError as exc:
            p.error(str(exc))
        if args.url:
            p.error("--emulate starts the --topology here on the emulated device: it cannot go with --url")
    if args.url and args.topology != "integrated":
        p.error("--topology starts servers: it cannot go with --url (point --url at the router instead)")


def model_arguments(args) -> list[str]:
    """What names the model to the nanomm-serve instances started here: --emulate, --demo or a checkpoint."""
    if args.emulate:
        return ["--emulate", args.emulate]
    if args.demo:
        from nanomm import demo_checkpoint
        return [str(demo_checkpoint())]
    return [str(load_checkpoint(args, print))]


def report_chat(chat: dict, args, command: str, machine: dict) -> int:
    """Print the multi-turn tables, write the JSON; 0 when every turn was answered."""
    print(chat_markdown(chat))
    if chat["first_errors"]:
        print(f"{chat['errors']} failed, the first: {chat['first_errors']}")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(command=command, machine=machine, load="sessions",
                                                   topology=args.topology if args.url is None else None,
                                                   instance_threads=args.instance_threads, **chat), indent=1))
    return 0 if chat["errors"] == 0 else 1


def main(args) -> int:
    command = args.command_line
    machine = machine_info()
    load = f"mix {args.mix}: {parse_mix(args.mix)}" if args.sessions is None else f"chat sessions: {args.sessions}"
    print(f"command: {command}\nmachine: {machine['cpu']}, {machine['usable_cores']} cores, "
          f"{machine['memory_gib']} GiB; {load}", flush=True)
    started, url, kv_here = {}, args.url, None
    role_urls = {f"metrics {i + 1}": u for i, u in enumerate(args.metrics_url)}
    if url is None:
        model_args, server_args = model_arguments(args), [a for s in args.server_arg for a in shlex.split(s)]
        if args.sessions is not None:
            kv_here = kv_bytes_per_token_of(model_args, server_args)
        commands, front = topology_commands(args.topology, model_args, args.model, server_args)
        started = start_servers(commands, print, threads=args.instance_threads)
        role_urls = {role: u for role, (_, u) in started.items() if role != "router"}
        url = started[front][1]
    else:
        role_urls = {"front": url, **role_urls}
    stage_urls = finishing_urls(started, url)
    log = lambda line: print(line, flush=True)  # noqa: E731
    try:
        if args.sessions is not None:
            chat = run_chat(url, args, log, stage_urls[0], kv_here)
        elif args.trace:
            results = run_trace(url, args, log)
        else:
            results = sweep(url, args, log, role_urls, stage_urls, started)
    finally:
        stop_servers(started)
    if args.sessions is not None:
        return report_chat(chat, args, command, machine)
    print(markdown_table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(dict(command=command, machine=machine, mix=args.mix,
                                                   mix_entries=[asdict(e) for e in parse_mix(args.mix)],
                                                   topology=args.topology if args.url is None else None,
                                                   instance_threads=args.instance_threads,
                                                   max_tokens=args.max_tokens, pictures=args.pictures,
                                                   results=results), indent=1))
    return 0 if all(r["errors"] == 0 for r in results) else 1
