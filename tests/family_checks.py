"""Checks every model family passes through the engine, shared by tests/test_qwen2_5_vl.py and tests/test_qwen3_vl.py:
transformers' greedy tokens under given engine settings, each lever against the dense reference, the chat CLI, and
the split roles against the integrated server."""

import io
import os

import httpx
import torch

from helpers import (assert_engine_matches_reference, assert_no_leaks, chat_prompt, data_url, hf_inputs, random_image,
                     random_workload)
from nanomm import LLM, SamplingParams
from nanomm.accel.quant import QuantizedLinear
from nanomm.inputs.image import ImageProcessorConfig, preprocess_image
from nanomm.inputs.tokenizer import Tokenizer
from nanomm.reference import generate
from nanomm.serve.app import Server, ServerConfig
from nanomm.serve.encoder_server import EncoderServer, load_encoder
from nanomm.serve.router import Router
from nanomm.serve.testing import BackgroundServer
from test_engine import record_logit_rows
from test_model_parity import LOGITS_ATOL, oracle_greedy, steps_fed_the_same_tokens

LEVERS = {
    "compression-attention": dict(visual_token_compression={"method": "attention", "keep_ratio": 0.5}),
    "compression-pool": dict(visual_token_compression={"method": "pool", "keep_ratio": 0.25}),
    "compression-prune": dict(visual_token_compression={"method": "prune", "keep_ratio": 0.5}),
    "fp8-kv": dict(kv_cache_dtype="fp8"),
    "int8-weights-kernel": dict(quantization="int8", quantized_path="kernel"),
    "int8-weights-definition": dict(quantization="int8", quantized_path="definition"),
    "int4-weights-kernel": dict(quantization="int4", quantization_group_size=32, quantized_path="kernel"),
    "int4-weights-definition": dict(quantization="int4", quantization_group_size=32, quantized_path="definition"),
    "ngram-speculation": dict(speculative={"method": "ngram", "num_speculative_tokens": 3}),
    "encoder-cache-only": dict(enable_prefix_caching=False, max_num_batched_tokens=16),
}


def engine_gives_transformers_tokens(folder, oracle, prompts, num_tokens: int, max_pixels: int,
                                     num_logprobs: int | None = None, **settings) -> dict:
    """Every prompt through the engine at once, twice (the second pass hits the prefix cache); each answer must be
    transformers' greedy answer up to a near-tie, and every comparable step's logits must be transformers' within
    LOGITS_ATOL. The engine shows its logits as logprobs: log_softmax, which is the logits up to one constant a
    row, the part sampling never sees; over the whole vocabulary, or its num_logprobs most likely tokens (a real
    vocabulary's 151,936 a step would be slow to compare in Python). Returns the engine's stats."""
    with LLM(str(folder), device="cpu", dtype="float32", max_pixels=max_pixels, num_preprocess_workers=0,
             **settings) as llm:
        num_logprobs = num_logprobs or llm.model.config.text.vocab_size
        params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True, logprobs=num_logprobs)
        for _ in range(2):
            for prompt, out in zip(prompts, llm.generate(prompts, params)):
                prepared = llm.engine.prepare(prompt, params)
                tokens, logits = oracle_greedy(oracle, hf_inputs(prepared.token_ids, prepared.images,
                                                                 llm.model.config.image_token_id), num_tokens)
                got = out.outputs[0].token_ids
                comparable = steps_fed_the_same_tokens(got, tokens, logits)
                assert got[:comparable] == tokens[:comparable]
                for step in range(comparable):
                    assert_logprobs_match(out.outputs[0].logprobs[step], logits[step], step, num_logprobs)
        return llm.stats()


def assert_logprobs_match(engine_row: dict, oracle_logits: torch.Tensor, step: int, num_logprobs: int) -> None:
    """The engine's logprobs for num_logprobs tokens or more (its top ones, and the token it chose) equal
    log_softmax of transformers' logits."""
    assert len(engine_row) >= num_logprobs, f"step {step}: logprobs for {len(engine_row)} tokens"
    tokens = list(engine_row)
    ours = torch.tensor([engine_row[token].logprob for token in tokens], dtype=torch.float64)
    diff = (ours - torch.log_softmax(oracle_logits.double(), dim=-1)[tokens]).abs().max().item()
    assert diff <= LOGITS_ATOL, f"step {step}: logprobs differ from transformers' by {diff}"


def lever_matches_reference(folder, lever: str, max_pixels: int, monkeypatch) -> None:
    """A mixed workload (greedy and seeded) with one lever on equals the dense reference, and again from the caches.
    A quantized lever runs the path it names; it and the fp8 cache round to a few bits, and are held to what such
    a lever promises in a mixed batch (`assert_quantized_engine_tracks_reference`)."""
    settings = dict(LEVERS[lever])
    path = settings.pop("quantized_path", None)
    if path:
        force_quantized_path(monkeypatch, path)
    rounds = path or settings.get("kv_cache_dtype") == "fp8"  # fp8 keys and values round as int8 weights do
    compare = assert_quantized_engine_tracks_reference if rounds else assert_engine_matches_reference
    with LLM(str(folder), device="cpu", dtype="float32", max_pixels=max_pixels, num_preprocess_workers=0,
             **settings) as llm:
        prompts = random_workload(seed=3, num_prompts=6)
        params = [SamplingParams(temperature=0.0 if i % 2 or "speculation" in lever else 0.8, top_k=40, seed=i,
                                 max_tokens=4 + 3 * (i % 4), ignore_eos=True) for i in range(len(prompts))]
        compare(llm, prompts, params)
        compare(llm, prompts[:3], params[:3])
        stats = llm.stats()
        hits = stats["encoder_cache_hits"] if lever == "encoder-cache-only" else stats["prefix_cache_hit_tokens"]
        assert hits > 0


# The most a quantized engine's logit moves from the reference's in a mixed batch, where a last-bit float32
# difference meets the layers' bfloat16 rounding: up to 0.0625 seen on an Intel Xeon (AMX; the int4 kernel path),
# 0.05 on an AMD EPYC (Zen 4). A wrong quantization moves the logits far more.
QUANTIZED_LOGITS_ATOL = 0.08


def assert_quantized_engine_tracks_reference(llm, prompts, params_list) -> int:
    """A mixed batch through a quantized engine against the dense reference that runs the same quantized layers.

    Where the engine's float32 work differs from the reference's in its last bit (pictures of several prompts
    encoded in one forward, a prefix from the cache, keys padded to a longer sequence's: which shapes do that
    depends on the CPU's BLAS), the layers' bfloat16 rounding makes it visible, and a seeded draw may land on
    another token. What holds on every CPU, and is checked:
    - every logits row the engine samples from is within QUANTIZED_LOGITS_ATOL of the reference's;
    - wherever a row is the reference's bit for bit, the token drawn from it is the reference's;
    - a request is followed up to its first differing token (past it, the two histories differ).
    Returns how many rows were the reference's bit for bit. A request alone gets them all
    (`quantized_alone_matches_reference`)."""
    rows = record_logit_rows(llm)
    exact = 0
    for i, (prompt, params, out) in enumerate(zip(prompts, params_list, llm.generate(prompts, params_list))):
        prepared = llm.engine.prepare(prompt, params)
        reference = generate(llm.model, prepared.token_ids, prepared.images, params, llm.tokenizer.eos_token_ids,
                             keep_logits=True, kv_cache_dtype=llm.engine.config.kv_cache_dtype)
        ours = out.outputs[0].token_ids
        for step, (row, reference_row) in enumerate(zip(rows[out.request_id], reference.logits)):
            torch.testing.assert_close(row, reference_row, atol=QUANTIZED_LOGITS_ATOL, rtol=0)
            if torch.equal(row, reference_row):
                exact += 1
                assert ours[step] == reference.token_ids[step], f"prompt {i}, step {step}: the reference's logits, " \
                                                                f"another token"
            elif ours[step] != reference.token_ids[step]:
                break
        else:
            assert ours == reference.token_ids, f"prompt {i} differs"
    assert_no_leaks(llm)
    return exact


QUANTIZED_PATHS = ("kernel", "definition")


def force_quantized_path(monkeypatch, path: str) -> None:
    """Make every quantized layer built from now on take `path`: "kernel" is what the probe chooses (torch's
    kernel wherever it runs and accepts the shape); "definition" never tries the kernel (dequantize-then-multiply)."""
    assert path in QUANTIZED_PATHS
    if path == "definition":
        monkeypatch.setattr(QuantizedLinear, "_try_kernel", lambda self, probe_rows=3: None)


def kernel_layers(llm) -> tuple[int, int]:
    """(layers on torch's kernel, quantized layers) of an LLM's model."""
    layers = [m for m in llm.model.modules() if isinstance(m, QuantizedLinear)]
    return sum(layer.uses_kernel for layer in layers), len(layers)


ROUNDING_LEVERS = {"int8": dict(quantization="int8"), "int4": dict(quantization="int4"),
                   "fp8-kv": dict(kv_cache_dtype="fp8")}
# (lever, path) of the alone tests: the weights on either path; an fp8 cache has no quantized layer to force
ALONE_CASES = [(lever, path) for lever in ("int8", "int4") for path in QUANTIZED_PATHS] + [("fp8-kv", "kernel")]


def quantized_alone_matches_reference(folder, method: str, path: str, max_pixels: int, monkeypatch) -> None:
    """Each prompt of a mixed workload alone in an engine with a rounding lever (ROUNDING_LEVERS; no prefix cache,
    so every step's tensors have the reference's shapes), greedy and seeded: every logits row it samples from is
    the dense reference's, bit for bit, so every draw is too. On every CPU: the two run the same kernels on the
    same tensors, quantized layers on the path forced here (the kernel: on every layer whose shape it accepts; or
    the definition)."""
    force_quantized_path(monkeypatch, path)
    with LLM(str(folder), device="cpu", dtype="float32", max_pixels=max_pixels, num_preprocess_workers=0,
             quantization_group_size=32, enable_prefix_caching=False, **ROUNDING_LEVERS[method]) as llm:
        on_kernel, total = kernel_layers(llm)
        if total:  # quantized weights: the path forced is the path taken
            assert (on_kernel > 0) if path == "kernel" else (on_kernel == 0), f"{on_kernel} of {total} on the kernel"
        rows = record_logit_rows(llm)
        for i, prompt in enumerate(random_workload(seed=3, num_prompts=6)):
            params = SamplingParams(temperature=0.0 if i % 2 else 0.8, top_k=40, seed=i, max_tokens=4 + 3 * (i % 4),
                                    ignore_eos=True)
            out = llm.generate([prompt], params, use_tqdm=False)[0]
            prepared = llm.engine.prepare(prompt, params)
            reference = generate(llm.model, prepared.token_ids, prepared.images, params, keep_logits=True,
                                 kv_cache_dtype=llm.engine.config.kv_cache_dtype)
            assert out.outputs[0].token_ids == reference.token_ids, f"prompt {i} differs ({on_kernel}/{total} kernel)"
            for step, (ours, theirs) in enumerate(zip(rows[out.request_id], reference.logits, strict=True)):
                assert torch.equal(ours, theirs), f"prompt {i}, step {step}: logits differ by " \
                                                  f"{float((ours - theirs).abs().max())}"


def chat_cli_answers_as_the_engine(folder, tmp_path) -> None:
    """`nanomm-chat --model FOLDER` (greedy by default) answers about a picture as `LLM.chat` does, on one line."""
    from test_chat import chat
    picture = tmp_path / "p.png"
    random_image(300, 200, 1).save(picture)
    rc, replies, err = chat(["--model", str(folder), "--image", str(picture), "--max-tokens", "5"], "Describe it\n",
                            {**os.environ, "HF_HUB_OFFLINE": "1"}, tmp_path)
    assert rc == 0, err
    with LLM(str(folder), device="cpu", dtype="float32") as llm:
        expected = llm.chat([{"role": "user", "content": [{"type": "image", "image": str(picture)},
                                                          {"type": "text", "text": "Describe it"}]}],
                            SamplingParams(temperature=0.0, max_tokens=5))[0].outputs[0].text
    assert expected.strip() and replies == [" ".join(expected.splitlines())]


def split_and_integrated_answers(folder, max_pixels: int) -> tuple[dict, dict, str, str]:
    """One greedy chat about a picture, to an integrated server and to encoder + prefill + decode behind a router:
    (integrated answer, split answer, the encoder's /metrics, the prefill instance's /metrics)."""
    picture = random_image(300, 200, 2)
    buffer = io.BytesIO()
    picture.save(buffer, "PNG")
    chat = {"model": "m", "max_tokens": 8, "temperature": 0.0, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(buffer.getvalue())}},
        {"type": "text", "text": "what is it"}]}]}
    kwargs = dict(device="cpu", dtype="float32", max_pixels=max_pixels, num_preprocess_workers=0)
    with BackgroundServer(EncoderServer(load_encoder(str(folder), max_pixels=max_pixels), "m")) as encoder_url, \
            BackgroundServer(Server(LLM(str(folder), **kwargs), ServerConfig("m"))) as whole_url, \
            BackgroundServer(Server(LLM(str(folder), encoder_url=encoder_url, **kwargs),
                                    ServerConfig("m", role="prefill", encoder_urls=(encoder_url,)))) as prefill_url, \
            BackgroundServer(Server(LLM(str(folder), **kwargs), ServerConfig("m", role="decode"))) as decode_url, \
            BackgroundServer(Router([encoder_url], [prefill_url], [decode_url])) as router_url:
        whole = httpx.post(whole_url + "/v1/chat/completions", json=chat, timeout=120).json()
        split = httpx.post(router_url + "/v1/chat/completions", json=chat, timeout=120).json()
        return whole, split, httpx.get(encoder_url + "/metrics").text, httpx.get(prefill_url + "/metrics").text


def metric(text: str, prefix: str) -> float:
    """The value of the one sample line of a /metrics text that starts with prefix."""
    (line,) = [line for line in text.splitlines() if line.startswith(prefix)]
    return float(line.split()[-1])


def expanded_prompt(folder, pictures: list, max_pixels: int):
    """A chat about the pictures, rendered, tokenized and expanded: (token ids, ProcessedImages)."""
    tokenizer = Tokenizer.from_pretrained(folder)
    config = ImageProcessorConfig.from_pretrained(folder)
    text, found = tokenizer.apply_chat_template([{"role": "user", "content": [
        *({"type": "image", "image": im} for im in pictures), {"type": "text", "text": "Describe, then count."}]}])
    processed = [preprocess_image(im, config, max_pixels=max_pixels) for im in found]
    return tokenizer.expand_image_placeholders(tokenizer.encode(text), [p.num_tokens for p in processed]), processed


def reference_matches_transformers(model, oracle, ids, processed, num_tokens: int) -> int:
    """nanomm's dense reference on `model` against transformers' greedy generation from the same prompt: every
    step's logits within LOGITS_ATOL up to the first near-tie. Returns how many steps were compared."""
    params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
    result = generate(model, ids, processed, params, keep_logits=True)
    tokens, logits = oracle_greedy(oracle, hf_inputs(ids, processed, model.config.image_token_id), num_tokens)
    comparable = steps_fed_the_same_tokens(result.token_ids, tokens, logits)
    diffs = [(a - b).abs().max().item() for a, b in zip(result.logits[:comparable], logits)]
    assert max(diffs) <= LOGITS_ATOL, diffs
    assert logits[0].std() > 0.05, "random weights too small to make the comparison meaningful"
    return comparable


def real_width_cut_matches_transformers(folder, model, oracle_class, pictures, max_pixels: int, tight: dict) -> None:
    """A checkpoint of a real model's widths and vocabulary with its depth cut (`model` loaded from it): the dense
    reference against transformers, then the engine under default and `tight` settings, on the real vocabulary's
    20 most likely tokens a step. pictures(n): n pictures."""
    oracle = oracle_class.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    ids, processed = expanded_prompt(folder, pictures(1), max_pixels)
    assert reference_matches_transformers(model, oracle, ids, processed, 4) >= 2
    prompts = [chat_prompt("Describe, then count.", pictures(n)) for n in (0, 1)]
    for settings in ({}, tight):
        engine_gives_transformers_tokens(folder, oracle, prompts, 4, max_pixels, num_logprobs=20, **settings)


def static_decode_matches_reference(folder, max_pixels: int) -> None:
    """The padded, static decode path that CUDA graphs record (run here without recording: a CPU has no graphs)
    gives the dense reference's tokens, greedy and seeded, batches padded to their bucket."""
    from test_cuda_graphs import assert_static_decode_matches_reference
    with LLM(str(folder), device="cpu", dtype="float32", max_pixels=max_pixels) as llm:
        assert_static_decode_matches_reference(llm)
