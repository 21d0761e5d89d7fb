"""What the engine hands back: RequestOutput (vLLM's shape) and per-request metrics.

Lesson: lessons/05-continuous-batching.md.
"""

from dataclasses import dataclass, field


@dataclass
class RequestMetrics:
    arrival_time: float  # time.perf_counter() when the request was added
    # TTFT = preprocess_s + queue_s + encode_s + prefill_s + transfer_s, exactly.
    preprocess_s: float = 0.0  # arrival -> pixels ready (validate, decode, resize, tokenise; pool queueing too)
    queue_s: float = 0.0  # pixels ready -> first scheduled (waiting for a seat, KV blocks, or, in LLM.generate,
    #                       for the other prompts' preprocessing)
    encode_s: float = 0.0  # vision encoder time spent on this request's images (0 on an encoder-cache hit)
    encode_ahead_s: float = 0.0  # the part of encode_s waited for an encoder service before it was scheduled
    prefill_s: float = 0.0  # first scheduled -> first token, encoding excluded (steps shared with other requests,
    #                         and steps it waited on the encoder budget, count here)
    transfer_s: float = 0.0  # a decode instance: pulling the prompt's KV from the prefill instance that ran it
    ttft_s: float | None = None  # arrival -> first token
    tpot_s: float | None = None  # mean time per output token after the first
    e2e_s: float | None = None  # arrival -> finished
    num_prompt_tokens: int = 0
    num_visual_tokens: int = 0  # the prompt's visual tokens, after compression (inputs/compression.py)
    num_encoded_visual_tokens: int = 0  # the vision tower's tokens for its images: before compression
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    encoder_cache_hits: int = 0
    # The device time it took: its encode share, plus its share, by tokens, of every step that ran it (its
    # chunk's positions over the step's). What cost per request is made of (serve/metrics.py).
    device_s: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    # Decode steps (every step after the first token) and speculative decoding (lessons/08).
    num_decode_steps: int = 0
    num_decode_tokens: int = 0  # tokens those steps emitted: 1 each without speculation
    num_draft_tokens: int = 0  # proposals verified
    num_accepted_tokens: int = 0  # proposals the target accepted

    def queue_and_prefill(self, ready_time: float, now: float) -> tuple[float, float]:
        """queue_s and prefill_s at the first token (now): an encode waited for before the first step is neither."""
        ahead, scheduled = self.encode_ahead_s, self.first_scheduled_time
        return scheduled - ready_time - ahead, now - scheduled - (self.encode_s - ahead)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_tokens_per_decode_step(self) -> float:
        return self.num_decode_tokens / self.num_decode_steps if self.num_decode_steps else 0.0


@dataclass
class Logprob:
    """vLLM's shape: a token's log-probability under the model, its rank (1 = most likely) and its text."""
    logprob: float
    rank: int
    decoded_token: str


@dataclass
class CompletionOutput:
    index: int  # which of the prompt's n completions
    token_ids: list[int]  # cumulative
    text: str  # cumulative
    finish_reason: str | None = None  # "stop", "length", "abort", "error"
    delta_token_ids: list[int] = field(default_factory=list)  # new this step
    delta_text: str = ""
    error: str | None = None
    error_status: int = 400  # over HTTP: 400 for bad input, 502/503/504 when a peer instance failed
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it; None for EOS
    cumulative_logprob: float | None = None  # sum of the tokens' logprobs, when logprobs were asked for
    logprobs: list[dict[int, Logprob]] | None = None  # per token: the top-n and the token itself


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]  # expanded
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # None for the first prompt token
    # A prefill instance's hand-off (vLLM's name): what a decode instance needs to continue (engine/handoff.py)
    kv_transfer_params: dict | None = None
