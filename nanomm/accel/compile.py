"""THE COMPILED PATH, optional: `LLM(compile=True)` runs each decoder layer through `torch.compile`.

Lesson: lessons/A3-cpu-kernels.md (where the decode step's time goes).

In eager mode every operation of a layer is its own kernel, with its own trip through PyTorch's dispatcher and
its own pass over memory. Inductor, torch.compile's backend, traces the layer once and fuses the elementwise
work between the matmuls (RMSNorm, the rotary, SiLU times up) into a few generated kernels (C++ on a CPU, Triton
on a GPU). The paged-attention call stays eager: `PagedAttention.attend` is excluded from tracing (a graph
break), because its metadata changes every step. `dynamic=True` lets one compiled graph serve every token
count, so a new batch size does not recompile.

The first steps pay for compiling (tens of seconds on a small CPU). The tokens are the eager model's up to
rounding: fused kernels sum in another order. The engine is held to the same dense-reference test with and
without it (tests/test_compile.py).
"""

import torch
from torch import nn


def compile_decoder_layers(model: nn.Module) -> int:
    """Wrap every decoder layer's forward in torch.compile (in place); returns how many were wrapped."""
    layers = model.language_model.layers
    for layer in layers:
        layer.forward = torch.compile(layer.forward, dynamic=True)
    return len(layers)
