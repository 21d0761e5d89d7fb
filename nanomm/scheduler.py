"""Continuous batching with chunked prefill: one token budget per step, decodes first, preemption by recompute.

Lesson: lessons/05-continuous-batching.md.

Every request is "compute these positions": it has `num_tokens` known tokens (prompt + output so far) and
`num_computed_tokens` whose KV is in the cache. A decode needs 1 more position, a prefill many. Each step
hands out `max_num_batched_tokens` positions: running decodes first (so a long prefill never stalls the
requests already streaming), then running prefills, then new requests in arrival order, each taking a chunk
of what is left. A chunk may end anywhere, even inside an image's tokens.

Memory is the other budget. A request is admitted only when the blocks for its chunk are free (after
reusing whatever the prefix cache already holds). When the pool runs dry mid-decode, the most recently
admitted request is preempted: its blocks are freed and it goes back to the front of the queue, to be
recomputed later (its finished blocks often come straight back from the prefix cache).
"""

import time
from collections import deque
from dataclasses import dataclass, field
from enum import Enum

import torch

from nanomm.inputs import PreparedPrompt
from nanomm.kv_cache import BlockManager
from nanomm.outputs import RequestMetrics
from nanomm.sampling import SamplingParams


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    request_id: str
    prompt: PreparedPrompt
    params: SamplingParams
    generator: torch.Generator | None
    stop_token_ids: frozenset
    metrics: RequestMetrics
    token_ids: list[int] = field(default_factory=list)  # prompt + output, grows as tokens are sampled
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # of its full blocks, computed once
    status: Status = Status.WAITING
    finish_reason: str | None = None
    image_embeds: dict[int, torch.Tensor] = field(default_factory=dict)  # image index -> (tokens, hidden)
    num_preemptions: int = 0

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
        """(3, end - start) M-RoPE ids: the precomputed prompt ones, then index + rope delta on all axes."""
        prompt_end = min(end, self.num_prompt_tokens)
        parts = [self.prompt.positions[:, start:prompt_end]] if start < prompt_end else []
        if end > self.num_prompt_tokens:
            generated = torch.arange(max(start, self.num_prompt_tokens), end) + self.prompt.rope_delta
            parts.append(generated.expand(3, -1))
        return torch.cat(parts, dim=1)


@dataclass
class ScheduledChunk:
    request: Request
    start: int  # first position computed this step (= num_computed_tokens when scheduled)
    num_tokens: int

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def samples(self) -> bool:
        """A chunk that reaches the last known token yields logits for the next one."""
        return self.end == self.request.num_tokens


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.blocks = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledChunk]:
        budget = self.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        decodes = [r for r in self.running if r.num_remaining == 1]
        prefills = [r for r in self.running if r.num_remaining > 1]
        for request in decodes + prefills:
            if budget == 0:
                break
            if request.status is not Status.RUNNING:  # preempted earlier in this loop
                continue
            n = min(request.num_remaining, budget)
            if self._grow(request, n, chunks):
                chunks.append(ScheduledChunk(request, request.num_computed_tokens, n))
                budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
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
            needed = self.blocks.blocks_needed(request.num_computed_tokens + n) - len(request.block_table)
            if self.blocks.can_allocate(needed):
                request.block_table += self.blocks.allocate(needed)
                return True
            scheduled = {id(c.request) for c in chunks}
            victims = [r for r in self.running if r is not request and id(r) not in scheduled]
            self.preempt(victims[-1] if victims else request)
            if not victims:
                return False

    def _admit(self, request: Request, budget: int) -> ScheduledChunk | None:
        bs = self.blocks.block_size
        # The last prompt token is always computed (its logits pick the first output), so at most
        # (num_tokens - 1) // block_size full blocks can come from the cache.
        request.block_hashes = self.blocks.block_hashes(request.token_ids, request.prompt.image_spans,
                                                        (request.num_tokens - 1) // bs, request.block_hashes)
        cached = self.blocks.find_cached_prefix(request.block_hashes[:(request.num_tokens - 1) // bs])
        num_cached = len(cached) * bs
        n = min(request.num_tokens - num_cached, budget)
        new_blocks = self.blocks.blocks_needed(num_cached + n) - len(cached)
        if not self.blocks.can_allocate(new_blocks, cached):
            return None
        self.blocks.take_cached(cached)
        request.block_table = cached + self.blocks.allocate(new_blocks)
        request.num_computed_tokens = num_cached
        if request.metrics.first_scheduled_time is None:
            request.metrics.first_scheduled_time = time.perf_counter()
            request.metrics.num_cached_tokens = num_cached
            self.blocks.queried_tokens += request.num_tokens
            self.blocks.hit_tokens += num_cached
        request.status = Status.RUNNING
        self.running.append(request)
        return ScheduledChunk(request, num_cached, n)

    def preempt(self, request: Request) -> None:
        """Free a running request's blocks; it goes back to the head of the queue and is recomputed later."""
        self.running.remove(request)
        self.blocks.free(request.block_table)
        request.block_table, request.num_computed_tokens = [], 0
        request.status = Status.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def commit(self, chunk: ScheduledChunk) -> None:
        """After the model ran a chunk: its positions are computed; name the blocks that are now full."""
        request = chunk.request
        request.num_computed_tokens = chunk.end
        bs = self.blocks.block_size
        request.block_hashes = self.blocks.block_hashes(request.token_ids, request.prompt.image_spans,
                                                        request.num_computed_tokens // bs, request.block_hashes)
        self.blocks.register(request.block_table, request.block_hashes, request.num_computed_tokens)

    def finish(self, request: Request, reason: str) -> None:
        if request.status is Status.RUNNING:
            self.running.remove(request)
            self.blocks.free(request.block_table)
        elif request.status is Status.WAITING:
            self.waiting.remove(request)
        request.block_table = []
        request.image_embeds.clear()
        request.status, request.finish_reason = Status.FINISHED, reason
