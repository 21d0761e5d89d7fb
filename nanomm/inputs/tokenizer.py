"""Text in, token ids out: the Qwen2-VL tokenizer, chat template and image placeholders.

A Qwen2-VL prompt is ordinary byte-level BPE text plus a few special tokens. Each image appears in the
prompt as `<|vision_start|><|image_pad|><|vision_end|>` with ONE `<|image_pad|>`; before the model runs,
that single pad becomes as many pads as the image has visual tokens (grid_t * grid_h * grid_w // merge**2),
so that every visual embedding has a position of its own in the sequence.

This module does three things:
- `Tokenizer.encode` / `decode`: a thin wrapper over the `tokenizers` library (no transformers).
- `Tokenizer.apply_chat_template`: the Qwen2-VL instruct chat template, written out in Python. It produces
  exactly the text that the Jinja template in `CHAT_TEMPLATE` produces (the tests check this against
  transformers) and returns the pictures and videos in the order their placeholders appear (a video as a
  `VideoPart`; `multi_modal_data` sorts them into vLLM's {"image": [...], "video": [...]}).
- `Tokenizer.expand_visual_placeholders`: the single-pad -> n-pads expansion, for `<|image_pad|>` and for
  `<|video_pad|>` (`<|vision_start|><|video_pad|><|vision_end|>`, lesson 17).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream

from nanomm.errors import CheckpointError, InvalidInputError
from nanomm.inputs.processor_cache import MediaWithUuid
from nanomm.model.config import read_checkpoint_json

IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO_PLACEHOLDER = "<|vision_start|><|video_pad|><|vision_end|>"
DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."  # Qwen2-VL's and Qwen2.5-VL's templates add it; Qwen3-VL's not
NO_DEFAULT_SYSTEM_PROMPT = ("qwen3_vl",)  # config.json model types whose chat template adds no system turn
ROLES = ("system", "user", "assistant", "tool")

# The Qwen2-VL-*-Instruct chat template, verbatim. It is written into tokenizer_config.json by
# nanomm.tools.tokenizers so that transformers (the test oracle) renders the same prompts we do.
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass(frozen=True)
class VideoPart:
    """A chat's video, in `apply_chat_template`'s list of media: a clip for `nanomm.inputs.video_io.load_video`."""
    source: object


def multi_modal_data(media: list) -> dict:
    """A chat's media, in order -> vLLM's multi_modal_data: {"image": [...], "video": [...]}, the empty ones left out.
    A part the client named by a uuid gives its data (None if it sent the uuid alone)."""
    return {key: [_data(m) for m in items] for key, items in _by_kind(media) if items}


def multi_modal_uuids(media: list) -> dict | None:
    """The uuids the chat's parts carry, as vLLM's multi_modal_uuids ({"image": [uuid or None, ...], ...}); None
    if no part carries one."""
    named = {key: [m.uuid if isinstance(m, MediaWithUuid) else None for m in items] for key, items in _by_kind(media)
             if items}
    return named if any(u is not None for uuids in named.values() for u in uuids) else None


def media_prompt(text: str, media: list) -> dict:
    """A rendered chat and its media -> a prompt for the engine (with multi_modal_uuids where parts carry uuids)."""
    prompt = {"prompt": text, "multi_modal_data": multi_modal_data(media)}
    uuids = multi_modal_uuids(media)
    if uuids is not None:
        prompt["multi_modal_uuids"] = uuids
    return prompt


def map_media_sources(media: list, source_of) -> list:
    """Each part's data replaced by `source_of(data, "an image" or "a video")`, its VideoPart and uuid kept; a part
    sent as a uuid alone has no data to map."""
    def mapped(m, what):
        if isinstance(m, MediaWithUuid):
            return m if m.data is None else MediaWithUuid(source_of(m.data, what), m.uuid)
        return source_of(m, what)

    return [VideoPart(mapped(m.source, "a video")) if isinstance(m, VideoPart) else mapped(m, "an image")
            for m in media]


def _by_kind(media: list) -> tuple:
    """(("image", pictures), ("video", videos)): each video's VideoPart unwrapped."""
    return (("image", [m for m in media if not isinstance(m, VideoPart)]),
            ("video", [m.source for m in media if isinstance(m, VideoPart)]))


def _data(m):
    return m.data if isinstance(m, MediaWithUuid) else m


class Tokenizer:
    """The Qwen2-VL tokenizer of one checkpoint folder, with its special-token ids."""

    def __init__(self, tokenizer: HFTokenizer, *, image_token_id: int, vision_start_token_id: int,
                 vision_end_token_id: int, eos_token_ids: list[int], pad_token_id: int | None,
                 default_system_prompt: str | None = DEFAULT_SYSTEM_PROMPT, video_token_id: int | None = None):
        self.tokenizer = tokenizer
        self.default_system_prompt = default_system_prompt  # the system turn a chat without one gets, if any
        self.image_token_id = image_token_id
        self.video_token_id = video_token_id  # None: a tokenizer without <|video_pad|>
        self.vision_start_token_id = vision_start_token_id
        self.vision_end_token_id = vision_end_token_id
        self.eos_token_ids = eos_token_ids
        self.pad_token_id = pad_token_id
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)

    @classmethod
    def from_pretrained(cls, folder, *, image_token_id=None, vision_start_token_id=None,
                        vision_end_token_id=None, video_token_id=None) -> "Tokenizer":
        """Load folder/tokenizer.json. Special ids default to the tokenizer's own ids for the Qwen tokens;
        the model loader passes the ids from config.json, which are the ones the model was trained with."""
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise CheckpointError(f"{folder} has no tokenizer.json")
        tok = HFTokenizer.from_file(str(path))

        def token_id(token: str, given: int | None) -> int:
            if given is not None:
                return int(given)
            found = tok.token_to_id(token)
            if found is None:
                raise CheckpointError(f"{path} has no {token} token; pass its id explicitly")
            return found

        config = read_checkpoint_json(folder / "config.json", required=False)
        generation = read_checkpoint_json(folder / "generation_config.json", required=False)
        eos = generation.get("eos_token_id", config.get("eos_token_id",
                                                       config.get("text_config", {}).get("eos_token_id")))
        if eos is None:
            eos = token_id("<|im_end|>", None)
        pad = generation.get("pad_token_id", config.get("pad_token_id"))
        if pad is None:
            pad = tok.token_to_id("<|endoftext|>")
        return cls(tok,
                   image_token_id=token_id("<|image_pad|>", image_token_id),
                   vision_start_token_id=token_id("<|vision_start|>", vision_start_token_id),
                   vision_end_token_id=token_id("<|vision_end|>", vision_end_token_id),
                   eos_token_ids=[int(e) for e in (eos if isinstance(eos, list) else [eos])],
                   pad_token_id=pad, default_system_prompt=None if config.get("model_type") in
                   NO_DEFAULT_SYSTEM_PROMPT else DEFAULT_SYSTEM_PROMPT,
                   video_token_id=video_token_id if video_token_id is not None else tok.token_to_id("<|video_pad|>"))

    def encode(self, text: str) -> list[int]:
        # Special tokens written in the text (<|im_start|>, <|image_pad|>, ...) become single ids because
        # they are "added tokens" of the tokenizer. Qwen adds no BOS, so add_special_tokens is irrelevant.
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, tokenize: bool | None = None,
                            tools: list[dict] | None = None):
        """Render an OpenAI-style conversation as Qwen2-VL prompt text. Returns (text, media in order): each
        picture's source, and each video as a `VideoPart`. `tools` (OpenAI function tools), assistant turns'
        `tool_calls` and `role: "tool"` messages are written as Qwen's templates write them (tool_prompt.py).

        With `tokenize` given, it answers as a Hugging Face tokenizer does, for scripts written for vLLM's
        `llm.get_tokenizer()`: the text alone (tokenize=False) or its token ids (tokenize=True)."""
        if tokenize is not None:
            text, _ = self.apply_chat_template(messages, add_generation_prompt, tools=tools)
            return self.encode(text) if tokenize else text
        if not isinstance(messages, (list, tuple)) or not messages:
            raise InvalidInputError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
        pieces, images = [], []
        first_is_system = _message_role(messages[0], 0) == "system"
        if tools is not None:  # the system turn carries the tools (tool_prompt.py); the first system message is in it
            from nanomm.inputs.tool_prompt import check_tools, tools_system_turn  # loaded by the first chat with tools

            system = (_render_content(messages[0].get("content"), 0, images) if first_is_system
                      else self.default_system_prompt)
            pieces.append(tools_system_turn(system, check_tools(tools)))
        elif not first_is_system and self.default_system_prompt is not None:
            pieces.append(f"<|im_start|>system\n{self.default_system_prompt}<|im_end|>\n")
        for i, message in enumerate(messages):
            if i == 0 and first_is_system and tools is not None:
                continue
            pieces.append(self._render_turn(messages, i, images))
        if add_generation_prompt:
            pieces.append("<|im_start|>assistant\n")
        return "".join(pieces), images

    def _render_turn(self, messages, i: int, images: list) -> str:
        """Message i as a turn: `<|im_start|>role\ncontent<|im_end|>\n`, its tool calls after an assistant's
        content; a tool message is a `<tool_response>` block in a user turn shared with its neighbours."""
        message = messages[i]
        role = _message_role(message, i)
        calls = message.get("tool_calls") if role == "assistant" else None
        if "content" not in message and not calls:
            raise InvalidInputError(f"message {i} has no 'content'")
        content = "" if calls and message.get("content") is None else _render_content(message["content"], i, images)
        if role == "tool" or calls:
            from nanomm.inputs.tool_prompt import tool_call_blocks, tool_response  # loaded by the first tool turn
        if role == "tool":
            return tool_response(content, first=i == 0 or messages[i - 1].get("role") != "tool",
                                 last=i == len(messages) - 1 or messages[i + 1].get("role") != "tool")
        if calls:
            content = tool_call_blocks(content, calls, i)
        return f"<|im_start|>{role}\n{content}<|im_end|>\n"

    def expand_image_placeholders(self, ids: list[int], tokens_per_image: list[int]) -> list[int]:
        """Replace the i-th single <|image_pad|> by tokens_per_image[i] copies of it."""
        return self.expand_visual_placeholders(ids, [(self.image_token_id, n) for n in tokens_per_image])

    def expand_visual_placeholders(self, ids: list[int], items: list[tuple[int, int | list[int]]]) -> list[int]:
        """items: (pad id, visual tokens) of each picture or video, in prompt order. The i-th single pad of
        either kind becomes items[i]'s count of copies of it, or items[i]'s own token list (a Qwen3-VL video: its
        temporal patches with their times); it must be of items[i]'s kind."""
        pads = {self.image_token_id} | {pad for pad, _ in items}  # a <|video_pad|> with no video is text
        positions = [p for p, t in enumerate(ids) if t in pads]
        if len(positions) != len(items):
            kind = "image" if pads == {self.image_token_id} else "image or video"
            raise InvalidInputError(f"the prompt has {len(positions)} {kind} placeholder(s) but {len(items)} "
                                    f"{kind}(s) were given")
        for k, (p, (pad, n)) in enumerate(zip(positions, items)):
            well_formed = (0 < p < len(ids) - 1 and ids[p - 1] == self.vision_start_token_id
                           and ids[p + 1] == self.vision_end_token_id)
            placeholder = IMAGE_PLACEHOLDER if pad == self.image_token_id else VIDEO_PLACEHOLDER
            if not well_formed or ids[p] != pad:
                raise InvalidInputError(f"placeholder {k} (token {p}) is not {placeholder} with a single pad "
                                        "(is the prompt already expanded?)")
            if not (isinstance(n, list) and pad in n) and (not isinstance(n, int) or n < 1):
                raise InvalidInputError(f"an image or video must have at least one visual token, got {n!r:.80}")
        out, start = [], 0
        for p, (pad, n) in zip(positions, items):
            out += ids[start:p]
            out += n if isinstance(n, list) else [pad] * n
            start = p + 1
        return out + ids[start:]


class IncrementalDetokenizer:
    """Text deltas for tokens arriving one at a time (streaming).

    Byte-level BPE splits many characters (accents, CJK, emoji) over several tokens; `tokenizers`'
    DecodeStream holds the bytes back until they form whole UTF-8 characters, so no delta is ever half a char.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer.tokenizer
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self.text = ""

    def step(self, token_id: int) -> str:
        piece = self._stream.step(self._tokenizer, token_id) or ""
        self.text += piece
        return piece


def _message_role(message, i: int) -> str:
    if not isinstance(message, dict):
        raise InvalidInputError(f"message {i} must be a dict with 'role' and 'content', got {type(message).__name__}")
    role = message.get("role")
    if role not in ROLES:
        raise InvalidInputError(f"message {i} has role {role!r}; expected one of {', '.join(ROLES)}")
    return role


def _render_content(content, i: int, images: list) -> str:
    """A string is emitted as is; a list of parts is concatenated with no separators, as the template does."""
    if isinstance(content, str):
        return content
    if not isinstance(content, (list, tuple)):
        raise InvalidInputError(f"message {i} content must be a string or a list of parts, "
                                f"got {type(content).__name__}")
    return "".join(_render_part(part, i, j, images) for j, part in enumerate(content))


def _part_uuid(part: dict, where: str) -> str | None:
    uuid = part.get("uuid")
    if uuid is not None and not (isinstance(uuid, str) and uuid):
        raise InvalidInputError(f"{where}: 'uuid' must be a non-empty string, got {uuid!r:.80}")
    return uuid


def _named(data, uuid: str | None):
    """A part's data, wrapped with its uuid if it carries one."""
    return data if uuid is None else MediaWithUuid(data, uuid)


def _render_part(part, i: int, j: int, images: list) -> str:
    where = f"message {i} part {j}"
    if not isinstance(part, dict) or "type" not in part:
        raise InvalidInputError(f"{where} must be a dict with a 'type' key")
    kind = part["type"]
    if kind == "text":
        if not isinstance(part.get("text"), str):
            raise InvalidInputError(f"{where} is a text part without a string 'text'")
        return part["text"]
    uuid = _part_uuid(part, where)  # vLLM's: with a uuid the processor cache holds, the data may be left out
    if kind == "image":
        if part.get("image") is None and uuid is None:
            raise InvalidInputError(f"{where} is an image part without an 'image'")
        images.append(_named(part.get("image"), uuid))
        return IMAGE_PLACEHOLDER
    if kind == "image_url":
        url = part.get("image_url")
        url = url.get("url") if isinstance(url, dict) else url
        if not isinstance(url, str) and not (url is None and uuid is not None):
            raise InvalidInputError(f"{where} is an image_url part without a string 'image_url' or 'image_url.url'")
        images.append(_named(url, uuid))
        return IMAGE_PLACEHOLDER
    if kind in ("video", "video_url"):
        source = part.get(kind)
        source = source.get("url") if kind == "video_url" and isinstance(source, dict) else source
        if (source is None and uuid is None) or (kind == "video_url" and not isinstance(source, (str, type(None)))):
            raise InvalidInputError(f"{where} is a {kind} part without a " + ("'video'" if kind == "video" else
                                    "string 'video_url' or 'video_url.url'"))
        images.append(VideoPart(_named(source, uuid)))
        return VIDEO_PLACEHOLDER
    raise InvalidInputError(f"{where} has type {kind!r}; expected 'text', 'image', 'image_url', 'video' or "
                            "'video_url'")
