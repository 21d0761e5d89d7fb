"""The step timeline: a Chrome / Perfetto trace of what the engine did, step by step and request by request.

Lesson: lessons/12-capstone.md ("The whole run on one timeline").

    LLM(model, trace_path="run.json")      # written when the LLM closes
    nanomm-chat --demo --trace run.json

Open the file in https://ui.perfetto.dev or chrome://tracing. It has:
- one lane, "engine steps", with each `step()` split into schedule (and propose, with speculation), encode,
  forward, sample and commit;
- one lane per request: preprocess (on the worker pool), waiting, prefill (from the first scheduled step to the
  first token, with the request's encode share and its chunks inside), then one event per decode step
  ("decode", or "verify" with the proposals and how many were accepted), preempted, finish;
- counters: KV blocks used and free, and the prefix- and encoder-cache hit rates.

A request's TTFT stages are the lane's own spans: preprocess + waiting + prefill = TTFT, and the encode spans
inside prefill add up to `metrics.encode_s` (outputs.py). The format is Chrome's "Trace Event Format": a JSON
object whose `traceEvents` are complete events (ph "X", a start and a duration in microseconds), instants ("i"),
counters ("C") and the metadata ("M") that names the lanes. Events are kept in memory until `save`, so trace a
run, not a server that stays up for days.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path

ENGINE_PID, REQUESTS_PID = 0, 1
STEP_LANE = 0


class StepTrace:
    """Collects trace events; `save` writes them. Times are time.perf_counter() seconds, as in RequestMetrics."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path).resolve()  # where the caller meant, even if the working folder changes
        self.origin = time.perf_counter()
        self.events: list[dict] = [
            _meta(ENGINE_PID, None, "process_name", "nanomm engine"),
            _meta(ENGINE_PID, STEP_LANE, "thread_name", "engine steps"),
            _meta(REQUESTS_PID, None, "process_name", "requests"),
        ]
        self.lanes: dict[str, int] = {}  # request id -> its lane (tid)
        self.waiting_since: dict[str, float] = {}  # request id -> when it (re)joined the queue
        self.forward_span: tuple[float, float] | None = None  # this step's forward pass

    # -- the engine lane ----------------------------------------------------------------------------------

    @contextlib.contextmanager
    def span(self, name: str, **args):
        """A span of the engine lane around a block of the step."""
        start = time.perf_counter()
        try:
            yield
        finally:
            end = time.perf_counter()
            self._complete(name, start, end, ENGINE_PID, STEP_LANE, args)
            if name == "forward":
                self.forward_span = (start, end)

    def counters(self, block_manager, encoder_cache) -> None:
        """After each step: the KV pool's blocks and the two caches' hit rates (read only when tracing)."""
        blocks, encoder = block_manager.stats(), encoder_cache.stats()
        now = self._us(time.perf_counter())
        used = blocks["kv_blocks_used"]
        for name, values in (("KV blocks", {"used": used, "free": blocks["kv_blocks_total"] - used}),
                             ("cache hit rate", {"prefix": round(blocks["prefix_cache_hit_rate"], 4),
                                                 "encoder": round(encoder["encoder_cache_hit_rate"], 4)})):
            self.events.append({"ph": "C", "name": name, "pid": ENGINE_PID, "ts": now, "args": values})

    # -- the request lanes --------------------------------------------------------------------------------

    def request_ready(self, request) -> None:
        """Its images are preprocessed and it joins the scheduler's queue."""
        metrics = request.metrics
        ready = request.prompt.ready_time
        self._complete("preprocess", metrics.arrival_time, ready, REQUESTS_PID, self._lane(request.request_id),
                       {"preprocess_s": metrics.preprocess_s})
        self.waiting_since[request.request_id] = ready

    def scheduled(self, chunks) -> None:
        """After `schedule`: the requests that start (or restart) this step leave the queue."""
        now = time.perf_counter()
        for chunk in chunks:
            request_id = chunk.request.request_id
            since = self.waiting_since.pop(request_id, None)
            if since is not None:
                first = chunk.request.metrics.first_scheduled_time
                end = first if first is not None and first >= since else now
                self._complete("waiting", since, end, REQUESTS_PID, self._lane(request_id), {})

    def encoded(self, request, start: float, encode_s: float) -> None:
        """The vision tower encoded one of the request's images; encode_s is its share of the batch."""
        self._complete("encode", start, start + encode_s, REQUESTS_PID, self._lane(request.request_id),
                       {"encode_s": encode_s})

    def committed(self, chunk, num_emitted: int, num_accepted: int) -> None:
        """A chunk ran in this step's forward pass and its tokens were committed."""
        request, (start, end) = chunk.request, self.forward_span
        lane, metrics = self._lane(request.request_id), request.metrics
        prefill = chunk.start < request.num_prompt_tokens
        name = "prefill chunk" if prefill else ("verify" if chunk.spec_token_ids else "decode")
        args = {"positions": [chunk.start, chunk.end], "tokens_out": num_emitted}
        if chunk.spec_token_ids:
            args |= {"proposed": len(chunk.spec_token_ids), "accepted": num_accepted}
        self._complete(name, start, end, REQUESTS_PID, lane, args)
        if prefill and num_emitted and metrics.first_token_time is not None and metrics.first_token_time >= end:
            self._complete("prefill", metrics.first_scheduled_time, metrics.first_token_time, REQUESTS_PID, lane,
                           {"ttft_s": metrics.ttft_s, "preprocess_s": metrics.preprocess_s,
                            "queue_s": metrics.queue_s, "encode_s": metrics.encode_s, "prefill_s": metrics.prefill_s,
                            "cached_tokens": metrics.num_cached_tokens})

    def preempted(self, request) -> None:
        now = time.perf_counter()
        self._instant("preempted", now, self._lane(request.request_id), {})
        self.waiting_since[request.request_id] = now

    def finished(self, request, reason: str) -> None:
        self.waiting_since.pop(request.request_id, None)
        self._instant("finish", time.perf_counter(), self._lane(request.request_id),
                      {"reason": reason, "output_tokens": len(request.output_token_ids)})

    # -- output -------------------------------------------------------------------------------------------

    def save(self) -> Path:
        """Write the trace (atomically: a reader never sees half a file)."""
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps({"traceEvents": self.events, "displayTimeUnit": "ms"}))
        tmp.replace(self.path)
        return self.path

    def _lane(self, request_id: str) -> int:
        if request_id not in self.lanes:
            tid = self.lanes[request_id] = len(self.lanes) + 1
            self.events.append(_meta(REQUESTS_PID, tid, "thread_name", f"request {request_id}"))
            self.events.append(_meta(REQUESTS_PID, tid, "thread_sort_index", tid, key="sort_index"))
        return self.lanes[request_id]

    def _us(self, t: float) -> float:
        return round((t - self.origin) * 1e6, 3)

    def _complete(self, name, start, end, pid, tid, args) -> None:
        self.events.append({"ph": "X", "name": name, "pid": pid, "tid": tid, "ts": self._us(start),
                            "dur": round(max(0.0, end - start) * 1e6, 3), "args": args})

    def _instant(self, name, t, tid, args) -> None:
        self.events.append({"ph": "i", "s": "t", "name": name, "pid": REQUESTS_PID, "tid": tid, "ts": self._us(t),
                            "args": args})


def _meta(pid: int, tid: int | None, name: str, value, key: str = "name") -> dict:
    event = {"ph": "M", "name": name, "pid": pid, "args": {key: value}}
    if tid is not None:
        event["tid"] = tid
    return event
