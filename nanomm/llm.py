"""The offline API, vLLM's shape: `LLM(model, **engine_args)`, then `generate(prompts, sampling_params)` or
`chat(messages, sampling_params)`.

Lesson: lessons/12-capstone.md (the whole request path through this API).

`LLM` loads the model and its tokenizer, sizes the engine (engine/sizing.py), builds it
(engine/engine.py) and drives it: validate everything first, then add all requests and step until they are done.
The argument names, their defaults and the outputs are vLLM's, so a script written for vLLM's offline API runs
with only its import line changed (README: "Coming from vLLM"). Calls without sampling params use the
checkpoint's generation_config.json, as vLLM does. An http(s) picture or video is fetched (inputs/media_fetch.py,
on threads, every URL of a prompt at once) only from the hosts given as `allowed_media_domains`, before anything
else is validated; without them every URL is refused with an error naming it and that argument.
"""

import contextlib
import logging
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from nanomm.accel import speed_up
from nanomm.engine.config import EngineConfig
from nanomm.engine.engine import LLMEngine
from nanomm.engine.sizing import size_engine
from nanomm.errors import CheckpointError, InvalidInputError
from nanomm.inputs.image import ImageProcessorConfig
from nanomm.inputs.tokenizer import Tokenizer, media_prompt
from nanomm.model.config import read_checkpoint_json
from nanomm.model.loader import load_model, resolve_checkpoint
from nanomm.outputs import RequestOutput
from nanomm.sampling import SamplingParams, generation_defaults

if TYPE_CHECKING:
    from nanomm.planner import Plan

logger = logging.getLogger("nanomm")


def profile_memory(*args):
    """engine/memory_profile.py's `profile_memory`, imported only when a GPU's KV pool is sized (it runs the model,
    with CUDA graphs when they are on): a CPU run never loads it."""
    from nanomm.engine.memory_profile import profile_memory

    return profile_memory(*args)


class LLM:
    """`LLM(path_or_hub_id, **engine_args)`: the engine arguments are the fields of `EngineConfig`."""

    def __init__(self, model: str | None = None, **engine_args):
        config = EngineConfig.from_kwargs(engine_args)
        if config.emulate is not None:  # no weights: the engine on an emulated device (nanomm/emulate)
            self._start_emulated(model, config)
            return
        if model is None:
            raise TypeError("LLM() needs a model: a local folder or a hub id (or emulate='GPU:MODEL')")
        self.emulated = None
        device = config.device or ("cuda" if torch.cuda.is_available() else "cpu")
        dtype = config.dtype or ("bfloat16" if torch.device(device).type == "cuda" else "float32")
        config = replace(config, device=device, dtype=dtype)  # the engine's config says what it runs on
        folder = resolve_checkpoint(model, config.revision, config.download_dir)
        self.model = load_model(folder, device=device, dtype=dtype)
        if not self.model.config.has_vision:
            raise CheckpointError(f"{model} is a text-only Qwen2 model; nanomm serves Qwen2-VL (a Qwen2 checkpoint "
                                  "can be the draft model of speculative decoding)")
        if config.encoder_url is not None:  # the encoder service runs the tower: this engine holds none
            self.model.visual = None
        self.draft_model = None
        if config.speculative is not None and config.speculative.method == "draft":
            draft_folder = resolve_checkpoint(config.speculative.model, download_dir=config.download_dir)
            self.draft_model = load_model(draft_folder, device=device, dtype=dtype)
        for m in (self.model, self.draft_model):  # the fast layers, behind one seam (accel/)
            if m is not None:
                speed_up(m, fused_layers=config.fused_layers, quantization=config.quantization,
                         quantization_group_size=config.quantization_group_size,
                         cpu_fast_linear=config.cpu_fast_linear, compile=config.compile)
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
        models = [m for m in (self.model, self.draft_model) if m is not None]
        # the memory split, for stats(); on a GPU the activation reserve is measured by running the model
        config, self.memory = size_engine(config, models, self.image_config, profile_memory)
        video_preprocessor = read_checkpoint_json(folder / "video_preprocessor_config.json", required=False)
        self.engine = LLMEngine(self.model, self.tokenizer, self.image_config, config, self.draft_model,
                                video_preprocessor=video_preprocessor or None)
        if logger.isEnabledFor(logging.INFO):  # the planner is imported only to log its plan, or when asked for one
            from nanomm.planner import plan_lines

            for what, value in plan_lines(self.plan()):
                logger.info("KV plan: %s: %s", what, value)

    def _start_emulated(self, model: str | None, config: EngineConfig) -> None:
        """The twin: the model's config and the demo tokenizer, the KV pool the planner gives that model on that
        GPU, the emulated device's runner behind the engine's seam. Checked before anything starts."""
        from nanomm.demo import demo_checkpoint  # the twin's tokenizer
        from nanomm.emulate import EmulatedDevice  # imported only here: the image path never needs it

        unsupported = {"quantization": config.quantization,
                       "a draft model": config.speculative is not None and config.speculative.method == "draft",
                       "device": config.device not in (None, "meta"), "dtype": config.dtype not in (None, "bfloat16")}
        refused = [name for name, given in unsupported.items() if given]
        if refused:
            raise ValueError(f"emulate={config.emulate!r} serves an engine in bfloat16 on the emulated GPU; it does "
                             f"not emulate {', '.join(refused)}")
        device = EmulatedDevice.from_value(config.emulate, config.emulate_cost_file, config.kv_cache_dtype)
        if model not in (None, device.model_name):
            raise ValueError(f"emulate={config.emulate!r} serves {device.model_name}; drop the model argument "
                             f"{model!r} or name the same one")
        self.model = device.twin_model()
        self.draft_model, self.model_name, self.emulated = None, device.model_name, device
        self.tokenizer = Tokenizer.from_pretrained(
            demo_checkpoint(), image_token_id=self.model.config.image_token_id,
            vision_start_token_id=self.model.config.vision_start_token_id,
            vision_end_token_id=self.model.config.vision_end_token_id)
        pixel_cap = {k: getattr(config, k) for k in ("min_pixels", "max_pixels") if getattr(config, k) is not None}
        self.image_config = replace(device.image_config, **pixel_cap)
        self.default_sampling_params = SamplingParams()
        config = replace(config, device="meta", dtype="bfloat16")
        config, self.memory = device.size(config, self.image_config)
        self.engine = LLMEngine(self.model, self.tokenizer, self.image_config, config,
                                make_runner=device.make_runner)

    def plan(self, **workload) -> "Plan":
        """The KV budget plan (planner.py) of this engine as built: its pixel cap, block size and pool.
        workload: the fields of planner.Workload (images_per_request, prompt_tokens, output_tokens,
        typical_image), each defaulting as there."""
        from nanomm.planner import Workload, make_plan

        config = self.engine.config
        model_config = self.model.config if self.emulated is None else self.emulated.config  # the real model's
        return make_plan(model_config, self.image_config, model=self.model_name, dtype=self._dtype_name,
                         kv_dtype=config.kv_cache_dtype, quantization=config.quantization,
                         quantization_group_size=config.quantization_group_size,
                         visual_token_compression=config.visual_token_compression, block_size=config.block_size,
                         max_num_seqs=config.max_num_seqs,
                         max_model_len=config.max_model_len, workload=Workload(**workload),
                         num_kv_blocks=config.num_kv_blocks,
                         video_settings=self.engine.processor.video_settings if workload.get("videos_per_request")
                         else None)

    @property
    def _dtype_name(self) -> str:
        return str(self.model.dtype).removeprefix("torch.")  # torch.bfloat16 -> "bfloat16"

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
        policy = self.engine.config.media_url_policy
        if policy is not None:  # http(s) pictures and videos -> their bytes; without a policy load_image refuses URLs
            from nanomm.inputs.media_fetch import fetch_prompt_media

            prompts = [fetch_prompt_media(p, policy, f"prompt {i}") for i, p in enumerate(prompts)]
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
             mm_processor_kwargs: dict | None = None, tools: list[dict] | None = None) -> list[RequestOutput]:
        """One conversation (a list of messages) or a list of conversations; generates the assistant turn.
        `tools`: OpenAI function tools, written into each prompt (nanomm/inputs/tool_prompt.py); the outputs' text
        keeps the model's `<tool_call>` blocks (nanomm/serve/tool_calls.py parses them)."""
        if chat_template is not None:
            raise ValueError("chat_template: nanomm renders Qwen2-VL's own chat template and takes no other")
        conversations = messages if messages and isinstance(messages[0], (list, tuple)) else [messages]
        prompts = []
        for i, conversation in enumerate(conversations):
            try:
                text, media = self.tokenizer.apply_chat_template(conversation, add_generation_prompt, tools=tools)
            except InvalidInputError as exc:
                raise InvalidInputError(f"conversation {i}: {exc}") from None
            prompts.append(media_prompt(text, media) if media else text)
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
