"""Requests in: validate a prompt, preprocess its images inline or on the worker pool, and hold the outputs that
are ready before any model step (a request aborted while preprocessing, an image that failed to decode).

Lesson: lessons/07-encoder-cache.md (the worker pool and the TTFT breakdown).

Nothing here touches the KV pool or the scheduler: a request enters them only once its images are ready, through
the `admit` callback the engine passes to `collect`. So a prompt that fails here has allocated nothing. With an
encoder service, ready means preprocessed and its visual tokens fetched (encode_ahead.py): that wait is here too,
off the engine's step.
"""

import time

from nanomm.engine.kv_cache import BlockManager
from nanomm.errors import InvalidInputError, PeerError
from nanomm.inputs.pool import PreprocessPool
from nanomm.inputs.prompt import InputProcessor, PreparedPrompt, ValidatedPrompt
from nanomm.outputs import CompletionOutput, RequestMetrics, RequestOutput
from nanomm.sampling import SamplingParams


class RequestIntake:
    def __init__(self, processor: InputProcessor, pool: PreprocessPool, block_manager: BlockManager,
                 max_model_len: int, encode_ahead=None):
        self.processor, self.pool, self.block_manager = processor, pool, block_manager
        self.max_model_len = max_model_len
        self.encode_ahead = encode_ahead  # an EncodeAhead with an encoder service; None: the tower is in the step
        self.preprocessing: dict[str, tuple[ValidatedPrompt, SamplingParams, float]] = {}  # id -> its job's inputs
        self.encoding: dict[str, tuple] = {}  # id -> (validated or None, prepared, params) while its tokens come
        self.early_outputs: list[RequestOutput] = []  # aborts and preprocessing errors, reported by the next step

    def prepare(self, validated: ValidatedPrompt, params: SamplingParams) -> PreparedPrompt:
        """Decode and resize the images and expand the prompt; raises InvalidInputError."""
        prepared = self.processor.preprocess(validated)
        self.check_fits(prepared, params, validated.name)
        return prepared

    def prepare_all(self, validated: list[ValidatedPrompt], params: list[SamplingParams]) -> list[PreparedPrompt]:
        """`prepare` for many prompts, images decoded in parallel on the pool; the first bad prompt raises."""
        arrival = time.perf_counter()
        results = self.pool.map([lambda v=v, sp=sp: self.prepare(v, sp) for v, sp in zip(validated, params)])
        for result in results:
            if isinstance(result, Exception):
                raise result
        for prepared in results:
            prepared.arrival_time = arrival
        return results

    def check_fits(self, prepared: PreparedPrompt, params: SamplingParams, name: str) -> None:
        """A request whose longest possible sequence needs more blocks than the whole pool could never finish."""
        max_len = min(len(prepared.token_ids) + params.token_limit, self.max_model_len)
        needed, pool = self.block_manager.blocks_needed(max_len), self.block_manager.num_blocks
        if needed > pool:
            raise InvalidInputError(
                f"{name}: up to {max_len} tokens need {needed} KV blocks, but the whole pool has {pool}; lower "
                "max_tokens or max_pixels, or give the engine more KV memory")

    def submit(self, request_id: str, validated: ValidatedPrompt, params: SamplingParams, arrival: float) -> None:
        """Preprocess on a worker; `collect` picks the result up."""
        self.preprocessing[request_id] = (validated, params, arrival)
        self.pool.submit(request_id, lambda: self.prepare(validated, params))

    def fail(self, request_id: str, validated: ValidatedPrompt, message: str, arrival: float) -> None:
        """This request alone ends with finish_reason "error"; the next step reports it."""
        self.early_outputs.append(final_output(request_id, validated, "error", message, arrival))

    def collect(self, wait_s: float, admit) -> None:
        """Hand every request that is ready to `admit(request_id, prepared, params)`: preprocessed, and with an
        encoder service its visual tokens in. A job that failed, or whose admission raised, becomes an error
        output for its request alone."""
        fetching = self.encode_ahead is not None and self.encode_ahead.has_pending()
        for request_id, result in self.pool.poll(0.0 if fetching else wait_s):
            validated, params, arrival = self.preprocessing.pop(request_id)
            if isinstance(result, PreparedPrompt):
                result.arrival_time = arrival
                self.ready(request_id, result, params, admit, validated)
                continue
            self.fail(request_id, validated, error_message(result, validated.name), arrival)
        if fetching:
            self.encode_ahead.wait(wait_s)  # an idle engine waits for the tokens instead of spinning
            self.encode_ahead.admit_landed(self.encoding, admit, self.early_outputs)

    def ready(self, request_id: str, prepared: PreparedPrompt, params: SamplingParams, admit,
              validated: ValidatedPrompt | None = None) -> None:
        """A preprocessed request: admitted now, or once the encoder service's tokens for it are in. Admitted now,
        an admission that raises is this request's error alone when it came from the pool (validated given), and
        raises to the caller otherwise."""
        if self.encode_ahead is not None and self.encode_ahead.start(request_id, prepared):
            self.encoding[request_id] = (validated, prepared, params)
            return
        try:
            admit(request_id, prepared, params)
        except Exception as exc:  # noqa: BLE001 - whatever it is, it is this request's alone
            if validated is None:
                raise
            self.fail(request_id, validated, error_message(exc, validated.name), prepared.arrival_time)

    def cancel(self, request_id: str) -> bool:
        """Abort a request still preprocessing or waiting for its visual tokens (its output says "abort"); False
        if it is neither."""
        if request_id in self.encoding and self.encode_ahead.cancel(request_id):
            _, prepared, _ = self.encoding.pop(request_id)
            self.early_outputs.append(final_output(request_id, prepared, "abort", None, prepared.arrival_time))
            return True
        if request_id not in self.preprocessing:
            return False
        self.pool.cancel(request_id)
        validated, _, arrival = self.preprocessing.pop(request_id)
        self.early_outputs.append(final_output(request_id, validated, "abort", None, arrival))
        return True

    def take_early_outputs(self) -> list[RequestOutput]:
        outputs, self.early_outputs = self.early_outputs, []
        return outputs

    def forget_outputs(self, request_ids) -> None:
        """Drop pending outputs of these requests (LLM.generate cleaning up after an error: nobody reads them)."""
        request_ids = set(request_ids)
        self.early_outputs = [o for o in self.early_outputs if o.request_id not in request_ids]

    def has_pending(self) -> bool:
        return bool(self.preprocessing or self.encoding or self.early_outputs)

    def stats(self) -> dict:
        ahead = self.encode_ahead.stats() if self.encode_ahead is not None else {}
        return {"preprocess_queue": len(self.pool), **ahead}

    def close(self) -> None:
        self.pool.shutdown()
        if self.encode_ahead is not None:
            self.encode_ahead.close()


def final_output(request_id: str, prompt: ValidatedPrompt | PreparedPrompt, reason: str,
                 error: str | None, arrival: float, status: int = 400) -> RequestOutput:
    """The one output of a request that ended before it was scheduled (status: an error's, over HTTP)."""
    completion = CompletionOutput(0, [], "", reason, error=error, error_status=status)
    metrics = RequestMetrics(arrival_time=arrival, e2e_s=time.perf_counter() - arrival)
    return RequestOutput(request_id, prompt.text, list(prompt.token_ids), [completion], True, metrics)


def error_message(error: Exception, name: str) -> str:
    """What the caller reads of a request's failure: our own errors as they are, anything else with its type."""
    return str(error) if isinstance(error, (InvalidInputError, PeerError)) else f"{name}: {error!r}"
