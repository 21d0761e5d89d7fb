"""When does splitting a multimodal serving engine pay, and how many encoder / prefill / decode workers does a mix need?

Lesson: lessons/13-three-topologies.md. Driven by `nanomm-bench simulate` (nanomm/bench/simulate.py).

A discrete-event simulation of the stages, standard library only; `nanomm/sim/twin.py` is the engine-faithful
model that replaces the engine below with nanomm's scheduler on the emulated device's cost model. Topologies
follow the one grammar (nanomm/topology.py):
  dp<N>          N identical workers, continuous batching: each step runs every running decode plus FCFS prompt
                 chunks up to a token budget (a running decode takes one token of it); a prompt's images are
                 encoded inside the step that takes its first chunk.
  <X>e<Y>pd      encoders (one request's images at a time, FCFS) send visual tokens over the link to LM workers
                 that step as above, minus the encoding. Text-only requests skip the encoders.
  <X>e<Y>p<Z>d   encoders -> prefill workers (chunked prefill only) -> the prompt's KV crosses the link -> decode
                 workers. The first token reaches the user with the KV: TTFT includes both transfers.
A request goes to the pool worker with the fewest requests queued or running (ties: lowest index) when it reaches
the pool. `search_pools` tries every size of a shape, fewest workers first, and reports the smallest that keeps
a target share of requests within both SLOs (ties: the best share).

Cost model (StageCosts, seconds; b = sequences in the decode batch):
  encode a request = step_overhead + sum over images (encode_s_per_image + tokens * encode_s_per_visual_token)
  engine step      = step_overhead + its encodes + prefill tokens * prefill_s_per_token
                     + (decode_s_per_step + b * decode_s_per_sequence if b > 0)
  link transfer    = bytes / link_bytes_per_s + link_latency_s   (visual tokens * visual_bytes_per_token, or
                                                                  prompt tokens * kv_bytes_per_token)
  shared_cpu_workers (0 unless set: a device per worker) = K: the workers share one machine's processors, and
                     with n > max(1, K) of them busy each stage runs at K / n of its speed (processor sharing);
                     for instances on one CPU (`nanomm-bench stage-costs` measures K)
StageCosts.for_gpu("qwen2-vl-2b", gpu) derives them (peak = dense bf16 FLOP/s, HBM = bytes/s, from the one GPU
table, nanomm/emulate/costs.py's GPUS):
  prefill_s_per_token       = 2 * 1.5e9 LM params / (peak * 0.5)        compute bound at 50% of peak
  encode_s_per_visual_token = 2 * 675e6 vision params * 4 patches / (peak * 0.5)   (2x2 patches make one token)
  encode_s_per_image        = 675e6 * 2 bytes / (HBM * 0.8)              vision weights read once per image
  decode_s_per_step         = 1.5e9 * 2 bytes / (HBM * 0.8)              LM weights read once per step
  decode_s_per_sequence     = 1024 context tokens * kv_bytes / (HBM * 0.8) + 2 * 1.5e9 / (peak * 0.5)
  kv_bytes_per_token = 2 * 28 layers * 2 KV heads * 128 * 2 bytes = 28,672;  visual_bytes_per_token = 1536 * 2
  step_overhead_s = 0.5 ms; link = 25 GB/s (a 200 Gb/s NIC) + 50 us.  Assumed: attention FLOPs ignored, nothing
  overlaps inside a step. A roofline sketch, not a prediction.

Metrics: TTFT = first token at the user - arrival. TPOT = (finish - first token) / (output tokens - 1), 0 for one
output token. Good = TTFT <= the TTFT SLO and TPOT <= the TPOT SLO. Goodput = good requests / arrival span, the
span from t=0 to the last arrival (Poisson gaps start at t=0: N requests at rate r span about N/r). Utilisation =
a pool's busy time / (its workers * time of the last finish). Percentiles: nanomm/sim/stats.py.

Left out here (the twin model, nanomm/sim/twin.py, models the first four as nanomm's engine does them, and the
host's part as measured): preemption and KV-memory limits (batches grow without bound), prefix and encoder
caches, attention cost growing with context, the engine's encoder budget and max_num_seqs, priorities (FCFS
everywhere), link contention, encoder batching across requests, tokenisation and image decoding, tensor
parallelism.
"""

import itertools
import json
from collections import deque
from dataclasses import asdict, dataclass, field, fields

from nanomm.emulate.costs import GPUS
from nanomm.sim.events import EventClock, least_loaded
from nanomm.sim.stats import percentile
from nanomm.topology import POOL_NAMES, SHAPES, Topology, parse_topology, topology_of
from nanomm.sim.workload import SimRequest

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
        m, device = MODELS[model], GPUS[gpu]
        flops, bytes_s = device.bf16_flops * compute_efficiency, device.hbm_bytes_per_s * bandwidth_efficiency
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


class _Clock(EventClock):
    def __init__(self, costs: StageCosts, token_budget: int):
        super().__init__()
        self.costs, self.token_budget = costs, token_budget
        self.cpu = _SharedCPU(self, costs.shared_cpu_workers) if costs.shared_cpu_workers else None

    def work(self, seconds: float, fn, *args) -> None:
        """A worker's stage of `seconds` (its cost alone), then fn(*args): on a device of its own, or sharing
        the machine's processors with the other busy workers."""
        if self.cpu is None:
            self.at(self.now + seconds, fn, *args)
        else:
            self.cpu.run(seconds, lambda: fn(*args))

    def after_link(self, nbytes: float, fn) -> None:
        self.at(self.now + nbytes / self.costs.link_bytes_per_s + self.costs.link_latency_s, fn)


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




def build_pools(topology: Topology, clock: _Clock):
    """The workers of each pool, and the function an arriving request goes to."""
    costs = clock.costs
    if topology.shape == "dp<N>":
        workers = [_Engine(clock, encodes=True) for _ in range(topology.prefill)]
        return {"worker": workers}, lambda track: least_loaded(workers).submit(track)
    if topology.shape == "<X>e<Y>pd":
        lm_pools = {"lm": [_Engine(clock, encodes=False) for _ in range(topology.prefill)]}
    else:
        decode = [_Engine(clock, encodes=False) for _ in range(topology.decode)]

        def ship_kv(track: _Track) -> None:
            kv_bytes = track.request.prompt_tokens * costs.kv_bytes_per_token
            clock.after_link(kv_bytes, lambda: least_loaded(decode).first_token(track))

        lm_pools = {"prefill": [_Engine(clock, False, after_prefill=ship_kv) for _ in range(topology.prefill)],
                    "decode": decode}
    first_lm_pool = next(iter(lm_pools.values()))  # "lm" or "prefill": where prompts go

    def to_prefill(track: _Track) -> None:
        least_loaded(first_lm_pool).submit(track)

    def ship_visual(track: _Track) -> None:
        clock.after_link(sum(track.request.image_tokens) * costs.visual_bytes_per_token, lambda: to_prefill(track))

    encoders = [_Encoder(clock, ship_visual) for _ in range(topology.encoders)]

    def entry(track: _Track) -> None:
        (least_loaded(encoders).submit if track.request.image_tokens else to_prefill)(track)

    return {"encode": encoders, **lm_pools}, entry


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
    caches: dict = field(default_factory=dict)  # the twin's prefix- and encoder-cache hits (twin.cache_hits)

    def summary(self) -> dict:
        return {"topology": self.topology, "pools": self.pools, "requests": len(self.ttft_s),
                "ttft_p50_s": percentile(self.ttft_s, 50), "ttft_p90_s": percentile(self.ttft_s, 90),
                "ttft_p99_s": percentile(self.ttft_s, 99),
                "tpot_p50_s": percentile(self.tpot_s, 50), "tpot_p90_s": percentile(self.tpot_s, 90),
                "tpot_p99_s": percentile(self.tpot_s, 99), "share_within_slo": self.share_within_slo, "goodput_rps": self.goodput_rps,
                "arrival_span_s": self.arrival_span_s, "utilisation": self.utilisation, "caches": self.caches}


def simulate(topology: "str | Topology", costs, requests: list[SimRequest], slo_ttft_s: float,
             slo_tpot_s: float, token_budget: int = 2048, routing: str = "requests",
             affinity_slack: float = 8192.0) -> SimResult:
    """costs: StageCosts (this file's engine), or nanomm.sim.twin.TwinCosts (nanomm's scheduler on the emulated
    device's cost model; token_budget then comes from the twin's engine config; `routing` and `affinity_slack`
    pick its whole engines, twin.py)."""
    topology = parse_topology(topology)
    if any(r.prompt_tokens < 1 or r.output_tokens < 1 for r in requests):
        raise ValueError("every request needs a prompt token and an output token")
    caches = {}
    if isinstance(costs, StageCosts):
        if routing != "requests":
            raise ValueError("the stage model routes by requests alone: other routings need the twin (--emulate)")
        ttft, tpot, busy = _simulate_stages(topology, costs, requests, token_budget)
    else:
        from nanomm.sim.twin import run_twin

        outcomes, busy, caches = run_twin(topology, costs, requests, routing, affinity_slack)
        ttft, tpot = [o[0] for o in outcomes if o], [o[1] for o in outcomes if o]  # failed requests: neither
    good = sum(a <= slo_ttft_s and b <= slo_tpot_s for a, b in zip(ttft, tpot))
    span = max((r.arrival_s for r in requests), default=0.0)
    return SimResult(topology.name, topology.pools, ttft, tpot, good / max(1, len(requests)),
                     good / span if span > 0 else None, span, busy, caches)


def _simulate_stages(topology: Topology, costs: StageCosts, requests: list[SimRequest],
                     token_budget: int) -> tuple[list[float], list[float], dict[str, float]]:
    clock = _Clock(costs, token_budget)
    workers, entry = build_pools(topology, clock)
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


def search_pools(shape: str, costs, requests: list[SimRequest], slo_ttft_s: float, slo_tpot_s: float,
                 max_workers: int, target_share: float = 0.9, token_budget: int = 2048) -> SimResult | None:
    """The fewest workers of a shape (one of SHAPES: 'dp<N>', '<X>e<Y>pd', '<X>e<Y>p<Z>d') whose sizes keep
    `target_share` of requests within SLO (ties: the best share, then the first sizes in lexicographic order);
    None when no topology of at most max_workers does."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}: one of {SHAPES}")
    parts = len(POOL_NAMES[shape])
    for total in range(parts, max_workers + 1):
        results = [simulate(topology_of(shape, sizes), costs, requests, slo_ttft_s, slo_tpot_s, token_budget)
                   for sizes in compositions(total, parts)]
        meeting = [r for r in results if r.share_within_slo >= target_share]
        if meeting:
            return max(meeting, key=lambda r: r.share_within_slo)
    return None
