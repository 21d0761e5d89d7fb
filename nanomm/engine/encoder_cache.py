"""The vision-encoding cache: an image's visual tokens, computed once, reused by every request that shows it.

Lesson: lessons/07-encoder-cache.md.

Multi-turn chats resend the same picture every turn; a document gets asked about again and again. The vision
tower is the most expensive part of their time to first token, and its output depends only on the pixels,
the preprocessing and the model. So the cache maps

    key = sha256(image content hash, model identity)

to the projected visual tokens (tokens, hidden), after visual-token compression if the image has a policy
(inputs/compression.py; then the entry also holds each kept token's grid coordinates). The image content hash
(`nanomm.inputs.image.ProcessedImage`) already covers the decoded pixels and every parameter that changes the
tokens (resized size, min/max pixel cap, mean/std, patch and merge sizes, compression method and ratio), so the
same picture given as a path, as bytes or as a PIL image hits, and the same picture under another `max_pixels`
or another compression policy misses.

The budget is counted in visual tokens (`capacity_tokens`). Least recently used entries are evicted when a
new one does not fit, but never an entry a running request still needs: requests *hold* the entries of the
images their prefill has not passed yet. If everything cached is held, a new entry still goes in (a running
request needs it) and the cache shrinks back as holds are released.
"""

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

import torch


def encoder_cache_key(image_content_hash: str, model_identity: str) -> str:
    return hashlib.sha256(f"{image_content_hash}\0{model_identity}".encode()).hexdigest()


@dataclass
class CacheEntry:
    embeds: torch.Tensor  # (tokens, hidden), or a DeepStack model's (1 + levels, tokens, hidden)
    coords: torch.Tensor | None = None  # (3, tokens) grid (t, h, w) of a compressed image's tokens (compression.py)
    holders: int = 0  # running requests whose prefill still needs these tokens
    fetched_s: float | None = None  # fetched ahead for a request (encode_ahead.py): the wait, until it is charged

    @property
    def num_tokens(self) -> int:
        return self.embeds.shape[-2]


class EncoderCache:
    def __init__(self, capacity_tokens: int):
        self.capacity_tokens = capacity_tokens
        self.entries: OrderedDict[str, CacheEntry] = OrderedDict()  # least recently used first
        self.num_tokens = 0
        self.hits = self.misses = self.evictions = 0

    def __contains__(self, key: str) -> bool:
        return key in self.entries

    @property
    def num_bytes(self) -> int:
        return sum(e.embeds.numel() * e.embeds.element_size() for e in self.entries.values())

    def lookup(self, key: str) -> torch.Tensor | None:
        """The cached tokens (and a hit), or None (and a miss); a hit becomes the most recently used."""
        entry = self.entries.get(key)
        if entry is None or entry.fetched_s is not None:  # fetched ahead: the request found it missing
            self.misses += 1
            return None if entry is None else entry.embeds
        self.hits += 1
        self.entries.move_to_end(key)
        return entry.embeds

    def count_shared_hit(self) -> None:
        """A request served by an encode another request of the same step triggered: a hit for this one."""
        self.hits += 1

    def add(self, key: str, embeds: torch.Tensor, coords: torch.Tensor | None = None,
            fetched_s: float | None = None) -> None:
        """Insert freshly encoded tokens (and, for a compressed image, their grid coordinates; for tokens fetched
        ahead of a request, the wait). No eviction here: the engine trims at the end of the step."""
        if key not in self.entries:
            self.entries[key] = CacheEntry(embeds, coords, fetched_s=fetched_s)
            self.num_tokens += embeds.shape[-2]

    def take_fetch_time(self, key: str) -> float | None:
        """The wait for tokens fetched ahead, once (the request they were fetched for is charged it); else None."""
        entry = self.entries[key]
        seconds, entry.fetched_s = entry.fetched_s, None
        return seconds

    def hold(self, key: str) -> None:
        """A running request will need this entry's tokens: it is not evicted until released."""
        self.entries[key].holders += 1

    def embeds(self, key: str) -> torch.Tensor:
        """The tokens of an entry the caller holds (no hit counted: the lookup that found it counted one)."""
        return self.entries[key].embeds

    def coords(self, key: str) -> torch.Tensor | None:
        """The grid coordinates (3, tokens) of a compressed image the caller holds; None if uncompressed."""
        return self.entries[key].coords

    def release(self, key: str) -> None:
        """No eviction here: the scheduler may have counted on this entry for this step. The engine trims once
        per step, at its end (`LLMEngine.step`)."""
        entry = self.entries[key]
        assert entry.holders > 0, f"release of an encoder cache entry nobody holds: {key[:12]}"
        entry.holders -= 1

    def trim(self) -> None:
        """Evict least recently used entries nobody holds until the cache is within its budget."""
        for key in list(self.entries):
            if self.num_tokens <= self.capacity_tokens:
                return
            entry = self.entries[key]
            if entry.holders == 0:
                del self.entries[key]
                self.num_tokens -= entry.num_tokens
                self.evictions += 1

    def stats(self) -> dict:
        lookups = self.hits + self.misses
        return {
            "encoder_cache_hits": self.hits,
            "encoder_cache_misses": self.misses,
            "encoder_cache_hit_rate": self.hits / lookups if lookups else 0.0,
            "encoder_cache_evictions": self.evictions,
            "encoder_cache_tokens": self.num_tokens,
            "encoder_cache_bytes": self.num_bytes,
        }

    def check_no_holds(self) -> None:
        held = [k[:12] for k, e in self.entries.items() if e.holders]
        assert not held, f"encoder cache entries still held: {held}"
