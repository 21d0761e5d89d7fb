"""Every engine argument in one dataclass: `LLM(model, **kwargs)` fills `EngineConfig` field by field.

Lesson: lessons/05-continuous-batching.md (the budgets), lessons/04-paged-kv-cache.md (the KV pool).

The names are vLLM's engine arguments where vLLM has one (max_num_seqs, max_num_batched_tokens, block_size,
gpu_memory_utilization, enable_prefix_caching, ...). A keyword `LLM` does not know is a TypeError naming it,
never silently dropped; a bad value is a ValueError quoting the value given. `None` fields are resolved
once the model is loaded (`LLM` does it): the model's context length, the KV pool that fits the memory.
"""

from dataclasses import dataclass, fields

from nanomm.engine.speculative import SpeculativeConfig
from nanomm.errors import check_int, is_finite_number


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
    limit_images_per_prompt: int = 16
    speculative: SpeculativeConfig | dict | None = None  # see speculative.py
    cpu_fast_linear: bool = True  # CPU float32: oneDNN-packed linear layers (model/fast_linear.py)

    @classmethod
    def from_kwargs(cls, kwargs: dict) -> "EngineConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"LLM() got unknown keyword argument(s) {unknown}; "
                            f"the engine arguments are {sorted(known)}")
        return cls(**kwargs)

    def __post_init__(self):
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "encoder_cache_size",
                     "limit_images_per_prompt"):
            check_int(getattr(self, name), name)
        for name in ("max_model_len", "num_kv_blocks", "max_num_encoder_tokens", "min_pixels", "max_pixels"):
            if getattr(self, name) is not None:
                check_int(getattr(self, name), name)
        check_int(self.num_preprocess_workers, "num_preprocess_workers", minimum=0)
        check_int(self.seed, "seed", minimum=-2**63)
        for name in ("enable_prefix_caching", "cpu_fast_linear"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if not is_finite_number(self.gpu_memory_utilization) or not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if self.kv_cache_memory_gib is not None and not (is_finite_number(self.kv_cache_memory_gib)
                                                         and self.kv_cache_memory_gib > 0):
            raise ValueError(f"kv_cache_memory_gib must be a number > 0, got {self.kv_cache_memory_gib!r}")
        if isinstance(self.speculative, dict):
            self.speculative = SpeculativeConfig.from_dict(self.speculative)
        elif self.speculative is not None and not isinstance(self.speculative, SpeculativeConfig):
            SpeculativeConfig.from_dict(self.speculative)  # raises the error that explains the expected dict
