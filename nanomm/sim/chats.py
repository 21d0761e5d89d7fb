"""Multi-turn chat sessions for the twin: each turn's prompt carries the turns before it, text and pictures.

Lesson: lessons/15-scaling-each-pool.md (cache-affine routing among several engines).

A session is one growing stream of positions: the chat template's first `prefix_tokens`, then per turn its new
pictures, its question and its answer. Turn t's prompt is the stream up to its question; its answer's positions
follow. So every block of the stream has one identity in the session (`block_keys`: (session, block), or
("template", block) for blocks inside the template that every session shares), and every picture one identity
(`image_keys`: (session, turn, picture)): an engine that ran turn t of a session holds the blocks turn t + 1 starts
with, and the pictures it encoded, as nanomm's prefix cache and encoder cache would.

Arrivals are an open loop: sessions start at `rate` per second (Poisson, from `seed`), and a session's turns
arrive between 0.5 and 1.5 x `think_s` apart (uniform, from `seed`). A turn that arrives before the previous one's answer is done finds less in the caches,
as a real client that does not wait would.
"""

import random

from nanomm.inputs.image import DEFAULT_MAX_PIXELS
from nanomm.sim.workload import FACTOR, MixEntry, SimRequest, parse_mix, visual_tokens


def chat_turns(session: int, arrivals: list[float], turns: list[MixEntry], text_tokens: int,
                  output_tokens: int, prefix_tokens: int, block_size: int, max_pixels: int,
                  factor: int) -> list[SimRequest]:
    """One session's requests: turn t (from 0) arrives at arrivals[t]."""
    requests, position, images, offsets, keys = [], prefix_tokens, [], [], []
    for turn, entry in enumerate(turns):
        for picture in range(entry.num_images):
            images.append(visual_tokens(entry.width, entry.height, max_pixels, factor))
            offsets.append(position)
            keys.append((session, turn, picture))
            position += images[-1]
        position += text_tokens  # the question
        written = position + output_tokens - 1  # the answer's last token is sampled, never computed
        blocks = tuple(("template", b) if (b + 1) * block_size <= prefix_tokens else (session, b)
                       for b in range(written // block_size))
        requests.append(SimRequest(session * len(turns) + turn, arrivals[turn], tuple(images),
                                   position - sum(images), output_tokens, image_keys=tuple(keys),
                                   image_offsets=tuple(offsets), block_keys=blocks))
        position += output_tokens  # the answer, carried by the next turn's prompt
    return requests


def make_chats(mix: "str | list[MixEntry]", rate: float, sessions: int, turns: int, think_s: float,
                  seed: int = 0, text_tokens: int = 64, output_tokens: int = 32, prefix_tokens: int = 16,
                  block_size: int = 16, max_pixels: int = DEFAULT_MAX_PIXELS, factor: int = FACTOR) -> list[SimRequest]:
    """`sessions` chats of `turns` turns each, every turn's pictures drawn from the mix; in arrival order."""
    mix = parse_mix(mix) if isinstance(mix, str) else mix
    if sessions < 1 or turns < 1 or think_s <= 0 or rate <= 0:
        raise ValueError("sessions need sessions >= 1, turns >= 1, a think time > 0 and a rate > 0")
    rng, start, requests = random.Random(seed), 0.0, []
    for session in range(sessions):
        start += rng.expovariate(rate)
        drawn = rng.choices(mix, weights=[m.weight for m in mix], k=turns)
        arrivals = [start]
        for _ in range(turns - 1):
            arrivals.append(arrivals[-1] + think_s * rng.uniform(0.5, 1.5))
        requests += chat_turns(session, arrivals, drawn, text_tokens, output_tokens, prefix_tokens,
                                  block_size, max_pixels, factor)
    return sorted(requests, key=lambda r: (r.arrival_s, r.id))
