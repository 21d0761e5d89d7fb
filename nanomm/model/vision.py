"""The Qwen2-VL vision tower: patch embedding, ViT blocks with 2-D rotary, and the PatchMerger projector.

Lesson: lessons/02-vision-encoder.md.

Input is what `nanomm.inputs.image` produces: the patches of one or more images concatenated into one
(num_patches, 3*2*14*14) tensor, plus each image's grid (t, h, w) in 14-px patch units. Output is one
tensor per image of (t*h*w/4, hidden_size) visual tokens, ready to replace that image's <|image_pad|> tokens.

Several images run through one forward pass: every linear layer sees all patches of all images at once, and
attention is block-diagonal (each image attends only to itself): the segments of one length (pictures of one
size, or Qwen2.5-VL's full windows) go through one batched attention call, so the kernels a layer launches grow
with the number of distinct sizes, not of pictures, and no image pays for another's length.
"""

import itertools

import torch
import torch.nn.functional as F
from torch import nn

from nanomm.model.config import VisionConfig
from nanomm.model.rope import apply_rotary, vision_cos_sin

ACTIVATIONS = {
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),  # the original CLIP activation, not exact GELU
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),  # Qwen3-VL
    "silu": F.silu,
}


class VisionAttention(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.qkv = nn.Linear(cfg.embed_dim, 3 * cfg.embed_dim)
        self.proj = nn.Linear(cfg.embed_dim, cfg.embed_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segment_lengths: list[int]):
        q, k, v = self._rotated_qkv(x, cos, sin)
        out = block_diagonal_attention(q, k, v, segment_lengths)
        return self.proj(out.reshape(x.shape[0], -1))  # (n, heads, head_dim) -> (n, embed_dim)

    def _rotated_qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """q, k (rotated), v: 3 x (n, heads, head_dim). Rotary in float32, then back to the activation dtype (what
        the reference does in bf16 too)."""
        q, k, v = self.qkv(x).view(x.shape[0], 3, self.num_heads, self.head_dim).unbind(1)
        return apply_rotary(q.float(), cos, sin).to(x.dtype), apply_rotary(k.float(), cos, sin).to(x.dtype), v

    def received_attention(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                           segment_lengths: list[int], max_weights: int = 2**24) -> torch.Tensor:
        """(n,) how much attention each patch receives, averaged over heads and over the queries of its frame (an
        image is one): the softmax weights written out, in float32, which the fused kernel never shows
        (visual-token compression, nanomm/inputs/compression.py, "attention"). Queries go a chunk at a time, so
        the scores and weights of at most max_weights entries (2 x 64 MiB) exist at once, whatever the size."""
        q, k, _ = self._rotated_qkv(x, cos, sin)
        q, k = q.float(), k.float()
        out = []
        for q_seg, k_seg in zip(q.split(segment_lengths), k.split(segment_lengths)):
            received = torch.zeros(k_seg.shape[0], device=x.device)
            for q_chunk in q_seg.split(max(1, max_weights // (self.num_heads * k_seg.shape[0]))):
                weights = attention_weights(q_chunk, k_seg)  # (heads, queries, keys)
                received += weights.sum(dim=(0, 1))
            out.append(received / (self.num_heads * q_seg.shape[0]))
        return torch.cat(out)


def attention_weights(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(head_dim)) per head: (queries, heads, head_dim), (keys, heads, head_dim) ->
    (heads, queries, keys). What scaled_dot_product_attention multiplies V by, written out."""
    scores = torch.einsum("qhd,khd->hqk", q, k) / q.shape[-1] ** 0.5
    return scores.softmax(dim=-1)


def block_diagonal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             segment_lengths: list[int]) -> torch.Tensor:
    """Bidirectional attention inside each segment of consecutive rows: (n, heads, head_dim) in and out.
    Segments of equal length are gathered into one batch, (segments, heads, length, head_dim), one call each."""
    if len(set(segment_lengths)) == 1:  # one size: the rows already are (segments * length): a view, no gather
        return _batched_full_attention(q, k, v, segment_lengths[0])
    starts = list(itertools.accumulate([0] + segment_lengths[:-1]))  # each segment's first row
    out = torch.empty_like(q)
    for length in dict.fromkeys(segment_lengths):
        first_rows = torch.tensor([s for s, n in zip(starts, segment_lengths) if n == length])
        rows = (first_rows[:, None] + torch.arange(length)).flatten().to(q.device)  # (segments * length,)
        picked = (x.index_select(0, rows) for x in (q, k, v))
        out.index_copy_(0, rows, _batched_full_attention(*picked, length))
    return out


def _batched_full_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, length: int) -> torch.Tensor:
    """Rows that are whole segments of `length`, one after another: (segments * length, heads, head_dim) ->
    (segments, heads, length, head_dim) for PyTorch's fused kernel, and back."""
    heads, head_dim = q.shape[1], q.shape[2]
    q, k, v = (x.view(-1, length, heads, head_dim).transpose(1, 2) for x in (q, k, v))
    return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(-1, heads, head_dim)


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.fc1 = nn.Linear(cfg.embed_dim, cfg.mlp_dim)
        self.fc2 = nn.Linear(cfg.mlp_dim, cfg.embed_dim)
        self.act = ACTIVATIONS[cfg.hidden_act]

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class VisionBlock(nn.Module):
    """Pre-norm transformer block: LayerNorm with bias, eps fixed at 1e-6 by the reference, and `VisionMLP`. The
    newer towers keep the block and swap its parts: make_norm builds each norm (Qwen2.5-VL: RMSNorm), mlp is the
    MLP module (Qwen2.5-VL: SwiGLU; Qwen3-VL: its own layer names)."""

    def __init__(self, cfg: VisionConfig, make_norm=None, mlp: nn.Module | None = None):
        super().__init__()
        make_norm = make_norm or (lambda: nn.LayerNorm(cfg.embed_dim, eps=1e-6))
        self.norm1 = make_norm()
        self.norm2 = make_norm()
        self.attn = VisionAttention(cfg)
        self.mlp = mlp if mlp is not None else VisionMLP(cfg)

    def forward(self, x, cos, sin, segment_lengths):
        x = x + self.attn(self.norm1(x), cos, sin, segment_lengths)
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    """A Conv3d whose kernel equals its stride: one patch in, one embedding out, i.e. a matmul.

    The weight keeps the checkpoint's Conv3d shape (embed_dim, 3, 2, 14, 14); we apply it as a linear layer
    over the flattened patch, which is the same sum of products.
    """

    def __init__(self, cfg: VisionConfig, bias: bool = False):
        super().__init__()
        t, p = cfg.temporal_patch_size, cfg.patch_size
        self.proj = nn.Module()
        self.proj.weight = nn.Parameter(torch.empty(cfg.embed_dim, cfg.in_channels, t, p, p))
        self.proj.bias = nn.Parameter(torch.empty(cfg.embed_dim)) if bias else None  # Qwen3-VL's has one

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight.flatten(1)  # (embed_dim, 3*2*14*14)
        out = pixel_values.to(weight.dtype) @ weight.T  # (num_patches, embed_dim)
        return out if self.proj.bias is None else out + self.proj.bias


class PatchMerger(nn.Module):
    """The projector: normalise each patch (a LayerNorm, unless `norm` says otherwise), concatenate each 2x2 block
    of patches, then a 2-layer GELU MLP."""

    def __init__(self, cfg: VisionConfig, norm: nn.Module | None = None):
        super().__init__()
        merged_dim = cfg.embed_dim * cfg.spatial_merge_size ** 2
        self.ln_q = norm if norm is not None else nn.LayerNorm(cfg.embed_dim, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(merged_dim, merged_dim), nn.GELU(), nn.Linear(merged_dim, cfg.hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The pixel rows are merge-block-major, so 4 consecutive patches are one 2x2 block.
        x = self.ln_q(x).view(-1, self.mlp[0].in_features)  # (patches, embed) -> (patches/4, 4*embed)
        return self.mlp(x)  # (patches/4, hidden_size)


class VisionTransformer(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg)

    def forward(self, pixel_values: torch.Tensor, image_grids: list[tuple[int, int, int]],
                received_attention: bool = False):
        """pixel_values (num_patches, 1176) of all images; returns one (tokens_i, hidden_size) tensor per image.
        received_attention: also return, per image, the attention each token receives in the last layer (tokens_i,):
        the mean over its merged patches of `VisionAttention.received_attention`."""
        cfg = self.cfg
        cos, sin = vision_cos_sin(image_grids, cfg.head_dim, cfg.rope_theta, cfg.spatial_merge_size,
                                  pixel_values.device)
        # Attention segments are frames: a t-frame grid is t segments of h*w patches (t = 1 for images).
        segment_lengths = [h * w for t, h, w in image_grids for _ in range(t)]
        x = self.patch_embed(pixel_values)  # (num_patches, embed_dim)
        for i, block in enumerate(self.blocks):
            if received_attention and i == len(self.blocks) - 1:
                last = block.attn.received_attention(block.norm1(x), cos, sin, segment_lengths)  # (num_patches,)
            x = block(x, cos, sin, segment_lengths)
        tokens = self.merger(x)  # (num_patches/4, hidden_size)
        per_image = [t * h * w // cfg.spatial_merge_size ** 2 for t, h, w in image_grids]
        if not received_attention:
            return list(tokens.split(per_image))
        last = last.view(-1, cfg.spatial_merge_size ** 2).mean(dim=1)  # (patches,) -> (tokens,): a merge block
        return list(tokens.split(per_image)), list(last.split(per_image))
