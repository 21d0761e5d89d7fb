"""Visual-token compression: keep fewer of an image's visual tokens, after the projector, before the prefill.

Lesson: lessons/14-visual-token-compression.md.

An image of 144 visual tokens costs the language model 144 prompt positions: prefill compute, KV blocks, and
attention work for every later token. Compression hands the language model fewer of them. It happens in two
places on the request path:

- at expansion (inputs/prompt.py), the policy fixes how many <|image_pad|> tokens the image gets
  (`kept_layout`), so the prompt, its KV blocks and the scheduler's budget see the smaller count from the start;
- after the vision tower and the projector (`encode_images`), the policy picks or merges that many tokens
  (`compress`), and says where each kept token sits in the image's grid (its (t, h, w) M-RoPE coordinates).

The methods, baselines first (independent benchmarks found plain pooling and random selection "surprisingly
strong" against published selection methods):

- "pool": average neighbouring tokens in windows of kh x kw (1x2 at keep_ratio 0.5, 2x2 at 0.25, 3x4 at 0.1).
  The pooled tokens form a smaller grid, and their M-RoPE positions are that grid's, as if the image were smaller.
- "random": a random subset, seeded by the image's hash so that the same picture keeps the same tokens.
- "prune": max-min diversity after the projector (DivPrune, Alvar et al., CVPR 2025): start from the most isolated
  token, then keep adding the token farthest (in cosine distance) from everything kept so far, so that a uniform
  background is kept once and not 50 times. The project's default selection method.
- "attention": VisionZip-style (Yang et al., CVPR 2025): "dominant" tokens are those receiving the most attention
  in the vision tower's last layer (computed explicitly for that layer, `VisionTransformer.forward`), and a few
  "contextual" tokens each average the remaining tokens most similar to them.

A selected (or contextual) token keeps its own (t, h, w) position, and the text after the image resumes where it
would have without compression, at the grid's largest extent. Pruning *inside* the language model (FastV: drop
tokens after layer K by the attention they get) is left out: its KV rows would differ per layer, which breaks one
uniform paged KV layout and prefix caching across requests. The lesson says more.

The policy is part of an image's identity (`ProcessedImage.with_compression`): the encoder cache key and the
prefix-cache block hash both change with the method and ratio, so two policies never share visual tokens.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nanomm.errors import InvalidInputError

METHODS = ("pool", "random", "prune", "attention")
CONTEXTUAL_SHARE = 1 / 6  # "attention": the share of kept tokens that are merged contextual ones (VisionZip: 10 of 64)


@dataclass(frozen=True)
class CompressionPolicy:
    method: str
    keep_ratio: float  # in (0, 1): the share of an image's visual tokens the language model gets

    @property
    def key(self) -> str:
        """What goes into an image's hash: the method and the exact ratio (repr of a float is exact)."""
        return f"{self.method}:{self.keep_ratio!r}"


@dataclass
class VisualTokens:
    """An image's tokens as the language model gets them."""
    embeds: torch.Tensor  # (tokens, hidden)
    coords: torch.Tensor | None = None  # (3, tokens) (t, h, w) in the token grid; None: every cell, in order


def parse_policy(value, name: str = "visual_token_compression") -> CompressionPolicy | None:
    """A policy from {"method": ..., "keep_ratio": ...} (or None: no compression). keep_ratio 1 is no compression,
    so it shares its cache entries with an uncompressed image. Anything else is an InvalidInputError."""
    if value is None or isinstance(value, CompressionPolicy):
        return value if value is None or value.keep_ratio < 1 else None
    if not isinstance(value, dict) or set(value) != {"method", "keep_ratio"}:
        raise InvalidInputError(f"{name} must be a dict with exactly 'method' and 'keep_ratio', got {value!r:.80}")
    method, ratio = value["method"], value["keep_ratio"]
    if method not in METHODS:
        raise InvalidInputError(f"{name}: unknown method {method!r}; choose one of {list(METHODS)}")
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not (0 < ratio <= 1):
        raise InvalidInputError(f"{name}: keep_ratio must be a number in (0, 1], got {ratio!r}")
    return CompressionPolicy(method, float(ratio)) if ratio < 1 else None


def policy_from_text(text: str) -> dict:
    """A command line's "prune:0.5" -> {"method": "prune", "keep_ratio": 0.5}; InvalidInputError if not a policy."""
    method, _, ratio = text.partition(":")
    try:
        policy = {"method": method, "keep_ratio": float(ratio)}
    except ValueError:
        raise InvalidInputError(f"{text!r}: write METHOD:KEEP_RATIO, e.g. prune:0.5 or pool:0.25") from None
    parse_policy(policy, repr(text))
    return policy


def pool_window(keep_ratio: float) -> tuple[int, int]:
    """The smallest window of 1x2, 2x2, 2x3, 3x3, 3x4, ... whose area is at least 1 / keep_ratio."""
    kh, kw = 1, 1
    while kh * kw * keep_ratio < 1 - 1e-9:
        kh, kw = (kh, kw + 1) if kh == kw else (kh + 1, kw)
    return kh, kw


def kept_layout(grid: tuple[int, int, int], policy: CompressionPolicy | None) -> tuple[int, int]:
    """(tokens kept, the grid's extent) of an image whose token grid is (T, H, W), merged units. The text after
    the image resumes at the image's first position + extent (for pooling, the pooled grid's extent)."""
    t, h, w = grid
    if policy is None:
        return t * h * w, max(grid)
    if policy.method == "pool":
        kh, kw = pool_window(policy.keep_ratio)
        pooled = (t, -(-h // kh), -(-w // kw))
        return math.prod(pooled), max(pooled)
    return max(1, math.ceil(t * h * w * policy.keep_ratio)), max(grid)


def grid_coords(t: int, h: int, w: int) -> torch.Tensor:
    """(3, t*h*w) coordinates of every cell of a grid in token order: t-major, then rows, then columns."""
    tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
    return torch.stack([tt, hh, ww]).reshape(3, -1)


def compress(embeds: torch.Tensor, grid: tuple[int, int, int], policy: CompressionPolicy | None, seed: int = 0,
             attention: torch.Tensor | None = None) -> VisualTokens:
    """embeds (T*H*W, hidden) of one image whose token grid is (T, H, W) -> the tokens its policy keeps.
    seed: for "random"; attention (T*H*W,): the attention each token received in the vision tower's last layer,
    for "attention"."""
    if policy is None:
        return VisualTokens(embeds)
    num_kept, _ = kept_layout(grid, policy)
    if policy.method == "pool":
        return _pool(embeds, grid, pool_window(policy.keep_ratio))
    if policy.method == "random":
        generator = torch.Generator().manual_seed(seed)
        kept = torch.randperm(embeds.shape[0], generator=generator)[:num_kept]
    elif policy.method == "prune":
        kept = max_min_diverse(embeds, num_kept)
    else:
        return _dominant_and_contextual(embeds, grid, attention, num_kept)
    kept = kept.sort().values.to(embeds.device)  # in raster order, as the uncompressed tokens were
    return VisualTokens(embeds[kept], grid_coords(*grid)[:, kept.cpu()])


def _pool(embeds: torch.Tensor, grid: tuple[int, int, int], window: tuple[int, int]) -> VisualTokens:
    """Average each kh x kw window of the token grid; windows at the bottom and right edges average what they cover."""
    (t, h, w), (kh, kw) = grid, window
    ph, pw = -(-h // kh), -(-w // kw)  # the pooled grid
    x = embeds.view(t, h, w, -1)  # (T, H, W, hidden)
    ones = torch.ones(t, h, w, 1, dtype=embeds.dtype, device=embeds.device)
    pad = (0, 0, 0, pw * kw - w, 0, ph * kh - h)  # zeros on the right and at the bottom
    sums = F.pad(x, pad).view(t, ph, kh, pw, kw, -1).sum(dim=(2, 4))  # (T, ph, pw, hidden)
    counts = F.pad(ones, pad).view(t, ph, kh, pw, kw, 1).sum(dim=(2, 4))  # (T, ph, pw, 1)
    return VisualTokens((sums / counts).reshape(t * ph * pw, -1), grid_coords(t, ph, pw))


def max_min_diverse(embeds: torch.Tensor, num_kept: int) -> torch.Tensor:
    """Greedy max-min diversity (DivPrune): indices of num_kept tokens, each one the farthest (in cosine distance)
    from those kept before it. Memory stays O(tokens): the (tokens, tokens) distances are never held whole."""
    unit = F.normalize(embeds.float(), dim=-1)  # (n, hidden)
    kept = [int(_nearest_neighbour_distances(unit).argmax())]  # the most isolated token
    to_kept = 1 - unit @ unit[kept[0]]  # (n,) each token's distance to its nearest kept token
    for _ in range(num_kept - 1):
        to_kept[kept] = -1  # never pick a kept token again
        kept.append(int(to_kept.argmax()))
        to_kept = torch.minimum(to_kept, 1 - unit @ unit[kept[-1]])
    return torch.tensor(kept)


def _nearest_neighbour_distances(unit: torch.Tensor, rows_per_chunk: int = 1024) -> torch.Tensor:
    """(n,) each unit vector's cosine distance to its nearest other one, a chunk of rows at a time."""
    out = []
    for start in range(0, unit.shape[0], rows_per_chunk):
        distance = 1 - unit[start:start + rows_per_chunk] @ unit.T  # (rows, n)
        rows = torch.arange(distance.shape[0], device=unit.device)
        distance[rows, start + rows] = float("inf")  # not itself
        out.append(distance.min(dim=1).values)
    return torch.cat(out)


def _dominant_and_contextual(embeds: torch.Tensor, grid: tuple[int, int, int], attention: torch.Tensor,
                             num_kept: int) -> VisualTokens:
    """VisionZip's two kinds of token: the num_dominant most attended-to tokens as they are, and num_contextual
    tokens spread evenly over the rest, each the average of itself and the remaining tokens closest to it."""
    num_contextual = int(num_kept * CONTEXTUAL_SHARE)
    dominant = attention.topk(num_kept - num_contextual).indices.cpu()
    rest = torch.ones(embeds.shape[0], dtype=torch.bool)
    rest[dominant] = False
    rest = rest.nonzero().flatten()  # (n - dominant,) indices
    kept, merged = dominant.tolist(), {}
    if num_contextual:
        step = len(rest) // num_contextual
        targets = rest[::step][:num_contextual]  # evenly spaced over the remaining tokens
        similarity = F.normalize(embeds[rest].float(), dim=-1) @ F.normalize(embeds[targets].float(), dim=-1).T
        owner = similarity.argmax(dim=1).cpu()  # (n - dominant,) the target each remaining token joins
        owner[torch.arange(num_contextual) * step] = torch.arange(num_contextual)  # a target joins itself
        for j, target in enumerate(targets.tolist()):
            merged[target] = embeds[rest[owner == j].to(embeds.device)].mean(dim=0)
        kept += targets.tolist()
    kept = sorted(kept)
    rows = [merged[i] if i in merged else embeds[i] for i in kept]
    return VisualTokens(torch.stack(rows), grid_coords(*grid)[:, kept])


def seed_of(content_hash: str) -> int:
    """A generator seed from an image's hash: the same picture under the same policy keeps the same tokens."""
    return int(content_hash[:15], 16)


def encode_images(model, images: list) -> list[VisualTokens]:
    """Run the vision tower on several preprocessed images (`ProcessedImage`) at once, then compress each one by
    its own policy. The last layer's attention is computed only when some image asks for "attention"."""
    pixels = torch.cat([im.pixel_values for im in images]).to(model.device)
    grids = [tuple(im.grid_thw) for im in images]
    wants_attention = any(im.compression is not None and im.compression.method == "attention" for im in images)
    if wants_attention:
        embeds, attention = model.encode_images(pixels, grids, received_attention=True)
    else:
        embeds, attention = model.encode_images(pixels, grids), [None] * len(images)
    return [compress(e, im.token_grid, im.compression, seed_of(im.content_hash), a)
            for e, im, a in zip(embeds, images, attention)]
