"""THE CPU FAST PATH, not part of the model: float32 linear layers through oneDNN, each weight reordered once.

Lesson: lessons/A3-cpu-kernels.md (where the decode step's time goes). The model code the
lessons read is `nn.Linear` (`F.linear`); `LLM` swaps these in after loading, on CPU float32 only and for layers
at least `MIN_PACKED_SIDE` wide (smaller ones are faster as they are), and `LLM(..., cpu_fast_linear=False)`
leaves every plain layer in place.

On a CPU, a decode step is a handful of matrix multiplications, and the widest of them, the LM head
(hidden x ~152k vocabulary rows), dominates it. PyTorch's default CPU matmul reads the weight in its plain
row-major layout on every call. oneDNN (built into PyTorch's CPU wheels) can reorder a weight once into the
blocked layout its kernels stream best, then multiply dense activations against it directly. This is the op
PyTorch's own compiler emits for frozen linear layers on CPU (`torch.ops.mkldnn._linear_pointwise`); nanomm
calls it directly.

What it buys depends on the CPU (BENCHMARKS.md, "The CPU fast path"): on the 2-core AMD EPYC VM a 2048^3
matmul ran at 489 against 216 GFLOP/s for `torch.mm` and decode throughput went from 374 to 908 tokens/s; on
the 2-core Intel Xeon VM (AVX-512, AMX) the 2048^3 matmul is roughly even (1.08x), the batch-32 LM head is
1.76x faster, and decode throughput gains ~18%.

The results are the same float32 products summed in another order: they differ from F.linear by rounding
only (~1e-6), as any two BLAS libraries do; the oracle tests hold the packed model to transformers. The
engine uses this only after checking that the op exists and agrees with F.linear on this machine; on CUDA,
cuBLAS is already what we want.
"""

import torch
from torch import nn


def _mkldnn_ops_present() -> bool:
    ops = torch.ops.mkldnn
    return torch.backends.mkldnn.is_available() and hasattr(ops, "_reorder_linear_weight") \
        and hasattr(ops, "_linear_pointwise")


def packed_linear_available(device: torch.device, dtype: torch.dtype) -> bool:
    """CPU float32, the oneDNN ops present, and a packed layer that agrees with F.linear on a small check."""
    if device.type != "cpu" or dtype != torch.float32 or not _mkldnn_ops_present():
        return False
    g = torch.Generator().manual_seed(0)
    probe = nn.Linear(64, 48)
    x = torch.randn(5, 64, generator=g)
    try:
        return torch.allclose(PackedLinear(probe)(x), probe(x), rtol=1e-4, atol=1e-5)
    except RuntimeError:  # an op that exists but refuses: stay on the plain path
        return False


class PackedLinear(nn.Module):
    """A drop-in replacement for an nn.Linear, holding its weight in oneDNN's blocked layout."""

    def __init__(self, linear: nn.Linear, batch_size_hint: int = 32):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # The reorder picks a blocking for ~batch_size_hint rows; any number of rows works.
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), batch_size_hint)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)  # (rows, in): the op takes 2-D input
        out = torch.ops.mkldnn._linear_pointwise(flat, self.packed_weight, self.bias, "none", [], "")
        return out.view(*x.shape[:-1], self.out_features)

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + self(x) in one kernel: oneDNN adds the residual as the matmul writes its output (the same
        float32 sum as a separate add). x (rows, in), residual (rows, out)."""
        return torch.ops.mkldnn._linear_pointwise.binary(x, residual, self.packed_weight, self.bias, "add")


# A layer is packed only if both its sides are at least this wide. oneDNN's call costs more than MKL's (on the
# 2-core Xeon, 10-15 microseconds more a call), which a small layer's matmul never earns back: layers with a
# 256-wide side (the demo model's) ran 1.7-2.5x slower packed at 1 and 5 rows and about even at 32, while layers
# 512 wide and wider ran 1.3-1.7x faster packed at 32 rows. BENCHMARKS.md, "Small layers stay on F.linear";
# `python scripts/bench_linear.py --layer-sweep`.
MIN_PACKED_SIDE = 512


def pack_linear_layers(model: nn.Module, min_side: int | None = None) -> int:
    """Replace every nn.Linear of model whose in and out features are both at least min_side (default
    MIN_PACKED_SIDE) by a PackedLinear, in place; returns how many were replaced.

    An untied layer's plain weight is released. A tied LM head gets its own packed copy of the embedding
    matrix (the embedding lookup still needs the plain one): one extra copy of that matrix in memory.
    """
    min_side = MIN_PACKED_SIDE if min_side is None else min_side
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and min(child.in_features, child.out_features) >= min_side:
                setattr(parent, name, PackedLinear(child))
                replaced += 1
    return replaced
