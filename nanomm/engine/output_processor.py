"""Tokens out: where a request stops, its streamed text, its metrics, and the RequestOutput the caller sees.

Lesson: lessons/05-continuous-batching.md (outputs and metrics), lessons/08-speculative-decoding.md (tokens
per decode step).

The engine appends the tokens a step emitted; this class decides how many of them stand (a stop token or a
length limit may come in the middle of accepted proposals), turns them into text incrementally, and keeps the
time-to-first-token breakdown and the speculation counters, per request and for the engine.
"""

import time

from nanomm.engine.request import Request, Status
from nanomm.inputs.tokenizer import IncrementalDetokenizer, Tokenizer
from nanomm.outputs import CompletionOutput, RequestMetrics, RequestOutput


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, max_model_len: int):
        self.tokenizer, self.max_model_len = tokenizer, max_model_len
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}
        self.counters = dict(generated_tokens=0, decode_steps=0, decode_tokens=0, draft_tokens=0, accepted_tokens=0)

    def add(self, request: Request) -> None:
        self.detokenizers[request.request_id] = IncrementalDetokenizer(self.tokenizer)

    def cut_at_finish(self, request: Request, tokens: list[int]) -> tuple[list[int], str | None]:
        """The tokens up to the first that finishes the request (a stop token, max_tokens, max_model_len)."""
        for i, token in enumerate(tokens, start=1):
            if token in request.stop_token_ids:
                return tokens[:i], "stop"
            if (len(request.output_token_ids) + i >= request.params.max_tokens
                    or request.num_tokens + i >= self.max_model_len):
                return tokens[:i], "length"
        return tokens, None

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
            metrics.queue_s = metrics.first_scheduled_time - request.prompt.ready_time
            metrics.prefill_s = now - metrics.first_scheduled_time - metrics.encode_s
        if finished:
            metrics.e2e_s = now - metrics.arrival_time
            num_out = len(request.output_token_ids)
            metrics.tpot_s = (now - metrics.first_token_time) / (num_out - 1) if num_out > 1 else None

    def make_output(self, request: Request, new_tokens: list[int]) -> RequestOutput:
        """The cumulative output plus this step's delta; a finished request's detokenizer is dropped."""
        rid = request.request_id
        detokenizer = self.detokenizers[rid]
        delta = "".join(detokenizer.step(t) for t in new_tokens)
        finished = request.status is Status.FINISHED
        completion = CompletionOutput(0, list(request.output_token_ids), detokenizer.text, request.finish_reason,
                                      list(new_tokens), delta)
        if finished:
            del self.detokenizers[rid]
        return RequestOutput(rid, request.prompt.text, list(request.prompt.token_ids), [completion], finished,
                             request.metrics)

    def stats(self) -> dict:
        c = self.counters
        return {
            "generated_tokens": c["generated_tokens"],
            "spec_draft_tokens": c["draft_tokens"],
            "spec_accepted_tokens": c["accepted_tokens"],
            "spec_acceptance_rate": c["accepted_tokens"] / c["draft_tokens"] if c["draft_tokens"] else 0.0,
            "mean_tokens_per_decode_step": c["decode_tokens"] / c["decode_steps"] if c["decode_steps"] else 0.0,
        }
