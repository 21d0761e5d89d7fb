"""Faster float32 linear layers on CPU: oneDNN with each weight reordered once into its blocked layout.

Lesson: lessons/05-continuous-batching.md (where the decode step's time goes).

On a CPU, a decode step is a handful of matrix multiplications, and the widest of them, the LM head
(hidden x ~152k vocabulary rows), dominates it. PyTorch's default CPU matmul reads the weight in its plain
row-major layout on every call. oneDNN (MKL-DNN, built into PyTorch's CPU wheels) can reorder a weight once
into the blocked layout its kernels stream best, then multiply dense activations against it directly. This
is the op PyTorch's own compiler emits for frozen linear layers on CPU (`torch.ops.mkldnn._linear_pointwise`);
nanomm calls it directly. On the 2-core development machine it runs the LM head ~3x faster than F.linear
(numbers in BENCHMARKS.md).

The results are the same float32 products summed in another order: they differ from F.linear by rounding
only (~1e-6), as any two BLAS libraries do; the oracle tests hold the packed model to transformers. The
engine uses this on CPU in float32 only, and only after checking the op exists and agrees with F.linear on
this machine; on CUDA, cuBLAS is already what we want.
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


def pack_linear_layers(model: nn.Module) -> int:
    """Replace every nn.Linear in model by a PackedLinear (in place); returns how many were replaced.

    An untied layer's plain weight is released. A tied LM head gets its own packed copy of the embedding
    matrix (the embedding lookup still needs the plain one): one extra copy of that matrix in memory.
    """
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, PackedLinear(child))
                replaced += 1
    return replaced
