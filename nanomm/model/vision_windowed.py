"""The Qwen2.5-VL vision tower: Qwen2-VL's tower (vision.py) with window attention, RMSNorm and a SwiGLU MLP.

Lessons: lessons/14-model-generations.md (what each generation changed for serving), and
lessons/02-vision-encoder.md (the Qwen2-VL tower, which this one changes).

What changed from Qwen2-VL, and why it matters to a server:

- **Windows.** Most blocks attend only within a window of `window_size` pixels (112: 4x4 visual tokens, 8x8
  patches); the blocks in `fullatt_block_indexes` (7, 15, 23, 31 in the real checkpoints) attend over the whole
  image. A window's attention costs the same however big the picture, so the tower's cost grows about linearly
  with pixels, where Qwen2-VL's attention grows with their square.
- **Window order.** For each window to be one contiguous run of patches, the patches are reordered window by
  window right after the patch embedding (a 2x2 merge block moves as one: the merger still sees its four
  patches side by side), and the visual tokens are put back in grid order after the merger. Windows tile each
  frame from the top-left corner, row by row; the last row and column of windows may be cut short.
- **Blocks** use RMSNorm and a SwiGLU MLP with biases; the merger normalises with RMSNorm.
- The rotary embedding, the patch embedding, the attention and the merger's MLP are Qwen2-VL's.
"""

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from nanomm.model.config import VisionConfig
from nanomm.model.qwen2 import RMSNorm
from nanomm.model.rope import vision_cos_sin
from nanomm.model.vision import PatchEmbed, PatchMerger, VisionBlock

NORM_EPS = 1e-6  # fixed by the reference, as in Qwen2-VL's tower


def window_order(image_grids: list[tuple[int, int, int]], spatial_merge_size: int,
                 window_tokens: int) -> tuple[torch.Tensor, list[int]]:
    """The merge blocks of all images in window order, and each window's length in patches.

    image_grids: (t, h, w) per image in patches. A merge block is one visual token (m x m patches). Returns
    order (num_blocks,): order[i] is the grid-order index of the i-th block in window order; lengths: patches
    per window, in that order (windows never span two images or two frames)."""
    order, lengths, offset = [], [], 0
    for t, h, w in image_grids:
        rows, cols = h // spatial_merge_size, w // spatial_merge_size
        index = torch.arange(t * rows * cols).view(t, rows, cols) + offset
        for frame in index:
            for top in range(0, rows, window_tokens):
                for left in range(0, cols, window_tokens):
                    window = frame[top:top + window_tokens, left:left + window_tokens].flatten()
                    order.append(window)
                    lengths.append(window.numel() * spatial_merge_size ** 2)
        offset += t * rows * cols
    return torch.cat(order), lengths


def to_window_order(x: torch.Tensor, order: torch.Tensor, block: int) -> torch.Tensor:
    """Rows of x (patches, ...) in merge-block-major grid order -> window order; block = patches per merge block."""
    return x.view(-1, block, *x.shape[1:])[order].flatten(0, 1)  # (blocks, m*m, ...) -> (patches, ...)


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)), with biases (the language model's MLP has none)."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.embed_dim, cfg.mlp_dim)
        self.up_proj = nn.Linear(cfg.embed_dim, cfg.mlp_dim)
        self.down_proj = nn.Linear(cfg.mlp_dim, cfg.embed_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class WindowedVisionTransformer(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg)
        rms_norm = partial(RMSNorm, cfg.embed_dim, NORM_EPS)
        self.blocks = nn.ModuleList(VisionBlock(cfg, make_norm=rms_norm, mlp=SwiGLU(cfg)) for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg, norm=rms_norm())

    def forward(self, pixel_values: torch.Tensor, image_grids: list[tuple[int, int, int]],
                received_attention: bool = False):
        """pixel_values (num_patches, 3*2*14*14) of all images -> one (tokens_i, hidden_size) tensor per image, in
        grid order (and with received_attention, the attention each token receives in the last block, as
        `vision.VisionTransformer` does; a windowed last block averages over the queries of its window)."""
        cfg, block = self.cfg, self.cfg.spatial_merge_size ** 2
        order, window_lengths = window_order(image_grids, cfg.spatial_merge_size,
                                             cfg.window_size // (cfg.patch_size * cfg.spatial_merge_size))
        order = order.to(pixel_values.device)
        frame_lengths = [h * w for t, h, w in image_grids for _ in range(t)]  # frames stay contiguous in window order
        cos, sin = vision_cos_sin(image_grids, cfg.head_dim, cfg.rope_theta, cfg.spatial_merge_size,
                                  pixel_values.device)
        cos, sin = to_window_order(cos, order, block), to_window_order(sin, order, block)
        x = to_window_order(self.patch_embed(pixel_values), order, block)  # (num_patches, embed_dim)
        for i, layer in enumerate(self.blocks):
            segments = frame_lengths if i in cfg.fullatt_block_indexes else window_lengths
            if received_attention and i == len(self.blocks) - 1:
                last = layer.attn.received_attention(layer.norm1(x), cos, sin, segments)  # (num_patches,)
            x = layer(x, cos, sin, segments)
        restore = torch.argsort(order)
        tokens = self.merger(x)[restore]  # (num_patches / m^2, hidden_size), back in grid order
        per_image = [t * h * w // block for t, h, w in image_grids]
        if not received_attention:
            return list(tokens.split(per_image))
        last = last.view(-1, block).mean(dim=1)[restore]  # (patches,) -> (tokens,): a merge block, in grid order
        return list(tokens.split(per_image)), list(last.split(per_image))
