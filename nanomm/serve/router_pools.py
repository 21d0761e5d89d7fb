"""The router's pools (serve/router.py): each role's instances, the work each holds, and the work a request brings.

The router loads no model, so a request's work is an estimate from its body alone:

- visual tokens (`estimated_visual_tokens`): each data-URL image's size, at 28 x 28 pixels a token (Qwen2-VL's
  14-pixel patches, 2 x 2 merged), read from the image's header; what an encoder or a prefill instance spends;
- prompt tokens (`estimated_prompt_tokens`): those visual tokens, plus the prompt's text at about 4 characters a
  token; what an engine that takes whole requests (dp<N>, <X>e<Y>pd) spends before its first token.
"""

import base64
import binascii
import io
import math
from dataclasses import dataclass, field

from PIL import Image

from nanomm.serve.affinity import CacheAffinity, PromptKeys

PIXELS_PER_TOKEN = 28 * 28  # Qwen2-VL: 14 x 14 patches, 2 x 2 of them merged into one token
CHARACTERS_PER_TOKEN = 4  # English text in a BPE vocabulary, roughly


@dataclass
class Pool:
    """One role's instances, the work each holds now, and how many requests each was sent in all."""
    role: str
    urls: list[str]
    outstanding: dict[str, float] = field(default_factory=dict)
    routed: dict[str, int] = field(default_factory=dict)
    affinity: CacheAffinity | None = None  # --routing affinity: where each request's prefix and pictures went

    def __post_init__(self):
        self.urls = [u.rstrip("/") for u in self.urls]
        self.outstanding = {u: 0.0 for u in self.urls}
        self.routed = {u: 0 for u in self.urls}

    def pick(self, work: float, keys: PromptKeys | None = None) -> str:
        """The instance with the least outstanding work, charged `work` until `done`. Among equals, the one sent
        the fewest requests so far (then the first): one request at a time still goes round the pool. With
        affinity and the request's `keys`: the instance its cache entries went to, within the slack
        (serve/affinity.py)."""
        url = min(self.urls, key=lambda u: (self.outstanding[u], self.routed[u]))
        if self.affinity is not None and keys is not None:
            url = self.affinity.pick(keys, self.outstanding, url)
        self.outstanding[url] += work
        self.routed[url] += 1
        return url

    def done(self, url: str, work: float) -> None:
        self.outstanding[url] -= work


def estimated_visual_tokens(body: dict) -> float:
    """The visual tokens of a chat request's data-URL images, from their sizes alone (headers are enough)."""
    tokens = 0.0
    for part in _content_parts(body):
        url = (part.get("image_url") or {}).get("url", "")
        if isinstance(url, str) and url.startswith("data:") and "," in url:
            try:
                width, height = picture_size(url.split(",", 1)[1])
                tokens += max(1, math.ceil(width / 28) * math.ceil(height / 28))
            except (binascii.Error, OSError, ValueError):
                tokens += 1  # the instance will name what is wrong with it
    return tokens


HEADER_BASE64_CHARS = 8192  # the first 6 KB of a picture: where PNG, JPEG, GIF and WebP state their size


def picture_size(payload: str) -> tuple[int, int]:
    """(width, height) of a base64 picture, from its first bytes: the router forwards pictures, it never decodes
    a whole one. A header further in (a JPEG with a large EXIF block) is read from the whole payload."""
    head = payload[:HEADER_BASE64_CHARS]
    try:
        return Image.open(io.BytesIO(base64.b64decode(head))).size
    except (binascii.Error, OSError, ValueError):
        if len(head) == len(payload):
            raise
    return Image.open(io.BytesIO(base64.b64decode(payload))).size


def picture_tokens(payload: str) -> float:
    """One base64 picture's visual tokens from its header (1 when it cannot be read: the engine will say why)."""
    try:
        width, height = picture_size(payload)
    except (binascii.Error, OSError, ValueError):
        return 1.0
    return max(1, math.ceil(width / 28) * math.ceil(height / 28))


def estimated_prompt_tokens(body: dict) -> float:
    """A chat or completion request's prompt tokens: its visual tokens and its text's characters / 4 (at least
    1, so that every request counts)."""
    characters = sum(len(text) for text in _prompt_texts(body))
    return max(1.0, estimated_visual_tokens(body) + math.ceil(characters / CHARACTERS_PER_TOKEN))


def _content_parts(body: dict):
    """Every dict part of a chat request's list contents."""
    for message in body.get("messages") or []:
        content = message.get("content") if isinstance(message, dict) else None
        yield from (part for part in (content if isinstance(content, list) else []) if isinstance(part, dict))


def _prompt_texts(body: dict):
    """Every text of a request's prompt: a completion's prompt (a string or strings), a chat's messages."""
    prompt = body.get("prompt")
    prompts = [prompt] if isinstance(prompt, str) else prompt if isinstance(prompt, list) else []
    yield from (text for text in prompts if isinstance(text, str))
    for message in body.get("messages") or []:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            yield content
    for part in _content_parts(body):
        if isinstance(part.get("text"), str):
            yield part["text"]
