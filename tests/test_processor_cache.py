"""The processor cache (nanomm/inputs/processor_cache.py): a picture sent again, by its bytes or by a client's
uuid, gives the tokens an engine without the cache gives, and is not decoded again (counted); the byte bound holds
under many pictures; an unknown uuid is a 400 / InvalidInputError; a uuid never crosses processing settings."""

import io

import httpx
import pytest

from helpers import data_url, random_image, reference_tokens
from nanomm import LLM, SamplingParams
from nanomm.errors import InvalidInputError
from nanomm.inputs.image import ImageProcessorConfig, preprocess_image
from nanomm.inputs.processor_cache import ProcessorCache
from nanomm.serve.app import Server, ServerConfig
from nanomm.serve.testing import BackgroundServer

MODEL = "tiny"
GREEDY = SamplingParams(temperature=0, max_tokens=8)
PROMPT = ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is this?<|im_end|>\n"
          "<|im_start|>assistant\n")


def make_llm(ckpt, **kwargs):
    return LLM(str(ckpt), device="cpu", dtype="float32", max_pixels=28 * 28 * 16, **kwargs)


def png_bytes(seed: int, width: int = 56, height: int = 56) -> bytes:
    buffer = io.BytesIO()
    random_image(width, height, seed).save(buffer, "PNG")
    return buffer.getvalue()


def prompt(image, uuid=None, **processor_kwargs) -> dict:
    p = {"prompt": PROMPT, "multi_modal_data": {"image": [image]}}
    if uuid is not None:
        p["multi_modal_uuids"] = {"image": [uuid]}
    if processor_kwargs:
        p["mm_processor_kwargs"] = processor_kwargs
    return p


def tokens(llm, p) -> list[int]:
    return llm.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def counters(llm) -> tuple[int, int]:
    stats = llm.stats()
    return stats["processor_cache_decodes"], stats["processor_cache_hits"]


def test_a_picture_sent_again_is_not_decoded_again_and_gives_the_same_tokens(ckpt):
    url = data_url(png_bytes(1))
    plain = make_llm(ckpt, mm_processor_cache_gb=0)
    expected = reference_tokens(plain, prompt(url), GREEDY)  # the dense reference, the cache off
    assert tokens(plain, prompt(url)) == tokens(plain, prompt(url)) == expected
    assert counters(plain) == (3, 0)  # reference_tokens' prepare and two requests: three decodes

    cached = make_llm(ckpt)
    assert tokens(cached, prompt(url, uuid="pic-1")) == expected
    assert counters(cached) == (1, 0)
    assert tokens(cached, prompt(url)) == expected  # the same bytes: found by their hash
    assert counters(cached) == (1, 1)
    assert tokens(cached, prompt(None, uuid="pic-1")) == expected  # the uuid alone
    assert counters(cached) == (1, 2)
    assert tokens(cached, prompt(data_url(png_bytes(2)))) != expected  # another picture is decoded
    assert counters(cached) == (2, 2)


def test_chat_parts_carry_uuids_offline(ckpt):
    url = data_url(png_bytes(3))

    def chat(image_url):
        part = {"type": "image_url", "image_url": image_url, "uuid": "photo"}
        messages = [{"role": "user", "content": [part, {"type": "text", "text": "What is this?"}]}]
        return llm.chat(messages, GREEDY, use_tqdm=False)[0].outputs[0].token_ids

    llm = make_llm(ckpt)
    first = chat({"url": url})
    assert chat(None) == first and counters(llm) == (1, 1)


def test_an_unknown_uuid_is_invalid_input_offline(ckpt):
    llm = make_llm(ckpt)
    with pytest.raises(InvalidInputError, match="'never-sent'"):
        llm.generate([prompt(None, uuid="never-sent")], GREEDY, use_tqdm=False)
    assert counters(llm) == (0, 0)


def test_a_uuid_does_not_cross_processing_settings(ckpt):
    llm = make_llm(ckpt)
    url = data_url(png_bytes(4, 112, 112))
    small = tokens(llm, prompt(url, uuid="pic", max_pixels=28 * 28 * 4))
    with pytest.raises(InvalidInputError, match="'pic'"):  # known, but under another pixel cap
        tokens(llm, prompt(None, uuid="pic"))
    assert tokens(llm, prompt(None, uuid="pic", max_pixels=28 * 28 * 4)) == small
    assert counters(llm) == (1, 1)
    tokens(llm, prompt(url))  # the same bytes under the engine's own cap: decoded again
    assert counters(llm) == (2, 1)
    off = make_llm(ckpt, mm_processor_cache_gb=0)
    with pytest.raises(InvalidInputError, match="'pic'"):  # the cache off: no uuid is known
        tokens(off, prompt(None, uuid="pic"))


def test_the_byte_bound_holds_and_the_least_recently_used_goes_first():
    config = ImageProcessorConfig(max_pixels=56 * 56)
    entry_bytes = 56 * 56 * 3  # a 56x56 picture stays 56x56: its uint8 RGB pixels
    cache = ProcessorCache(int(2.5 * entry_bytes))  # room for two
    pictures = [png_bytes(seed) for seed in range(8)]

    def get(i: int):
        return cache.get_or_process("settings", pictures[i], f"uuid-{i}",
                                    lambda: preprocess_image(pictures[i], config))

    get(0), get(1), get(0)  # the second look at 0 is a hit, and makes 1 the least recently used
    get(2)
    assert cache.lookup_uuid("settings", "uuid-1") is None  # evicted with its entry
    assert cache.lookup_uuid("settings", "uuid-0") is not None
    for i in range(3, 8):
        get(i)
        assert cache.nbytes <= cache.capacity_bytes and len(cache) == 2
    assert (cache.decodes, cache.hits, cache.evictions) == (8, 2, 6)
    assert cache.nbytes == 2 * entry_bytes
    assert cache.lookup_uuid("other settings", "uuid-7") is None


def test_an_entry_over_the_bound_is_not_kept():
    config = ImageProcessorConfig(max_pixels=56 * 56)
    cache = ProcessorCache(100)
    data = png_bytes(0)
    cache.get_or_process("s", data, "big", lambda: preprocess_image(data, config))
    assert (len(cache), cache.nbytes, cache.lookup_uuid("s", "big")) == (0, 0, None)


def test_over_http_an_unknown_uuid_is_a_400_and_a_known_one_is_served(ckpt):
    llm = make_llm(ckpt)
    url = data_url(png_bytes(5))

    def body(image_url, uuid):
        part = {"type": "image_url", "image_url": image_url, "uuid": uuid}
        return {"model": MODEL, "max_tokens": 8, "temperature": 0,
                "messages": [{"role": "user", "content": [part, {"type": "text", "text": "What is this?"}]}]}

    with BackgroundServer(Server(llm, ServerConfig(MODEL))) as base:
        unknown = httpx.post(base + "/v1/chat/completions", json=body(None, "nobody-sent-this"), timeout=60)
        assert unknown.status_code == 400 and "nobody-sent-this" in unknown.json()["error"]["message"]
        first = httpx.post(base + "/v1/chat/completions", json=body({"url": url}, "pic"), timeout=60)
        again = httpx.post(base + "/v1/chat/completions", json=body(None, "pic"), timeout=60)
        assert first.status_code == again.status_code == 200
        assert again.json()["choices"][0]["message"] == first.json()["choices"][0]["message"]
        scraped = httpx.get(base + "/metrics").text
    assert counters(llm) == (1, 1)
    assert "nanomm_processor_cache_hits_total 1.0" in scraped
