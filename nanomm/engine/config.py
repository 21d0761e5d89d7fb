"""Every engine argument in one dataclass: `LLM(model, **kwargs)` fills `EngineConfig` field by field.

Lesson: lessons/05-continuous-batching.md (the budgets), lessons/04-paged-kv-cache.md (the KV pool).

The names are vLLM's engine arguments where vLLM has one (max_num_seqs, max_num_batched_tokens, block_size,
gpu_memory_utilization, enable_prefix_caching, limit_mm_per_prompt, mm_processor_kwargs, speculative_config,
...), with vLLM's meanings, so a vLLM script's `LLM(...)` line runs unchanged (the README has the table).
A keyword `LLM` does not know is a TypeError naming it, never silently dropped; a bad value is a ValueError
quoting the value given; an argument that only makes sense across several devices is a ValueError that says
so. `None` fields are resolved once the model is loaded (`LLM` does it): the model's context length, the KV
pool that fits the memory.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from dataclasses import replace as dataclass_replace
from typing import TYPE_CHECKING

from nanomm.engine.kv_cache import KV_CACHE_DTYPES
from nanomm.inputs.compression import CompressionPolicy, parse_policy
from nanomm.inputs.old_images import (DEFAULT_KEEP_LAST_IMAGES, OldImagePolicy, check_keep_last_images,
                                      parse_old_image_policy)
from nanomm.errors import check_int, is_finite_number

if TYPE_CHECKING:  # speculative.py, accel/quant.py and media_fetch.py are imported only when their lever is asked for
    from nanomm.engine.speculative import SpeculativeConfig
    from nanomm.inputs.media_fetch import MediaUrlPolicy


@dataclass
class EngineConfig:
    device: str | None = None  # None: cuda when available, else cpu
    dtype: str | None = None  # None: bfloat16 on cuda, float32 on cpu
    revision: str | None = None  # a hub revision, for hub ids
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_num_seqs: int = 64  # requests running at once
    max_num_batched_tokens: int = 2048  # positions computed per step (the token budget)
    block_size: int = 16  # token slots per KV block
    num_kv_blocks: int | None = None  # None: as many as the memory budget below holds
    gpu_memory_utilization: float = 0.9  # fraction of the GPU the model and the KV pool may use
    kv_cache_memory_gib: float | None = None  # a fixed KV budget instead (the CPU default is 2 GiB)
    enable_prefix_caching: bool = True
    min_pixels: int | None = None  # the engine's pixel cap; None: the checkpoint's preprocessor config
    max_pixels: int | None = None
    seed: int = 0  # derives the seed of every sampled request that sets none
    encoder_cache_size: int = 16384  # visual tokens the encoder cache keeps
    max_num_encoder_tokens: int | None = None  # visual tokens encoded per step; None: max_num_batched_tokens
    num_preprocess_workers: int = 2  # threads decoding and resizing images; 0 = inline in add_request
    # vLLM's name: GiB of preprocessed pictures and videos kept, keyed by their bytes or a client's uuid, so one sent
    # again is not decoded again (inputs/processor_cache.py); 0: none kept
    mm_processor_cache_gb: float = 4.0
    limit_images_per_prompt: int = 16
    limit_videos_per_prompt: int = 2  # videos (limit_mm_per_prompt={"video": n}); lesson 17
    speculative: SpeculativeConfig | dict | None = None  # see speculative.py
    fused_layers: bool = True  # the language model's layers in fewer kernels (accel/fused_layers.py)
    cpu_fast_linear: bool = True  # CPU float32: oneDNN-packed linear layers (accel/packed_linear.py)
    compile: bool = False  # torch.compile each decoder layer (accel/compile.py); replaces cpu_fast_linear
    encoder_url: str | None = None  # an encoder service (nanomm-serve --role encoder): no local vision tower
    encoder_timeout_s: float = 30.0  # how long a step waits for the encoder service before its requests fail
    kv_handoff_timeout_s: float = 30.0  # a prefill instance frees a parked request's KV if no decode peer took it
    trace_path: str | None = None  # write a Chrome/Perfetto trace of every step here on close (engine/trace.py)
    # vLLM's names for the same things (translated in __post_init__) and its other arguments.
    speculative_config: SpeculativeConfig | dict | None = None  # vLLM's current name for `speculative`
    limit_mm_per_prompt: dict | None = None  # {"image": k, "video": m}: sets limit_images/videos_per_prompt
    mm_processor_kwargs: dict | None = None  # {"min_pixels": .., "max_pixels": ..}: the engine's pixel cap
    # {"video": {"fps": .., "num_frames": .., "min_frames": .., "max_frames": .., "video_max_pixels": ..}}: how the
    # engine samples and caps videos, over the checkpoint's video_preprocessor_config.json (inputs/video_settings.py;
    # an fps or num_frames here samples every clip, as vLLM's loader does; a request's mm_processor_kwargs may
    # change the sampling, with do_sample_frames as transformers reads it, and lower the caps)
    media_io_kwargs: dict | None = None
    video_pruning_rate: float = 0.0  # vLLM's name: drop this share of each later temporal patch's least-changed
    #                                  tokens (inputs/video_pruning.py); a request's mm_processor_kwargs may set it
    tokenizer: str | None = None  # a folder or hub id to take the tokenizer from; None: the model's
    download_dir: str | None = None  # where hub downloads go; None: the Hugging Face cache
    enable_chunked_prefill: bool = True  # False: a prompt is prefilled in one step (the budget grows to fit)
    enforce_eager: bool = False  # True: no CUDA graphs for decode steps (engine/cuda_graphs.py; CUDA only)
    max_seq_len_to_capture: int = 8192  # decode steps with a longer context run eagerly (vLLM's name and default)
    generation_config: str = "auto"  # "auto": sampling defaults from the checkpoint's generation_config.json;
    #                                  "vllm": vLLM's own defaults; or a folder holding a generation_config.json
    kv_cache_dtype: str = "auto"  # "auto": the model's dtype; "fp8": float8 e4m3 with scales (engine/kv_fp8.py)
    quantization: str | None = None  # None, "int8" or "int4": weight-only, the language model (accel/quant.py)
    quantization_group_size: int = 128  # int4: input columns per scale and zero
    # {"method": "pool" | "random" | "prune" | "attention", "keep_ratio": r}: every image's and video patch's default
    # (a request's mm_processor_kwargs may override it); None: keep every visual token (inputs/compression.py)
    visual_token_compression: CompressionPolicy | dict | None = None
    # Long chats (inputs/old_images.py): what a prompt's pictures older than its last keep_last_images become:
    # "keep", "drop", "downscale:<max_pixels>" or "compress:<method>:<ratio>" (a request's mm_processor_kwargs
    # may override both)
    old_image_policy: OldImagePolicy | str = "keep"
    keep_last_images: int = DEFAULT_KEEP_LAST_IMAGES
    # http(s) pictures and videos in LLM.generate and LLM.chat (inputs/media_fetch.py): the hosts they may come from
    # (vLLM's name; "*.example.com" lists its subdomains), or the whole policy (redirects, private addresses,
    # timeouts, byte caps, the resolver); None: every URL is refused. The server fetches with its own flags.
    allowed_media_domains: list[str] | None = None
    media_url_policy: MediaUrlPolicy | dict | None = None
    trust_remote_code: bool = False  # accepted for vLLM scripts; no effect (nanomm runs no code from the hub)
    tensor_parallel_size: int = 1  # nanomm runs on one device: only 1
    pipeline_parallel_size: int = 1  # only 1
    distributed_executor_backend: str | None = None  # only None
    # "GPU:MODEL", e.g. "h200:qwen2-vl-2b": the engine on an emulated device, no weights loaded (nanomm/emulate)
    emulate: str | None = None
    emulate_cost_file: str | None = None  # with emulate: a cost file measured on a real GPU (emulate/costs.py)

    @classmethod
    def from_kwargs(cls, kwargs: dict) -> "EngineConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"LLM() got unknown keyword argument(s) {unknown}; "
                            f"the engine arguments are {sorted(known)}")
        return cls(**kwargs)

    def __post_init__(self):
        self._translate_vllm_arguments()
        self._check_single_device()
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "encoder_cache_size",
                     "limit_images_per_prompt", "max_seq_len_to_capture"):
            check_int(getattr(self, name), name)
        check_int(self.limit_videos_per_prompt, "limit_videos_per_prompt", minimum=0)
        for name in ("max_model_len", "num_kv_blocks", "max_num_encoder_tokens", "min_pixels", "max_pixels"):
            if getattr(self, name) is not None:
                check_int(getattr(self, name), name)
        check_int(self.num_preprocess_workers, "num_preprocess_workers", minimum=0)
        check_int(self.seed, "seed", minimum=-2**63)
        for name in ("enable_prefix_caching", "fused_layers", "cpu_fast_linear", "compile", "enable_chunked_prefill",
                     "enforce_eager", "trust_remote_code"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if not is_finite_number(self.gpu_memory_utilization) or not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if not is_finite_number(self.mm_processor_cache_gb) or self.mm_processor_cache_gb < 0:
            raise ValueError(f"mm_processor_cache_gb must be a number >= 0, got {self.mm_processor_cache_gb!r}")
        if self.kv_cache_memory_gib is not None and not (is_finite_number(self.kv_cache_memory_gib)
                                                         and self.kv_cache_memory_gib > 0):
            raise ValueError(f"kv_cache_memory_gib must be a number > 0, got {self.kv_cache_memory_gib!r}")
        if self.encoder_url is not None and not (isinstance(self.encoder_url, str)
                                                 and self.encoder_url.startswith(("http://", "https://"))):
            raise ValueError(f"encoder_url must be an http:// or https:// URL, got {self.encoder_url!r}")
        for name in ("encoder_timeout_s", "kv_handoff_timeout_s"):
            if not is_finite_number(getattr(self, name)) or getattr(self, name) <= 0:
                raise ValueError(f"{name} must be a number > 0, got {getattr(self, name)!r}")
        if not isinstance(self.generation_config, str):
            raise ValueError(f"generation_config must be 'auto', 'vllm' or a folder, got {self.generation_config!r}")
        if self.speculative is not None:
            from nanomm.engine.speculative import SpeculativeConfig

            if isinstance(self.speculative, dict):
                self.speculative = SpeculativeConfig.from_dict(self.speculative)
            elif not isinstance(self.speculative, SpeculativeConfig):
                SpeculativeConfig.from_dict(self.speculative)  # raises the error that explains the expected dict

    def _make_media_url_policy(self) -> None:
        """allowed_media_domains (vLLM's name) into media_url_policy; again on replace(), with the same result."""
        from nanomm.inputs.media_fetch import MediaUrlPolicy

        self.media_url_policy = MediaUrlPolicy.of(self.media_url_policy)
        if self.allowed_media_domains is not None:
            domains = self.allowed_media_domains
            domains = tuple(domains) if isinstance(domains, (list, tuple)) else domains  # a str: the policy names it
            self.media_url_policy = dataclass_replace(self.media_url_policy or MediaUrlPolicy(),
                                                      allowed_domains=domains)

    def _translate_vllm_arguments(self) -> None:
        """vLLM's argument names and values -> the fields the engine reads."""
        self.dtype = {"auto": None, "half": "float16", "float": "float32"}.get(self.dtype, self.dtype)
        if self.speculative_config is not None:
            if self.speculative is not None:
                raise ValueError("give speculative_config or speculative (its older name), not both")
            self.speculative, self.speculative_config = self.speculative_config, None
        if self.limit_mm_per_prompt is not None:
            self.limit_images_per_prompt, self.limit_videos_per_prompt = _media_limits(
                self.limit_mm_per_prompt, self.limit_images_per_prompt, self.limit_videos_per_prompt)
        if self.mm_processor_kwargs is not None:
            kwargs = self.mm_processor_kwargs
            if isinstance(kwargs, dict) and {"old_image_policy", "keep_last_images"} & set(kwargs):
                kwargs = self._take_long_chat_kwargs(kwargs)
            if isinstance(kwargs, dict) and "visual_token_compression" in kwargs:
                given = parse_policy(kwargs["visual_token_compression"], "mm_processor_kwargs visual_token_compression")
                if self.visual_token_compression is not None and parse_policy(self.visual_token_compression) != given:
                    raise ValueError("visual_token_compression is given twice, as an argument and in "
                                     "mm_processor_kwargs")
                self.visual_token_compression = given
                kwargs = {k: v for k, v in kwargs.items() if k != "visual_token_compression"}
                self.mm_processor_kwargs = kwargs  # translated: a second __post_init__ (replace) sees it once
            for name, value in _pixel_kwargs(kwargs, "mm_processor_kwargs").items():
                if getattr(self, name) is not None and getattr(self, name) != value:
                    raise ValueError(f"{name} is given twice, as {getattr(self, name)} and in mm_processor_kwargs")
                setattr(self, name, value)
        if self.media_io_kwargs is not None and (not isinstance(self.media_io_kwargs, dict) or set(
                self.media_io_kwargs) - {"video"} or not isinstance(self.media_io_kwargs.get("video", {}), dict)):
            raise ValueError(f"media_io_kwargs must be a dict like {{'video': {{'num_frames': 32}}}}, got "
                             f"{self.media_io_kwargs!r}")
        self.kv_cache_dtype = {"fp8_e4m3": "fp8"}.get(self.kv_cache_dtype, self.kv_cache_dtype)
        if self.media_url_policy is not None or self.allowed_media_domains is not None:
            self._make_media_url_policy()
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES} (or 'fp8_e4m3'), got "
                             f"{self.kv_cache_dtype!r}")
        if self.quantization is not None:
            from nanomm.accel.quant import QUANTIZATION_METHODS

            if self.quantization not in QUANTIZATION_METHODS:
                raise ValueError(f"quantization must be None or one of {QUANTIZATION_METHODS} (weight-only, "
                                 f"quantized at load), got {self.quantization!r}")
        if check_int(self.quantization_group_size, "quantization_group_size") % 2:
            raise ValueError(f"quantization_group_size must be even, got {self.quantization_group_size}")
        self.visual_token_compression = parse_policy(self.visual_token_compression)  # InvalidInputError if bad
        self.old_image_policy = parse_old_image_policy(self.old_image_policy)
        check_keep_last_images(self.keep_last_images)

    def _take_long_chat_kwargs(self, kwargs: dict) -> dict:
        """mm_processor_kwargs' old_image_policy and keep_last_images become the engine arguments; the rest stays."""
        checks = {"old_image_policy": parse_old_image_policy, "keep_last_images": check_keep_last_images}
        defaults = {"old_image_policy": OldImagePolicy("keep"), "keep_last_images": DEFAULT_KEEP_LAST_IMAGES}
        for name, check in checks.items():
            if name in kwargs:
                given, current = check(kwargs[name], f"mm_processor_kwargs {name}"), check(getattr(self, name), name)
                if current not in (defaults[name], given):
                    raise ValueError(f"{name} is given twice, as an argument and in mm_processor_kwargs")
                setattr(self, name, given)
        self.mm_processor_kwargs = {k: v for k, v in kwargs.items() if k not in ("old_image_policy", "keep_last_images")}
        return self.mm_processor_kwargs

    def _check_single_device(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            if check_int(getattr(self, name), name) != 1:
                raise ValueError(f"{name}={getattr(self, name)}: nanomm runs one model on one device. To split a "
                                 "model over several GPUs, serve it with vLLM or SGLang (same offline API)")
        if self.distributed_executor_backend is not None:
            raise ValueError(f"distributed_executor_backend={self.distributed_executor_backend!r}: nanomm runs on one "
                             "device in one process; for distributed serving use vLLM or SGLang")


def _media_limits(limits, images: int, videos: int) -> tuple[int, int]:
    """limit_mm_per_prompt={"image": k, "video": m} -> (k, m), each the default where left out; other modalities
    may only be limited to 0 (nanomm serves pictures and videos)."""
    if not isinstance(limits, dict):
        raise ValueError(f"limit_mm_per_prompt must be a dict like {{'image': 4, 'video': 1}}, got {limits!r}")
    for modality, limit in limits.items():
        if modality not in ("image", "video") and limit not in (0, None):
            raise ValueError(f"limit_mm_per_prompt: nanomm serves images and videos, so {modality!r} can only be 0, "
                             f"got {limit!r}")
    return (check_int(limits.get("image", images), "limit_mm_per_prompt['image']"),
            check_int(limits.get("video", videos), "limit_mm_per_prompt['video']", minimum=0))


def _pixel_kwargs(kwargs, name: str) -> dict:
    """The Qwen2-VL image processor's keywords that nanomm honours: min_pixels and max_pixels."""
    if not isinstance(kwargs, dict):
        raise ValueError(f"{name} must be a dict like {{'max_pixels': 1280 * 28 * 28}}, got {kwargs!r}")
    unknown = sorted(set(kwargs) - {"min_pixels", "max_pixels"})
    if unknown:
        raise ValueError(f"{name}: unknown keys {unknown}; the Qwen2-VL image processor takes min_pixels and "
                         "max_pixels (and nanomm visual_token_compression)")
    return {k: check_int(v, f"{name}['{k}']") for k, v in kwargs.items()}
