"""Every speed-up of the served model, behind one seam: the model in model/ stays the textbook architecture, and
`speed_up` swaps faster modules in for its layers after loading; nothing in model/ branches on them.

Lesson: lessons/A3-cpu-kernels.md (where a step's time goes, and what each piece buys).

Each piece can be switched off (the switch is named with it), and each is tested equal to the plain path
(tests/test_accel.py): the same tokens, logits within rounding. Quantization is the exception: it changes the
weights, and is tested against its own definition instead.

- fused_layers.py: q/k/v and gate/up in one matmul each, RMSNorm in one kernel on a GPU and four on a CPU, the
  rotary in three, residual adds inside the matmuls, long chunks' MLP in passes (`LLM(fused_layers=False)` turns
  it off);
- packed_linear.py: CPU float32 linear layers through oneDNN with pre-reordered weights (`cpu_fast_linear=False`);
- quant.py: int8 / int4 weight-only linear layers (`quantization="int8"`), their torch kernels checked against the
  dequantize-then-multiply definition (tests/test_quant.py; lesson 09): the one piece that changes the numbers,
  so a quantized model is its own dense reference;
- compile.py: each decoder layer through torch.compile (`compile=True`; off by default).

`speed_up` swaps those four into the model. The engine calls one more, which stands on the model alone too:
- batched_attention.py: a step's decodes in one fused attention call per layer, its prompt chunks in another
  (`ModelRunner(batched_attention=False)` attends each sequence alone, the definition; tests/test_attention.py).

This folder sits below the engine and imports none of it: the fast paths that run engine steps, CUDA graphs and
the GPU memory profile, are the engine's own (engine/cuda_graphs.py, engine/memory_profile.py).
"""

from torch import nn

from nanomm.accel.fused_layers import fuse_language_model
from nanomm.accel.packed_linear import pack_linear_layers, packed_linear_available


def speed_up(model: nn.Module, *, fused_layers: bool = True, quantization: str | None = None,
             quantization_group_size: int = 128, cpu_fast_linear: bool = True, compile: bool = False) -> None:
    """Swap the fast forms into a loaded model, in place, in the order they compose: fuse the layers, quantize
    what is left in float (accel/quant.py: the fused matrices are quantized whole), then pack the float layers
    (CPU float32) or compile (Inductor picks its own matmuls, so the two never stack)."""
    if fused_layers:
        fuse_language_model(model)
    if quantization is not None:  # quant.py and compile.py are imported only when switched on
        from nanomm.accel.quant import quantize_language_model

        quantize_language_model(model, quantization, quantization_group_size)
    if cpu_fast_linear and not compile and packed_linear_available(model.device, model.dtype):
        pack_linear_layers(model)
    if compile:
        from nanomm.accel.compile import compile_decoder_layers

        compile_decoder_layers(model)
