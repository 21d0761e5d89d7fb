"""A processor cache: a picture or video sent again is not decoded, resized or hashed again.

Lesson: lessons/16-long-conversations.md (a long chat sends every earlier picture again on each turn).

The prefix cache serves a chat's earlier turns, but only once the prompt is built, and building it means
preprocessing every picture the client sent: on turn 12 of a chat with a picture a turn, twelve decodes and
resizes. This cache, vLLM's `mm_processor_cache_gb`, keeps what preprocessing made (`ProcessedImage`,
`ProcessedVideo`: the resized uint8 pixels, the grid and the content hash the encoder and prefix caches key on), so
a hit skips the decode, the resize and the hash over the pixels.

Keys. An entry's key is (settings, sha256 of the encoded bytes the client sent: the data URL's payload, the
file's bytes), taken before anything is decoded. `settings` names everything that changes the result: the model
family, the image processor config, the pixel cap (a request's, or an old picture's downscale) and, for a video,
its sampling settings (`InputProcessor` builds it). Visual-token compression is applied after the cache, on a
copy, so one entry serves every policy.

uuids (vLLM's form). A content part may carry a client's `uuid`; the entry is then found under (settings, uuid)
too, so a later request may send the uuid alone, without the data. A uuid sent with data points at that data's
entry (the bytes decide, never a stale uuid); a uuid is only ever looked up under the same settings, so it never
crosses from one pixel cap or model to another. A picture given as a PIL image has no bytes to hash: it is cached
under its uuid alone, if it has one.

Bound. The bytes counted are each entry's uint8 pixels; the least recently used entries go first, and an entry
larger than the whole bound is not kept. The float patches are never held: each hit hands out a fresh copy of the
entry, whose `pixel_values` the engine builds on first use (and not at all when the encoder cache has the
picture). Capacity 0 turns the cache off; the decodes are still counted.

Lookups come from the preprocessing pool's threads and the engine's (a uuid without data is resolved when the
prompt is validated): one lock guards the table, and the decode itself runs outside it.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field, replace

GIB = 2**30
DEFAULT_PROCESSOR_CACHE_GIB = 4.0  # vLLM's mm_processor_cache_gb default


@dataclass(frozen=True)
class MediaWithUuid:
    """A picture or video that the client named: `data` as sent (None: the uuid alone), and, once a data-less uuid
    is resolved at validation, the cached entry it names."""
    data: object
    uuid: str
    cached: object = None


@dataclass
class _Entry:
    item: object  # a ProcessedImage or ProcessedVideo, as preprocessing made it (no compression, no floats)
    nbytes: int
    uuids: set = field(default_factory=set)  # the (settings, uuid) keys that point here


def settings_key(*parts) -> str:
    """A short name for the processing settings: the sha256 of their reprs (frozen dataclasses, numbers, strings)."""
    return hashlib.sha256(repr(parts).encode()).hexdigest()


def item_nbytes(item) -> int:
    """The bytes an entry counts against the bound: its uint8 pixels (a picture's or a clip's frames)."""
    pixels = getattr(item, "resized_rgb", None)
    return len(pixels if pixels is not None else item.frames_rgb)


class ProcessorCache:
    def __init__(self, capacity_bytes: int):
        self.capacity_bytes = int(capacity_bytes)
        self._entries: OrderedDict[tuple, _Entry] = OrderedDict()  # least recently used first
        self._uuids: dict[tuple[str, str], tuple] = {}  # (settings, uuid) -> the key of its entry
        self._lock = threading.Lock()
        self.nbytes = 0
        self.decodes = self.hits = self.misses = self.evictions = 0

    @classmethod
    def from_gib(cls, gib: float) -> "ProcessorCache":
        return cls(int(gib * GIB))

    @property
    def enabled(self) -> bool:
        return self.capacity_bytes > 0

    def __len__(self) -> int:
        return len(self._entries)

    def lookup_uuid(self, settings: str, uuid: str):
        """A fresh copy of the entry the client named `uuid` under these settings, or None."""
        with self._lock:
            key = self._uuids.get((settings, uuid))
            if key is None:
                return None
            self.hits += 1
            self._entries.move_to_end(key)
            return replace(self._entries[key].item)

    def get_or_process(self, settings: str, payload: bytes | None, uuid: str | None, process: Callable[[], object]):
        """The entry for these encoded bytes (or, without bytes, this uuid) under these settings, else `process()`
        run and its result kept. Either way a fresh copy, and `uuid` (if any) names the entry from now on."""
        if not self.enabled:
            return self._decode(process)
        if payload is not None:
            key = (settings, "sha256", hashlib.sha256(payload).hexdigest())
        elif uuid is not None:
            key = (settings, "uuid", uuid)
        else:  # a PIL image without a name: nothing to key it on
            return self._decode(process)
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self.hits += 1
                self._entries.move_to_end(key)
                self._name(key, settings, uuid)
                return replace(entry.item)
            self.misses += 1
        item = self._decode(process)  # outside the lock: the pool's workers decode in parallel
        with self._lock:
            self._store(key, item)
            self._name(key, settings, uuid)
        return replace(item)

    def stats(self) -> dict:
        return {"processor_cache_decodes": self.decodes, "processor_cache_hits": self.hits,
                "processor_cache_misses": self.misses, "processor_cache_evictions": self.evictions,
                "processor_cache_bytes": self.nbytes, "processor_cache_entries": len(self._entries)}

    def _decode(self, process: Callable[[], object]):
        item = process()
        with self._lock:
            self.decodes += 1
        return item

    def _store(self, key: tuple, item) -> None:
        nbytes = item_nbytes(item)
        if key in self._entries or nbytes > self.capacity_bytes:  # kept by another thread meanwhile, or too big
            return
        self._entries[key] = _Entry(item, nbytes)
        self.nbytes += nbytes
        while self.nbytes > self.capacity_bytes:
            self._evict_oldest()

    def _evict_oldest(self) -> None:
        _, entry = self._entries.popitem(last=False)
        self.nbytes -= entry.nbytes
        self.evictions += 1
        for name in entry.uuids:
            del self._uuids[name]

    def _name(self, key: tuple, settings: str, uuid: str | None) -> None:
        """`uuid` names the entry at `key` (if it is kept), and no longer the one it named before."""
        if uuid is None or key not in self._entries:
            return
        name = (settings, uuid)
        previous = self._uuids.get(name)
        if previous is not None and previous in self._entries:
            self._entries[previous].uuids.discard(name)
        self._uuids[name] = key
        self._entries[key].uuids.add(name)
