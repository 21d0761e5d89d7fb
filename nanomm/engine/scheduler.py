"""Continuous batching with chunked prefill: one token budget per step, decodes first, preemption by recompute.

Lesson: lessons/05-continuous-batching.md.

Every request is "compute these positions": it has `num_tokens` known tokens (prompt + output so far) and
`num_computed_tokens` whose KV is in the cache. A decode needs 1 more position, a prefill many. Each step
hands out `max_num_batched_tokens` positions: running decodes first (so a long prefill never stalls the
requests already streaming), then running prefills, then new requests first come first served (in the order
their images finished preprocessing), each taking a chunk of what is left. A chunk may end anywhere, even inside an image's tokens.

Memory is the other budget. A request is admitted only when the blocks for its chunk are free (after
reusing whatever the prefix cache already holds). When the pool runs dry mid-decode, the most recently
admitted request is preempted: its blocks are freed and it goes back to the front of the queue, to be
recomputed later (its finished blocks often come straight back from the prefix cache).
"""

import time
from collections import deque
from dataclasses import dataclass, field

from nanomm.engine.encoder_cache import EncoderCache
from nanomm.engine.kv_cache import BlockManager
from nanomm.engine.request import Request, Sequence, Status
from nanomm.engine.null_trace import NoTrace


@dataclass
class ScheduledChunk:
    request: Sequence  # a Request, or a draft model's shadow of one (draft.py)
    start: int  # first position computed this step (= num_computed_tokens when scheduled)
    num_tokens: int  # positions computed this step, proposals included
    spec_token_ids: list[int] = field(default_factory=list)  # proposals to verify, after the known tokens

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def token_ids(self) -> list[int]:
        """The tokens at positions start..end-1: known ones, then the proposals."""
        return self.request.token_ids[self.start:self.end - len(self.spec_token_ids)] + self.spec_token_ids

    @property
    def samples_next_token(self) -> bool:
        """A chunk that reaches the last known token yields logits for the next one (and one more per proposal)."""
        return self.end - len(self.spec_token_ids) == self.request.num_tokens


class Scheduler:
    def __init__(self, block_manager: BlockManager, encoder_cache: EncoderCache, max_num_seqs: int,
                 max_num_batched_tokens: int, max_num_encoder_tokens: int, chunked_prefill: bool = True,
                 trace=None):
        self.block_manager, self.encoder_cache = block_manager, encoder_cache
        self.trace = trace or NoTrace()  # the step timeline (trace.py)
        self.chunked_prefill = chunked_prefill  # False: a prompt is admitted only when all of it fits this step
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_encoder_tokens = max_num_encoder_tokens  # visual tokens the vision tower may encode per step
        self._encoder_budget, self._images_this_step = 0, set()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order
        self.failed: list[Request] = []  # preempted requests that cannot be recomputed here: the engine reports them
        self.num_preemptions = 0
        # the OOM count: admissions refused for lack of KV blocks (once per wait), plus preemptions for lack of them
        self.num_kv_allocation_failures = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def add_running(self, request: Request) -> None:
        """A request whose prompt KV is already in its blocks (a decode instance's, engine/handoff.py)."""
        request.status = Status.RUNNING
        request.metrics.first_scheduled_time = time.perf_counter()
        self.running.append(request)

    def detach(self, request: Request) -> None:
        """Take a running request off the schedule, its blocks still taken (a prefill instance parks them)."""
        self.running.remove(request)
        request.block_table = []
        request.status = Status.FINISHED

    def take_failed(self) -> list[Request]:
        failed, self.failed = self.failed, []
        return failed

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledChunk]:
        budget = self.max_num_batched_tokens
        self._encoder_budget, self._images_this_step = self.max_num_encoder_tokens, set()
        chunks: list[ScheduledChunk] = []
        decodes = [r for r in self.running if r.num_remaining == 1]
        prefills = [r for r in self.running if r.num_remaining > 1]
        for request in decodes + prefills:
            if budget == 0:
                break
            if request.status is not Status.RUNNING:  # preempted earlier in this loop
                continue
            n = self._fit_encoder_budget(request, request.num_computed_tokens, min(request.num_remaining, budget))
            if n and self._grow(request, n, chunks):
                proposals = self._room_for_proposals(request, n, budget) if request.num_remaining == 1 else []
                chunks.append(ScheduledChunk(request, request.num_computed_tokens, n + len(proposals), proposals))
                budget -= n + len(proposals)
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            if not self.waiting[0].ready_to_prefill:
                break  # a sibling of parallel sampling waits for its leader's prompt blocks (parallel_sampling.py)
            chunk = self._admit(self.waiting[0], budget)
            if chunk is None:
                break  # first come, first served: nobody overtakes the head of the queue
            self.waiting.popleft()
            chunks.append(chunk)
            budget -= chunk.num_tokens
        return chunks

    def _grow(self, request: Request, n: int, chunks: list[ScheduledChunk]) -> bool:
        """Make room in request's block table for n more positions, preempting newer requests if needed."""
        while True:
            if self.block_manager.grow_to(request.block_table, request.num_computed_tokens + n):
                return True
            # Only requests admitted after this one, not yet given work this step: the newest goes first.
            scheduled = {id(c.request) for c in chunks}
            newer = self.running[self.running.index(request) + 1:]
            victims = [r for r in newer if id(r) not in scheduled]
            self.preempt(victims[-1] if victims else request)
            if not victims:
                return False

    def _room_for_proposals(self, request: Request, n: int, budget: int) -> list[int]:
        """A decode verifies its speculative proposals in the same pass, one more position each: as many as the
        token budget and the free blocks allow. Proposals are optional, so nobody is preempted for them."""
        proposals = request.spec_token_ids[:budget - n]
        end = request.num_computed_tokens + n
        while proposals and not self.block_manager.grow_to(request.block_table, end + len(proposals)):
            proposals = proposals[:-1]
        return proposals

    def _admit(self, request: Request, budget: int) -> ScheduledChunk | None:
        bs = self.block_manager.block_size
        # The last prompt token is always computed (its logits pick the first output), so at most
        # (num_tokens - 1) // block_size full blocks can come from the cache.
        request.block_hashes = self.block_manager.block_hashes(request.token_ids, request.prompt.image_spans,
                                                        (request.num_tokens - 1) // bs, request.block_hashes)
        cached = self.block_manager.find_cached_prefix(request.block_hashes[:(request.num_tokens - 1) // bs])
        if request.params.prompt_logprobs is not None:
            cached = []  # cached positions have no logits: compute the whole prompt (as vLLM does)
        num_cached = len(cached) * bs
        n = self._fit_encoder_budget(request, num_cached, min(request.num_tokens - num_cached, budget))
        new_blocks = self.block_manager.blocks_needed(num_cached + n) - len(cached)
        whole = self.chunked_prefill or num_cached + n == request.num_tokens
        if n == 0 or not whole:
            return None
        if not self.block_manager.can_allocate(new_blocks, cached):
            self._count_refusal(request)
            return None
        request.refused_for_kv = False
        self.block_manager.take_cached(cached)
        request.block_table = cached + self.block_manager.allocate(new_blocks)
        request.num_computed_tokens = num_cached
        if request.metrics.first_scheduled_time is None:
            request.metrics.first_scheduled_time = time.perf_counter()
            request.metrics.num_cached_tokens = num_cached
            self.block_manager.count_prefix_lookup(request.num_tokens, num_cached)
        request.status = Status.RUNNING
        self.running.append(request)
        return ScheduledChunk(request, num_cached, n)

    def _count_refusal(self, request: Request) -> None:
        """An admission refused for lack of KV blocks is one allocation failure, however many steps the request
        then waits at the head of the queue."""
        if not request.refused_for_kv:
            request.refused_for_kv = True
            self.num_kv_allocation_failures += 1

    def _fit_encoder_budget(self, request: Request, start: int, n: int) -> int:
        """Shorten a chunk [start, start + n) so the images it must encode fit this step's encoder budget.

        An image the chunk touches must be encoded whole unless the request already holds it or the encoder
        cache has it. If it does not fit, the chunk stops just before the image (possibly at 0 tokens: the
        request waits for the next step). An image larger than the whole budget may go alone in a step of its
        own, or it could never run.
        """
        for i, span in enumerate(request.prompt.image_spans):
            if not span.overlaps(start, start + n):
                continue
            key = request.image_keys[i]
            if i in request.held_images or key in self.encoder_cache or key in self._images_this_step:
                continue
            cost = request.prompt.images[i].num_encoded_tokens  # the tower's tokens, before any compression
            fits = cost <= self._encoder_budget
            alone = self._encoder_budget == self.max_num_encoder_tokens  # nothing else encodes this step
            if not (fits or alone):
                return max(0, span.start - start)
            self._encoder_budget -= cost
            self._images_this_step.add(key)
        return n

    def release_images(self, request: Request) -> None:
        """Let go of the encoder-cache entries a request held for its prefill."""
        for key in request.held_images.values():
            self.encoder_cache.release(key)
        request.held_images.clear()

    def preempt(self, request: Request) -> None:
        """Free a running request's blocks; it goes back to the head of the queue and is recomputed later. A
        request whose prompt KV came from a prefill instance cannot be recomputed here: it fails instead."""
        self.num_kv_allocation_failures += 1  # a preemption is always for lack of KV blocks (`_grow`)
        if request.prompt.positions is None:
            request.error, request.error_status = ("the decode instance ran out of KV blocks, and a request whose "
                                                   "prompt was prefilled elsewhere cannot be recomputed here"), 503
            self.finish(request, "error")
            self.failed.append(request)
            return
        self.running.remove(request)
        self.block_manager.free(request.block_table)
        self.release_images(request)
        request.block_table, request.num_computed_tokens = [], 0
        request.status = Status.WAITING
        request.refused_for_kv = True  # counted here: its refused re-admissions are the same shortage
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        self.trace.preempted(request)

    def commit(self, chunk: ScheduledChunk, num_rejected: int = 0) -> None:
        """After the model ran a chunk and its new tokens were appended: its positions are computed, except the
        rejected proposals at its end, whose blocks go back to the pool (speculative rollback by position).
        Then name the blocks that are now full, so only committed tokens are ever found by the prefix cache."""
        request = chunk.request
        request.num_computed_tokens = min(chunk.end - num_rejected, request.num_tokens)
        self.block_manager.shrink_to(request.block_table, request.num_computed_tokens)
        self.register_full_blocks(request)

    def register_full_blocks(self, request: Request) -> None:
        """Name every block of the request that is full and computed, so that later requests find it."""
        bs = self.block_manager.block_size
        request.block_hashes = self.block_manager.block_hashes(request.token_ids, request.prompt.image_spans,
                                                        request.num_computed_tokens // bs, request.block_hashes)
        self.block_manager.register(request.block_table, request.block_hashes, request.num_computed_tokens)

    def stats(self) -> dict:
        return {"preemptions": self.num_preemptions, "kv_allocation_failures": self.num_kv_allocation_failures,
                "running": len(self.running), "waiting": len(self.waiting)}

    def finish(self, request: Request, reason: str) -> None:
        if request.status is Status.RUNNING:
            self.running.remove(request)
            self.block_manager.free(request.block_table)
        elif request.status is Status.WAITING:
            self.waiting.remove(request)
        request.block_table = []
        self.release_images(request)
        request.status, request.finish_reason = Status.FINISHED, reason
