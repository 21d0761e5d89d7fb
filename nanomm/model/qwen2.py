"""The Qwen2 language model inside Qwen2-VL: RMSNorm, GQA attention with q/k/v bias and M-RoPE, SwiGLU.

Lesson: lessons/03-mrope.md.

Tokens are flat: a forward pass takes (num_tokens, hidden) with no batch dimension, the layout a serving
engine packs many sequences into. Who sees whom is not decided here: each attention layer hands its rotated
q, k, v to an *attention backend* (`attention.attend(layer, q, k, v)`), which stores k/v in its cache and returns the
attention output. The dense reference (`reference.py`) plugs in a contiguous single-sequence cache.

Written for few kernels per layer (lessons/05-continuous-batching.md, section 6): a decode step is launch-bound
on a GPU and pays a fixed cost per operation on a CPU, so the HF checkpoint's q/k/v projections are one matrix
here (`qkv_proj`), gate/up are one (`gate_up_proj`), both fused at load (`model/loader.py`); q and k rotate in
one pass; RMSNorm is four kernels; the residual adds ride on the o_proj and down_proj matmuls. The arithmetic
is the checkpoint's; only the rounding of some sums differs from an unfused implementation.
"""

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from nanomm.model.config import TextConfig
from nanomm.model.rope import apply_rotary_rolled, roll_layout_sin


class AttentionBackend(Protocol):
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q (tokens, heads, head_dim), k/v (tokens, kv_heads, head_dim) -> (tokens, heads, head_dim)."""


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight, over the hidden size of (tokens, hidden) activations."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.register_buffer("eps_tensor", torch.full((1, 1, 1), eps), persistent=False)  # the addend below
        self.eps = eps

    @property
    def eps(self) -> float:
        return self._eps

    @eps.setter
    def eps(self, value: float) -> None:  # one value: the float and the tensor that forward reads
        self._eps = value
        self.eps_tensor.fill_(value)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()  # statistics in float32 even for bf16 activations
        # mean(x^2) + eps as one batched dot product per token: (tokens, 1, hidden) @ (tokens, hidden, 1)
        variance = torch.baddbmm(self.eps_tensor.float(), xf[:, None, :], xf[:, :, None],
                                 alpha=1 / x.shape[-1])  # (tokens, 1, 1)
        return self.weight * (xf * variance.view(-1, 1).rsqrt()).to(x.dtype)


def residual_linear(residual: torch.Tensor, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """residual + layer(x) for a bias-free linear layer, the add done by the matmul itself."""
    if hasattr(layer, "forward_add"):  # fast_linear.PackedLinear (oneDNN add post-op), quant.QuantizedLinear
        return layer.forward_add(x, residual)
    return torch.addmm(residual, x, layer.weight.t())  # residual + x @ W^T (beta = 1)


class Attention(nn.Module):
    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, (self.num_heads + 2 * self.num_kv_heads) * self.head_dim)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x, cos, sin_rolled, attention: AttentionBackend, layer: int, residual) -> torch.Tensor:
        """residual + attention output (tokens, hidden)."""
        n, heads, kv_heads = x.shape[0], self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x).view(n, heads + 2 * kv_heads, self.head_dim)  # q heads, then k, then v
        qk = apply_rotary_rolled(qkv[:, :heads + kv_heads], cos, sin_rolled)  # q and k rotated in one pass
        q, k, v = qk[:, :heads], qk[:, heads:], qkv[:, heads + kv_heads:]
        out = attention.attend(layer, q, k, v)  # (n, heads, head_dim)
        return residual_linear(residual, self.o_proj, out.reshape(n, -1))


# On a CPU a fresh multi-megabyte tensor costs a page fault per 4 KiB on first touch, and glibc's malloc maps an
# allocation above 32 MiB afresh every time (and unmaps it on free), while it reuses freed smaller blocks. So a
# long prefill chunk's MLP goes through in passes whose (rows, 2 x intermediate) output stays under
# MLP_PASS_BYTES: 1,365 rows for the `small` preset (intermediate 1,536), 234 for Qwen2-VL-2B's shape (8,960),
# in float32. Lesson 05, section 6, "Temporaries under 32 MiB".
MLP_PASS_BYTES = 16 * 2**20


class MLP(nn.Module):
    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.intermediate_size = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)  # gate rows, then up
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def rows_per_pass(self, element_size: int) -> int:
        """How many rows' gate/up output fits in MLP_PASS_BYTES (at least 64, so that a pass is still a matmul)."""
        return max(64, MLP_PASS_BYTES // (2 * self.intermediate_size * element_size))

    def forward(self, x, residual):
        """residual + down(silu(gate(x)) * up(x)). A long prefill chunk goes through in passes of
        `rows_per_pass` rows, so that its temporaries stay small (rows do not interact: only rounding can differ)."""
        rows_per_pass = self.rows_per_pass(x.element_size())
        if x.shape[0] > rows_per_pass:
            passes = zip(x.split(rows_per_pass), residual.split(rows_per_pass))
            return torch.cat([self.forward(rows, rows_residual) for rows, rows_residual in passes])
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return residual_linear(residual, self.down_proj, F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin_rolled, attention: AttentionBackend, layer: int):
        x = self.self_attn(self.input_layernorm(x), cos, sin_rolled, attention, layer, residual=x)
        return self.mlp(self.post_attention_layernorm(x), residual=x)


class Qwen2Model(nn.Module):
    """Embeddings, decoder layers and the final norm (the LM head lives in `model.Qwen2VL`)."""

    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos, sin, attention: AttentionBackend) -> torch.Tensor:
        """x: input embeddings (tokens, hidden); cos/sin: M-RoPE angles (tokens, head_dim)."""
        sin_rolled = roll_layout_sin(sin)  # once per forward, for every layer's rotary
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin_rolled, attention, i)
        return self.norm(x)
