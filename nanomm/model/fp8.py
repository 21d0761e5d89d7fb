"""float8 e4m3 codes with a scale per vector: the numerics of the fp8 KV cache (`LLM(kv_cache_dtype="fp8")`).

Lesson: lessons/09-bytes-per-step.md, section 4. The cache that stores them is engine/kv_fp8.py; the dense
reference (reference.py) rounds its keys and values through `fp8_round_trip`, so both see the same numbers.
"""

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3 value
SCALE_DTYPE = torch.bfloat16
TINY_SCALE = 1e-30  # an all-zero vector still gets a nonzero scale


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., head_dim) -> codes float8 (..., head_dim), scales bfloat16 (...): x ~= codes * scale."""
    x = x.float()
    scales = (x.abs().amax(dim=-1) / FP8_MAX).clamp(min=TINY_SCALE).to(SCALE_DTYPE)
    codes = (x / scales.float()[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)  # rounds to nearest
    return codes, scales


def dequantize_fp8(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return codes.float().mul_(scales.float()[..., None]).to(dtype)  # in place: one float32 copy, not two


def fp8_round_trip(x: torch.Tensor) -> torch.Tensor:
    """What attention sees of x after it went through the fp8 cache (the dense reference uses this)."""
    return dequantize_fp8(*quantize_fp8(x), x.dtype)
