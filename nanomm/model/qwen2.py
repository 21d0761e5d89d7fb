"""The Qwen2 language model inside Qwen2-VL: RMSNorm, GQA attention with q/k/v bias and M-RoPE, SwiGLU.

Lesson: lessons/03-mrope.md.

Tokens are flat: a forward pass takes (num_tokens, hidden) with no batch dimension, the layout a serving
engine packs many sequences into. Who sees whom is not decided here: each attention layer hands its rotated
q, k, v to an *attention backend* (`attention.attend(layer, q, k, v)`), which stores k/v in its cache and returns the
attention output. The dense reference (`reference.py`) plugs in a contiguous single-sequence cache.
"""

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from nanomm.model.config import TextConfig
from nanomm.model.rope import apply_rotary


class AttentionBackend(Protocol):
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q (tokens, heads, head_dim), k/v (tokens, kv_heads, head_dim) -> (tokens, heads, head_dim)."""


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()  # statistics in float32 even for bf16 activations
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x, cos, sin, attention: AttentionBackend, layer: int) -> torch.Tensor:
        n = x.shape[0]
        q = self.q_proj(x).view(n, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(n, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(n, self.num_kv_heads, self.head_dim)
        out = attention.attend(layer, apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v)
        return self.o_proj(out.reshape(n, -1))  # (n, heads, head_dim) -> (n, heads*head_dim)


class MLP(nn.Module):
    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
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

    def forward(self, x: torch.Tensor, cos, sin, attention: AttentionBackend) -> torch.Tensor:
        """x: input embeddings (tokens, hidden); cos/sin: M-RoPE angles (tokens, head_dim)."""
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, attention, i)
        return self.norm(x)
