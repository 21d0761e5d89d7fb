"""The Qwen2 language model inside Qwen2-VL: RMSNorm, GQA attention with q/k/v bias and M-RoPE, SwiGLU.

Lesson: lessons/03-mrope.md.

Qwen2.5-VL uses it as it is. Qwen3-VL's decoder is the same with three changes, each a config field: no q/k/v
biases, an RMSNorm over each head of q and of k before the rotation (`qk_norm`), and a head_dim of its own; and
its DeepStack adds extra levels of visual features to the visual positions after the first layers (`DeepStack`).

Tokens are flat: a forward pass takes (num_tokens, hidden) with no batch dimension, the layout a serving
engine packs many sequences into. Who sees whom is not decided here: each attention layer hands its rotated
q, k, v to an *attention backend* (`attention.attend(layer, q, k, v)`, model/attention.py), which stores k/v in
its cache and returns the attention output. The dense reference (`reference.py`) plugs in a contiguous
single-sequence cache, the engine a paged one.

This is the architecture as the checkpoint stores it, and numerically what transformers computes. The engine
serves a faster form of the same layers, with q/k/v in one matrix, fused norms and residual adds inside the
matmuls: nanomm/accel/fused_layers.py swaps them in after loading, and is tested equal to this.
"""

import torch
import torch.nn.functional as F
from torch import nn

from nanomm.model.attention import AttentionBackend
from nanomm.model.config import TextConfig
from nanomm.model.rope import apply_rotary


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight, over the hidden size; the statistics in float32 even for bf16."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Attention(nn.Module):
    """q/k/v with biases (Qwen2) or without, and for Qwen3 an RMSNorm over each head of q and of k."""

    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, attention: AttentionBackend, layer: int) -> torch.Tensor:
        """x (tokens, hidden) -> (tokens, hidden)."""
        n = x.shape[0]
        q = self.q_proj(x).view(n, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(n, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(n, self.num_kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = attention.attend(layer, q, k, v)  # (n, heads, head_dim)
        return self.o_proj(out.reshape(n, -1))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm: x + attention(norm(x)), then that + mlp(norm(that))."""

    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, attention: AttentionBackend, layer: int):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attention, layer)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen2Model(nn.Module):
    """Embeddings, decoder layers and the final norm (the LM head lives in `model.Qwen2VL`)."""

    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos, sin, attention: AttentionBackend,
                deepstack: "DeepStack | None" = None) -> torch.Tensor:
        """x: input embeddings (tokens, hidden); cos/sin: M-RoPE angles (tokens, head_dim)."""
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, attention, i)
            if deepstack is not None:
                x = deepstack.add(i, x)
        return self.norm(x)


class DeepStack:
    """Qwen3-VL: after decoder layer i, the visual positions get the i-th extra level of visual features (the
    outputs of earlier vision blocks, each through its own merger). levels (L, image tokens, hidden); image_mask
    (tokens,) marks the visual positions, as for the embeddings."""

    def __init__(self, levels: torch.Tensor, image_mask: torch.Tensor):
        self.levels, self.image_mask = levels, image_mask
        self.index = visual_index(image_mask)  # (tokens,) worked out once for every level

    def add(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        if layer >= self.levels.shape[0]:
            return x
        level = self.levels[layer].to(x.dtype).index_select(0, self.index)  # (tokens, hidden)
        return torch.where(self.image_mask[:, None], x + level, x)


def visual_index(image_mask: torch.Tensor) -> torch.Tensor:
    """(tokens,) -> (tokens,): the k-th True row of image_mask gets k, the index of its visual token; a False row
    gets some index, for `torch.where` to ignore. The mask's running count, so nothing is read back to the host
    (boolean indexing would have to read how many rows it selects)."""
    return (image_mask.long().cumsum(0) - 1).clamp(min=0)


def visual_rows(image_embeds: torch.Tensor, image_mask: torch.Tensor) -> torch.Tensor:
    """(image tokens, hidden) -> (tokens, hidden): each True row of image_mask gets its visual token
    (`visual_index`)."""
    return image_embeds.index_select(0, visual_index(image_mask))
