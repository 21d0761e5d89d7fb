"""Sampling parameters and the per-request sampler: greedy, temperature, top-k, top-p, seeds.

Every request samples with its own `torch.Generator`, so a seeded request draws the same tokens whatever else
shares its batch. (With speculative decoding the draws come in another order and how many proposals a step
verifies can depend on the batch, so a seed's tokens differ from those without it, in the same distribution;
lessons/08-speculative-decoding.md.) Greedy is temperature 0: a plain argmax, no randomness consumed.
"""

from dataclasses import dataclass

import torch

from nanomm.errors import InvalidInputError, check_int, is_finite_number


GREEDY_BELOW_TEMPERATURE = 1e-5


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) = no top-k
    max_tokens: int = 16
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None

    def __post_init__(self):
        _check(is_finite_number(self.temperature) and self.temperature >= 0,
               f"temperature must be a finite number >= 0, got {self.temperature!r}")
        _check(is_finite_number(self.top_p) and 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p!r}")
        self.top_k = check_int(self.top_k, "top_k (0 or -1 = off)", minimum=-1, error=InvalidInputError)
        self.max_tokens = check_int(self.max_tokens, "max_tokens", error=InvalidInputError)
        _check(self.stop_token_ids is None or isinstance(self.stop_token_ids, (list, tuple)),
               f"stop_token_ids must be a list of non-negative ints, got {self.stop_token_ids!r}")
        for token_id in self.stop_token_ids or ():
            check_int(token_id, f"every stop_token_ids entry (in {self.stop_token_ids!r})", minimum=0,
                      error=InvalidInputError)
        _check(isinstance(self.ignore_eos, bool), f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if self.seed is not None:
            self.seed = check_int(self.seed, "seed", minimum=-2**63, error=InvalidInputError)
            _check(self.seed < 2**64, f"seed must be an int in [-2**63, 2**64) or None, got {self.seed!r}")

    def validate(self) -> "SamplingParams":
        """Check again (the fields are plain attributes: a caller may have changed one after construction)."""
        self.__post_init__()
        return self

    @property
    def greedy(self) -> bool:
        # Below this, dividing the logits by the temperature overflows float32: it means argmax anyway.
        return self.temperature < GREEDY_BELOW_TEMPERATURE


def _check(ok: bool, message: str):
    if not ok:
        raise InvalidInputError(message)


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Pick the next token from float32 logits (vocab,)."""
    if params.greedy:
        return int(torch.argmax(logits))
    return int(torch.multinomial(probabilities(logits, params), 1, generator=generator))


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a sampled request draws from: softmax of the temperature-scaled logits after top-k and
    top-p. logits (..., vocab) -> probabilities (..., vocab). Speculative verification compares these."""
    return torch.softmax(filter_logits(logits / params.temperature, params.top_k, params.top_p), dim=-1)


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
