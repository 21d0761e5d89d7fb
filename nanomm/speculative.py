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
from dataclasses import dataclass, replace

import torch

from nanomm.encoder_cache import EncoderCache, encoder_cache_key
from nanomm.kv_cache import BlockManager, allocate_kv_cache
from nanomm.model import Qwen2VL
from nanomm.model_runner import ModelRunner
from nanomm.outputs import RequestMetrics
from nanomm.sampling import probabilities
from nanomm.scheduler import Request, ScheduledChunk

METHODS = ("ngram", "draft")


@dataclass(frozen=True)
class SpeculativeConfig:
    """`LLM(speculative={...})`, vLLM's shape: {"method": "ngram", "num_speculative_tokens": k,
    "prompt_lookup_min": a, "prompt_lookup_max": b} or {"method": "draft", "model": path_or_id,
    "num_speculative_tokens": k}."""
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
        _check_positive("num_speculative_tokens", config.num_speculative_tokens)
        if method == "ngram":
            _check_positive("prompt_lookup_min", config.prompt_lookup_min)
            _check_positive("prompt_lookup_max", config.prompt_lookup_max)
            if config.prompt_lookup_min > config.prompt_lookup_max:
                raise ValueError(f"speculative: prompt_lookup_min={config.prompt_lookup_min} is larger than "
                                 f"prompt_lookup_max={config.prompt_lookup_max}")
        elif not isinstance(config.model, str) or not config.model:
            raise ValueError("speculative method 'draft' needs 'model': a checkpoint folder or hub id")
        return config


def _check_positive(key: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"speculative: {key} must be a positive int, got {value!r}")


@dataclass
class Proposal:
    tokens: list[int]
    probs: torch.Tensor | None = None  # (len(tokens), vocab) the draft's distributions q; None = deterministic


def proposal_budget(request: Request, k: int, max_model_len: int) -> int:
    """How many proposals are worth making: a step emits at most k + 1 tokens, and none past max_tokens or
    max_model_len (so speculation never needs more KV than the request could use anyway)."""
    left_to_generate = request.params.max_tokens - len(request.output_token_ids)
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


class DraftProposer:
    """A small model guesses k tokens autoregressively, one batched forward per token across requests.

    It has its own paged KV cache, block manager and encoder cache, and reuses the engine's ModelRunner: each
    request has a *draft sequence*, a `Request` of the draft's own (same prompt, own block table and computed
    count). Keeping it in step with the target is bookkeeping on that sequence:

    - catch-up: the first time, the draft prefills the whole prompt; later, whatever the target committed
      since (the accepted proposals and the target's own token) is fed in one chunk;
    - rollback: proposals the target rejected are dropped from the sequence, its computed count falls back
      to the longest prefix it shares with the request, and blocks past that return to the draft's pool.

    A draft with a vision tower sees the same images (encoded by its own tower: its visual tokens differ from
    the target's). A text-only draft (a Qwen2 checkpoint) sees the image span as its <|image_pad|> tokens,
    with plain 1-D positions, which is what a text model was trained on; see the lesson for why.
    """

    def __init__(self, model: Qwen2VL, num_kv_blocks: int, block_size: int, target_vocab_size: int,
                 encoder_cache_size: int):
        self.model, self.target_vocab_size = model, target_vocab_size
        text = model.config.text
        self.vocab_size = text.vocab_size
        self.blocks = BlockManager(num_kv_blocks, block_size, enable_prefix_caching=False)
        kv_cache = allocate_kv_cache(text.num_hidden_layers, num_kv_blocks, block_size, text.num_key_value_heads,
                                     text.head_dim, model.dtype, model.device)
        self.runner = ModelRunner(model, kv_cache, block_size, EncoderCache(encoder_cache_size))
        self.identity = f"draft:{getattr(model, 'name_or_path', 'model')}:{model.dtype}"
        self.sequences: dict[str, Request] = {}  # request id -> the draft's sequence for it

    @property
    def sees_images(self) -> bool:
        return self.model.visual is not None

    def propose(self, requests: list[Request], budgets: list[int]) -> list[Proposal]:
        """requests: every decoding request of this step. Sequences of any other request (finished, preempted,
        back in prefill) are dropped first; they catch up from scratch if they decode again."""
        for request_id in self.sequences.keys() - {r.request_id for r in requests}:
            self._drop(request_id)
        active = [(r, k) for r, k in zip(requests, budgets) if k and self._sync(r, k)]
        tokens = {r.request_id: [] for r, _ in active}
        probs = {r.request_id: [] for r, _ in active}
        # Round 0 feeds each sequence its catch-up tokens; round i > 0 feeds the proposal of round i - 1.
        for round_ in range(max((k for _, k in active), default=0)):
            batch = [(r, self.sequences[r.request_id]) for r, k in active if k > round_]
            logits = self.runner.run([ScheduledChunk(seq, seq.num_computed_tokens, seq.num_tokens -
                                                     seq.num_computed_tokens) for _, seq in batch])
            logits = self._to_target_vocab(logits)  # (len(batch), target vocab)
            for (request, seq), row in zip(batch, logits):
                seq.num_computed_tokens = seq.num_tokens
                token, q = self._draw(request, row)
                seq.token_ids.append(token)
                tokens[request.request_id].append(token)
                probs[request.request_id].append(q)
        self.runner.encoder_cache.trim()
        return [Proposal(tokens[r.request_id], None if r.params.greedy else torch.stack(probs[r.request_id]))
                if r.request_id in tokens else Proposal([]) for r in requests]

    def _sync(self, request: Request, k: int) -> bool:
        """Bring the draft sequence in line with the request's committed tokens and make room for k proposals
        (the last one is never fed, so k - 1 new slots past them). False when the draft's pool is full."""
        seq = self.sequences.get(request.request_id)
        if seq is None:
            prompt = request.prompt if self.sees_images else _without_images(request.prompt)
            seq = Request(request.request_id, prompt, request.params, None, frozenset(), RequestMetrics(0.0),
                          image_keys=[encoder_cache_key(im.content_hash, self.identity) for im in prompt.images])
            self.sequences[request.request_id] = seq
        shared = _common_prefix_length(seq.token_ids, request.token_ids)
        # Keep the KV of the shared prefix, but always feed at least the last token: its logits propose.
        seq.num_computed_tokens = min(seq.num_computed_tokens, shared, request.num_tokens - 1)
        seq.token_ids = list(request.token_ids)
        if max(seq.token_ids[seq.num_computed_tokens:]) >= self.vocab_size:
            self._drop(request.request_id)  # an id the draft's smaller vocabulary lacks: it cannot read this text
            return False
        self.blocks.shrink_to(seq.block_table, seq.num_computed_tokens)  # rollback: forget rejected proposals
        if not self.blocks.grow_to(seq.block_table, request.num_tokens + k - 1):
            self._drop(request.request_id)  # no room: no proposals this step; it catches up from scratch later
            return False
        return True

    def _draw(self, request: Request, logits: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        """The draft's token for one row: its argmax for a greedy request; a sample from its own filtered
        distribution q (kept for the acceptance rule) for a sampled one, with the request's generator."""
        if request.params.greedy:
            return int(logits.argmax()), None
        q = probabilities(logits, request.params)
        return int(torch.multinomial(q, 1, generator=request.generator)), q

    def _to_target_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Checkpoints pad their vocab differently (151936 vs 152064): cut or pad the draft's logits to the
        target's width; padded ids can never be proposed."""
        width = self.target_vocab_size
        if logits.shape[-1] >= width:
            return logits[..., :width]
        return torch.nn.functional.pad(logits, (0, width - logits.shape[-1]), value=float("-inf"))

    def release(self, request: Request) -> None:
        """The request finished: its draft sequence and blocks go."""
        self._drop(request.request_id)

    def _drop(self, request_id: str) -> None:
        seq = self.sequences.pop(request_id, None)
        if seq is not None:
            self.blocks.free(seq.block_table)
            for key in seq.held_images.values():
                self.runner.encoder_cache.release(key)
            seq.held_images.clear()

    def check_no_leaks(self) -> None:
        self.blocks.check_no_leaks()


def _without_images(prompt):
    """The prompt as a text-only draft sees it: the <|image_pad|> tokens stay, with 1-D positions 0..n-1."""
    n = len(prompt.token_ids)
    return replace(prompt, images=[], image_spans=[], positions=torch.arange(n).expand(3, n), rope_delta=0)


def _common_prefix_length(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


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
        u = torch.rand((), generator=generator, device=device)
        if u < acceptance_probability(p[x], q[x]):
            emitted.append(x)
            continue
        emitted.append(int(torch.multinomial(residual_distribution(p, q), 1, generator=generator)))
        return emitted
    emitted.append(int(torch.multinomial(target_probs[len(proposed)], 1, generator=generator)))
    return emitted


def make_proposer(config: SpeculativeConfig, draft_model: Qwen2VL | None, num_kv_blocks: int, block_size: int,
                  target_vocab_size: int, encoder_cache_size: int):
    if config.method == "ngram":
        return NgramProposer(config)
    return DraftProposer(draft_model, num_kv_blocks, block_size, target_vocab_size, encoder_cache_size)
