"""CUDA graphs for decode steps: record a step's kernels once, then replay them all with one launch.

Lesson: lessons/A3-cpu-kernels.md (where a decode step's time goes).

A decode step of a 2B model reads ~3 GB of weights: well under a millisecond of an H200's bandwidth. Launched
one by one from Python, its ~21 kernels per layer x 28 layers cost more than that in CPU time alone, and the
GPU waits for them. A CUDA graph records the kernels of one call, with their arguments, and replays them all
from one launch. The price is that everything must stay still between replays:

- **Shapes.** A graph holds one batch size and one context length. Steps are padded up to a bucket: the batch
  to one of `BATCH_BUCKETS`, the longest context to a power of two of blocks (at most max_model_len). One graph
  is recorded per (batch, context) bucket the first time it is needed, and kept. A step whose longest context
  is past `max_seq_len_to_capture` (8,192 by default, as in vLLM) runs eagerly: its graph would keep a
  batch x context gather per layer for good.
- **Memory.** The graphs share one memory pool, which keeps what the largest recorded step needed (at the
  largest bucket, each layer's gathered context: batch x context keys and values). The largest bucket is
  recorded first, so that the smaller ones fit in the memory it leaves (recorded smallest first, each larger
  step would add its own). Their logits go to one static buffer of the largest batch, so that the kept graphs
  do not each keep a (batch, vocab) output. The KV pool is sized after a profiling pass that runs the largest
  bucket's step (engine/memory_profile.py).
- **Addresses.** Inputs are copied into the same static buffers before every replay (one host-to-device copy:
  they are views of the front of one flat buffer, which every bucket shares). The KV cache never moves.
- **Padding.** Padding rows are decodes of token 0 that write their key and value to a scratch slot, one block
  past the pool that the block manager never hands out, and attend only to it. Real rows' padded context
  positions point there too, and the mask hides them.
- **No host syncs.** Nothing inside may read a value back to the host (`.item()`, `.tolist()`, `nonzero`,
  boolean indexing): a recording cannot wait for the GPU. `decode_forward` is that region; on a CPU,
  tests/test_cuda_graphs.py runs it under `NoHostSync` (scripts/workshop/op_count.py), which raises on any of them.

Only steps in which every chunk decodes one token go through a graph (prefills, speculative verifications,
prompt logprobs run eagerly). On by default on CUDA; `LLM(enforce_eager=True)` (vLLM's switch) turns it off.
On a CPU the same static path runs without recording (`capture=False`), which is how the tests check it.
"""

import contextlib
from dataclasses import dataclass

import torch

from nanomm.accel.batched_attention import DecodeBatch
from nanomm.engine.attention import PagedAttention, StepMetadata
from nanomm.engine.kv_fp8 import Fp8KVCache
from nanomm.engine.model_runner import packed_positions, padded_context_slots
from nanomm.engine.scheduler import ScheduledChunk
from nanomm.engine.sizing import batch_bucket, context_bucket, largest_bucket
from nanomm.model.qwen2_vl import Qwen2VL

@dataclass
class StaticDecodeInputs:
    """A decode step's inputs, at fixed addresses: views of one flat int64 buffer."""
    flat: torch.Tensor  # everything below, back to back
    input_ids: torch.Tensor  # (B,)
    positions: torch.Tensor  # (3, B)
    slot_mapping: torch.Tensor  # (B,) where each new key and value is written
    context_slots: torch.Tensor  # (B, L) the slots each row attends to
    last_visible: torch.Tensor  # (B, 1) the last context position each row sees
    query_rows: torch.Tensor  # (B, 1) 0..B-1: decodes in packed order (never changes)

    @staticmethod
    def sizes(batch: int, length: int) -> list[int]:
        """Elements of each field, in the flat buffer's order."""
        return [batch, 3 * batch, batch, batch * length, batch, batch]

    @classmethod
    def allocate(cls, batch: int, length: int, device, shared: torch.Tensor | None = None) -> "StaticDecodeInputs":
        """New buffers, or views of the front of `shared` (rewritten whole before every replay: buckets may share)."""
        sizes = cls.sizes(batch, length)
        if shared is None:
            flat = torch.zeros(sum(sizes), dtype=torch.long, device=device)
        else:
            flat = shared[:sum(sizes)]
        ids, positions, slots, context, last, rows = flat.split(sizes)
        rows.copy_(torch.arange(batch))
        return cls(flat, ids, positions.view(3, batch), slots, context.view(batch, length), last.view(batch, 1),
                   rows.view(batch, 1))

    def host_values(self, chunks: list[ScheduledChunk], block_size: int, scratch_slot: int) -> torch.Tensor:
        """The flat buffer's next contents, built on the host: the chunks' rows, then padding rows (token 0 at
        position 0, writing and reading only the scratch slot). A decode's new token sits at position end - 1."""
        batch, length = self.context_slots.shape
        n = len(chunks)
        ids, positions = torch.zeros(batch, dtype=torch.long), torch.zeros(3, batch, dtype=torch.long)
        slots, last = torch.full((batch,), scratch_slot), torch.zeros(batch, dtype=torch.long)
        context = torch.full((batch, length), scratch_slot)
        if chunks:  # the runner's own builders (model_runner.py) for slots and positions, then padding
            ends = torch.tensor([c.end for c in chunks])
            real = padded_context_slots([c.request.block_table for c in chunks], ends.tolist(), block_size)
            # What build_decode_batch derives for one query per row, in three host ops: this path exists to
            # save host time. Past a row's context: the scratch slot.
            visible = torch.arange(real.shape[1]) < ends[:, None]
            context[:n, :real.shape[1]] = torch.where(visible, real, scratch_slot)
            ids[:n] = torch.tensor([c.token_ids[0] for c in chunks])
            positions[:, :n] = packed_positions(chunks)
            slots[:n], last[:n] = real[torch.arange(n), ends - 1], ends - 1
        return torch.cat([ids, positions.flatten(), slots, context.flatten(), last, torch.arange(batch)])


def decode_forward(model: Qwen2VL, kv_cache: "torch.Tensor | Fp8KVCache", inputs: StaticDecodeInputs) -> torch.Tensor:
    """One decode step from the static inputs -> logits (B, vocab). This is what a graph records: it reads
    only `inputs` and the cache, and reads nothing back to the host."""
    short = DecodeBatch(inputs.query_rows, inputs.context_slots, inputs.last_visible, valid_index=None,
                         dest_rows=inputs.query_rows.flatten(), rows_in_place=True)
    no_slots = inputs.flat[:0]  # no sequence is attended alone
    meta = StepMetadata(inputs.slot_mapping, no_slots, [], short)
    attention = PagedAttention(kv_cache, meta, model.config.text.num_attention_heads)
    hidden = model(inputs.input_ids, inputs.positions, attention)  # (B, hidden)
    return model.compute_logits(hidden)


@dataclass
class _CapturedGraph:
    inputs: StaticDecodeInputs
    graph: "torch.cuda.CUDAGraph | None"


class DecodeGraphs:
    """Runs pure decode steps through one recorded graph per (batch, context) bucket."""

    def __init__(self, model: Qwen2VL, kv_cache: "torch.Tensor | Fp8KVCache", block_size: int, scratch_slot: int,
                 max_batch: int, max_context: int, capture: bool = True):
        """capture=False runs the same static, padded path without recording (on a CPU, for tests)."""
        self.model, self.kv_cache, self.block_size, self.scratch_slot = model, kv_cache, block_size, scratch_slot
        self.largest = largest_bucket(max_batch, max_context, block_size)
        self.max_batch, self.max_context, self.capture = self.largest[0], max_context, capture
        # Shared by every bucket: its inputs (the front of one buffer) and its logits (rows 0..batch-1), both
        # rewritten by each step and read before the next one replays (on the same stream).
        self.flat_inputs = torch.zeros(sum(StaticDecodeInputs.sizes(*self.largest)), dtype=torch.long,
                                       device=kv_cache.device)
        self.logits = torch.empty(self.max_batch, model.config.text.vocab_size, dtype=torch.float32,
                                  device=kv_cache.device)
        self.recorded: dict[tuple[int, int], _CapturedGraph] = {}
        self.pool = None  # recorded graphs share one memory pool
        self.replays = 0

    def eligible(self, chunks: list[ScheduledChunk]) -> bool:
        """Every chunk decodes one token (no prompt position, no proposals), and the step fits a bucket."""
        return bool(chunks) and len(chunks) <= self.max_batch and all(
            c.num_tokens == 1 and not c.spec_token_ids and c.start >= c.request.num_prompt_tokens
            and c.samples_next_token and c.end <= self.max_context for c in chunks)

    def run(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """Logits (len(chunks), vocab) of an eligible step."""
        key = (batch_bucket(len(chunks)), context_bucket(max(c.end for c in chunks), self.block_size, self.max_context))
        with _on_device(self.kv_cache.device):  # streams and graphs belong to the current GPU: make it the model's
            if self.capture and not self.recorded and key != self.largest:
                self._record(*self.largest)  # first, so that the pool is the largest step's (module docstring)
            recorded = self.recorded.get(key) or self._record(*key)
            values = recorded.inputs.host_values(chunks, self.block_size, self.scratch_slot)
            if recorded.inputs.flat.device.type == "cuda":
                values = values.pin_memory()
            recorded.inputs.flat.copy_(values, non_blocking=True)
            self.replays += 1
            if recorded.graph is None:
                self._step(recorded.inputs)
            else:
                recorded.graph.replay()
            return self.logits[:len(chunks)]

    def _step(self, inputs: StaticDecodeInputs) -> None:
        """What a graph records: the step, its logits copied into the shared buffer."""
        self.logits[:inputs.input_ids.shape[0]].copy_(decode_forward(self.model, self.kv_cache, inputs))

    def _record(self, batch: int, length: int) -> _CapturedGraph:
        inputs = StaticDecodeInputs.allocate(batch, length, self.kv_cache.device, shared=self.flat_inputs)
        padding = inputs.host_values([], self.block_size, self.scratch_slot)  # every row writes the scratch slot
        inputs.flat.copy_(padding)
        graph = None
        if self.capture:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up outside the recording: lazy initialisations, allocations
                for _ in range(2):
                    self._step(inputs)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):  # the step's temporaries: freed, reusable by the next
                self._step(inputs)
            self.pool = graph.pool()
        self.recorded[(batch, length)] = _CapturedGraph(inputs, graph)
        return self.recorded[(batch, length)]


def _on_device(device: torch.device):
    """`torch.cuda.device(device)` for a GPU (a model on cuda:1 must record and replay on cuda:1's streams, not the
    current device's); nothing on a CPU."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
