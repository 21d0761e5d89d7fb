"""From what a caller sends to what the engine runs: validate a prompt, preprocess its images, expand it.

Lesson: lessons/05-continuous-batching.md (the request path).

Everything here runs before any model compute, so a bad prompt, image or parameter is reported as an
`InvalidInputError` naming the prompt, and nothing in the engine is touched. The output, a `PreparedPrompt`,
holds the expanded token ids, the preprocessed images, where each image's tokens sit, and the M-RoPE
positions, computed once and sliced by every chunk later.
"""

import time
from dataclasses import dataclass, field, replace

import torch
from PIL import Image

from nanomm.model.config import ModelConfig
from nanomm.errors import InvalidInputError, check_int
from nanomm.inputs.compression import CompressionPolicy, parse_policy
from nanomm.inputs.image import ImageProcessorConfig, ProcessedImage, _pixel_cap, preprocess_image
from nanomm.inputs.image_io import encoded_bytes
from nanomm.inputs.old_images import (DEFAULT_KEEP_LAST_IMAGES, DROPPED_MARKER, ImageSettings, OldImagePolicy,
                                      OldImages, PlaceholderIds, check_keep_last_images, parse_old_image_policy)
from nanomm.inputs.processor_cache import MediaWithUuid, ProcessorCache, settings_key
from nanomm.model.rope import mrope_positions, video_time_interval
from nanomm.inputs.tokenizer import Tokenizer

# multi_modal_uuids (vLLM's): {"image": [uuid or None, ...], "video": [...]}, one per item of multi_modal_data; an
# item named by a uuid the processor cache holds may be None there (inputs/processor_cache.py)
PROMPT_KEYS = {"prompt", "prompt_token_ids", "multi_modal_data", "multi_modal_uuids", "mm_processor_kwargs"}
PIXEL_KEYS = {"min_pixels", "max_pixels"}
LONG_CHAT_KEYS = {"old_image_policy", "keep_last_images"}  # inputs/old_images.py
# inputs/video_settings.py REQUEST_KEYS: how a request's videos are sampled and capped (checked there, on use)
VIDEO_KEYS = {"do_sample_frames", "fps", "num_frames", "min_frames", "max_frames", "video_min_pixels",
              "video_max_pixels", "video_pruning_rate"}
PROCESSOR_KEYS = PIXEL_KEYS | {"visual_token_compression"} | LONG_CHAT_KEYS | VIDEO_KEYS


@dataclass(frozen=True)
class ImageSpan:
    """Where one image's tokens sit in a prompt, and what the image is (for hashing and encoding)."""
    start: int
    length: int
    content_hash: str

    @property
    def end(self) -> int:
        return self.start + self.length

    def overlaps(self, start: int, end: int) -> bool:
        """Whether any of this image's tokens lie in positions [start, end)."""
        return self.start < end and self.end > start

    def clip(self, start: int, end: int) -> range:
        """The positions of this image's tokens that lie in [start, end) (empty if none)."""
        return range(max(self.start, start), min(self.end, end))


@dataclass
class PreparedPrompt:
    text: str | None
    token_ids: list[int]  # expanded: one <|image_pad|> per visual token
    images: list[ProcessedImage]
    image_spans: list[ImageSpan]
    # (3, len(token_ids)) M-RoPE ids. A compressed image's rows hold its origin only: the model runner adds each
    # kept token's (t, h, w) from the encoder's output (`_compressed_image_origins`).
    positions: torch.Tensor
    rope_delta: int  # generated token i (0-based over the whole sequence) has position i + rope_delta
    ready_time: float  # time.perf_counter() when it was ready to schedule
    arrival_time: float | None = None  # when the caller handed it in (set by the engine)

    @property
    def num_visual_tokens(self) -> int:
        return sum(span.length for span in self.image_spans)


@dataclass
class ValidatedPrompt:
    """A prompt whose structure is checked and text tokenised; its images are not decoded yet."""
    name: str
    text: str | None
    token_ids: list[int]  # one <|image_pad|> per image, not expanded yet
    raw_images: list
    pixel_kwargs: dict
    compression: CompressionPolicy | None = None  # the request's, else the engine's default
    old_images: OldImages = OldImages(OldImagePolicy("keep"), DEFAULT_KEEP_LAST_IMAGES)  # for downscale and compress
    raw_videos: list = field(default_factory=list)  # clips for nanomm.inputs.video_io.load_video, in prompt order
    video_settings: object = None  # with videos: the engine's VideoSettings with the request's VIDEO_KEYS applied


class InputProcessor:
    """Two phases, so the slow one can run in a worker pool: `validate` (cheap, on the caller's thread)
    checks everything that needs no pixels; `preprocess` decodes and resizes the images and expands the
    prompt."""

    def __init__(self, tokenizer: Tokenizer, model_config: ModelConfig, image_config: ImageProcessorConfig,
                 max_model_len: int, limit_images_per_prompt: int = 16,
                 compression: CompressionPolicy | None = None, old_images: OldImages | None = None,
                 limit_videos_per_prompt: int = 2, no_video_reason: str | None = None, video_settings=None,
                 processor_cache: ProcessorCache | None = None):
        """no_video_reason: why this engine takes no video (a text-only model), or None. video_settings: the
        engine's `VideoSettings` (inputs/video_settings.py); None: the family's, made when the first video comes.
        processor_cache: pictures and videos already preprocessed (processor_cache.py); None: none kept."""
        self.tokenizer, self.model_config, self.image_config = tokenizer, model_config, image_config
        self.max_model_len, self.limit_images_per_prompt = max_model_len, limit_images_per_prompt
        self.compression = compression  # the engine's default visual-token compression (compression.py)
        self.limit_videos_per_prompt, self.no_video_reason = limit_videos_per_prompt, no_video_reason
        self._video_settings = video_settings
        self.processor_cache = processor_cache if processor_cache is not None else ProcessorCache(0)
        self.old_images = old_images or OldImages(OldImagePolicy("keep"), DEFAULT_KEEP_LAST_IMAGES)  # old_images.py
        self.placeholder_ids = PlaceholderIds(model_config.image_token_id, model_config.vision_start_token_id,
                                              model_config.vision_end_token_id, tokenizer.encode(DROPPED_MARKER))

    def validate(self, prompt, name: str = "prompt") -> ValidatedPrompt:
        if isinstance(prompt, str):
            prompt = {"prompt": prompt}
        if not isinstance(prompt, dict):
            raise InvalidInputError(f"{name}: a prompt is a str or a dict, got {type(prompt).__name__}")
        unknown = set(prompt) - PROMPT_KEYS
        if unknown:
            raise InvalidInputError(f"{name}: unknown keys {sorted(unknown)}; allowed: {sorted(PROMPT_KEYS)}")
        text, ids = self._token_ids(prompt, name)
        pixel_kwargs = self._pixel_kwargs(prompt.get("mm_processor_kwargs"), name)
        compression = self.compression
        if "visual_token_compression" in (prompt.get("mm_processor_kwargs") or {}):  # None: none for this one
            compression = parse_policy(prompt["mm_processor_kwargs"]["visual_token_compression"],
                                       f"{name}: mm_processor_kwargs visual_token_compression")
        images, videos = self._media(prompt.get("multi_modal_data"), name)
        images, videos = _with_uuids(images, videos, prompt.get("multi_modal_uuids"), name)
        self._check_counts(ids, images, videos, name)
        old_images = self._old_images(prompt.get("mm_processor_kwargs"), name)
        try:
            ids, images = old_images.drop(ids, images, self.placeholder_ids)  # dropped pictures are never decoded
        except InvalidInputError as exc:
            raise InvalidInputError(f"{name}: {exc}") from None
        video_settings = self._request_video_settings(prompt.get("mm_processor_kwargs"), name) if videos else None
        images, videos = self._resolve_uuids(images, videos, old_images, pixel_kwargs, video_settings, name)
        return ValidatedPrompt(name, text, ids, images, pixel_kwargs, compression, old_images, videos, video_settings)

    def _resolve_uuids(self, images: list, videos: list, old_images: OldImages, pixel_kwargs: dict, video_settings,
                       name: str) -> tuple[list, list]:
        """The pictures and videos, each one sent as a uuid alone with the cache's entry for it (`_resolve_uuid`)."""
        pictures = []
        for i, item in enumerate(images):  # each lambda runs within its own iteration
            where = f"{name}, image {i}"
            pictures.append(self._resolve_uuid(
                item, lambda: self._image_key(old_images, pixel_kwargs, i, len(images), where), where))
        clips = [self._resolve_uuid(item, lambda: self._video_key(video_settings), f"{name}, video {i}")
                 for i, item in enumerate(videos)]
        return pictures, clips

    def _resolve_uuid(self, item, settings_of, name: str):
        """An item sent as a uuid alone -> with its cached entry (under the settings `settings_of()` names), found
        now so that an unknown uuid is a 400 before anything is decoded. Any other item as it is."""
        if not isinstance(item, MediaWithUuid) or item.data is not None:
            return item
        cached = self.processor_cache.lookup_uuid(settings_of(), item.uuid)
        if cached is None:
            raise InvalidInputError(f"{name}: uuid {item.uuid!r:.80} came without data, and the processor cache holds "
                                    "nothing under that uuid for these processing settings; send the data with it")
        return replace(item, cached=cached)

    def _image_key(self, old_images: OldImages, pixel_kwargs: dict, index: int, num_images: int, name: str) -> str:
        """The processor cache's settings for picture `index`: the model family, the config and its pixel cap."""
        kwargs = self._picture_settings(old_images, pixel_kwargs, None, index, num_images).pixel_kwargs
        lo, hi = _pixel_cap(self.image_config, kwargs.get("min_pixels"), kwargs.get("max_pixels"), name)
        return settings_key("image", self.model_config.model_type, self.image_config, lo, hi)

    def _video_key(self, video_settings) -> str:
        """The processor cache's settings for a video: the model family, the config and the sampling settings."""
        return settings_key("video", self.model_config.model_type, self.image_config, video_settings)

    def _through_cache(self, raw, key: str, payload_of, process):
        """`process(source)` for one picture or video, unless the processor cache holds its result: found by the
        encoded bytes (`payload_of(data)`, None when there are none to hash) or by the client's uuid."""
        if isinstance(raw, MediaWithUuid) and raw.cached is not None:
            return raw.cached
        data, uuid = (raw.data, raw.uuid) if isinstance(raw, MediaWithUuid) else (raw, None)
        payload = payload_of(data) if self.processor_cache.enabled else None
        source = data if payload is None else payload  # decoded from the bytes already read, not read twice
        return self.processor_cache.get_or_process(key, payload, uuid, lambda: process(source))

    def _request_video_settings(self, kwargs, name: str):
        """The engine's video settings with the request's VIDEO_KEYS applied, checked before any frame is decoded."""
        video_kwargs = {key: value for key, value in (kwargs or {}).items() if key in VIDEO_KEYS}
        if not video_kwargs:
            return self.video_settings
        return self.video_settings.with_request(video_kwargs, f"{name}: mm_processor_kwargs")

    def _check_counts(self, ids: list[int], images: list, videos: list, name: str) -> None:
        """As many pictures and videos as their placeholders, within the limits, and videos only where served."""
        cfg = self.model_config
        for kind, items, pad, limit, argument in (
                ("image", images, cfg.image_token_id, self.limit_images_per_prompt, "limit_images_per_prompt"),
                ("video", videos, cfg.video_token_id, self.limit_videos_per_prompt, "limit_mm_per_prompt['video']")):
            if len(items) > limit:
                raise InvalidInputError(f"{name}: {len(items)} {kind}s, over the limit of {limit} per prompt "
                                        f"({argument})")
            placeholders = ids.count(pad) if kind == "image" or items else 0  # a stray <|video_pad|> is text
            if placeholders != len(items):
                raise InvalidInputError(f"{name}: the prompt has {placeholders} {kind} placeholder(s) but "
                                        f"{len(items)} {kind}(s) were given")
        if videos and self.no_video_reason:
            raise InvalidInputError(f"{name}: {self.no_video_reason}")

    def preprocess(self, validated: ValidatedPrompt) -> PreparedPrompt:
        """Decode and resize the images, expand the placeholders, compute the M-RoPE positions."""
        name = validated.name
        pictures = [self._preprocess_image(validated, i) for i in range(len(validated.raw_images))]
        videos = [self._preprocess_video(clip, validated, f"{name}, video {i}")
                  for i, clip in enumerate(validated.raw_videos)]
        images, pads = self._in_prompt_order(validated.token_ids, pictures, videos)  # pictures and videos
        try:
            ids = self.tokenizer.expand_visual_placeholders(validated.token_ids,
                                                            [(pad, self._expansion(im)) for pad, im in zip(pads, images)])
        except InvalidInputError as exc:
            raise InvalidInputError(f"{name}: {exc}") from None
        if len(ids) >= self.max_model_len:
            raise InvalidInputError(f"{name}: the prompt is {len(ids)} tokens (images expanded), which leaves no "
                                    f"room to generate within max_model_len={self.max_model_len}")
        timestamped = any(getattr(im, "timestamps", None) for im in images)
        if timestamped:  # Qwen3-VL: each temporal patch sits in the prompt as a picture of its own, after its time
            images, pads = placed_units(images, pads)
        spans = _image_spans(ids, images, pads)
        positions, delta = self._positions(ids, images, bool(videos))
        if videos and not timestamped:  # from here on, each temporal patch is a unit of its own, encoded and cached
            images, spans = _split_videos(images, spans)  # as prefill reaches it
        return PreparedPrompt(validated.text, ids, images, spans, positions, delta, time.perf_counter())

    def _expansion(self, item) -> int | list[int]:
        """What one placeholder pad becomes: as many pads as visual tokens, or for a Qwen3-VL video, per temporal
        patch, its time as text then its own <|vision_start|> pads <|vision_end|> (inside the placeholder's own)."""
        if not getattr(item, "timestamps", None):
            return item.num_tokens
        from nanomm.inputs.video_settings import timestamp_text

        cfg = self.model_config
        return [token for seconds, patch in zip(item.timestamps, item.temporal_groups())
                for token in (self.tokenizer.encode(timestamp_text(seconds)) + [cfg.vision_start_token_id]
                              + [cfg.video_token_id] * patch.num_tokens + [cfg.vision_end_token_id])]

    @property
    def video_settings(self):
        """The engine's video settings (inputs/video_settings.py, imported with the first video)."""
        if self._video_settings is None:
            from nanomm.inputs.video_settings import VideoSettings

            self._video_settings = VideoSettings.for_model(self.model_config.model_type, self.image_config)
        return self._video_settings

    def _positions(self, ids: list[int], media: list, has_videos: bool) -> tuple[torch.Tensor, int]:
        """The expanded prompt's M-RoPE positions (3, L) and rope delta, from its whole pictures and videos. A pruned
        video's kept tokens keep the positions they had unpruned (inputs/video_pruning.py); a compressed one's
        rows hold their origins, which the model runner completes, as for a compressed picture."""
        cfg = self.model_config
        intervals = [video_time_interval(m, cfg.vision.tokens_per_second) for m in media]
        placed = [m.layout(interval, torch.zeros(3, m.num_tokens, dtype=torch.long))  # its rows: origins, for now
                  if getattr(m, "is_video", False) else origin
                  for m, interval, origin in zip(media, intervals, _compressed_image_origins(media))]
        return mrope_positions(ids, [m.grid_thw for m in media], cfg.image_token_id, cfg.vision.spatial_merge_size,
                               placed, video_token_id=cfg.video_token_id if has_videos else None,
                               time_intervals=intervals)

    def _in_prompt_order(self, ids: list[int], pictures: list, videos: list) -> tuple[list, list[int]]:
        """The pictures and videos in the order their placeholders appear, and each one's pad token id."""
        image_pad, video_pad = self.model_config.image_token_id, self.model_config.video_token_id
        pads = [t for t in ids if t == image_pad or (videos and t == video_pad)]
        pictures_left, videos_left = iter(pictures), iter(videos)
        return [next(pictures_left) if pad == image_pad else next(videos_left) for pad in pads], pads

    def _preprocess_video(self, clip, validated: ValidatedPrompt, name: str):
        """One video's frames, decoded, sampled and made into temporal patches (inputs/video_io.py and video.py,
        imported only for videos), under the engine's video settings and what the request changed, and compressed as its pictures
        are, patch by patch (unless pruned)."""
        from nanomm.inputs.video import preprocess_video
        from nanomm.inputs.video_io import encoded_video_bytes, load_video

        def sampled_and_resized(source):
            return preprocess_video(load_video(source, name), self.image_config, settings=validated.video_settings,
                                    name=name)

        video = self._through_cache(clip, self._video_key(validated.video_settings),
                                    lambda data: encoded_video_bytes(data, name), sampled_and_resized)
        return video.with_compression(validated.compression)

    def _preprocess_image(self, validated: ValidatedPrompt, index: int) -> ProcessedImage:
        """One picture under its prompt's cap and compression, or the old pictures' (old_images.py)."""
        name, count = f"{validated.name}, image {index}", len(validated.raw_images)
        settings = self._picture_settings(validated.old_images, validated.pixel_kwargs, validated.compression,
                                          index, count)
        key = self._image_key(validated.old_images, validated.pixel_kwargs, index, count, name)
        image = self._through_cache(validated.raw_images[index], key, lambda data: encoded_bytes(data, name),
                                    lambda source: preprocess_image(source, self.image_config, name=name,
                                                                    **settings.pixel_kwargs))
        return image.with_compression(settings.compression)

    def _picture_settings(self, old_images: OldImages, pixel_kwargs: dict, compression, index: int,
                          num_images: int) -> ImageSettings:
        """Picture `index`'s pixel cap and compression: its prompt's, or the old pictures' (old_images.py)."""
        config = self.image_config
        return old_images.settings(index, num_images, ImageSettings(pixel_kwargs, compression),
                                   config.min_pixels, config.max_pixels)

    def _old_images(self, kwargs, name: str) -> OldImages:
        """The engine's long-chat setting, with what the request's mm_processor_kwargs override (checked there)."""
        kwargs = kwargs or {}
        policy, keep_last = self.old_images.policy, self.old_images.keep_last
        if "old_image_policy" in kwargs:
            policy = parse_old_image_policy(kwargs["old_image_policy"], f"{name}: mm_processor_kwargs old_image_policy")
        if "keep_last_images" in kwargs:
            keep_last = check_keep_last_images(kwargs["keep_last_images"],
                                               f"{name}: mm_processor_kwargs keep_last_images")
        return OldImages(policy, keep_last)

    def _token_ids(self, prompt: dict, name: str) -> tuple[str | None, list[int]]:
        if ("prompt" in prompt) == ("prompt_token_ids" in prompt):
            raise InvalidInputError(f"{name}: give exactly one of 'prompt' (text) or 'prompt_token_ids'")
        if "prompt" in prompt:
            text = prompt["prompt"]
            if not isinstance(text, str):
                raise InvalidInputError(f"{name}: 'prompt' must be a str, got {type(text).__name__}")
            ids = self.tokenizer.encode(text)
        else:
            text, ids = None, prompt["prompt_token_ids"]
            vocab = self.model_config.text.vocab_size
            if not isinstance(ids, (list, tuple)) or not all(
                    isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids):
                raise InvalidInputError(f"{name}: 'prompt_token_ids' must be a list of ints in [0, {vocab})")
            ids = list(ids)
        if not ids:
            raise InvalidInputError(f"{name}: the prompt is empty")
        return text, ids

    def _media(self, mm_data, name: str) -> tuple[list, list]:
        """multi_modal_data -> (pictures, videos): each key holds one item or a list of them."""
        if mm_data is None:
            return [], []
        if not isinstance(mm_data, dict) or set(mm_data) - {"image", "video"}:
            raise InvalidInputError(f"{name}: 'multi_modal_data' must be a dict with 'image' and/or 'video' keys, "
                                    f"got {mm_data!r:.80}")
        return [list(items) if isinstance(items, (list, tuple)) and not _is_frame_list(items, key) else [items]
                for key, items in ((k, mm_data.get(k, [])) for k in ("image", "video"))]

    def _pixel_kwargs(self, kwargs, name: str) -> dict:
        if kwargs is None:
            return {}
        if not isinstance(kwargs, dict) or set(kwargs) - PROCESSOR_KEYS:
            raise InvalidInputError(f"{name}: 'mm_processor_kwargs' may hold only {sorted(PROCESSOR_KEYS)}, "
                                    f"got {kwargs!r:.80}")
        kwargs = {key: value for key, value in kwargs.items() if key in PIXEL_KEYS}
        for key, value in kwargs.items():
            check_int(value, f"{name}: mm_processor_kwargs {key}", error=InvalidInputError)
        # The engine's max_pixels bounds every image's visual tokens (KV memory, encoder budget): a request may
        # lower it, not raise it.
        cap = self.image_config.max_pixels
        if kwargs.get("max_pixels", cap) > cap or kwargs.get("min_pixels", 1) > cap:
            raise InvalidInputError(f"{name}: mm_processor_kwargs {kwargs} exceed the engine's max_pixels={cap}")
        return dict(kwargs)


def _with_uuids(images: list, videos: list, uuids, name: str) -> tuple[list, list]:
    """multi_modal_uuids applied: each item the client named becomes a `MediaWithUuid` (its data may be None)."""
    if uuids is None:
        return images, videos
    if not isinstance(uuids, dict) or set(uuids) - {"image", "video"}:
        raise InvalidInputError(f"{name}: 'multi_modal_uuids' must be a dict with 'image' and/or 'video' keys, "
                                f"got {uuids!r:.80}")
    named = []
    for key, items in (("image", images), ("video", videos)):
        names = uuids.get(key, [])
        names = list(names) if isinstance(names, (list, tuple)) else [names]
        if len(names) != len(items):
            raise InvalidInputError(f"{name}: multi_modal_uuids['{key}'] has {len(names)} entries for {len(items)} "
                                    f"{key}(s) in multi_modal_data")
        if any(u is not None and not (isinstance(u, str) and u) for u in names):
            raise InvalidInputError(f"{name}: multi_modal_uuids['{key}'] must hold non-empty strings or None")
        named.append([item if u is None else MediaWithUuid(item, u) for item, u in zip(items, names)])
    return named[0], named[1]


def _compressed_image_origins(images: list[ProcessedImage]) -> list:
    """`mrope_positions`' `compressed` for the engine. Which tokens a compressed image keeps is known only once
    it is encoded, so each of its rows holds the image's first position on all three axes (coordinates 0), and
    the model runner adds each kept token's own (t, h, w) when a chunk takes the tokens (model_runner.py)."""
    return [None if im.compression is None else
            (im.position_extent, torch.zeros(3, im.num_tokens, dtype=torch.long))
            for im in images]


def _is_frame_list(items, key: str) -> bool:
    """A video given as a list of frames (PIL images) rather than a list of videos."""
    return key == "video" and bool(items) and all(isinstance(x, Image.Image) for x in items)


def placed_units(items: list, tags: list) -> tuple[list, list]:
    """The runs of visual tokens that M-RoPE places one after another, each with its item's tag (a pad id, a
    compression): a picture or a video is one run, except a Qwen3-VL video, whose temporal patches each sit in the
    prompt as a picture of its own after its time in text, as transformers' get_rope_index splits its grid."""
    units, unit_tags = [], []
    for item, tag in zip(items, tags):
        parts = item.temporal_groups() if getattr(item, "timestamps", None) else [item]
        units += parts
        unit_tags += [tag] * len(parts)
    return units, unit_tags


def _split_videos(items: list, spans: list[ImageSpan]) -> tuple[list, list[ImageSpan]]:
    """Each video -> its temporal patches (`ProcessedVideo.temporal_groups`), each with the span of its own tokens
    (a temporal patch's tokens are contiguous: the clip's tokens are t-major). Pictures pass through."""
    units, unit_spans = [], []
    for item, span in zip(items, spans):
        parts = item.temporal_groups() if getattr(item, "is_video", False) else [item]
        start = span.start
        for part in parts:
            units.append(part)
            unit_spans.append(ImageSpan(start, part.num_tokens, part.content_hash))
            start += part.num_tokens
    return units, unit_spans


def _image_spans(ids: list[int], images: list, pads: list[int]) -> list[ImageSpan]:
    """Where each picture's or video's tokens sit: the next run of its pad id."""
    spans, start = [], 0
    for image, pad in zip(images, pads):
        start = ids.index(pad, start)
        spans.append(ImageSpan(start, image.num_tokens, image.content_hash))
        start += image.num_tokens
    return spans
