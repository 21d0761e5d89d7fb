"""The draft model of speculative decoding: a small model that proposes tokens, kept in step with the target.

Lesson: lessons/08-speculative-decoding.md. speculative.py has the other proposer (n-gram) and the acceptance
rules; this file is the draft model's bookkeeping.
"""

from dataclasses import replace

import torch

from nanomm.engine.encoder_cache import EncoderCache, encoder_cache_key
from nanomm.engine.kv_cache import BlockManager, allocate_kv_cache
from nanomm.engine.model_runner import ModelRunner
from nanomm.engine.request import Request, Sequence
from nanomm.engine.scheduler import ScheduledChunk
from nanomm.engine.speculative import Proposal
from nanomm.model.qwen2_vl import Qwen2VL
from nanomm.sampling import probabilities, sample_from


class DraftProposer:
    """A small model guesses k tokens autoregressively, one batched forward per token across requests.

    It has its own paged KV cache, block manager and encoder cache, and reuses the engine's ModelRunner: each
    request has a *draft sequence*, a plain `Sequence` of the draft's own (request.py: same prompt, own block
    table and computed count, no sampling state). Keeping it in step with the target is bookkeeping on that sequence:

    - catch-up: the first time, the draft prefills the whole prompt; later, whatever the target committed
      since (the accepted proposals and the target's own token) is fed in one chunk;
    - rollback: proposals the target rejected are dropped from the sequence, its computed count falls back
      to the longest prefix it shares with the request, and blocks past that return to the draft's pool.

    A draft with a vision tower sees the same images. Encoded by its own tower, its visual tokens differ from
    the target's; but a draft cut from its target (tools/draft_checkpoint.py) often keeps the target's tower
    unchanged, and then it shares the target's encoder cache (`shared_encoder_cache`): the pictures the target
    encoded cost the draft nothing. A text-only draft (a Qwen2 checkpoint) sees the image span as its
    <|image_pad|> tokens, with plain 1-D positions, which is what a text model was trained on; see the lesson.
    """

    def __init__(self, model: Qwen2VL, num_kv_blocks: int, block_size: int, target_vocab_size: int,
                 encoder_cache_size: int, shared_encoder_cache: tuple[EncoderCache, str] | None = None,
                 kv_cache_dtype: str = "auto"):
        """shared_encoder_cache: (the target's cache, the target's model identity), for a draft whose vision tower
        is the target's (`same_vision_tower`)."""
        self.model, self.target_vocab_size = model, target_vocab_size
        text = model.config.text
        self.vocab_size = text.vocab_size
        self.block_manager = BlockManager(num_kv_blocks, block_size, enable_prefix_caching=False)
        kv_cache = allocate_kv_cache(text.num_hidden_layers, num_kv_blocks, block_size, text.num_key_value_heads,
                                     text.head_dim, model.dtype, model.device, kv_cache_dtype)
        if shared_encoder_cache is None:
            shared_encoder_cache = EncoderCache(encoder_cache_size), f"draft:{model.name_or_path}:{model.dtype}"
        encoder_cache, self.model_identity = shared_encoder_cache
        self.runner = ModelRunner(model, kv_cache, block_size, encoder_cache)
        self.sequences: dict[str, Sequence] = {}  # request id -> the draft's sequence for it

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
                                                     seq.num_computed_tokens) for _, seq in batch]).sampling
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
            seq = Sequence(request.request_id, prompt,
                           [encoder_cache_key(im.content_hash, self.model_identity) for im in prompt.images])
            self.sequences[request.request_id] = seq
        shared = _common_prefix_length(seq.token_ids, request.token_ids)
        # Keep the KV of the shared prefix, but always feed at least the last token: its logits propose.
        seq.num_computed_tokens = min(seq.num_computed_tokens, shared, request.num_tokens - 1)
        seq.token_ids = list(request.token_ids)
        if max(seq.token_ids[seq.num_computed_tokens:]) >= self.vocab_size:
            self._drop(request.request_id)  # an id the draft's smaller vocabulary lacks: it cannot read this text
            return False
        self.block_manager.shrink_to(seq.block_table, seq.num_computed_tokens)  # rollback: forget rejected proposals
        if not self.block_manager.grow_to(seq.block_table, request.num_tokens + k - 1):
            self._drop(request.request_id)  # no room: no proposals this step; it catches up from scratch later
            return False
        return True

    def _draw(self, request: Request, logits: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        """The draft's token for one row: its argmax for a greedy request; a sample from its own filtered
        distribution q (kept for the acceptance rule) for a sampled one, with the request's generator."""
        if request.params.greedy:
            return int(logits.argmax()), None
        q = probabilities(logits, request.params)
        return sample_from(q, request.generator), q

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
            self.block_manager.free(seq.block_table)
            for key in seq.held_images.values():
                self.runner.encoder_cache.release(key)
            seq.held_images.clear()

    def check_no_leaks(self) -> None:
        """No draft sequence left, every draft KV block free, no draft encoder-cache entry held."""
        assert not self.sequences, f"draft sequences left: {sorted(self.sequences)[:10]}"
        self.block_manager.check_no_leaks()
        self.runner.encoder_cache.check_no_holds()


@torch.no_grad()
def same_vision_tower(target: Qwen2VL, draft: Qwen2VL) -> bool:
    """Do the two models turn a picture into the same visual tokens? Same config, dtype, device and weights."""
    if target.visual is None or draft.visual is None or target.config.vision != draft.config.vision:
        return False
    if (target.dtype, target.device) != (draft.dtype, draft.device):
        return False
    theirs = dict(draft.visual.named_parameters())
    return all(torch.equal(p, theirs[name]) for name, p in target.visual.named_parameters())


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
