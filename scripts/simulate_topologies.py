"""When does splitting a multimodal serving engine pay, and how many encoder / prefill / decode workers does a mix need?

    python scripts/simulate_topologies.py                                    # H200 costs, the three topologies
    python scripts/simulate_topologies.py --rate 50 100 200 --pools 3 1,2 1,1,1 --json sim.json
    python scripts/simulate_topologies.py --search --max-workers 8 --rate 150 --mix 4x896x896:1,0x0x0:3
    python scripts/simulate_topologies.py --gpu l4 --save-costs l4.json      # write derived costs to edit, or
    python scripts/simulate_topologies.py --costs l4.json                    # feed costs measured elsewhere
    python scripts/simulate_topologies.py --costs costs.json --replay load.json --pools 1 1,1,1 --slo-tpot 0.05

    python scripts/simulate_topologies.py --emulate h200:qwen2-vl-2b --host-costs host.json --replay twin.json \
        --pools 1 1,1 1,1,1 1,2,1                       # nanomm's scheduler on the twin's cost model

A discrete-event simulation, standard library only (`--emulate` also reads nanomm's cost model and engine config:
scripts/simulate_engine.py, whose engine replaces the one below). A pool spec's length names its topology:
  integrated  `--pools 3`: N identical workers, continuous batching: each step runs every running decode plus FCFS
              prompt chunks up to a token budget (a running decode takes one token of it); a prompt's images are
              encoded inside the step that takes its first chunk.
  e+pd        `--pools 1,2`: encoders (one request's images at a time, FCFS) send visual tokens over the link to LM
              workers that step as above, minus the encoding. Text-only requests skip the encoders.
  epd         `--pools 1,1,1`: encoders -> prefill workers (chunked prefill only) -> the prompt's KV crosses the
              link -> decode workers. The first token reaches the user with the KV: TTFT includes both transfers.
A request goes to the pool worker with the fewest requests queued or running (ties: lowest index) when it reaches
the pool. `--search` tries every split of at most --max-workers workers, fewest first, and reports the smallest that
keeps --target-share of requests within both SLOs (ties: the best share).

Cost model (StageCosts, seconds; b = sequences in the decode batch):
  encode a request = step_overhead + sum over images (encode_s_per_image + tokens * encode_s_per_visual_token)
  engine step      = step_overhead + its encodes + prefill tokens * prefill_s_per_token
                     + (decode_s_per_step + b * decode_s_per_sequence if b > 0)
  link transfer    = bytes / link_bytes_per_s + link_latency_s   (visual tokens * visual_bytes_per_token, or
                                                                  prompt tokens * kv_bytes_per_token)
  shared_cpu_workers (0 unless set: a device per worker) = K: the workers share one machine's processors, and
                     with n > max(1, K) of them busy each stage runs at K / n of its speed (processor sharing);
                     for instances on one CPU (scripts/measure_stage_costs.py measures K)
StageCosts.for_gpu("qwen2-vl-2b", gpu) derives them (peak = dense bf16 FLOP/s, HBM = bytes/s, from GPUS):
  prefill_s_per_token       = 2 * 1.5e9 LM params / (peak * 0.5)        compute bound at 50% of peak
  encode_s_per_visual_token = 2 * 675e6 vision params * 4 patches / (peak * 0.5)   (2x2 patches make one token)
  encode_s_per_image        = 675e6 * 2 bytes / (HBM * 0.8)              vision weights read once per image
  decode_s_per_step         = 1.5e9 * 2 bytes / (HBM * 0.8)              LM weights read once per step
  decode_s_per_sequence     = 1024 context tokens * kv_bytes / (HBM * 0.8) + 2 * 1.5e9 / (peak * 0.5)
  kv_bytes_per_token = 2 * 28 layers * 2 KV heads * 128 * 2 bytes = 28,672;  visual_bytes_per_token = 1536 * 2
  step_overhead_s = 0.5 ms; link = 25 GB/s (a 200 Gb/s NIC) + 50 us.  Assumed: attention FLOPs ignored, nothing
  overlaps inside a step. A roofline sketch, not a prediction.

Replay (`--replay`): instead of drawing requests from --mix, take every answered request of a scripts/load.py
JSON (its `records`: send time, visual tokens, prompt and output tokens), one simulation per rate it ran, so a
prediction and a measurement see the same arrivals and the same pictures (lesson 13 compares them). A
request's visual tokens are split evenly over its images. `--factor` is the pixels per visual token's side
(28 for Qwen2-VL; 14 for the demo model, whose patches are 7 pixels).

Metrics: TTFT = first token at the user - arrival. TPOT = (finish - first token) / (output tokens - 1), 0 for one
output token. Good = TTFT <= --slo-ttft and TPOT <= --slo-tpot. Goodput = good requests / arrival span, the span
from t=0 to the last arrival (Poisson gaps start at t=0: N requests at rate r span about N/r). Utilisation = a
pool's busy time / (its workers * time of the last finish). Visual tokens per image = resized area / 784 after
Qwen2-VL's smart_resize (sides to multiples of 28, area within [3136, --max-pixels]).

Left out here (`--emulate` models the first four, as nanomm's engine does them, and measures the host's part: see
scripts/simulate_engine.py): preemption and KV-memory limits (batches grow without bound), prefix and encoder
caches, attention cost growing with context, the engine's encoder budget and max_num_seqs, priorities
(FCFS everywhere), link contention, encoder batching across requests, tokenisation and image decoding, tensor
parallelism.
"""

import argparse
import heapq
import itertools
import json
import math
import random
from collections import deque
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field, fields

FACTOR, MIN_PIXELS, DEFAULT_MAX_PIXELS = 28, 56 * 56, 16384 * 28 * 28  # Qwen2-VL's Hub preprocessor values
TOPOLOGIES = {"integrated": ("worker",), "e+pd": ("encode", "lm"), "epd": ("encode", "prefill", "decode")}
ALIASES = {"1e1pd": "e+pd", "e+p+d": "epd"}
SHORT = {"worker": "W", "encode": "E", "lm": "PD", "prefill": "P", "decode": "D"}  # pool labels in the table
GPUS = {"h200": (989e12, 4.8e12), "a100": (312e12, 2.0e12), "l4": (121e12, 300e9)}  # dense bf16 FLOP/s, HBM B/s
MODELS = {"qwen2-vl-2b": dict(lm_params=1.5e9, layers=28, kv_heads=2, head_dim=128, hidden=1536,
                              vision_params=675e6, patches_per_token=4, dtype_bytes=2)}


@dataclass
class StageCosts:
    encode_s_per_visual_token: float
    encode_s_per_image: float
    prefill_s_per_token: float
    step_overhead_s: float
    decode_s_per_step: float
    decode_s_per_sequence: float
    visual_bytes_per_token: float
    kv_bytes_per_token: float
    link_bytes_per_s: float
    link_latency_s: float
    # Workers that share one machine's processors: how many of them can be busy at once at their full speed
    # (0: every worker has a device of its own, as on GPUs). With n > 1 busy, each runs at
    # min(1, shared_cpu_workers / n) of its speed alone (processor sharing; utilisation counts the work alone).
    shared_cpu_workers: float = 0.0

    @classmethod
    def for_gpu(cls, model: str = "qwen2-vl-2b", gpu: str = "h200", compute_efficiency: float = 0.5,
                bandwidth_efficiency: float = 0.8, context_tokens: int = 1024, step_overhead_s: float = 0.5e-3,
                link_bytes_per_s: float = 25e9, link_latency_s: float = 50e-6) -> "StageCosts":
        m, (peak_flops, hbm_bytes_s) = MODELS[model], GPUS[gpu]
        flops, bytes_s = peak_flops * compute_efficiency, hbm_bytes_s * bandwidth_efficiency
        kv_bytes = 2 * m["layers"] * m["kv_heads"] * m["head_dim"] * m["dtype_bytes"]
        return cls(encode_s_per_visual_token=2 * m["vision_params"] * m["patches_per_token"] / flops,
                   encode_s_per_image=m["vision_params"] * m["dtype_bytes"] / bytes_s,
                   prefill_s_per_token=2 * m["lm_params"] / flops,
                   step_overhead_s=step_overhead_s,
                   decode_s_per_step=m["lm_params"] * m["dtype_bytes"] / bytes_s,
                   decode_s_per_sequence=context_tokens * kv_bytes / bytes_s + 2 * m["lm_params"] / flops,
                   visual_bytes_per_token=m["hidden"] * m["dtype_bytes"], kv_bytes_per_token=kv_bytes,
                   link_bytes_per_s=link_bytes_per_s, link_latency_s=link_latency_s)

    @classmethod
    def from_json(cls, path: str) -> "StageCosts":
        with open(path) as f:
            values = json.load(f)
        return cls(**{f.name: float(values[f.name]) for f in fields(cls)  # KeyError names a missing cost
                      if f.name in values or f.name != "shared_cpu_workers"})

    def to_json(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(asdict(self), f, indent=2)


def smart_resize(height: int, width: int, factor: int = FACTOR, min_pixels: int = MIN_PIXELS,
                 max_pixels: int = DEFAULT_MAX_PIXELS) -> tuple[int, int]:
    """Qwen2-VL's rule: each side rounds to a multiple of `factor`; an area outside [min, max] pixels is rescaled."""
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar, w_bar = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def visual_tokens(width: int, height: int, max_pixels: int = DEFAULT_MAX_PIXELS, factor: int = FACTOR) -> int:
    h, w = smart_resize(height, width, factor, max_pixels=max_pixels)
    return h * w // (factor * factor)  # 2x2 patches (14x14 pixels in Qwen2-VL) merge into one token


@dataclass(frozen=True)
class SimRequest:
    id: int
    arrival_s: float
    image_tokens: tuple[int, ...]  # visual tokens of each image
    text_tokens: int
    output_tokens: int
    cached_tokens: int = 0  # prompt positions the prefix cache held (a replay's records say)
    body_bytes: int = 0  # the request's JSON body, pictures included
    image_keys: tuple = ()  # each picture's identity, for encoder-cache hits (default: every picture new)

    @property
    def prompt_tokens(self) -> int:
        return self.text_tokens + sum(self.image_tokens)


def parse_mix(text: str) -> list[tuple[int, int, int, float]]:
    """'COUNTxWIDTHxHEIGHT:WEIGHT,...' -> [(images, width, height, weight)]; '0x0x0:3' is a text-only request."""
    mix = []
    for item in text.split(","):
        shape, _, weight = item.partition(":")
        try:
            count, width, height = (int(x) for x in shape.split("x"))
            mix.append((count, width, height, float(weight or 1)))
        except ValueError:
            raise ValueError(f"bad mix item {item!r}: expected COUNTxWIDTHxHEIGHT:WEIGHT") from None
    return mix


def make_requests(mix: str | list, rate: float, num_requests: int, seed: int = 0, text_tokens: int = 64,
                  output_tokens: int = 32, max_pixels: int = DEFAULT_MAX_PIXELS,
                  factor: int = FACTOR, body_bytes_per_pixel: float = 0.0) -> list[SimRequest]:
    """Poisson arrivals at `rate` per second from t=0; each request's kind drawn from the mix by weight (its
    body's bytes estimated from its pictures' pixels, for the host's costs of --emulate)."""
    mix = parse_mix(mix) if isinstance(mix, str) else mix
    rng, now, requests = random.Random(seed), 0.0, []
    for i in range(num_requests):
        now += rng.expovariate(rate)
        count, width, height, _ = rng.choices(mix, weights=[m[3] for m in mix])[0]
        images = tuple(visual_tokens(width, height, max_pixels, factor) for _ in range(count))
        body_bytes = round(body_bytes_per_pixel * count * width * height)
        requests.append(SimRequest(i, now, images, text_tokens, output_tokens, body_bytes=body_bytes))
    return requests


def requests_from_load(result: dict) -> list[SimRequest]:
    """The answered requests of one rate of a scripts/load.py JSON (its `records`), arrivals from t=0."""
    done = [r for r in result["records"] if r["error"] is None and r["completion_tokens"]]
    start = min(r["sent_at"] for r in result["records"])
    requests = []
    for i, r in enumerate(sorted(done, key=lambda r: r["sent_at"])):
        n, tokens = r["num_images"], r["visual_tokens"]
        images = tuple(tokens // n + (k < tokens % n) for k in range(n)) if n else ()
        requests.append(SimRequest(i, r["sent_at"] - start, images, r["prompt_tokens"] - tokens,
                                   r["completion_tokens"], r.get("cached_tokens", 0), r.get("body_bytes", 0)))
    return requests


def encode_s(costs: StageCosts, request: SimRequest) -> float:
    return sum(costs.encode_s_per_image + n * costs.encode_s_per_visual_token for n in request.image_tokens)


@dataclass
class _Track:  # one request's progress
    request: SimRequest
    encoded: bool = False
    prefilled: int = 0
    generated: int = 0
    first_token_s: float | None = None
    finish_s: float | None = None


class _Clock:
    def __init__(self, costs: StageCosts, token_budget: int):
        self.costs, self.token_budget, self.now = costs, token_budget, 0.0
        self._events, self._order = [], itertools.count()
        self.cpu = _SharedCPU(self, costs.shared_cpu_workers) if costs.shared_cpu_workers else None

    def at(self, t: float, fn, *args) -> None:
        heapq.heappush(self._events, (t, next(self._order), fn, args))

    def work(self, seconds: float, fn, *args) -> None:
        """A worker's stage of `seconds` (its cost alone), then fn(*args): on a device of its own, or sharing
        the machine's processors with the other busy workers."""
        if self.cpu is None:
            self.at(self.now + seconds, fn, *args)
        else:
            self.cpu.run(seconds, lambda: fn(*args))

    def after_link(self, nbytes: float, fn) -> None:
        self.at(self.now + nbytes / self.costs.link_bytes_per_s + self.costs.link_latency_s, fn)

    def run(self) -> None:
        while self._events:
            self.now, _, fn, args = heapq.heappop(self._events)
            fn(*args)


class _SharedCPU:
    """Processor sharing: with n > 1 stages running, each advances at min(1, capacity / n) of its speed alone."""

    def __init__(self, clock: "_Clock", capacity: float):
        self.clock, self.capacity = clock, capacity
        self.jobs: dict[int, list] = {}  # id -> [seconds of work left (at full speed), then]
        self.ids, self.since, self.version = itertools.count(), 0.0, 0

    def speed(self) -> float:
        n = len(self.jobs)
        return 1.0 if n <= 1 else min(1.0, self.capacity / n)  # one stage alone runs as it was measured

    def run(self, seconds: float, then) -> None:
        self._advance()
        self.jobs[next(self.ids)] = [seconds, then]
        self._next_finish()

    def _advance(self) -> None:
        done = (self.clock.now - self.since) * self.speed()
        for job in self.jobs.values():
            job[0] -= done
        self.since = self.clock.now

    def _next_finish(self) -> None:
        self.version += 1  # an earlier finish event, computed at another speed, is stale
        if self.jobs:
            left = min(job[0] for job in self.jobs.values())
            self.clock.at(self.clock.now + max(0.0, left) / self.speed(), self._finish, self.version)

    def _finish(self, version: int) -> None:
        if version != self.version:
            return
        self._advance()
        finished = [i for i, job in self.jobs.items() if job[0] <= 1e-12]
        thens = [self.jobs.pop(i)[1] for i in finished]
        self._next_finish()
        for then in thens:
            then()


class _Encoder:
    """Encodes one request's images at a time, FCFS, then hands the request to `deliver`."""

    def __init__(self, clock: _Clock, deliver):
        self.clock, self.deliver, self.queue, self.busy, self.busy_s = clock, deliver, deque(), False, 0.0

    def load(self) -> int:
        return len(self.queue) + self.busy

    def submit(self, track: _Track) -> None:
        self.queue.append(track)
        self._start()

    def _start(self) -> None:
        if self.busy or not self.queue:
            return
        track = self.queue.popleft()
        cost = self.clock.costs.step_overhead_s + encode_s(self.clock.costs, track.request)
        self.busy, self.busy_s = True, self.busy_s + cost
        self.clock.work(cost, self._done, track)

    def _done(self, track: _Track) -> None:
        self.busy, track.encoded = False, True
        self.deliver(track)
        self._start()


class _Engine:
    """Continuous batching: each step runs all running decodes plus FCFS prompt chunks within the token budget.
    With after_prefill set it only prefills (a prefill worker); fed by admit() only, it only decodes."""

    def __init__(self, clock: _Clock, encodes: bool, after_prefill=None):
        self.clock, self.encodes, self.after_prefill = clock, encodes, after_prefill
        self.waiting, self.running, self.busy, self.busy_s = deque(), [], False, 0.0

    def load(self) -> int:
        return len(self.waiting) + len(self.running)

    def submit(self, track: _Track) -> None:  # a prompt to prefill
        self.waiting.append(track)
        self._start()

    def admit(self, track: _Track) -> None:  # a request with its first token, to decode
        self.running.append(track)
        self._start()

    def _start(self) -> None:
        if self.busy or not (self.waiting or self.running):
            return
        costs, decoding, chunks = self.clock.costs, list(self.running), []
        budget, cost = self.clock.token_budget - len(decoding), costs.step_overhead_s
        for track in self.waiting:
            if budget <= 0:
                break
            n = min(budget, track.request.prompt_tokens - track.prefilled)
            if self.encodes and not track.encoded:
                cost, track.encoded = cost + encode_s(costs, track.request), True
            chunks.append((track, n))
            budget -= n
        cost += sum(n for _, n in chunks) * costs.prefill_s_per_token
        if decoding:
            cost += costs.decode_s_per_step + len(decoding) * costs.decode_s_per_sequence
        self.busy, self.busy_s = True, self.busy_s + cost
        self.clock.work(cost, self._done, decoding, chunks)

    def _done(self, decoding: list, chunks: list) -> None:
        for track in decoding:
            track.generated += 1
            if track.generated == track.request.output_tokens:
                track.finish_s = self.clock.now
        self.running = [t for t in self.running if t.finish_s is None]
        for track, n in chunks:
            track.prefilled += n
            if track.prefilled == track.request.prompt_tokens:
                self.waiting.popleft()  # chunks come from the front, so finished prompts do too
                (self.after_prefill or self.first_token)(track)
        self.busy = False
        self._start()

    def first_token(self, track: _Track) -> None:
        track.first_token_s, track.generated = self.clock.now, 1
        if track.request.output_tokens == 1:
            track.finish_s = self.clock.now
        else:
            self.admit(track)


def least_loaded(pool: list):
    return min(pool, key=lambda worker: worker.load())  # min keeps the first of equals: the lowest index


def build_pools(topology: str, pools: tuple[int, ...], clock: _Clock):
    """The workers of each pool, and the function an arriving request goes to."""
    costs = clock.costs
    if topology == "integrated":
        workers = [_Engine(clock, encodes=True) for _ in range(pools[0])]
        return {"worker": workers}, lambda track: least_loaded(workers).submit(track)
    if topology == "e+pd":
        lm_pools = {"lm": [_Engine(clock, encodes=False) for _ in range(pools[1])]}
    else:
        decode = [_Engine(clock, encodes=False) for _ in range(pools[2])]

        def ship_kv(track: _Track) -> None:
            kv_bytes = track.request.prompt_tokens * costs.kv_bytes_per_token
            clock.after_link(kv_bytes, lambda: least_loaded(decode).first_token(track))

        lm_pools = {"prefill": [_Engine(clock, False, after_prefill=ship_kv) for _ in range(pools[1])],
                    "decode": decode}
    first_lm_pool = next(iter(lm_pools.values()))  # "lm" or "prefill": where prompts go

    def to_prefill(track: _Track) -> None:
        least_loaded(first_lm_pool).submit(track)

    def ship_visual(track: _Track) -> None:
        clock.after_link(sum(track.request.image_tokens) * costs.visual_bytes_per_token, lambda: to_prefill(track))

    encoders = [_Encoder(clock, ship_visual) for _ in range(pools[0])]

    def entry(track: _Track) -> None:
        (least_loaded(encoders).submit if track.request.image_tokens else to_prefill)(track)

    return {"encode": encoders, **lm_pools}, entry


def percentile(values: list[float], q: float) -> float:
    """Nearest rank: the smallest value with at least q of the values at or below it."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)] if ordered else math.nan


@dataclass
class SimResult:
    topology: str
    pools: dict[str, int]
    ttft_s: list[float] = field(repr=False)
    tpot_s: list[float] = field(repr=False)
    share_within_slo: float
    goodput_rps: float | None  # None when every request arrives at t=0
    arrival_span_s: float
    utilisation: dict[str, float]

    def summary(self) -> dict:
        return {"topology": self.topology, "pools": self.pools, "requests": len(self.ttft_s),
                "ttft_p50_s": percentile(self.ttft_s, 0.5), "ttft_p90_s": percentile(self.ttft_s, 0.9),
                "tpot_p50_s": percentile(self.tpot_s, 0.5), "tpot_p90_s": percentile(self.tpot_s, 0.9),
                "share_within_slo": self.share_within_slo, "goodput_rps": self.goodput_rps,
                "arrival_span_s": self.arrival_span_s, "utilisation": self.utilisation}


def canonical(topology: str) -> str:
    name = ALIASES.get(topology.lower(), topology.lower())
    if name not in TOPOLOGIES:
        raise ValueError(f"unknown topology {topology!r}: one of {sorted(TOPOLOGIES)} (or {sorted(ALIASES)})")
    return name


def simulate(topology: str, pools: tuple[int, ...], costs: StageCosts, requests: list[SimRequest],
             slo_ttft_s: float, slo_tpot_s: float, token_budget: int = 2048) -> SimResult:
    """costs: StageCosts (this file's engine), or simulate_engine.TwinCosts (nanomm's scheduler on the emulated
    device's cost model; token_budget then comes from the twin's engine config)."""
    topology = canonical(topology)
    if len(pools) != len(TOPOLOGIES[topology]) or min(pools) < 1:
        raise ValueError(f"{topology} needs {len(TOPOLOGIES[topology])} pool sizes >= 1, got {pools}")
    if any(r.prompt_tokens < 1 or r.output_tokens < 1 for r in requests):
        raise ValueError("every request needs a prompt token and an output token")
    if isinstance(costs, StageCosts):
        ttft, tpot, busy = _simulate_stages(topology, pools, costs, requests, token_budget)
    else:
        from simulate_engine import simulate_twin

        outcomes, busy = simulate_twin(topology, pools, costs, requests)
        ttft, tpot = [o[0] for o in outcomes if o], [o[1] for o in outcomes if o]  # failed requests: neither
    good = sum(a <= slo_ttft_s and b <= slo_tpot_s for a, b in zip(ttft, tpot))
    span = max((r.arrival_s for r in requests), default=0.0)
    return SimResult(topology, dict(zip(TOPOLOGIES[topology], pools)), ttft, tpot, good / max(1, len(requests)),
                     good / span if span > 0 else None, span, busy)


def _simulate_stages(topology: str, pools: tuple[int, ...], costs: StageCosts, requests: list[SimRequest],
                     token_budget: int) -> tuple[list[float], list[float], dict[str, float]]:
    clock = _Clock(costs, token_budget)
    workers, entry = build_pools(topology, pools, clock)
    tracks = [_Track(r) for r in requests]
    for track in tracks:
        clock.at(track.request.arrival_s, entry, track)
    clock.run()
    ttft = [t.first_token_s - t.request.arrival_s for t in tracks]
    tpot = [(t.finish_s - t.first_token_s) / max(1, t.request.output_tokens - 1) for t in tracks]
    end = max((t.finish_s for t in tracks), default=0.0)
    busy = {name: sum(w.busy_s for w in pool) / (len(pool) * end) if end else 0.0 for name, pool in workers.items()}
    return ttft, tpot, busy


def compositions(total: int, parts: int) -> list[tuple[int, ...]]:
    """Every tuple of `parts` positive ints summing to `total`, in lexicographic order."""
    return [p for p in itertools.product(range(1, total + 1), repeat=parts) if sum(p) == total]


def search_pools(topology: str, costs: StageCosts, requests: list[SimRequest], slo_ttft_s: float,
                 slo_tpot_s: float, max_workers: int, target_share: float = 0.9,
                 token_budget: int = 2048) -> SimResult | None:
    """The fewest workers whose split keeps `target_share` of requests within SLO (ties: the best share, then the
    first split in lexicographic order); None when no split with at most max_workers does."""
    parts = len(TOPOLOGIES[canonical(topology)])
    for total in range(parts, max_workers + 1):
        results = [simulate(topology, pools, costs, requests, slo_ttft_s, slo_tpot_s, token_budget)
                   for pools in compositions(total, parts)]
        meeting = [r for r in results if r.share_within_slo >= target_share]
        if meeting:
            return max(meeting, key=lambda r: r.share_within_slo)
    return None


def parse_pools(spec: str) -> tuple[str, tuple[int, ...]]:
    """'3' -> integrated, '1,2' -> e+pd (E, PD), '1,1,1' -> epd (E, P, D)."""
    pools = tuple(int(x) for x in spec.split(","))
    by_length = {len(names): name for name, names in TOPOLOGIES.items()}
    if len(pools) not in by_length:
        raise ValueError(f"bad pool spec {spec!r}: 1, 2 or 3 comma-separated sizes")
    return by_length[len(pools)], pools


def format_row(rate: float, result: SimResult | None, topology: str) -> str:
    if result is None:
        return f"{topology:<11} {'(none fits)':<14} {rate:>7g}"
    s, pools = result.summary(), " ".join(f"{SHORT[k]}={v}" for k, v in result.pools.items())
    goodput = "-" if s["goodput_rps"] is None else f"{s['goodput_rps']:.2f}"
    busy = " ".join(f"{SHORT[k]}={v:.0%}" for k, v in result.utilisation.items())
    return (f"{result.topology:<11} {pools:<14} {rate:>7g} {s['ttft_p50_s']:>8.3f} {s['ttft_p90_s']:>8.3f} "
            f"{s['tpot_p50_s'] * 1e3:>8.1f} {s['tpot_p90_s'] * 1e3:>8.1f} {s['share_within_slo']:>7.0%} "
            f"{goodput:>8}  {busy}")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--costs", help="StageCosts JSON (e.g. measured); default: derived for --gpu")
    p.add_argument("--emulate", metavar="GPU:MODEL", help="nanomm's scheduler on the emulated device's cost model "
                   "(scripts/simulate_engine.py) instead of StageCosts, e.g. h200:qwen2-vl-2b")
    p.add_argument("--host-costs", metavar="JSON", help="with --emulate: the host's costs measured on the twin "
                   "(scripts/measure_stage_costs.py --emulate); default: none (the device alone)")
    p.add_argument("--gpu", default="h200", choices=sorted(GPUS))
    p.add_argument("--model", default="qwen2-vl-2b", choices=sorted(MODELS))
    p.add_argument("--save-costs", metavar="FILE", help="write the costs in use as JSON")
    p.add_argument("--mix", default="1x448x448:1", help="COUNTxWIDTHxHEIGHT:WEIGHT,... (images per request)")
    p.add_argument("--text-tokens", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--max-pixels", type=int, default=DEFAULT_MAX_PIXELS)
    p.add_argument("--factor", type=int, default=FACTOR, help="pixels per visual token's side (the demo model: 14)")
    p.add_argument("--replay", metavar="LOAD_JSON", help="simulate the requests a scripts/load.py run sent (its "
                   "arrivals, pictures and lengths; one run per rate in it) instead of drawing them")
    p.add_argument("--rate", type=float, nargs="+", default=[50.0, 100.0, 200.0], help="requests/s")
    p.add_argument("--num-requests", type=int, default=500)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo-ttft", type=float, default=0.5, help="seconds")
    p.add_argument("--slo-tpot", type=float, default=0.05, help="seconds")
    p.add_argument("--token-budget", type=int, default=2048, help="tokens per engine step")
    p.add_argument("--pools", nargs="+", default=["3", "1,2", "1,1,1"], help="N | E,PD | E,P,D")
    p.add_argument("--search", action="store_true", help="find the fewest workers meeting --target-share")
    p.add_argument("--max-workers", type=int, default=8)
    p.add_argument("--target-share", type=float, default=0.9)
    p.add_argument("--topologies", nargs="+", default=list(TOPOLOGIES), help="searched with --search")
    p.add_argument("--json", metavar="FILE")
    return p.parse_args(argv)


def stage_or_twin_costs(args):
    if args.emulate:
        from simulate_engine import HostCosts, TwinCosts

        with open(args.host_costs) if args.host_costs else nullcontext() as f:
            host = HostCosts.from_json(json.load(f)) if f else HostCosts()
        return TwinCosts.for_twin(args.emulate, host)
    return StageCosts.from_json(args.costs) if args.costs else StageCosts.for_gpu(args.model, args.gpu)


def main(argv=None) -> dict:
    args = parse_args(argv)
    costs = stage_or_twin_costs(args)
    if args.save_costs:
        costs.to_json(args.save_costs)
    slo = (args.slo_ttft, args.slo_tpot)
    print(f"{'topology':<11} {'pools':<14} {'rate':>7} {'TTFT p50':>8} {'p90 (s)':>8} {'TPOT p50':>8} "
          f"{'p90 (ms)':>8} {'in SLO':>7} {'goodput':>8}  utilisation")
    results = []
    if args.replay:
        with open(args.replay) as f:
            replayed = {run["rate"]: requests_from_load(run) for run in json.load(f)["results"]}
    for rate in (replayed if args.replay else args.rate):
        requests = replayed[rate] if args.replay else make_requests(
            args.mix, rate, args.num_requests, args.seed, args.text_tokens, args.output_tokens, args.max_pixels,
            args.factor, getattr(getattr(costs, "host", None), "body_bytes_per_pixel", 0.0))
        if args.search:
            runs = [(canonical(t), search_pools(t, costs, requests, *slo, args.max_workers, args.target_share,
                                                args.token_budget)) for t in args.topologies]
        else:
            runs = [(t, simulate(t, pools, costs, requests, *slo, args.token_budget))
                    for t, pools in map(parse_pools, args.pools)]
        for topology, result in runs:
            print(format_row(rate, result, topology))
            results.append({"rate": rate, "topology": topology, **(result.summary() if result else {"pools": None})})
    report = {"costs": costs.describe() if args.emulate else asdict(costs), "args": vars(args), "results": results}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return report


if __name__ == "__main__":
    main()
