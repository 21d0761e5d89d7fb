"""Long chats (nanomm/inputs/old_images.py, lesson 16): old pictures dropped, downscaled or compressed, the prefix
cache reused up to the first changed picture, every answer exact against the dense reference, bad settings a 400."""

import io

import httpx
import pytest

from helpers import assert_engine_matches_reference, assert_no_leaks, data_url
from nanomm import LLM, SamplingParams, demo_checkpoint
from nanomm.engine.config import EngineConfig
from nanomm.errors import InvalidInputError
from nanomm.inputs.old_images import DROPPED_MARKER, OldImagePolicy, parse_old_image_policy
from nanomm.bench.long_chats import chat_turns, run_chat, user_turn
from nanomm.serve.app import Server, ServerConfig
from nanomm.serve.cli import parse_args, _long_chat_args
from nanomm.serve.testing import BackgroundServer

TOKENS_PER_PICTURE = 144  # a 448x448 picture under the demo model's cap (168x168, 12x12 merged tokens)
POOLED = 36  # compress:pool:0.25 pools 2x2 windows: 6x6
BLOCK = 16


@pytest.fixture(scope="module")
def demo_llm():
    llm = LLM(demo_checkpoint(), num_preprocess_workers=0)
    yield llm
    llm.close()


def nth_picture_start(token_ids: list[int], n: int, vision_start: int) -> int:
    """Where the n-th (0-based) picture still shown in a prompt begins: its <|vision_start|>."""
    return [i for i, t in enumerate(token_ids) if t == vision_start][n]


@pytest.mark.parametrize("policy, old_tokens", [("drop", 0), ("compress:pool:0.25", POOLED)])
def test_a_twelve_turn_chat_keeps_two_pictures_whole(demo_llm, policy, old_tokens):
    """A new 448x448 picture every turn, keep_last_images=2: the visual tokens stop growing at two pictures (plus
    the old ones' markers or pooled tokens), and the prefix cache serves every turn up to the picture that has just
    become old: the block that holds its first changed token, and nothing after it."""
    prompts = []
    rows = run_chat(demo_llm, chat_turns(seed=7, turns=12), policy, keep_last=2, prompts=prompts)
    vision_start = demo_llm.engine.model.config.vision_start_token_id
    for t, row in enumerate(rows, start=1):
        assert row["visual_tokens"] == min(t, 2) * TOKENS_PER_PICTURE + max(0, t - 2) * old_tokens, row
        if t >= 3:  # picture t - 2 has just become old; in the previous prompt it was the (t-3)-th shown whole
            shown_before = 0 if policy == "drop" else t - 3
            start = nth_picture_start(prompts[t - 2], shown_before, vision_start)
            # drop replaces the picture from its <|vision_start|> on; compress keeps that and changes its tokens
            changed = start if policy == "drop" else start + 1
            assert row["changed_at"] == changed if policy == "drop" else row["changed_at"] > changed, (t, row)
            assert row["cached_tokens"] == changed // BLOCK * BLOCK, (t, row)
    assert_no_leaks(demo_llm)


def test_drop_is_the_chat_with_markers_written_in(demo_llm):
    """The oracle of "drop": the same chat written with the marker text in place of each old picture gives the
    same prompt and the same greedy answer."""
    turns = chat_turns(seed=3, turns=4)
    messages = [user_turn(*turn) for turn in turns]
    by_hand = [{"role": "user", "content": [{"type": "text", "text": DROPPED_MARKER},
                                            {"type": "text", "text": qa.question}]} for _, qa in turns[:2]]
    params = SamplingParams(temperature=0.0, max_tokens=8)
    dropped = demo_llm.chat(messages, params, use_tqdm=False,
                            mm_processor_kwargs={"old_image_policy": "drop", "keep_last_images": 2})[0]
    written = demo_llm.chat(by_hand + messages[2:], params, use_tqdm=False)[0]
    assert dropped.prompt_token_ids == written.prompt_token_ids
    assert dropped.outputs[0].token_ids == written.outputs[0].token_ids
    assert dropped.metrics.num_visual_tokens == 2 * TOKENS_PER_PICTURE


@pytest.mark.parametrize("policy", ["drop", "downscale:6272", "compress:prune:0.3", "keep"])
def test_every_policy_is_exact_against_the_dense_reference(demo_llm, policy):
    """Old pictures changed, new ones whole, in one prompt: the engine's tokens equal the dense reference's on the
    same prepared prompt, whatever the batching, for each policy."""
    prompts = []
    for seed in range(3):
        messages = [user_turn(*turn) for turn in chat_turns(seed=20 + seed, turns=3 + seed)]
        text, images = demo_llm.tokenizer.apply_chat_template(messages)
        prompts.append({"prompt": text, "multi_modal_data": {"image": images},
                        "mm_processor_kwargs": {"old_image_policy": policy, "keep_last_images": 1}})
    params = [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)] * len(prompts)
    outputs = assert_engine_matches_reference(demo_llm, prompts, params)
    if policy == "downscale:6272":  # 448x448 under 6272 pixels: 70x70 (84x84 is 7056), 5x5 tokens of 14x14 pixels
        assert [out.metrics.num_visual_tokens for out in outputs] == [
            TOKENS_PER_PICTURE + 25 * (len(p["multi_modal_data"]["image"]) - 1) for p in prompts]


@pytest.mark.parametrize("kwargs, field", [
    ({"keep_last_images": 0}, "keep_last_images"), ({"keep_last_images": "2"}, "keep_last_images"),
    ({"keep_last_images": True}, "keep_last_images"), ({"old_image_policy": "shrink"}, "old_image_policy"),
    ({"old_image_policy": "downscale:lots"}, "old_image_policy"), ({"old_image_policy": 3}, "old_image_policy"),
    ({"old_image_policy": "compress:blur:0.5"}, "old_image_policy"),
    ({"old_image_policy": "compress:pool:2"}, "old_image_policy")])
def test_a_bad_setting_is_an_error_naming_the_field(demo_llm, kwargs, field):
    prompt = {"prompt": "hello", "mm_processor_kwargs": kwargs}
    with pytest.raises(InvalidInputError, match=field):
        demo_llm.generate([prompt], SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match=field):
        EngineConfig(**kwargs)
    with pytest.raises(ValueError, match=field):
        EngineConfig(mm_processor_kwargs=kwargs)
    assert_no_leaks(demo_llm)


def test_the_engine_setting_may_come_through_mm_processor_kwargs_once():
    config = EngineConfig(mm_processor_kwargs={"old_image_policy": "compress:pool:0.50", "keep_last_images": 3})
    assert (config.old_image_policy, config.keep_last_images) == (parse_old_image_policy("compress:pool:0.5"), 3)
    assert EngineConfig(old_image_policy="drop", mm_processor_kwargs={"old_image_policy": "drop"}).old_image_policy \
        == OldImagePolicy("drop")
    with pytest.raises(ValueError, match="given twice"):
        EngineConfig(old_image_policy="drop", mm_processor_kwargs={"old_image_policy": "keep"})


def test_downscale_never_enlarges_a_small_old_picture(demo_llm):
    """A 56x56 picture (8x8 patches of 7 pixels, merged 2x2: 16 tokens) stays 16 tokens when it becomes old, though
    downscale:6272 would allow 70x70 (25 tokens)."""
    from helpers import random_image

    images = [random_image(56, 56, seed=1), random_image(448, 448, seed=2)]
    prompt = {"prompt": "<|vision_start|><|image_pad|><|vision_end|><|vision_start|><|image_pad|><|vision_end|>hi",
              "multi_modal_data": {"image": images},
              "mm_processor_kwargs": {"old_image_policy": "downscale:6272", "keep_last_images": 1}}
    prepared = demo_llm.engine.prepare(prompt, None)
    assert [im.num_tokens for im in prepared.images] == [16, TOKENS_PER_PICTURE]


def test_drop_refuses_a_malformed_placeholder_as_keep_does(demo_llm):
    from helpers import random_image

    prompt = {"prompt": "<|image_pad|> and <|vision_start|><|image_pad|><|vision_end|>",
              "multi_modal_data": {"image": [random_image(56, 56, seed=1), random_image(56, 56, seed=2)]}}
    for policy in ("keep", "drop"):
        with pytest.raises(InvalidInputError, match="placeholder"):
            demo_llm.engine.prepare({**prompt, "mm_processor_kwargs": {"old_image_policy": policy,
                                                                         "keep_last_images": 1}}, None)


def test_the_server_takes_the_policy_per_request_and_answers_400_naming_the_field(demo_llm):
    turns = chat_turns(seed=5, turns=3)
    picture_urls = []
    for picture, _ in turns:
        buffer = io.BytesIO()
        picture.save(buffer, format="PNG")
        picture_urls.append(data_url(buffer.getvalue()))
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": qa.question}]}
                for url, (_, qa) in zip(picture_urls, turns)]
    body = {"model": "demo", "messages": messages, "max_tokens": 4, "temperature": 0,
            "mm_processor_kwargs": {"old_image_policy": "drop", "keep_last_images": 1}}
    with BackgroundServer(Server(demo_llm, ServerConfig("demo"))) as url:
        ok = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
        bad = httpx.post(f"{url}/v1/chat/completions", timeout=60,
                         json={**body, "mm_processor_kwargs": {"keep_last_images": -1}})
        unknown = httpx.post(f"{url}/v1/chat/completions", timeout=60,
                             json={**body, "mm_processor_kwargs": {"old_image_policy": "forget"}})
    assert ok.status_code == 200 and ok.json()["usage"]["visual_tokens"] == TOKENS_PER_PICTURE
    assert bad.status_code == 400 and "keep_last_images" in bad.json()["error"]["message"]
    assert unknown.status_code == 400 and "old_image_policy" in unknown.json()["error"]["message"]
    assert_no_leaks(demo_llm)


def test_the_server_flags_become_engine_arguments():
    args = parse_args(["--demo", "--old-image-policy", "compress:pool:0.25", "--keep-last-images", "3"])
    assert _long_chat_args(args) == {"old_image_policy": "compress:pool:0.25", "keep_last_images": 3}
    assert _long_chat_args(parse_args(["--demo"])) == {}


def test_policies_parse_as_documented():
    assert parse_old_image_policy("keep") == OldImagePolicy("keep")
    assert parse_old_image_policy("downscale:50176").max_pixels == 50176
    compress = parse_old_image_policy("compress:pool:0.25").compression
    assert (compress.method, compress.keep_ratio) == ("pool", 0.25)
    with pytest.raises(InvalidInputError, match="keep, drop, downscale"):
        parse_old_image_policy("drop:3")
