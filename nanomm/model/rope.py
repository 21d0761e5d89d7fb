"""Rotary position embeddings for both towers, and Qwen2-VL's multimodal M-RoPE position ids.

Lesson: lessons/03-mrope.md.

The language model gives every token three position ids (t, h, w). Text tokens use the same number on all
three axes, so text-only prompts reduce to ordinary 1-D RoPE. The tokens of an image sit on a grid: they share
one t, and their h and w follow the grid rows and columns. The rotary frequency bands are split between the
axes by `mrope_section` (for Qwen2-VL-2B: 16 bands follow t, 24 follow h, 24 follow w).

The vision tower uses a 2-D rotary embedding instead: half the bands follow the patch row, half the column.
"""

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) on the last dim: the NeoX rotary layout (halves, not interleaved pairs)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (tokens, heads, head_dim) by per-token angles cos/sin (tokens, head_dim)."""
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # (tokens, 1, head_dim): broadcast over heads
    return x * cos + rotate_half(x) * sin


def inverse_frequencies(dim: int, theta: float, device=None) -> torch.Tensor:
    """1 / theta^(2i/dim), computed in float32 exactly as the reference does (float64 then cast differs)."""
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))


# ----------------------------------------------------------------------------------------------------------
# Language model: M-RoPE


def mrope_positions(input_ids: list[int], image_grids: list[tuple[int, int, int]], image_token_id: int,
                    spatial_merge_size: int, compressed=None, video_token_id: int | None = None,
                    time_intervals=None) -> tuple[torch.Tensor, int]:
    """Position ids (3, L) for an expanded prompt, and the rope delta that decode positions continue from.

    Text runs count up on all three axes. The k-th run of image (or, with video_token_id, video) tokens is
    image_grids[k]: with a merged grid (T, H, W) its tokens get (start + t, start + h, start + w), and the text
    after it resumes at start + max(T, H, W). A video's T counts its temporal patches (two frames each): Qwen2-VL's
    rule, which transformers 5.24 departs from when T > max(H, W) (lesson 17). Generated token i (0-based over the
    whole sequence, i >= L) gets i + delta.

    time_intervals: per item, None (time ids 0, 1, 2, ...) or Qwen2.5-VL's interval for a video, tokens_per_second x
    its seconds per temporal patch: temporal patch g gets time id trunc(g x interval), in float32 as transformers
    computes it, and the text after the video resumes one past its largest id.

    compressed: per image, None, or (extent, coords) for an image whose visual tokens were compressed
    (inputs/compression.py): its tokens get start + coords (3, tokens), and the text after it resumes at
    start + extent.
    """
    compressed = compressed or [None] * len(image_grids)
    time_intervals = time_intervals or [None] * len(image_grids)
    visual = {image_token_id, video_token_id} - {None}
    blocks, start, i, k = [], 0, 0, 0
    while i < len(input_ids):
        if input_ids[i] in visual:
            if k == len(image_grids):
                raise ValueError(f"prompt has more than {k} image spans but {len(image_grids)} images were given")
            t, h, w = image_grids[k]
            grid = (t, h // spatial_merge_size, w // spatial_merge_size)
            extent, coords = compressed[k] or spaced_in_time(grid, time_intervals[k])
            blocks.append(coords + start)  # (3, tokens)
            start += extent
            i += coords.shape[1]
            k += 1
        else:
            run_end = min(_next_index(input_ids, token, i) for token in visual)
            blocks.append(torch.arange(start, start + run_end - i).expand(3, -1))
            start += run_end - i
            i = run_end
    if k != len(image_grids):
        raise ValueError(f"prompt has {k} image spans but {len(image_grids)} images were given")
    positions = torch.cat(blocks, dim=1) if blocks else torch.zeros(3, 0, dtype=torch.long)
    delta = (start - len(input_ids)) if len(input_ids) else 0
    return positions, delta


def video_time_interval(item, tokens_per_second: float) -> float | None:
    """Qwen2.5-VL's spacing of a video's temporal patches in time ids: tokens_per_second x the seconds one patch
    spans, in float32 as transformers computes it. None for a picture, or a family that counts patches (Qwen2-VL)."""
    if not tokens_per_second or not getattr(item, "is_video", False):
        return None
    return (torch.tensor(item.second_per_grid, dtype=torch.float32) * tokens_per_second).item()


def spaced_in_time(grid: tuple[int, int, int], interval: float | None) -> tuple[int, torch.Tensor]:
    """(extent, (3, t*h*w) coordinates) of a merged grid whose temporal patches are `interval` time ids apart
    (None: 1 apart). The extent is one past the largest coordinate."""
    coords = grid_positions(*grid)
    if interval is not None:
        t, h, w = grid
        ids = (torch.arange(t) * torch.tensor(interval, dtype=torch.float32)).long()  # (t,): float32, truncated
        coords[0] = ids.repeat_interleave(h * w)
    return int(coords.max()) + 1, coords


def text_positions(num_tokens: int, start: int = 0) -> torch.Tensor:
    """(3, num_tokens) positions of plain text, start, start+1, ... on all three axes: 1-D RoPE.

    A text-only Qwen2 model uses these for every token (it has no images, so an <|image_pad|> id is text).
    """
    return torch.arange(start, start + num_tokens).expand(3, -1)


def grid_positions(t: int, h: int, w: int) -> torch.Tensor:
    """(3, t*h*w) grid coordinates in token order: t-major, then rows, then columns."""
    tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
    return torch.stack([tt, hh, ww]).reshape(3, -1)


def _next_index(ids: list[int], value: int, start: int) -> int:
    try:
        return ids.index(value, start)
    except ValueError:
        return len(ids)


def mrope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, mrope_section, dtype: torch.dtype,
                  interleaved: bool = False):
    """cos/sin (tokens, head_dim) for M-RoPE positions (3, tokens), cast to the activation dtype.

    Band j of the head_dim/2 frequency bands takes its angle from the t, h or w axis according to
    mrope_section; the second half of head_dim mirrors the first (rotate_half layout). A band may be empty:
    text-only Qwen2 uses (head_dim/2, 0, 0), every band on the t axis, which is plain 1-D RoPE.
    Qwen2-VL's sections are three contiguous runs (t t ... h h ... w w ...); Qwen3-VL's are interleaved
    (t h w t h w ..., then t for the rest), so every axis gets high and low frequencies alike.
    """
    inv_freq = inverse_frequencies(head_dim, theta, positions.device)
    angles = positions[..., None].float() * inv_freq  # (3, tokens, head_dim/2)
    if interleaved:
        axis = band_axes(head_dim // 2, mrope_section, interleaved).to(positions.device)  # (head_dim/2,)
        angles = angles.gather(0, axis.expand(1, angles.shape[1], -1))[0]  # (tokens, head_dim/2): band j from axis[j]
    else:  # three contiguous runs: fewer kernels a step than the gather (lesson A3 counts them)
        bands = angles.split(list(mrope_section), dim=-1)
        angles = torch.cat([band[axis] for axis, band in enumerate(bands)], dim=-1)  # (tokens, head_dim/2)
    angles = torch.cat((angles, angles), dim=-1)  # (tokens, head_dim)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def band_axes(num_bands: int, mrope_section, interleaved: bool) -> torch.Tensor:
    """Which position axis (0 t, 1 h, 2 w) drives each rotary band."""
    if not interleaved:
        return torch.repeat_interleave(torch.arange(3), torch.tensor(list(mrope_section)))
    axes = torch.zeros(num_bands, dtype=torch.long)
    for a in (1, 2):  # h on bands 1, 4, 7, ... and w on 2, 5, 8, ..., each for its section's count
        axes[a:3 * mrope_section[a]:3] = a
    return axes


# ----------------------------------------------------------------------------------------------------------
# Vision tower: 2-D rotary over patch rows and columns


def vision_patch_positions(image_grids: list[tuple[int, int, int]], spatial_merge_size: int) -> torch.Tensor:
    """(num_patches, 2) [row, col] of every patch, in the pixel rows' merge-block-major order. Built once per
    distinct grid: pictures of one size share it."""
    m = spatial_merge_size
    per_grid = {}
    for t, h, w in dict.fromkeys(image_grids):
        rows = torch.arange(h)[:, None].expand(h, w)
        cols = torch.arange(w)[None, :].expand(h, w)
        # (h, w) -> (h/m, m, w/m, m) -> (h/m, w/m, m, m): each 2x2 merge block is contiguous
        rows = rows.reshape(h // m, m, w // m, m).permute(0, 2, 1, 3).flatten()
        cols = cols.reshape(h // m, m, w // m, m).permute(0, 2, 1, 3).flatten()
        frame = torch.stack([rows, cols], dim=-1)  # (h*w, 2)
        per_grid[t, h, w] = frame if t == 1 else frame.repeat(t, 1)  # (t*h*w, 2)
    return torch.cat([per_grid[grid] for grid in image_grids])


def vision_cos_sin(image_grids, head_dim: int, theta: float, spatial_merge_size: int, device=None):
    """float32 cos/sin (num_patches, head_dim): in each half of head_dim, the first half follows the row, the second the column."""
    inv_freq = inverse_frequencies(head_dim // 2, theta, device)  # (head_dim/4,)
    positions = vision_patch_positions(image_grids, spatial_merge_size).to(device)
    angles = (positions[..., None].float() * inv_freq).flatten(1)  # (patches, 2, hd/4) -> (patches, hd/2)
    angles = torch.cat((angles, angles), dim=-1)  # (patches, head_dim)
    return angles.cos(), angles.sin()
