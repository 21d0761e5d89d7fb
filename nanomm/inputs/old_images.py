"""Long chats: what becomes of a conversation's older pictures, so that its visual tokens stop growing.

Lesson: lessons/16-long-conversations.md.

A chat client sends the whole conversation every turn, pictures included. With a new picture each turn, turn t
carries t pictures' visual tokens: prefill work (unless the prefix cache holds them), KV blocks while the turn
runs, and attention work for every token after them. `old_image_policy` says what a prompt's pictures older than
its last `keep_last_images` become:

- "keep" (the default): nothing changes;
- "drop": each old picture becomes a short text marker (`DROPPED_MARKER`), and is never decoded;
- "downscale:<max_pixels>": each old picture is resized under a lower pixel cap, so it has fewer tokens;
- "compress:<method>:<ratio>": lesson 10's visual-token compression, for old pictures only.

The policy is applied to each prompt on its own, with no memory of earlier turns: a picture is old when K newer
ones follow it in the same prompt. So each turn changes exactly one picture, the one that has just fallen out of
the last K, and everything before it is what the previous turn sent (an old picture becomes the same marker, the
same small picture or the same compressed tokens every time). The prefix cache therefore serves each turn up to
that picture, and the tokens after it are computed again: the price of a bounded conversation, which the lesson
measures.
"""

from dataclasses import dataclass

from nanomm.errors import InvalidInputError, check_int
from nanomm.inputs.compression import CompressionPolicy, parse_policy

KINDS = ("keep", "drop", "downscale", "compress")
DROPPED_MARKER = "(an earlier picture, not shown)"
DEFAULT_KEEP_LAST_IMAGES = 2


@dataclass(frozen=True)
class OldImagePolicy:
    kind: str  # one of KINDS
    max_pixels: int | None = None  # "downscale": the old pictures' pixel cap
    compression: CompressionPolicy | None = None  # "compress": the old pictures' policy


def parse_old_image_policy(value, name: str = "old_image_policy") -> OldImagePolicy:
    """"keep", "drop", "downscale:<max_pixels>" or "compress:<method>:<keep_ratio>" (an OldImagePolicy passes
    through); anything else is an InvalidInputError naming `name`."""
    if isinstance(value, OldImagePolicy):
        return value
    hint = "write keep, drop, downscale:MAX_PIXELS or compress:METHOD:KEEP_RATIO (e.g. compress:pool:0.25)"
    if not isinstance(value, str):
        raise InvalidInputError(f"{name} must be a string; {hint}; got {value!r:.80}")
    kind, _, argument = value.partition(":")
    if kind in ("keep", "drop") and not argument:
        return OldImagePolicy(kind)
    if kind == "downscale" and argument:
        try:
            max_pixels = int(argument)
        except ValueError:
            raise InvalidInputError(f"{name}: {argument!r} is not a pixel count; {hint}") from None
        return OldImagePolicy(kind, max_pixels=check_int(max_pixels, f"{name}: downscale's max_pixels",
                                                         error=InvalidInputError))
    if kind == "compress" and argument:
        method, _, ratio = argument.partition(":")
        try:
            policy = parse_policy({"method": method, "keep_ratio": float(ratio)}, f"{name}: compress")
        except ValueError as exc:  # InvalidInputError is one; float() raises the plain kind
            detail = str(exc) if isinstance(exc, InvalidInputError) else f"{ratio!r} is not a keep ratio"
            raise InvalidInputError(f"{name}: {detail}; {hint}") from None
        return OldImagePolicy(kind, compression=policy)  # ratio 1 (no compression) is keep
    raise InvalidInputError(f"{name}: unknown policy {value!r:.80}; {hint}")


def check_keep_last_images(value, name: str = "keep_last_images") -> int:
    """How many of a prompt's last pictures stay whole: an integer of 1 or more."""
    return check_int(value, name, error=InvalidInputError)


@dataclass(frozen=True)
class OldImages:
    """A prompt's long-chat setting: the policy, and how many of its last pictures it spares."""
    policy: OldImagePolicy
    keep_last: int

    def num_old(self, num_images: int) -> int:
        """How many of a prompt's pictures, from the first, the policy applies to."""
        return 0 if self.policy.kind == "keep" else max(0, num_images - self.keep_last)

    def drop(self, token_ids: list[int], images: list, ids: "PlaceholderIds") -> tuple[list[int], list]:
        """token_ids with each old picture's placeholder, <|vision_start|><|image_pad|><|vision_end|>, replaced by
        the marker's tokens, and the pictures that remain. Nothing changes unless the policy is "drop"."""
        num_old = self.num_old(len(images)) if self.policy.kind == "drop" else 0
        if num_old == 0:
            return token_ids, images
        pads = [p for p, token in enumerate(token_ids) if token == ids.image][:num_old]
        out, start = [], 0
        for p in pads:
            if not (0 < p < len(token_ids) - 1 and token_ids[p - 1] == ids.vision_start
                    and token_ids[p + 1] == ids.vision_end):
                raise InvalidInputError(f"image placeholder at token {p} is not <|vision_start|><|image_pad|>"
                                        "<|vision_end|> with a single <|image_pad|>")
            out += token_ids[start:p - 1] + ids.marker  # up to the picture's <|vision_start|>, then the marker
            start = p + 2  # past its <|vision_end|>
        return out + token_ids[start:], images[num_old:]

    def settings(self, index: int, num_images: int, prompt_settings: "ImageSettings",
                 engine_min_pixels: int, engine_max_pixels: int) -> "ImageSettings":
        """The pixel cap and compression of picture `index` of `num_images`: the prompt's own, unless the picture is
        old and the policy is downscale or compress."""
        if index >= self.num_old(num_images) or self.policy.kind not in ("downscale", "compress"):
            return prompt_settings
        if self.policy.kind == "compress":
            return ImageSettings(prompt_settings.pixel_kwargs, self.policy.compression)
        kwargs = prompt_settings.pixel_kwargs
        cap = min(self.policy.max_pixels, kwargs.get("max_pixels", engine_max_pixels))
        floor = min(kwargs.get("min_pixels", engine_min_pixels), cap)  # a small picture is never enlarged
        return ImageSettings({**kwargs, "max_pixels": cap, "min_pixels": floor}, prompt_settings.compression)


@dataclass(frozen=True)
class ImageSettings:
    """How one picture is preprocessed: its pixel cap (min_pixels, max_pixels) and its compression."""
    pixel_kwargs: dict
    compression: CompressionPolicy | None


@dataclass(frozen=True)
class PlaceholderIds:
    """The token ids that `OldImages.drop` reads and writes."""
    image: int
    vision_start: int
    vision_end: int
    marker: list[int]

