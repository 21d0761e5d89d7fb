"""Cache-affine routing: send a request where its prefix and pictures were sent before, unless that engine is busy.

Lesson: lessons/15-scaling-each-pool.md (routing among several engines of one pool).

With several engines in a pool (dp<N>, the prefill instances of <X>e<Y>pd or <X>e<Y>p<Z>d), each turn of a chat
that goes to the least loaded engine may land where its pictures were never encoded and its prefix never run:
the engine's encoder cache and prefix cache then miss. The router cannot see the engines' caches, so it keeps its
own memory of where it sent things (`AffinityMap`): a bounded, least-recently-used map from keys to the engine
last sent them.

- `PromptKeys`: what a request brings, as keys with their weight in tokens. `prefix` is a chain: each key hashes
  the one before it and one more piece of the prompt (a block of text, or a picture), so key i names the whole
  prompt up to piece i, as the prefix cache's block hashes do. `pictures` are the pictures alone (the encoder
  cache finds a picture wherever it sits in the prompt).
- `prompt_keys(body, picture_tokens)`: a chat or completion body's keys. Text is cut into blocks of
  BLOCK_CHARACTERS (about one 16-token KV block); a picture is hashed from its base64 string (or URL), never
  decoded; `picture_tokens` weighs it (the router passes its header-read estimate).
- `CacheAffinity.pick`: the engine that would skip the most tokens (the longest prefix it was sent, plus the
  pictures it was sent), unless its outstanding work exceeds the least loaded engine's by more than `slack`
  (the pool's work units: prompt tokens for whole engines); otherwise the load policy's own pick. Either way the
  request's keys are then remembered as sent to the engine picked.

Standard library only: the router (serve/router.py), Ray's request router (serve/ray.py) and the twin
(sim/twin.py) share this one policy. Engines are whatever hashable values the caller names (URLs, Ray replica
ids, simulated engines).
"""

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

BLOCK_CHARACTERS = 64  # about 16 tokens of English text: one KV block of the prefix cache
CHARACTERS_PER_TOKEN = 4
# Prompt tokens an affine pick may hold beyond the least loaded engine's: a few chat histories' worth. On the twin's
# dp4 over six-turn chats of 1,024-token pictures, 2,048 spilled so often that TTFT p99 stayed 2.5x 8,192's
# (BENCHMARKS.md, "Cache-affine routing").
DEFAULT_SLACK = 8192.0


@dataclass(frozen=True)
class PromptKeys:
    prefix: tuple[tuple[str, float], ...] = ()  # (chained key, tokens of its piece), in prompt order
    pictures: tuple[tuple[str, float], ...] = ()  # (picture key, its tokens)


def _digest(*parts: str) -> str:
    return hashlib.blake2b("\x1f".join(parts).encode(), digest_size=12).hexdigest()


def chain(pieces: list[tuple[str, float]]) -> tuple[tuple[str, float], ...]:
    """(piece identity, tokens) in order -> (key of the prompt up to that piece, tokens)."""
    keys, previous = [], ""
    for identity, tokens in pieces:
        previous = _digest(previous, identity)
        keys.append((previous, tokens))
    return tuple(keys)


def prompt_keys(body: dict, picture_tokens=lambda payload: 1.0) -> PromptKeys:
    """A chat or completion body's keys: its text in blocks and its pictures, in the order the prompt holds them."""
    pieces, pictures, text = [], [], []

    def flush_text(final: bool = False) -> None:
        joined = "".join(text)
        whole = len(joined) if final else len(joined) // BLOCK_CHARACTERS * BLOCK_CHARACTERS
        for start in range(0, whole, BLOCK_CHARACTERS):
            block = joined[start:start + BLOCK_CHARACTERS]
            pieces.append(("t" + block, len(block) / CHARACTERS_PER_TOKEN))
        text[:] = [joined[whole:]]

    prompt = body.get("prompt")
    for item in [prompt] if isinstance(prompt, str) else prompt if isinstance(prompt, list) else []:
        text.append(str(item))
    for message in body.get("messages") or []:
        if not isinstance(message, dict):
            continue
        text.append(f"\x00{message.get('role')}\x00")
        content = message.get("content")
        for part in [{"text": content}] if isinstance(content, str) else content if isinstance(content, list) else []:
            if not isinstance(part, dict):
                continue
            if isinstance(part.get("text"), str):
                text.append(part["text"])
            url = (part.get("image_url") or {}).get("url") if isinstance(part.get("image_url"), dict) else None
            if isinstance(url, str):
                flush_text(final=True)  # a picture starts a piece of its own
                key, tokens = "p" + _digest(url), picture_tokens(url.split(",", 1)[-1])
                pieces.append((key, tokens))
                pictures.append((key, tokens))
        flush_text()
    flush_text(final=True)
    return PromptKeys(chain(pieces), tuple(pictures))


class AffinityMap:
    """Key -> the engine last sent it, the least recently used key forgotten past `capacity` keys."""

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"the affinity map needs room for a key, got capacity {capacity}")
        self.capacity, self.entries = capacity, OrderedDict()

    def __len__(self) -> int:
        return len(self.entries)

    def savings(self, keys: PromptKeys) -> dict:
        """Engine -> the tokens it would not recompute: the prefix up to the last key it was sent, plus the
        pictures it was sent."""
        saved, covered = {}, 0.0
        for key, tokens in keys.prefix:
            covered += tokens
            engine = self.entries.get(key)
            if engine is not None:
                saved[engine] = covered  # the deepest key wins: it was sent the whole prefix up to here
        for key, tokens in keys.pictures:
            engine = self.entries.get(key)
            if engine is not None:
                saved[engine] = saved.get(engine, 0.0) + tokens
        return saved

    def record(self, keys: PromptKeys, engine) -> None:
        for key, _ in keys.prefix + keys.pictures:
            self.entries[key] = engine
            self.entries.move_to_end(key)
        while len(self.entries) > self.capacity:
            self.entries.popitem(last=False)

    def forget(self, engine) -> None:
        """An engine that left the pool: none of its keys is worth anything now."""
        for key in [k for k, e in self.entries.items() if e == engine]:
            del self.entries[key]


class CacheAffinity:
    """The policy: the engine that would skip the most, within `slack` work of the least loaded engine."""

    OUTCOMES = ("affine", "spilled", "new")  # sent for its cache; its cache's engine too busy; nothing known

    def __init__(self, slack: float, capacity: int = 65536):
        if slack < 0:
            raise ValueError(f"the affinity slack is work an engine may hold beyond the least loaded one's: "
                             f"it must be >= 0, got {slack}")
        self.slack, self.map = slack, AffinityMap(capacity)
        self.outcomes = dict.fromkeys(self.OUTCOMES, 0)

    def choose(self, keys: PromptKeys, outstanding: dict, fallback) -> tuple:
        """(engine, outcome): one of `outstanding`'s engines (engine -> its work now); `fallback` is the load
        policy's pick. Remembers nothing: a caller that may still send elsewhere (Ray) records what it did."""
        saved = {engine: tokens for engine, tokens in self.map.savings(keys).items() if engine in outstanding}
        if not saved:
            return fallback, "new"
        best = max(saved, key=lambda engine: (saved[engine], -outstanding[engine]))
        if outstanding[best] - min(outstanding.values()) <= self.slack:
            return best, "affine"
        return fallback, "spilled"

    def pick(self, keys: PromptKeys, outstanding: dict, fallback):
        """`choose`, counted, and the request's keys remembered as sent to the engine chosen."""
        choice, outcome = self.choose(keys, outstanding, fallback)
        self.outcomes[outcome] += 1
        self.map.record(keys, choice)
        return choice
