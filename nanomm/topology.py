"""One topology grammar for every tool: the load generator, the simulators, the Ray app and the lessons.

Lesson: lessons/13-three-topologies.md.

    integrated      one engine: the tower, prefill and decode in one process
    dp<N>           N integrated engines behind the router (dp1 is `integrated`)
    <X>e<Y>pd       X encoders; Y engines that prefill and decode (the tower runs in the encoders)
    <X>e<Y>p<Z>d    X encoders; Y prefill instances; Z decode instances (the prompt's KV crosses to decode)

e.g. `dp4`, `1e3pd`, `1e1p1d`, `2e2p1d`. A name says both the shape (which pools there are) and each pool's size;
`SHAPES` are the three shapes as patterns, which `search_pools` takes to try every size.
"""

import re
from dataclasses import dataclass

GRAMMAR = re.compile(r"(?:dp(?P<dp>\d+))|(?:(?P<e>\d+)e(?P<p>\d+)(?:pd|p(?P<d>\d+)d))")
SHAPES = ("dp<N>", "<X>e<Y>pd", "<X>e<Y>p<Z>d")
POOL_NAMES = {"dp<N>": ("worker",), "<X>e<Y>pd": ("encode", "lm"), "<X>e<Y>p<Z>d": ("encode", "prefill", "decode")}


@dataclass(frozen=True)
class Topology:
    encoders: int  # 0: the tower runs inside the engines
    prefill: int  # engines that take prompts (and decode them too when `decode` is 0)
    decode: int = 0  # decode instances (0: no P/D split)

    @property
    def shape(self) -> str:
        return "dp<N>" if not self.encoders else "<X>e<Y>p<Z>d" if self.decode else "<X>e<Y>pd"

    @property
    def sizes(self) -> tuple[int, ...]:
        """Each pool's size, in the shape's pool order (POOL_NAMES)."""
        return {"dp<N>": (self.prefill,), "<X>e<Y>pd": (self.encoders, self.prefill),
                "<X>e<Y>p<Z>d": (self.encoders, self.prefill, self.decode)}[self.shape]

    @property
    def pools(self) -> dict[str, int]:
        return dict(zip(POOL_NAMES[self.shape], self.sizes))

    @property
    def gpus(self) -> int:
        return self.encoders + self.prefill + self.decode

    @property
    def name(self) -> str:
        if self.shape == "dp<N>":
            return "integrated" if self.prefill == 1 else f"dp{self.prefill}"
        return f"{self.encoders}e{self.prefill}p" + (f"{self.decode}d" if self.decode else "d")

    def __str__(self) -> str:
        return self.name


def parse_topology(name: "str | Topology") -> Topology:
    """'integrated', 'dp4', '1e3pd', '1e1p1d', ... -> Topology; anything else is a ValueError naming the grammar."""
    if isinstance(name, Topology):
        return name
    text = str(name).strip().lower()
    if text == "integrated":
        return Topology(0, 1)
    match = GRAMMAR.fullmatch(text)
    sizes = [int(v) for v in match.groupdict().values() if v is not None] if match else []
    if not match or min(sizes) < 1:
        raise ValueError(f"unknown topology {name!r}: integrated, dp<N>, <X>e<Y>pd or <X>e<Y>p<Z>d "
                         "(e.g. dp4, 1e3pd, 1e1p1d), every count at least 1")
    if match["dp"]:
        return Topology(0, int(match["dp"]))
    return Topology(int(match["e"]), int(match["p"]), int(match["d"] or 0))


def topology_of(shape: str, sizes: tuple[int, ...]) -> Topology:
    """The topology of a shape (one of SHAPES) with these pool sizes: ('<X>e<Y>pd', (2, 3)) -> 2e3pd."""
    if shape not in SHAPES or len(sizes) != len(POOL_NAMES[shape]):
        raise ValueError(f"shape {shape!r} with sizes {sizes}: a shape is one of {SHAPES}, with a size per pool")
    if shape == "dp<N>":
        return Topology(0, sizes[0])
    return Topology(sizes[0], sizes[1], sizes[2] if len(sizes) == 3 else 0)
