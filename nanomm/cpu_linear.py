"""Faster float32 linear layers on CPU: oneDNN with each weight reordered once into its blocked layout.

Lesson: lessons/05-continuous-batching.md (where the decode step's time goes).

On a CPU, a decode step is a handful of matrix multiplications, and the widest of them, the LM head
(hidden x ~152k vocabulary rows), dominates it. PyTorch's default CPU matmul reads the weight in its
plain row-major layout every call. oneDNN (MKL-DNN, built into PyTorch's CPU wheels) can reorder a weight
once into the blocked layout its kernels stream best, and then multiply against it directly; on the 2-core
machines nanomm is developed on that runs the LM head ~1.4-2.4x faster (BENCHMARKS.md).

The numbers are the same float32 products summed in a different order: results differ from F.linear by
rounding only (~1e-6), like any other BLAS. The engine applies this on CPU float32 only; on CUDA, cuBLAS is
already what we want.
"""

import torch
from torch import nn


def packed_linear_available(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()


class PackedLinear(nn.Module):
    """A drop-in replacement for an nn.Linear, holding its weight (and bias) in oneDNN's layout."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed_weight = linear.weight.detach().to_mkldnn()
        bias = linear.bias if linear.bias is not None else torch.zeros(linear.out_features)
        self.packed_bias = bias.detach().to_mkldnn()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)  # oneDNN's linear takes 2-D input
        out = torch.ops.aten.mkldnn_linear(flat.to_mkldnn(), self.packed_weight, self.packed_bias).to_dense()
        return out.view(*x.shape[:-1], self.out_features)


def pack_linear_layers(model: nn.Module) -> int:
    """Replace every nn.Linear in model by a PackedLinear (in place); returns how many were replaced.

    An untied layer's plain weight is released; a tied LM head keeps sharing nothing with the embedding
    (its packed copy is separate), which costs one extra copy of the embedding matrix.
    """
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, PackedLinear(child))
                replaced += 1
    return replaced
