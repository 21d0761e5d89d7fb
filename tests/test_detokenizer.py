"""Streaming text: deltas are whole characters even when byte-level BPE splits one over several tokens."""

import pytest

from nanomm.tools.tokenizers import write_qwen_tokenizer
from nanomm.inputs.tokenizer import IncrementalDetokenizer, Tokenizer

TEXTS = ["héllo wörld", "你好，世界！这是一个测试。", "emoji 🎉🫠🦜 and ñ", "plain ascii text", "mixed 日本語 ok 𓀀"]


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen-tokenizer")
    write_qwen_tokenizer(folder)
    return Tokenizer.from_pretrained(folder)


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_are_whole_characters_and_add_up(qwen, text):
    ids = qwen.encode(text)
    detok = IncrementalDetokenizer(qwen)
    deltas = [detok.step(t) for t in ids]
    assert "".join(deltas) == text == detok.text
    assert all("\ufffd" not in d for d in deltas)  # never half a UTF-8 character


def test_some_character_really_spans_several_tokens(qwen):
    ids = qwen.encode("🫠")  # three byte-level tokens for one character
    assert len(ids) > 1  # otherwise the test above proves nothing about split characters
    detok = IncrementalDetokenizer(qwen)
    assert [detok.step(t) for t in ids] == [""] * (len(ids) - 1) + ["🫠"]


def test_special_tokens_are_skipped_in_text(qwen):
    detok = IncrementalDetokenizer(qwen)
    ids = qwen.encode("done<|im_end|>")
    assert "".join(detok.step(t) for t in ids) == "done"
