"""The emulated device (the twin): the real engine serving a named model on a named GPU, with no weights and no GPU.

Lesson: lessons/13-three-topologies.md (the emulated device).

    LLM(emulate="h200:qwen2-vl-2b")
    nanomm-serve --emulate h200:qwen2-vl-2b

Everything a request meets before the device runs as it does for a real model: intake, validation and
preprocessing under the model's own image processor, the encoder and prefix caches, the scheduler with chunked
prefill and preemption, the paged KV pool sized for that model on that GPU's memory (the blocks `nanomm-plan`
computes), and the metrics. Only the device's work is replaced (emulate/runner.py): the tower and every step
take the time the cost model gives them (emulate/costs.py), slept, and the tokens come from a stand-in.

What the twin is made of: the model's module tree on PyTorch's meta device (shapes, no memory: the KV pool too),
built from its real config.json (shipped in emulate/models/); the demo model's tokenizer, whose special tokens
the tree takes over (so its stand-in logits are 619 wide, not 151,936: sampling stays cheap). Prompts are
therefore counted in the demo tokenizer's tokens, pictures in the real model's visual tokens.
It serves an integrated engine, an encoder service (its tower an `EmulatedTower`, which the server's encoder role
runs: serve/encoder_server.py's `load_emulated_encoder`) and an engine that uses one (1E1PD), and prefill and
decode instances (a router in front of them needs no model): placeholders cross the wire, one element a visual
token or a KV position, and both sides count the bytes the real model's tensors would take, and the receiver
sleeps the link's time for them. This package imports nothing of the server. Nothing on the image path imports
it: `LLM` imports it only when `emulate` is given.
"""

import math
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from nanomm.emulate.costs import GPUS, CostModel, Gpu, ModelShape
from nanomm.emulate.runner import EmulatedKVConnector, EmulatedRunner, StandInTokens, wire_placeholder
from nanomm.engine.sizing import context_and_token_budget, kv_bytes_per_token, sized_config
from nanomm.inputs.compression import VisualTokens
from nanomm.inputs.image import ImageProcessorConfig
from nanomm.model.config import ModelConfig

# -- the models it knows: the real checkpoints' config files, shipped in models/ (no weights) ----------------------

FOLDER = Path(__file__).parent / "models"
MODELS = {  # the name --emulate takes -> the hub id whose config.json and preprocessor_config.json are shipped
    "qwen2-vl-2b": "Qwen/Qwen2-VL-2B-Instruct",
    "qwen2.5-vl-3b": "Qwen/Qwen2.5-VL-3B-Instruct",
    "qwen3-vl-2b": "Qwen/Qwen3-VL-2B-Instruct",
    "qwen3-vl-4b": "Qwen/Qwen3-VL-4B-Instruct",  # the model of vLLM's EPD experiment (lesson 13)
}
WEIGHT_DTYPE = torch.bfloat16  # what the emulated GPU serves in


def model_folder(name: str) -> Path:
    return FOLDER / name


def load_configs(name: str) -> tuple[ModelConfig, ImageProcessorConfig]:
    folder = model_folder(name)
    return ModelConfig.from_pretrained(folder), ImageProcessorConfig.from_pretrained(folder)


def _params(module: torch.nn.Module, skip: tuple = ()) -> int:
    skipped = {id(p) for m in skip for p in m.parameters()}
    return sum(p.numel() for p in module.parameters() if id(p) not in skipped)


def model_shape(config: ModelConfig, kv_cache_dtype: str = "auto") -> ModelShape:
    """The cost model's view of a model: parameters a step multiplies (the decoder and the head, which only the
    sampled rows go through; the embedding is a lookup), the tower's, widths, and the bytes a token's KV (bfloat16, or an fp8 cache) and a visual token
    take."""
    from nanomm.planner import meta_model  # the module tree on the meta device: shapes, no memory

    model = meta_model(config)
    lm = model.language_model
    lm_head_params = model.lm_head.weight.numel()
    lm_params = _params(lm, skip=(lm.embed_tokens,)) + lm_head_params
    vision = config.vision
    size = WEIGHT_DTYPE.itemsize
    window = (vision.window_size // vision.patch_size) ** 2 if vision.window_size else 0
    full_blocks = len(vision.fullatt_block_indexes) if window else vision.depth
    text = config.text
    levels = 1 + len(vision.deepstack_visual_indexes)
    vision_params = _params(model.visual)
    return ModelShape(
        lm_params=lm_params, lm_weight_bytes=lm_params * size, layers=text.num_hidden_layers,
        attention_width=text.num_attention_heads * text.head_dim,
        kv_bytes_per_token=kv_bytes_per_token(text.num_hidden_layers, text.num_key_value_heads, text.head_dim,
                                              WEIGHT_DTYPE, kv_cache_dtype),
        vision_params=vision_params, vision_weight_bytes=vision_params * size,
        vision_depth=vision.depth, vision_width=vision.embed_dim, vision_window_patches=window,
        vision_full_blocks=full_blocks, visual_token_bytes=levels * text.hidden_size * size,
        lm_head_params=lm_head_params)


# -- the twin ------------------------------------------------------------------------------------------------------

class EmulatedTower:
    """What `nanomm-serve --role encoder --emulate GPU:MODEL` encodes with: each call takes the cost model's time
    and sends placeholders, and its sent bytes are counted as the real visual tokens would weigh (the engine's
    side waits their link time: `EmulatedRemoteEncoder`). The real service (its cache, checks and counters) runs
    around it."""

    def __init__(self, costs: CostModel, sleep=time.sleep):
        self.costs, self.sleep = costs, sleep
        self.seconds: list[float] = []  # the last 1,000 calls' times, for the tests
        self.patches: list[list[int]] = []  # and each one's pictures' patch counts

    def __call__(self, images: list) -> list[VisualTokens]:
        """One vision forward over a batch: one encode floor for all its pictures (`CostModel.encode_seconds`)."""
        patches = [math.prod(im.grid_thw) for im in images]
        seconds = self.costs.encode_seconds(patches)
        self.seconds = (self.seconds + [seconds])[-1000:]
        self.patches = (self.patches + [patches])[-1000:]
        self.sleep(seconds)
        return [VisualTokens(wire_placeholder(im.num_tokens), None) for im in images]

    def counted_bytes(self, answer: bytes, images: list) -> int:
        return sum(im.num_tokens for im in images) * self.costs.shape.visual_token_bytes


def parse_emulate(value: str) -> tuple[str, str]:
    """"GPU:MODEL" -> (gpu, model), each one the twin knows; else a ValueError naming the known ones."""
    gpu, sep, model = str(value).strip().lower().partition(":")
    if not sep or gpu not in GPUS or model not in MODELS:
        raise ValueError(f"emulate={value!r}: expected GPU:MODEL with GPU one of {sorted(GPUS)} and MODEL one of "
                         f"{sorted(MODELS)}, e.g. 'h200:qwen2-vl-2b'")
    return gpu, model


@dataclass
class EmulatedDevice:
    gpu: Gpu
    model_name: str
    config: ModelConfig  # the real model's
    image_config: ImageProcessorConfig  # the real model's, at its own pixel cap
    costs: CostModel

    @classmethod
    def from_value(cls, value: str, cost_file: str | None = None, kv_cache_dtype: str = "auto") -> "EmulatedDevice":
        gpu, model = parse_emulate(value)
        config, image_config = load_configs(model)
        costs = CostModel(GPUS[gpu], model_shape(config, kv_cache_dtype))
        return cls(GPUS[gpu], model, config, image_config, costs.with_cost_file(cost_file) if cost_file else costs)

    def twin_model(self):
        """The real model's module tree on the meta device, with the demo tokenizer's vocabulary and special
        tokens (the only part of the model the engine reads is its config)."""
        from nanomm.demo import demo_checkpoint
        from nanomm.model.qwen2_vl import Qwen2VL

        demo_config = ModelConfig.from_pretrained(demo_checkpoint())
        twin = replace(self.config, text=replace(self.config.text, vocab_size=demo_config.text.vocab_size),
                       image_token_id=demo_config.image_token_id, video_token_id=demo_config.video_token_id,
                       vision_start_token_id=demo_config.vision_start_token_id,
                       vision_end_token_id=demo_config.vision_end_token_id,
                       eos_token_ids=demo_config.eos_token_ids, tie_word_embeddings=True)
        with torch.device("meta"):
            model = Qwen2VL(twin, name_or_path=f"emulated {self.model_name}")
        return model.to(WEIGHT_DTYPE)

    def make_runner(self, model, kv_cache, block_size: int, encoder_cache, trace,
                    remote_encoder=None) -> EmulatedRunner:
        """The engine's runner: this device's costs, the stand-in answers over the twin's vocabulary."""
        config = model.config
        special = {config.image_token_id, config.video_token_id, config.vision_start_token_id,
                   config.vision_end_token_id, *config.eos_token_ids}
        stand_in = StandInTokens(config.text.vocab_size, special, config.eos_token_ids[0])
        return EmulatedRunner(model, kv_cache, block_size, encoder_cache, trace, self.costs, stand_in,
                              config.text.vocab_size, remote_encoder)

    def kv_connector(self, timeout_s: float) -> EmulatedKVConnector:
        """A prefill or decode instance's KV connector: placeholders cross, the real KV's bytes are counted and
        their link time is slept."""
        return EmulatedKVConnector(self.costs, timeout_s)

    def tower(self, sleep=time.sleep) -> "EmulatedTower":
        """The encoder role's tower on this device (serve/encoder_server.py's `load_emulated_encoder` serves it
        over the twin's model tree and the real model's image processor)."""
        return EmulatedTower(self.costs, sleep)

    def size(self, config, image_config) -> tuple:
        """The engine's config with what depends on the model filled in, as `engine.sizing.size_engine` does for a
        loaded one, the KV pool the planner's for the real model on this GPU (make_plan: weights, an activation
        reserve estimated rather than profiled). Returns (that config, the memory split for stats())."""
        from nanomm.planner import make_plan

        max_model_len, token_budget = context_and_token_budget(config, self.config.text.max_position_embeddings)
        plan = make_plan(self.config, image_config, model=self.model_name, dtype=str(WEIGHT_DTYPE).split(".")[1],
                         kv_dtype=config.kv_cache_dtype, block_size=config.block_size,
                         max_num_seqs=config.max_num_seqs, max_model_len=max_model_len,
                         device_memory_gib=self.gpu.memory_gib, gpu_memory_utilization=config.gpu_memory_utilization,
                         kv_cache_memory_gib=config.kv_cache_memory_gib, num_kv_blocks=config.num_kv_blocks,
                         visual_token_compression=config.visual_token_compression, alternatives=False,
                         cuda_graphs=not config.enforce_eager, max_seq_len_to_capture=config.max_seq_len_to_capture)
        sized = sized_config(config, max_model_len, token_budget, plan.num_kv_blocks)
        memory = {"kv_budget_rule": plan.budget_rule, "kv_budget_bytes": plan.kv_budget_bytes,
                  "emulated_gpu": self.gpu.name, "emulated_model": self.model_name}
        return sized, memory
