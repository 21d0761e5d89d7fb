"""Workloads and oracles shared by the engine tests."""

import base64
import random
import struct
import zlib

import torch
from PIL import Image

from nanomm import SamplingParams
from nanomm.reference import generate as reference_generate
from nanomm.inputs.tokenizer import IMAGE_PLACEHOLDER

WORDS = "the a cat dog sat on mat and looked at picture of red blue green house tree sky".split()


def random_image(width: int, height: int, seed: int) -> Image.Image:
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), dtype=torch.uint8, generator=g)
    return Image.frombytes("RGB", (width, height), pixels.numpy().tobytes())


def chat_prompt(text: str, images=()) -> dict | str:
    """A Qwen2-VL user turn with the images first, as the chat template renders it."""
    body = IMAGE_PLACEHOLDER * len(images) + text
    prompt = f"<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n{body}<|im_end|>\n" \
             f"<|im_start|>assistant\n"
    return {"prompt": prompt, "multi_modal_data": {"image": list(images)}} if images else prompt


def random_workload(seed: int, num_prompts: int, max_images: int = 3):
    """Prompts with 0..max_images images of varied sizes and varied text lengths."""
    rng = random.Random(seed)
    prompts = []
    for i in range(num_prompts):
        images = [random_image(rng.randrange(28, 120), rng.randrange(28, 120), seed * 1000 + i * 10 + j)
                  for j in range(rng.randrange(0, max_images + 1))]
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randrange(1, 40)))
        prompts.append(chat_prompt(text, images))
    return prompts


def reference_tokens(llm, prompt, params) -> list[int]:
    """What the dense reference generates for this prompt: the engine's oracle."""
    prepared = llm.engine.prepare(prompt, params)
    return reference_generate(llm.model, prepared.token_ids, prepared.images, params, llm.tokenizer.eos_token_ids,
                              kv_cache_dtype=llm.engine.config.kv_cache_dtype).token_ids


def run_to_completion(engine, max_steps: int = 500) -> dict:
    """Step until every request finished; their final outputs by request id. Bounded: a stuck engine fails."""
    finished = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return finished
        for out in engine.step():
            if out.finished:
                assert out.request_id not in finished, f"request {out.request_id} finished twice"
                finished[out.request_id] = out
    raise AssertionError(f"the engine did not drain in {max_steps} steps")


def assert_no_leaks(llm) -> None:
    """Nothing left behind in an idle engine: no request in flight or queued, every KV block free (the draft
    model's too), no encoder-cache entry held (the draft's cache too). Every engine test ends with this."""
    engine = getattr(llm, "engine", llm)
    assert not engine.has_unfinished_requests() and not engine.requests
    stats = engine.stats()
    assert (stats["running"], stats["waiting"], stats["preprocess_queue"]) == (0, 0, 0), stats
    engine.block_manager.check_no_leaks()
    engine.encoder_cache.check_no_holds()
    if engine.proposer is not None:
        engine.proposer.check_no_leaks()


def assert_engine_matches_reference(llm, prompts, params_list):
    outputs = llm.generate(prompts, params_list)
    for i, (prompt, params, out) in enumerate(zip(prompts, params_list, outputs)):
        assert out.finished
        assert out.outputs[0].token_ids == reference_tokens(llm, prompt, params), f"prompt {i} differs"
    assert_no_leaks(llm)
    return outputs


def assert_mixed_workload_matches(llm, reference_model) -> None:
    """Eight random prompts, half greedy and half seeded sampling, through the engine: each must equal the dense
    reference run on `reference_model` (the engine's own model, or an eager copy of it), token for token."""
    prompts = random_workload(seed=1, num_prompts=8)
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.8, top_k=40, seed=i, max_tokens=4 + 3 * (i % 4),
                             ignore_eos=True) for i in range(8)]
    outputs = llm.generate(prompts, params)
    for i, (prompt, p, out) in enumerate(zip(prompts, params, outputs)):
        prepared = llm.engine.prepare(prompt, p)
        expected = reference_generate(reference_model, prepared.token_ids, prepared.images, p,
                                      llm.tokenizer.eos_token_ids,
                                      kv_cache_dtype=llm.engine.config.kv_cache_dtype).token_ids
        assert out.outputs[0].token_ids == expected, f"prompt {i} differs"
    assert_no_leaks(llm)


def force_first_token(monkeypatch, token_id: int) -> None:
    """Make every request's first generated token `token_id` (the engine samples as usual, then this replaces
    what it chose), to test what happens after a token the model would rarely pick."""
    from nanomm.engine import engine as engine_module
    sample = engine_module.sample_and_verify

    def first_token_forced(chunks, logits):
        emitted = sample(chunks, logits)
        for chunk, e in zip(chunks, emitted):
            if not chunk.request.output_token_ids:
                e.token_ids = [token_id]
        return emitted

    monkeypatch.setattr(engine_module, "sample_and_verify", first_token_forced)


def hf_inputs(ids, processed, image_token_id) -> dict:
    """transformers' generate/forward inputs for an expanded prompt and its ProcessedImages (the oracle's side).
    mm_token_type_ids always: without it transformers silently falls back to 1-D positions."""
    input_ids = torch.tensor([ids])
    inputs = dict(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                  mm_token_type_ids=(input_ids == image_token_id).int())
    if processed:
        inputs["pixel_values"] = torch.cat([p.pixel_values for p in processed])
        inputs["image_grid_thw"] = torch.tensor([list(p.grid_thw) for p in processed])
    return inputs


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64," + base64.b64encode(data).decode()


def png_header_only(width: int, height: int) -> bytes:
    """A tiny PNG whose header claims width x height (1-bit grey): a decompression bomb for a few dozen bytes."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    ihdr = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0\0"))
            + chunk(b"IEND", b""))


# Prepended to a child interpreter's code: any attempt to resolve a host name or open a network connection is
# reported on stderr ("NETWORK ATTEMPT") and refused, so a test can prove that nothing tried to reach the hub.
NO_NETWORK = """
import socket, sys
def _no_network(event, args):
    if event == "socket.getaddrinfo" or (event == "socket.connect" and args[0].family != socket.AF_UNIX):
        sys.stderr.write(f"NETWORK ATTEMPT: {event} {args[:2]!r}\\n")
        raise OSError(f"network access is blocked in this test ({event})")
sys.addaudithook(_no_network)
"""


def forward_without_host_syncs(llm, guard, monkeypatch) -> list:
    """Run every engine forward of `llm`'s model (the step's language-model pass and its logits) inside `guard()`, a
    context that fails on any read of a device value by the host. Returns, per forward, (decoded, prefilled,
    placed visual tokens), so that a test can check a mixed step ran."""
    model, kinds = llm.engine.runner.model, []
    forward, logits = model.forward, model.compute_logits

    def guarded_forward(input_ids, positions, attention, *visual):
        meta = getattr(attention, "meta", None)
        if meta is None:  # the dense reference's forward, on the same model: not the engine's step
            return forward(input_ids, positions, attention, *visual)
        kinds.append((meta.short is not None, meta.prompt_chunks is not None, bool(visual) and visual[0] is not None))
        with guard():
            return forward(input_ids, positions, attention, *visual)

    def guarded_logits(hidden):
        with guard():
            return logits(hidden)

    monkeypatch.setattr(model, "forward", guarded_forward)
    monkeypatch.setattr(model, "compute_logits", guarded_logits)
    return kinds


def assert_mixed_steps_never_sync(llm, guard, monkeypatch) -> None:
    """A mixed workload (greedy and seeded, pictures cut by small chunks when the engine's budget is small) with
    every engine forward inside guard(): the dense reference's tokens, and at least one step that decoded,
    prefilled and placed visual tokens at once."""
    kinds = forward_without_host_syncs(llm, guard, monkeypatch)
    prompts = random_workload(seed=5, num_prompts=6)
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=6, ignore_eos=True)
              for i in range(len(prompts))]
    assert_engine_matches_reference(llm, prompts, params)
    monkeypatch.undo()
    assert (True, True, True) in kinds


def llm_with_norms(monkeypatch, one_kernel_norms: bool, *args, **kwargs):
    """`LLM(*args, **kwargs)`; with one_kernel_norms, its RMSNorms go through `F.rms_norm` on this CPU too: the
    form a GPU takes, one kernel there (accel/fused_layers.py)."""
    from nanomm import LLM
    from nanomm.accel import fused_layers
    if one_kernel_norms:
        monkeypatch.setattr(fused_layers, "ONE_KERNEL_NORM_DEVICES", ("cpu",))  # read when the layers are fused
    return LLM(*args, **kwargs)
