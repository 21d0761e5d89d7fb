"""The offline API, vLLM's shape: `LLM(model, **engine_args)`, then `generate(prompts, sampling_params)` or
`chat(messages, sampling_params)`.

Lesson: lessons/09-capstone.md (the whole request path through this API).

`LLM` loads the model and its tokenizer, sizes the KV pool from a memory budget, builds the engine
(engine/engine.py) and drives it: validate everything first, then add all requests and step until they are done.
The argument names, their defaults and the outputs are vLLM's, so a script written for vLLM's offline API runs
with only its import line changed (README: "Coming from vLLM"). Calls without sampling params use the
checkpoint's generation_config.json, as vLLM does.
"""

import contextlib
import logging
from dataclasses import replace

import torch

from nanomm.engine.config import EngineConfig
from nanomm.engine.cuda_graphs import graph_context, largest_bucket
from nanomm.engine.engine import LLMEngine
from nanomm.engine.kv_cache import kv_bytes_per_token
from nanomm.engine.memory_profile import profile_memory
from nanomm.errors import CheckpointError, InvalidInputError
from nanomm.inputs.image import ImageProcessorConfig
from nanomm.inputs.tokenizer import Tokenizer
from nanomm.model.compile import compile_decoder_layers
from nanomm.model.fast_linear import pack_linear_layers, packed_linear_available
from nanomm.model.loader import load_model, resolve_checkpoint
from nanomm.model.quant import quantize_language_model
from nanomm.outputs import RequestOutput
from nanomm.planner import Plan, Workload, kv_pool_blocks, kv_pool_budget, make_plan, plan_lines, worst_case_image
from nanomm.sampling import SamplingParams, generation_defaults

logger = logging.getLogger("nanomm")


class LLM:
    """`LLM(path_or_hub_id, **engine_args)`: the engine arguments are the fields of `EngineConfig`."""

    def __init__(self, model: str, **engine_args):
        config = EngineConfig.from_kwargs(engine_args)
        device = config.device or ("cuda" if torch.cuda.is_available() else "cpu")
        dtype = config.dtype or ("bfloat16" if torch.device(device).type == "cuda" else "float32")
        config = replace(config, device=device, dtype=dtype)  # the engine's config says what it runs on
        folder = resolve_checkpoint(model, config.revision, config.download_dir)
        self.model = load_model(folder, device=device, dtype=dtype)
        if not self.model.config.has_vision:
            raise CheckpointError(f"{model} is a text-only Qwen2 model; nanomm serves Qwen2-VL (a Qwen2 checkpoint "
                                  "can be the draft model of speculative decoding)")
        self.draft_model = None
        if config.speculative is not None and config.speculative.method == "draft":
            draft_folder = resolve_checkpoint(config.speculative.model, download_dir=config.download_dir)
            self.draft_model = load_model(draft_folder, device=device, dtype=dtype)
        if config.quantization is not None:  # the draft's too; before packing, which takes what is left in float
            for m in (self.model, self.draft_model):
                if m is not None:
                    quantize_language_model(m, config.quantization, config.quantization_group_size)
        if config.cpu_fast_linear and not config.compile:  # Inductor picks its own matmuls
            for m in (self.model, self.draft_model):
                if m is not None and packed_linear_available(m.device, m.dtype):
                    pack_linear_layers(m)  # CPU float32 only: oneDNN's blocked weights (model/fast_linear.py)
        if config.compile:
            for m in (self.model, self.draft_model):
                if m is not None:
                    compile_decoder_layers(m)  # torch.compile, the attention call left eager (model/compile.py)
        tokenizer_folder = folder if config.tokenizer is None else resolve_checkpoint(
            config.tokenizer, config.revision, config.download_dir)
        self.tokenizer = Tokenizer.from_pretrained(
            tokenizer_folder, image_token_id=self.model.config.image_token_id,
            vision_start_token_id=self.model.config.vision_start_token_id,
            vision_end_token_id=self.model.config.vision_end_token_id)
        image_config = ImageProcessorConfig.from_pretrained(folder)
        pixel_cap = {k: getattr(config, k) for k in ("min_pixels", "max_pixels") if getattr(config, k) is not None}
        self.image_config = replace(image_config, **pixel_cap)
        self.default_sampling_params = generation_defaults(folder, config.generation_config)
        self.model_name = model
        self.memory = {}  # how the memory budget was split, when _kv_budget sizes the pool
        self.engine = LLMEngine(self.model, self.tokenizer, self.image_config, self._resolve(config),
                                self.draft_model)
        if logger.isEnabledFor(logging.INFO):
            for what, value in plan_lines(self.plan()):
                logger.info("KV plan: %s: %s", what, value)

    def plan(self, **workload) -> Plan:
        """The KV budget plan (planner.py) of this engine as built: its pixel cap, block size and pool.
        workload: the fields of planner.Workload (images_per_request, prompt_tokens, output_tokens,
        typical_image), each defaulting as there."""
        config = self.engine.config
        return make_plan(self.model.config, self.image_config, model=self.model_name, dtype=self._dtype_name,
                         kv_dtype=config.kv_cache_dtype, quantization=config.quantization,
                         quantization_group_size=config.quantization_group_size,
                         visual_token_compression=config.visual_token_compression, block_size=config.block_size,
                         max_num_seqs=config.max_num_seqs,
                         max_model_len=config.max_model_len, workload=Workload(**workload),
                         num_kv_blocks=config.num_kv_blocks)

    @property
    def _dtype_name(self) -> str:
        return str(self.model.dtype).removeprefix("torch.")  # torch.bfloat16 -> "bfloat16"

    def _resolve(self, config: EngineConfig) -> EngineConfig:
        """Fill in what depends on the loaded model: context length, encoder budget, KV pool size."""
        limit = self.model.config.text.max_position_embeddings
        max_model_len = config.max_model_len or limit
        if max_model_len > limit:  # positions past the trained range: the model was never taught them
            raise ValueError(f"max_model_len={max_model_len} is beyond this model's max_position_embeddings={limit}")
        token_budget = config.max_num_batched_tokens
        if not config.enable_chunked_prefill:  # every prompt must fit one step, as in vLLM
            token_budget = max(token_budget, max_model_len)
        num_kv_blocks = config.num_kv_blocks
        if num_kv_blocks is None:
            per_block = config.block_size * sum(  # a draft model's KV lives in the same budget
                kv_bytes_per_token(m.config.text.num_hidden_layers, m.config.text.num_key_value_heads,
                                   m.config.text.head_dim, m.dtype, config.kv_cache_dtype)
                for m in (self.model, self.draft_model) if m)
            num_kv_blocks = kv_pool_blocks(self._kv_budget(config, max_model_len, token_budget), per_block,
                                           config.max_num_seqs, max_model_len, config.block_size)
            if num_kv_blocks < 1:
                raise ValueError("no memory left for the KV cache; lower the model size or raise "
                                 "gpu_memory_utilization")
        return replace(config, max_model_len=max_model_len, num_kv_blocks=num_kv_blocks,
                       max_num_batched_tokens=token_budget,
                       max_num_encoder_tokens=config.max_num_encoder_tokens or token_budget)

    def _kv_budget(self, config: EngineConfig, max_model_len: int, token_budget: int) -> int:
        """Bytes for the KV pool (planner.kv_pool_budget). On a GPU: what is free of the utilisation share once
        the weights are loaded, less the activations of the engine's largest step (token_budget tokens against
        max_model_len) and, with CUDA graphs, what the largest graph's decode step keeps, measured by a profiling
        pass (engine/memory_profile.py). Elsewhere: the fixed budget.
        How it was split lands in `self.memory`."""
        device = self.model.device
        profiled = {}
        if device.type == "cuda" and config.kv_cache_memory_gib is None:
            graphs = None if config.enforce_eager else largest_bucket(
                config.max_num_seqs, graph_context(max_model_len, config.max_seq_len_to_capture), config.block_size)
            profile = profile_memory(self.model, self.image_config, worst_case_image(self.image_config)[0],
                                     token_budget, config.max_num_seqs, max_model_len, graphs, config.block_size,
                                     config.kv_cache_dtype)
            profiled = dict(total_bytes=profile.total_bytes, used_bytes=profile.used_bytes,
                            reserve_bytes=profile.reserve_bytes)
            self.memory.update(profile.as_stats(), memory_activation_reserve_bytes=profile.reserve_bytes)
        budget, rule = kv_pool_budget(device.type, gpu_memory_utilization=config.gpu_memory_utilization,
                                      kv_cache_memory_gib=config.kv_cache_memory_gib, **profiled)
        self.memory.update(kv_budget_rule=rule, kv_budget_bytes=budget)
        return budget

    def get_default_sampling_params(self) -> SamplingParams:
        """What a call without sampling params uses: from generation_config.json unless generation_config="vllm"."""
        return replace(self.default_sampling_params)

    def get_tokenizer(self) -> Tokenizer:
        """The tokenizer: encode, decode, and apply_chat_template(messages, tokenize=False) as in Hugging Face."""
        return self.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True, mm_processor_kwargs: dict | None = None) -> list[RequestOutput]:
        """Generate for one prompt or a list (vLLM's shape); use_tqdm shows a progress bar (rich, on stderr).
        mm_processor_kwargs: the pixel cap and visual-token compression of every prompt, key by key where a prompt
        does not set its own."""
        single = isinstance(prompts, (str, dict))
        prompts = [prompts] if single else list(prompts)
        if mm_processor_kwargs is not None:
            prompts = [_with_processor_kwargs(p, mm_processor_kwargs) for p in prompts]
        params = sampling_params
        params_list = params if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise InvalidInputError(f"got {len(params_list)} sampling params for {len(prompts)} prompts")
        params_list = [p or self.get_default_sampling_params() for p in params_list]
        # Validate and preprocess everything before any model compute: one bad prompt rejects the call.
        prepared = self.engine.prepare_all(prompts, params_list)
        ids: list[str] = []
        finished: dict[str, RequestOutput] = {}
        try:
            for p, sp, pp in zip(prompts, params_list, prepared):
                ids.append(self.engine.add_request(p, sp, prepared=pp))
            with _progress(use_tqdm, len(ids)) as advance:
                while len(finished) < len(ids):
                    for out in self.engine.step():
                        if out.finished:
                            finished[out.request_id] = out
                            advance()
        except BaseException:  # Ctrl-C or a bug: leave nothing of this call behind in the engine
            for request_id in ids:
                self.engine.abort_request(request_id)
            self.engine.forget_outputs(ids)
            raise
        return [finished[i] for i in ids]

    def chat(self, messages, sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = True, chat_template: str | None = None, add_generation_prompt: bool = True,
             mm_processor_kwargs: dict | None = None) -> list[RequestOutput]:
        """One conversation (a list of messages) or a list of conversations; generates the assistant turn."""
        if chat_template is not None:
            raise ValueError("chat_template: nanomm renders Qwen2-VL's own chat template and takes no other")
        conversations = messages if messages and isinstance(messages[0], (list, tuple)) else [messages]
        prompts = []
        for i, conversation in enumerate(conversations):
            try:
                text, images = self.tokenizer.apply_chat_template(conversation, add_generation_prompt)
            except InvalidInputError as exc:
                raise InvalidInputError(f"conversation {i}: {exc}") from None
            prompts.append({"prompt": text, "multi_modal_data": {"image": images}} if images else text)
        return self.generate(prompts, sampling_params, use_tqdm, mm_processor_kwargs)

    def stats(self) -> dict:
        """The engine's counters, and how the memory budget was split (on a GPU, from the profiling pass)."""
        return {**self.engine.stats(), **self.memory}

    def close(self) -> None:
        """Stop the preprocessing worker threads. Also done by `with LLM(...) as llm:` on the way out."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@contextlib.contextmanager
def _progress(show: bool, total: int):
    """A rich progress bar over finished requests, or nothing."""
    if not show:
        yield lambda: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    columns = TextColumn("generating"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()
    console = Console(stderr=True)
    with Progress(*columns, console=console, transient=True, disable=not console.is_terminal) as bar:
        task = bar.add_task("generate", total=total)
        yield lambda: bar.advance(task)


def _with_processor_kwargs(prompt, kwargs: dict):
    """A prompt with the call's mm_processor_kwargs, under the keys the prompt does not set itself. Whatever is
    not a dict passes through, for the prompt's validation to name."""
    if isinstance(prompt, str):
        return {"prompt": prompt, "mm_processor_kwargs": kwargs}
    own = prompt.get("mm_processor_kwargs") if isinstance(prompt, dict) else None
    if isinstance(prompt, dict) and isinstance(kwargs, dict) and (own is None or isinstance(own, dict)):
        return {**prompt, "mm_processor_kwargs": {**kwargs, **(own or {})}}
    return prompt
