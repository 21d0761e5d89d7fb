"""EVS-style video pruning: drop the visual tokens that barely change from one temporal patch to the next.

Lesson: lessons/17-video.md (section "Pruning what does not move").

A camera on a tripod films the same wall for twenty seconds: every temporal patch repeats the last one's tokens,
and each costs the language model as many positions as the first. Efficient Video Sampling (EVS, as vLLM's
`--video-pruning-rate` serves it) keeps the tokens that changed and drops the rest, at a set rate, and keeps each
kept token's own M-RoPE position, so the model still knows where and when it sits.

nanomm judges change on the pixels, before the vision tower runs, where vLLM judges it on the tower's output:

  - for each merged token of temporal patch g >= 1 (its merge x merge patches, both frames, all channels of the
    resized uint8 frames), the mean absolute difference from the same token of patch g - 1;
  - patch 0 keeps every token (nothing came before it); every later patch keeps its ceil((1 - rate) x n) most
    changed tokens, ties to the earlier token, in raster order.

Deciding from pixels means the kept tokens are known when the prompt is expanded: the prompt's length, its KV
blocks and every position are fixed before any encoding, and a clip is still encoded a patch at a time as prefill
reaches it (the tower sees whole patches; the pruning picks rows of its output). A per-patch count, rather than
one count for the clip, keeps that streaming: no patch waits for a later one. scripts/video_pruning.py measures
what it costs the demo model's answers.
"""

import math

import torch

from nanomm.errors import InvalidInputError


def check_pruning_rate(value, name: str) -> float:
    """A pruning rate is a number in [0, 1): the share of each later temporal patch's tokens to drop."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise InvalidInputError(f"{name} must be a number in [0, 1), got {value!r}")
    return float(value)


def kept_per_patch(frames: torch.Tensor, merge_factor: int, temporal_patch_size: int,
                   rate: float) -> list[torch.Tensor]:
    """frames (T_padded, H, W, 3) uint8, resized and padded -> per temporal patch, the indices (raster order of its
    merged token grid) of the tokens it keeps. merge_factor: the pixels one merged token spans (patch x merge)."""
    frames_total, height, width, _ = frames.shape
    rows, cols = height // merge_factor, width // merge_factor
    patches = frames_total // temporal_patch_size
    # (patches, T, rows, f, cols, f, 3) -> one float per merged token and patch: its pixels, both frames, summed
    x = frames.view(patches, temporal_patch_size, rows, merge_factor, cols, merge_factor, 3).to(torch.float32)
    x = x.permute(0, 2, 4, 1, 3, 5, 6).reshape(patches, rows * cols, -1)  # (patches, tokens, pixels of a token)
    everything = torch.arange(rows * cols)
    if rate == 0 or patches == 1:
        return [everything] * patches
    change = (x[1:] - x[:-1]).abs().mean(dim=-1)  # (patches - 1, tokens): how much each token moved
    keep = max(1, math.ceil((1 - rate) * rows * cols - 1e-9))
    kept = [everything]
    for row in change:
        order = torch.sort(-row, stable=True).indices[:keep]  # most changed first, ties to the earlier token
        kept.append(order.sort().values)
    return kept


def check_kept(kept, num_tokens: int, name: str) -> torch.Tensor:
    """Indices a peer sent for a patch's kept tokens: increasing, within its grid."""
    if not (isinstance(kept, list) and kept and all(type(i) is int for i in kept)
            and all(0 <= a < b for a, b in zip(kept, kept[1:])) and 0 <= kept[0] and kept[-1] < num_tokens):
        raise InvalidInputError(f"{name}: kept must be increasing token indices below {num_tokens}")
    return torch.tensor(kept, dtype=torch.long)
