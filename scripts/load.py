"""Load nanomm-serve the way its users do: Poisson arrivals, a mix of image sizes and counts, streaming clients.

    python scripts/load.py --mix thumbnails --rate 1 2 4          # starts nanomm-serve on the tiny checkpoint
    python scripts/load.py --mix scans --rate 0.5 1 --num-requests 40 --json scans.json
    python scripts/load.py --url http://127.0.0.1:8000 --model nanomm-demo --mix "1x224x224:3,2x112x112:1"
    python scripts/load.py --demo --topology 1e1p1d --rate 2 --slo-ttft 0.5 --slo-tpot 0.05   # a split engine

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
- the bytes that moved between instances (visual tokens, KV), read from every instance's /metrics.

Without `--url` the servers are started here, each as its own process (`python -m nanomm.serve.app`), so that
the load generator and the engines do not share an interpreter, on free ports of 127.0.0.1; `--topology` says
which: `integrated` (one engine), `1e1pd` (an encoder service and one engine that runs no vision tower),
`1e1p1d` or `1e2p1d` (an encoder, one or two prefill instances and a decode instance behind the router, which
takes the load). All of them are stopped at the end. Not a test: the smallest runs are in tests/test_scripts.py, and nothing asserts a
timing. The JSON holds every request as the client saw it (`records`), so a run can be replayed elsewhere
(the simulator in lesson 13 replays them).
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

import httpx
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/: bench.py's helpers

from bench import WORDS, load_checkpoint, machine_info, random_image  # noqa: E402
from nanomm.serve.app import free_local_port  # noqa: E402
from nanomm.serve.metrics import TTFT_STAGES  # noqa: E402  (preprocess, queue, encode, prefill)

# Named mixes: "COUNTxWIDTHxHEIGHT:WEIGHT" entries, comma-separated (a request draws one entry by weight).
MIXES = {
    "text": "0x0x0:1",
    "thumbnails": "1x224x224:5,1x168x168:3,2x112x112:2",  # 64, 36 and 2 x 16 visual tokens
    "scans": "1x896x1176:7,2x728x952:3",  # a page (1,344 visual tokens) or two smaller ones (2 x 884)
}

@dataclass(frozen=True)
class MixEntry:
    num_images: int
    width: int
    height: int
    weight: float


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


def parse_mix(text: str) -> list[MixEntry]:
    """A mix's name (MIXES) or its entries, "COUNTxWIDTHxHEIGHT:WEIGHT,..."; a ValueError says what is wrong."""
    entries = []
    for item in MIXES.get(text, text).split(","):
        try:
            shape, weight = item.split(":")
            count, width, height = (int(v) for v in shape.lower().split("x"))
            entry = MixEntry(count, width, height, float(weight))
        except ValueError:
            raise ValueError(f"mix entry {item!r} is not COUNTxWIDTHxHEIGHT:WEIGHT (for example 1x224x224:1); "
                             f"named mixes: {', '.join(MIXES)}") from None
        if entry.num_images < 0 or entry.weight <= 0 or (entry.num_images and min(width, height) < 28):
            raise ValueError(f"mix entry {item!r}: the count must be >= 0, the weight > 0, images >= 28 pixels")
        entries.append(entry)
    return entries


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


async def send_one(http: httpx.AsyncClient, body: dict, record: RequestRecord, clock) -> None:
    """Send at record.sent_at, read the stream to [DONE]; fill in when each part arrived, or the error."""
    await asyncio.sleep(max(0.0, record.sent_at - clock()))
    record.sent_at = clock()  # the actual send time (the event loop may be a little late)
    try:
        async with http.stream("POST", "/v1/chat/completions", json=body) as answer:
            if answer.status_code != 200:
                record.error = f"HTTP {answer.status_code}: {(await answer.aread()).decode()[:200]}"
                return
            async for line in answer.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                if "error" in chunk:
                    record.error = chunk["error"].get("message", str(chunk))
                    return
                if chunk["choices"] and record.first_token_at is None:
                    record.first_token_at = clock()  # a chunk with a choice carries the first token
                if chunk.get("usage"):
                    usage = chunk["usage"]
                    record.prompt_tokens, record.completion_tokens = usage["prompt_tokens"], usage["completion_tokens"]
                    record.visual_tokens = usage.get("visual_tokens", 0)
                    record.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            record.finished_at = clock()
            if record.first_token_at is None or not record.completion_tokens:
                record.error = "the stream ended without a token or without its usage chunk"
    except httpx.HTTPError as exc:
        record.error = f"{type(exc).__name__}: {exc}"


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
    bodies = [request_body(a.entry, rng, model, a.max_tokens, pictures) for a in schedule]
    records = [RequestRecord(a.at, a.entry.num_images, body_bytes=len(json.dumps(b)), phase=a.phase)
               for a, b in zip(schedule, bodies)]
    # A fresh connection per request, as from independent users: a kept-alive connection that the server closes
    # for idleness (uvicorn: after 5 s) just as a request goes out on it fails that request (a ReadError).
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=timeout_s, limits=limits) as http:
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


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100), interpolated between the two nearest ranks (numpy's default)."""
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


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


def scrape(url: str) -> dict[str, float]:
    """Every unlabelled sample of the server's /metrics, by name (a histogram's _sum and _count among them)."""
    families = text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text)
    return {sample.name: sample.value for family in families for sample in family.samples if not sample.labels}


TRANSFER_METRICS = {"kv": "nanomm_kv_transfer_bytes_total", "visual": "nanomm_visual_token_transfer_bytes_total"}


def transfer_bytes(url: str) -> dict[str, float]:
    """{"kv sent": bytes, "visual received": ...}: an instance's transfer counters (the ones it has)."""
    families = text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text)
    names = {metric: what for what, metric in TRANSFER_METRICS.items()}
    return {f"{names[sample.name]} {sample.labels['direction']}": sample.value for family in families
            for sample in family.samples if sample.name in names and "direction" in sample.labels}


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


def mean_stages(before: dict, after: dict) -> dict[str, float]:
    """The mean of each TTFT stage over the requests that finished between two /metrics reads."""
    means = {}
    for stage, (total, count) in after.items():
        total_before, count_before = before.get(stage, (0.0, 0.0))
        means[stage] = (total - total_before) / (count - count_before) if count > count_before else None
    return means


TOPOLOGIES = ("integrated", "1e1pd", "1e1p1d", "1e2p1d")  # 1eNp1d: N prefill instances


def server_command(port: int, role_args: list[str]) -> list[str]:
    return [sys.executable, "-m", "nanomm.serve.app", *role_args, "--port", str(port), "--log-level", "warning"]


def topology_commands(topology: str, model_args: list[str], model: str, extra: list[str],
                      peer_timeout_s: float = 600.0) -> tuple[dict[str, list[str]], str]:
    """({role: its nanomm-serve command}, the role that takes the load) on fresh 127.0.0.1 ports. model_args: what
    names the model to nanomm-serve (a checkpoint folder, or `--emulate GPU:MODEL`). `extra` goes to every
    instance that loads the model (an encoder takes the engine's --max-pixels, so the two agree)."""
    num_prefills = int(topology[2]) if topology.endswith("p1d") else 0
    prefills = [f"prefill {i + 1}" if num_prefills > 1 else "prefill" for i in range(num_prefills)]
    ports = {role: free_local_port() for role in ("encoder", *prefills, "decode", "router", "integrated")}
    url = {role: f"http://127.0.0.1:{port}" for role, port in ports.items()}
    served = [*model_args, "--served-model-name", model, *extra]
    if topology == "integrated":
        return {"integrated": server_command(ports["integrated"], served)}, "integrated"
    encoder = server_command(ports["encoder"], [*served, "--role", "encoder"])
    if topology == "1e1pd":  # one engine whose images go to the encoder service
        return {"encoder": encoder, "lm": server_command(
            ports["integrated"], [*served, "--encoder-url", url["encoder"]])}, "lm"
    prefill_urls = [a for role in prefills for a in ("--prefill-url", url[role])]
    return {"encoder": encoder,
            **{role: server_command(ports[role], [*served, "--role", "prefill", "--encoder-url", url["encoder"]])
               for role in prefills},
            "decode": server_command(ports["decode"], [*served, "--role", "decode"]),
            "router": server_command(ports["router"], [
                "--role", "router", "--encoder-url", url["encoder"], *prefill_urls,
                "--decode-url", url["decode"], "--peer-timeout", str(peer_timeout_s)])}, "router"


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
    return {name: (after[name] - before[name]) / (wall_s * usable_cores()) for name in before}


def sweep(url: str, args, log, role_urls: dict[str, str] | None = None, stages_url: str | None = None,
          pids: dict[str, int] | None = None) -> list[dict]:
    """One run per rate against `url`. role_urls: every instance, for the bytes moved; stages_url: the instance
    that finishes requests (its TTFT stage histograms); pids: the processes started here, by role, for the CPU
    each used (the load generator's own is counted too) and other_cpu_share."""
    role_urls, stages_url = role_urls or {}, stages_url or url
    processes = {"load": os.getpid(), **(pids or {})}
    mix = parse_mix(args.mix)
    asyncio.run(run_load(url, args.model, mix, rate=1e6, num_requests=len(mix), max_tokens=2, seed=0,
                         content_seed=-1))  # warm-up: one-off costs (first kernels, allocations) paid here
    results = []
    for i, rate in enumerate(args.rate):
        before = ttft_stage_sums(stages_url)
        moved_before = {role: transfer_bytes(u) for role, u in role_urls.items()}
        window = {}

        def start_counting():  # once the bodies are made: the CPU the run itself takes
            window["cpu"], window["start"] = cpu_seconds(list(processes.values())), time.monotonic()
            window["each"] = process_cpu_seconds(processes)

        records = asyncio.run(run_load(url, args.model, mix, rate, args.num_requests, args.max_tokens,
                                       seed=args.seed, content_seed=args.seed + 1 + i,  # new pictures per rate
                                       on_start=start_counting, pictures=args.pictures))
        wall_s = time.monotonic() - window["start"]
        cpu_before, cpu_after = window["cpu"], cpu_seconds(list(processes.values()))
        by_process = cpu_shares(window["each"], process_cpu_seconds(processes), wall_s)
        summary = summarize(records, rate, args.slo_ttft, args.slo_tpot)
        summary["server_ttft_stages_s"] = mean_stages(before, ttft_stage_sums(stages_url))
        moved = transfer_delta(role_urls, moved_before)
        summary["transfer_bytes"] = moved
        summary["transfer_bytes_per_request"] = {
            what: sum(v.get(what, 0.0) for v in moved.values()) / max(1, summary["completed"])
            for what in ("visual received", "kv received")}
        summary["other_cpu_share"] = other_cpu_share(cpu_before if pids else None, cpu_after, wall_s)
        summary["cpu_share_by_process"] = by_process
        summary["cluster_cpu_share"] = None if by_process is None else sum(by_process.values())
        summary["records"] = [asdict(r) for r in records]
        log(report_line(summary))
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


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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
    p.add_argument("--topology", default="integrated", choices=TOPOLOGIES,
                   help="what to start without --url: one engine, encoder + engine, or encoder + prefill + "
                        "decode behind the router")
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
    p.add_argument("--json")
    args = p.parse_args(argv)
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
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    command = " ".join(shlex.quote(a) for a in ["scripts/load.py", *(sys.argv[1:] if argv is None else argv)])
    machine = machine_info()
    print(f"command: {command}\nmachine: {machine['cpu']}, {machine['usable_cores']} cores, "
          f"{machine['memory_gib']} GiB; mix {args.mix}: {parse_mix(args.mix)}", flush=True)
    started, url = {}, args.url
    role_urls = {f"metrics {i + 1}": u for i, u in enumerate(args.metrics_url)}
    if url is None:
        if args.emulate:
            model_args = ["--emulate", args.emulate]
        elif args.demo:
            from nanomm import demo_checkpoint
            model_args = [str(demo_checkpoint())]
        else:
            model_args = [str(load_checkpoint(args, print))]
        commands, front = topology_commands(args.topology, model_args, args.model,
                                            [a for s in args.server_arg for a in shlex.split(s)])
        started = start_servers(commands, print, threads=args.instance_threads)
        role_urls = {role: u for role, (_, u) in started.items() if role != "router"}
        url = started[front][1]
    else:
        role_urls = {"front": url, **role_urls}
    stages_url = started["decode"][1] if "decode" in started else url  # the instance that finishes requests
    try:
        if args.trace:
            results = run_trace(url, args, lambda line: print(line, flush=True))
        else:
            results = sweep(url, args, lambda line: print(line, flush=True), role_urls, stages_url,
                            {role: process.pid for role, (process, _) in started.items()})
    finally:
        stop_servers(started)
    print(markdown_table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(dict(command=command, machine=machine, mix=args.mix,
                                                   mix_entries=[asdict(e) for e in parse_mix(args.mix)],
                                                   topology=args.topology if args.url is None else None,
                                                   instance_threads=args.instance_threads,
                                                   max_tokens=args.max_tokens, pictures=args.pictures,
                                                   results=results), indent=1))
    return 0 if all(r["errors"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
