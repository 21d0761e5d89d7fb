"""Turn a scheduled step into tensors, run the model once, and return the logits of the rows that sample.

Lesson: lessons/05-continuous-batching.md.

The scheduler decided *what* runs (a list of chunks: request, first position, count); this module only
prepares it: the packed token ids, their M-RoPE positions, the cache slot of every new token, each sequence's
slots so far, and the visual tokens of any image a chunk covers. An image is encoded whole the first time a
chunk touches it (its attention is bidirectional, so a slice cannot be encoded alone), all such images of the
step in one batched vision forward; each chunk then takes its slice of the embeddings. Encoded images go
into the encoder cache (encoder_cache.py), so a later request showing the same picture skips the encoder.

The preparation is built for the whole step at once, in a few tensor operations however many chunks there are
(`padded_context_slots`, `packed_positions`), and reaches the device in one copy (`copy_to_device`). A step of pure
decodes on a GPU goes through a recorded CUDA graph instead (cuda_graphs.py).
"""

import dataclasses
import math
import time
from dataclasses import dataclass

import torch

from nanomm.accel.batched_attention import MAX_BATCHED_QUERIES, DecodeBatch, build_decode_batch
from nanomm.engine.attention import PagedAttention, PrefillSequence, StepMetadata
from nanomm.engine.encoder_cache import EncoderCache
from nanomm.engine.kv_fp8 import Fp8KVCache
from nanomm.engine.scheduler import ScheduledChunk
from nanomm.engine.null_trace import NoTrace
from nanomm.errors import PeerError
from nanomm.inputs.compression import encode_visual_tokens
from nanomm.model.qwen2_vl import Qwen2VL


class ImagesUnavailable(Exception):
    """The encoder service failed on some images: the requests that show them fail, the others run on."""

    def __init__(self, content_hashes: list[str], cause: PeerError):
        super().__init__(str(cause))
        self.content_hashes, self.cause = set(content_hashes), cause


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # (tokens,) every chunk's new tokens, packed
    positions: torch.Tensor  # (3, tokens) M-RoPE ids
    meta: StepMetadata  # cache slots to write and to read, per sequence
    visual_tokens: torch.Tensor | None  # (image tokens, hidden) the rows image_mask marks, in order
    image_mask: torch.Tensor  # (tokens,) True where a token is an image token of a prompt
    sample_rows: torch.Tensor  # (sample rows,) packed rows whose logits pick a next token
    prompt_rows: list[tuple[ScheduledChunk, list[int]]]  # rows whose logits give prompt_logprobs, per chunk


@dataclass
class StepLogits:
    """float32 logits of one forward pass."""
    sampling: torch.Tensor  # (sample rows, vocab): 1 + len(spec_token_ids) rows per chunk that samples, in order
    prompt: list[tuple[ScheduledChunk, torch.Tensor]]  # per chunk that wants prompt_logprobs: (its prompt rows, vocab)


def _wants_prompt_logprobs(chunk: ScheduledChunk) -> bool:
    params = getattr(chunk.request, "params", None)  # a draft model's sequence has none
    return params is not None and params.prompt_logprobs is not None


def token_slots(block_table: list[int], start: int, end: int, block_size: int) -> torch.Tensor:
    """Cache slots of positions start..end-1 of a sequence: block_table[i // bs] * bs + i % bs."""
    positions = torch.arange(start, end)
    table = torch.tensor(block_table, dtype=torch.long)
    return table[positions // block_size] * block_size + positions % block_size


def padded_context_slots(block_tables: list[list[int]], lengths: list[int], block_size: int) -> torch.Tensor:
    """`token_slots(table, 0, length)` of many sequences at once: (sequences, longest length). Past a
    sequence's length the row holds slots of its block table padded with block 0: valid, never attended."""
    width = -(-max(lengths) // block_size)  # blocks of the longest
    tables = torch.tensor([table[:width] + [0] * (width - len(table[:width])) for table in block_tables])
    positions = torch.arange(max(lengths))
    blocks = tables[:, positions // block_size]  # (sequences, longest length)
    return blocks * block_size + positions % block_size


def copy_to_device(tensors: list, device: torch.device) -> list:
    """A step's integer inputs in one host-to-device copy: packed into one buffer (pinned on CUDA, so the copy
    does not wait for the host), copied once, split into views. None entries pass through; on a CPU there is
    nothing to copy."""
    if device.type == "cpu":
        return tensors
    return packed_copy(tensors, device)


def packed_copy(tensors: list, device: torch.device) -> list:
    """`copy_to_device`'s work, for any device: int64 buffer, one copy, views back in each tensor's shape and dtype."""
    present = [t for t in tensors if t is not None]
    flat = torch.cat([t.reshape(-1).long() for t in present])
    if device.type == "cuda":
        flat = flat.pin_memory()
    pieces = iter(flat.to(device, non_blocking=True).split([t.numel() for t in present]))
    return [None if t is None else next(pieces).view(t.shape).to(t.dtype) for t in tensors]


class ModelRunner:
    def __init__(self, model: Qwen2VL, kv_cache: "torch.Tensor | Fp8KVCache", block_size: int,
                 encoder_cache: EncoderCache,
                 trace=None, batched_attention: bool = True, decode_graphs=None, remote_encoder=None):
        self.model, self.kv_cache, self.block_size = model, kv_cache, block_size
        # transfer.RemoteEncoder: images go to an encoder service; None: this model's own tower
        self.remote_encoder = remote_encoder
        self.decode_graphs = decode_graphs  # cuda_graphs.DecodeGraphs: pure decode steps replayed, or None
        self.batched_attention = batched_attention  # False: every sequence attended alone (the definition)
        self.trace = trace or NoTrace()  # the step timeline (trace.py)
        self.encoder_cache = encoder_cache
        self.device = model.device
        self.visual_tokens_encoded, self.encode_s = 0, 0.0  # encode_s: local encodes and waits on the service
        self.encoder_busy_s = 0.0  # this instance's own tower only: its utilisation is this over wall time

    @torch.inference_mode()
    def run(self, chunks: list[ScheduledChunk]) -> StepLogits:
        """Forward the packed chunks; the logits of the rows that sample, and of the prompt rows of requests
        that asked for prompt_logprobs."""
        with self.trace.span("encode"):
            self._encode_images(chunks)
        with self.trace.span("forward", tokens=sum(c.num_tokens for c in chunks), sequences=len(chunks)):
            if self.decode_graphs is not None and self.decode_graphs.eligible(chunks):
                return StepLogits(self.decode_graphs.run(chunks), [])  # every chunk samples: rows in order
            step = self._pack(chunks)
            hidden = self.model(step.input_ids, step.positions, self.attention_backend(step.meta),
                                step.visual_tokens, step.image_mask)  # (tokens, hidden)
            prompt = [(chunk, self.model.compute_logits(hidden[rows])) for chunk, rows in step.prompt_rows]
            logits = self.model.compute_logits(hidden.index_select(0, step.sample_rows))  # (sample rows, vocab)
            if logits.device.type == "cuda":  # the span times the work, not only its launch
                torch.cuda.synchronize(logits.device)
        return StepLogits(logits, prompt)

    def attention_backend(self, meta: StepMetadata) -> PagedAttention:
        return PagedAttention(self.kv_cache, meta, self.model.config.text.num_attention_heads)

    def stats(self) -> dict:
        remote = self.remote_encoder.stats() if self.remote_encoder is not None else {}
        return {"visual_tokens_encoded": self.visual_tokens_encoded, "encode_s": self.encode_s,
                "encoder_busy_s": self.encoder_busy_s,
                "visual_tokens_per_s": self.visual_tokens_encoded / self.encode_s if self.encode_s else 0.0, **remote}

    def encode(self, images: list, urls: list[str | None]) -> list:
        """The encode stage: the local tower (counted as this instance's encoded tokens), or the encoder service
        (urls: the one each image's request names; None: the default), one call per service. A service that
        fails raises ImagesUnavailable naming its images, for the engine to fail their requests."""
        if self.remote_encoder is None:
            self.visual_tokens_encoded += sum(im.num_encoded_tokens for im in images)
            return encode_visual_tokens(self.model, images)  # compressed by each image's policy
        encoded = [None] * len(images)
        for url in dict.fromkeys(urls):
            picked = [i for i, u in enumerate(urls) if u == url]
            try:
                tokens = self.remote_encoder.encode([images[i] for i in picked], url)
            except PeerError as exc:
                raise ImagesUnavailable([images[i].content_hash for i in picked], exc) from None
            for i, t in zip(picked, tokens):
                encoded[i] = t
        return encoded

    def _pack(self, chunks: list[ScheduledChunk]) -> "StepInputs":
        """The chunks, sequence after sequence, as the tensors one forward pass takes (no padding anywhere)."""
        ids, visual, visual_rows, sample_rows, prompt_rows, query_starts = [], [], [], [], [], []
        grid_offsets = []  # (packed rows, (3, rows) grid coordinates) of compressed images' tokens
        offset = 0  # where this chunk starts in the packed tokens
        for chunk in chunks:
            request = chunk.request
            ids += chunk.token_ids
            query_starts.append(offset)
            visual += self._visual_slices(chunk, offset, grid_offsets)
            visual_rows += [offset + i - chunk.start for span in request.prompt.image_spans  # image tokens here
                            for i in span.clip(chunk.start, chunk.end)]
            if _wants_prompt_logprobs(chunk):  # position i predicts prompt token i + 1
                last = min(chunk.end, request.num_prompt_tokens - 1)
                if last > chunk.start:
                    prompt_rows.append((chunk, list(range(offset, offset + last - chunk.start))))
            offset += chunk.num_tokens
            if chunk.samples_next_token:  # the last known token predicts the next, each proposal the one after it
                sample_rows += range(offset - 1 - len(chunk.spec_token_ids), offset)
        slots = padded_context_slots([c.request.block_table for c in chunks], [c.end for c in chunks],
                                     self.block_size)  # (chunks, longest context)
        owner = torch.tensor([i for i, c in enumerate(chunks) for _ in range(c.num_tokens)])  # each token's chunk
        new_slots = slots[owner, torch.tensor([p for c in chunks for p in range(c.start, c.end)])]  # (tokens,)
        image_mask = torch.zeros(len(ids), dtype=torch.bool)  # (tokens,)
        image_mask[visual_rows] = True
        short, prompt_chunks, prefills = self._split_runs(chunks, query_starts, slots)
        positions = packed_positions(chunks)  # (3, tokens)
        for rows, coords in grid_offsets:  # a compressed image's kept tokens at their own place in its grid
            positions[:, rows.start:rows.stop] += coords
        host = [torch.tensor(ids), positions, new_slots, image_mask, prefills[1],
                torch.tensor(sample_rows, dtype=torch.long)] + _batch_tensors(short) + _batch_tensors(prompt_chunks)
        input_ids, positions, new_slots, image_mask, context_slots, sample_rows, *batch_tensors = copy_to_device(
            host, self.device)
        count = len(DecodeBatch.TENSORS)
        short = _with_tensors(short, batch_tensors[:count])  # the batches' tensors, now on the device
        prompt_chunks = _with_tensors(prompt_chunks, batch_tensors[count:])
        return StepInputs(
            input_ids=input_ids, positions=positions,  # (tokens,), (3, tokens)
            meta=StepMetadata(new_slots, context_slots, prefills[0], short, prompt_chunks),
            visual_tokens=torch.cat(visual, dim=-2) if visual else None,  # ([levels,] this step's image tokens, hidden)
            image_mask=image_mask, sample_rows=sample_rows, prompt_rows=prompt_rows)

    def _split_runs(self, chunks: list[ScheduledChunk], query_starts: list[int], slots: torch.Tensor):
        """Batched (the default): short query runs past the prompt (decodes, verifications) in one batch, prompt
        chunks and any longer run in another (accel/batched_attention.py). Without batched attention every run is
        attended alone, its context slots packed sequence after sequence: the definition.
        Returns (short runs' DecodeBatch or None, prompt chunks' DecodeBatch or None, (sequences, packed slots))."""
        if not self.batched_attention:
            alone, offset = [], 0
            for start, chunk in zip(query_starts, chunks):
                alone.append(PrefillSequence(start, chunk.num_tokens, offset, chunk.end))
                offset += chunk.end
            return None, None, (alone, torch.cat([row[:c.end] for row, c in zip(slots, chunks)]))
        short = [c.num_tokens <= MAX_BATCHED_QUERIES and c.start >= c.request.num_prompt_tokens for c in chunks]

        def batch_of(picked: list[int]) -> DecodeBatch | None:
            return build_decode_batch([query_starts[i] for i in picked], [chunks[i].num_tokens for i in picked],
                                      slots[picked], [chunks[i].end for i in picked]) if picked else None

        return (batch_of([i for i, s in enumerate(short) if s]), batch_of([i for i, s in enumerate(short) if not s]),
                ([], torch.zeros(0, dtype=torch.long)))

    def _encode_images(self, chunks: list[ScheduledChunk]) -> None:
        """Make every image a chunk covers available to its request: from the encoder cache when it is there,
        else encoded, all such images of the step in one batched vision forward (each distinct image once).
        The request holds the cache entry until its prefill has passed the image."""
        needed = [(chunk.request, i) for chunk in chunks for i, span in enumerate(chunk.request.prompt.image_spans)
                  if span.overlaps(chunk.start, chunk.end) and i not in chunk.request.held_images]
        to_encode, urls = {}, {}  # cache key -> ProcessedImage, in order; -> the encoder service its request names
        cache_hits = []  # per needed image: served without an encode of its own
        fetched = {}  # cache key -> the wait for its tokens, fetched ahead for this request (encode_ahead.py)
        for request, i in needed:
            key = request.image_keys[i]
            if key in to_encode:  # another request of this step shows the same picture: one encode serves both
                self.encoder_cache.count_shared_hit()
                cache_hits.append(True)
            elif self.encoder_cache.lookup(key) is not None:
                wait = self.encoder_cache.take_fetch_time(key)
                if wait is not None:
                    fetched[key] = wait
                cache_hits.append(wait is None)
            else:
                to_encode[key] = request.prompt.images[i]
                urls[key] = getattr(request, "encoder_url", None)  # a draft's sequence names none
                cache_hits.append(False)
        share, began = {}, {}  # cache key -> the encode time it is charged, and where that share starts
        if to_encode:
            start = time.perf_counter()
            images = list(to_encode.values())
            encoded = self.encode(images, [urls[key] for key in to_encode])
            if self.device.type == "cuda":  # time the encode, not only its launch
                torch.cuda.synchronize(self.device)
            elapsed = time.perf_counter() - start
            for key, tokens in zip(to_encode, encoded):
                self.encoder_cache.add(key, tokens.embeds, tokens.coords)
            num_patches = sum(math.prod(im.grid_thw) for im in images)
            self.encode_s += elapsed
            if self.remote_encoder is None:
                self.encoder_busy_s += elapsed
            share = {key: elapsed * math.prod(im.grid_thw) / num_patches for key, im in to_encode.items()}
            for key in to_encode:  # shares laid end to end, in batch order, for the timeline
                began[key] = start
                start += share[key]
        for (request, i), cache_hit in zip(needed, cache_hits):  # each is charged for the images encoded for it
            key = request.image_keys[i]
            encode_s = share.pop(key, 0.0) or fetched.pop(key, 0.0)
            request.record_image_ready(cache_hit, encode_s, on_this_device=self.remote_encoder is None)
            if encode_s and key in began:  # encoded in this step (a wait fetched ahead was no step's)
                self.trace.encoded(request, began[key], encode_s)
            self.encoder_cache.hold(key)
            request.held_images[i] = key

    def _visual_slices(self, chunk: ScheduledChunk, offset: int, grid_offsets: list) -> list[torch.Tensor]:
        """The rows of each overlapping image's visual tokens that fall inside this chunk, in order. A compressed
        image's rows also add (packed row, its (t, h, w)) to grid_offsets: their positions hold the image's origin
        until then (inputs/prompt.py, `_compressed_image_origins`). offset: where the chunk starts in the packed tokens."""
        request, out = chunk.request, []
        for i, span in enumerate(request.prompt.image_spans):
            rows = span.clip(chunk.start, chunk.end)
            if rows:
                key = request.held_images[i]
                out.append(self.encoder_cache.embeds(key)[..., rows.start - span.start:rows.stop - span.start, :])
                coords = self.encoder_cache.coords(key)
                if coords is not None:
                    grid_offsets.append((range(offset + rows.start - chunk.start, offset + rows.stop - chunk.start),
                                         coords[:, rows.start - span.start:rows.stop - span.start]))
                if rows.stop == span.end:  # the prefill has passed this image: the request no longer needs it
                    del request.held_images[i]
                    self.encoder_cache.release(key)
        return out


def _batch_tensors(batch: DecodeBatch | None) -> list:
    return [getattr(batch, name) if batch is not None else None for name in DecodeBatch.TENSORS]


def _with_tensors(batch: DecodeBatch | None, tensors: list) -> DecodeBatch | None:
    """`batch` with its tensors (`_batch_tensors`' order) replaced by `tensors`."""
    return None if batch is None else dataclasses.replace(batch, **dict(zip(DecodeBatch.TENSORS, tensors)))


def packed_positions(chunks: list[ScheduledChunk]) -> torch.Tensor:
    """(3, tokens) M-RoPE ids of the packed chunks. A chunk past its prompt (a decode, a verification) counts
    up from index + rope delta on all three axes: those are written in one go, not built per chunk."""
    total = sum(c.num_tokens for c in chunks)
    positions = torch.empty(3, total, dtype=torch.long)
    generated_rows, generated_values, offset = [], [], 0
    for chunk in chunks:
        request = chunk.request
        if chunk.start >= request.num_prompt_tokens:
            generated_rows += range(offset, offset + chunk.num_tokens)
            generated_values += range(chunk.start + request.prompt.rope_delta, chunk.end + request.prompt.rope_delta)
        else:
            positions[:, offset:offset + chunk.num_tokens] = request.positions(chunk.start, chunk.end)
        offset += chunk.num_tokens
    if generated_rows:
        positions[:, generated_rows] = torch.tensor(generated_values)
    return positions
