"""Visual-token compression: keep fewer of an image's visual tokens, after the projector, before the prefill.

Lesson: lessons/10-visual-token-compression.md.

An image of 144 visual tokens costs the language model 144 prompt positions: prefill compute, KV blocks, and
attention work for every later token. Compression hands the language model fewer of them. It happens in two
places on the request path:

- at expansion (inputs/prompt.py), the policy fixes how many <|image_pad|> tokens the image gets
  (`kept_layout`), so the prompt, its KV blocks and the scheduler's budget see the smaller count from the start;
- in the encode stage (`encode_visual_tokens`, which the engine's runner and the dense reference call), after the
  vision tower and the projector, the policy picks or merges that many tokens (`compress`), and says where each
  kept token sits in the image's grid (its (t, h, w) M-RoPE coordinates).

The model knows nothing of it: it takes pixels and returns every visual token; `compress` works on what it returns.

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

A video is compressed temporal patch by temporal patch, each as a picture (lesson 17): the engine encodes a patch
at a time, and the dense reference, which encodes a clip whole, cuts its tokens into patches first
(`_compress_item`).

The policy is part of an image's identity (`ProcessedImage.with_compression`): the encoder cache key and the
prefix-cache block hash both change with the method and ratio, so two policies never share visual tokens.
"""

import argparse
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nanomm.errors import InvalidInputError
from nanomm.model.rope import grid_positions

METHODS = ("pool", "random", "prune", "attention")
CONTEXTUAL_SHARE = 1 / 6  # "attention": the share of kept tokens that are merged contextual ones (VisionZip: 10 of 64)


@dataclass(frozen=True)
class CompressionPolicy:
    method: str  # one of METHODS
    keep_ratio: float  # in (0, 1]: a selection keeps ceil(keep_ratio x tokens); pool averages windows of at least
    #                    1 / keep_ratio tokens (`pool_window`), so about that share (the grid's edges round up)

    def __post_init__(self):
        if self.method not in METHODS:
            raise InvalidInputError(f"visual_token_compression: unknown method {self.method!r}; choose one of "
                                    f"{list(METHODS)}")
        ratio = self.keep_ratio
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not (0 < ratio <= 1):
            raise InvalidInputError(f"visual_token_compression: keep_ratio must be a number in (0, 1], got {ratio!r}")

    @property
    def key(self) -> str:
        """What goes into an image's hash: the method and the exact ratio (repr of a float is exact)."""
        return f"{self.method}:{self.keep_ratio!r}"


@dataclass
class VisualTokens:
    """An image's tokens as the language model gets them."""
    embeds: torch.Tensor  # (tokens, hidden), on the model's device
    coords: torch.Tensor | None = None  # (3, tokens) (t, h, w) in the token grid, on the CPU (positions are built
    #                                     there); None: every cell, in order


def parse_policy(value, name: str = "visual_token_compression") -> CompressionPolicy | None:
    """A policy from {"method": ..., "keep_ratio": ...} (or None: no compression). keep_ratio 1 is no compression,
    so it shares its cache entries with an uncompressed image. Anything else is an InvalidInputError."""
    if isinstance(value, dict) and set(value) == {"method", "keep_ratio"}:
        try:
            value = CompressionPolicy(value["method"], value["keep_ratio"])  # checks both
        except InvalidInputError as exc:
            raise InvalidInputError(str(exc).replace("visual_token_compression", name, 1)) from None
    elif value is not None and not isinstance(value, CompressionPolicy):
        raise InvalidInputError(f"{name} must be a dict with exactly 'method' and 'keep_ratio', got {value!r:.80}")
    return None if value is None or value.keep_ratio == 1 else CompressionPolicy(value.method, float(value.keep_ratio))


def policy_argument(text: str) -> dict:
    """argparse's `type=` for a command line's "prune:0.5" -> {"method": "prune", "keep_ratio": 0.5}."""
    method, _, ratio = text.partition(":")
    try:
        policy = {"method": method, "keep_ratio": float(ratio)}
        parse_policy(policy, repr(text))
    except ValueError as exc:  # InvalidInputError is one
        detail = str(exc) if isinstance(exc, InvalidInputError) else "write METHOD:KEEP_RATIO, e.g. prune:0.5"
        raise argparse.ArgumentTypeError(f"{text!r}: {detail}") from None
    return policy


def pool_window(keep_ratio: float) -> tuple[int, int]:
    """The first window of 1x1, 1x2, 2x2, 2x3, 3x3, 3x4, ... whose area is at least 1 / keep_ratio."""
    area = math.ceil(1 / keep_ratio - 1e-9)
    k = math.ceil(math.sqrt(area)) - 1  # k x k is too small, (k + 1) x (k + 1) is not
    return (k, k + 1) if k * (k + 1) >= area else (k + 1, k + 1)


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
    return max(1, math.ceil(t * h * w * policy.keep_ratio - 1e-9)), max(grid)  # 100 x 0.07 is 7.000000000000001


def compress(embeds: torch.Tensor, grid: tuple[int, int, int], policy: CompressionPolicy | None, seed: int = 0,
             attention: torch.Tensor | None = None, similarity_width: int | None = None) -> VisualTokens:
    """embeds (T*H*W, hidden) of one image whose token grid is (T, H, W) -> the tokens its policy keeps.
    seed: for "random"; attention (T*H*W,): the attention each token received in the vision tower's last layer,
    for "attention". A DeepStack model's embeds are (levels, T*H*W, hidden): the policy judges the tokens by
    level 0 (what the decoder's input gets) and keeps, pools or merges the same tokens at every level.
    similarity_width: compare tokens by their first so many features only (level 0 of such a model)."""
    if policy is None:
        return VisualTokens(embeds)
    if embeds.dim() == 3:
        levels, n, hidden = embeds.shape
        wide = embeds.transpose(0, 1).reshape(n, levels * hidden)  # (tokens, levels x hidden): level 0 first
        out = compress(wide, grid, policy, seed, attention, similarity_width=hidden)
        return VisualTokens(out.embeds.view(-1, levels, hidden).transpose(0, 1), out.coords)
    width = similarity_width or embeds.shape[1]
    num_kept, _ = kept_layout(grid, policy)
    if policy.method == "pool":
        return _pool(embeds, grid, pool_window(policy.keep_ratio))
    if policy.method == "attention":
        return _dominant_and_contextual(embeds, grid, attention, num_kept, width)
    if policy.method == "random":
        generator = torch.Generator().manual_seed(seed)
        kept = torch.randperm(embeds.shape[0], generator=generator)[:num_kept]
    else:  # "prune"
        kept = max_min_diverse(embeds[:, :width], num_kept).cpu()
    kept = kept.sort().values  # in raster order, as the uncompressed tokens were
    return VisualTokens(embeds[kept.to(embeds.device)], grid_positions(*grid)[:, kept])


def encode_visual_tokens(model, images: list) -> list[VisualTokens]:
    """The encode stage: preprocessed images (`nanomm.inputs.image.ProcessedImage`) -> what the language model gets
    of each. One vision forward (`Qwen2VL.encode_images`) for them all, then each image's compression if it has a
    policy. The last layer's attention is computed only when a policy needs it ("attention")."""
    pixels = torch.cat([im.pixel_values for im in images]).to(model.device)
    grids = [tuple(im.grid_thw) for im in images]
    if any(im.compression is not None and im.compression.method == "attention" for im in images):
        embeds, attention = model.encode_images(pixels, grids, received_attention=True)
    else:
        embeds, attention = model.encode_images(pixels, grids), [None] * len(images)
    return [_compress_item(_pruned(e, im), im, a) for e, im, a in zip(embeds, images, attention)]


def _compress_item(embeds: torch.Tensor, item, attention) -> VisualTokens:
    """One item's tokens under its policy. A whole clip (the dense reference encodes clips whole) is compressed
    temporal patch by temporal patch, each as the engine compresses it alone: its own grid (1, h, w) and seed."""
    t, h, w = item.token_grid
    if item.compression is None or t == 1 or not getattr(item, "is_video", False):
        return compress(embeds, item.token_grid, item.compression, seed_of(item.content_hash), attention)
    n, parts = h * w, []
    for g, patch in enumerate(item.temporal_groups()):
        rows = slice(g * n, (g + 1) * n)
        parts.append(compress(embeds[..., rows, :], (1, h, w), item.compression, seed_of(patch.content_hash),
                              None if attention is None else attention[rows]))
    return VisualTokens(torch.cat([p.embeds for p in parts], dim=-2), torch.cat([p.coords for p in parts], dim=1))


def _pruned(embeds: torch.Tensor, item) -> torch.Tensor:
    """A pruned video's kept tokens (inputs/video_pruning.py: chosen from its pixels, before the tower ran), at
    every DeepStack level; anything else whole."""
    rows = getattr(item, "kept_rows", None)
    return embeds if rows is None else embeds.index_select(-2, rows.to(embeds.device))


def _pool(embeds: torch.Tensor, grid: tuple[int, int, int], window: tuple[int, int]) -> VisualTokens:
    """Average each kh x kw window of the token grid, in float32; windows at the bottom and right edges average
    what they cover. A window larger than the grid is the grid."""
    (t, h, w), (kh, kw) = grid, window
    kh, kw = min(kh, h), min(kw, w)
    ph, pw = -(-h // kh), -(-w // kw)  # the pooled grid
    x = embeds.float().view(t, h, w, -1)  # (T, H, W, hidden)
    ones = torch.ones(t, h, w, 1, device=embeds.device)
    pad = (0, 0, 0, pw * kw - w, 0, ph * kh - h)  # zeros on the right and at the bottom
    sums = F.pad(x, pad).view(t, ph, kh, pw, kw, -1).sum(dim=(2, 4))  # (T, ph, pw, hidden)
    counts = F.pad(ones, pad).view(t, ph, kh, pw, kw, 1).sum(dim=(2, 4))  # (T, ph, pw, 1)
    pooled = (sums / counts).reshape(t * ph * pw, -1).to(embeds.dtype)  # (T*ph*pw, hidden)
    return VisualTokens(pooled, grid_positions(t, ph, pw))


def max_min_diverse(embeds: torch.Tensor, num_kept: int) -> torch.Tensor:
    """Greedy max-min diversity (DivPrune): indices of num_kept tokens, each one the farthest (in cosine distance)
    from those kept before it. Memory stays O(tokens): the (tokens, tokens) distances are never held whole."""
    unit = F.normalize(embeds.float(), dim=-1)  # (n, hidden)
    kept = torch.empty(num_kept, dtype=torch.long, device=unit.device)  # on the device: no host sync per token
    kept[0] = _nearest_neighbour_distances(unit).argmax()  # the most isolated token
    to_kept = 1 - unit @ unit[kept[0]]  # (n,) each token's distance to its nearest kept token
    for i in range(1, num_kept):
        to_kept[kept[i - 1]] = -1  # never pick a kept token again (the minimum below keeps the -1)
        kept[i] = to_kept.argmax()
        to_kept = torch.minimum(to_kept, 1 - unit @ unit[kept[i]])
    return kept


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
                             num_kept: int, width: int) -> VisualTokens:
    """VisionZip's two kinds of token: the most attended-to tokens as they are ("dominant"), and num_kept / 6
    "contextual" tokens spread evenly over the rest, each the average of itself and the remaining tokens most
    similar to it (cosine similarity of the projector's output). Every kept token keeps its own position."""
    num_contextual = int(num_kept * CONTEXTUAL_SHARE)
    dominant = attention.topk(num_kept - num_contextual).indices.cpu()
    is_rest = torch.ones(embeds.shape[0], dtype=torch.bool)
    is_rest[dominant] = False
    rest = is_rest.nonzero().flatten()  # (n - dominant,) indices
    targets = rest[::max(1, len(rest) // max(1, num_contextual))][:num_contextual].contiguous()  # evenly spaced
    kept = torch.cat([dominant, targets]).sort().values  # in raster order
    tokens = embeds[kept.to(embeds.device)].clone()  # (num_kept, hidden)
    if num_contextual:
        similarity = (F.normalize(embeds[rest, :width].float(), dim=-1) @  # by the first `width` features
                      F.normalize(embeds[targets, :width].float(), dim=-1).T)
        owner = similarity.argmax(dim=1)  # (n - dominant,) the target each remaining token joins
        owner[torch.searchsorted(rest, targets).to(owner.device)] = torch.arange(num_contextual, device=owner.device)
        sums = torch.zeros(num_contextual, embeds.shape[1], device=embeds.device).index_add_(
            0, owner, embeds[rest].float())  # (contextual, hidden)
        counts = torch.bincount(owner, minlength=num_contextual).float()[:, None]  # a target joins itself: >= 1
        tokens[torch.searchsorted(kept, targets).to(embeds.device)] = (sums / counts).to(embeds.dtype)
    return VisualTokens(tokens, grid_positions(*grid)[:, kept])


def seed_of(content_hash: str) -> int:
    """A generator seed from an image's hash: the same picture under the same policy keeps the same tokens."""
    return int(content_hash[:15], 16)
