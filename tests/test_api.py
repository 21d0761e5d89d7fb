"""The LLM API (vLLM's offline shape) and its front door: every bad input is an InvalidInputError, before compute."""

import re
import threading

import pytest
import torch

from helpers import assert_no_leaks, chat_prompt, random_image, reference_tokens, run_to_completion
from nanomm import LLM, InvalidInputError, RequestOutput, SamplingParams
from nanomm.tools.random_checkpoint import make_checkpoint

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    folder = make_checkpoint(tmp_path_factory.mktemp("tiny"), preset="tiny")
    return LLM(str(folder), device="cpu", dtype="float32", max_pixels=28 * 28 * 16, max_model_len=512,
               num_kv_blocks=64, block_size=4)


def test_unknown_engine_argument_is_a_type_error(llm):
    with pytest.raises(TypeError):
        LLM("unused", no_such_option=True)


def test_generate_shapes(llm):
    one = llm.generate(chat_prompt("hello"))
    assert len(one) == 1 and isinstance(one[0], RequestOutput)
    assert len(one[0].outputs[0].token_ids) <= SamplingParams().max_tokens  # default params
    many = llm.generate([chat_prompt("a"), chat_prompt("b"), chat_prompt("c")],
                        [GREEDY, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), GREEDY])
    assert [len(o.outputs[0].token_ids) for o in many] == [6, 2, 6]
    assert [o.prompt for o in many] == [chat_prompt(x) for x in "abc"]
    assert_no_leaks(llm)


def test_prompt_token_ids_and_text_prompts_agree(llm):
    image = random_image(56, 84, 1)
    text = chat_prompt("what is it?", [image])
    ids = llm.tokenizer.encode(text["prompt"])  # one <|image_pad|> per image: the engine expands it
    by_text, by_ids = llm.generate([text, {"prompt_token_ids": ids, "multi_modal_data": {"image": image}}], GREEDY)
    assert by_text.prompt_token_ids == by_ids.prompt_token_ids
    assert by_text.outputs[0].token_ids == by_ids.outputs[0].token_ids


def test_chat_applies_the_template_and_default_system_prompt(llm):
    image = random_image(60, 60, 2)
    conversation = [{"role": "user", "content": [{"type": "image", "image": image},
                                                  {"type": "text", "text": "what is it?"}]}]
    out = llm.chat(conversation, GREEDY)[0]
    assert out.prompt == chat_prompt("what is it?", [image])["prompt"]
    assert out.outputs[0].token_ids == reference_tokens(llm, chat_prompt("what is it?", [image]), GREEDY)
    two = llm.chat([conversation, [{"role": "user", "content": "hi"}]], GREEDY)
    assert len(two) == 2 and two[1].prompt == chat_prompt("hi")
    with pytest.raises(InvalidInputError, match="conversation 1: message 0"):
        llm.chat([conversation, [{"role": "robot", "content": "hi"}]], GREEDY)
    assert_no_leaks(llm)


BAD_PROMPTS = {
    "not a prompt": (42, "a str or a dict"),
    "unknown key": ({"prompt": "x", "images": []}, "unknown keys"),
    "both prompt kinds": ({"prompt": "x", "prompt_token_ids": [1]}, "exactly one"),
    "empty": ("", "empty"),
    "token id out of range": ({"prompt_token_ids": [1, 10**9]}, "prompt_token_ids"),
    "more images than placeholders": ({"prompt": "no placeholder", "multi_modal_data": {"image": "IMG"}},
                                      "0 image placeholder"),
    "placeholder without image": (chat_prompt("x", ["IMG"])["prompt"], "1 image placeholder"),
    "audio": ({"prompt": "x", "multi_modal_data": {"audio": []}}, "'image' and/or 'video' keys"),
    "a video without its placeholder": ({"prompt": "x", "multi_modal_data": {"video": [[]]}}, "0 video placeholder"),
    "bad mm kwargs": ({"prompt": "x", "mm_processor_kwargs": {"frame_rate": 2}}, "mm_processor_kwargs"),
    "bad max_pixels": ({**chat_prompt("x", ["IMG"]), "mm_processor_kwargs": {"max_pixels": -5}}, "max_pixels"),
    "corrupt image": (chat_prompt("x", [b"\x89PNG\r\n\x1a\n broken"]), "image 0"),
    "missing file": (chat_prompt("x", ["/no/such/file.png"]), "image 0"),
    "too long for max_model_len": (" ".join(["word"] * 600), "max_model_len"),
}


@pytest.mark.parametrize("case", list(BAD_PROMPTS))
def test_bad_prompt_rejects_the_whole_call_before_compute(llm, case):
    bad, message = BAD_PROMPTS[case]
    image = random_image(40, 40, 3)
    bad = _with_real_image(bad, image)
    prompts = [chat_prompt("fine"), chat_prompt("also fine", [image]), bad]
    steps = llm.stats()["steps"]
    with pytest.raises(InvalidInputError, match=message) as err:
        llm.generate(prompts, GREEDY)
    assert "prompt 2" in str(err.value)
    assert llm.stats()["steps"] == steps  # no model compute happened
    assert_no_leaks(llm)


def _with_real_image(prompt, image):
    """Replace the "IMG" marker by a real image (parametrize ids stay readable)."""
    if isinstance(prompt, dict) and "image" in prompt.get("multi_modal_data", {}):
        images = prompt["multi_modal_data"].get("image")
        images = [image if im == "IMG" else im for im in (images if isinstance(images, list) else [images])]
        return {**prompt, "multi_modal_data": {"image": images}}
    return prompt


def test_bad_sampling_params_and_pool_limits(llm):
    with pytest.raises(InvalidInputError, match="SamplingParams"):
        llm.generate([chat_prompt("x")], [{"temperature": 0}])
    with pytest.raises(InvalidInputError, match="2 sampling params for 1 prompts"):
        llm.generate([chat_prompt("x")], [GREEDY, GREEDY])
    with pytest.raises(InvalidInputError, match="KV blocks"):  # 64 blocks of 4 = 256 tokens in the whole pool
        llm.generate([chat_prompt("x")], SamplingParams(max_tokens=400))
    assert_no_leaks(llm)


def test_bad_add_request_leaves_running_requests_untouched(llm):
    """Structural problems raise at add_request; an image that fails to decode on the worker pool finishes its
    own request with finish_reason "error". Either way the running requests are untouched."""
    engine = llm.engine
    good = [chat_prompt("one", [random_image(50, 70, 4)]), chat_prompt("two")]
    ids = [engine.add_request(p, GREEDY) for p in good]
    engine.step()
    with pytest.raises(InvalidInputError, match="1 image placeholder"):
        engine.add_request(chat_prompt("no image given", ["IMG"])["prompt"], GREEDY)
    with pytest.raises(InvalidInputError, match="already in use"):
        engine.add_request(chat_prompt("dup"), GREEDY, request_id=ids[0])
    bad = engine.add_request(chat_prompt("bad", [b"not an image"]), GREEDY)
    finished = run_to_completion(engine)
    assert sorted(finished) == sorted(ids + [bad])
    assert finished[bad].outputs[0].finish_reason == "error" and finished[bad].outputs[0].token_ids == []
    assert "image 0" in finished[bad].outputs[0].error
    for rid, prompt in zip(ids, good):
        assert finished[rid].outputs[0].token_ids == reference_tokens(llm, prompt, GREEDY)
    assert_no_leaks(llm)


def test_progress_bar_does_not_change_outputs(llm, capsys, monkeypatch):
    """vLLM's default, use_tqdm=True: a bar on stderr when it is a terminal (FORCE_COLOR makes rich think so),
    nothing on a pipe; never on stdout, where a script's own output goes."""
    prompts = [chat_prompt(f"progress {i}") for i in range(3)]
    plain = llm.generate(prompts, GREEDY, use_tqdm=False)
    piped = llm.generate(prompts, GREEDY)
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("FORCE_COLOR", "1")
    shown = llm.generate(prompts, GREEDY, use_tqdm=True)
    assert [o.outputs[0].token_ids for o in shown] == [o.outputs[0].token_ids for o in plain]
    assert [o.outputs[0].token_ids for o in piped] == [o.outputs[0].token_ids for o in plain]
    printed = capsys.readouterr()
    assert "3/3" in printed.err and printed.out == ""
    assert_no_leaks(llm)


def test_unknown_engine_arguments_are_named(tmp_path):
    with pytest.raises(TypeError, match=r"\['max_num_sequences', 'no_such_option'\]"):
        LLM("unused", max_num_sequences=8, no_such_option=True)  # before any loading: the folder does not exist


@pytest.mark.parametrize("name,value", [
    ("num_preprocess_workers", -1), ("max_num_seqs", 0), ("block_size", 2.5), ("max_num_batched_tokens", True),
    ("encoder_cache_size", "big"), ("max_num_encoder_tokens", 0), ("limit_images_per_prompt", -3),
    ("max_model_len", 0), ("num_kv_blocks", -2), ("gpu_memory_utilization", 1.5), ("kv_cache_memory_gib", 0),
    ("enable_prefix_caching", "yes"), ("cpu_fast_linear", 1), ("max_pixels", 0), ("seed", 1.0),
])
def test_bad_engine_arguments_name_the_value_given(name, value):
    with pytest.raises(ValueError, match=rf"{name}.*got {re.escape(repr(value))}$"):
        LLM("unused", **{name: value})


def test_engine_arguments_fill_the_config_by_name(llm):
    config = llm.engine.config
    assert (config.max_pixels, config.max_model_len, config.num_kv_blocks, config.block_size) == (28 * 28 * 16, 512, 64, 4)
    assert config.max_num_encoder_tokens == config.max_num_batched_tokens == 2048  # resolved from the token budget
    assert config.device == "cpu" and config.dtype == "float32"
    assert llm.engine.config.speculative is None and llm.engine.config.cpu_fast_linear is True


def preprocess_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("nanomm-preprocess")]


def test_close_and_context_manager_stop_the_worker_pool(tmp_path):
    folder = make_checkpoint(tmp_path / "tiny", preset="tiny")
    before = set(preprocess_threads())
    with LLM(str(folder), device="cpu", max_model_len=256, num_kv_blocks=32, num_preprocess_workers=2) as llm:
        llm.generate([chat_prompt("a", [random_image(40, 40, i)]) for i in range(3)], GREEDY)  # workers start
        assert set(preprocess_threads()) - before
        assert llm.engine.config.dtype == "float32"  # resolved: cpu means float32
    assert not set(preprocess_threads()) - before  # every worker of this LLM has exited
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate(chat_prompt("a", [random_image(40, 40, 9)]), GREEDY)
    llm.close()  # a second close is harmless


def test_cpu_fast_linear_switch(llm, tmp_path, monkeypatch):
    """The fast path is on by default for CPU float32, for layers at least MIN_PACKED_SIDE wide on both sides (the
    tiny preset has none), and off with cpu_fast_linear=False: then every layer is the plain nn.Linear the lessons
    read. With every layer packed, and with none, the engine gives the dense reference's tokens."""
    from nanomm.accel import packed_linear as fast_linear
    from nanomm.accel.packed_linear import PackedLinear, packed_linear_available
    settings = dict(device="cpu", max_pixels=28 * 28 * 16, max_model_len=512, num_kv_blocks=64, block_size=4)
    tiny = str(make_checkpoint(tmp_path / "tiny", preset="tiny"))
    plain = LLM(tiny, cpu_fast_linear=False, **settings)
    assert not any(isinstance(m, PackedLinear) for m in plain.model.modules())
    assert not any(isinstance(m, PackedLinear) for m in llm.model.modules())  # 64 wide: too small to pay
    engines = [plain]
    if packed_linear_available(llm.model.device, llm.model.dtype):
        monkeypatch.setattr(fast_linear, "MIN_PACKED_SIDE", 1)
        every_layer_packed = LLM(tiny, **settings)
        assert not any(isinstance(m, torch.nn.Linear) for m in every_layer_packed.model.modules())
        engines.append(every_layer_packed)
    prompts = [chat_prompt("what is it?", [random_image(56, 84, 3)]), chat_prompt("hello there")]
    for engine in engines:
        for prompt, out in zip(prompts, engine.generate(prompts, GREEDY)):
            assert out.outputs[0].token_ids == reference_tokens(engine, prompt, GREEDY)
        engine.close()


def test_only_layers_wide_enough_to_pay_are_packed():
    """pack_linear_layers packs a layer only if both its sides are at least MIN_PACKED_SIDE (512)."""
    from nanomm.accel.packed_linear import PackedLinear, pack_linear_layers, packed_linear_available
    if not packed_linear_available(torch.device("cpu"), torch.float32):
        pytest.skip("this torch build has no usable oneDNN linear ops")
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 256), torch.nn.Linear(1024, 512),
                                torch.nn.Linear(256, 151_936))
    assert pack_linear_layers(model) == 2
    assert [type(m).__name__ for m in model] == ["PackedLinear", "Linear", "PackedLinear", "Linear"]
    assert isinstance(model[0], PackedLinear)
