"""A decode step's kernels per layer do not grow with the batch, and the decoder layers never sync with the
host (scripts/workshop/op_count.py counts them; issue 12's measure)."""

import torch

from nanomm import LLM, SamplingParams
from workshop.op_count import OpCounter, decode_step_ops


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


def test_the_counter_sees_kernels_and_host_syncs_and_skips_views():
    x = torch.arange(6.0)
    with OpCounter() as ops:
        y = (x.view(2, 3).t() * 2).sum()
        y.item()
    assert ops.counts["view"] == 1 and ops.counts["mul"] == 1 and ops.host_syncs == 1
    assert ops.kernels == ops.counts["mul"] + ops.counts["sum"] + ops.counts["_local_scalar_dense"]


def test_a_decode_step_launches_at_most_25_kernels_per_layer(ckpt):
    """Issue 12's target, on the tiny preset in float32 (the layer code is the same for every preset; bench.py
    prints the count for the 2b-shaped one)."""
    ops = decode_ops(ckpt, 8)
    assert ops["kernels_per_layer"] <= 25, ops["top_ops_per_layer"]


def test_a_reshape_that_copies_is_a_kernel_and_a_no_op_to_is_not():
    x = torch.arange(12.0).view(3, 4)
    with torch.inference_mode(), OpCounter() as ops:  # as in the engine: reshape reaches the counter whole
        x.reshape(12)  # a view
        x.t().reshape(12)  # a copy: the transposed memory cannot be viewed flat
        x.to(torch.float32)  # nothing to do
    assert ops.counts["reshape (copy)"] == 1 and ops.kernels == 1
