"""The topology simulator's engine-faithful mode: nanomm's scheduler and the emulated device's cost model, in events.

    nanomm-bench simulate --emulate h200:qwen2-vl-2b --host-costs host.json --replay twin.json \
        --topologies integrated 1e1pd 1e1p1d 1e2p1d

Lesson: lessons/13-three-topologies.md (the simulator checked against the twin).

The stage model's engine (nanomm/sim/stages.py) prices a step per token (`StageCosts`); this one asks the cost
model that the emulated device sleeps on (nanomm/emulate/costs.py: `CostModel.step_seconds`, `encode_seconds`,
`transfer_seconds`), so a prediction and a run of `nanomm-serve --emulate` differ only in what the simulator
leaves out, never in a formula. What it models, as the engine does (engine/scheduler.py):

- a step: the running decodes first, then running prompts, then waiting prompts first come first served, within
  the token budget (max_num_batched_tokens) and max_num_seqs; attention's cost grows with each chunk's context;
- the encoder budget: a chunk that reaches a picture not yet encoded encodes it whole in its step, within
  max_num_encoder_tokens visual tokens (a larger picture goes alone); an engine's encoder cache (by picture
  key, unbounded here: nanomm's evicts past its size) and the prefix cache (the cached positions a replayed
  request's record names) skip work;
- the KV pool: blocks of block_size positions; a step that needs blocks the pool lacks preempts the newest
  running request, which is recomputed from the start (a transferred request cannot be: it fails);
- an encoder service: one job (a request's pictures) at a time, first come first served; a request reaching an
  engine sends its pictures there first and waits off the step for the answer and its link time (encode-ahead,
  as nanomm's engine does), so no step of the engine waits on a remote encode;
- the router's pick of a whole engine (dp<N>, <X>e<Y>pd): `routing="requests"` (the default), the one with the
  fewest requests queued or running; `"load"`, as the router's Pool.pick (the fewest outstanding prompt tokens,
  then the fewest sent); `"affinity"`, serve/affinity.py's policy over the request's prefix blocks and pictures
  (the keys a session's turns share, nanomm/sim/chats.py), within `affinity_slack` prompt tokens of the
  engine holding the fewest; each engine's prefix cache (by block key, unbounded here) then skips the blocks
  it holds, and every request counts its prefix-cache and encoder-cache hits (`cache_hits`);
- the router (<X>e<Y>p<Z>d): each request goes to the prefill instance with the least outstanding visual tokens (the
  first of equals), charged until its handoff, as `Router` picks; decode instances by their running requests;
- prefill then decode: a prompt's KV crosses the link to the decode instance, whose next step emits the
  first token together with the second.

What the host adds, measured on the twin (`nanomm-bench stage-costs --emulate`, `HostCosts`): each
engine step's host work (scheduling, sampling, outputs) as a + b x sequences (a term per token, c, is there for a
cost file that names it; the measurement leaves it at 0), and a request's
path outside the engines (HTTP, JSON, base64 and picture decoding, the router's hops, the stream back) as a
delay of a + b x body bytes per topology, fitted at a low rate where nothing queues. Left out: the host's
processes sharing the machine's cores under load (the twin's host should stay far from saturation: the load
generator reports its CPU share), link contention, tensor parallelism.
"""

from collections import deque
from dataclasses import asdict, dataclass, field

from nanomm.serve.affinity import DEFAULT_SLACK, CacheAffinity, PromptKeys
from nanomm.sim.events import EventClock, least_loaded
from nanomm.topology import Topology, parse_topology

HOST_KEYS = {"dp<N>": "integrated", "<X>e<Y>pd": "1e1pd", "<X>e<Y>p<Z>d": "1eNp1d"}  # HostCosts' key per shape


@dataclass
class HostCosts:
    """The host's share of the work, measured on the twin (`nanomm-bench stage-costs --emulate`)."""
    step_s: float = 0.0  # an engine step's host work: a + b x sequences + c x tokens
    step_s_per_sequence: float = 0.0
    step_s_per_token: float = 0.0
    request_s: dict = field(default_factory=dict)  # topology key -> a request's fixed delay outside the engines
    request_s_per_byte: dict = field(default_factory=dict)  # topology key -> its delay per byte of body
    body_bytes_per_pixel: float = 0.0  # a request body's bytes per picture pixel (the load's JPEGs, base64)

    def step(self, sequences: int, tokens: int) -> float:
        return self.step_s + self.step_s_per_sequence * sequences + self.step_s_per_token * tokens

    def request_delay(self, topology: Topology, body_bytes: int) -> float:
        key = HOST_KEYS[topology.shape]
        return self.request_s.get(key, 0.0) + self.request_s_per_byte.get(key, 0.0) * body_bytes

    @classmethod
    def from_json(cls, values: dict) -> "HostCosts":
        return cls(**{k: values[k] for k in asdict(cls()) if k in values})


@dataclass(frozen=True)
class EngineLimits:
    """What bounds a step, as the twin's engine is configured (`EmulatedDevice.size`)."""
    token_budget: int = 2048
    encoder_budget: int = 2048
    max_num_seqs: int = 64
    num_kv_blocks: int = 131072
    block_size: int = 16
    prefix_tokens: int = 16  # prompt positions before the first picture (the chat template's)
    patches_per_token: int = 4  # 2 x 2 patches merge into one visual token


class TwinCosts:
    """The device's times from the shared cost model, the host's from measurement, the engine's limits."""

    def __init__(self, device, host: HostCosts, limits: EngineLimits):
        self.device, self.host, self.limits = device, host, limits

    @classmethod
    def for_twin(cls, emulate: str, host: HostCosts) -> "TwinCosts":
        """The cost model and limits of `nanomm-serve --emulate GPU:MODEL` with its default engine config."""
        from nanomm.emulate import EmulatedDevice
        from nanomm.engine.config import EngineConfig

        device = EmulatedDevice.from_value(emulate)
        config, _ = device.size(EngineConfig(), device.image_config)
        vision = device.config.vision
        limits = EngineLimits(config.max_num_batched_tokens, config.max_num_encoder_tokens, config.max_num_seqs,
                              config.num_kv_blocks, config.block_size,
                              patches_per_token=vision.spatial_merge_size ** 2)
        return cls(device.costs, host, limits)

    def describe(self) -> dict:
        return {"gpu": asdict(self.device.gpu), "efficiency": asdict(self.device.efficiency),
                "model": asdict(self.device.shape), "host": asdict(self.host), "limits": asdict(self.limits)}

    def to_json(self, path: str) -> None:
        self.device.to_json(path)

    def encode_s(self, image_tokens: list[int]) -> float:
        return self.device.encode_seconds([t * self.limits.patches_per_token for t in image_tokens])

    def visual_link_s(self, image_tokens: list[int]) -> float:
        return self.device.transfer_seconds(sum(image_tokens) * self.device.shape.visual_token_bytes)

    def kv_link_s(self, positions: int) -> float:
        return self.device.transfer_seconds(positions * self.device.shape.kv_bytes_per_token)


@dataclass(eq=False)  # compared by identity: two requests may look alike
class TwinRequest:  # one request's progress in the engine it is in
    request: object  # SimRequest
    computed: int = 0  # positions whose KV is written
    generated: int = 0
    blocks: int = 0
    encoded: set = field(default_factory=set)  # indices of its pictures this engine holds
    transferred: bool = False
    first_token_s: float | None = None
    finish_s: float | None = None
    failed: bool = False
    handed_to: "TwinRequest | None" = None  # a prefill instance's request: its decode instance's copy
    release: object = None  # the router's charge for it, given back when its prefill instance answers
    prefix_hit: int | None = None  # prompt positions the engine's prefix cache held when it was admitted
    pictures_cached: set = field(default_factory=set)  # indices of its pictures the engine's encoder cache held

    @property
    def known(self) -> int:  # positions whose token is known: the prompt and the tokens generated so far
        return self.request.prompt_tokens + self.generated

    @property
    def remaining(self) -> int:  # positions to compute before the next token (a preempted request: all again)
        return max(1, self.known - self.computed) if self.generated else self.request.prompt_tokens - self.computed

    def image_spans(self, prefix_tokens: int) -> list[tuple[int, int]]:
        if self.request.image_offsets:  # a session's turn: each picture where its turn put it
            return list(zip(self.request.image_offsets, self.request.image_tokens))
        start, spans = prefix_tokens, []
        for tokens in self.request.image_tokens:
            spans.append((start, tokens))
            start += tokens
        return spans


class EncoderService:
    """First come first served, in batches: the jobs waiting when the tower frees (each a step's pictures) go into
    one vision forward, up to the encoder budget (the first always goes), as nanomm's encoder service batches its
    callers (serve/encoder_server.py); each job's `then` runs when its answer has crossed."""

    def __init__(self, clock, costs: TwinCosts):
        self.clock, self.costs, self.queue, self.busy, self.busy_s = clock, costs, deque(), False, 0.0

    def load(self) -> int:
        return len(self.queue) + self.busy

    def submit(self, image_tokens: list[int], then) -> None:
        self.queue.append((image_tokens, then))
        self._start()

    def _start(self) -> None:
        if self.busy or not self.queue:
            return
        batch = [self.queue.popleft()]
        tokens = sum(batch[0][0])
        while self.queue and tokens + sum(self.queue[0][0]) <= self.costs.limits.encoder_budget:
            tokens += sum(self.queue[0][0])
            batch.append(self.queue.popleft())
        seconds = self.costs.encode_s([t for image_tokens, _ in batch for t in image_tokens])
        self.busy, self.busy_s = True, self.busy_s + seconds
        self.clock.at(self.clock.now + seconds, self.batch_done, batch)

    def batch_done(self, batch: list) -> None:
        self.busy = False
        for image_tokens, then in batch:
            self.job_done(image_tokens, then)
        self._start()

    def job_done(self, image_tokens: list[int], then) -> None:
        """One job's pictures are encoded: their tokens cross to the engine that asked."""
        self.clock.at(self.clock.now + self.costs.visual_link_s(image_tokens), then)


class TwinEngine:
    """An engine instance: role "integrated" (its own tower), "lm" (an encoder service's), "prefill" (hands each
    request on after its prompt) or "decode" (takes them over)."""

    def __init__(self, clock, costs: TwinCosts, role: str, encoders: list | None = None, hand_off=None):
        self.clock, self.costs, self.role, self.encoders, self.hand_off = clock, costs, role, encoders, hand_off
        self.waiting, self.running = deque(), []
        self.free_blocks = costs.limits.num_kv_blocks
        self.cached_pictures: set = set()  # the encoder cache's keys
        self.cached_blocks: set = set()  # the prefix cache's block keys
        self.busy, self.busy_s = False, 0.0

    def load(self) -> int:
        return len(self.waiting) + len(self.running)

    def outstanding_tokens(self) -> int:
        """The prompt tokens of the requests it holds, as the router counts an engine's work."""
        return sum(t.request.prompt_tokens for t in self.waiting) + sum(t.request.prompt_tokens for t in self.running)

    def submit(self, track: TwinRequest) -> None:
        """A prompt to run. With an encoder service, its pictures the cache lacks go there first, and the request
        waits off the step until they have crossed (encode-ahead, as nanomm's engine/encode_ahead.py)."""
        missing = self._missing_pictures(track) if self.encoders else []
        if self.encoders:  # encode-ahead asks the encoder cache first (the prefix cache, later, may cover more)
            track.pictures_cached |= {i for i in range(len(track.request.image_tokens)) if i not in missing
                                      and self._key(track, i) in self.cached_pictures}
        if not missing:
            self.waiting.append(track)
            self._start()
            return

        def landed() -> None:
            for index in missing:
                track.encoded.add(index)
                self.cached_pictures.add(self._key(track, index))
            self.waiting.append(track)
            self._start()

        encoder = min(self.encoders, key=lambda e: e.load())
        encoder.submit([track.request.image_tokens[i] for i in missing], landed)

    def _missing_pictures(self, track: TwinRequest) -> list[int]:
        """The indexes of the request's pictures that neither the cache nor an earlier picture of it holds."""
        missing, keys = [], set()
        for index in range(len(track.request.image_tokens)):
            key = self._key(track, index)
            if key not in self.cached_pictures and key not in keys:
                missing.append(index)
                keys.add(key)
        return missing

    def admit_transferred(self, track: TwinRequest) -> None:
        """A decode instance: the prompt's KV arrived; it decodes from the next step."""
        need = self._blocks_for(track.request.prompt_tokens + 1)
        if need > self.free_blocks:
            track.failed = True  # nanomm answers 503: it cannot recompute a prompt whose pixels never came
            return
        self.free_blocks -= need
        track.blocks, track.computed, track.generated, track.transferred = need, track.request.prompt_tokens, 1, True
        if track.request.output_tokens <= 1:  # the handed-off token was the whole answer
            track.first_token_s = track.finish_s = self.clock.now
            self.free_blocks += need
            return
        self.running.append(track)
        self._start()

    # -- one step --------------------------------------------------------------------------------------------

    def _start(self) -> None:
        if self.busy or not (self.waiting or self.running):
            return
        chunks, pictures = self._schedule()
        if not chunks:
            return
        self.busy = True
        started = self.clock.now
        host = self.costs.host.step(len(chunks), sum(n for _, n in chunks))
        runs = [(n, t.computed + n) for t, n in chunks]
        device = self.costs.device.step_seconds(runs)
        tokens = [t.request.image_tokens[i] for t, i in pictures]
        if not tokens:
            self.clock.at(started + host + device, self._done, chunks, started)
        elif self.role == "integrated":
            self.clock.at(started + host + self.costs.encode_s(tokens) + device, self._done, chunks, started)
        else:  # pictures not fetched ahead (none, with an unbounded cache): the service's answer, in the step
            def forward():
                self.clock.at(self.clock.now + device, self._done, chunks, started)

            encoder = min(self.encoders, key=lambda e: e.load())
            self.clock.at(started + host, encoder.submit, tokens, forward)
        for track, index in pictures:
            track.encoded.add(index)
            self.cached_pictures.add(self._key(track, index))

    def _schedule(self) -> tuple[list, list]:
        """(chunks [(request, positions)], pictures [(request, picture index)] to encode) for this step."""
        limits = self.costs.limits
        budget, state = limits.token_budget, {"encoder": limits.encoder_budget, "pictures": [], "keys": set()}
        chunks = []
        decodes = [t for t in self.running if t.remaining == 1]
        prompts = [t for t in self.running if t.remaining > 1]
        for track in decodes + prompts:
            if budget == 0:
                break
            if track not in self.running:  # preempted earlier in this loop
                continue
            found = []
            n = self._fit_encoder(track, track.computed, min(track.remaining, budget), state, found)
            if n and self._grow(track, n, chunks):
                chunks.append((track, n))
                state["pictures"] += found  # encoded only if its chunk runs (the budget is spent either way)
                budget -= n
        while self.waiting and budget > 0 and len(self.running) < limits.max_num_seqs:
            track = self.waiting[0]
            if track.computed == 0:
                cached = max(track.request.cached_tokens, self._prefix_held(track))
                track.computed = min(cached // limits.block_size * limits.block_size, track.request.prompt_tokens - 1)
                if track.prefix_hit is None:
                    track.prefix_hit = track.computed
            found = []
            n = self._fit_encoder(track, track.computed, min(track.remaining, budget), state, found)
            need = self._blocks_for(track.computed + n) - track.blocks
            if n == 0 or need > self.free_blocks:
                break  # first come, first served: nobody overtakes the head of the queue
            state["pictures"] += found
            self.waiting.popleft()
            self.free_blocks -= need
            track.blocks += need
            self.running.append(track)
            chunks.append((track, n))
            budget -= n
        return chunks, state["pictures"]

    def _fit_encoder(self, track: TwinRequest, start: int, n: int, state: dict, found: list) -> int:
        """The chunk shortened to stop before a picture that does not fit this step's encoder budget; the pictures
        it must encode go to `found`. A picture already taken this step (by its key) is not encoded twice."""
        limits = self.costs.limits
        for index, (span_start, tokens) in enumerate(track.image_spans(limits.prefix_tokens)):
            if span_start + tokens <= start or span_start >= start + n:
                continue
            key = self._key(track, index)
            if key in self.cached_pictures and index not in track.encoded:
                track.pictures_cached.add(index)
            if index in track.encoded or key in self.cached_pictures or key in state["keys"]:
                continue
            alone = state["encoder"] == limits.encoder_budget  # nothing else encodes this step
            if tokens > state["encoder"] and not alone:
                return max(0, span_start - start)
            state["encoder"] -= tokens
            state["keys"].add(key)
            found.append((track, index))
        return n

    def _grow(self, track: TwinRequest, n: int, chunks: list) -> bool:
        """Blocks for n more positions, preempting the newest running requests not in this step if needed."""
        while True:
            need = self._blocks_for(track.computed + n) - track.blocks
            if need <= self.free_blocks:
                self.free_blocks -= need
                track.blocks += need
                return True
            scheduled = {id(t) for t, _ in chunks}
            newer = self.running[self.running.index(track) + 1:]
            victims = [t for t in newer if id(t) not in scheduled]
            self._preempt(victims[-1] if victims else track)
            if not victims:
                return False

    def _preempt(self, track: TwinRequest) -> None:
        self.running.remove(track)
        self.free_blocks += track.blocks
        track.blocks = 0
        if track.transferred:
            track.failed = True
            return
        track.computed, track.encoded = 0, set()
        self.waiting.appendleft(track)

    def _done(self, chunks: list, started: float) -> None:
        now = self.clock.now
        self.busy_s += now - started
        for track, n in chunks:
            if track.failed or track not in self.running:
                continue
            track.computed += n
            if track.computed < track.known:
                continue  # a prompt chunk (or a preempted request's recompute): no token yet
            self.emit_token(track, now)
        self.running = [t for t in self.running if t.finish_s is None and not t.failed]
        self.busy = False
        self._start()

    def _prefix_held(self, track: TwinRequest) -> int:
        """Positions of the prompt's leading full blocks that this engine's prefix cache holds."""
        held, full = 0, track.request.prompt_tokens // self.costs.limits.block_size
        for key in track.request.block_keys[:full]:
            if key not in self.cached_blocks:
                break
            held += 1
        return held * self.costs.limits.block_size

    def _cache_blocks(self, track: TwinRequest) -> None:
        """Name the request's full, computed blocks (prompt, then answer) in the prefix cache, as nanomm does."""
        self.cached_blocks.update(track.request.block_keys[:track.computed // self.costs.limits.block_size])

    def emit_token(self, track: TwinRequest, now: float) -> None:
        self._cache_blocks(track)
        if track.generated == 0 and self.role == "prefill":
            self.running.remove(track)
            self.free_blocks += track.blocks  # the pull takes the KV right away (nanomm frees it as it leaves)
            track.blocks = 0
            self.hand_off(track)
            return
        if track.first_token_s is None:  # a decode instance's first step emits the handed-off token too
            track.first_token_s = now
        track.generated += 1
        if track.generated >= track.request.output_tokens:
            track.finish_s = now
            self.free_blocks += track.blocks
            track.blocks = 0

    def _blocks_for(self, positions: int) -> int:
        return -(-positions // self.costs.limits.block_size)

    @staticmethod
    def _key(track: TwinRequest, index: int):
        keys = track.request.image_keys
        return keys[index] if index < len(keys) else (track.request.id, index)


ROUTINGS = ("requests", "load", "affinity")


def prompt_keys_of(request, block_size: int) -> PromptKeys:
    """A simulated request's keys for the affinity policy: its prompt's full blocks and its pictures."""
    full = request.prompt_tokens // block_size
    return PromptKeys(tuple((key, block_size) for key in request.block_keys[:full]),
                      tuple(zip(request.image_keys, request.image_tokens)))


def engine_picker(routing: str, affinity_slack: float, block_size: int):
    """pick(engines, track) -> the engine a whole request goes to: "requests", the fewest queued or running (the
    first of equals); "load", as the router's `Pool.pick` (the fewest outstanding prompt tokens, then the fewest
    sent so far); "affinity", serve/affinity.py's policy over that load pick."""
    if routing not in ROUTINGS:
        raise ValueError(f"unknown routing {routing!r}; the routings are {list(ROUTINGS)}")
    if routing == "requests":
        return lambda engines, track: least_loaded(engines)
    routed, policy = {}, CacheAffinity(affinity_slack) if routing == "affinity" else None

    def pick(engines: list, track: TwinRequest):
        outstanding = {engine: engine.outstanding_tokens() for engine in engines}
        engine = min(engines, key=lambda e: (outstanding[e], routed.get(e, 0)))
        if policy is not None:
            engine = policy.pick(prompt_keys_of(track.request, block_size), outstanding, engine)
        routed[engine] = routed.get(engine, 0) + 1
        return engine

    return pick


def build_twin_pools(topology: Topology, clock, costs: TwinCosts, routing: str = "requests",
                     affinity_slack: float = DEFAULT_SLACK):
    """The instances of each pool, and the function an arriving request goes to (after its host delay)."""

    def delayed(entry):
        return lambda track: clock.at(clock.now + costs.host.request_delay(topology, track.request.body_bytes),
                                      entry, track)

    pick = engine_picker(routing, affinity_slack, costs.limits.block_size)
    if topology.shape == "dp<N>":
        workers = [TwinEngine(clock, costs, "integrated") for _ in range(topology.prefill)]
        return {"worker": workers}, delayed(lambda track: pick(workers, track).submit(track))
    encoders = [EncoderService(clock, costs) for _ in range(topology.encoders)]
    if topology.shape == "<X>e<Y>pd":
        lms = [TwinEngine(clock, costs, "lm", encoders) for _ in range(topology.prefill)]
        return {"encode": encoders, "lm": lms}, delayed(lambda track: pick(lms, track).submit(track))
    decodes = [TwinEngine(clock, costs, "decode") for _ in range(topology.decode)]

    def hand_off(track: TwinRequest) -> None:
        track.release()  # the prefill instance has answered the router
        taken = track.handed_to = TwinRequest(track.request)
        clock.at(clock.now + costs.kv_link_s(track.request.prompt_tokens),
                 lambda: least_loaded(decodes).admit_transferred(taken))

    prefills = [TwinEngine(clock, costs, "prefill", encoders, hand_off) for _ in range(topology.prefill)]
    outstanding = [0] * len(prefills)  # visual tokens each prefill instance holds, as the router counts them

    def route(track: TwinRequest) -> None:
        pick = min(range(len(prefills)), key=outstanding.__getitem__)
        work = sum(track.request.image_tokens)
        outstanding[pick] += work
        track.release = lambda: outstanding.__setitem__(pick, outstanding[pick] - work)
        prefills[pick].submit(track)

    return {"encode": encoders, "prefill": prefills, "decode": decodes}, delayed(route)


def final(track: TwinRequest) -> TwinRequest:
    """Where a request ended: the decode instance's copy of a handed-off one."""
    while track.handed_to is not None:
        track = track.handed_to
    return track


def outcome(track: TwinRequest) -> tuple[float, float, float] | None:
    """(TTFT, TPOT, finish time) of a request that finished, None for one that failed."""
    end = final(track)
    if end.failed or end.finish_s is None:
        return None
    r = end.request
    return (end.first_token_s - r.arrival_s, (end.finish_s - end.first_token_s) / max(1, r.output_tokens - 1),
            end.finish_s)


def cache_hits(tracks: list, prefix_tokens: int = 0) -> dict:
    """Over the requests an engine admitted: the share of prompt positions its prefix cache held, and the share
    of the pictures it had to embed (those past the prefix hit) that its encoder cache held."""
    admitted = [t for t in tracks if t.prefix_hit is not None]
    positions = sum(t.request.prompt_tokens for t in admitted)
    hit = sum(t.prefix_hit for t in admitted)
    past = [[i for i, (start, tokens) in enumerate(t.image_spans(prefix_tokens)) if start + tokens > t.prefix_hit]
            for t in admitted]  # the pictures each had to embed: those the prefix hit did not cover
    needed = sum(len(indices) for indices in past)
    cached = sum(len(t.pictures_cached.intersection(indices)) for t, indices in zip(admitted, past))
    return {"prefix_hit_rate": hit / positions if positions else 0.0,
            "encoder_hit_rate": cached / needed if needed else 0.0,
            "pictures_embedded": needed, "pictures_from_cache": cached}


def run_twin(topology: "str | Topology", costs: TwinCosts, requests: list, routing: str = "requests",
             affinity_slack: float = DEFAULT_SLACK) -> tuple[list, dict, dict]:
    """Every request through the topology: ([(TTFT, TPOT, finish) or None for a failed one], each pool's busy
    share, the caches' hits)."""
    clock = EventClock()
    workers, entry = build_twin_pools(parse_topology(topology), clock, costs, routing, affinity_slack)
    tracks = [TwinRequest(r) for r in requests]
    for track in tracks:
        clock.at(track.request.arrival_s, entry, track)
    clock.run()
    outcomes = [outcome(t) for t in tracks]
    end = max((final(t).finish_s or 0.0 for t in tracks), default=0.0)
    busy = {name: sum(w.busy_s for w in pool) / (len(pool) * end) if end else 0.0 for name, pool in workers.items()}
    return outcomes, busy, cache_hits(tracks, costs.limits.prefix_tokens)


def simulate_twin(topology: "str | Topology", costs: TwinCosts, requests: list) -> tuple[list, dict]:
    """run_twin's outcomes and busy shares, each request to the engine with the fewest requests."""
    outcomes, busy, _ = run_twin(topology, costs, requests)
    return outcomes, busy

