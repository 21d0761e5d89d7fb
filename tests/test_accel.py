"""The seam (nanomm/accel/): the model in model/ is the textbook architecture, and every speed-up swapped into it
after loading computes what it computes, with the seam on and off."""

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from PIL import Image, ImageDraw
from safetensors.torch import load_file

from helpers import chat_prompt, llm_with_norms
from nanomm import LLM, SamplingParams, demo_checkpoint
from nanomm.accel import fused_layers, packed_linear
from nanomm.accel.fused_layers import (FastRMSNorm, FusedAttention, FusedMLP, FusedQwen2Model, apply_rotary_rolled,
                                       roll_layout_sin)
from nanomm.model import qwen2
from nanomm.model.attention import causal_attention
from nanomm.model.config import TextConfig
from nanomm.model.loader import canonical_name, load_model
from nanomm.model.rope import apply_rotary
from nanomm.reference import generate as reference_generate

CONFIG = TextConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                    num_hidden_layers=1)


class WholeSequence:
    """An attention backend over one sequence given whole: causal attention, no cache."""

    def attend(self, layer, q, k, v):
        return causal_attention(q, k, v)


def random_(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return module.requires_grad_(False)


def test_the_textbook_model_holds_the_checkpoint_s_layers(ckpt):
    """load_model gives model/qwen2.py's layers with the checkpoint's own matrices: nothing fused, nothing packed."""
    model = load_model(ckpt)
    on_disk = {}
    for file in Path(ckpt).glob("*.safetensors"):
        on_disk.update({canonical_name(k): v for k, v in load_file(file).items()})
    layer = model.language_model.layers[0]
    assert type(model.language_model) is qwen2.Qwen2Model and type(layer.input_layernorm) is qwen2.RMSNorm
    for name in ("self_attn.q_proj.weight", "self_attn.k_proj.bias", "self_attn.v_proj.weight", "mlp.gate_proj.weight",
                 "mlp.up_proj.weight"):
        assert torch.equal(layer.get_parameter(name), on_disk[f"language_model.layers.0.{name}"]), name


def test_q_k_v_and_gate_up_are_stacked_by_rows_in_the_checkpoint_s_order(ckpt):
    """The fused matrices are the checkpoint's, row blocks in order: q, k, v and gate, up."""
    model = load_model(ckpt)
    t, plain = model.config.text, model.language_model.layers[0]
    q, k, v = (plain.self_attn.get_submodule(f"{n}_proj") for n in "qkv")
    gate, up = plain.mlp.gate_proj.weight, plain.mlp.up_proj.weight
    fused = FusedQwen2Model(model.language_model).layers[0]
    q_rows, kv_rows = t.num_attention_heads * t.head_dim, t.num_key_value_heads * t.head_dim
    qkv = fused.self_attn.qkv_proj
    assert torch.equal(qkv.weight[:q_rows], q.weight) and torch.equal(qkv.weight[q_rows:q_rows + kv_rows], k.weight)
    assert torch.equal(qkv.bias[q_rows + kv_rows:], v.bias)
    gate_up = fused.mlp.gate_up_proj.weight
    assert torch.equal(gate_up[:t.intermediate_size], gate) and torch.equal(gate_up[t.intermediate_size:], up)


def test_each_fused_piece_computes_its_textbook_piece():
    torch.manual_seed(0)
    x, residual = torch.randn(7, 64), torch.randn(7, 64)
    norm = random_(qwen2.RMSNorm(64, 1e-6), 1)
    torch.testing.assert_close(FastRMSNorm(norm)(x), norm(x), rtol=1e-6, atol=1e-6)

    angles = torch.randn(7, 8)
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()  # (tokens, head_dim)
    heads = torch.randn(7, 4, 16)
    torch.testing.assert_close(apply_rotary_rolled(heads, cos, roll_layout_sin(sin)), apply_rotary(heads, cos, sin))

    attn = random_(qwen2.Attention(CONFIG), 2)
    expected = residual + attn(x, cos, sin, WholeSequence(), 0)
    fused = FusedAttention(attn)(x, cos, roll_layout_sin(sin), WholeSequence(), 0, residual=residual)
    torch.testing.assert_close(fused, expected, rtol=1e-5, atol=1e-5)

    mlp = random_(qwen2.MLP(CONFIG), 3)
    torch.testing.assert_close(FusedMLP(mlp)(x, residual), residual + mlp(x), rtol=1e-5, atol=1e-5)


def test_the_gpu_s_one_kernel_norms_compute_the_textbook_norms():
    """`F.rms_norm` (one kernel on a GPU) for every norm of a layer, Qwen3's per-head q and k norms too: the
    textbook's values in float32, and in bf16 within one rounding of the output (the kernel rounds once where
    the textbook rounds before the weight and after it)."""
    torch.manual_seed(0)
    norm = random_(qwen2.RMSNorm(64, 1e-6), 1)
    x = torch.randn(7, 64)
    torch.testing.assert_close(FastRMSNorm(norm, one_kernel=True)(x), norm(x), rtol=1e-6, atol=1e-6)
    bf16 = random_(qwen2.RMSNorm(64, 1e-6), 1).to(torch.bfloat16)
    got, want = FastRMSNorm(bf16, one_kernel=True)(x.bfloat16()), bf16(x.bfloat16())
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=1e-3)

    attn = random_(qwen2.Attention(replace(CONFIG, qk_norm=True, attention_bias=False)), 2)
    angles = torch.randn(7, 8)
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    fused = FusedAttention(attn, one_kernel_norms=True)
    assert isinstance(fused.q_norm, FastRMSNorm) and fused.q_norm.one_kernel
    torch.testing.assert_close(fused(x, cos, roll_layout_sin(sin), WholeSequence(), 0, residual=x),
                               x + attn(x, cos, sin, WholeSequence(), 0), rtol=1e-5, atol=1e-5)


def test_a_long_chunk_s_mlp_in_passes_equals_one_pass(monkeypatch):
    """FusedMLP runs a chunk whose gate/up output is over MLP_PASS_BYTES in passes (small temporaries): the
    same rows out."""
    torch.manual_seed(0)
    mlp = FusedMLP(random_(qwen2.MLP(TextConfig(hidden_size=32, intermediate_size=48)), 4))
    x, residual = torch.randn(1100, 32), torch.randn(1100, 32)
    calls = []
    mlp.gate_up_proj.register_forward_hook(lambda module, args, out: calls.append(args[0].shape[0]))
    with torch.no_grad():
        one_pass = mlp(x, residual)  # 1,100 x 96 float32 outputs: 0.4 MB, far under the default 16 MiB
        assert calls == [1100]
        monkeypatch.setattr(fused_layers, "MLP_PASS_BYTES", 500 * 2 * 48 * 4)  # 500 rows' gate/up output
        calls.clear()
        in_passes = mlp(x, residual)
        assert calls == [500, 500, 100]
        monkeypatch.setattr(fused_layers, "MLP_PASS_BYTES", 1)  # never fewer than 64 rows in a pass
        calls.clear()
        mlp(x[:130], residual[:130])
        assert calls == [64, 64, 2]
    assert in_passes.shape == (1100, 32)
    torch.testing.assert_close(in_passes, one_pass, rtol=1e-6, atol=1e-6)
    monkeypatch.undo()
    # The real presets' pass sizes, in float32: Qwen2-VL-2B's intermediate of 8,960, the `small` preset's 1,536.
    wide = FusedMLP(qwen2.MLP(TextConfig(hidden_size=8, intermediate_size=8960)))
    assert wide.rows_per_pass(4) == 16 * 2**20 // 71680 == 234
    assert FusedMLP(qwen2.MLP(TextConfig(hidden_size=8, intermediate_size=1536))).rows_per_pass(4) == 1365


def shapes_picture(seed: int) -> Image.Image:
    """A few coloured shapes on white, drawn here (not by the demo's own scene code)."""
    g = torch.Generator().manual_seed(seed)
    image = Image.new("RGB", (224, 224), "white")
    draw = ImageDraw.Draw(image)
    for i in range(3):
        x, y = (int(v) for v in torch.randint(10, 150, (2,), generator=g))
        colour = ("red", "blue", "green", "orange")[int(torch.randint(0, 4, (1,), generator=g))]
        (draw.ellipse if i % 2 else draw.rectangle)((x, y, x + 60, y + 60), fill=colour)
    return image


SEAM = {  # name -> engine arguments (one_kernel_norms: the GPU's norms, here); the first: every speed-up off
    "textbook": dict(fused_layers=False, cpu_fast_linear=False),
    "fused": dict(fused_layers=True, cpu_fast_linear=False),
    "fused and packed": dict(fused_layers=True, cpu_fast_linear=True),
    "packed alone": dict(fused_layers=False, cpu_fast_linear=True),
    "fused, as on a GPU": dict(fused_layers=True, cpu_fast_linear=False, one_kernel_norms=True),
}


def served_tokens_and_logits(llm: LLM, switches: dict, prompts: list, greedy: SamplingParams):
    """The engine's greedy tokens, and the dense reference's logits on the same model."""
    with llm:
        fused = type(llm.model.language_model) is FusedQwen2Model
        packed = any(isinstance(m, packed_linear.PackedLinear) for m in llm.model.modules())
        assert (fused, packed) == (switches["fused_layers"], switches["cpu_fast_linear"])
        tokens = [out.outputs[0].token_ids for out in llm.generate(prompts, greedy, use_tqdm=False)]
        prepared = [llm.engine.prepare(p, greedy) for p in prompts]
        logits = [torch.stack(reference_generate(llm.model, pp.token_ids, pp.images, greedy, keep_logits=True)
                              .logits) for pp in prepared]
    return tokens, logits


def test_the_seam_on_and_off_gives_the_same_tokens_and_logits(monkeypatch):
    """The trained demo model served with each combination of the seam's pieces: the same greedy tokens as the
    textbook model, and logits within float32 rounding of it (every layer packed, whatever its width). "As on a
    GPU" takes the GPU's one-kernel norms."""
    if not packed_linear.packed_linear_available(torch.device("cpu"), torch.float32):
        pytest.skip("this torch build has no usable oneDNN linear ops")
    monkeypatch.setattr(packed_linear, "MIN_PACKED_SIDE", 1)  # the demo model's 256-wide layers are packed too
    questions = ["What colour is the circle?", "How many shapes are there?", "Is the square left of the circle?"]
    prompts = [chat_prompt(q, [shapes_picture(i)]) for i, q in enumerate(questions)] + [chat_prompt("Say hello.")]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    results = {}
    for name, switches in SEAM.items():
        with monkeypatch.context() as patch:
            switches = dict(switches)
            one_kernel_norms = switches.pop("one_kernel_norms", False)
            llm = llm_with_norms(patch, one_kernel_norms, str(demo_checkpoint()), max_model_len=1024,
                                 num_kv_blocks=128, **switches)
            if switches["fused_layers"]:
                assert llm.model.language_model.norm.one_kernel == one_kernel_norms
            results[name] = served_tokens_and_logits(llm, switches, prompts, greedy)
    textbook_tokens, textbook_logits = results.pop("textbook")
    for name, (tokens, logits) in results.items():
        assert tokens == textbook_tokens, name
        for got, want in zip(logits, textbook_logits):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=lambda m: f"{name}: {m}")
