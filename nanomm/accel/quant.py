"""Weight-only quantization of the language model's linear layers: int8 per output channel, int4 per group.

Lesson: lessons/09-bytes-per-step.md.

A decode step at batch 1 reads every weight of the language model once and does two FLOPs per weight read:
it is bound by bytes, not arithmetic (lesson 08). Storing a weight in 8 or 4 bits instead of 32 cuts those
bytes 4x or 8x; the arithmetic stays in floating point ("weight-only": activations are not quantized).

- **int8, per output channel**: row r of W is `codes[r] * scale[r]`, codes in [-127, 127], scale = max |W[r]| / 127.
- **int4, per group** of `group_size` inputs: `W[r, j] = (codes[r, j] - 8) * scale[r, g] + zero[r, g]`, codes in
  [0, 15], for the group g = j // group_size; scale = (max - min) / 15 and zero = min + 8 * scale of the group
  (asymmetric: the codes span the group's own range). This is the convention of the int4 kernels torch ships.

The readable definition of a quantized layer is *dequantize, then multiply* (`linear_definition`): the codes
times their scales give a float32 weight, and the product is computed with the activations rounded to
bfloat16 and summed in float32. The bfloat16 activations are the kernels' own: torch's weight-only kernels
(`aten._weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`, `_weight_int4pack_mm` on CUDA) take bfloat16
activations (on the CPU they also take float32, but ran 8.5x and 33x slower with it: BENCHMARKS.md), so a quantized
layer computes in bfloat16 whatever the model's dtype and hands back the model's dtype. The kernels also round
their result to bfloat16; the definition keeps it in float32, so that where it runs, rows computed in
different batches differ by float32 rounding only, as in the unquantized model. Each layer checks its kernel
against the definition on a probe when it is built and falls back to the definition where the kernel is
missing or refuses the shape (the CPU int4 kernel wants out_features divisible by 16). The kernels give a row
the same bits whatever the other rows of the call (torch 2.13's CPU kernels choose no path by the row
count; tests/test_quant.py checks it on the CPU at hand). That is half of what makes a request alone in the engine
the dense reference's bit for bit; the other half is the same float32 work around the layers (model/attention.py).
The bfloat16 rounding turns any last-bit float32 difference into a visible one: lesson 09, section 6.

Quantized here: every linear layer of the language model and the LM head (at batch 1 the head is most of the
bytes of a small model). Not quantized: the embedding (a decode step reads one row of it; a tied head gets its
own quantized copy), the norms, and the vision tower (it runs once per image, not once per token).
Idea and kernels: gpt-fast's int8/int4 weight-only quantization (pytorch-labs/gpt-fast, quantize.py).
"""

import logging

import torch
from torch import nn

logger = logging.getLogger("nanomm")

QUANTIZATION_METHODS = ("int8", "int4")
COMPUTE_DTYPE = torch.bfloat16  # the activations' dtype inside a quantized layer: the kernels'
DEFAULT_GROUP_SIZE = 128


# -- the formats ---------------------------------------------------------------------------------------------


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight (out, in) -> codes int8 (out, in) in [-127, 127], scales bfloat16 (out,): one per output channel."""
    scales = (weight.float().abs().amax(dim=1) / 127).clamp(min=1e-12).to(COMPUTE_DTYPE)
    codes = (weight.float() / scales.float()[:, None]).round().clamp(-127, 127).to(torch.int8)
    return codes, scales


def dequantize_int8(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return codes.float() * scales.float()[:, None]  # (out, in) float32


def quantize_int4(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight (out, in) -> codes uint8 (out, in) in [0, 15], scales and zeros bfloat16 (out, in // group_size)."""
    out_features, in_features = weight.shape
    groups = weight.float().view(out_features, in_features // group_size, group_size)  # (out, groups, group)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)  # (out, groups)
    zeros = (low + 8 * (high - low) / 15).to(COMPUTE_DTYPE).float()  # the value of code 8, as stored
    # Codes 0..15 stand for zero - 8 scale .. zero + 7 scale: wide enough for the group around the stored zero
    # (bfloat16 moves a zero far from 0 by more than a step of a narrow group).
    scales = torch.maximum((zeros - low) / 8, (high - zeros) / 7).clamp(min=1e-12).to(COMPUTE_DTYPE)
    codes = ((groups - zeros[..., None]) / scales.float()[..., None] + 8).round().clamp(0, 15)
    return codes.to(torch.uint8).view(out_features, in_features), scales, zeros.to(COMPUTE_DTYPE)


def dequantize_int4(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    out_features, in_features = codes.shape
    num_groups = scales.shape[1]
    grouped = codes.float().view(out_features, num_groups, in_features // num_groups)  # (out, groups, group)
    weight = (grouped - 8) * scales.float()[..., None] + zeros.float()[..., None]
    return weight.view(out_features, in_features)  # float32


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """(out, in) codes in [0, 15] -> (out, in / 2) bytes: column 2j in the low four bits, 2j + 1 in the high."""
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack([packed & 15, packed >> 4], dim=-1).view(packed.shape[0], -1)  # (out, in)


def linear_definition(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """What every quantized layer computes: x (rows, in) rounded to bfloat16, times the dequantized float32 weight
    (out, in), summed in float32 -> (rows, out) float32."""
    return x.to(COMPUTE_DTYPE).float() @ weight.t()


# -- the layers ----------------------------------------------------------------------------------------------


class QuantizedLinear(nn.Module):
    """An nn.Linear whose weight is stored quantized. Subclasses say how: `kernel_matmul` runs torch's kernel,
    `dequantized_weight` gives the float32 weight for the definition."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach())
        self.uses_kernel = False

    def dequantized_weight(self) -> torch.Tensor:
        raise NotImplementedError

    def kernel_matmul(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x (rows, in) -> (rows, out): bfloat16 by the kernel, float32 by the definition. No rows, no kernel: a
        step with no token to sample gives the head none, and torch's CUDA int8 kernel launches an empty grid
        for them, an "invalid argument" that breaks the next CUDA call (seen on an H200, torch 2.11)."""
        if x.shape[0] == 0:
            return x.new_empty(0, self.out_features)
        if self.uses_kernel:
            return self.kernel_matmul(x.to(COMPUTE_DTYPE))
        return linear_definition(x, self.dequantized_weight())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).contiguous()  # (rows, in): the kernels take contiguous 2-D input
        out = self.matmul(flat).to(x.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features)

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + self(x), the call `fused_layers.residual_linear` makes."""
        return residual + self(x)

    def _apply(self, fn, recurse=True):
        """`.to()`, `.float()`, `.cuda()`: refused. The codes are laid out for one device's kernel and the scales
        must stay bfloat16, so quantize where the model will run (LLM does: after loading, on its device)."""
        raise RuntimeError(f"{type(self).__name__} cannot be moved or cast after quantization: load the model on "
                           "its device and in its dtype first, then quantize")

    def _try_kernel(self, probe_rows: int = 3) -> None:
        """Use the kernel if it runs here and agrees with the definition on a probe (bfloat16 rounding apart)."""
        g = torch.Generator().manual_seed(0)
        weight = self.dequantized_weight()
        x = torch.randn(probe_rows, self.in_features, generator=g).to(weight.device)
        expected = linear_definition(x, weight).float()
        try:
            got = self.kernel_matmul(x.to(COMPUTE_DTYPE)).float()
        except (RuntimeError, NotImplementedError):  # missing op, or a shape the kernel refuses
            return
        self.uses_kernel = torch.allclose(got, expected, rtol=2e-2, atol=2e-2 * float(expected.abs().max()))


class Int8Linear(QuantizedLinear):
    """int8 codes per output channel: `aten._weight_int8pack_mm(x, codes, scales)` computes x @ (codes * scales)^T."""

    def __init__(self, linear: nn.Linear, try_kernel: bool = True):
        super().__init__(linear)
        codes, scales = quantize_int8(linear.weight.detach())
        self.register_buffer("codes", codes)  # (out, in) int8
        self.register_buffer("scales", scales)  # (out,) bfloat16
        if try_kernel and hasattr(torch.ops.aten, "_weight_int8pack_mm"):
            self._try_kernel()

    def dequantized_weight(self) -> torch.Tensor:
        return dequantize_int8(self.codes, self.scales)

    def kernel_matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x, self.codes, self.scales)


class Int4Linear(QuantizedLinear):
    """int4 codes in groups along the input. Held in one layout: the kernel's packing (made by
    `_convert_weight_to_int4pack[_for_cpu]`) when the kernel runs here, else two codes per byte (`pack_nibbles`)."""

    CUDA_INNER_K_TILES, CPU_INNER_K_TILES = 8, 2  # the kernels' tiling of the packed weight

    def __init__(self, linear: nn.Linear, group_size: int, try_kernel: bool = True):
        super().__init__(linear)
        if self.in_features % group_size or group_size % 2:
            raise ValueError(f"int4 group size {group_size} must be even and divide the layer's input width "
                             f"{self.in_features}")
        self.group_size = group_size
        codes, scales, zeros = quantize_int4(linear.weight.detach(), group_size)
        self.register_buffer("scales", scales)  # (out, groups) bfloat16
        self.register_buffer("zeros", zeros)
        self.register_buffer("packed_codes", pack_nibbles(codes))  # (out, in / 2) uint8
        self.kernel_weight = self.scales_and_zeros = None
        if try_kernel:
            self._try_int4_kernel(codes)

    def _try_int4_kernel(self, codes: torch.Tensor) -> None:
        on_cuda = codes.device.type == "cuda"
        convert = "_convert_weight_to_int4pack" if on_cuda else "_convert_weight_to_int4pack_for_cpu"
        if not hasattr(torch.ops.aten, convert):
            return
        try:
            if on_cuda:  # CUDA's converter takes two codes per byte, the even column in the high four bits
                source, tiles = (codes[:, 0::2] << 4) | codes[:, 1::2], self.CUDA_INNER_K_TILES
            else:  # the CPU's takes one code per int32
                source, tiles = codes.to(torch.int32), self.CPU_INNER_K_TILES
            self.kernel_weight = getattr(torch.ops.aten, convert)(source.contiguous(), tiles)
        except (RuntimeError, NotImplementedError):
            return
        # (groups, out, 2): scale and zero of each group, the kernels' layout
        self.scales_and_zeros = torch.stack([self.scales, self.zeros], dim=-1).transpose(0, 1).contiguous()
        self._try_kernel()
        if self.uses_kernel:  # one copy of the weight: the kernel's (so dequantized_weight is gone)
            self.packed_codes = self.scales = self.zeros = None
        else:
            self.kernel_weight = self.scales_and_zeros = None

    def dequantized_weight(self) -> torch.Tensor:
        return dequantize_int4(unpack_nibbles(self.packed_codes), self.scales, self.zeros)

    def kernel_matmul(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cuda":
            return torch.ops.aten._weight_int4pack_mm(x, self.kernel_weight, self.group_size, self.scales_and_zeros)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.kernel_weight, self.group_size,
                                                          self.scales_and_zeros)


# -- the model -----------------------------------------------------------------------------------------------


def quantized_linear(linear: nn.Linear, method: str, group_size: int = DEFAULT_GROUP_SIZE,
                     try_kernel: bool = True) -> QuantizedLinear:
    if method == "int8":
        return Int8Linear(linear, try_kernel)
    if method == "int4":
        return Int4Linear(linear, group_size, try_kernel)
    raise ValueError(f"quantization must be None or one of {QUANTIZATION_METHODS}, got {method!r}")


def quantized_layers(model: nn.Module) -> list[nn.Linear]:
    """The layers of a `Qwen2VL` that quantization replaces: every linear layer of the language model, then the
    LM head (the vision tower and the embedding stay)."""
    return [m for m in model.language_model.modules() if isinstance(m, nn.Linear)] + [model.lm_head]


def quantized_weight_bytes(out_features: int, in_features: int, method: str,
                           group_size: int = DEFAULT_GROUP_SIZE) -> float:
    """Bytes a quantized layer keeps for its weight (not its bias): int8, a byte per weight and a bfloat16 scale
    per row; int4, half a byte per weight and a bfloat16 scale and zero per group."""
    if method == "int8":
        return out_features * in_features + 2 * out_features
    return out_features * in_features / 2 + 2 * 2 * out_features * in_features / group_size


def quantize_language_model(model: nn.Module, method: str, group_size: int = DEFAULT_GROUP_SIZE,
                            try_kernel: bool = True) -> int:
    """Replace `quantized_layers(model)` by quantized ones, in place; returns how many were replaced.
    try_kernel=False keeps every layer on the definition."""
    replacing = {id(layer) for layer in quantized_layers(model)}
    layers = []
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if id(child) in replacing:  # a tied head: its own quantized copy, the embedding stays
                layers.append(quantized_linear(child, method, group_size, try_kernel))
                setattr(parent, name, layers[-1])
    slow = [f"{layer.out_features}x{layer.in_features}" for layer in layers if not layer.uses_kernel]
    if slow and try_kernel:
        logger.warning("%s: %d of %d layers have no kernel on %s and run dequantize-then-multiply (slower): %s",
                       method, len(slow), len(layers), model.device, ", ".join(sorted(set(slow))))
    return len(layers)


def weight_bytes(module: nn.Module) -> int:
    """Bytes of the parameters and buffers a forward pass of `module` reads (each tensor once)."""
    tensors = {id(t): t for t in list(module.parameters()) + list(module.buffers())}
    for layer in module.modules():  # the kernel layouts are plain attributes of the int4 layers
        for t in (getattr(layer, "kernel_weight", None), getattr(layer, "scales_and_zeros", None)):
            if t is not None:
                tensors[id(t)] = t
    return sum(t.numel() * t.element_size() for t in tensors.values())
