"""Workloads: mixes of pictures, arrivals, and the requests the simulators replay.

Lesson: lessons/11-serving-under-load.md (mixes) and lessons/13-three-topologies.md (replays).

A mix is "COUNTxWIDTHxHEIGHT:WEIGHT,..." (a request draws one entry by weight; `0x0x0:3` is a text-only request)
or a named mix (MIXES). The load generator sends such requests to real servers (nanomm/bench/load.py); the
simulators take `SimRequest`s drawn from the same mix (`make_requests`) or replayed from a load run's records
(`requests_from_load`). Visual tokens per picture follow the model's own smart_resize (nanomm/inputs/image.py).
"""

import random
from dataclasses import dataclass

from nanomm.inputs.image import DEFAULT_MAX_PIXELS, smart_resize

FACTOR = 28  # pixels per visual token's side in Qwen2-VL (2 x 2 patches of 14); the demo model's is 14

# Named mixes: "COUNTxWIDTHxHEIGHT:WEIGHT" entries, comma-separated (a request draws one entry by weight).
MIXES = {
    "text": "0x0x0:1",
    "thumbnails": "1x224x224:5,1x168x168:3,2x112x112:2",  # 64, 36 and 2 x 16 visual tokens
    "scans": "1x896x1176:7,2x728x952:3",  # a page (1,344 visual tokens) or two smaller ones (2 x 884)
}


@dataclass(frozen=True)
class MixEntry:
    num_images: int
    width: int
    height: int
    weight: float


def parse_mix(text: str) -> list[MixEntry]:
    """A mix's name (MIXES) or its entries, "COUNTxWIDTHxHEIGHT:WEIGHT,..."; a ValueError says what is wrong."""
    entries = []
    for item in MIXES.get(text, text).split(","):
        try:
            shape, weight = item.split(":")
            count, width, height = (int(v) for v in shape.lower().split("x"))
            entry = MixEntry(count, width, height, float(weight))
        except ValueError:
            raise ValueError(f"mix entry {item!r} is not COUNTxWIDTHxHEIGHT:WEIGHT (for example 1x224x224:1); "
                             f"named mixes: {', '.join(MIXES)}") from None
        if entry.num_images < 0 or entry.weight <= 0 or (entry.num_images and min(width, height) < 28):
            raise ValueError(f"mix entry {item!r}: the count must be >= 0, the weight > 0, images >= 28 pixels")
        entries.append(entry)
    return entries


def visual_tokens(width: int, height: int, max_pixels: int = DEFAULT_MAX_PIXELS, factor: int = FACTOR) -> int:
    """A picture's visual tokens: its resized area over one token's pixels."""
    h, w = smart_resize(height, width, factor, max_pixels=max_pixels)
    return h * w // (factor * factor)


@dataclass(frozen=True)
class SimRequest:
    id: int
    arrival_s: float
    image_tokens: tuple[int, ...]  # visual tokens of each image
    text_tokens: int
    output_tokens: int
    cached_tokens: int = 0  # prompt positions the prefix cache held (a replay's records say)
    body_bytes: int = 0  # the request's JSON body, pictures included
    image_keys: tuple = ()  # each picture's identity, for encoder-cache hits (default: every picture new)
    image_offsets: tuple = ()  # each picture's first prompt position (default: together, after the template's)
    block_keys: tuple = ()  # each full KV block's identity (prompt, then answer), for prefix-cache hits

    @property
    def prompt_tokens(self) -> int:
        return self.text_tokens + sum(self.image_tokens)


def make_requests(mix: "str | list[MixEntry]", rate: float, num_requests: int, seed: int = 0,
                  text_tokens: int = 64, output_tokens: int = 32, max_pixels: int = DEFAULT_MAX_PIXELS,
                  factor: int = FACTOR, body_bytes_per_pixel: float = 0.0) -> list[SimRequest]:
    """Poisson arrivals at `rate` per second from t=0; each request's kind drawn from the mix by weight (its
    body's bytes estimated from its pictures' pixels, for the host's costs of the twin)."""
    mix = parse_mix(mix) if isinstance(mix, str) else mix
    rng, now, requests = random.Random(seed), 0.0, []
    for i in range(num_requests):
        now += rng.expovariate(rate)
        entry = rng.choices(mix, weights=[m.weight for m in mix])[0]
        images = tuple(visual_tokens(entry.width, entry.height, max_pixels, factor) for _ in range(entry.num_images))
        body_bytes = round(body_bytes_per_pixel * entry.num_images * entry.width * entry.height)
        requests.append(SimRequest(i, now, images, text_tokens, output_tokens, body_bytes=body_bytes))
    return requests


def requests_from_load(result: dict) -> list[SimRequest]:
    """The answered requests of one rate of a load run's JSON (its `records`), arrivals from t=0."""
    done = [r for r in result["records"] if r["error"] is None and r["completion_tokens"]]
    start = min(r["sent_at"] for r in result["records"])
    requests = []
    for i, r in enumerate(sorted(done, key=lambda r: r["sent_at"])):
        n, tokens = r["num_images"], r["visual_tokens"]
        images = tuple(tokens // n + (k < tokens % n) for k in range(n)) if n else ()
        requests.append(SimRequest(i, r["sent_at"] - start, images, r["prompt_tokens"] - tokens,
                                   r["completion_tokens"], r.get("cached_tokens", 0), r.get("body_bytes", 0)))
    return requests
