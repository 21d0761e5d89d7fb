"""The serving engine: `add_request` / `step` / `abort_request`, over the pieces in this folder.

Lesson: lessons/05-continuous-batching.md.

One `step()` = pick up requests whose images are ready (intake.py) -> propose speculative tokens
(speculative.py, draft.py) -> schedule (scheduler.py) -> run the model once over every scheduled chunk
(model_runner.py) -> sample and verify (sampler.py) -> commit, stream, finish (output_processor.py).
`nanomm.llm.LLM` is the offline API on top.
"""

from __future__ import annotations

import hashlib
import itertools
import time
from typing import TYPE_CHECKING

import torch

from nanomm.engine.config import EngineConfig
from nanomm.engine.encoder_cache import EncoderCache, encoder_cache_key
from nanomm.engine.intake import RequestIntake
from nanomm.engine.kv_cache import BlockManager, allocate_kv_cache
from nanomm.engine.model_runner import ImagesUnavailable, ModelRunner
from nanomm.engine.output_processor import OutputProcessor
from nanomm.engine.request import Request, Status
from nanomm.engine.scheduler import ScheduledChunk, Scheduler
from nanomm.engine.sizing import kv_bytes_per_token
from nanomm.engine.sampler import SampledTokens, sample_and_verify
from nanomm.engine.null_trace import NoTrace
from nanomm.errors import InvalidInputError
from nanomm.inputs.image import ImageProcessorConfig
from nanomm.inputs.old_images import OldImages
from nanomm.inputs.pool import PreprocessPool
from nanomm.inputs.processor_cache import ProcessorCache
from nanomm.inputs.prompt import InputProcessor, PreparedPrompt
from nanomm.inputs.tokenizer import Tokenizer
from nanomm.model.qwen2_vl import Qwen2VL
from nanomm.outputs import RequestMetrics, RequestOutput
from nanomm.sampling import SamplingParams

if TYPE_CHECKING:  # levers, imported where they are turned on (as the others are)
    from nanomm.engine.handoff import KVHandoffs
    from nanomm.engine.parallel_sampling import ParallelSampling


class LLMEngine:
    def __init__(self, model: Qwen2VL, tokenizer: Tokenizer, image_config: ImageProcessorConfig,
                 config: EngineConfig, draft_model: Qwen2VL | None = None, make_runner=None,
                 video_preprocessor: dict | None = None):
        """config: with every None resolved (`LLM` does that): max_model_len, num_kv_blocks, max_num_encoder_tokens.
        make_runner(model, kv_cache, block_size, encoder_cache, trace, remote_encoder): another runner behind the
        seam (the emulated device's, nanomm/emulate); None: the model's own, `ModelRunner`.
        video_preprocessor: the checkpoint's video_preprocessor_config.json, if it has one."""
        self.model, self.tokenizer, self.config = model, tokenizer, config
        text = model.config.text
        self.processor = InputProcessor(tokenizer, model.config, image_config, config.max_model_len,
                                        config.limit_images_per_prompt, config.visual_token_compression,
                                        OldImages(config.old_image_policy, config.keep_last_images),
                                        config.limit_videos_per_prompt, _no_video_reason(model.config),
                                        _video_settings(model.config, image_config, video_preprocessor, config),
                                        ProcessorCache.from_gib(config.mm_processor_cache_gb))
        self.block_manager = BlockManager(config.num_kv_blocks, config.block_size, config.enable_prefix_caching)
        self.encoder_cache = EncoderCache(config.encoder_cache_size)
        # Visual tokens depend on the weights too: the cache key names the model (and its dtype).
        self.model_identity = f"{model.name_or_path}:{model.dtype}"
        use_graphs = model.device.type == "cuda" and not config.enforce_eager
        # With CUDA graphs, one block past the pool, never handed out: where padding rows write (cuda_graphs.py).
        kv_cache = allocate_kv_cache(text.num_hidden_layers, config.num_kv_blocks + use_graphs, config.block_size,
                                     text.num_key_value_heads, text.head_dim, model.dtype, model.device,
                                     config.kv_cache_dtype)
        self.trace = _step_trace(config.trace_path) if config.trace_path else NoTrace()  # trace.py, when asked
        graphs = _decode_graphs(model, kv_cache, config) if use_graphs else None
        remote_encoder = None if config.encoder_url is None else _remote_encoder(model, config)
        if make_runner is None:
            self.runner = ModelRunner(model, kv_cache, config.block_size, self.encoder_cache, self.trace,
                                      decode_graphs=graphs, remote_encoder=remote_encoder)
        else:
            self.runner = make_runner(model, kv_cache, config.block_size, self.encoder_cache, self.trace,
                                      remote_encoder)
        self.scheduler = Scheduler(self.block_manager, self.encoder_cache, config.max_num_seqs,
                                   config.max_num_batched_tokens, config.max_num_encoder_tokens,
                                   config.enable_chunked_prefill, self.trace)
        self.intake = RequestIntake(self.processor, PreprocessPool(config.num_preprocess_workers),
                                    self.block_manager, config.max_model_len, _encode_ahead(self))
        self.output_processor = OutputProcessor(tokenizer, config.max_model_len)
        self.proposer = _make_proposer(config, draft_model, model, (self.encoder_cache, self.model_identity))
        self._handoffs: KVHandoffs | None = None  # prefill here, decode there: made when first used (handoff.py)
        self.parallel: ParallelSampling | None = None  # requests with n > 1, from the first one (parallel_sampling.py)
        self.grammars = None  # constrained requests' grammars, from the first one (structured.py)
        self.requests: dict[str, Request] = {}  # scheduled and not finished
        self._ids = itertools.count()
        self.num_steps, self.step_s, self.num_computed_tokens = 0, 0.0, 0
        self.lm_busy_s = 0.0  # the steps that ran chunks, less their encodes: the language model's busy time

    @property
    def handoffs(self) -> KVHandoffs:
        """Prefill here, decode there (handoff.py): made on a split engine's first use, never on an integrated one."""
        if self._handoffs is None:
            from nanomm.engine.handoff import KVHandoffs

            self._handoffs = KVHandoffs(self)
        return self._handoffs

    # -- requests in ---------------------------------------------------------------------------------------

    def prepare(self, prompt, params: SamplingParams | None, name: str = "prompt") -> PreparedPrompt:
        """Validate and preprocess one prompt; raises InvalidInputError and touches nothing in the engine."""
        params = _check_params(params, name, self)
        return self.intake.prepare(self.processor.validate(prompt, name), params)

    def prepare_all(self, prompts: list, params: list[SamplingParams | None]) -> list[PreparedPrompt]:
        """`prepare` for many prompts, images decoded in parallel on the pool; the first bad prompt raises."""
        params = [_check_params(p, f"prompt {i}", self) for i, p in enumerate(params)]
        validated = [self.processor.validate(p, f"prompt {i}") for i, p in enumerate(prompts)]
        return self.intake.prepare_all(validated, params)

    def add_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
                    prepared: PreparedPrompt | None = None, hand_off: bool = False,
                    encoder_url: str | None = None) -> str:
        """Queue a request. Problems with the prompt itself (its shape, placeholders, limits, sampling params)
        raise InvalidInputError here. Its images load and decode on the worker pool: an image that cannot be
        used (wrong type, missing file, bad data URL, corrupt, a bomb...) finishes this request alone with
        finish_reason "error" and the reason in `outputs[0].error`."""
        arrival = time.perf_counter()
        request_id = self._new_request_id() if request_id is None else str(request_id)
        params = self._check_new_request(request_id, params)
        if hand_off:  # a prefill instance's request, parked after its first token (handoff.py)
            self.handoffs.mark(request_id, params, encoder_url)
        if params.n > 1:  # parallel sampling, set up by the first request that asks for it
            if self.parallel is None:
                from nanomm.engine.parallel_sampling import ParallelSampling
                self.parallel = ParallelSampling()
            self.parallel.check_child_ids(request_id, params.n, self._id_in_use)
        try:
            self._queue(request_id, prompt, params, prepared, arrival)
        except BaseException:
            if self._handoffs is not None:  # refused: a later request with this id is not marked
                self._handoffs.marked.pop(request_id, None)
            raise
        return request_id

    def _queue(self, request_id: str, prompt, params: SamplingParams, prepared: PreparedPrompt | None,
               arrival: float) -> None:
        """To the worker pool to preprocess, or (prepared, text alone, or no workers) to the scheduler now."""
        name = f"request {request_id}"
        if prepared is not None:  # prepared elsewhere, maybe with other sampling params: check the pool again
            self.intake.check_fits(prepared, params, name)
        else:
            validated = self.processor.validate(prompt, name)
            media = validated.raw_images or validated.raw_videos  # decoded on the pool, failing as a result there
            if media and not self.intake.pool.inline:
                self.intake.submit(request_id, validated, params, arrival)
                return
            try:  # text alone is cheap: preprocess here, and raise here
                prepared = self.intake.prepare(validated, params)
            except InvalidInputError as exc:
                if not media:
                    raise
                # No workers: decoded here, with the pool's contract (an error result for this request).
                self.intake.fail(request_id, validated, str(exc), arrival)
                return
        if prepared.arrival_time is None:
            prepared.arrival_time = arrival
        self.intake.ready(request_id, prepared, params, self._admit)

    def _new_request_id(self) -> str:
        while True:  # skip ids a caller chose for their own requests
            request_id = str(next(self._ids))
            if not self._id_in_use(request_id):
                return request_id

    def _id_in_use(self, request_id: str) -> bool:
        """Taken by a running request, one still preprocessing, or a completion of either (n > 1)."""
        return (request_id in self.requests or request_id in self.intake.preprocessing
                or self.parallel is not None and self.parallel.holds(request_id, self.intake.preprocessing))

    def _check_new_request(self, request_id: str, params) -> SamplingParams:
        """The sampling params, checked, of a request whose id is free; InvalidInputError otherwise."""
        if self._id_in_use(request_id):
            raise InvalidInputError(f"request id {request_id!r} is already in use")
        return _check_params(params, f"request {request_id}", self)

    def _admit(self, request_id: str, prepared: PreparedPrompt, params: SamplingParams) -> None:
        """A prepared request becomes the scheduler's: one request, or n children (parallel_sampling.py)."""
        if params.n == 1:
            self._add_to_scheduler(self._make_request(request_id, prepared, params))
            return

        def make_child(child_id: str, child_params: SamplingParams, index: int) -> Request:
            return self._make_request(child_id, prepared, child_params, completion_index=index)

        for child in self.parallel.children(request_id, params, make_child, self.config.enable_prefix_caching):
            self._add_to_scheduler(child)

    def _make_request(self, request_id: str, prepared: PreparedPrompt, params: SamplingParams,
                      completion_index: int = 0) -> Request:
        seed = params.seed if params.seed is not None else _derived_seed(self.config.seed, request_id)
        generator = None if params.greedy else torch.Generator().manual_seed(seed)  # on the host (sampling.py)
        stop = set(params.stop_token_ids or ()) | (set() if params.ignore_eos else set(self.tokenizer.eos_token_ids))
        metrics = RequestMetrics(arrival_time=prepared.arrival_time,
                                 preprocess_s=prepared.ready_time - prepared.arrival_time,
                                 num_prompt_tokens=len(prepared.token_ids),
                                 num_visual_tokens=prepared.num_visual_tokens,
                                 num_encoded_visual_tokens=sum(im.num_encoded_tokens for im in prepared.images))
        marked = self._handoffs.marked if self._handoffs is not None else {}  # a prefill instance's hand-offs
        return Request(request_id, prepared, [self.encoder_cache_key_for(im) for im in prepared.images],
                       params=params, generator=generator, stop_token_ids=frozenset(stop), metrics=metrics,
                       completion_index=completion_index, hands_off=request_id in marked,
                       encoder_url=marked.get(request_id), grammar=_new_matcher(self, params))

    def _add_to_scheduler(self, request: Request, running: bool = False) -> None:
        """running: its prompt KV is already in its blocks (a decode instance's transferred request)."""
        self.trace.request_ready(request)
        self.requests[request.request_id] = request
        self.output_processor.add(request)
        (self.scheduler.add_running if running else self.scheduler.add)(request)

    def encoder_cache_key_for(self, image) -> str:
        """The encoder-cache key of a preprocessed image on this engine's model."""
        return encoder_cache_key(image.content_hash, self.model_identity)

    def forget_outputs(self, request_ids) -> None:
        """Drop pending outputs of these requests (LLM.generate cleaning up after an error: nobody reads them)."""
        request_ids = list(request_ids)
        children = self.parallel.forget(request_ids) if self.parallel is not None else []
        self.intake.forget_outputs(request_ids + children)

    def abort_request(self, request_id: str) -> None:
        request_id = str(request_id)
        if self.intake.cancel(request_id):
            return
        children = self.parallel.children_of(request_id) if self.parallel is not None else []
        if children:  # a request with n > 1: its completions
            for child_id in children:
                self.abort_request(child_id)
            return
        request = self.requests.get(request_id)
        if request is None or request.status is Status.FINISHED:
            return
        self._finish(request, "abort")
        self.intake.early_outputs.append(self._output(request, []))

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work() or self.intake.has_pending()

    # -- one step --------------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        # With nothing to run, wait a little for a worker instead of spinning (not counted as step time).
        self.intake.collect(wait_s=0.0 if self.scheduler.has_work() else 0.05, admit=self._admit)
        start, encode_s_before, ran = time.perf_counter(), self.runner.encode_s, []
        outputs = self.intake.take_early_outputs()
        with self.trace.span("step", step=self.num_steps):
            with self.trace.span("schedule"):
                if self.proposer is not None:
                    with self.trace.span("propose"):
                        self._propose()
                chunks = self.scheduler.schedule()
            for request in self.scheduler.take_failed():
                self._finish(request, "error")
                outputs.append(self._output(request, []))
            self.trace.scheduled(chunks)
            if chunks:
                try:
                    outputs += self._run(chunks)
                    ran = chunks
                except ImagesUnavailable as failed:  # the encoder service failed: nothing of this step ran
                    outputs += self._fail_showing(failed, chunks)
            self.encoder_cache.trim()  # back within budget, now that this step's holds are taken and released
        self.num_steps += 1
        elapsed = time.perf_counter() - start
        self.step_s += elapsed
        self._charge_step(ran, elapsed - (self.runner.encode_s - encode_s_before))
        self.trace.counters(self.block_manager, self.encoder_cache)
        if self._handoffs is not None:
            self._handoffs.forget_marks(outputs)
        return outputs if self.parallel is None else self.parallel.merge(outputs)

    def _run(self, chunks: list[ScheduledChunk]) -> list[RequestOutput]:
        """One forward pass over the scheduled chunks, then sampling, verification and commit."""
        logits = self.runner.run(chunks)
        with self.trace.span("sample"):
            for chunk, prompt_logits in logits.prompt:
                self.output_processor.record_prompt_logprobs(chunk.request, chunk.start, prompt_logits)
            sampling = [c for c in chunks if c.samples_next_token]
            emitted = dict(zip(map(id, sampling), sample_and_verify(sampling, logits.sampling)))
        outputs = []
        with self.trace.span("commit"):
            for chunk in chunks:
                output = self._commit(chunk, emitted.get(id(chunk), SampledTokens([], 0)))
                if output is not None:
                    outputs.append(output)
        self.num_computed_tokens += sum(c.num_tokens for c in chunks)
        return outputs

    def _charge_step(self, chunks: list[ScheduledChunk], lm_s: float) -> None:
        """The language model's part of a step that ran (its time less the encode): busy time, and each request's
        device seconds by its share of the step's positions (the encode is charged per image, in the runner)."""
        if not chunks:
            return
        self.lm_busy_s += lm_s
        positions = sum(c.num_tokens for c in chunks)
        for chunk in chunks:
            chunk.request.metrics.device_s += lm_s * chunk.num_tokens / positions

    def _fail_showing(self, failed: ImagesUnavailable, chunks: list[ScheduledChunk]) -> list[RequestOutput]:
        """Finish, with the service's error, the requests that show an image it failed on; the other chunks of
        the step simply run again next step (nothing was computed or committed)."""
        outputs = []
        for request in {id(c.request): c.request for c in chunks}.values():
            if any(span.content_hash in failed.content_hashes for span in request.prompt.image_spans):
                request.error, request.error_status = str(failed.cause), failed.cause.status
                self._finish(request, "error")
                outputs.append(self._output(request, []))
        return outputs

    def _propose(self) -> None:
        """Speculative decoding: proposals for every decoding request, verified by this step's forward pass."""
        running = self.scheduler.running
        for request in running:
            request.spec_token_ids, request.spec_token_probs = [], None
        decoding = [r for r in running if r.num_remaining == 1 and r.output_token_ids]  # not the prefill's last chunk
        from nanomm.engine.speculative import proposal_budget

        k = self.config.speculative.num_speculative_tokens
        budgets = [proposal_budget(r, k, self.config.max_model_len) for r in decoding]
        for request, proposal in zip(decoding, self.proposer.propose(decoding, budgets)):
            request.spec_token_ids, request.spec_token_probs = proposal.tokens, proposal.probs

    def _commit(self, chunk: ScheduledChunk, emitted: SampledTokens) -> RequestOutput | None:
        """Append what the chunk emitted (up to a finish), commit its positions, and stream the new tokens."""
        request = chunk.request
        if request.hands_off and emitted.token_ids:  # a prefill instance: the first token goes with the KV
            self.scheduler.commit(chunk)
            return self.handoffs.park(request, emitted)
        token_ids, grammar_complete = _follow_grammar(request, emitted.token_ids)  # structured.py
        tokens, reason = self.output_processor.take_tokens(request, token_ids, emitted.logprobs)
        reason = reason or ("stop" if grammar_complete and tokens else None)
        if tokens and request.output_token_ids:  # a decode step (the prefill's first token is not)
            self.output_processor.count_decode_step(request.metrics, len(chunk.spec_token_ids),
                                                    min(emitted.num_accepted, len(tokens)), len(tokens))
        request.token_ids += tokens
        self.scheduler.commit(chunk, num_rejected=len(chunk.spec_token_ids) - emitted.num_accepted)
        if tokens:
            self.output_processor.record_tokens(request, len(tokens), finished=reason is not None)
        self.trace.committed(chunk, len(tokens), min(emitted.num_accepted, len(tokens)))
        if not tokens:
            return None
        if reason:
            self._finish(request, reason)
        return self._output(request, tokens)

    def _finish(self, request: Request, reason: str) -> None:
        self.scheduler.finish(request, reason)
        self.trace.finished(request, reason)
        if self.proposer is not None:
            self.proposer.release(request)

    def _output(self, request: Request, new_tokens: list[int]) -> RequestOutput:
        output = self.output_processor.make_output(request, new_tokens)
        if output.finished:  # the engine forgets finished requests; the caller holds the output
            del self.requests[request.request_id]
        return output

    # -- counters and shutdown ----------------------------------------------------------------------------

    def stats(self) -> dict:
        """Engine counters: each component reports its own."""
        t = self.model.config.text
        generated = self.output_processor.counters["generated_tokens"]
        return {
            **self.block_manager.stats(),
            "kv_cache_dtype": self.config.kv_cache_dtype,
            "kv_bytes_per_token": kv_bytes_per_token(t.num_hidden_layers, t.num_key_value_heads, t.head_dim,
                                                     self.model.dtype, self.config.kv_cache_dtype),
            "kv_capacity_tokens": self.block_manager.num_blocks * self.config.block_size,
            "quantization": self.config.quantization,
            "kv_requests_parked": len(self._handoffs.parked) if self._handoffs is not None else 0,
            **self.scheduler.stats(),
            "steps": self.num_steps,
            "computed_tokens": self.num_computed_tokens,
            "tokens_per_s": generated / self.step_s if self.step_s else 0.0,
            "lm_busy_s": self.lm_busy_s,
            **self.output_processor.stats(),
            **self.encoder_cache.stats(),
            **self.intake.stats(),
            **self.processor.processor_cache.stats(),
            **self.runner.stats(),
        }

    def close(self) -> None:
        """Stop the preprocessing workers and write the trace, if one was asked for (LLM.close)."""
        self.intake.close()
        if self.config.trace_path is not None:
            self.trace.save()


def _make_proposer(config: EngineConfig, draft_model: Qwen2VL | None, target: Qwen2VL, target_encoder_cache):
    """target_encoder_cache: (cache, model identity), shared with a draft whose vision tower is the target's."""
    spec = config.speculative
    if spec is None:
        return None
    if spec.method == "ngram":
        from nanomm.engine.speculative import NgramProposer

        return NgramProposer(spec)
    from nanomm.engine.draft import DraftProposer, same_vision_tower

    shared = target_encoder_cache if same_vision_tower(target, draft_model) else None
    return DraftProposer(draft_model, config.num_kv_blocks, config.block_size, target.config.text.vocab_size,
                         config.encoder_cache_size, shared, config.kv_cache_dtype)


def _decode_graphs(model: Qwen2VL, kv_cache, config: EngineConfig):
    """CUDA graphs of the decode step (cuda_graphs.py), captured up to the longest context asked for."""
    from nanomm.engine.cuda_graphs import DecodeGraphs
    from nanomm.engine.sizing import graph_context

    longest = graph_context(config.max_model_len, config.max_seq_len_to_capture)
    return DecodeGraphs(model, kv_cache, config.block_size, config.num_kv_blocks * config.block_size,
                        config.max_num_seqs, longest)


def _step_trace(path):
    from nanomm.engine.trace import StepTrace  # a lever: loaded when a trace is asked for

    return StepTrace(path)


def _encode_ahead(engine: LLMEngine):
    """With an encoder service, a request's visual tokens are fetched off the step (encode_ahead.py); None when the
    tower runs here, inside the step."""
    if engine.runner.remote_encoder is None:
        return None
    from nanomm.engine.encode_ahead import encode_ahead_for

    return encode_ahead_for(engine)


def _remote_encoder(model: Qwen2VL, config: EngineConfig):
    """The encoder service's client (transfer.py): the visual tokens of every image come from config.encoder_url."""
    from nanomm.transfer import RemoteEncoder

    return RemoteEncoder(config.encoder_url, model.config.text.hidden_size, model.dtype, model.device,
                         config.encoder_timeout_s, levels=1 + len(model.config.vision.deepstack_visual_indexes))


VIDEO_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")  # video checked against transformers (lesson 17)


def _no_video_reason(model_config) -> str | None:
    """Why this engine takes no video (a text-only model), or None."""
    if model_config.model_type not in VIDEO_FAMILIES:
        return f"videos are served for {', '.join(VIDEO_FAMILIES)} models, not {model_config.model_type}"
    return None


def _video_settings(model_config, image_config, video_preprocessor: dict | None, config: EngineConfig):
    """The engine's video settings where the checkpoint or the arguments set any (inputs/video_settings.py);
    None: the family's, made when the first video comes (a pictures-only engine imports no video code)."""
    if not video_preprocessor and not config.media_io_kwargs and not config.video_pruning_rate:
        return None
    from nanomm.inputs.video_settings import VideoSettings

    try:
        settings = VideoSettings.for_model(model_config.model_type, image_config, video_preprocessor)
        settings = settings.with_engine_kwargs((config.media_io_kwargs or {}).get("video", {}))
        return settings.with_request({"video_pruning_rate": config.video_pruning_rate}, "engine", cap=False)
    except InvalidInputError as exc:
        raise ValueError(str(exc)) from None


def _check_params(params, name: str, engine: LLMEngine) -> SamplingParams:
    """Checked sampling params; a structured_outputs constraint is compiled here (once), before any compute."""
    if params is None:
        return SamplingParams()
    if not isinstance(params, SamplingParams):
        raise InvalidInputError(f"{name}: sampling params must be a SamplingParams, got {type(params).__name__}")
    try:
        params.validate()
        if params.structured_outputs is not None:
            from nanomm.engine.structured import compiler_of
            compiler_of(engine).compile(params.structured_outputs)
        return params
    except InvalidInputError as exc:
        raise InvalidInputError(f"{name}: {exc}") from None


def _new_matcher(engine: LLMEngine, params: SamplingParams):
    """A constrained sequence's own matcher (structured.py; one per completion of n > 1), or None."""
    if params.structured_outputs is None:
        return None
    from nanomm.engine.structured import compiler_of
    return compiler_of(engine).matcher(params.structured_outputs)


def _follow_grammar(request: Request, token_ids: list[int]) -> tuple[list[int], bool]:
    """The tokens that stand and whether the grammar is complete (then the request stops); structured.py."""
    return (token_ids, False) if request.grammar is None else request.grammar.advance(token_ids)


def _derived_seed(engine_seed: int, request_id: str) -> int:
    """A reproducible per-request seed for requests that set none (Python's hash() is salted per process)."""
    return int.from_bytes(hashlib.sha256(f"{engine_seed}:{request_id}".encode()).digest()[:8], "little") >> 1
