"""Count the tensor operations a piece of code runs: how many kernels a decode step launches, and whether it
waits on the host.

Tooling outside the request path: `scripts/bench.py` prints the count per layer of a decode step, and
tests/test_op_count.py holds the engine to it. Issue 12's target is a decode step that launches few kernels
per layer, whatever the batch size, and that never syncs with the host (what a CUDA graph needs).

    with OpCounter() as ops:
        engine.step()
    ops.kernels, ops.host_syncs, ops.counts.most_common(10)

`python -m nanomm.workshop.op_count` prints how a step's operations grow with the requests in it, on the demo
model: a prefill step of 1 and of 8 pictured requests (batched, and attended one sequence at a time, the
definition), a decode step of 1 and of 32 sampled requests (BENCHMARKS.md, "Operations per step").

It is a `TorchDispatchMode`: every ATen operation passes through `__torch_dispatch__`. Under inference mode (the
engine's steps) a composite operation reaches it whole, before it is broken into others: `linear`,
`scaled_dot_product_attention` and `rms_norm` count as one each. On CUDA `linear` is a matmul, and the other two
are one fused kernel each (aten._fused_rms_norm, a fused attention kernel); on a CPU `rms_norm` runs as eight
operations. The profiler (gpu_check.sh's profile stage) counts what a GPU really launches. Operations that only
make a new view of the same memory (view, permute, slicing...) launch nothing and are not counted as kernels,
nor is a `to` that returns its input unchanged. A `reshape` (or `to`) that had to copy is counted, as
"reshape (copy)": the result's memory is compared with the input's.
"""

import contextlib
from collections import Counter

import torch
from PIL import Image
from torch.utils._python_dispatch import TorchDispatchMode

from nanomm import LLM, SamplingParams
from nanomm.demo import demo_checkpoint
from nanomm.inputs.tokenizer import IMAGE_PLACEHOLDER

VIEWS = {"view", "_unsafe_view", "reshape", "permute", "transpose", "expand", "slice", "select", "unsqueeze",
         "squeeze", "t", "split", "split_with_sizes", "unbind", "as_strided", "detach", "alias", "lift_fresh",
         "_reshape_alias", "view_as", "expand_as", "narrow", "chunk"}
MAYBE_COPIES = {"reshape", "to", "flatten", "contiguous"}  # a view (or nothing) when they can, a copy otherwise
HOST_SYNCS = {"_local_scalar_dense", "nonzero", "item", "equal", "is_nonzero"}  # they read a value back to Python


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts: Counter = Counter()
        self.counting = True  # `counting_only_inside` switches it off outside some modules

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.counting:
            name = func.overloadpacket.__name__
            if name in MAYBE_COPIES and not _same_memory(out, args[0]):
                name += " (copy)"
            self.counts[name] += 1
        return out

    @property
    def kernels(self) -> int:
        """Operations that compute or copy something (views excluded)."""
        return sum(n for name, n in self.counts.items() if name not in VIEWS and name not in MAYBE_COPIES)

    @property
    def host_syncs(self) -> int:
        return sum(self.counts[name] for name in HOST_SYNCS)


class HostSyncError(RuntimeError):
    """Raised by `NoHostSync`: the code read a device value back to the host."""


class NoHostSync(TorchDispatchMode):
    """Raise on anything that makes the host wait for a value on the device: `.item()`, `int(t)`, `bool(t)`,
    `nonzero`, boolean-mask indexing (its result's size is a device value), and `.tolist()` (which bypasses
    the dispatcher, so it is patched for the duration). This is what a CUDA graph cannot record; on a CPU it
    checks the region before a GPU ever runs it (nanomm/engine/cuda_graphs.py)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in HOST_SYNCS or (name in ("index", "index_put", "index_put_") and _has_bool_index(args)):
            raise HostSyncError(f"aten.{name} reads a device value back to the host")
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        self._tolist = torch.Tensor.tolist

        def tolist(tensor):
            raise HostSyncError("Tensor.tolist reads a device value back to the host")

        torch.Tensor.tolist = tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)


def _has_bool_index(args) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ())


def _same_memory(out, source) -> bool:
    return isinstance(out, torch.Tensor) and isinstance(source, torch.Tensor) and \
        out.untyped_storage().data_ptr() == source.untyped_storage().data_ptr()


@contextlib.contextmanager
def counting_only_inside(counter: OpCounter, modules):
    """Count only while one of `modules` runs its forward (forward hooks switch the counter on and off)."""
    counter.counting = False
    handles = []
    for module in modules:
        handles.append(module.register_forward_pre_hook(lambda *_: setattr(counter, "counting", True)))
        handles.append(module.register_forward_hook(lambda *_: setattr(counter, "counting", False)))
    try:
        yield counter
    finally:
        for handle in handles:
            handle.remove()
        counter.counting = True


@contextlib.contextmanager
def eager_steps(engine):
    """The engine's steps without CUDA graphs while inside: a graph's replay would show none of its kernels."""
    runner = engine.runner
    graphs, runner.decode_graphs = runner.decode_graphs, None
    try:
        yield
    finally:
        runner.decode_graphs = graphs


def decode_step_ops(engine) -> dict:
    """Operations of the engine's next step (call it when every running request is decoding): in the whole
    step, per decoder layer, and the host syncs inside the decoder layers. The step runs eagerly: a CUDA graph's
    replay would show none of the kernels it launches."""
    layers = engine.model.language_model.layers
    with eager_steps(engine), OpCounter() as whole:
        with OpCounter() as inside, counting_only_inside(inside, layers):
            batch = len(engine.scheduler.running)
            engine.step()
    # The inner mode sees each op first and passes it on, so the outer one counts the whole step.
    return {"batch": batch, "step_kernels": whole.kernels, "kernels_per_layer": inside.kernels / len(layers),
            "host_syncs_in_layers": inside.host_syncs, "top_ops_per_layer": {
                name: n / len(layers) for name, n in inside.counts.most_common() if name not in VIEWS | MAYBE_COPIES}}


def step_ops(engine) -> OpCounter:
    """Every operation the engine's next step dispatches, run eagerly."""
    with eager_steps(engine), OpCounter() as ops:
        engine.step()
    return ops


def _picture(seed: int) -> Image.Image:
    pixels = torch.randint(0, 256, (224, 224, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    return Image.frombytes("RGB", (224, 224), pixels.numpy().tobytes())


def demo_prefill_ops(num_requests: int, batched_attention: bool = True) -> OpCounter:
    """The demo model's step that prefills num_requests chats, each about its own 224x224 picture, in full."""
    with LLM(str(demo_checkpoint()), num_kv_blocks=1024, max_num_batched_tokens=4096,
             num_preprocess_workers=0) as llm:
        llm.engine.runner.batched_attention = batched_attention
        for i in range(num_requests):
            prompt = (f"<|im_start|>user\n{IMAGE_PLACEHOLDER}What colour is shape {i}?<|im_end|>\n"
                      "<|im_start|>assistant\n")
            llm.engine.add_request({"prompt": prompt, "multi_modal_data": {"image": [_picture(50 + i)]}},
                                   SamplingParams(max_tokens=2, ignore_eos=True))
        ops = step_ops(llm.engine)
        running = llm.engine.scheduler.running
        assert len(running) == num_requests and all(r.num_computed_tokens == r.num_prompt_tokens for r in running)
    return ops


def demo_decode_ops(num_requests: int) -> OpCounter:
    """The demo model's decode step of num_requests sampled requests, each with its own seed."""
    with LLM(str(demo_checkpoint()), num_kv_blocks=1024, num_preprocess_workers=0) as llm:
        for i in range(num_requests):
            llm.engine.add_request(f"request {i} asks a question",
                                   SamplingParams(temperature=0.8, seed=i, max_tokens=4, ignore_eos=True))
        llm.engine.step()  # the prefills
        llm.engine.step()  # the first decode: every request now decodes
        assert len(llm.engine.scheduler.running) == num_requests
        return step_ops(llm.engine)


def total_ops(ops: OpCounter) -> int:
    """Every operation dispatched, views included."""
    return sum(ops.counts.values())


def main() -> None:
    rows = [("prefill, batched", demo_prefill_ops(1), demo_prefill_ops(8), 8),
            ("prefill, one sequence at a time", demo_prefill_ops(1, False), demo_prefill_ops(8, False), 8),
            ("decode, sampled", demo_decode_ops(1), demo_decode_ops(32), 32)]
    print("| step | ops with 1 request | with N | N | ratio | kernels with 1 | with N | ratio |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, one, many, n in rows:
        print(f"| {name} | {total_ops(one):,} | {total_ops(many):,} | {n} | {total_ops(many) / total_ops(one):.2f} | "
              f"{one.kernels:,} | {many.kernels:,} | {many.kernels / one.kernels:.2f} |")


if __name__ == "__main__":
    torch.set_num_threads(2)
    main()
