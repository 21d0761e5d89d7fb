"""Speculative decoding: propose a few tokens cheaply, verify them all in one target forward, keep it exact.

Lesson: lessons/08-speculative-decoding.md.

A decode step reads every weight of the model to produce one token per sequence. Verifying k proposed tokens
costs about the same read (the weights are read once for k + 1 query positions), so a step whose proposals
are right emits up to k + 1 tokens for the price of one. The pieces:

- **Proposers** guess the next k tokens of a running request. `NgramProposer` looks the request's last few
  tokens up in its own prompt and output (prompt lookup: no extra model). `DraftProposer` runs a small model
  with its own paged KV cache, kept in step with the target (it catches up on whatever the target committed
  since last time and forgets what was rejected).
- **Verification** happens inside the continuous batcher: the scheduler gives a decoding request 1 + k query
  positions (scheduler.py), the model runner returns logits for all of them (model_runner.py), and the rules
  below decide which proposals stand. Rejected positions are simply not committed: the scheduler shrinks the
  block table back to the committed length.
- **Acceptance** keeps the output distribution exactly the target's. Greedy: keep the longest run of proposals
  that equal the target's argmax, then add the target's own token (the correction, or a bonus when all k
  match). Sampled: the rejection-sampling rule of Leviathan et al. and Chen et al. (2023): accept proposal x
  with probability min(1, p(x) / q(x)); on a rejection draw from the residual max(0, p - q), normalised; when
  all are accepted, draw a bonus token from p.
"""

from array import array
from dataclasses import dataclass

import torch

from nanomm.engine.request import Request
from nanomm.errors import check_int
from nanomm.sampling import next_uniform, sample_from

METHODS = ("ngram", "draft")


@dataclass(frozen=True)
class SpeculativeConfig:
    """`LLM(speculative_config={...})`, vLLM's shape: {"method": "ngram", "num_speculative_tokens": k,
    "prompt_lookup_min": a, "prompt_lookup_max": b} or {"method": "draft", "model": path_or_id,
    "num_speculative_tokens": k} ("draft_model", vLLM's name, or no method with a model, mean "draft")."""
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 2  # shortest suffix n-gram the n-gram proposer looks up
    prompt_lookup_max: int = 4  # longest; longer matches are tried first
    model: str | None = None  # the draft checkpoint (method "draft")

    @classmethod
    def from_dict(cls, raw) -> "SpeculativeConfig":
        if not isinstance(raw, dict):
            raise ValueError(f"speculative must be a dict like {{'method': 'ngram', 'num_speculative_tokens': 4}}, "
                             f"got {type(raw).__name__}")
        raw = dict(raw)
        if raw.get("method") is None and raw.get("model") is not None:
            raw["method"] = "draft"  # vLLM infers the draft-model method from a model path
        if raw.get("method") == "draft_model":
            raw["method"] = "draft"  # vLLM's name for it
        method = raw.get("method")
        if method not in METHODS:
            raise ValueError(f"speculative method must be one of {METHODS}, got {method!r}")
        allowed = {"method", "num_speculative_tokens"} | (
            {"prompt_lookup_min", "prompt_lookup_max"} if method == "ngram" else {"model"})
        if set(raw) - allowed:
            raise ValueError(f"speculative: keys {sorted(set(raw) - allowed)} are not for method {method!r} "
                             f"(it takes {sorted(allowed)})")
        if "num_speculative_tokens" not in raw:
            raise ValueError("speculative: num_speculative_tokens is required (how many tokens to propose per step)")
        config = cls(**raw)
        check_int(config.num_speculative_tokens, "speculative: num_speculative_tokens")
        if method == "ngram":
            check_int(config.prompt_lookup_min, "speculative: prompt_lookup_min")
            check_int(config.prompt_lookup_max, "speculative: prompt_lookup_max")
            if config.prompt_lookup_min > config.prompt_lookup_max:
                raise ValueError(f"speculative: prompt_lookup_min={config.prompt_lookup_min} is larger than "
                                 f"prompt_lookup_max={config.prompt_lookup_max}")
        elif not isinstance(config.model, str) or not config.model:
            raise ValueError("speculative method 'draft' needs 'model': a checkpoint folder or hub id")
        return config


@dataclass
class Proposal:
    tokens: list[int]
    probs: torch.Tensor | None = None  # (len(tokens), vocab) the draft's distributions q; None = deterministic


def proposal_budget(request: Request, k: int, max_model_len: int) -> int:
    """How many proposals are worth making: a step emits at most k + 1 tokens, and none past max_tokens or
    max_model_len (so speculation never needs more KV than the request could use anyway)."""
    left_to_generate = request.params.token_limit - len(request.output_token_ids)
    return max(0, min(k, left_to_generate - 1, max_model_len - request.num_tokens - 1))


# -- proposers ------------------------------------------------------------------------------------------------

def ngram_lookup(token_ids: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Prompt lookup: find the longest suffix n-gram (max_n down to min_n) that occurred earlier in token_ids,
    at its most recent earlier occurrence, and propose the k tokens that followed it.

    The copy may run into the tokens it is proposing (like an LZ77 copy), so a short cycle such as
    "a b a b" continues as "a b a b ..." for all k tokens. The search runs every step over the whole
    sequence, so it is done by `bytes.rfind` over 4 bytes per token (in C: ~16x faster than a Python loop
    at 4k tokens); a hit at an offset that is not a multiple of 4 straddles tokens and is skipped.
    """
    length = len(token_ids)
    data = array("i", token_ids).tobytes()
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix, end = data[-4 * n:], 4 * (length - 1)  # an earlier occurrence ends before the last token
        while (at := data.rfind(suffix, 0, end)) >= 0 and at % 4:
            end = at + 4 * n - 1  # misaligned: look further back
        if at >= 0:
            start = at // 4 + n  # the first token after the occurrence
            proposed = []
            for i in range(start, start + k):
                proposed.append(token_ids[i] if i < length else proposed[i - length])
            return proposed
    return []


class NgramProposer:
    def __init__(self, config: SpeculativeConfig):
        self.config = config

    def propose(self, requests: list[Request], budgets: list[int]) -> list[Proposal]:
        c = self.config
        return [Proposal(ngram_lookup(r.token_ids, k, c.prompt_lookup_min, c.prompt_lookup_max) if k else [])
                for r, k in zip(requests, budgets)]

    def release(self, request: Request) -> None:
        pass  # no state

    def check_no_leaks(self) -> None:
        pass


# -- verification ---------------------------------------------------------------------------------------------

def acceptance_probability(p_x: torch.Tensor, q_x: torch.Tensor) -> torch.Tensor:
    """Accept a proposal x drawn from q with probability min(1, p(x) / q(x))."""
    return torch.clamp(p_x / q_x, max=1.0)


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """After a rejection, draw from max(0, p - q), normalised: the part of p that q proposed too rarely.
    In exact arithmetic it is never all zero after a rejection (p(x) < q(x) leaves p - q > 0 somewhere); in
    float32, p and q a rounding error apart can make it so, and then p itself is the right distribution."""
    residual = torch.clamp(p - q, min=0.0)
    total = residual.sum()
    return residual / total if total > 0 else p


def accept_sampled(proposed: list[int], target_probs: torch.Tensor, draft_probs: torch.Tensor | None,
                   generator: torch.Generator | None) -> list[int]:
    """Rejection sampling. target_probs (len(proposed) + 1, vocab) is p after each proposal; draft_probs
    (len(proposed), vocab) is q, or None when the proposer is deterministic (q is then one-hot at the proposal,
    so x is accepted with probability p(x) and a rejection draws from p without x). With no proposals this is
    plain sampling from p."""
    device = target_probs.device
    emitted = []
    for i, x in enumerate(proposed):
        p = target_probs[i]
        q = draft_probs[i] if draft_probs is not None else torch.nn.functional.one_hot(
            torch.tensor(x, device=device), p.shape[-1]).to(p.dtype)
        if next_uniform(generator) < acceptance_probability(p[x], q[x]):
            emitted.append(x)
            continue
        emitted.append(sample_from(residual_distribution(p, q), generator))
        return emitted
    emitted.append(sample_from(target_probs[len(proposed)], generator))
    return emitted
