"""Scripts written for vLLM run unchanged: its documented Qwen2-VL offline examples with only the import line
(and the model path) changed, its engine arguments, its generation defaults, and EXIF orientation."""

import io
import json
import shutil

import pytest
import torch
from PIL import Image

from helpers import assert_no_leaks, data_url, random_image, reference_tokens
from nanomm import LLM, InvalidInputError, SamplingParams
from nanomm.inputs.image_io import load_image


def png_bytes(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()


# -- vLLM's examples ----------------------------------------------------------------------------------------

def test_vllm_single_image_example(ckpt):
    """examples/offline_inference/vision_language.py, run_qwen2_vl: engine arguments, prompt string and
    generate call as vLLM's documentation writes them."""
    model_name = str(ckpt)
    image = random_image(180, 120, 1)
    llm = LLM(model=model_name, max_model_len=4096, max_num_seqs=5,
              mm_processor_kwargs={"min_pixels": 28 * 28, "max_pixels": 1280 * 28 * 28},
              limit_mm_per_prompt={"image": 1})
    placeholder = "<|image_pad|>"
    questions = ["What is the content of this image?", "What colour is the sky?"]
    prompts = [("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
                f"<|im_start|>user\n<|vision_start|>{placeholder}<|vision_end|>"
                f"{question}<|im_end|>\n"
                "<|im_start|>assistant\n") for question in questions]
    sampling_params = SamplingParams(temperature=0.2, max_tokens=64, stop_token_ids=None)
    inputs = [{"prompt": prompt, "multi_modal_data": {"image": image}} for prompt in prompts]
    outputs = llm.generate(inputs, sampling_params=sampling_params)
    for o in outputs:
        generated_text = o.outputs[0].text
        # (a trailing incomplete UTF-8 character is held back by the streaming detokenizer, as in vLLM)
        assert llm.tokenizer.decode(o.outputs[0].token_ids, True).startswith(generated_text)
        assert o.finished and 0 < len(o.outputs[0].token_ids) <= 64
    greedy = SamplingParams(temperature=0, max_tokens=16)
    exact = llm.generate(inputs[0], sampling_params=greedy)[0]
    assert exact.outputs[0].token_ids == reference_tokens(llm, inputs[0], greedy)
    with pytest.raises(InvalidInputError, match="image"):  # limit_mm_per_prompt={"image": 1}
        llm.generate({"prompt": prompts[0].replace(placeholder, placeholder + "<|vision_end|><|vision_start|>"
                                                   + placeholder), "multi_modal_data": {"image": [image, image]}})
    assert_no_leaks(llm)


def test_vllm_multi_image_examples(ckpt):
    """examples/offline_inference/vision_language_multi_image.py for Qwen2-VL: the prompt from the tokenizer's
    chat template with image parts, then generate; and chat() with image_url parts."""
    llm = LLM(model=str(ckpt), max_model_len=4096, max_num_seqs=5, limit_mm_per_prompt={"image": 2})
    images = [random_image(84, 56, 2), random_image(56, 84, 3)]
    image_urls = [data_url(png_bytes(im)) for im in images]
    question = "What are the differences between these images?"
    placeholders = [{"type": "image", "image": url} for url in image_urls]
    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": [*placeholders, {"type": "text", "text": question}]}]
    prompt = llm.get_tokenizer().apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    sampling_params = SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=None)
    outputs = llm.generate({"prompt": prompt, "multi_modal_data": {"image": images}},
                           sampling_params=sampling_params)
    chat_outputs = llm.chat([{"role": "user", "content": [
        {"type": "text", "text": question},
        *({"type": "image_url", "image_url": {"url": url}} for url in image_urls)]}],
        sampling_params=sampling_params)
    expected = reference_tokens(llm, {"prompt": prompt, "multi_modal_data": {"image": images}}, sampling_params)
    assert outputs[0].outputs[0].token_ids == expected
    assert outputs[0].metrics.num_visual_tokens == chat_outputs[0].metrics.num_visual_tokens > 0
    assert_no_leaks(llm)


def test_mm_processor_kwargs_per_call(ckpt):
    llm = LLM(model=str(ckpt), mm_processor_kwargs={"max_pixels": 28 * 28 * 64})
    image = random_image(300, 300, 4)
    messages = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "hi"}]}]
    params = SamplingParams(temperature=0, max_tokens=4)
    default = llm.chat(messages, params)[0].metrics.num_visual_tokens
    smaller = llm.chat(messages, params, mm_processor_kwargs={"max_pixels": 28 * 28 * 16})[0]
    prompt = llm.get_tokenizer().apply_chat_template(messages, tokenize=False)
    per_prompt = llm.generate({"prompt": prompt, "multi_modal_data": {"image": image},
                               "mm_processor_kwargs": {"max_pixels": 28 * 28 * 4}}, params)[0]
    assert 64 >= default > 16 >= smaller.metrics.num_visual_tokens > 4 >= per_prompt.metrics.num_visual_tokens
    with pytest.raises(InvalidInputError, match="max_pixels"):  # above the engine's cap
        llm.chat(messages, params, mm_processor_kwargs={"max_pixels": 28 * 28 * 100})
    assert_no_leaks(llm)


def test_request_output_has_vllms_fields(ckpt):
    llm = LLM(str(ckpt))
    out = llm.generate("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
                       SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0]
    completion = out.outputs[0]
    for name in ("request_id", "prompt", "prompt_token_ids", "prompt_logprobs", "outputs", "finished", "metrics"):
        assert hasattr(out, name), name
    assert (completion.index, completion.finish_reason, completion.stop_reason) == (0, "length", None)
    assert completion.cumulative_logprob is None and completion.logprobs is None and out.prompt_logprobs is None


# -- engine arguments ----------------------------------------------------------------------------------------

def test_engine_arguments_with_vllms_names(ckpt, tmp_path):
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    llm = LLM(model=str(ckpt), tokenizer=str(ckpt), dtype="auto", seed=1, trust_remote_code=True,
              enforce_eager=True, kv_cache_dtype="auto", quantization=None, tensor_parallel_size=1,
              gpu_memory_utilization=0.5, enable_prefix_caching=True, block_size=8, max_num_batched_tokens=512,
              speculative_config=spec, download_dir=str(tmp_path))
    assert llm.engine.config.speculative.method == "ngram" and llm.model.dtype == torch.float32
    draft = LLM(str(ckpt), speculative_config={"model": str(ckpt), "num_speculative_tokens": 2})
    assert draft.engine.config.speculative.method == "draft"  # vLLM infers it from the model
    prompt = "<|im_start|>user\nred blue red blue<|im_end|>\n<|im_start|>assistant\n"
    params = SamplingParams(temperature=0, max_tokens=12)
    tokens = [engine.generate(prompt, params)[0].outputs[0].token_ids for engine in (llm, draft)]
    assert tokens[0] == tokens[1] == reference_tokens(llm, prompt, params)
    assert_no_leaks(llm)


@pytest.mark.parametrize("kwargs, message", [
    (dict(tensor_parallel_size=2), "vLLM or SGLang"),
    (dict(pipeline_parallel_size=4), "vLLM or SGLang"),
    (dict(distributed_executor_backend="ray"), "vLLM or SGLang"),
    (dict(limit_mm_per_prompt={"audio": 1}), "images and videos"),
    (dict(mm_processor_kwargs={"fps": 2}), "min_pixels"),
    (dict(kv_cache_dtype="fp8_e5m2"), "kv_cache_dtype must be one of"),
    (dict(quantization="awq"), "quantization must be None or one of"),
    (dict(quantization="int4", quantization_group_size=33), "must be even"),
    (dict(speculative={"method": "ngram", "num_speculative_tokens": 2},
          speculative_config={"method": "ngram", "num_speculative_tokens": 2}), "not both"),
    (dict(speculative_config={"method": "eagle", "model": "x", "num_speculative_tokens": 2}), "method"),
])
def test_arguments_nanomm_cannot_honour_are_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM("unused-folder", **kwargs)  # before any loading


def test_unknown_arguments_are_type_errors():
    with pytest.raises(TypeError, match="swap_spaces"):
        LLM("unused-folder", swap_spaces=4)


def test_chunked_prefill_off_prefills_each_prompt_in_one_step(ckpt):
    llm = LLM(str(ckpt), enable_chunked_prefill=False, max_num_batched_tokens=16, max_model_len=512)
    chunks_seen = []
    schedule = llm.engine.scheduler.schedule

    def recording():
        chunks = schedule()
        chunks_seen.extend((c.start, c.num_tokens, c.request.num_prompt_tokens) for c in chunks)
        return chunks

    llm.engine.scheduler.schedule = recording
    prompt = {"prompt": "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>look<|im_end|>\n"
                        "<|im_start|>assistant\n", "multi_modal_data": {"image": random_image(112, 112, 5)}}
    params = SamplingParams(temperature=0, max_tokens=4)
    out = llm.generate([prompt, "<|im_start|>user\nhi<|im_end|>\n"], params)
    prefills = [c for c in chunks_seen if c[0] == 0]
    assert len(prefills) == 2 and all(n == length for _, n, length in prefills)
    assert max(n for _, n, length in prefills) > 16  # longer than the budget the caller gave
    assert out[0].outputs[0].token_ids == reference_tokens(llm, prompt, params)
    assert_no_leaks(llm)


# -- generation defaults ----------------------------------------------------------------------------------------

# Qwen/Qwen2-VL-2B-Instruct's generation_config.json. The hub is unreachable from here; these values were read
# from a public copy of the file: repository mrpid12org/imageworks, path
# models/Qwen2-VL-2B-Instruct/generation_config.json (commit 229b9475de9a).
QWEN2_VL_2B_INSTRUCT = {"bos_token_id": 151643, "pad_token_id": 151643, "do_sample": True,
                        "eos_token_id": [151645, 151643], "repetition_penalty": 1.0, "temperature": 0.01,
                        "top_p": 0.001, "top_k": 1, "transformers_version": "4.37.0"}
# A base-model style file: no sampling temperature, Qwen's usual repetition penalty of 1.05.
BASE_STYLE = {"bos_token_id": 151643, "eos_token_id": 151643, "do_sample": False, "repetition_penalty": 1.05,
              "max_new_tokens": 20}


def with_generation_config(ckpt, tmp_path, values: dict):
    folder = tmp_path / "model"
    shutil.copytree(ckpt, folder)
    ids = json.loads((ckpt / "generation_config.json").read_text())  # this tokenizer's EOS ids, not Qwen's
    values = {**values, "eos_token_id": ids["eos_token_id"], "bos_token_id": ids["bos_token_id"],
              "pad_token_id": ids.get("pad_token_id")}
    (folder / "generation_config.json").write_text(json.dumps(values))
    return folder


def test_generation_config_auto_takes_the_instruct_checkpoints_defaults(ckpt, tmp_path):
    folder = with_generation_config(ckpt, tmp_path, QWEN2_VL_2B_INSTRUCT)
    llm = LLM(str(folder))
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_p, defaults.top_k, defaults.repetition_penalty) == (0.01, 0.001, 1, 1.0)
    prompt = "<|im_start|>user\nthe cat the cat<|im_end|>\n<|im_start|>assistant\n"
    near_greedy = [o.outputs[0].token_ids for o in llm.generate([prompt] * 3)]  # no params: the file's
    greedy = SamplingParams(temperature=0, max_tokens=16)
    assert near_greedy == [reference_tokens(llm, prompt, greedy)] * 3  # top_k 1: the argmax, every time
    vllm_defaults = LLM(str(folder), generation_config="vllm").get_default_sampling_params()
    assert vllm_defaults == SamplingParams()  # temperature 1: sampled
    assert_no_leaks(llm)


def test_generation_config_of_a_base_model_applies_its_repetition_penalty(ckpt, tmp_path):
    folder = with_generation_config(ckpt, tmp_path, BASE_STYLE)
    llm = LLM(str(folder), seed=5)
    defaults = llm.get_default_sampling_params()
    assert (defaults.repetition_penalty, defaults.max_tokens, defaults.temperature) == (1.05, 20, 1.0)
    prompt = "<|im_start|>user\nred blue red blue<|im_end|>\n<|im_start|>assistant\n"
    by_default = llm.generate(prompt)[0].outputs[0].token_ids
    explicit = SamplingParams(repetition_penalty=1.05, max_tokens=20, seed=123)
    again = LLM(str(folder), seed=5, generation_config="vllm")
    assert again.generate(prompt, SamplingParams(repetition_penalty=1.05, max_tokens=20))[0].outputs[0].token_ids \
        == by_default  # same derived seed, same parameters
    assert llm.generate(prompt, explicit)[0].outputs[0].token_ids == \
        again.generate(prompt, explicit)[0].outputs[0].token_ids
    other = LLM(str(ckpt), generation_config=str(folder)).get_default_sampling_params()  # a folder of its own
    assert other.repetition_penalty == 1.05
    with pytest.raises(ValueError, match="generation_config.json"):
        LLM(str(ckpt), generation_config=str(tmp_path))


# -- EXIF orientation -------------------------------------------------------------------------------------------

def jpeg_with_orientation(image: Image.Image, orientation: int) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = orientation
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", exif=exif, quality=95)
    return buffer.getvalue()


@pytest.mark.parametrize("orientation, turn", [(3, Image.Transpose.ROTATE_180), (6, Image.Transpose.ROTATE_270),
                                               (8, Image.Transpose.ROTATE_90)])
def test_exif_orientation_is_applied_to_files_and_bytes(tmp_path, orientation, turn):
    """A phone photo stored sideways with an orientation tag comes out upright: the same pixels as the stored
    picture turned by hand (PIL's own rotation is the oracle)."""
    picture = Image.new("RGB", (64, 32), (250, 250, 250))
    picture.paste((200, 0, 0), (0, 0, 16, 16))  # a red corner shows which way is up
    data = jpeg_with_orientation(picture, orientation)
    stored = Image.open(io.BytesIO(data)).convert("RGB")
    path = tmp_path / "photo.jpg"
    path.write_bytes(data)
    for source in (data, str(path), data_url(data, "image/jpeg")):
        upright = load_image(source).convert("RGB")
        assert upright.tobytes() == stored.transpose(turn).tobytes()
    assert load_image(Image.open(io.BytesIO(data))).size == (64, 32)  # a PIL image is taken as given


def test_exif_orientation_reaches_the_model(ckpt):
    llm = LLM(str(ckpt), max_pixels=28 * 28 * 16)
    picture = random_image(84, 28, 6)
    sideways = jpeg_with_orientation(picture.transpose(Image.Transpose.ROTATE_90), 6)  # stored turned, tagged back
    prompt = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>hi<|im_end|>\n<|im_start|>assistant\n"
    out = llm.generate({"prompt": prompt, "multi_modal_data": {"image": sideways}},
                       SamplingParams(temperature=0, max_tokens=2))[0]
    prepared = llm.engine.prepare({"prompt": prompt, "multi_modal_data": {"image": sideways}}, None)
    _, rows, columns = prepared.images[0].grid_thw  # in 14-pixel patches (scaled up to min_pixels)
    assert columns == 2 * rows  # three times wider than high, scaled to 112 x 56: upright again, not 56 x 112
    assert out.metrics.num_visual_tokens == rows * columns // 4
