"""Turn a scheduled step into tensors, run the model once, and return the logits of the rows that sample.

Lesson: lessons/05-continuous-batching.md.

The scheduler decided *what* runs (a list of chunks: request, first position, count); this module only
prepares it: the packed token ids, their M-RoPE positions, the cache slot of every new token, each sequence's
slots so far, and the visual tokens of any image a chunk covers. An image is encoded whole the first time a
chunk touches it (its attention is bidirectional, so a slice cannot be encoded alone), all such images of the
step in one batched vision forward; each chunk then takes its slice of the embeddings. Encoded images go
into the encoder cache (encoder_cache.py), so a later request showing the same picture skips the encoder.
"""

import time

import torch

from nanomm.attention import PagedAttention, SequenceSlice, StepMetadata
from nanomm.encoder_cache import EncoderCache
from nanomm.model import Qwen2VL
from nanomm.scheduler import ScheduledChunk


def token_slots(block_table: list[int], start: int, end: int, block_size: int) -> torch.Tensor:
    """Cache slots of positions start..end-1 of a sequence: block_table[i // bs] * bs + i % bs."""
    positions = torch.arange(start, end)
    table = torch.tensor(block_table, dtype=torch.long)
    return table[positions // block_size] * block_size + positions % block_size


class ModelRunner:
    def __init__(self, model: Qwen2VL, kv_cache: torch.Tensor, block_size: int, encoder_cache: EncoderCache):
        self.model, self.kv_cache, self.block_size = model, kv_cache, block_size
        self.encoder_cache = encoder_cache
        self.device = model.device
        self.visual_tokens_encoded, self.encode_s = 0, 0.0

    @torch.inference_mode()
    def run(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """Forward the packed chunks; float32 logits (num sampling chunks, vocab), in chunk order."""
        self._encode_images(chunks)
        ids, positions, contexts, sequences, visual, visual_rows, sample_rows = [], [], [], [], [], [], []
        offset = context_offset = 0
        for chunk in chunks:
            request = chunk.request
            ids += request.token_ids[chunk.start:chunk.end]
            positions.append(request.positions(chunk.start, chunk.end))
            contexts.append(token_slots(request.block_table, 0, chunk.end, self.block_size))
            sequences.append(SequenceSlice(offset, chunk.num_tokens, context_offset, chunk.end))
            context_offset += chunk.end
            visual += self._visual_slices(chunk)
            visual_rows += [offset + i - chunk.start for span in request.prompt.image_spans
                            for i in range(max(span.start, chunk.start), min(span.end, chunk.end))]
            offset += chunk.num_tokens
            if chunk.samples:
                sample_rows.append(offset - 1)
        new_slots = torch.cat([c[chunk.start:] for c, chunk in zip(contexts, chunks)])
        meta = StepMetadata(new_slots.to(self.device), torch.cat(contexts).to(self.device), sequences)
        image_mask = torch.zeros(len(ids), dtype=torch.bool)
        image_mask[visual_rows] = True
        hidden = self.model(torch.tensor(ids, device=self.device), torch.cat(positions, dim=1).to(self.device),
                            PagedAttention(self.kv_cache, meta), torch.cat(visual) if visual else None,
                            image_mask.to(self.device))
        return self.model.compute_logits(hidden[sample_rows])

    def _encode_images(self, chunks: list[ScheduledChunk]) -> None:
        """Make every image a chunk covers available to its request: from the encoder cache when it is there,
        else encoded, all such images of the step in one batched vision forward (each distinct image once).
        The request holds the cache entry until its prefill has passed the image."""
        needed = [(chunk.request, i) for chunk in chunks for i, span in enumerate(chunk.request.prompt.image_spans)
                  if span.start < chunk.end and span.end > chunk.start and i not in chunk.request.held_images]
        to_encode = {}  # cache key -> ProcessedImage, in order
        for request, i in needed:
            key = request.image_keys[i]
            if key in to_encode:  # another request of this step shows the same picture: one encode serves both
                self.encoder_cache.hits += 1
                request.metrics.encoder_cache_hits += 1
            elif self.encoder_cache.lookup(key) is not None:
                request.metrics.encoder_cache_hits += 1
            else:
                to_encode[key] = request.prompt.images[i]
        if to_encode:
            start = time.perf_counter()
            images = list(to_encode.values())
            pixels = torch.cat([im.pixel_values for im in images]).to(self.device)
            embeds = self.model.encode_images(pixels, [im.grid_thw for im in images])
            elapsed = time.perf_counter() - start
            for key, embed in zip(to_encode, embeds):
                self.encoder_cache.add(key, embed)
            self.visual_tokens_encoded += sum(e.shape[0] for e in embeds)
            self.encode_s += elapsed
            share = {key: elapsed * im.pixel_values.shape[0] / pixels.shape[0] for key, im in to_encode.items()}
            for request, i in needed:  # each request is charged for the images encoded for it
                request.metrics.encode_s += share.pop(request.image_keys[i], 0.0)
        for request, i in needed:
            self.encoder_cache.hold(request.image_keys[i])
            request.held_images[i] = request.image_keys[i]

    def _visual_slices(self, chunk: ScheduledChunk) -> list[torch.Tensor]:
        """The rows of each overlapping image's visual tokens that fall inside this chunk, in order."""
        request, out = chunk.request, []
        for i, span in enumerate(request.prompt.image_spans):
            lo, hi = max(span.start, chunk.start), min(span.end, chunk.end)
            if lo < hi:
                key = request.held_images[i]
                out.append(self.encoder_cache.entries[key].embeds[lo - span.start:hi - span.start])
                if hi == span.end:  # the prefill has passed this image: the request no longer needs it
                    del request.held_images[i]
                    self.encoder_cache.release(key)
        return out
