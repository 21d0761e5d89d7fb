"""The emulated device's model runner: the engine's own step, with the device's work replaced by its time.

Lesson: lessons/13-topologies.md (the emulated device).

Everything up to the device runs for real: the encoder cache is looked up and filled, the prefill passes images
and releases them, the scheduler's chunks arrive as they would. Then, instead of the tower and the forward pass,
the runner asks the cost model (emulate/costs.py) how long they would take and sleeps that long: the host is
free, as it is while a GPU computes. The tokens come from a stand-in that is a function of the request alone
(its prompt and seed) and the position, so an answer is the same whatever the batching or the topology, and
stop strings, max_tokens and the end-of-sequence token work as with a model.
"""

import math
import time
import zlib

import torch

from nanomm.emulate.costs import CostModel
from nanomm.engine.model_runner import ModelRunner, StepLogits, _wants_prompt_logprobs
from nanomm.engine.scheduler import ScheduledChunk
from nanomm.inputs.compression import VisualTokens

STAND_IN_MARGIN = 30.0  # the stand-in token's logit above every other: sampled at any temperature, ~always


class StandInTokens:
    """The token at each position of a request's answer: a hash of (the request's prompt and seed, position)
    over the ordinary tokens, and the end-of-sequence token once the answer reaches a length drawn the same way
    (between 16 and 512 tokens)."""

    def __init__(self, vocab_size: int, special_ids: set[int], eos_token_id: int):
        self.ordinary = [i for i in range(vocab_size) if i not in special_ids]
        self.eos_token_id = eos_token_id

    @staticmethod
    def seed(request) -> int:
        """The request's own number: its prompt and its sampling seed, hashed once and kept on the request."""
        if getattr(request, "stand_in_seed", None) is None:
            key = f"{request.prompt.token_ids}|{request.params.seed}".encode()
            request.stand_in_seed = zlib.crc32(key)
        return request.stand_in_seed

    def token(self, request, position: int) -> int:
        seed = self.seed(request)
        if position - request.num_prompt_tokens >= 16 + seed % 497:
            return self.eos_token_id
        return self.ordinary[zlib.crc32(f"{seed}:{position}".encode()) % len(self.ordinary)]


class EmulatedRunner(ModelRunner):
    """`ModelRunner` whose tower and forward pass take the cost model's time. `step_seconds` and
    `encode_seconds` list what each call was assigned (and `encoded_patches` what each encode was given)."""

    def __init__(self, model, kv_cache, block_size: int, encoder_cache, trace, costs: CostModel,
                 stand_in: StandInTokens, vocab_size: int):
        super().__init__(model, kv_cache, block_size, encoder_cache, trace)
        self.costs, self.stand_in, self.vocab_size = costs, stand_in, vocab_size
        self.device = torch.device("cpu")  # where the stand-in logits live: the meta model computes nothing
        self.step_seconds: list[float] = []
        self.encode_seconds: list[float] = []
        self.encoded_patches: list[list[int]] = []  # per encode call: each picture's patches

    def encode(self, images: list, urls: list) -> list[VisualTokens]:
        """The tower's time for these pictures, slept; one placeholder row a visual token (never read)."""
        patches = [math.prod(im.grid_thw) for im in images]
        seconds = self.costs.encode_seconds(patches)
        self.encoded_patches.append(patches)
        self.encode_seconds.append(seconds)
        time.sleep(seconds)
        self.visual_tokens_encoded += sum(im.num_encoded_tokens for im in images)
        return [VisualTokens(torch.zeros(im.num_tokens, 1), None) for im in images]

    def run(self, chunks: list[ScheduledChunk]) -> StepLogits:
        with self.trace.span("encode"):
            self._encode_images(chunks)
        with self.trace.span("forward", tokens=sum(c.num_tokens for c in chunks), sequences=len(chunks)):
            for chunk in chunks:
                self._visual_slices(chunk, 0, [])  # the prefill passes its images: their cache entries are let go
            seconds = self.costs.step_seconds([(c.num_tokens, c.end) for c in chunks])
            self.step_seconds.append(seconds)
            time.sleep(seconds)
            return StepLogits(self._sampling_logits(chunks), self._prompt_logits(chunks))

    def _sampling_logits(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """(sample rows, vocab): each row's stand-in token STAND_IN_MARGIN above the rest. A chunk's rows predict
        the positions after its last token and after each proposal."""
        targets = []
        for chunk in chunks:
            if chunk.samples_next_token:
                first = chunk.end - len(chunk.spec_token_ids)  # the position the first sampling row predicts
                targets += [self.stand_in.token(chunk.request, p) for p in range(first, chunk.end + 1)]
        logits = torch.zeros(len(targets), self.vocab_size)
        logits[torch.arange(len(targets)), torch.tensor(targets, dtype=torch.long)] = STAND_IN_MARGIN
        return logits

    def _prompt_logits(self, chunks: list[ScheduledChunk]) -> list:
        """Flat logits for the prompt rows of requests that asked for prompt_logprobs."""
        out = []
        for chunk in chunks:
            if _wants_prompt_logprobs(chunk):
                rows = max(0, min(chunk.end, chunk.request.num_prompt_tokens - 1) - chunk.start)
                if rows:
                    out.append((chunk, torch.zeros(rows, self.vocab_size)))
        return out
