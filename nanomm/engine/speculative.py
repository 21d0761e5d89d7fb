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
from nanomm.sampling import (adjust_logits, draw_tokens, greedy_tokens, next_uniform, probabilities, sample_from,
                             top_logprobs)

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

def accept_greedy(proposed: list[int], target_argmax: list[int]) -> list[int]:
    """target_argmax[i] is the target's choice after the i-th proposal (len(proposed) + 1 rows). Emit the
    proposals up to the first disagreement, then the target's own token there (or the bonus after them all)."""
    emitted = []
    for token, target in zip(proposed, target_argmax):
        if token != target:
            break
        emitted.append(token)
    emitted.append(target_argmax[len(emitted)])
    return emitted


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


@dataclass
class SampledTokens:
    """What one sampling chunk adds to its request this step."""
    token_ids: list[int]  # the accepted proposals, then the target's own token
    num_accepted: int  # how many of token_ids were proposals
    logprobs: list[dict] | None = None  # per token, {token id: (logprob, rank)} when the request asked for them


def sample_and_verify(chunks, logits: torch.Tensor) -> list[SampledTokens]:
    """The tokens each sampling chunk emits, in order. logits (rows, vocab): 1 + len(spec_token_ids) rows per
    chunk, the row after each known token and after each proposal. Without proposals this is plain sampling;
    with them, the acceptance rules above. Greedy rows share one argmax; plain sampled rows that share their
    settings are drawn together (`draw_plain`), each with its own request's generator, and read back once per
    step. Penalties and min_tokens see, at each row, the output so far plus the proposals before it: the
    history that row would have in plain decoding."""
    greedy = any(c.request.params.greedy and not c.request.params.reads_history for c in chunks)
    argmax = greedy_tokens(logits).tolist() if greedy else []  # read back only when a greedy row takes it
    per_chunk, plain, row = [], {}, 0  # per chunk: (its first row, its tokens or None while drawn in a group)
    for chunk in chunks:
        request, proposed = chunk.request, chunk.spec_token_ids
        rows = 1 + len(proposed)
        raw = logits[row:row + rows] if proposed or request.params.reads_history else None  # (rows, vocab)
        adjusted = adjusted_rows(request, proposed, raw) if request.params.reads_history else None
        if request.params.greedy:
            chosen = adjusted.argmax(dim=-1).tolist() if adjusted is not None else argmax[row:row + rows]
            tokens = accept_greedy(proposed, chosen)
        elif not proposed:  # plain sampling: the same draw as accept_sampled's, made with its group's
            plain.setdefault(_settings(request.params), (request.params, []))[1].append(
                (len(per_chunk), request.generator, row if adjusted is None else adjusted[0]))
            tokens = None
        else:
            p = probabilities(raw if adjusted is None else adjusted, request.params)  # (rows, vocab)
            q = None if request.spec_token_probs is None else request.spec_token_probs[:rows - 1]
            tokens = accept_sampled(proposed, p, q, request.generator)
        per_chunk.append((row, tokens))
        row += rows
    drawn = draw_plain(plain, logits)  # the step's one read-back of sampled tokens
    emitted = []
    for i, (chunk, (row, tokens)) in enumerate(zip(chunks, per_chunk)):
        tokens = [drawn[i]] if tokens is None else tokens
        num_top = chunk.request.params.logprobs
        logprobs = None if num_top is None else top_logprobs(logits[row:row + len(tokens)], tokens, num_top)
        emitted.append(SampledTokens(tokens, len(tokens) - 1, logprobs))  # every token but the last was a proposal
    return emitted


def _settings(params) -> tuple:
    """What `probabilities` reads of a request's parameters: rows that agree on it share one call."""
    return params.temperature, params.min_p, params.top_k, params.top_p


def draw_plain(groups: dict, logits: torch.Tensor) -> dict[int, int]:
    """Plain sampled rows, by settings: {settings: (the parameters, [(chunk index, generator, its logits row's
    index, or its adjusted logits (vocab,))])}. One `probabilities` and one `draw_tokens` per group, each row
    with its generator's next number; then every token read back at once. Returns {chunk index: token}."""
    order, draws = [], []
    for params, entries in groups.values():
        rows = [r for _, _, r in entries]
        if all(isinstance(r, int) for r in rows):
            picked = logits.index_select(0, torch.tensor(rows, device=logits.device))  # (group rows, vocab)
        else:
            picked = torch.stack([logits[r] if isinstance(r, int) else r for r in rows])
        uniforms = torch.tensor([next_uniform(generator) for _, generator, _ in entries], device=logits.device)
        draws.append(draw_tokens(probabilities(picked, params), uniforms))
        order += [i for i, _, _ in entries]
    return dict(zip(order, torch.cat(draws).tolist())) if draws else {}


def adjusted_rows(request: Request, proposed: list[int], raw: torch.Tensor) -> torch.Tensor:
    """`adjust_logits` for each verification row: row i follows the output and the first i proposals."""
    prompt, output = request.prompt.token_ids, request.output_token_ids
    return torch.stack([adjust_logits(raw[i], request.params, prompt, output + proposed[:i], request.stop_token_ids)
                        for i in range(raw.shape[0])])
