"""The Qwen3-VL vision tower: 16-px patches, a learned position grid on top of the 2-D rotary, and DeepStack.

Lessons: lessons/14-model-generations.md (what each generation changed for serving), and
lessons/02-vision-encoder.md (the Qwen2-VL tower, which this one changes).

What changed from Qwen2-VL (vision.py), and why it matters to a server:

- **16-px patches.** With the 2x2 merge a visual token covers 32x32 pixels, not 28x28: the same picture at the
  same pixel cap gives about (28/32)^2 = 77% of the visual tokens. The preprocessor's patch_size says so.
- **A learned position embedding** of `num_position_embeddings` entries (a 48x48 grid in the real checkpoints) is
  resampled bilinearly (corners aligned) to each image's patch grid and added after the patch embedding, on top
  of the 2-D rotary that every attention layer applies. The patch embedding has a bias.
- **LayerNorm + GELU (tanh) blocks**, with the MLP's layers named `linear_fc1` / `linear_fc2`.
- **DeepStack.** The outputs of the blocks in `deepstack_visual_indexes` (5, 11, 17 in Qwen3-VL-2B) each go
  through a merger of their own (normalising after the 2x2 concatenation), giving extra *levels* of visual
  tokens. The language model adds level i to the visual positions after its decoder layer i (qwen2.DeepStack).
  For a server, an image's encoding is 1 + levels tensors, not one: the encoder cache, a prefill chunk that cuts
  an image, compression and the encoder service must carry every level, sliced alike.

The tower returns, per image, a (1 + levels, tokens, hidden) tensor: level 0 is the usual visual tokens.
"""

import torch
from torch import nn

from nanomm.model.config import VisionConfig
from nanomm.model.rope import vision_cos_sin, vision_patch_positions
from nanomm.model.vision import ACTIVATIONS, PatchEmbed, VisionBlock

NORM_EPS = 1e-6


def position_grid_taps(grid_h: int, grid_w: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Bilinear resampling (corners aligned) of a side x side table to a grid_h x grid_w patch grid, as table
    indices and weights (grid_h * grid_w, 4) in raster order: taps (top, left), (top, right), (bottom, left),
    (bottom, right)."""
    def axis(size: int) -> tuple[torch.Tensor, torch.Tensor]:  # (size, 2) taps and weights along one axis
        source = torch.arange(size, dtype=torch.float32) * (side - 1) / max(size - 1, 1)
        floor = source.floor()
        taps = (floor.long()[:, None] + torch.arange(2)).clamp(0, side - 1)
        weights = (1 - (source[:, None] - floor[:, None] - torch.arange(2)).abs()).clamp(min=0)
        return taps, weights

    row_taps, row_weights = axis(grid_h)
    col_taps, col_weights = axis(grid_w)
    index = row_taps[:, None, :, None] * side + col_taps[None, :, None, :]  # (h, w, 2, 2)
    weight = row_weights[:, None, :, None] * col_weights[None, :, None, :]
    return index.reshape(-1, 4), weight.reshape(-1, 4)


class VisionMLP(nn.Module):
    """vision.VisionMLP under Qwen3-VL's layer names (linear_fc1, linear_fc2)."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.linear_fc1 = nn.Linear(cfg.embed_dim, cfg.mlp_dim)
        self.linear_fc2 = nn.Linear(cfg.mlp_dim, cfg.embed_dim)
        self.act = ACTIVATIONS[cfg.hidden_act]

    def forward(self, x):
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class Merger(nn.Module):
    """2x2 patches -> one visual token: LayerNorm, concatenate, GELU MLP. The DeepStack mergers normalise after the
    concatenation (over 4 x embed_dim) instead of before it."""

    def __init__(self, cfg: VisionConfig, norm_after_concat: bool):
        super().__init__()
        self.merged_dim = cfg.embed_dim * cfg.spatial_merge_size ** 2
        self.norm_after_concat = norm_after_concat
        self.norm = nn.LayerNorm(self.merged_dim if norm_after_concat else cfg.embed_dim, eps=NORM_EPS)
        self.linear_fc1 = nn.Linear(self.merged_dim, self.merged_dim)
        self.act = nn.GELU()
        self.linear_fc2 = nn.Linear(self.merged_dim, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.norm_after_concat:
            x = self.norm(x.view(-1, self.merged_dim))  # (patches, embed) -> (patches/4, 4*embed)
        else:
            x = self.norm(x).view(-1, self.merged_dim)
        return self.linear_fc2(self.act(self.linear_fc1(x)))  # (patches/4, hidden_size)


class DeepStackVisionTransformer(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg, bias=True)
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.embed_dim)
        self.blocks = nn.ModuleList(VisionBlock(cfg, mlp=VisionMLP(cfg)) for _ in range(cfg.depth))
        self.merger = Merger(cfg, norm_after_concat=False)
        self.deepstack_merger_list = nn.ModuleList(Merger(cfg, norm_after_concat=True)
                                                   for _ in cfg.deepstack_visual_indexes)

    def position_embeddings(self, image_grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """(num_patches, embed_dim): the learned grid resampled to each image, in merge-block-major order."""
        side = int(self.cfg.num_position_embeddings ** 0.5)
        out = []
        for t, h, w in image_grids:
            index, weight = position_grid_taps(h, w, side)
            rows, cols = vision_patch_positions([(1, h, w)], self.cfg.spatial_merge_size).unbind(1)
            order = rows * w + cols  # raster index of each patch, in the pixel rows' merge-block-major order
            device = self.pos_embed.weight.device
            index, weight = index[order].to(device), weight[order].to(device)
            out.append((self.pos_embed(index) * weight[:, :, None]).sum(1).repeat(t, 1))  # (t*h*w, embed_dim)
        return torch.cat(out)

    def forward(self, pixel_values: torch.Tensor, image_grids: list[tuple[int, int, int]],
                received_attention: bool = False):
        """pixel_values (num_patches, 3*2*16*16) of all images -> per image (1 + levels, tokens, hidden_size)
        (and with received_attention, per image the attention each token receives in the last block, as
        `vision.VisionTransformer` gives it)."""
        cfg = self.cfg
        cos, sin = vision_cos_sin(image_grids, cfg.head_dim, cfg.rope_theta, cfg.spatial_merge_size,
                                  pixel_values.device)
        segment_lengths = [h * w for t, h, w in image_grids for _ in range(t)]
        x = self.patch_embed(pixel_values)  # (num_patches, embed_dim)
        x = x + self.position_embeddings(image_grids).to(x.dtype)
        levels = []
        for i, block in enumerate(self.blocks):
            if received_attention and i == len(self.blocks) - 1:
                last = block.attn.received_attention(block.norm1(x), cos, sin, segment_lengths)  # (num_patches,)
            x = block(x, cos, sin, segment_lengths)
            if i in cfg.deepstack_visual_indexes:
                levels.append(self.deepstack_merger_list[cfg.deepstack_visual_indexes.index(i)](x))
        tokens = torch.stack([self.merger(x), *levels])  # (1 + levels, num_patches / 4, hidden_size)
        per_image = [t * h * w // cfg.spatial_merge_size ** 2 for t, h, w in image_grids]
        if not received_attention:
            return list(tokens.split(per_image, dim=1))
        last = last.view(-1, cfg.spatial_merge_size ** 2).mean(dim=1)  # (patches,) -> (tokens,): a merge block
        return list(tokens.split(per_image, dim=1)), list(last.split(per_image))
