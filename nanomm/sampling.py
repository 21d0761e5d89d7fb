"""Sampling parameters (vLLM's surface) and what they do to a row of logits.

Lesson: lessons/05-continuous-batching.md (sampling in the batch), lessons/08-speculative-decoding.md
(verification applies the same rules to every proposed position).

Every request samples with its own `torch.Generator`, kept on the host, so a seeded request draws the same tokens
whatever else shares its batch. A draw takes one uniform number from it (`next_uniform`) and picks the token whose
cumulative probability first passes it (`draw_tokens`, inverse-CDF sampling), so the sampled rows of a step that
share their settings are drawn together, in a few kernels however many there are. (With speculative decoding the
draws come in another order and how many proposals a step verifies can depend on the batch, so a seed's tokens
differ from those without it, in the same distribution; lessons/08-speculative-decoding.md.) Greedy is
temperature 0: a plain argmax, no randomness consumed.

The order is vLLM's (v1 sampler), so the same parameters mean the same distribution there and here:

1. `adjust_logits`, the processors that read the tokens so far: min_tokens (the stop tokens are masked until
   the output is long enough), then repetition_penalty over prompt and output ids (transformers' rule: a
   positive logit is divided by the penalty, a negative one multiplied), then frequency_penalty (times each
   token's count in the output) and presence_penalty (once per token present in the output), OpenAI's rule.
   Greedy decoding takes the argmax here.
2. `probabilities`, for sampling: divide by the temperature, then min_p (drop tokens less likely than min_p
   times the most likely one), top_k, top_p; softmax.

`logprobs` report the model's own distribution, log_softmax of the raw logits (vLLM's default
"raw_logprobs"), whatever the processing above; under `structured_outputs` the raw logits are the masked ones
(vLLM applies the grammar's mask before its sampler): nanomm/engine/structured.py.
"""

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from nanomm.errors import InvalidInputError, check_int, is_finite_number


GREEDY_BELOW_TEMPERATURE = 1e-5


@dataclass
class SamplingParams:
    """vLLM's `SamplingParams`, the fields one device can honour, in vLLM's order and with its defaults."""
    n: int = 1  # completions per prompt: the prompt is prefilled once, its KV blocks shared (prefix cache)
    presence_penalty: float = 0.0  # in [-2, 2]; 0 = off
    frequency_penalty: float = 0.0  # in [-2, 2]; 0 = off
    repetition_penalty: float = 1.0  # > 0; 1 = off
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # in (0, 1]; 1 = off
    top_k: int = 0  # 0 or -1 = off
    min_p: float = 0.0  # in [0, 1]; 0 = off
    seed: int | None = None  # with n > 1, completion i draws with seed + i
    stop: str | list[str] | None = None  # strings that end the output (not part of the text, unless asked)
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: until the context is full
    min_tokens: int = 0  # no stop token or stop string before this many tokens
    logprobs: int | None = None  # top-n log-probabilities per generated token (plus the token's own)
    prompt_logprobs: int | None = None  # the same for every prompt token (the first has none: None)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: "StructuredOutputsParams | None" = None  # the answer's shape (a JSON schema, regex, ...)

    def __post_init__(self):
        self.n = check_int(self.n, "n", error=InvalidInputError)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(is_finite_number(value) and -2 <= value <= 2, f"{name} must be in [-2, 2], got {value!r}")
        _check(is_finite_number(self.repetition_penalty) and self.repetition_penalty > 0,
               f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty!r}")
        _check(is_finite_number(self.temperature) and self.temperature >= 0,
               f"temperature must be a finite number >= 0, got {self.temperature!r}")
        _check(is_finite_number(self.top_p) and 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p!r}")
        self.top_k = check_int(self.top_k, "top_k (0 or -1 = off)", minimum=-1, error=InvalidInputError)
        _check(is_finite_number(self.min_p) and 0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p!r}")
        self._check_seed()
        self._check_stops()
        _check(isinstance(self.ignore_eos, bool), f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if self.max_tokens is not None:
            self.max_tokens = check_int(self.max_tokens, "max_tokens", error=InvalidInputError)
        self.min_tokens = check_int(self.min_tokens, "min_tokens", minimum=0, error=InvalidInputError)
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens,
               f"min_tokens={self.min_tokens} is larger than max_tokens={self.max_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                setattr(self, name, check_int(getattr(self, name), name, minimum=0, error=InvalidInputError))
        for name in ("skip_special_tokens", "include_stop_str_in_output"):
            _check(isinstance(getattr(self, name), bool), f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.structured_outputs is not None:  # its own module, loaded by the requests that ask for a shape
            from nanomm.structured_params import StructuredOutputsParams
            _check(isinstance(self.structured_outputs, StructuredOutputsParams), "structured_outputs must be a "
                   f"StructuredOutputsParams, got {type(self.structured_outputs).__name__}")

    def _check_seed(self) -> None:
        if self.seed is not None:
            self.seed = check_int(self.seed, "seed", minimum=-2**63, error=InvalidInputError)
            _check(self.seed < 2**64, f"seed must be an int in [-2**63, 2**64) or None, got {self.seed!r}")

    def _check_stops(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        _check(self.stop is None or (isinstance(self.stop, (list, tuple))
                                     and all(isinstance(s, str) and s for s in self.stop)),
               f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        _check(self.stop_token_ids is None or isinstance(self.stop_token_ids, (list, tuple)),
               f"stop_token_ids must be a list of non-negative ints, got {self.stop_token_ids!r}")
        for token_id in self.stop_token_ids or ():
            check_int(token_id, f"every stop_token_ids entry (in {self.stop_token_ids!r})", minimum=0,
                      error=InvalidInputError)

    def validate(self) -> "SamplingParams":
        """Check again (the fields are plain attributes: a caller may have changed one after construction)."""
        self.__post_init__()
        return self

    @property
    def greedy(self) -> bool:
        # Below this, dividing the logits by the temperature overflows float32: it means argmax anyway.
        return self.temperature < GREEDY_BELOW_TEMPERATURE

    @property
    def token_limit(self) -> int:
        """max_tokens, or no limit of its own (the context length still ends the output)."""
        return sys.maxsize if self.max_tokens is None else self.max_tokens

    @property
    def reads_history(self) -> bool:
        """Whether the logits depend on the tokens so far (penalties, min_tokens): then each row is adjusted."""
        return bool(self.min_tokens or self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0)


def __getattr__(name: str):
    if name == "StructuredOutputsParams":  # `from nanomm.sampling import StructuredOutputsParams`, as in vLLM
        from nanomm.structured_params import StructuredOutputsParams
        return StructuredOutputsParams
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _check(ok: bool, message: str):
    if not ok:
        raise InvalidInputError(message)


# The generation_config.json fields vLLM takes as sampling defaults (its get_diff_sampling_param); do_sample is
# not among them: a checkpoint that asks for near-greedy decoding does so through temperature, top_k and top_p.
GENERATION_CONFIG_FIELDS = {"repetition_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
                            "frequency_penalty": "frequency_penalty", "temperature": "temperature", "top_k": "top_k",
                            "top_p": "top_p", "min_p": "min_p", "max_new_tokens": "max_tokens",
                            "skip_special_tokens": "skip_special_tokens"}


def generation_defaults(folder, mode: str = "auto") -> SamplingParams:
    """The SamplingParams a call without any gets (vLLM's `generation_config` argument): "auto" reads the
    checkpoint folder's generation_config.json, "vllm" ignores it (vLLM's neutral defaults), any other string is
    a folder whose generation_config.json is read instead."""
    if mode == "vllm":
        return SamplingParams()
    path = Path(folder if mode == "auto" else mode) / "generation_config.json"
    if not path.is_file():
        if mode != "auto":
            raise ValueError(f"generation_config={mode!r}: no generation_config.json in that folder")
        return SamplingParams()
    raw = json.loads(path.read_text(encoding="utf-8"))
    fields = {ours: raw[theirs] for theirs, ours in GENERATION_CONFIG_FIELDS.items() if raw.get(theirs) is not None}
    try:
        return SamplingParams(**fields)
    except InvalidInputError as exc:
        raise ValueError(f"{path}: {exc}") from None


# -- step 1: the processors that read the tokens so far -----------------------------------------------------

def adjust_logits(logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int], output_ids: list[int],
                  stop_token_ids=()) -> torch.Tensor:
    """min_tokens, then repetition, frequency and presence penalties. logits (vocab,) -> (vocab,), a new tensor.
    stop_token_ids: what min_tokens holds back (the request's stop tokens, EOS included unless ignored)."""
    logits = logits.clone()
    vocab, device = logits.shape[-1], logits.device
    if len(output_ids) < params.min_tokens and stop_token_ids:
        logits[[t for t in stop_token_ids if t < vocab]] = float("-inf")
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt_ids) | set(output_ids)), dtype=torch.long, device=device)
        scores = logits[seen]
        logits[seen] = torch.where(scores > 0, scores / params.repetition_penalty, scores * params.repetition_penalty)
    if (params.frequency_penalty or params.presence_penalty) and output_ids:
        counts = torch.bincount(torch.tensor(output_ids, device=device), minlength=vocab)[:vocab].to(logits.dtype)
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


# -- step 2: temperature and the filters, for sampling -------------------------------------------------------

def greedy_tokens(logits: torch.Tensor, block: int = 128) -> torch.Tensor:
    """argmax over the vocabulary of each row of logits (rows, vocab) -> (rows,), the first maximum on ties.

    Two passes instead of one: the maximum of each block of `block` logits (a vectorised reduction), then the
    argmax among the block maxima and inside the winning block. On a CPU torch's single-pass argmax over a
    152k vocabulary is scalar code, ~7x slower than this at batch 32; the result is the same index: the first
    block holding the maximum holds its first occurrence."""
    rows, vocab = logits.shape
    if vocab % block or logits.device.type != "cpu":  # on a GPU the one-pass kernel is already fast
        return logits.argmax(dim=-1)
    blocks = logits.view(rows, vocab // block, block)  # (rows, blocks, block)
    best_block = blocks.amax(dim=-1).argmax(dim=-1)  # (rows,)
    within = blocks[torch.arange(rows, device=logits.device), best_block].argmax(dim=-1)  # (rows,)
    return best_block * block + within


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Pick the next token from float32 logits (vocab,), already adjusted by `adjust_logits`."""
    if params.greedy:
        return int(torch.argmax(logits))
    return sample_from(probabilities(logits, params), generator)


def next_uniform(generator: torch.Generator | None) -> float:
    """The next number in [0, 1) of a request's generator (a host one: None is torch's default). float32's 24
    bits keep u * total strictly below a row's total in `draw_tokens`."""
    return torch.rand(1, generator=generator).tolist()[0]


def draw_tokens(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: row i's token is the first whose cumulative probability passes uniforms[i] times the
    row's total. probs (rows, vocab), uniforms (rows,) -> token ids (rows,). A token of probability zero is never
    picked: its cumulative value equals the one before it, which did not pass."""
    cdf = probs.double().cumsum(dim=-1)  # (rows, vocab), in float64 so that no rounding moves a boundary
    target = uniforms.double()[:, None] * cdf[:, -1:]  # (rows, 1)
    return torch.searchsorted(cdf, target, right=True).squeeze(-1)


def sample_from(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from probs (vocab,), with the generator's next number: `draw_tokens` for a single row."""
    uniform = torch.tensor([next_uniform(generator)], device=probs.device)
    return int(draw_tokens(probs[None], uniform)[0])


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a sampled request draws from: softmax of the temperature-scaled logits after min_p,
    top-k and top-p. logits (..., vocab) -> probabilities (..., vocab). Speculative verification compares these."""
    scaled = logits / params.temperature
    return torch.softmax(filter_logits(filter_min_p(scaled, params.min_p), params.top_k, params.top_p), dim=-1)


def filter_min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Set to -inf the tokens whose probability is below min_p times the most likely token's."""
    if min_p <= 0:
        return logits
    probs = torch.softmax(logits, dim=-1)
    threshold = min_p * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(probs < threshold, float("-inf"))


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set the logits outside the top-k and outside the top-p nucleus to -inf (the most likely token stays)."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth_largest = torch.topk(logits, top_k).values[..., -1:]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        # Drop a token when the tokens ranked above it already reach top_p.
        drop_sorted = (cumulative - torch.softmax(sorted_logits, dim=-1)) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


# -- log-probabilities ----------------------------------------------------------------------------------------

def top_logprobs(logits: torch.Tensor, token_ids: list[int], num_top: int) -> list[dict[int, tuple[float, int]]]:
    """For each row of raw logits (rows, vocab) and the token chosen at it: {token id: (logprob, rank)} for the
    num_top most likely tokens and the chosen one. Rank 1 is the most likely token."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # (rows, vocab)
    top_values, top_ids = torch.topk(logprobs, min(num_top, logprobs.shape[-1]), dim=-1) if num_top else (None, None)
    rows = []
    for i, token in enumerate(token_ids):
        chosen = logprobs[i, token]
        entry = {token: (float(chosen), int((logprobs[i] > chosen).sum()) + 1)}
        if num_top:
            for rank, (value, top_id) in enumerate(zip(top_values[i].tolist(), top_ids[i].tolist()), start=1):
                entry.setdefault(top_id, (value, rank))
        rows.append(entry)
    return rows
