"""CUDA graphs for decode (nanomm/engine/cuda_graphs.py): the static, padded path it records gives the dense
reference's tokens, it never reads a value back to the host, and on a GPU a replay equals eager decoding."""

import pytest
import torch

from helpers import assert_no_leaks, random_workload, reference_tokens
from nanomm import LLM, SamplingParams
from nanomm.engine import attention
from nanomm.engine.cuda_graphs import DecodeGraphs, StaticDecodeInputs, decode_forward
from nanomm.engine.sizing import batch_bucket, context_bucket, graph_context, largest_bucket
from nanomm.engine.memory_profile import decode_step
from nanomm.workshop.op_count import HostSyncError, NoHostSync
from test_engine import MAX_PIXELS, STRESS


def with_static_decode(llm) -> tuple[DecodeGraphs, int]:
    """The engine's decode steps through DecodeGraphs without recording (a CPU has no graphs), padding rows
    writing to a block taken from the pool for the test (given back by `release`)."""
    engine = llm.engine
    scratch = engine.block_manager.allocate(1)[0]
    config = engine.config
    graphs = DecodeGraphs(llm.model, engine.runner.kv_cache, config.block_size, scratch * config.block_size,
                          config.max_num_seqs, graph_context(config.max_model_len, config.max_seq_len_to_capture),
                          capture=False)
    engine.runner.decode_graphs = graphs
    return graphs, scratch


def test_buckets():
    assert [batch_bucket(n) for n in (1, 3, 5, 17, 33, 256)] == [1, 4, 8, 24, 48, 256]
    assert batch_bucket(257) is None
    assert [context_bucket(n, 16) for n in (1, 16, 17, 33, 200)] == [16, 16, 32, 64, 256]
    # Never past max_model_len's blocks: 200 tokens are 13 blocks, so a 16-block bucket would be 3 too many.
    assert [context_bucket(n, 16, max_tokens=200) for n in (17, 100, 200)] == [32, 128, 208]
    assert largest_bucket(max_num_seqs=40, max_context=1000, block_size=16) == (48, 1008)
    assert largest_bucket(max_num_seqs=300, max_context=100, block_size=16) == (256, 112)


@pytest.mark.parametrize("setting", ["default", "block-1", "tiny-pool-preemption", "few-seqs"])
def test_the_padded_static_decode_path_matches_the_dense_reference(ckpt, setting):
    llm = LLM(str(ckpt), device="cpu", dtype="float32", max_pixels=MAX_PIXELS, **STRESS[setting])
    assert_static_decode_matches_reference(llm)
    assert_no_leaks(llm)


def assert_static_decode_matches_reference(llm) -> None:
    """Greedy and seeded requests through the padded static decode path give the dense reference's tokens (the
    new model families' tests call it too)."""
    graphs, scratch = with_static_decode(llm)
    prompts = random_workload(seed=2, num_prompts=7)  # 7 decodes pad to a bucket of 8
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.9, seed=i, max_tokens=5 + 2 * i, ignore_eos=True)
              for i in range(7)]
    outputs = llm.generate(prompts, params)
    assert graphs.replays > 0 and any(batch > 1 for batch, _ in graphs.recorded)
    for i, (prompt, p, out) in enumerate(zip(prompts, params, outputs)):
        assert out.outputs[0].token_ids == reference_tokens(llm, prompt, p), f"prompt {i} differs"
    llm.engine.block_manager.free([scratch])


def test_padding_rows_write_only_the_scratch_slot(ckpt):
    llm = LLM(str(ckpt), device="cpu", dtype="float32", block_size=4, num_kv_blocks=64)
    graphs, scratch = with_static_decode(llm)
    for i in range(3):  # 3 decodes: a bucket of 4, one padding row
        llm.engine.add_request(f"request {i} asks", SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    llm.engine.step()  # prefills
    llm.engine.step()  # first decode step (static path)
    llm.engine.runner.kv_cache[:, :, scratch * 4:scratch * 4 + 4] = 0  # so that the padding row's write shows
    before = llm.engine.runner.kv_cache.clone()
    running = list(llm.engine.scheduler.running)
    last = [(r.block_table, r.num_tokens - 1) for r in running]  # the token this step computes: its k/v are new
    new_slots = {table[p // 4] * 4 + p % 4 for table, p in last}
    llm.engine.step()
    changed = (llm.engine.runner.kv_cache != before).any(dim=(0, 1, 3, 4)).nonzero().flatten().tolist()  # slots
    scratch_slots = set(range(scratch * 4, scratch * 4 + 4))
    assert set(changed) <= new_slots | scratch_slots and set(changed) & scratch_slots
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    llm.engine.block_manager.free([scratch])
    assert_no_leaks(llm)


def test_every_bucket_s_logits_land_in_one_shared_buffer(ckpt, monkeypatch):
    """Kept graphs must not each keep a (batch, vocab) output: every step's logits are rows of `graphs.logits`."""
    llm = LLM(str(ckpt), device="cpu", dtype="float32", block_size=4, num_kv_blocks=64)
    graphs, scratch = with_static_decode(llm)
    run, returned = graphs.run, []
    monkeypatch.setattr(graphs, "run", lambda chunks: returned.append(run(chunks)) or returned[-1])
    prompts = random_workload(seed=5, num_prompts=3)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (2, 4, 40)]  # 3 rows, then 1
    outputs = llm.generate(prompts, params)
    assert len({key[0] for key in graphs.recorded}) >= 2 and len({key[1] for key in graphs.recorded}) >= 2
    assert returned and all(out.data_ptr() == graphs.logits.data_ptr() for out in returned)
    assert graphs.logits.shape == (batch_bucket(llm.engine.config.max_num_seqs), llm.model.config.text.vocab_size)
    for prompt, p, out in zip(prompts, params, outputs):
        assert out.outputs[0].token_ids == reference_tokens(llm, prompt, p)
    llm.engine.block_manager.free([scratch])
    assert_no_leaks(llm)


def test_context_buckets_stop_at_max_model_len(ckpt):
    llm = LLM(str(ckpt), device="cpu", dtype="float32", block_size=4, num_kv_blocks=64, max_model_len=44)
    graphs, scratch = with_static_decode(llm)
    out = llm.generate(["Count on:"], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0]
    assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 44  # decoded up to the limit
    contexts = {length for _, length in graphs.recorded}
    assert max(contexts) == 44 and graphs.largest == (batch_bucket(llm.engine.config.max_num_seqs), 44)
    llm.engine.block_manager.free([scratch])
    assert_no_leaks(llm)


def test_steps_past_max_seq_len_to_capture_run_eagerly(ckpt):
    llm = LLM(str(ckpt), device="cpu", dtype="float32", block_size=4, num_kv_blocks=64, max_model_len=44,
              max_seq_len_to_capture=24)
    graphs, scratch = with_static_decode(llm)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    out = llm.generate(["Count on:"], params)[0]
    assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 44
    assert graphs.replays > 0 and max(length for _, length in graphs.recorded) == 24  # then eager up to 44
    assert graphs.replays < len(out.outputs[0].token_ids) - 1
    assert out.outputs[0].token_ids == reference_tokens(llm, "Count on:", params)
    llm.engine.block_manager.free([scratch])
    assert_no_leaks(llm)


class LargestOutput(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.numel = max([self.numel] + [t.numel() for t in torch.utils._pytree.tree_leaves(out)
                                         if isinstance(t, torch.Tensor)])
        return out


def test_the_memory_profile_s_decode_step_gathers_the_largest_bucket_s_whole_context(ckpt):
    """The profile (CUDA only) measures `decode_step`; on a CPU we check it is the step that it stands for:
    every row attends to `context` keys, so a layer gathers batch x context keys and values, from a one-block
    cache, with no host sync (the same region a graph records)."""
    llm = LLM(str(ckpt), device="cpu", dtype="float32", block_size=4, num_kv_blocks=8)
    text = llm.model.config.text
    batch, context = 8, 64
    with torch.inference_mode(), NoHostSync(), LargestOutput() as largest:
        logits = decode_step(llm.model, batch, context, block_size=4)
    assert logits.shape == (batch, text.vocab_size)
    assert largest.numel >= 2 * batch * context * text.num_key_value_heads * text.head_dim


def test_the_memory_profile_s_batched_step_gathers_every_run_s_whole_context(ckpt):
    """The profile's worst batched step (runs of MAX_BATCHED_QUERIES queries, built by the runner's own
    build_decode_batch): every query of every run samples, and a layer gathers batch x context keys and values."""
    from nanomm.accel.batched_attention import MAX_BATCHED_QUERIES
    llm = LLM(str(ckpt), device="cpu", dtype="float32", block_size=4, num_kv_blocks=8)
    text = llm.model.config.text
    batch, context = 3, 64
    with torch.inference_mode(), LargestOutput() as largest:
        logits = decode_step(llm.model, batch, context, block_size=4, queries=MAX_BATCHED_QUERIES)
    assert logits.shape == (batch * MAX_BATCHED_QUERIES, text.vocab_size) and bool(torch.isfinite(logits).all())
    assert largest.numel >= 2 * batch * context * text.num_key_value_heads * text.head_dim


def test_the_recorded_region_never_reads_a_value_back_to_the_host(ckpt, monkeypatch):
    llm = LLM(str(ckpt), device="cpu", dtype="float32", block_size=4, num_kv_blocks=64)
    graphs, scratch = with_static_decode(llm)
    for i in range(3):
        llm.engine.add_request(f"request {i}", SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    llm.engine.step()  # prefills
    llm.engine.step()  # a decode step through the static path: its inputs stay in the buffers
    inputs = next(iter(graphs.recorded.values())).inputs
    with torch.inference_mode(), NoHostSync():
        logits = decode_forward(llm.model, llm.engine.runner.kv_cache.clone(), inputs)
    assert logits.shape == (4, llm.model.config.text.vocab_size)
    # The check has teeth: each kind of sync inside the attention call is caught.
    attend = attention.PagedAttention.attend
    for sync in (lambda q: q.sum().item(), lambda q: q.flatten()[:2].tolist(), lambda q: (q > 0).nonzero(),
                 lambda q: q[q > 0]):
        def attend_and_sync(self, layer, q, k, v, sync=sync):
            sync(q)
            return attend(self, layer, q, k, v)
        monkeypatch.setattr(attention.PagedAttention, "attend", attend_and_sync)
        with pytest.raises(HostSyncError), torch.inference_mode(), NoHostSync():
            decode_forward(llm.model, llm.engine.runner.kv_cache.clone(), inputs)
    monkeypatch.undo()
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    llm.engine.block_manager.free([scratch])
    assert_no_leaks(llm)


@pytest.fixture(params=["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def family_ckpt(request, ckpt, tmp_path_factory):
    """A tiny checkpoint of each family: the graphs record Qwen3-VL's q/k norms and interleaved M-RoPE too."""
    if request.param == "qwen2_vl":
        return ckpt
    from hf_checkpoints import make_hf_checkpoint
    return make_hf_checkpoint(tmp_path_factory.mktemp(request.param), request.param)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (scripts/gpu_check.sh runs it)")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_graph_replay_gives_what_eager_decoding_gives_on_cuda(family_ckpt, dtype, monkeypatch):
    """Bit for bit on the same (padded) inputs; token for token end to end in float32. An eager step runs its real
    rows only, a graph the padded bucket: in bfloat16 a matmul of 8 rows may round differently from one of 6, so
    whole generations are compared in float32 only. Each family: Qwen2-VL, Qwen2.5-VL, Qwen3-VL."""
    ckpt = family_ckpt
    prompts = random_workload(seed=4, num_prompts=6)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    # Every bucket's inputs are views of the front of one shared buffer, which holds only the last step's: keep
    # each bucket's last inputs (its recording's padding, or its last real step) to put back before its replay.
    last_inputs, host_values = {}, StaticDecodeInputs.host_values
    def keep(inputs, *args):
        last_inputs[id(inputs)] = host_values(inputs, *args)
        return last_inputs[id(inputs)]
    monkeypatch.setattr(StaticDecodeInputs, "host_values", keep)
    with LLM(str(ckpt), device="cuda", dtype=dtype, max_pixels=MAX_PIXELS) as graphed:
        got = [o.outputs[0].token_ids for o in graphed.generate(prompts, params)]
        graphs = graphed.engine.runner.decode_graphs
        assert graphs.replays > 0 and all(r.graph is not None for r in graphs.recorded.values())
        assert graphs.largest in graphs.recorded  # recorded first, whatever the first step needed
        assert len(graphs.recorded) > 1  # so that the buffer was shared, and put back below
        for recorded in graphs.recorded.values():
            recorded.inputs.flat.copy_(last_inputs[id(recorded.inputs)])
            batch = recorded.inputs.input_ids.shape[0]
            recorded.graph.replay()
            replayed = graphs.logits[:batch].clone()
            with torch.inference_mode():
                eager = decode_forward(graphed.model, graphs.kv_cache, recorded.inputs)
            assert torch.equal(replayed, eager)
    if dtype == "float32":
        with LLM(str(ckpt), device="cuda", dtype=dtype, max_pixels=MAX_PIXELS, enforce_eager=True) as eager_llm:
            assert got == [o.outputs[0].token_ids for o in eager_llm.generate(prompts, params)]


def test_the_op_count_runs_the_step_eagerly_and_puts_the_graphs_back(ckpt):
    """A graph replay would hide every kernel from the op count (bench.py's kernels-per-layer line on CUDA): the
    counted step goes around the decode graphs, which are in place again afterwards."""
    from nanomm.workshop.op_count import decode_step_ops
    llm = LLM(str(ckpt), device="cpu", dtype="float32", block_size=4, num_kv_blocks=64)
    graphs, scratch = with_static_decode(llm)
    for i in range(3):
        llm.engine.add_request(f"request {i} asks", SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    llm.engine.step()  # prefills
    llm.engine.step()  # the first decode step, through the graphs' static path
    replays = graphs.replays
    ops = decode_step_ops(llm.engine)
    assert graphs.replays == replays and llm.engine.runner.decode_graphs is graphs
    assert 0 < ops["kernels_per_layer"] <= 21
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    assert graphs.replays > replays  # the later steps replay again
    llm.engine.block_manager.free([scratch])
    assert_no_leaks(llm)
