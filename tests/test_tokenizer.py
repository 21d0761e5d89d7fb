"""Our chat template, encoding and placeholder expansion give the same ids as transformers' Qwen2-VL processor."""

import functools
import json

import pytest
from PIL import Image
from transformers import AutoTokenizer, Qwen2VLProcessor  # the oracle: missing, these tests fail (never skip)
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from nanomm.errors import InvalidInputError
from nanomm.inputs.tokenizer import CHAT_TEMPLATE, IMAGE_PLACEHOLDER, Tokenizer
from nanomm.tools.random_checkpoint import make_checkpoint


@pytest.fixture(scope="module", params=["qwen", "tiny"])
def folder(request, tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp(request.param), "tiny", tokenizer=request.param)


@pytest.fixture(scope="module")
def qwen_folder(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("qwen"), "tiny", tokenizer="qwen")


@functools.cache
def ours(folder) -> Tokenizer:  # loading the 151k-token BPE takes about a second, so load each folder once
    return Tokenizer.from_pretrained(folder)


@functools.cache
def theirs(folder):
    return AutoTokenizer.from_pretrained(folder)


class _Processor(Qwen2VLProcessor):
    # Without torchvision the class check of the (absent) video processor fails; see §8 of the reference notes.
    def check_argument_for_proper_class(self, name, arg):
        return None if arg is None else super().check_argument_for_proper_class(name, arg)


def hf_processor(folder):
    return _Processor(image_processor=Qwen2VLImageProcessorPil(max_pixels=12845056),
                      tokenizer=theirs(folder), video_processor=None,
                      chat_template=CHAT_TEMPLATE)


RED, GREEN, BLUE = (Image.new("RGB", size, color) for size, color in
                    [((56, 84), (255, 0, 0)), ((100, 60), (0, 255, 0)), ((200, 120), (0, 0, 255))])

CONVERSATIONS = {
    "text only": [{"role": "user", "content": "Hello! How are you today?"}],
    "system": [{"role": "system", "content": "You are a pirate."}, {"role": "user", "content": "Hi there"}],
    "one image": [{"role": "user", "content": [{"type": "image", "image": RED},
                                               {"type": "text", "text": "What kind of dog is this?"}]}],
    "three images, text around them": [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "text", "text": "First:\n"}, {"type": "image", "image": RED},
                                     {"type": "text", "text": " second: "}, {"type": "image", "image": GREEN},
                                     {"type": "image", "image": BLUE}, {"type": "text", "text": "\nCompare them."}]}],
    "multi-turn": [
        {"role": "user", "content": [{"type": "image", "image": GREEN}, {"type": "text", "text": "Describe it."}]},
        {"role": "assistant", "content": "A green square."},
        {"role": "user", "content": [{"type": "text", "text": "And this one?"}, {"type": "image", "image": BLUE}]},
        {"role": "assistant", "content": [{"type": "text", "text": "A blue rectangle, 200 × 120."}]},
        {"role": "user", "content": "Thanks — café, naïve, 日本語, emoji 🐶, don't\t tabs  and  spaces"}],
    "image_url parts": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        {"type": "image_url", "image_url": "/tmp/cat.png"}, {"type": "text", "text": "Same?"}]}],
}


def for_hf(messages):
    """transformers' template needs only {"type": "image"} to emit a placeholder."""
    return [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str) else
             [{"type": "image"} if p["type"] in ("image", "image_url") else p for p in m["content"]]}
            for m in messages]


@pytest.mark.parametrize("name", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(folder, name, add_generation_prompt):
    messages = CONVERSATIONS[name]
    tok, hf = ours(folder), theirs(folder)
    text, images = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    expected_text = hf.apply_chat_template(for_hf(messages), tokenize=False, add_generation_prompt=add_generation_prompt)
    expected_ids = hf.apply_chat_template(for_hf(messages), tokenize=True, add_generation_prompt=add_generation_prompt,
                                          return_dict=True)["input_ids"]
    assert text == expected_text
    assert tok.encode(text) == expected_ids
    parts = [p for m in messages if not isinstance(m["content"], str) for p in m["content"]]
    assert images == [p["image"] if p["type"] == "image" else
                      p["image_url"]["url"] if isinstance(p["image_url"], dict) else p["image_url"]
                      for p in parts if p["type"] != "text"]
    assert text.count(IMAGE_PLACEHOLDER) == len(images)


@pytest.mark.parametrize("name", ["text only", "one image", "three images, text around them", "multi-turn"])
def test_expansion_matches_the_hf_processor(folder, name):
    messages = CONVERSATIONS[name]
    tok = ours(folder)
    expected = hf_processor(folder).apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                                        return_dict=True)
    text, images = tok.apply_chat_template(messages)
    grids = expected["image_grid_thw"].tolist() if images else []
    tokens_per_image = [t * h * w // 4 for t, h, w in grids]
    assert tok.expand_image_placeholders(tok.encode(text), tokens_per_image) == expected["input_ids"][0]


def test_first_ids_of_the_hf_integration_example(qwen_folder):
    tok = ours(qwen_folder)
    text, images = tok.apply_chat_template(CONVERSATIONS["one image"])
    ids = tok.expand_image_placeholders(tok.encode(text), [4])
    assert ids[:17] == [151644, 8948, 198, 2610, 525, 264, 10950, 17847, 13, 151645, 198, 151644, 872, 198,
                        151652, 151655, 151655]
    assert images == [RED]


def test_special_ids_and_defaults(folder):
    tok = ours(folder)
    config = json.loads((folder / "config.json").read_text())
    generation = json.loads((folder / "generation_config.json").read_text())
    assert tok.image_token_id == config["image_token_id"]
    assert tok.vision_start_token_id == config["vision_start_token_id"]
    assert tok.vision_end_token_id == config["vision_end_token_id"]
    assert tok.eos_token_ids == generation["eos_token_id"]
    assert tok.pad_token_id == generation["pad_token_id"]
    assert tok.vocab_size == len(theirs(folder))
    assert tok.encode("<|im_start|><|image_pad|>") == [tok.tokenizer.token_to_id("<|im_start|>"), tok.image_token_id]
    assert Tokenizer.from_pretrained(folder, image_token_id=7).image_token_id == 7


def test_eos_falls_back_to_config_then_im_end(tmp_path):
    folder = make_checkpoint(tmp_path / "t", "tiny")
    im_end = Tokenizer.from_pretrained(folder).tokenizer.token_to_id("<|im_end|>")
    (folder / "generation_config.json").unlink()
    assert Tokenizer.from_pretrained(folder).eos_token_ids == [im_end]  # config.json's eos_token_id
    (folder / "config.json").unlink()
    assert Tokenizer.from_pretrained(folder).eos_token_ids == [im_end]


@pytest.mark.parametrize("text", ["Hello, world!", "  leading and trailing  ", "line\n\nbreaks\r\n", "café 日本語 🐶",
                                  "<|im_start|>user\nhi<|im_end|>\n" + IMAGE_PLACEHOLDER, "12345 don't", ""])
def test_decode_round_trip(folder, text):
    tok, hf = ours(folder), theirs(folder)
    ids = tok.encode(text)
    assert ids == hf(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text == hf.decode(ids)
    assert tok.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True)


def test_expansion_errors(qwen_folder):
    tok = ours(qwen_folder)
    ids = tok.encode("a" + IMAGE_PLACEHOLDER + "b" + IMAGE_PLACEHOLDER)
    assert tok.expand_image_placeholders(ids, [2, 3]).count(tok.image_token_id) == 5
    with pytest.raises(InvalidInputError, match="2 image placeholder.*1 image"):
        tok.expand_image_placeholders(ids, [4])
    with pytest.raises(InvalidInputError, match="2 image placeholder.*3 image"):
        tok.expand_image_placeholders(ids, [4, 4, 4])
    with pytest.raises(InvalidInputError, match="at least one"):
        tok.expand_image_placeholders(ids, [4, 0])
    with pytest.raises(InvalidInputError, match="already expanded"):
        tok.expand_image_placeholders(tok.expand_image_placeholders(ids, [2, 2]), [2, 2, 2, 2])
    with pytest.raises(InvalidInputError, match="placeholder 0"):
        tok.expand_image_placeholders(tok.encode("no start <|image_pad|><|vision_end|>"), [4])
    with pytest.raises(InvalidInputError, match="placeholder 0"):
        tok.expand_image_placeholders(tok.encode("<|vision_start|><|image_pad|>"), [4])
    assert tok.expand_image_placeholders(tok.encode("no images"), []) == tok.encode("no images")


GOOD = {"role": "user", "content": "hi"}
MALFORMED = {
    "not a list": ("hello", "non-empty list"),
    "empty": ([], "non-empty list"),
    "message not a dict": ([GOOD, "hi"], "message 1 must be a dict"),
    "unknown role": ([GOOD, {"role": "function", "content": "x"}], "message 1 has role 'function'"),
    "missing role": ([{"content": "x"}], "message 0 has role None"),
    "missing content": ([GOOD, GOOD, {"role": "user"}], "message 2 has no 'content'"),
    "content not str or list": ([{"role": "user", "content": 3}], "message 0 content must be"),
    "content None": ([GOOD, {"role": "assistant", "content": None}], "message 1 content must be"),
    "part not a dict": ([{"role": "user", "content": ["hi"]}], "message 0 part 0 must be a dict"),
    "part without type": ([{"role": "user", "content": [{"text": "hi"}]}], "message 0 part 0 must be a dict with a 'type'"),
    "unknown part type": ([GOOD, {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "audio"}]}],
                          "message 1 part 1 has type 'audio'"),
    "video missing": ([{"role": "user", "content": [{"type": "video"}]}], "message 0 part 0 is a video part"),
    "video_url missing url": ([{"role": "user", "content": [{"type": "video_url", "video_url": {}}]}],
                              "message 0 part 0 is a video_url part"),
    "text not a string": ([{"role": "user", "content": [{"type": "text", "text": 5}]}], "message 0 part 0 is a text part"),
    "image missing": ([{"role": "user", "content": [{"type": "image"}]}], "message 0 part 0 is an image part"),
    "image_url missing url": ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
                              "message 0 part 0 is an image_url part"),
    "image_url wrong type": ([{"role": "user", "content": [{"type": "image_url", "image_url": 3}]}],
                             "message 0 part 0 is an image_url part"),
}


@pytest.mark.parametrize("name", MALFORMED)
def test_malformed_messages(qwen_folder, name):
    messages, message = MALFORMED[name]
    tok = ours(qwen_folder)
    with pytest.raises(InvalidInputError) as info:
        tok.apply_chat_template(messages)
    assert message in str(info.value)
    assert isinstance(info.value, ValueError)
