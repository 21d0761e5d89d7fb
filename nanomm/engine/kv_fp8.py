"""An fp8 KV cache (`LLM(kv_cache_dtype="fp8")`): keys and values stored in one byte each, with a scale per
slot and KV head, dequantized as attention reads them.

Lesson: lessons/09-bytes-per-step.md, section 4.

Every cached token costs 2 x layers x kv_heads x head_dim values. float8 e4m3 keeps each in one byte: a sign,
4 exponent bits and 3 mantissa bits, so a relative step of 1/16 to 1/8 from 2^-6 to 448 (coarser below 2^-6,
down to the smallest subnormal, 2^-9).
To use that range, each (token, KV head) vector of head_dim values is divided by its own scale,
max |x| / 448, before the cast; the scale is kept beside it in bfloat16 (2 bytes per head_dim values). A slot
of a 64-wide head then takes 66 bytes against 128 in bfloat16 and 256 in float32: 1.94x and 3.9x the tokens
in the same memory. Attention reads the codes and the scales of the slots it needs and multiplies them back
into the model's dtype; the new tokens of a step are written quantized first and read back like the others,
so a token looks the same to every later query, whatever the batching.

The scale is computed from each token's own values when it is written ("dynamic" scaling), so there is
nothing to calibrate. vLLM's fp8 cache keeps one scale per layer instead (1.0 unless calibrated): slightly
fewer bytes, more rounding error for heads whose values are small.

CPU kernels for float8 are few (`index_copy_` has none), so the codes live in a uint8 tensor and are viewed
as float8 only to convert them.
"""

import torch

from nanomm.model.fp8 import FP8, SCALE_DTYPE, dequantize_fp8, quantize_fp8


class Fp8KVCache:
    """The KV pool in fp8: codes (layers, 2, slots, kv_heads, head_dim) as bytes, scales (layers, 2, slots,
    kv_heads). Same slots, same block tables as the model-dtype pool; only the storage differs."""

    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device):
        self.codes = torch.zeros(num_layers, 2, num_slots, num_kv_heads, head_dim, dtype=torch.uint8, device=device)
        self.scales = torch.zeros(num_layers, 2, num_slots, num_kv_heads, dtype=SCALE_DTYPE, device=device)
        self.dtype = dtype  # what reads return: the model's dtype

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape  # (layers, 2, slots, kv_heads, head_dim), as the model-dtype pool's

    @property
    def device(self) -> torch.device:
        return self.codes.device

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales))

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v (tokens, kv_heads, head_dim) into their slots (tokens,)."""
        for kind, x in enumerate((k, v)):
            codes, scales = quantize_fp8(x)
            self.codes[layer, kind].index_copy_(0, slots, codes.view(torch.uint8))
            self.scales[layer, kind].index_copy_(0, slots, scales)

    def read_slots(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the slots given, each (len(slots), kv_heads, head_dim) in the model's dtype."""
        keys, values = (dequantize_fp8(self.codes[layer, kind].index_select(0, slots).view(FP8),
                                       self.scales[layer, kind].index_select(0, slots), self.dtype) for kind in (0, 1))
        return keys, values

    def read_rows(self, layer: int, rows: torch.Tensor) -> torch.Tensor:
        """Rows of this layer's pool viewed as (2 * slots * kv_heads, head_dim): (len(rows), head_dim)."""
        head_dim = self.codes.shape[-1]
        codes = self.codes[layer].view(-1, head_dim).index_select(0, rows).view(FP8)
        return dequantize_fp8(codes, self.scales[layer].view(-1).index_select(0, rows), self.dtype)
