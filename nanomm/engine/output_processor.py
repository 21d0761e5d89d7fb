"""Tokens out: where a request stops, its streamed text, its metrics, and the RequestOutput the caller sees.

Lesson: lessons/05-continuous-batching.md (outputs and metrics), lessons/08-speculative-decoding.md (tokens
per decode step).

The engine appends the tokens a step emitted; this class decides how many of them stand (a stop token, a stop
string or a length limit may come in the middle of accepted proposals), turns them into text incrementally
(holding back, while streaming, the characters a stop string could start with), keeps the log-probabilities a
request asked for, and keeps the time-to-first-token breakdown and the speculation counters, per request and for
the engine.
"""

import time
from dataclasses import dataclass

import torch

from nanomm.engine.request import Request, Status
from nanomm.inputs.tokenizer import IncrementalDetokenizer, Tokenizer
from nanomm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from nanomm.sampling import top_logprobs


@dataclass
class OutputStream:
    """What one request has produced so far, as the caller sees it."""
    detokenizer: IncrementalDetokenizer
    text: str = ""  # the output text, cut where a stop string matched
    num_sent_chars: int = 0  # how much of it has been streamed
    holdback: int = 0  # characters kept back while streaming: the start of a stop string may be in them
    stop_search_from: int = 0  # a stop string counts only in text after the first min_tokens tokens (vLLM)
    stop_reason: int | str | None = None
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, max_model_len: int):
        self.tokenizer, self.max_model_len = tokenizer, max_model_len
        self.streams: dict[str, OutputStream] = {}
        self.counters = dict(generated_tokens=0, decode_steps=0, decode_tokens=0, draft_tokens=0, accepted_tokens=0)

    def add(self, request: Request) -> None:
        p = request.params
        wants_logprobs = p.logprobs is not None
        holdback = 0 if not p.stop or p.include_stop_str_in_output else max(map(len, p.stop)) - 1
        self.streams[request.request_id] = OutputStream(
            IncrementalDetokenizer(self.tokenizer, p.skip_special_tokens), holdback=holdback,
            cumulative_logprob=0.0 if wants_logprobs else None, logprobs=[] if wants_logprobs else None,
            prompt_logprobs=[None] if p.prompt_logprobs is not None else None)

    def take_tokens(self, request: Request, token_ids: list[int], logprobs: list[dict] | None = None
                    ) -> tuple[list[int], str | None]:
        """Take the emitted tokens one at a time, up to the first that finishes the request (a stop token, a stop
        string, max_tokens, max_model_len); returns the kept tokens and the finish reason. Text and logprobs
        follow; the caller appends the tokens to the request."""
        stream, params = self.streams[request.request_id], request.params
        for i, token in enumerate(token_ids):
            num_output = len(request.output_token_ids) + i + 1
            if logprobs is not None:
                self._add_logprobs(stream, token, logprobs[i])
            if num_output >= params.min_tokens and token in request.stop_token_ids:
                stream.stop_reason = None if token in self.tokenizer.eos_token_ids else token
                if params.include_stop_str_in_output:
                    stream.text += stream.detokenizer.step(token)
                return token_ids[:i + 1], "stop"
            piece = stream.detokenizer.step(token)
            stream.text += piece
            if num_output == params.min_tokens:
                stream.stop_search_from = len(stream.text)
            if num_output > params.min_tokens and params.stop and self._cut_at_stop_string(stream, piece, params):
                return token_ids[:i + 1], "stop"
            if num_output >= params.token_limit or request.num_tokens + i + 1 >= self.max_model_len:
                return token_ids[:i + 1], "length"
        return token_ids, None

    @staticmethod
    def _cut_at_stop_string(stream: OutputStream, piece: str, params) -> bool:
        """Find a stop string that the new piece of text completes (it may span several tokens and streamed
        deltas); cut the text there, after the string if it is to be included."""
        for stop in params.stop:
            start = max(stream.stop_search_from, len(stream.text) - len(piece) - len(stop) + 1)
            at = stream.text.find(stop, start)
            if at >= 0:
                stream.text = stream.text[:at + len(stop) if params.include_stop_str_in_output else at]
                stream.stop_reason = stop
                return True
        return False

    def _add_logprobs(self, stream: OutputStream, token: int, entry: dict) -> None:
        stream.logprobs.append(self._decoded(entry))
        stream.cumulative_logprob += entry[token][0]

    def _decoded(self, entry: dict[int, tuple[float, int]]) -> dict[int, Logprob]:
        return {t: Logprob(value, rank, self.tokenizer.decode([t])) for t, (value, rank) in entry.items()}

    def record_prompt_logprobs(self, request: Request, start: int, logits: torch.Tensor) -> None:
        """logits (rows, vocab): the raw logits at prompt positions start, start + 1, ...; each row predicts the
        prompt token after it. Positions already recorded (a preempted request computes them again) are skipped."""
        stream = self.streams[request.request_id]
        have = len(stream.prompt_logprobs)  # prompt tokens 0..have-1 are done; token `have` is predicted at have-1
        rows = logits[have - 1 - start:]
        targets = request.prompt.token_ids[have:have + rows.shape[0]]
        for entry in top_logprobs(rows[:len(targets)], targets, request.params.prompt_logprobs):
            stream.prompt_logprobs.append(self._decoded(entry))

    def count_decode_step(self, metrics: RequestMetrics, num_proposed: int, num_accepted: int, num_emitted: int):
        """Speculation metrics, per request and for the engine: proposals verified, proposals the target
        accepted, tokens emitted per decode step."""
        metrics.num_decode_steps += 1
        metrics.num_decode_tokens += num_emitted
        metrics.num_draft_tokens += num_proposed
        metrics.num_accepted_tokens += num_accepted
        for key, n in (("decode_steps", 1), ("decode_tokens", num_emitted), ("draft_tokens", num_proposed),
                       ("accepted_tokens", num_accepted)):
            self.counters[key] += n

    def record_tokens(self, request: Request, num_new: int, finished: bool) -> None:
        """Timing metrics once the new tokens are appended: TTFT (= preprocess + queue + encode + prefill) at
        the first token, end-to-end time and time per output token at the last."""
        now, metrics = time.perf_counter(), request.metrics
        self.counters["generated_tokens"] += num_new
        if metrics.first_token_time is None:
            metrics.first_token_time = now
            metrics.ttft_s = now - metrics.arrival_time
            metrics.queue_s, metrics.prefill_s = metrics.queue_and_prefill(request.prompt.ready_time, now)
        if finished:
            metrics.e2e_s = now - metrics.arrival_time
            num_out = len(request.output_token_ids)
            metrics.tpot_s = (now - metrics.first_token_time) / (num_out - 1) if num_out > 1 else None

    def make_output(self, request: Request, new_tokens: list[int]) -> RequestOutput:
        """The cumulative output plus this step's delta; a finished request's stream is dropped. While it runs,
        the last characters that could start a stop string are held back from the text."""
        stream = self.streams[request.request_id]
        finished = request.status is Status.FINISHED
        visible = len(stream.text) if finished else max(stream.num_sent_chars, len(stream.text) - stream.holdback)
        delta, stream.num_sent_chars = stream.text[stream.num_sent_chars:visible], visible
        completion = CompletionOutput(
            request.completion_index, list(request.output_token_ids), stream.text[:visible], request.finish_reason,
            list(new_tokens), delta, stop_reason=stream.stop_reason, cumulative_logprob=stream.cumulative_logprob,
            logprobs=None if stream.logprobs is None else list(stream.logprobs), error=request.error,
            error_status=request.error_status)
        if finished:
            del self.streams[request.request_id]
        return RequestOutput(request.request_id, request.prompt.text, list(request.prompt.token_ids), [completion],
                             finished, request.metrics, prompt_logprobs=stream.prompt_logprobs)

    def stats(self) -> dict:
        c = self.counters
        return {
            "generated_tokens": c["generated_tokens"],
            "spec_draft_tokens": c["draft_tokens"],
            "spec_accepted_tokens": c["accepted_tokens"],
            "spec_acceptance_rate": c["accepted_tokens"] / c["draft_tokens"] if c["draft_tokens"] else 0.0,
            "mean_tokens_per_decode_step": c["decode_tokens"] / c["decode_steps"] if c["decode_steps"] else 0.0,
        }
