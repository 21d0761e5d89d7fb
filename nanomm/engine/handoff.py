"""Prefill here, decode there: the state a request carries from a prefill instance to a decode instance, and
`KVHandoffs`, the engine's part that parks, exports, expires and takes over such requests.

Lesson: lessons/13-three-topologies.md (the E+P+D topology).

A prefill instance runs a request's prompt, visual tokens included, and samples its first token. Then, instead
of decoding, it *parks* the request: the request leaves the scheduler, but its KV blocks stay taken, under a
transfer id, until a decode instance pulls them or a deadline passes (a decode peer that never comes must not
leak the pool). What travels is:

- the KV of every prompt position, as tensors (`gather_kv`): layers x (k, v) x tokens x KV heads x head_dim in
  the model's dtype, or an fp8 cache's codes and scales as stored. Positions, not blocks: the two instances may
  use different block sizes. A decode instance first takes whatever leading blocks its own prefix cache holds
  (`KVHandoffs.take_cached_prefix`) and pulls only the positions after them;
- the `Handoff` (JSON): the prompt's token ids and image spans (the decode side names its blocks by the same
  chained hashes, so a later request finds them in its prefix cache), the M-RoPE delta (every later position is
  index + delta: the decode side never needs the prompt's pixels or positions), the first token with its
  logprobs, the prompt logprobs, the sampling generator's state (so seeded sampling goes on exactly as in one
  engine), and the TTFT stages spent so far.

The decode instance writes the KV into blocks of its own (`scatter_kv`), replays the first token through its
output processor (stop tokens, stop strings and max_tokens apply to it there, as in one engine), and decodes.
A transferred request cannot be recomputed where it is (its prompt's pixels never came): preempting it fails it
with a 503, so give decode instances KV room for their load (`nanomm-plan`).
"""

import base64
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field

import torch

from nanomm.engine.kv_fp8 import Fp8KVCache
from nanomm.engine.model_runner import token_slots
from nanomm.errors import InvalidInputError, PeerError
from nanomm.inputs.prompt import ImageSpan, PreparedPrompt
from nanomm.outputs import Logprob, RequestOutput

HANDOFF_STAGES = ("preprocess_s", "queue_s", "encode_s", "prefill_s")


@dataclass
class Handoff:
    transfer_id: str
    prompt_token_ids: list[int]
    image_spans: list[tuple[int, int, str]]  # (start, length, image content hash) per image
    rope_delta: int
    first_token: int
    first_logprobs: list[tuple[int, float, int]] | None  # (token, logprob, rank): the first token's top entries
    prompt_logprobs: list[list[tuple[int, float, int, str]] | None] | None
    generator_state: str | None  # base64 of torch.Generator.get_state(); None for greedy
    stages: dict[str, float] = field(default_factory=dict)  # the TTFT stages spent on the prefill instance
    num_visual_tokens: int = 0
    num_cached_tokens: int = 0
    remote_url: str | None = None  # where the KV is: set by whoever routes the request (the router)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def spans(self) -> list[ImageSpan]:
        return [ImageSpan(start, length, content_hash) for start, length, content_hash in self.image_spans]

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, params, vocab_size: int) -> "Handoff":
        """A handoff from a request's kv_transfer_params; InvalidInputError names what is malformed."""
        try:
            handoff = cls(**{k: v for k, v in params.items() if k != "do_remote_decode"})
            ids = handoff.prompt_token_ids
            well_formed = (
                isinstance(handoff.transfer_id, str) and isinstance(handoff.remote_url, str)
                and isinstance(ids, list) and ids and all(type(t) is int and 0 <= t < vocab_size for t in ids)
                and type(handoff.first_token) is int and 0 <= handoff.first_token < vocab_size
                and type(handoff.rope_delta) is int
                and all(type(x) is int for span in handoff.image_spans for x in span[:2])
                and all(isinstance(v, (int, float)) for v in handoff.stages.values()))
        except (TypeError, AttributeError, ValueError) as exc:
            raise InvalidInputError(f"kv_transfer_params is not a handoff from a nanomm prefill instance "
                                    f"({type(exc).__name__} {exc})") from None
        if not well_formed:
            raise InvalidInputError("kv_transfer_params is not a handoff from a nanomm prefill instance (a field "
                                    "has the wrong type, or a token id is outside the vocabulary)")
        handoff.image_spans = [tuple(s) for s in handoff.image_spans]
        return handoff


def make_handoff(request, first_token: int, first_logprobs: dict | None, prompt_logprobs) -> Handoff:
    """A prefilled request's handoff (engine/request.py's Request), the moment its first token is sampled."""
    m, prompt, now = request.metrics, request.prompt, time.perf_counter()
    queue_s, prefill_s = m.queue_and_prefill(prompt.ready_time, now)
    stages = dict(preprocess_s=m.preprocess_s, queue_s=queue_s, encode_s=m.encode_s, prefill_s=prefill_s)
    return Handoff(uuid.uuid4().hex, list(prompt.token_ids),
                   [(s.start, s.length, s.content_hash) for s in prompt.image_spans], prompt.rope_delta,
                   first_token, logprob_entries(first_logprobs), prompt_logprob_entries(prompt_logprobs),
                   encode_generator(request.generator), stages, m.num_visual_tokens, m.num_cached_tokens)


def transferred_prompt(handoff: Handoff, text: str | None) -> PreparedPrompt:
    """The prompt as a decode instance holds it: token ids and image spans (for block hashes), the rope delta,
    no images and no positions: it is never computed here (the scheduler fails it rather than recompute it)."""
    now = time.perf_counter()
    return PreparedPrompt(text, handoff.prompt_token_ids, [], handoff.spans(), None, handoff.rope_delta, now,
                          arrival_time=now)


def first_token_logprobs(handoff: Handoff) -> list[dict] | None:
    """The first token's logprobs as the output processor takes them: [{token: (logprob, rank)}]."""
    if handoff.first_logprobs is None:
        return None
    return [{token: (value, rank) for token, value, rank in handoff.first_logprobs}]


def count_prefill_stages(metrics, handoff: Handoff, transfer_s: float) -> None:
    """A transferred request's TTFT: the prefill instance's stages, then the KV transfer; arrival moved back."""
    for stage in HANDOFF_STAGES:
        setattr(metrics, stage, handoff.stages.get(stage, 0.0))
    metrics.transfer_s = transfer_s
    metrics.num_visual_tokens = handoff.num_visual_tokens
    metrics.ttft_s = sum(handoff.stages.get(stage, 0.0) for stage in HANDOFF_STAGES) + transfer_s
    metrics.arrival_time = metrics.first_token_time - metrics.ttft_s
    if metrics.e2e_s is not None:  # finished at its first token
        metrics.e2e_s = metrics.ttft_s


def encode_generator(generator: torch.Generator | None) -> str | None:
    return None if generator is None else base64.b64encode(generator.get_state().numpy().tobytes()).decode()


def decode_generator(state: str | None) -> torch.Generator | None:
    """The sampling generator (a host one, as every request's: sampling.py), exactly where the prefill instance
    left it."""
    if state is None:
        return None
    generator = torch.Generator()
    try:
        generator.set_state(torch.frombuffer(bytearray(base64.b64decode(state)), dtype=torch.uint8))
    except (RuntimeError, ValueError) as exc:  # not base64, or not a generator's state
        raise InvalidInputError(f"kv_transfer_params: the sampling state does not fit a generator ({exc})") from None
    return generator


def logprob_entries(entry: dict[int, tuple[float, int]] | None) -> list[tuple[int, float, int]] | None:
    return None if entry is None else [(token, value, rank) for token, (value, rank) in entry.items()]


def prompt_logprob_entries(rows) -> list | None:
    """An output stream's prompt logprobs ({token: Logprob} per position, None first) as JSON lists."""
    if rows is None:
        return None
    return [None if row is None else [(t, lp.logprob, lp.rank, lp.decoded_token) for t, lp in row.items()]
            for row in rows]


def prompt_logprobs_from(entries) -> list | None:
    if entries is None:
        return None
    return [None if row is None else {t: Logprob(value, rank, text) for t, value, rank, text in row}
            for row in entries]


# -- the KV itself ------------------------------------------------------------------------------------------

def kv_layout(kv_cache, num_tokens: int) -> dict[str, tuple[torch.dtype, tuple]]:
    """What a transfer of num_tokens positions holds, by tensor name: (dtype, shape)."""
    if isinstance(kv_cache, Fp8KVCache):
        layers, two, _, heads, dim = kv_cache.codes.shape
        return {"codes": (torch.uint8, (layers, two, num_tokens, heads, dim)),
                "scales": (kv_cache.scales.dtype, (layers, two, num_tokens, heads))}
    layers, two, _, heads, dim = kv_cache.shape
    return {"kv": (kv_cache.dtype, (layers, two, num_tokens, heads, dim))}


def gather_kv(kv_cache, slots: torch.Tensor) -> dict[str, torch.Tensor]:
    """The stored KV of these slots (tokens,), every layer: copies, so the blocks can be freed at once."""
    slots = slots.to(kv_cache.device)
    if isinstance(kv_cache, Fp8KVCache):
        return {"codes": kv_cache.codes.index_select(2, slots), "scales": kv_cache.scales.index_select(2, slots)}
    return {"kv": kv_cache.index_select(2, slots)}  # (layers, 2, tokens, kv_heads, head_dim)


def scatter_kv(kv_cache, slots: torch.Tensor, tensors: dict[str, torch.Tensor]) -> None:
    """Write transferred KV (checked against `kv_layout` by the caller) into these slots."""
    slots = slots.to(kv_cache.device)
    if isinstance(kv_cache, Fp8KVCache):
        kv_cache.codes.index_copy_(2, slots, tensors["codes"].to(kv_cache.device))
        kv_cache.scales.index_copy_(2, slots, tensors["scales"].to(kv_cache.device))
    else:
        kv_cache.index_copy_(2, slots, tensors["kv"].to(kv_cache.device))


@dataclass
class ParkedRequest:
    """A prefilled request's KV blocks, kept for a decode peer until `deadline` (time.monotonic())."""
    block_table: list[int]
    num_tokens: int
    deadline: float


class ParkedRequests:
    """transfer id -> ParkedRequest; `expired` hands back those whose decode peer never came. Thread-safe: a KV
    export takes its request from an HTTP thread while the engine thread parks and expires others."""

    def __init__(self):
        self.by_id: dict[str, ParkedRequest] = {}
        self.lock = threading.Lock()

    def park(self, transfer_id: str, block_table: list[int], num_tokens: int, timeout_s: float) -> None:
        with self.lock:
            self.by_id[transfer_id] = ParkedRequest(block_table, num_tokens, time.monotonic() + timeout_s)

    def take(self, transfer_id: str, from_token: int = 0) -> ParkedRequest:
        """The parked request, gone from here (its blocks still taken); InvalidInputError, leaving it parked, for an
        unknown transfer or a from_token outside its prompt."""
        with self.lock:
            parked = self.by_id.get(transfer_id)
            if parked is None:
                raise InvalidInputError(f"no parked request {transfer_id!r} (never made, already taken, or expired)")
            if not 0 <= from_token <= parked.num_tokens:
                raise InvalidInputError(f"from_token={from_token} is outside the prompt's {parked.num_tokens} "
                                        "positions")
            return self.by_id.pop(transfer_id)

    def expired(self) -> list[ParkedRequest]:
        now = time.monotonic()
        with self.lock:
            gone = [t for t, p in self.by_id.items() if p.deadline <= now]
            return [self.by_id.pop(t) for t in gone]

    def __len__(self) -> int:
        return len(self.by_id)


class KVHandoffs:
    """The engine's side of the handoff (engine.py holds one as `engine.handoffs`). On a prefill instance it marks
    the requests that hand off (`mark`), parks each one after its first token (`park`) and gives its KV to the
    decode instance that pulls it (`export_kv`), or frees it when none comes (`expire`). On a decode instance it
    takes over a transferred request (`take_cached_prefix`, then `add_transferred`). A part of the engine, it
    runs the engine's own request steps: `_make_request`, `_add_to_scheduler`, `_finish`, `_output`."""

    def __init__(self, engine):
        self.engine = engine
        self.parked = ParkedRequests()  # prefilled requests whose KV waits for a decode instance
        self.marked: dict[str, str | None] = {}  # requests to park after their first token -> the encoder each names

    # -- a prefill instance ----------------------------------------------------------------------------------

    def mark(self, request_id: str, params, encoder_url: str | None) -> None:
        """A prefill instance's request, maybe with the encoder service its router picked."""
        if params.n > 1:
            raise InvalidInputError(f"request {request_id}: n={params.n} is served by an integrated engine only; a "
                                    "prefill instance hands off one completion per request")
        if params.structured_outputs is not None:  # the grammar's state does not travel with the KV
            raise InvalidInputError(f"request {request_id}: structured_outputs are served by an integrated engine "
                                    "only; a prefill instance does not hand a grammar's state off")
        self.marked[request_id] = encoder_url

    def forget_marks(self, outputs: list[RequestOutput]) -> None:
        """Finished requests forget their mark (a marked one may end before its prefill: a bad image, an abort)."""
        for out in outputs:
            if out.finished:
                self.marked.pop(out.request_id, None)

    def park(self, request, emitted) -> RequestOutput:
        """The request leaves the scheduler with its first token; its blocks stay taken under a transfer id."""
        engine = self.engine
        stream = engine.output_processor.streams[request.request_id]
        handoff = make_handoff(request, emitted.token_ids[0], emitted.logprobs[0] if emitted.logprobs else None,
                               stream.prompt_logprobs)
        self.parked.park(handoff.transfer_id, request.block_table, request.num_computed_tokens,
                         engine.config.kv_handoff_timeout_s)
        engine.scheduler.detach(request)
        engine._finish(request, "handoff")
        output = engine._output(request, [])
        output.kv_transfer_params = handoff.to_json()
        return output

    def export_kv(self, transfer_id: str, from_token: int) -> tuple[dict[str, torch.Tensor], int]:
        """A parked request's KV from position from_token on (its tensors, and its number of positions); its
        blocks go back to the pool now. InvalidInputError for an unknown or expired transfer."""
        tensors, num_tokens, block_table = self.take_parked_kv(transfer_id, from_token)
        self.free_blocks(block_table)
        return tensors, num_tokens

    def take_parked_kv(self, transfer_id: str, from_token: int) -> tuple[dict[str, torch.Tensor], int, list[int]]:
        """`export_kv` from any thread, without waiting for a step to end: the request leaves the parked set under
        its lock, and no step writes a parked request's blocks, so they are read while the engine runs. Its blocks
        stay taken; the caller frees them on the engine thread (`free_blocks`)."""
        parked = self.parked.take(transfer_id, from_token)
        slots = token_slots(parked.block_table, from_token, parked.num_tokens, self.engine.config.block_size)
        try:
            return gather_kv(self.engine.runner.kv_cache, slots), parked.num_tokens, parked.block_table
        except BaseException:
            self.parked.park(transfer_id, parked.block_table, parked.num_tokens, timeout_s=0.0)  # expiry frees it
            raise

    def expire(self) -> int:
        """Free the blocks of parked requests whose decode peer never came; how many there were."""
        expired = self.parked.expired()
        for parked in expired:
            self.free_blocks(parked.block_table)
        return len(expired)

    def free_blocks(self, block_ids: list[int]) -> None:
        self.engine.block_manager.free(block_ids)

    # -- a decode instance -----------------------------------------------------------------------------------

    def kv_layout(self, num_tokens: int) -> dict[str, tuple[torch.dtype, tuple]]:
        """What a pull of num_tokens positions into this engine's KV cache holds, by tensor name: (dtype, shape)."""
        return kv_layout(self.engine.runner.kv_cache, num_tokens)

    def take_cached_prefix(self, handoff: Handoff) -> list[int]:
        """Before it pulls: the leading blocks of the prompt this engine's prefix cache holds, taken (so they stay)
        until `add_transferred` uses them or `free_blocks` returns them."""
        blocks = self.engine.block_manager
        hashes = blocks.block_hashes(handoff.prompt_token_ids, handoff.spans(),
                                     handoff.num_tokens // self.engine.config.block_size, [])
        cached = blocks.find_cached_prefix(hashes)
        blocks.take_cached(cached)
        return cached

    def add_transferred(self, request_id: str, text: str | None, params, handoff: Handoff,
                        kv: dict[str, torch.Tensor], cached_blocks: list[int], transfer_s: float) -> str:
        """Take over a request a prefill instance ran: its KV after the cached blocks is `kv`. The cached blocks are
        the request's from here on, whatever happens (on an error they are freed). The first token goes through
        this engine's output processor, as if sampled here; its output is the next step's."""
        engine = self.engine
        try:
            request = self._transferred_request(request_id, text, params, handoff, cached_blocks)
        except BaseException:
            self.free_blocks(cached_blocks)
            raise
        bs = engine.config.block_size
        scatter_kv(engine.runner.kv_cache, token_slots(request.block_table, len(cached_blocks) * bs,
                                                       handoff.num_tokens, bs), kv)
        request.num_computed_tokens = handoff.num_tokens
        engine.scheduler.register_full_blocks(request)
        engine._add_to_scheduler(request, running=True)
        self._replay_first_token(request, handoff, transfer_s)
        return request_id

    def _transferred_request(self, request_id: str, text: str | None, params, handoff: Handoff,
                             cached_blocks: list[int]):
        """The Request, checked, with blocks for the prompt and the first token, before anything is written."""
        engine, blocks, name = self.engine, self.engine.block_manager, f"request {request_id}"
        params = engine._check_new_request(request_id, params)
        if params.n > 1:
            raise InvalidInputError(f"{name}: n > 1 is served by an integrated engine only")
        prompt = transferred_prompt(handoff, text)
        if handoff.num_tokens >= engine.config.max_model_len:
            raise InvalidInputError(f"{name}: {handoff.num_tokens} prompt tokens leave no room under "
                                    f"max_model_len={engine.config.max_model_len}")
        engine.intake.check_fits(prompt, params, name)
        new_blocks = blocks.blocks_needed(handoff.num_tokens + 1) - len(cached_blocks)
        if not blocks.can_allocate(new_blocks):
            raise PeerError(f"the decode instance has {blocks.num_free_blocks} free KV blocks; this request needs "
                            f"{new_blocks}: retry shortly", 503)
        request = engine._make_request(request_id, prompt, params)
        request.generator = decode_generator(handoff.generator_state)
        request.metrics.num_cached_tokens = handoff.num_cached_tokens
        request.block_table = cached_blocks + blocks.allocate(new_blocks)
        return request

    def _replay_first_token(self, request, handoff: Handoff, transfer_s: float) -> None:
        """The prefill instance's first token (and prompt logprobs), as if sampled here: stop rules apply to it."""
        engine, outputs = self.engine, self.engine.output_processor
        outputs.streams[request.request_id].prompt_logprobs = prompt_logprobs_from(handoff.prompt_logprobs)
        tokens, reason = outputs.take_tokens(request, [handoff.first_token], first_token_logprobs(handoff))
        request.token_ids += tokens
        outputs.record_tokens(request, len(tokens), finished=reason is not None)
        count_prefill_stages(request.metrics, handoff, transfer_s)
        if reason:
            engine._finish(request, reason)
        engine.intake.early_outputs.append(engine._output(request, tokens))
