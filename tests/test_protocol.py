"""protocol.py's request parsers without a server: a decode instance's continuation (a body whose
kv_transfer_params is a handoff) reads the sampling fields exactly as the full chat and completion parsers do,
needs no messages or prompt, and never reads those it still carries."""

import pytest

from nanomm import InvalidInputError, SamplingParams
from nanomm.inputs.tokenizer import Tokenizer
from nanomm.serve import protocol

DEFAULTS = SamplingParams(temperature=0.7, top_p=0.8, top_k=20)  # a model's generation defaults
HANDOFF = {"kv_transfer_params": {"transfer_id": "t", "prompt_token_ids": [1, 2]}}  # checked by the server, not here
MESSAGES = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                                         {"type": "text", "text": "what is it"}]}]
SAMPLING = {  # the fields a client may send, as each endpoint spells its logprobs
    "defaults": ({}, {}),
    "greedy, capped": ({"temperature": 0, "max_tokens": 5, "stream": True}, {"temperature": 0, "max_tokens": 5}),
    "seeded, stops": ({"seed": 3, "stop": ["\n"], "min_tokens": 2, "ignore_eos": True}, {"seed": 3, "stop": "x"}),
    "logprobs": ({"logprobs": True, "top_logprobs": 3}, {"logprobs": 3}),
    "logprobs, no top": ({"logprobs": True}, {"logprobs": 0}),
    "logprobs off": ({"logprobs": False, "max_completion_tokens": 4}, {"logprobs": None, "n": 1}),
    "vLLM extras": ({"repetition_penalty": 1.1, "min_p": 0.1, "stop_token_ids": [2]}, {"top_k": 5, "min_p": 0.2}),
}
REFUSED = {  # (chat fields, completion fields, words the message names)
    "an unknown field": ({"functions": []}, {"tools": []}, "functions|tools"),
    "a bad temperature": ({"temperature": -1}, {"temperature": -1}, "temperature"),
    "stream not a bool": ({"stream": "yes"}, {"stream": "yes"}, "stream"),
    "logprobs of the other endpoint": ({"logprobs": 2}, {"logprobs": True}, "logprobs"),
    "an option alone or unsupported": ({"top_logprobs": 2}, {"echo": True}, "top_logprobs|echo"),
}


@pytest.fixture(scope="module")
def tokenizer(ckpt):
    return Tokenizer.from_pretrained(ckpt)


def full_chat(fields: dict, tokenizer) -> protocol.ChatRequest:
    return protocol.parse_chat({"messages": MESSAGES, **fields}, tokenizer, DEFAULTS, None)


def full_completion(fields: dict) -> protocol.ChatRequest:
    return protocol.parse_completion({"prompt": "the cat sat", **fields}, DEFAULTS)


def same_request(a: protocol.ChatRequest, b: protocol.ChatRequest) -> None:
    assert (a.params, a.stream, a.num_top_logprobs, a.chat) == (b.params, b.stream, b.num_top_logprobs, b.chat)


def test_a_continuation_needs_no_messages_or_prompt():
    for chat in (True, False):
        parsed = protocol.parse_continuation({**HANDOFF, "max_tokens": 4, "temperature": 0}, DEFAULTS, chat)
        assert parsed.prompt == {"prompt": None} and parsed.chat is chat
        assert (parsed.params.max_tokens, parsed.params.temperature, parsed.params.top_k) == (4, 0, 20)
        assert parsed.id.startswith("chatcmpl-" if chat else "cmpl-")


@pytest.mark.parametrize("case", SAMPLING)
def test_a_continuation_reads_the_sampling_fields_as_the_full_parsers_do(case, tokenizer):
    chat_fields, completion_fields = SAMPLING[case]
    same_request(protocol.parse_continuation({**HANDOFF, **chat_fields}, DEFAULTS, chat=True),
                 full_chat(chat_fields, tokenizer))
    same_request(protocol.parse_continuation({**HANDOFF, **completion_fields}, DEFAULTS, chat=False),
                 full_completion(completion_fields))


@pytest.mark.parametrize("case", REFUSED)
def test_a_continuation_refuses_what_the_full_parsers_refuse_in_the_same_words(case, tokenizer):
    chat_fields, completion_fields, words = REFUSED[case]
    for chat, fields, full in ((True, chat_fields, lambda: full_chat(chat_fields, tokenizer)),
                               (False, completion_fields, lambda: full_completion(completion_fields))):
        with pytest.raises(InvalidInputError, match=words) as refused:
            protocol.parse_continuation({**HANDOFF, **fields}, DEFAULTS, chat)
        with pytest.raises(InvalidInputError) as full_refused:
            full()
        assert str(refused.value) == str(full_refused.value)


def test_a_continuation_carrying_its_messages_or_prompt_does_not_read_them(tokenizer):
    """A whole client body, messages and all, is a continuation too; messages the full parser would refuse
    (an http image, no list at all) are not looked at."""
    fields = {"max_tokens": 3, "logprobs": True, "top_logprobs": 1}
    whole = protocol.parse_continuation({**HANDOFF, "messages": MESSAGES, **fields}, DEFAULTS, chat=True)
    same_request(whole, full_chat(fields, tokenizer))
    assert whole.prompt == {"prompt": None}
    http_image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x/cat.png"}}]}]
    for messages in (http_image, "not a list"):
        with pytest.raises(InvalidInputError):
            full_chat({"messages": messages}, tokenizer)
        assert protocol.parse_continuation({**HANDOFF, "messages": messages}, DEFAULTS, chat=True).prompt == \
            {"prompt": None}
    completion = protocol.parse_continuation({**HANDOFF, "prompt": ["two", "prompts"]}, DEFAULTS, chat=False)
    assert completion.prompt == {"prompt": None}
