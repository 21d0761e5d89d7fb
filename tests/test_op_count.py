"""A step's operations barely grow with the requests in it: a prefill of 8 pictured requests, a decode of 32. A
decode step's kernels per layer do not grow with the batch, the decoder layers never sync with the host, and in
bf16 the forms a GPU takes make no dtype copies (nanomm/workshop/op_count.py counts them)."""

import pytest
import torch

from helpers import assert_mixed_steps_never_sync, llm_with_norms
from nanomm import LLM, SamplingParams, demo_checkpoint
from nanomm.workshop.op_count import (HostSyncError, NoHostSync, OpCounter, decode_step_ops, demo_decode_ops,
                               demo_prefill_ops, total_ops as total)


def test_a_prefill_step_of_8_pictured_requests_dispatches_at_most_1_5x_the_ops_of_one():
    """Prompt chunks share one attention call per layer, pictures of one size one vision attention call per block,
    and the step's inputs are built in a few tensor operations: what is left per request is its picture's
    preprocessing and its slices of the step's tensors."""
    one, eight = demo_prefill_ops(1), demo_prefill_ops(8)
    assert total(eight) <= 1.5 * total(one), (total(one), total(eight))
    assert eight.kernels <= 1.5 * one.kernels, (one.kernels, eight.kernels)
    # Every prompt attended alone (the definition) launches its own attention kernels in every layer.
    one_by_one = demo_prefill_ops(8, batched_attention=False)
    assert total(one_by_one) > total(eight) + 8 * 4


def test_a_decode_step_of_32_sampled_requests_dispatches_at_most_1_3x_the_ops_of_one():
    """Rows that share their sampling settings are drawn together; each request only takes its generator's next
    number (sampling.py)."""
    one, many = demo_decode_ops(1), demo_decode_ops(32)
    assert total(many) <= 1.3 * total(one), (total(one), total(many), (many.counts - one.counts).most_common(5))
    assert many.kernels <= 1.3 * one.kernels, (one.kernels, many.kernels)


def decode_ops(ckpt, batch: int, batched_attention: bool = True) -> dict:
    with LLM(ckpt, num_kv_blocks=512) as llm:
        llm.engine.runner.batched_attention = batched_attention
        for i in range(batch):
            llm.engine.add_request(f"request {i} asks a question", SamplingParams(max_tokens=4, ignore_eos=True))
        llm.engine.step()  # the prefills
        llm.engine.step()  # the first decode: every request now decodes
        ops = decode_step_ops(llm.engine)
        while llm.engine.has_unfinished_requests():
            llm.engine.step()
    return ops


def test_a_decode_step_s_kernels_per_layer_do_not_grow_with_the_batch(ckpt):
    small, large = decode_ops(ckpt, 4), decode_ops(ckpt, 16)
    assert (small["batch"], large["batch"]) == (4, 16)
    assert small["kernels_per_layer"] == large["kernels_per_layer"]
    assert small["host_syncs_in_layers"] == large["host_syncs_in_layers"] == 0
    # The per-sequence definition launches attention kernels for every sequence: the count grows with the batch.
    one_by_one = decode_ops(ckpt, 16, batched_attention=False)
    assert one_by_one["kernels_per_layer"] > large["kernels_per_layer"] + 16


def bf16_decode_ops(monkeypatch, one_kernel_norms: bool) -> dict:
    """A decode step of 8 requests on the demo model in bf16, its norms in the CPU's form or in the GPU's."""
    with llm_with_norms(monkeypatch, one_kernel_norms, str(demo_checkpoint()), dtype="bfloat16", num_kv_blocks=256,
                        num_preprocess_workers=0) as llm:
        for i in range(8):
            llm.engine.add_request(f"request {i} asks a question", SamplingParams(max_tokens=4, ignore_eos=True))
        llm.engine.step()  # the prefills
        llm.engine.step()  # the first decode: every request now decodes
        return decode_step_ops(llm.engine)


def test_in_bf16_a_decode_layer_as_a_gpu_runs_it_dispatches_15_ops_and_no_dtype_copy(monkeypatch):
    """The decodes' attention is one SDPA call on every device: its kernel keeps the scores in float32 inside, so
    bf16 needs no cast around it. The norms' float32 round trips are the CPU form's four dtype copies per layer
    (25 ops); in the GPU's form, one `rms_norm` per norm, a layer dispatches 15 ops and no copy. On CUDA both
    rms_norm and SDPA are one kernel (aten._fused_rms_norm, a fused attention kernel); the op count sees what the
    layer asks torch for, and gpu_check.sh's profile stage counts the kernels a GPU launches."""
    def copies(ops):
        return {name: n for name, n in ops["top_ops_per_layer"].items() if name.split()[0] in ("to", "_to_copy")}

    cpu_norms, gpu_norms = bf16_decode_ops(monkeypatch, False), bf16_decode_ops(monkeypatch, True)
    assert copies(cpu_norms) == {"to (copy)": 4}, cpu_norms["top_ops_per_layer"]  # what the count would catch
    assert not copies(gpu_norms), gpu_norms["top_ops_per_layer"]
    assert gpu_norms["kernels_per_layer"] <= 15, gpu_norms["top_ops_per_layer"]
    assert gpu_norms["top_ops_per_layer"]["rms_norm"] == 2
    assert gpu_norms["top_ops_per_layer"]["scaled_dot_product_attention"] == 1


def test_the_counter_sees_kernels_and_host_syncs_and_skips_views():
    x = torch.arange(6.0)
    with OpCounter() as ops:
        y = (x.view(2, 3).t() * 2).sum()
        y.item()
    assert ops.counts["view"] == 1 and ops.counts["mul"] == 1 and ops.host_syncs == 1
    assert ops.kernels == ops.counts["mul"] + ops.counts["sum"] + ops.counts["_local_scalar_dense"]


def test_a_decode_step_launches_at_most_21_kernels_per_layer(ckpt):
    """On the tiny preset in float32 (the layer code is the same for every preset; bench.py prints the count for
    the 2b-shaped one). Issue 12's target was 25."""
    ops = decode_ops(ckpt, 8)
    assert ops["kernels_per_layer"] <= 21, ops["top_ops_per_layer"]


def test_a_reshape_that_copies_is_a_kernel_and_a_no_op_to_is_not():
    x = torch.arange(12.0).view(3, 4)
    with torch.inference_mode(), OpCounter() as ops:  # as in the engine: reshape reaches the counter whole
        x.reshape(12)  # a view
        x.t().reshape(12)  # a copy: the transposed memory cannot be viewed flat
        x.to(torch.float32)  # nothing to do
    assert ops.counts["reshape (copy)"] == 1 and ops.kernels == 1


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])
def test_a_mixed_step_s_forward_never_reads_a_value_back_to_the_host(family, ckpt, tmp_path, monkeypatch):
    """Decodes, prompt chunks cutting pictures, visual tokens placed (and Qwen3-VL's DeepStack levels added) in one
    forward: everything the host needs was built before it, so nothing in it waits on the device. The engine
    still gives the dense reference's tokens."""
    from hf_checkpoints import make_hf_checkpoint
    folder = ckpt if family == "qwen2_vl" else make_hf_checkpoint(tmp_path / family, family)
    with LLM(str(folder), max_num_batched_tokens=48, block_size=4, num_preprocess_workers=0) as llm:
        assert_mixed_steps_never_sync(llm, NoHostSync, monkeypatch)
    # The check has teeth: boolean indexing, as the embedding once placed visual tokens, is caught.
    with pytest.raises(HostSyncError), NoHostSync():
        torch.zeros(4, 2)[torch.tensor([True, False, True, False])] += 1
