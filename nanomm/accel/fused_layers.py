"""The language model's layers in fewer, larger kernels: the form the engine serves, tested equal to model/qwen2.py.

Lesson: lessons/A3-cpu-kernels.md (where a step's time goes).

A decode step is launch-bound on a GPU and pays a fixed cost per operation on a CPU, so every kernel a layer
saves is time saved at every step. `fuse_language_model` swaps these in for the textbook layers after loading,
the way `quantize_language_model` swaps in quantized ones; `LLM(..., fused_layers=False)` serves the textbook
model as it is. What changes, and only in the rounding of some sums:

- q/k/v are one matrix (`qkv_proj`) and gate/up are one (`gate_up_proj`): one matmul instead of three or two,
  the checkpoint's matrices stacked by rows;
- q and k rotate in one pass of three kernels (`apply_rotary_rolled`), with the sign flip of rotate_half paid
  once per forward (`roll_layout_sin`), not once per layer;
- RMSNorm is one kernel on a GPU (`F.rms_norm`, float32 statistics inside it: no dtype copies around it in bf16)
  and four on a CPU: mean(x^2) + eps as one batched dot product (`FastRMSNorm`);
- the residual adds ride on the o_proj and down_proj matmuls (`residual_linear`: addmm, or the packed and
  quantized layers' own `forward_add`);
- a long prefill chunk's MLP goes through in passes whose (rows, 2 x intermediate) output stays under
  MLP_PASS_BYTES. On a CPU a fresh multi-megabyte tensor costs a page fault per 4 KiB on first touch, and
  glibc's malloc maps an allocation above 32 MiB afresh every time (and unmaps it on free), while it reuses
  freed smaller blocks: 1,365 rows for the `small` preset (intermediate 1,536), 234 for Qwen2-VL-2B's shape
  (8,960), in float32.
"""

import torch
import torch.nn.functional as F
from torch import nn

from nanomm.model.attention import AttentionBackend
from nanomm.model.qwen2 import MLP, Attention, DecoderLayer, DeepStack, Qwen2Model, RMSNorm

MLP_PASS_BYTES = 16 * 2**20  # read at every call: the benchmark scripts may set it for their process


def roll_layout_sin(sin: torch.Tensor) -> torch.Tensor:
    """sin (tokens, head_dim) with its first half negated, for `apply_rotary_rolled`."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def apply_rotary_rolled(x: torch.Tensor, cos: torch.Tensor, sin_rolled: torch.Tensor) -> torch.Tensor:
    """`rope.apply_rotary` in three kernels: rotate_half(x) * sin == roll(x, half) * sin_rolled, whose sign flip
    was paid once (`roll_layout_sin`); x * cos + that in one addcmul. x (tokens, heads, head_dim)."""
    cos, sin_rolled = cos.unsqueeze(-2), sin_rolled.unsqueeze(-2)  # (tokens, 1, head_dim): broadcast over heads
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin_rolled)


def residual_linear(residual: torch.Tensor, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """residual + layer(x) for a bias-free linear layer, the add done by the matmul itself."""
    if hasattr(layer, "forward_add"):  # packed_linear.PackedLinear (oneDNN add post-op), quant.QuantizedLinear
        return layer.forward_add(x, residual)
    return torch.addmm(residual, x, layer.weight.t())  # residual + x @ W^T (beta = 1)


def stacked_linear(*parts: nn.Linear) -> nn.Linear:
    """One nn.Linear whose output rows are the parts', in order (their weights and biases stacked)."""
    weight = torch.cat([p.weight.detach() for p in parts])
    has_bias = parts[0].bias is not None
    out = nn.Linear(weight.shape[1], weight.shape[0], bias=has_bias, device="meta")  # shapes only: no init
    out.weight = nn.Parameter(weight, requires_grad=False)
    if has_bias:
        out.bias = nn.Parameter(torch.cat([p.bias.detach() for p in parts]), requires_grad=False)
    return out


ONE_KERNEL_NORM_DEVICES = ("cuda", "mps", "xpu")  # where aten._fused_rms_norm has a kernel of its own


class FastRMSNorm(nn.Module):
    """`qwen2.RMSNorm` in one kernel where torch has a fused RMSNorm (`F.rms_norm`, one kernel from torch 2.8 on:
    statistics in float32 inside the kernel, no dtype copies around it, the output rounded once), in four on a
    CPU, where `F.rms_norm` is the textbook's eight operations."""

    def __init__(self, norm: RMSNorm, one_kernel: bool = False):
        super().__init__()
        self.weight, self.eps, self.one_kernel = norm.weight, norm.eps, one_kernel
        self.register_buffer("eps_tensor", torch.full((1, 1, 1), norm.eps, device=norm.weight.device),
                             persistent=False)  # the addend below

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.one_kernel:  # any shape: over the last dimension (also Qwen3's per-head q and k norms)
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        xf = x.float()  # statistics in float32 even for bf16 activations
        # mean(x^2) + eps as one batched dot product per token: (tokens, 1, hidden) @ (tokens, hidden, 1)
        variance = torch.baddbmm(self.eps_tensor.float(), xf[:, None, :], xf[:, :, None],
                                 alpha=1 / x.shape[-1])  # (tokens, 1, 1)
        return self.weight * (xf * variance.view(-1, 1).rsqrt()).to(x.dtype)


class FusedAttention(nn.Module):
    """`qwen2.Attention` with q/k/v in one matmul, q and k rotated in one pass, the residual added by o_proj."""

    def __init__(self, attn: Attention, one_kernel_norms: bool = False):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.qkv_proj = stacked_linear(attn.q_proj, attn.k_proj, attn.v_proj)  # rows: q heads, then k, then v
        self.o_proj = attn.o_proj
        self.q_norm, self.k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)  # Qwen3 only
        if self.q_norm is not None and one_kernel_norms:  # the CPU form is for (tokens, hidden) rows only
            self.q_norm, self.k_norm = FastRMSNorm(self.q_norm, True), FastRMSNorm(self.k_norm, True)

    def forward(self, x, cos, sin_rolled, attention: AttentionBackend, layer: int, residual) -> torch.Tensor:
        """residual + attention output (tokens, hidden)."""
        n, heads, kv_heads = x.shape[0], self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x).view(n, heads + 2 * kv_heads, self.head_dim)  # q heads, then k, then v
        qk = qkv[:, :heads + kv_heads]
        if self.q_norm is not None:  # Qwen3: each head of q and of k normalised before the rotation
            qk = torch.cat([self.q_norm(qk[:, :heads]), self.k_norm(qk[:, heads:])], dim=1)
        qk = apply_rotary_rolled(qk, cos, sin_rolled)  # q and k rotated in one pass
        q, k, v = qk[:, :heads], qk[:, heads:], qkv[:, heads + kv_heads:]
        out = attention.attend(layer, q, k, v)  # (n, heads, head_dim)
        return residual_linear(residual, self.o_proj, out.reshape(n, -1))


class FusedMLP(nn.Module):
    """`qwen2.MLP` with gate/up in one matmul, the residual added by down_proj, and long chunks in passes."""

    def __init__(self, mlp: MLP):
        super().__init__()
        self.intermediate_size = mlp.gate_proj.out_features
        self.gate_up_proj = stacked_linear(mlp.gate_proj, mlp.up_proj)  # gate rows, then up
        self.down_proj = mlp.down_proj

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


class FusedDecoderLayer(nn.Module):
    def __init__(self, layer: DecoderLayer, one_kernel_norms: bool = False):
        super().__init__()
        self.input_layernorm = FastRMSNorm(layer.input_layernorm, one_kernel_norms)
        self.self_attn = FusedAttention(layer.self_attn, one_kernel_norms)
        self.post_attention_layernorm = FastRMSNorm(layer.post_attention_layernorm, one_kernel_norms)
        self.mlp = FusedMLP(layer.mlp)

    def forward(self, x, cos, sin_rolled, attention: AttentionBackend, layer: int):
        x = self.self_attn(self.input_layernorm(x), cos, sin_rolled, attention, layer, residual=x)
        return self.mlp(self.post_attention_layernorm(x), residual=x)


class FusedQwen2Model(nn.Module):
    """`qwen2.Qwen2Model` over fused layers: the same embeddings and weights, the rotary's sign flip once.

    It consumes the plain model: each plain layer is dropped as soon as its fused form exists, so that memory
    peaks at one layer's extra copy, not the whole model's."""

    def __init__(self, model: Qwen2Model, one_kernel_norms: bool = False):
        super().__init__()
        self.embed_tokens = model.embed_tokens  # the same module: a tied LM head stays tied
        self.layers = nn.ModuleList()
        for i in range(len(model.layers)):
            self.layers.append(FusedDecoderLayer(model.layers[i], one_kernel_norms))
            model.layers[i] = nn.Identity()
        self.norm = FastRMSNorm(model.norm, one_kernel_norms)

    def forward(self, x: torch.Tensor, cos, sin, attention: AttentionBackend,
                deepstack: DeepStack | None = None) -> torch.Tensor:
        sin_rolled = roll_layout_sin(sin)  # once per forward, for every layer's rotary
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin_rolled, attention, i)
            if deepstack is not None:
                x = deepstack.add(i, x)
        return self.norm(x)


def fuse_language_model(model: nn.Module) -> None:
    """Replace model.language_model (a `qwen2.Qwen2Model`) by its fused form, in place: its norms one kernel
    each on the devices that have one."""
    one_kernel_norms = model.device.type in ONE_KERNEL_NORM_DEVICES
    model.language_model = FusedQwen2Model(model.language_model, one_kernel_norms)
