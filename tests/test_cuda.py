"""The engine on a CUDA GPU: the same oracles as on the CPU. Every test here needs a GPU and is skipped
without one; `scripts/gpu_check.sh` runs them (with tests/test_cuda_graphs.py) the day a GPU is available.

float32: token-identical to the dense reference under the stress settings, and to transformers.
bfloat16: the engine's batched kernels and the reference's sum in other orders, and bf16 rounding turns those
differences into different tokens now and then, so the check is on logits, row by row, within bf16's error.
"""

import contextlib

import pytest
import torch

from helpers import assert_mixed_steps_never_sync, assert_mixed_workload_matches, assert_no_leaks, random_workload
from nanomm import LLM, SamplingParams
from nanomm.engine.sizing import graph_context, largest_bucket
from nanomm.reference import generate as reference_generate
from test_engine import MAX_PIXELS, STRESS, record_logit_rows

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (scripts/gpu_check.sh)")


@pytest.mark.parametrize("setting", ["default", "block-16-tiny-budget", "tiny-pool-preemption"])
@pytest.mark.parametrize("enforce_eager", [False, True])
def test_float32_on_cuda_matches_the_dense_reference(ckpt, setting, enforce_eager):
    llm = LLM(str(ckpt), device="cuda", dtype="float32", max_pixels=MAX_PIXELS, enforce_eager=enforce_eager,
              **STRESS[setting])
    assert_mixed_workload_matches(llm, llm.model)


def test_bfloat16_on_cuda_logits_follow_the_dense_reference(ckpt):
    llm = LLM(str(ckpt), device="cuda", dtype="bfloat16", max_pixels=MAX_PIXELS, block_size=4)
    prompts = random_workload(seed=3, num_prompts=6)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    rows = record_logit_rows(llm)
    ids = [llm.engine.add_request(p, params) for p in prompts]
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    for request_id, prompt in zip(ids, prompts):
        prepared = llm.engine.prepare(prompt, params)
        reference = reference_generate(llm.model, prepared.token_ids, prepared.images, params, keep_logits=True)
        # Teacher-forced on the engine's own tokens would be stricter; the first row has no history to differ.
        torch.testing.assert_close(rows[request_id][0].float(), reference.logits[0].float(), atol=0.1, rtol=0.05)
    assert_no_leaks(llm)


def test_parity_with_transformers_on_cuda_in_float32(ckpt):
    transformers = pytest.importorskip("transformers")
    from helpers import chat_prompt, random_image
    prompt = chat_prompt("what is here?", [random_image(112, 84, 7)])
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    with LLM(str(ckpt), device="cuda", dtype="float32") as llm:
        ours = llm.generate(prompt, params)[0].outputs[0].token_ids
        prepared = llm.engine.prepare(prompt, params)
    model = transformers.Qwen2VLForConditionalGeneration.from_pretrained(str(ckpt), dtype=torch.float32).cuda()
    ids = torch.tensor([prepared.token_ids], device="cuda")
    image = prepared.images[0]
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                         mm_token_type_ids=(ids == model.config.image_token_id).int(),
                         pixel_values=image.pixel_values.cuda(), image_grid_thw=torch.tensor([image.grid_thw]).cuda(),
                         max_new_tokens=16, min_new_tokens=16, do_sample=False, eos_token_id=None)
    assert out[0, ids.shape[1]:].tolist() == ours


@pytest.mark.parametrize("enforce_eager", [True, False])
def test_the_kv_pool_is_sized_after_a_profiling_pass(ckpt, enforce_eager):
    with LLM(str(ckpt), device="cuda", dtype="bfloat16", gpu_memory_utilization=0.5, max_num_seqs=4,
             enforce_eager=enforce_eager) as llm:
        stats = llm.stats()
        assert stats["memory_activation_peak_bytes"] > 0
        # With CUDA graphs, the largest bucket's decode step (4 rows, each gathering max_model_len keys and
        # values in a layer) and the logits buffer.
        graphs, text, config = stats["memory_decode_graph_bytes"], llm.model.config.text, llm.engine.config
        longest = graph_context(config.max_model_len, config.max_seq_len_to_capture)
        batch, context = largest_bucket(4, longest, config.block_size)
        gathered = 2 * batch * context * text.num_key_value_heads * text.head_dim * 2  # bfloat16
        assert graphs == 0 if enforce_eager else graphs >= gathered + batch * text.vocab_size * 4
        # Eagerly, the worst decode step: 4 rows, each gathering max_model_len keys and values in a layer.
        eager_gather = 2 * 4 * config.max_model_len * text.num_key_value_heads * text.head_dim * 2
        assert stats["memory_activation_peak_bytes"] >= eager_gather
        assert stats["memory_activation_reserve_bytes"] == stats["memory_activation_peak_bytes"] + graphs
        expected = int(0.5 * stats["memory_total_bytes"] - stats["memory_used_bytes"]
                       - stats["memory_activation_reserve_bytes"])
        assert stats["kv_budget_bytes"] == expected
        assert stats["kv_blocks_total"] * llm.engine.config.block_size * stats["kv_bytes_per_token"] <= expected


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_layers_on_cuda_run_a_kernel_that_is_their_definition(method):
    """On a GPU the weight-only kernels (`_weight_int8pack_mm`, `_weight_int4pack_mm`) should be found and agree
    with dequantize-then-multiply; a layer that falls back says so here rather than running slowly unseen."""
    from nanomm.accel.quant import (Int4Linear, Int8Linear, dequantize_int4, dequantize_int8, linear_definition,
                                    quantize_int4, quantize_int8)
    g = torch.Generator().manual_seed(0)
    layer = torch.nn.Linear(512, 256, bias=False)
    layer.weight.data = torch.randn(256, 512, generator=g)
    layer = layer.cuda()
    quantized = Int8Linear(layer) if method == "int8" else Int4Linear(layer, group_size=128)
    assert quantized.uses_kernel, f"no {method} kernel on this GPU: the definition runs instead"
    weight = layer.weight.detach()
    dequantized = dequantize_int8(*quantize_int8(weight)) if method == "int8" else \
        dequantize_int4(*quantize_int4(weight, 128))
    x = torch.randn(5, 512, generator=g).cuda()
    expected = linear_definition(x, dequantized)
    torch.testing.assert_close(quantized(x), expected, rtol=2**-7, atol=2**-7 * float(expected.abs().max()))


@pytest.mark.parametrize("extra", [dict(quantization="int8"), dict(quantization="int4", kv_cache_dtype="fp8")])
def test_quantized_engine_on_cuda_matches_its_dense_reference(ckpt, extra):
    llm = LLM(str(ckpt), device="cuda", dtype="float32", max_pixels=MAX_PIXELS, quantization_group_size=32,
              **STRESS["tiny-pool-preemption"], **extra)
    assert_mixed_workload_matches(llm, llm.model)


@pytest.mark.parametrize("method", ["pool", "random", "prune", "attention"])
def test_compressed_visual_tokens_on_cuda_match_the_dense_reference(ckpt, method):
    """Every compression method on the GPU (its indices and coordinates cross between devices), under preemption
    and tiny chunks, against the dense reference compressing the same way on the same device."""
    llm = LLM(str(ckpt), device="cuda", dtype="float32", max_pixels=MAX_PIXELS,
              visual_token_compression={"method": method, "keep_ratio": 0.5}, **STRESS["tiny-pool-preemption"])
    assert_mixed_workload_matches(llm, llm.model)


def test_the_demo_model_trains_on_cuda_as_on_the_cpu(tmp_path):
    """scripts/train_demo.py --device cuda: the same batches give the same losses as on the CPU (float32, TF32
    convolutions apart), with batches drawn by two workers, and the exported weights load on the CPU."""
    from nanomm.workshop.trainer import TINY_SPEC, export, new_run, train
    from nanomm.workshop.training import TrainConfig
    from nanomm.model.loader import load_model
    losses = {}
    for device in ("cpu", "cuda"):
        folder = new_run(tmp_path / device, TINY_SPEC)
        cfg = TrainConfig(steps=3, batch_size=4, warmup_steps=1, curriculum_steps=0, max_turns=4, vision_steps=1,
                          device=device, batch_workers=2)
        result = train(folder, cfg, show_progress=False, log=lambda _: None)
        losses[device] = result["losses"]
    assert result["model"].device.type == "cuda" and len(losses["cuda"]) == 3
    assert losses["cuda"] == pytest.approx(losses["cpu"], rel=1e-2)
    export(result["model"], folder)
    assert load_model(folder).device.type == "cpu"


@contextlib.contextmanager
def cuda_syncs_are_errors():
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_a_mixed_step_s_forward_never_syncs_on_cuda(ckpt, monkeypatch):
    """Decodes and prompt chunks cutting pictures in one step: its forward and logits run under
    `torch.cuda.set_sync_debug_mode("error")`, so any synchronizing CUDA call inside them raises."""
    with LLM(str(ckpt), device="cuda", dtype="float32", max_pixels=MAX_PIXELS, max_num_batched_tokens=48,
             block_size=4, num_preprocess_workers=0) as llm:
        assert_mixed_steps_never_sync(llm, cuda_syncs_are_errors, monkeypatch)
