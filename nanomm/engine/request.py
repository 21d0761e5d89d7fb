"""A request's state inside the engine: its tokens, where their KV lives, its images, and how it is sampled.

Lessons: lessons/04-paged-kv-cache.md (block tables), lessons/05-continuous-batching.md (num_computed_tokens).

`Sequence` is what the model runner and the block manager need to run a forward over a token sequence: the
known tokens, how many of them have their KV in the cache (`num_computed_tokens`), the block table and the
images. `Request` is a sequence that a caller asked for: sampling parameters, stop tokens, metrics, status.
The draft model of speculative decoding (draft.py) keeps a plain `Sequence` for every request it shadows.
"""

from dataclasses import dataclass, field
from enum import Enum

import torch

from nanomm.inputs.prompt import PreparedPrompt
from nanomm.outputs import RequestMetrics
from nanomm.sampling import SamplingParams


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    request_id: str
    prompt: PreparedPrompt
    image_keys: list[str] = field(default_factory=list)  # encoder-cache key of each image
    token_ids: list[int] = field(default_factory=list)  # prompt + output, grows as tokens are sampled
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    held_images: dict[int, str] = field(default_factory=dict)  # image index -> cache key held until prefill passes it

    def __post_init__(self):
        self.token_ids = list(self.prompt.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_remaining(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    def positions(self, start: int, end: int) -> torch.Tensor:
        """(3, end - start) M-RoPE ids: the precomputed prompt ones, then index + rope delta on all axes. The rows
        of a compressed image hold its origin: the model runner adds the kept tokens' coordinates (lesson 10)."""
        prompt_end = min(end, self.num_prompt_tokens)
        parts = [self.prompt.positions[:, start:prompt_end]] if start < prompt_end else []
        if end > self.num_prompt_tokens:
            generated = torch.arange(max(start, self.num_prompt_tokens), end) + self.prompt.rope_delta
            parts.append(generated.expand(3, -1))
        return torch.cat(parts, dim=1)

    def record_image_ready(self, cache_hit: bool, encode_s: float, on_this_device: bool = True) -> None:
        """The model runner made one of this sequence's images available (nothing to record for a draft)."""


@dataclass(kw_only=True)
class Request(Sequence):
    params: SamplingParams
    generator: torch.Generator | None
    stop_token_ids: frozenset
    metrics: RequestMetrics
    # Hashes of its full blocks, each computed once; only blocks whose KV is computed get registered for reuse.
    block_hashes: list[bytes] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str | None = None
    error: str | None = None  # why it ended with finish_reason "error", and the HTTP status that fits it
    error_status: int = 400
    num_preemptions: int = 0
    refused_for_kv: bool = False  # waiting after an allocation failure (already counted: scheduler.py)
    # Speculative decoding (speculative.py): this step's proposed next tokens and, from a sampling draft model,
    # the distributions they were drawn from (len(spec_token_ids), vocab).
    spec_token_ids: list[int] = field(default_factory=list)
    spec_token_probs: torch.Tensor | None = None
    # Parallel sampling (n > 1, parallel_sampling.py): which completion this is, and the sibling whose prompt
    # prefill it waits for, so that it finds the prompt's KV blocks in the prefix cache instead of computing them.
    completion_index: int = 0
    hands_off: bool = False  # a prefill instance's request: parked after its first token (handoff.py)
    encoder_url: str | None = None  # the encoder service its images go to; None: the engine's default
    waits_for_prefill_of: "Request | None" = None
    grammar: object | None = None  # structured outputs: its GrammarMatcher (structured.py), None if unconstrained

    @property
    def ready_to_prefill(self) -> bool:
        leader = self.waits_for_prefill_of
        return (leader is None or self.metrics.first_scheduled_time is not None  # started once: never waits again
                or leader.status is Status.FINISHED or leader.num_computed_tokens >= leader.num_prompt_tokens)

    def record_image_ready(self, cache_hit: bool, encode_s: float, on_this_device: bool = True) -> None:
        """encode_s: this request's share of the encode (a wait for the encoder service, not on_this_device, is
        not this device's time)."""
        self.metrics.encoder_cache_hits += cache_hit
        self.metrics.encode_s += encode_s
        if on_this_device:
            self.metrics.device_s += encode_s
