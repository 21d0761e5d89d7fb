"""Quantization: int8/int4 weight-only layers (accel/quant.py) and the fp8 KV cache (engine/kv_fp8.py).

Each format is checked by hand on values whose codes can be worked out on paper, each kernel against the
readable dequantize-then-multiply definition, and the engine against the dense reference that runs the same
quantized layers (and keeps its keys and values as an fp8 cache returns them), under the engine's stress
settings: chunked prefill that cuts images, preemption, prefix-cache hits, speculative decoding.
"""

import pytest
import torch
from torch import nn

from family_checks import (ALONE_CASES, assert_quantized_engine_tracks_reference, force_quantized_path,
                           quantized_alone_matches_reference)
from helpers import assert_engine_matches_reference, random_workload, run_to_completion
from test_engine import record_logit_rows
from nanomm import LLM, SamplingParams, demo_checkpoint
from nanomm.accel.fused_layers import FastRMSNorm
from nanomm.reference import generate as reference_generate
from nanomm.engine.kv_fp8 import Fp8KVCache
from nanomm.model.fp8 import dequantize_fp8, fp8_round_trip, quantize_fp8
from nanomm.accel.quant import (Int4Linear, Int8Linear, QuantizedLinear, dequantize_int4, dequantize_int8,
                                linear_definition, pack_nibbles, quantize_int4, quantize_int8, unpack_nibbles,
                                weight_bytes)

MAX_PIXELS = 28 * 28 * 16


def make_llm(ckpt, **kwargs):
    kwargs.setdefault("max_pixels", MAX_PIXELS)
    kwargs.setdefault("num_preprocess_workers", 0)  # which images share a vision forward: the same every run
    kwargs.setdefault("quantization_group_size", 32)  # the tiny preset's layers are 64 and 128 wide
    return LLM(str(ckpt), device="cpu", dtype="float32", **kwargs)


def linear_with(weight: torch.Tensor, bias: torch.Tensor | None = None) -> nn.Linear:
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    layer.weight.data = weight.clone()
    if bias is not None:
        layer.bias.data = bias.clone()
    return layer


# -- the formats, by hand ------------------------------------------------------------------------------------


def test_int8_codes_and_scale_by_hand():
    # max |w| = 127 / 128, so the scale is 1/128 exactly (a bfloat16 value) and each weight is a whole code
    weight = torch.tensor([[127 / 128, -0.5, 0.25, 2 / 128], [0.0, 0.0, 0.0, -1.0]])
    codes, scales = quantize_int8(weight)
    assert codes.tolist() == [[127, -64, 32, 2], [0, 0, 0, -127]]
    assert scales.float().tolist() == [1 / 128, pytest.approx(1 / 127, rel=2**-8)]
    assert torch.equal(dequantize_int8(codes, scales)[0], weight[0])


def test_int4_codes_scale_and_zero_by_hand():
    # one group of 4: min 0, max 3.75 -> scale 3.75 / 15 = 0.25; code 8 stands for 0 + 8 x 0.25 = 2.0
    weight = torch.tensor([[0.0, 0.5, 3.75, 1.0]])
    codes, scales, zeros = quantize_int4(weight, group_size=4)
    assert codes.tolist() == [[0, 2, 15, 4]]
    assert scales.float().tolist() == [[0.25]] and zeros.float().tolist() == [[2.0]]
    assert torch.equal(dequantize_int4(codes, scales, zeros), weight)


def test_int4_keeps_its_steps_for_a_group_far_from_zero():
    """A group in [1.0, 1.01]: bfloat16 stores its zero to within 2^-8, more than a step (0.01 / 15) away;
    the scale is chosen around the stored zero, so every weight still lands within about half a step."""
    weight = torch.linspace(1.0, 1.01, 32)[None, :]
    codes, scales, zeros = quantize_int4(weight, group_size=32)
    error = (dequantize_int4(codes, scales, zeros) - weight).abs().max()
    assert float(error) <= 0.6 * 0.01 / 15 * 1.1, float(error)  # half a step, with room for the wider scale


def test_a_quantized_layer_refuses_to_be_moved_or_cast():
    layer = Int8Linear(linear_with(torch.ones(16, 32)))
    with pytest.raises(RuntimeError, match="quantize"):
        layer.float()


def test_nibbles_pack_two_codes_per_byte():
    codes = torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8)
    packed = pack_nibbles(codes)
    assert packed.tolist() == [[1 + 2 * 16, 15]]
    assert torch.equal(unpack_nibbles(packed), codes)


def test_fp8_codes_and_scale_by_hand():
    # max |x| = 1.75 = 448 / 256, so the scale is 1/256; 0.1 x 256 = 25.6 lies between e4m3's 24 and 26 -> 26
    x = torch.tensor([[1.75, -0.5, 0.1, 0.0]])
    codes, scales = quantize_fp8(x)
    assert scales.float().tolist() == [1 / 256]
    assert codes.float().tolist() == [[448.0, -128.0, 26.0, 0.0]]
    assert dequantize_fp8(codes, scales, torch.float32).tolist() == [[1.75, -0.5, 26 / 256, 0.0]]
    assert torch.equal(fp8_round_trip(torch.zeros(2, 3)), torch.zeros(2, 3))  # no division by a zero scale


def test_fp8_keeps_about_two_significant_digits_at_any_magnitude():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 2, 64, generator=g) * torch.logspace(-3, 3, 64)[:, None, None]  # (tokens, heads, dim)
    err = (fp8_round_trip(x) - x).abs()
    step = x.abs().amax(dim=-1, keepdim=True) / 448 * 1.01  # one unit of the scaled values (scale rounding apart)
    # e4m3 keeps 3 mantissa bits: a value is off by at most 1/16 of itself, or by 2^-10 units below 2^-6 units
    assert bool((err <= torch.maximum(x.abs() / 16, step * 2**-10)).all())
    assert float((err / x.abs()).median()) < 0.03


# -- the layers: kernels against the definition -------------------------------------------------------------


@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("shape", [(48, 64), (128, 256), (96, 512)])
def test_a_quantized_layer_is_its_definition(method, shape):
    """Kernel or not, a layer computes linear_definition(x, dequantized weight) (+ bias): bfloat16 activations,
    float32 sums. The kernels sum in their own order and round the result to bfloat16: a bfloat16 step apart."""
    out_features, in_features = shape
    g = torch.Generator().manual_seed(out_features)
    layer = linear_with(torch.randn(out_features, in_features, generator=g), torch.randn(out_features, generator=g))
    quantized = Int8Linear(layer) if method == "int8" else Int4Linear(layer, group_size=32)
    x = torch.randn(5, in_features, generator=g)
    weight = layer.weight.detach()  # the definition, from the formats (checked by hand above)
    dequantized = dequantize_int8(*quantize_int8(weight)) if method == "int8" else \
        dequantize_int4(*quantize_int4(weight, 32))
    expected = linear_definition(x, dequantized) + layer.bias
    assert quantized.uses_kernel  # these shapes suit both CPU kernels: the kernel is what is checked here
    torch.testing.assert_close(quantized(x), expected, rtol=2**-7, atol=2**-7 * float(expected.abs().max()))
    assert quantized(x).dtype == torch.float32  # hands back the caller's dtype
    fallback = Int8Linear(layer, try_kernel=False) if method == "int8" else Int4Linear(layer, 32, try_kernel=False)
    assert not fallback.uses_kernel and torch.equal(fallback(x), expected)
    assert torch.equal(quantized(x.t().contiguous().t()), quantized(x))  # a strided input is made contiguous


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_no_rows_never_reach_the_kernel(method, monkeypatch):
    """A step with nothing to sample hands the head no rows: the answer is (0, out) without a kernel call (torch's
    CUDA int8 kernel fails on an empty grid, and the error surfaces at the next, unrelated CUDA call)."""
    layer = linear_with(torch.randn(64, 128, generator=torch.Generator().manual_seed(2)))
    quantized = Int8Linear(layer) if method == "int8" else Int4Linear(layer, group_size=32)
    assert quantized.uses_kernel
    def refuse(x):
        raise AssertionError(f"the kernel was called with {x.shape[0]} rows")
    monkeypatch.setattr(quantized, "kernel_matmul", refuse)
    out = quantized(torch.zeros(0, 128))
    assert out.shape == (0, 64) and out.dtype == torch.float32
    with pytest.raises(AssertionError, match="called with 3 rows"):  # the refusal has teeth
        quantized(torch.zeros(3, 128))


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_a_kernel_gives_a_row_the_same_bits_whatever_rows_come_with_it(method):
    """A row's result does not depend on how many rows share the kernel's call (a kernel that switched to another
    code path above some row count, as tiled matrix kernels do, would round a prompt's rows one way and a
    decode's another). torch 2.13's CPU int8 and int4 kernels compute each output from its own row and column in
    a fixed order, with no path chosen by the row count; this holds them to it on the CPU at hand, from 1 row to
    300. The float32 definition is a BLAS sgemm and need not be (on a 2-core AMD EPYC, 2 rows at once already
    differ from 1 in the last bit)."""
    g = torch.Generator().manual_seed(3)
    layer = linear_with(torch.randn(96, 256, generator=g))
    x = torch.randn(300, 256, generator=g)
    quantized = Int8Linear(layer) if method == "int8" else Int4Linear(layer, 32)
    assert quantized.uses_kernel
    alone = torch.cat([quantized(x[i:i + 1]) for i in range(len(x))])  # (300, 96), one row a call
    differ = [rows for rows in [2, 3, 4, 5, 7, 8, 15, 16, 17, 31, 32, 33, 64, 65, 128, 255, 300]
              if not torch.equal(quantized(x[:rows]), alone[:rows])]
    assert differ == []


def test_this_cpu_build_runs_torch_s_kernels():
    """The fast path is in use here (torch 2.13 CPU ships both kernels): otherwise the speed-ups recorded in
    BENCHMARKS.md would not be what a user gets."""
    g = torch.Generator().manual_seed(0)
    layer = linear_with(torch.randn(64, 128, generator=g))
    assert Int8Linear(layer).uses_kernel
    assert Int4Linear(layer, group_size=32).uses_kernel
    assert not Int4Linear(linear_with(torch.randn(40, 128, generator=g)), group_size=32).uses_kernel  # 40 % 16


def test_quantized_layers_are_close_to_the_float_ones():
    g = torch.Generator().manual_seed(1)
    layer = linear_with(torch.randn(256, 512, generator=g))
    x = torch.randn(8, 512, generator=g)
    exact = layer(x)
    for quantized, tolerance in ((Int8Linear(layer), 0.01), (Int4Linear(layer, 64), 0.1)):
        error = (quantized(x) - exact).norm() / exact.norm()
        assert float(error) < tolerance, type(quantized).__name__


def test_a_group_size_that_does_not_divide_the_layer_is_an_error(ckpt):
    with pytest.raises(ValueError, match="must be even and divide"):
        make_llm(ckpt, quantization="int4", quantization_group_size=128)  # the tiny preset's hidden size is 64


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_the_language_model_and_head_are_quantized_and_the_tower_is_not(ckpt, method):
    quantized = make_llm(ckpt, quantization=method)
    layers = [m for m in quantized.model.language_model.modules() if isinstance(m, QuantizedLinear)]
    assert len(layers) == 4 * quantized.model.config.text.num_hidden_layers  # qkv, o, gate/up, down
    assert isinstance(quantized.model.lm_head, QuantizedLinear)
    assert not any(isinstance(m, QuantizedLinear) for m in quantized.model.visual.modules())
    for layer in layers + [quantized.model.lm_head]:
        out_features, in_features = layer.out_features, layer.in_features
        bias = 0 if layer.bias is None else 4 * out_features
        if method == "int8":  # a byte per weight, a bfloat16 scale per row
            expected = out_features * in_features + 2 * out_features + bias
        else:  # half a byte per weight, a bfloat16 scale and zero per group of 32
            expected = out_features * in_features // 2 + 2 * 2 * out_features * in_features // 32 + bias
        assert weight_bytes(layer) == expected


# -- the engine against the dense reference -----------------------------------------------------------------

STRESS = {
    "block-16-tiny-budget": dict(block_size=16, max_num_batched_tokens=7),
    "tiny-pool-preemption": dict(block_size=4, num_kv_blocks=36, max_num_batched_tokens=24),
    "block-1": dict(block_size=1),
    "few-seqs": dict(max_num_seqs=2, block_size=8),
}
FORMATS = {
    "int8": dict(quantization="int8"),
    "int4": dict(quantization="int4"),
    "int8-definition": dict(quantization="int8", quantized_path="definition"),
    "int4-definition": dict(quantization="int4", quantized_path="definition"),
    "fp8-kv": dict(kv_cache_dtype="fp8"),
    "int4+fp8-kv": dict(quantization="int4", kv_cache_dtype="fp8"),
}


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("setting", list(STRESS))
def test_the_engine_matches_its_quantized_reference(ckpt, fmt, setting, monkeypatch):
    """A mixed batch under each stress setting, the quantized layers on the probe's choice (the kernel where it
    runs) or forced onto the definition: held to what a quantized engine promises in a batch
    (`assert_quantized_engine_tracks_reference`; fp8 keys and values round too, so the same)."""
    settings = dict(FORMATS[fmt])
    force_quantized_path(monkeypatch, settings.pop("quantized_path", "kernel"))
    llm = make_llm(ckpt, **settings, **STRESS[setting])
    prompts = random_workload(seed=1, num_prompts=8)
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.8, top_k=40, seed=i, max_tokens=4 + 3 * (i % 4),
                             ignore_eos=True) for i in range(len(prompts))]
    assert_quantized_engine_tracks_reference(llm, prompts, params)
    if setting == "tiny-pool-preemption":
        assert llm.stats()["preemptions"] > 0
    assert_quantized_engine_tracks_reference(llm, prompts[:3], params[:3])  # again: prefixes from the cache
    assert llm.stats()["prefix_cache_hit_tokens"] > 0


@pytest.mark.parametrize("method, path", ALONE_CASES)
def test_a_quantized_request_alone_is_the_reference_bit_for_bit(ckpt, method, path, monkeypatch):
    quantized_alone_matches_reference(ckpt, method, path, MAX_PIXELS, monkeypatch)


@pytest.mark.parametrize("fmt", ["int8", "int4+fp8-kv"])
@pytest.mark.parametrize("setting", ["block-16-tiny-budget", "tiny-pool-preemption", "block-1"])
def test_every_logits_row_is_the_reference_s(ckpt, fmt, setting):
    """Stricter than token ids: each row of logits the engine sampled from, against the reference's at that step.
    Quantized layers round their input to bfloat16, which turns a float32 difference upstream (a sum in another
    order, e.g. images encoded several at a time in the engine and one by one in the reference) into a logit
    difference of up to ~3e-2, now and then. So: no row is further than that, and most rows get the reference's
    bits (int8: its kernels give a row the same bits in any batch; the tiny model's int4 head, 526 rows, not a
    multiple of 16, runs the float32 definition: float32 rounding only). How many do depends on the process (a run
    of the whole suite saw 29 of 48 for int4 + fp8 where this test alone sees 40 to 48). A wrong slot, position or
    scale moves logits by far more."""
    llm = make_llm(ckpt, **FORMATS[fmt], **STRESS[setting])
    rows = record_logit_rows(llm)
    prompts = random_workload(seed=3, num_prompts=6)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    ids = [llm.engine.add_request(p, params) for p in prompts]
    run_to_completion(llm.engine)
    same, total = 0, 0
    for request_id, prompt in zip(ids, prompts):
        prepared = llm.engine.prepare(prompt, params)
        reference = reference_generate(llm.model, prepared.token_ids, prepared.images, params, keep_logits=True,
                                       kv_cache_dtype=llm.engine.config.kv_cache_dtype)
        for ours, theirs in zip(rows[request_id], reference.logits, strict=True):
            torch.testing.assert_close(ours, theirs, atol=0.05, rtol=0)
            same += torch.equal(ours, theirs) if fmt == "int8" else torch.allclose(ours, theirs, atol=1e-5, rtol=0)
            total += 1
    assert same >= 0.5 * total, f"{same} of {total} rows equal the reference's"


@pytest.mark.parametrize("fmt", ["int8", "int4+fp8-kv"])
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculative_decoding_on_a_quantized_engine_changes_no_greedy_token(ckpt, fmt, method):
    """Greedy tokens are the reference's (sampled ones keep the distribution, not the draws: test_speculative)."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1} if method == "ngram" else \
        {"method": "draft", "model": str(ckpt), "num_speculative_tokens": 3}
    llm = make_llm(ckpt, **FORMATS[fmt], speculative_config=spec, block_size=4, max_num_batched_tokens=24)
    prompts = random_workload(seed=1, num_prompts=8)
    params = [SamplingParams(temperature=0.0, max_tokens=12 + 3 * (i % 4), ignore_eos=True) for i in range(8)]
    assert_engine_matches_reference(llm, prompts, params)
    assert llm.stats()["spec_accepted_tokens"] > 0  # the verification path ran and kept proposals


def test_the_reference_is_really_quantized(ckpt):
    """The parity above would hold trivially if nothing were quantized: every format must move the logits."""
    prompt, params = random_workload(seed=5, num_prompts=1)[0], SamplingParams(temperature=0.0, max_tokens=3)
    logits = {}
    formats = {fmt: settings for fmt, settings in FORMATS.items() if "quantized_path" not in settings}
    for fmt, extra in {"float32": {}, **formats}.items():
        with make_llm(ckpt, **extra) as llm:
            prepared = llm.engine.prepare(prompt, params)
            logits[fmt] = reference_generate(llm.model, prepared.token_ids, prepared.images, params, keep_logits=True,
                                             kv_cache_dtype=llm.engine.config.kv_cache_dtype).logits[0]
    for fmt in formats:
        difference = float((logits[fmt] - logits["float32"]).abs().max())
        assert 1e-4 < difference < 0.5 * float(logits["float32"].abs().max()), (fmt, difference)


# -- the fp8 pool -------------------------------------------------------------------------------------------


def test_fp8_holds_at_least_1_9x_the_tokens_of_bfloat16_in_the_same_memory():
    """The demo model's heads are 64 wide: 64 one-byte codes and a 2-byte scale against 128 bytes of bfloat16."""
    capacity, pool_bytes = {}, {}
    for kv in ("auto", "fp8"):
        with LLM(demo_checkpoint(), dtype="bfloat16", kv_cache_dtype=kv, kv_cache_memory_gib=0.01) as llm:
            stats = llm.stats()
            capacity[kv] = stats["kv_capacity_tokens"]
            cache = llm.engine.runner.kv_cache
            pool_bytes[kv] = cache.nbytes if isinstance(cache, Fp8KVCache) else cache.numel() * cache.element_size()
            assert pool_bytes[kv] == capacity[kv] * stats["kv_bytes_per_token"] <= 0.01 * 2**30
    assert capacity["fp8"] / capacity["auto"] >= 1.9
    assert pool_bytes["fp8"] / capacity["fp8"] == 4 * 2 * 2 * (64 + 2)  # 4 layers x (K, V) x 2 KV heads
    assert pool_bytes["auto"] / capacity["auto"] == 4 * 2 * 2 * 64 * 2


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_the_planner_counts_the_weights_the_engine_holds(ckpt, method):
    """planner.model_weight_bytes from the config alone against the bytes of the quantized model in memory."""
    from nanomm.planner import model_weight_bytes
    with make_llm(ckpt, quantization=method, cpu_fast_linear=False) as llm:
        held = weight_bytes(llm.model)
        planned = model_weight_bytes(llm.model.config, "float32", method, group_size=32)
        norms = sum(isinstance(m, FastRMSNorm) for m in llm.model.modules())
        assert planned + 4 * norms == held, (planned, held)  # + each fused RMSNorm's eps buffer, not a parameter
        assert llm.plan().quantization == method
        assert llm.plan().weights_bytes == planned  # the engine's group size (32) reaches the plan


def test_an_fp8_engine_reports_its_cache(ckpt):
    with make_llm(ckpt, kv_cache_dtype="fp8") as llm:
        stats = llm.stats()
        assert stats["kv_cache_dtype"] == "fp8"
        assert stats["kv_bytes_per_token"] == 2 * 2 * 2 * (16 + 2)  # tiny: 2 layers, 2 KV heads of 16
        assert llm.plan().kv_bytes_per_token == stats["kv_bytes_per_token"]


# -- the trained model --------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt, floor", [("int8", 0.95), ("int4", 0.85), ("fp8-kv", 0.95)])
def test_the_trained_model_answers_the_same_when_quantized(fmt, floor):
    """Answers of the demo model on 60 held-out questions (colour, shape, places), quantized against not.
    BENCHMARKS.md has the accuracy per task on 800 questions each."""
    from nanomm.demo.evaluation import answer_items, held_out_items
    items = [item for task in ("colour", "shape", "left_right", "above_below")
             for item in held_out_items(task, 15, seed=1)]
    answers = {}
    for name, extra in (("float32", {}), (fmt, FORMATS[fmt])):
        with LLM(demo_checkpoint(), **extra) as llm:
            answers[name] = answer_items(llm, items)
    same = sum(a == b for a, b in zip(answers["float32"], answers[fmt])) / len(items)
    assert same >= floor, same
