"""The serving engine (LLMEngine: add_request / step / abort) and the offline API on top of it (LLM).

Lesson: lessons/05-continuous-batching.md.

One `step()` = schedule (scheduler.py) -> run the model once over every scheduled chunk (model_runner.py) ->
sample the requests whose chunk reached their last token (sampling.py) -> commit, stream, finish. `LLM` is
vLLM's offline API shape: validate everything first, then add all requests and step until they are done.
"""

import contextlib
import hashlib
import itertools
import time
from dataclasses import dataclass, replace

import torch

from nanomm.cpu_linear import pack_linear_layers, packed_linear_available
from nanomm.errors import CheckpointError, InvalidInputError
from nanomm.image import ImageProcessorConfig
from nanomm.encoder_cache import EncoderCache, encoder_cache_key
from nanomm.inputs import InputProcessor, PreparedPrompt, ValidatedPrompt
from nanomm.kv_cache import BlockManager, allocate_kv_cache, kv_bytes_per_token
from nanomm.loader import load_model, resolve_checkpoint
from nanomm.model import Qwen2VL
from nanomm.model_runner import ModelRunner
from nanomm.outputs import CompletionOutput, RequestMetrics, RequestOutput
from nanomm.preprocess_pool import PreprocessPool
from nanomm.sampling import SamplingParams, probabilities
from nanomm.scheduler import Request, ScheduledChunk, Scheduler, Status
from nanomm.speculative import SpeculativeConfig, accept_greedy, accept_sampled, make_proposer, proposal_budget
from nanomm.tokenizer import IncrementalDetokenizer, Tokenizer

CPU_KV_CACHE_GIB = 2.0  # the KV pool on CPU when neither num_kv_blocks nor kv_cache_memory_gib is given


@dataclass
class EngineConfig:
    max_model_len: int
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    num_kv_blocks: int = 0
    enable_prefix_caching: bool = True
    seed: int = 0
    encoder_cache_size: int = 16384  # visual tokens the encoder cache keeps
    max_num_encoder_tokens: int = 2048  # visual tokens the vision tower may encode in one step
    num_preprocess_workers: int = 2  # threads decoding and resizing images; 0 = inline in add_request
    limit_images_per_prompt: int = 16
    speculative: SpeculativeConfig | None = None


class LLMEngine:
    def __init__(self, model: Qwen2VL, tokenizer: Tokenizer, image_config: ImageProcessorConfig,
                 config: EngineConfig, draft_model: Qwen2VL | None = None):
        self.model, self.tokenizer, self.config = model, tokenizer, config
        text = model.config.text
        self.processor = InputProcessor(tokenizer, model.config, image_config, config.max_model_len,
                                        config.limit_images_per_prompt)
        self.blocks = BlockManager(config.num_kv_blocks, config.block_size, config.enable_prefix_caching)
        self.encoder_cache = EncoderCache(config.encoder_cache_size)
        # Visual tokens depend on the weights too: the cache key names the model (and its dtype).
        self.model_identity = f"{getattr(model, 'name_or_path', 'model')}:{model.dtype}"
        kv_cache = allocate_kv_cache(text.num_hidden_layers, config.num_kv_blocks, config.block_size,
                                     text.num_key_value_heads, text.head_dim, model.dtype, model.device)
        self.runner = ModelRunner(model, kv_cache, config.block_size, self.encoder_cache)
        self.scheduler = Scheduler(self.blocks, self.encoder_cache, config.max_num_seqs,
                                   config.max_num_batched_tokens, config.max_num_encoder_tokens)
        self.pool = PreprocessPool(config.num_preprocess_workers)
        self.proposer = None if config.speculative is None else make_proposer(
            config.speculative, draft_model, config.num_kv_blocks, config.block_size, text.vocab_size,
            config.encoder_cache_size)
        self.requests: dict[str, Request] = {}
        self._preprocessing: dict[str, tuple[ValidatedPrompt, SamplingParams, float]] = {}
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._early_outputs: list[RequestOutput] = []  # aborts and preprocessing errors, reported by step()
        self._ids = itertools.count()
        self.counters = dict(steps=0, step_s=0.0, generated_tokens=0, computed_tokens=0, decode_steps=0,
                             decode_tokens=0, draft_tokens=0, accepted_tokens=0)

    # -- requests in ---------------------------------------------------------------------------------------

    def prepare(self, prompt, params: SamplingParams | None, name: str = "prompt") -> PreparedPrompt:
        """Validate and preprocess one prompt; raises InvalidInputError and touches nothing in the engine."""
        params = _check_params(params, name)
        return self._preprocess(self.processor.validate(prompt, name), params)

    def prepare_all(self, prompts: list, params: list[SamplingParams | None]) -> list[PreparedPrompt]:
        """`prepare` for many prompts, images decoded in parallel on the pool; the first bad prompt raises."""
        arrival = time.perf_counter()
        params = [_check_params(p, f"prompt {i}") for i, p in enumerate(params)]
        validated = [self.processor.validate(p, f"prompt {i}") for i, p in enumerate(prompts)]
        results = self.pool.map([lambda v=v, sp=sp: self._preprocess(v, sp) for v, sp in zip(validated, params)])
        for result in results:
            if isinstance(result, Exception):
                raise result
        for prepared in results:
            prepared.arrival_time = arrival
        return results

    def _preprocess(self, validated: ValidatedPrompt, params: SamplingParams) -> PreparedPrompt:
        prepared = self.processor.preprocess(validated)
        self._check_fits(prepared, params, validated.name)
        return prepared

    def _check_fits(self, prepared: PreparedPrompt, params: SamplingParams, name: str) -> None:
        """A request whose longest possible sequence needs more blocks than the whole pool could never finish."""
        max_len = min(len(prepared.token_ids) + params.max_tokens, self.config.max_model_len)
        if self.blocks.blocks_needed(max_len) > self.blocks.num_blocks:
            raise InvalidInputError(
                f"{name}: up to {max_len} tokens need {self.blocks.blocks_needed(max_len)} KV blocks, but "
                f"the whole pool has {self.blocks.num_blocks}; lower max_tokens or max_pixels, or give the engine "
                "more KV memory")

    def add_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
                    prepared: PreparedPrompt | None = None) -> str:
        """Queue a request. Problems with the prompt itself (its shape, placeholders, limits, sampling params)
        raise InvalidInputError here. Its images load and decode on the worker pool: an image that cannot be
        used (wrong type, missing file, bad data URL, corrupt, a bomb...) finishes this request alone with
        finish_reason "error" and the reason in `outputs[0].error`."""
        arrival = time.perf_counter()
        request_id = self._new_request_id() if request_id is None else str(request_id)
        name = f"request {request_id}"
        if request_id in self.requests or request_id in self._preprocessing:
            raise InvalidInputError(f"request id {request_id!r} is already in use")
        params = _check_params(params, name)
        if prepared is None:
            validated = self.processor.validate(prompt, name)
            if not validated.raw_images:  # text alone is cheap: preprocess here, and raise here
                prepared = self._preprocess(validated, params)
            elif not self.pool.inline:
                self._preprocessing[request_id] = (validated, params, arrival)
                self.pool.submit(request_id, lambda: self._preprocess(validated, params))
                return request_id
            else:  # no workers: decode here, with the pool's contract (an error result for this request)
                try:
                    prepared = self._preprocess(validated, params)
                except InvalidInputError as exc:
                    self._early_outputs.append(self._final_output(request_id, validated, "error", str(exc), arrival))
                    return request_id
        else:  # prepared elsewhere, maybe with other sampling params: the KV-pool check must see these
            self._check_fits(prepared, params, name)
        if prepared.arrival_time is None:
            prepared.arrival_time = arrival
        self._schedule(request_id, prepared, params)
        return request_id

    def _new_request_id(self) -> str:
        while True:  # skip ids a caller chose for their own requests
            request_id = str(next(self._ids))
            if request_id not in self.requests and request_id not in self._preprocessing:
                return request_id

    def forget_outputs(self, request_ids) -> None:
        """Drop pending outputs of these requests (LLM.generate cleaning up after an error: nobody reads them)."""
        request_ids = set(request_ids)
        self._early_outputs = [o for o in self._early_outputs if o.request_id not in request_ids]

    def _schedule(self, request_id: str, prepared: PreparedPrompt, params: SamplingParams) -> None:
        seed = params.seed if params.seed is not None else _derived_seed(self.config.seed, request_id)
        generator = None if params.greedy else torch.Generator(self.runner.device).manual_seed(seed)
        stop = set(params.stop_token_ids or ()) | (set() if params.ignore_eos else set(self.tokenizer.eos_token_ids))
        metrics = RequestMetrics(arrival_time=prepared.arrival_time,
                                 preprocess_s=prepared.ready_time - prepared.arrival_time,
                                 num_prompt_tokens=len(prepared.token_ids), num_visual_tokens=prepared.num_visual_tokens)
        request = Request(request_id, prepared, params, generator, frozenset(stop), metrics,
                          image_keys=[self.encoder_cache_key_for(im) for im in prepared.images])
        self.requests[request_id] = request
        self._detokenizers[request_id] = IncrementalDetokenizer(self.tokenizer)
        self.scheduler.add(request)

    def encoder_cache_key_for(self, image) -> str:
        """The encoder-cache key of a preprocessed image on this engine's model."""
        return encoder_cache_key(image.content_hash, self.model_identity)

    def _collect_preprocessed(self, wait_s: float) -> None:
        for request_id, result in self.pool.poll(wait_s):
            validated, params, arrival = self._preprocessing.pop(request_id)
            if isinstance(result, PreparedPrompt):
                result.arrival_time = arrival
                try:
                    self._schedule(request_id, result, params)
                    continue
                except Exception as exc:  # noqa: BLE001 - whatever it is, it is this request's alone
                    result = exc
            # This request alone fails; the message says why.
            message = str(result) if isinstance(result, InvalidInputError) else f"{validated.name}: {result!r}"
            self._early_outputs.append(self._final_output(request_id, validated, "error", message, arrival))

    def _final_output(self, request_id, validated: ValidatedPrompt, reason: str, error: str | None,
                      arrival: float) -> RequestOutput:
        completion = CompletionOutput(0, [], "", reason, error=error)
        metrics = RequestMetrics(arrival_time=arrival, e2e_s=time.perf_counter() - arrival)
        return RequestOutput(request_id, validated.text, list(validated.token_ids), [completion], True, metrics)

    def abort_request(self, request_id: str) -> None:
        request_id = str(request_id)
        if request_id in self._preprocessing:
            self.pool.cancel(request_id)
            validated, _, arrival = self._preprocessing.pop(request_id)
            self._early_outputs.append(self._final_output(request_id, validated, "abort", None, arrival))
            return
        request = self.requests.get(request_id)
        if request is None or request.status is Status.FINISHED:
            return
        self._finish(request, "abort")
        self._early_outputs.append(self._output(request, []))

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work() or bool(self._preprocessing) or bool(self._early_outputs)

    # -- one step --------------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        # With nothing to run, wait a little for a worker instead of spinning (not counted as step time).
        self._collect_preprocessed(wait_s=0.0 if self.scheduler.has_work() else 0.05)
        start = time.perf_counter()
        outputs, self._early_outputs = self._early_outputs, []
        if self.proposer is not None:
            self._propose()
        chunks = self.scheduler.schedule()
        if chunks:
            logits = self.runner.run(chunks)
            sampling = [c for c in chunks if c.samples]
            emitted = dict(zip(map(id, sampling), self._next_tokens(sampling, logits)))
            for chunk in chunks:
                request, tokens = chunk.request, emitted.get(id(chunk), [])
                num_accepted = max(0, len(tokens) - 1)  # every emitted token but the last was a proposal
                tokens, reason = self._cut_at_finish(request, tokens)
                if tokens and request.output_token_ids:  # a decode step (the prefill's first token is not)
                    self._count_decode_step(request.metrics, len(chunk.draft_tokens), min(num_accepted, len(tokens)),
                                            len(tokens))
                request.token_ids += tokens
                num_rejected = len(chunk.draft_tokens) - num_accepted
                self.scheduler.commit(chunk, num_rejected)
                if tokens:
                    outputs.append(self._emit(request, tokens, reason))
            self.counters["computed_tokens"] += sum(c.num_tokens for c in chunks)
        self.encoder_cache.trim()  # back within budget, now that this step's holds are taken and released
        self.counters["steps"] += 1
        self.counters["step_s"] += time.perf_counter() - start
        return outputs

    def _propose(self) -> None:
        """Speculative decoding: proposals for every decoding request, verified by this step's forward pass."""
        running = self.scheduler.running
        for request in running:
            request.draft_tokens, request.draft_probs = [], None
        decoding = [r for r in running if r.num_remaining == 1 and r.output_token_ids]  # not the prefill's last chunk
        k = self.config.speculative.num_speculative_tokens
        budgets = [proposal_budget(r, k, self.config.max_model_len) for r in decoding]
        for request, proposal in zip(decoding, self.proposer.propose(decoding, budgets)):
            request.draft_tokens, request.draft_probs = proposal.tokens, proposal.probs

    def _next_tokens(self, chunks: list[ScheduledChunk], logits: torch.Tensor) -> list[list[int]]:
        """The tokens each sampling chunk emits: without proposals, the one token its row picks; with k
        proposals (k + 1 rows), the accepted ones and then the target's own token (speculative.py).
        Greedy rows share one argmax; sampled ones use their own request's generator."""
        argmax = logits.argmax(dim=-1).tolist()
        emitted, row = [], 0
        for chunk in chunks:
            request, rows = chunk.request, 1 + len(chunk.draft_tokens)
            if request.params.greedy:
                emitted.append(accept_greedy(chunk.draft_tokens, argmax[row:row + rows]))
            else:
                p = probabilities(logits[row:row + rows], request.params)  # (rows, vocab)
                q = None if request.draft_probs is None else request.draft_probs[:rows - 1]
                emitted.append(accept_sampled(chunk.draft_tokens, p, q, request.generator))
            row += rows
        return emitted

    def _count_decode_step(self, metrics: RequestMetrics, num_draft: int, num_accepted: int, num_emitted: int):
        """Speculation metrics, per request and for the engine: proposals verified, proposals the target
        accepted, tokens emitted per decode step."""
        metrics.num_decode_steps += 1
        metrics.num_decode_tokens += num_emitted
        metrics.num_draft_tokens += num_draft
        metrics.num_accepted_tokens += num_accepted
        for key, n in (("decode_steps", 1), ("decode_tokens", num_emitted), ("draft_tokens", num_draft),
                       ("accepted_tokens", num_accepted)):
            self.counters[key] += n

    def _cut_at_finish(self, request: Request, tokens: list[int]) -> tuple[list[int], str | None]:
        """The tokens up to the first that finishes the request (a stop token, max_tokens, max_model_len)."""
        for i, token in enumerate(tokens, start=1):
            if token in request.stop_token_ids:
                return tokens[:i], "stop"
            if (len(request.output_token_ids) + i >= request.params.max_tokens
                    or request.num_tokens + i >= self.config.max_model_len):
                return tokens[:i], "length"
        return tokens, None

    def _emit(self, request: Request, tokens: list[int], reason: str | None) -> RequestOutput:
        """Stream the tokens this step appended; finish the request if one of them ended it."""
        now = time.perf_counter()
        self.counters["generated_tokens"] += len(tokens)
        metrics = request.metrics
        if metrics.first_token_time is None:  # TTFT = preprocess + queue + encode + prefill
            metrics.first_token_time = now
            metrics.ttft_s = now - metrics.arrival_time
            metrics.queue_s = metrics.first_scheduled_time - request.prompt.ready_time
            metrics.prefill_s = now - metrics.first_scheduled_time - metrics.encode_s
        if reason:
            self._finish(request, reason)
            metrics.e2e_s = now - metrics.arrival_time
            num_out = len(request.output_token_ids)
            metrics.tpot_s = (now - metrics.first_token_time) / (num_out - 1) if num_out > 1 else None
        return self._output(request, tokens)

    def _finish(self, request: Request, reason: str) -> None:
        self.scheduler.finish(request, reason)
        if self.proposer is not None:
            self.proposer.release(request)

    def _output(self, request: Request, new_tokens: list[int]) -> RequestOutput:
        rid = request.request_id
        detokenizer = self._detokenizers[rid]
        delta = "".join(detokenizer.step(t) for t in new_tokens)
        finished = request.status is Status.FINISHED
        completion = CompletionOutput(0, list(request.output_token_ids), detokenizer.text, request.finish_reason,
                                      list(new_tokens), delta)
        if finished:  # the engine forgets finished requests; the caller holds the output
            del self.requests[rid], self._detokenizers[rid]
        return RequestOutput(rid, request.prompt.text, list(request.prompt.token_ids), [completion], finished,
                             request.metrics)

    # -- counters --------------------------------------------------------------------------------------------

    def stats(self) -> dict:
        c, b, t = self.counters, self.blocks, self.model.config.text
        return {
            "kv_blocks_total": b.num_blocks,
            "kv_blocks_used": b.num_blocks - b.num_free_blocks,
            "kv_blocks_cached": len(b.cached),
            "kv_bytes_per_token": kv_bytes_per_token(t.num_hidden_layers, t.num_key_value_heads, t.head_dim,
                                                     self.model.dtype),
            "prefix_cache_queried_tokens": b.queried_tokens,
            "prefix_cache_hit_tokens": b.hit_tokens,
            "prefix_cache_hit_rate": b.hit_tokens / b.queried_tokens if b.queried_tokens else 0.0,
            "preemptions": self.scheduler.num_preemptions,
            "steps": c["steps"],
            "generated_tokens": c["generated_tokens"],
            "computed_tokens": c["computed_tokens"],
            "tokens_per_s": c["generated_tokens"] / c["step_s"] if c["step_s"] else 0.0,
            "encoder_cache_hits": self.encoder_cache.hits,
            "encoder_cache_misses": self.encoder_cache.misses,
            "encoder_cache_hit_rate": self.encoder_cache.hits / max(1, self.encoder_cache.hits + self.encoder_cache.misses),
            "encoder_cache_evictions": self.encoder_cache.evictions,
            "encoder_cache_tokens": self.encoder_cache.num_tokens,
            "encoder_cache_bytes": self.encoder_cache.num_bytes,
            "preprocess_queue": len(self.pool),
            "visual_tokens_encoded": self.runner.visual_tokens_encoded,
            "encode_s": self.runner.encode_s,
            "visual_tokens_per_s": self.runner.visual_tokens_encoded / self.runner.encode_s if self.runner.encode_s else 0.0,
            "spec_draft_tokens": c["draft_tokens"],
            "spec_accepted_tokens": c["accepted_tokens"],
            "spec_acceptance_rate": c["accepted_tokens"] / c["draft_tokens"] if c["draft_tokens"] else 0.0,
            "mean_tokens_per_decode_step": c["decode_tokens"] / c["decode_steps"] if c["decode_steps"] else 0.0,
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
        }


class LLM:
    """The offline API: `LLM(path).generate(prompts, params)` / `.chat(messages, params)` (vLLM's shape)."""

    def __init__(self, model: str, *, device: str | None = None, dtype: str | None = None,
                 max_model_len: int | None = None, max_num_seqs: int = 64, max_num_batched_tokens: int = 2048,
                 block_size: int = 16, num_kv_blocks: int | None = None, gpu_memory_utilization: float = 0.9,
                 kv_cache_memory_gib: float | None = None, enable_prefix_caching: bool = True,
                 min_pixels: int | None = None, max_pixels: int | None = None, seed: int = 0,
                 encoder_cache_size: int = 16384, max_num_encoder_tokens: int | None = None,
                 num_preprocess_workers: int = 2, limit_images_per_prompt: int = 16,
                 speculative: dict | None = None, revision: str | None = None):
        speculative = None if speculative is None else SpeculativeConfig.from_dict(speculative)
        max_num_encoder_tokens = max_num_encoder_tokens or max_num_batched_tokens
        _check_engine_args(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                           block_size=block_size, encoder_cache_size=encoder_cache_size,
                           max_num_encoder_tokens=max_num_encoder_tokens,
                           limit_images_per_prompt=limit_images_per_prompt)
        _check_engine_args(num_preprocess_workers=num_preprocess_workers + 1)  # 0 is allowed: inline
        cuda = torch.cuda.is_available()
        device = device or ("cuda" if cuda else "cpu")
        dtype = dtype or ("bfloat16" if torch.device(device).type == "cuda" else "float32")
        folder = resolve_checkpoint(model, revision)
        self.model = load_model(folder, device=device, dtype=dtype)
        if not self.model.config.has_vision:
            raise CheckpointError(f"{model} is a text-only Qwen2 model; nanomm serves Qwen2-VL (a Qwen2 checkpoint "
                                  "can be the draft model of speculative decoding)")
        self.draft_model = None
        if speculative is not None and speculative.method == "draft":
            self.draft_model = load_model(resolve_checkpoint(speculative.model, None), device=device, dtype=dtype)
        for m in (self.model, self.draft_model):
            if m is not None and packed_linear_available(m.device, m.dtype):
                pack_linear_layers(m)  # CPU float32: oneDNN's blocked weights (nanomm/cpu_linear.py)
        self.tokenizer = Tokenizer.from_pretrained(
            folder, image_token_id=self.model.config.image_token_id,
            vision_start_token_id=self.model.config.vision_start_token_id,
            vision_end_token_id=self.model.config.vision_end_token_id)
        image_config = ImageProcessorConfig.from_pretrained(folder)
        pixel_cap = {k: v for k, v in (("min_pixels", min_pixels), ("max_pixels", max_pixels)) if v is not None}
        image_config = replace(image_config, **pixel_cap)
        text = self.model.config.text
        max_model_len = max_model_len or text.max_position_embeddings
        per_block = block_size * sum(kv_bytes_per_token(m.config.text.num_hidden_layers, m.config.text.num_key_value_heads,
                                                        m.config.text.head_dim, m.dtype)
                                     for m in (self.model, self.draft_model) if m is not None)  # a draft: its KV too
        if num_kv_blocks is None:
            num_kv_blocks = _kv_blocks_for_memory(self.model, per_block, gpu_memory_utilization, kv_cache_memory_gib,
                                                  max_num_seqs * -(-max_model_len // block_size))
        config = EngineConfig(max_model_len, max_num_seqs, max_num_batched_tokens, block_size, num_kv_blocks,
                              enable_prefix_caching, seed, encoder_cache_size, max_num_encoder_tokens,
                              num_preprocess_workers, limit_images_per_prompt, speculative)
        self.engine = LLMEngine(self.model, self.tokenizer, image_config, config, self.draft_model)

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Generate for one prompt or a list (vLLM's shape); use_tqdm shows a progress bar (rich)."""
        single = isinstance(prompts, (str, dict))
        prompts = [prompts] if single else list(prompts)
        params_list = params if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise InvalidInputError(f"got {len(params_list)} sampling params for {len(prompts)} prompts")
        params_list = [p or SamplingParams() for p in params_list]
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

    def chat(self, messages, params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """One conversation (a list of messages) or a list of conversations; generates the assistant turn."""
        conversations = messages if messages and isinstance(messages[0], (list, tuple)) else [messages]
        prompts = []
        for i, conversation in enumerate(conversations):
            try:
                text, images = self.tokenizer.apply_chat_template(conversation)
            except InvalidInputError as exc:
                raise InvalidInputError(f"conversation {i}: {exc}") from None
            prompts.append({"prompt": text, "multi_modal_data": {"image": images}} if images else text)
        return self.generate(prompts, params)

    def stats(self) -> dict:
        return self.engine.stats()


@contextlib.contextmanager
def _progress(show: bool, total: int):
    """A rich progress bar over finished requests, or nothing."""
    if not show:
        yield lambda: None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    with Progress(TextColumn("generating"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()) as bar:
        task = bar.add_task("generate", total=total)
        yield lambda: bar.advance(task)


def _check_params(params, name: str) -> SamplingParams:
    if params is None:
        return SamplingParams()
    if not isinstance(params, SamplingParams):
        raise InvalidInputError(f"{name}: sampling params must be a SamplingParams, got {type(params).__name__}")
    try:
        return params.validate()
    except InvalidInputError as exc:
        raise InvalidInputError(f"{name}: {exc}") from None


def _derived_seed(engine_seed: int, request_id: str) -> int:
    """A reproducible per-request seed for requests that set none (Python's hash() is salted per process)."""
    return int.from_bytes(hashlib.sha256(f"{engine_seed}:{request_id}".encode()).digest()[:8], "little") >> 1


def _check_engine_args(**kwargs):
    for key, value in kwargs.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{key} must be a positive int, got {value!r}")


def _kv_blocks_for_memory(model: Qwen2VL, bytes_per_block: int, gpu_memory_utilization: float,
                          kv_cache_memory_gib: float | None, useful_blocks: int) -> int:
    """Size the KV pool from a memory budget, capped at what max_num_seqs full-length sequences could use."""
    device = model.device
    if kv_cache_memory_gib is not None:
        budget = kv_cache_memory_gib * 2**30
    elif device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        used = total - free
        # Leave (1 - utilization) of the card, plus headroom for activations, to everything else.
        budget = total * gpu_memory_utilization - used - 2**30
    else:
        budget = CPU_KV_CACHE_GIB * 2**30
    blocks = min(int(budget // bytes_per_block), useful_blocks)
    if blocks < 1:
        raise ValueError("no memory left for the KV cache; lower the model size or raise gpu_memory_utilization")
    return blocks
