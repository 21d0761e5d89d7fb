"""The emulated device's model runner: the engine's own step, with the device's work replaced by its time.

Lesson: lessons/13-three-topologies.md (the emulated device).

Everything up to the device runs for real: the encoder cache is looked up and filled, the prefill passes images
and releases them, the scheduler's chunks arrive as they would. Then, instead of the tower and the forward pass,
the runner asks the cost model (emulate/costs.py) how long they would take and sleeps that long: the host is
free, as it is while a GPU computes. The tokens come from a stand-in that is a function of the request alone
(its prompt, its pictures and its seed) and the position, so an answer is the same whatever the batching, and
stop strings, max_tokens and the end-of-sequence token work as with a model. The stand-in never repeats itself
the way a model does, so n-gram speculation finds nothing to propose on the twin.
"""

import math
import time
import zlib
from collections import deque

import torch

from nanomm.emulate.costs import CostModel
from nanomm.engine.model_runner import ModelRunner, StepLogits, _wants_prompt_logprobs
from nanomm.engine.scheduler import ScheduledChunk
from nanomm.inputs.compression import VisualTokens
from nanomm.errors import PeerError
from nanomm.transfer import HttpKVConnector, RemoteEncoder, pack

# The stand-in token's logit above the others' (0): at temperature T another token is drawn with probability about
# vocab x exp(-30 / T): 6e-11 at T = 1, 2e-4 at T = 2. The runner-up (for when the end of sequence is not allowed
# yet: min_tokens) sits halfway.
STAND_IN_MARGIN = 30.0
WIRE_WIDTH, WIRE_DTYPE = 1, torch.float32  # what crosses instead of (tokens, hidden) in bfloat16
RECORDED_CALLS = 10_000  # the last calls' assigned times the runner keeps (a server runs for days)


class StandInTokens:
    """The token at each position of a request's answer: a hash of (the request's prompt and seed, position)
    over the ordinary tokens, and the end-of-sequence token once the answer reaches a length drawn the same way
    (between 16 and 512 tokens)."""

    def __init__(self, vocab_size: int, special_ids: set[int], eos_token_id: int):
        self.ordinary = [i for i in range(vocab_size) if i not in special_ids]
        self.eos_token_id = eos_token_id

    @staticmethod
    def seed(request) -> int:
        """The request's own number, hashed once and kept on the request: its prompt, its pictures and its seed,
        and, for a sampled request without a seed, its id (so that n answers differ, as they would)."""
        if getattr(request, "stand_in_seed", None) is None:
            params = request.params
            unseeded = params.seed is None and not params.greedy
            own = request.request_id if unseeded else ""
            pictures = [span.content_hash for span in request.prompt.image_spans]  # a decode instance has them too
            key = f"{request.prompt.token_ids}|{pictures}|{params.seed}|{own}"
            request.stand_in_seed = zlib.crc32(key.encode())
        return request.stand_in_seed

    def tokens(self, request, position: int) -> tuple[int, int]:
        """(the token at this position, the runner-up): past the answer's drawn length, the end of sequence."""
        seed = self.seed(request)
        word = self.ordinary[zlib.crc32(f"{seed}:{position}".encode()) % len(self.ordinary)]
        if position - request.num_prompt_tokens >= 16 + seed % 497:
            return self.eos_token_id, word
        return word, self.ordinary[zlib.crc32(f"{seed}:{position}:2".encode()) % len(self.ordinary)]


def wire_placeholder(num_tokens: int) -> torch.Tensor:
    """What an emulated encoder service sends for a picture's visual tokens: (tokens, 1) zeros."""
    return torch.zeros(num_tokens, WIRE_WIDTH, dtype=WIRE_DTYPE)


class EmulatedRemoteEncoder(RemoteEncoder):
    """The engine's side of an emulated encoder service: placeholders on the wire; the link's time for the real
    bytes slept; the real bytes counted as received."""

    def __init__(self, url: str, costs, timeout_s: float, wait):
        super().__init__(url, WIRE_WIDTH, WIRE_DTYPE, torch.device("cpu"), timeout_s)
        self.costs, self.wait = costs, wait

    def encode(self, images: list, url: str | None = None) -> list[VisualTokens]:
        tokens = super().encode(images, url)
        self.wait(self.costs.transfer_seconds(self.received_bytes(b"", images)))
        return tokens

    def received_bytes(self, answer: bytes, images: list) -> int:
        """The real visual tokens' bytes, where placeholders crossed."""
        return sum(im.num_tokens for im in images) * self.costs.shape.visual_token_bytes


class EmulatedKVConnector(HttpKVConnector):
    """A KV transfer between emulated instances: the same GET and the same checks, but one byte a position
    crosses instead of the real KV (whose pool lives on the meta device); the real KV's bytes are counted on both
    sides and the link's time for them is slept by the puller."""

    def __init__(self, costs, timeout_s: float):
        super().__init__(timeout_s)
        self.costs = costs

    def wait(self, seconds: float) -> None:
        """The link's time: the host sleeps, as while a NIC moves the bytes."""
        time.sleep(seconds)

    def export(self, tensors, from_token, num_tokens):
        wire = {name: torch.zeros(num_tokens - from_token, dtype=torch.uint8) for name in tensors}  # (positions,)
        body = pack(wire, {"from_token": from_token, "num_tokens": num_tokens})
        return body, sum(t.numel() * t.element_size() for t in tensors.values())

    def pull(self, remote_url, transfer_id, from_token, num_tokens, layout):
        wire, peer, _ = self.receive(remote_url, transfer_id, from_token, num_tokens)
        positions = num_tokens - from_token
        if set(wire) != set(layout) or any(t.dtype != torch.uint8 or tuple(t.shape) != (positions,)
                                           for t in wire.values()):
            raise PeerError(f"{peer} sent {sorted(wire)}, not {sorted(layout)} placeholders (one byte a position) "
                            f"for positions {from_token}..{num_tokens}")
        tensors = {name: torch.empty(shape, dtype=dtype, device="meta") for name, (dtype, shape) in layout.items()}
        real = sum(t.numel() * t.element_size() for t in tensors.values())
        self.wait(self.costs.transfer_seconds(real))
        return tensors, real


class EmulatedRunner(ModelRunner):
    """`ModelRunner` whose tower and forward pass take the cost model's time. `step_seconds` and
    `encode_seconds` list what each call was assigned (and `encoded_patches` what each encode was given)."""

    def __init__(self, model, kv_cache, block_size: int, encoder_cache, trace, costs: CostModel,
                 stand_in: StandInTokens, vocab_size: int, remote_encoder: RemoteEncoder | None = None):
        """remote_encoder: the engine's, for an emulated encoder service; replaced by one that takes placeholders."""
        remote = None if remote_encoder is None else EmulatedRemoteEncoder(
            remote_encoder.url, costs, remote_encoder.timeout_s, self.wait)
        super().__init__(model, kv_cache, block_size, encoder_cache, trace, remote_encoder=remote)
        self.costs, self.stand_in, self.vocab_size = costs, stand_in, vocab_size
        self.device = torch.device("cpu")  # where the stand-in logits live: the meta model computes nothing
        self.step_seconds = deque(maxlen=RECORDED_CALLS)
        self.encode_seconds = deque(maxlen=RECORDED_CALLS)
        self.encoded_patches = deque(maxlen=RECORDED_CALLS)  # per encode call: each picture's patches
        text, vision = model.config.text, model.config.vision
        self.visual_shape = (1 + len(vision.deepstack_visual_indexes), text.hidden_size)  # (levels, hidden)

    def wait(self, seconds: float) -> None:
        """The device's time: the host sleeps, free for other work, as while a GPU computes."""
        time.sleep(seconds)

    def encode(self, images: list, urls: list) -> list[VisualTokens]:
        """The tower's time for these pictures, slept (or the encoder service's answer, and the link's time);
        visual tokens of the real shape on the meta device (never read)."""
        if self.remote_encoder is not None:
            return [VisualTokens(self._placeholder(t.embeds.shape[0]), t.coords) for t in super().encode(images, urls)]
        patches = [math.prod(im.grid_thw) for im in images]
        seconds = self.costs.encode_seconds(patches)
        self.encoded_patches.append(patches)
        self.encode_seconds.append(seconds)
        self.wait(seconds)
        self.visual_tokens_encoded += sum(im.num_encoded_tokens for im in images)
        return [VisualTokens(self._placeholder(im.num_tokens), None) for im in images]

    def _placeholder(self, num_tokens: int) -> torch.Tensor:
        """Visual tokens of the real model's shape and dtype on the meta device: the encoder cache counts their
        bytes, and nothing ever reads them. ([levels,] tokens, hidden)"""
        levels, hidden = self.visual_shape
        shape = (num_tokens, hidden) if levels == 1 else (levels, num_tokens, hidden)
        return torch.empty(shape, dtype=torch.bfloat16, device="meta")

    def run(self, chunks: list[ScheduledChunk]) -> StepLogits:
        with self.trace.span("encode"):
            self._encode_images(chunks)
        with self.trace.span("forward", tokens=sum(c.num_tokens for c in chunks), sequences=len(chunks)):
            for chunk in chunks:
                self._visual_slices(chunk, 0, [])  # the prefill passes its images: their cache entries are let go
            seconds = self.costs.step_seconds([(c.num_tokens, c.end) for c in chunks])
            self.step_seconds.append(seconds)
            self.wait(seconds)
            return StepLogits(self._sampling_logits(chunks), self._prompt_logits(chunks))

    def _sampling_logits(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """(sample rows, vocab): each row's stand-in token STAND_IN_MARGIN above the rest, its runner-up half that.
        A chunk's rows predict the positions after its last known token and after each proposal."""
        picks = []  # (token, runner-up) per sampling row
        for chunk in chunks:
            if chunk.samples_next_token:
                first = chunk.end - len(chunk.spec_token_ids)  # the position the first sampling row predicts
                picks += [self.stand_in.tokens(chunk.request, p) for p in range(first, chunk.end + 1)]
        logits = torch.zeros(len(picks), self.vocab_size)  # (sample rows, vocab)
        rows = torch.arange(len(picks))
        logits[rows, torch.tensor([p[1] for p in picks], dtype=torch.long)] = STAND_IN_MARGIN / 2
        logits[rows, torch.tensor([p[0] for p in picks], dtype=torch.long)] = STAND_IN_MARGIN
        return logits

    def _prompt_logits(self, chunks: list[ScheduledChunk]) -> list:
        """Flat logits, (prompt rows, vocab), for each chunk whose request asked for prompt_logprobs: the rows
        `ModelRunner._pack` would take, positions start..min(end, prompt length - 1) - 1."""
        out = []
        for chunk in chunks:
            if _wants_prompt_logprobs(chunk):
                rows = max(0, min(chunk.end, chunk.request.num_prompt_tokens - 1) - chunk.start)
                if rows:
                    out.append((chunk, torch.zeros(rows, self.vocab_size)))
        return out
