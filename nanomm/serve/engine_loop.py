"""One thread owns the engine: it adds requests, aborts them and steps; nothing else touches the engine.

Lesson: lessons/05-continuous-batching.md (what one step does; here it runs in a loop of its own).

HTTP handlers run on an asyncio event loop, and a model step takes milliseconds to seconds: stepping on the event
loop would freeze every connection for that long. So the engine lives on its own thread, and the two sides talk
through queues, the pattern vLLM's AsyncLLM and SGLang's tokenizer manager follow across processes:

- handlers put commands ("add this request", "abort that one") on a thread-safe queue;
- the engine thread drains it between steps, steps, and hands each request's outputs to the callback that came
  with it (the server's callback moves them onto the handler's asyncio queue with `call_soon_threadsafe`).

An error from `add_request` (bad input) goes to the same callback, as the exception itself.
"""

import queue
import threading
from typing import Callable

from nanomm.engine.engine import LLMEngine
from nanomm.outputs import RequestOutput
from nanomm.sampling import SamplingParams

IDLE_WAIT_S = 0.05  # how long an idle engine thread waits for a command before looking again


class EngineLoop:
    def __init__(self, engine: LLMEngine, on_step: Callable[[dict], None] = lambda stats: None,
                 on_finished: Callable[[RequestOutput], None] = lambda out: None):
        self.engine = engine
        # Called on the engine thread: after every step with engine.stats(), and with every finished output
        # (aborted ones included, whose callbacks are gone).
        self.on_step, self.on_finished = on_step, on_finished
        self._commands: queue.Queue = queue.Queue()
        self._callbacks: dict[str, Callable] = {}  # request id -> where its outputs go
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="nanomm-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join(timeout=30)

    def add(self, request_id: str, prompt, params: SamplingParams, callback: Callable) -> None:
        """From any thread. callback(RequestOutput or InvalidInputError) is called on the engine thread."""
        self._commands.put(("add", request_id, prompt, params, callback))

    def abort(self, request_id: str) -> None:
        """From any thread: stop the request and free its KV blocks (its callback gets no more outputs)."""
        self._commands.put(("abort", request_id))

    @property
    def num_requests(self) -> int:
        """Requests added and not finished (read from other threads: an approximate count is fine there)."""
        return len(self._callbacks) + self._commands.qsize()

    def _run(self) -> None:
        while not self._stopping.is_set():
            busy = self.engine.has_unfinished_requests()
            self._take_commands(wait_s=0.0 if busy else IDLE_WAIT_S)
            if self.engine.has_unfinished_requests():
                try:
                    outputs = self.engine.step()
                except Exception as exc:  # a bug: fail what is running, keep serving
                    self._fail_all(exc)
                    continue
                for out in outputs:
                    if out.finished:
                        self.on_finished(out)
                    self._deliver(out)
                self.on_step(self.engine.stats())

    def _take_commands(self, wait_s: float) -> None:
        """Apply every queued command, waiting up to wait_s for the first one."""
        try:
            self._apply(self._commands.get(timeout=wait_s) if wait_s else self._commands.get_nowait())
            while True:
                self._apply(self._commands.get_nowait())
        except queue.Empty:
            pass

    def _apply(self, command: tuple) -> None:
        if command[0] == "abort":
            self._callbacks.pop(command[1], None)
            self.engine.abort_request(command[1])
            return
        _, request_id, prompt, params, callback = command
        try:
            self.engine.add_request(prompt, params, request_id=request_id)
        except Exception as exc:  # bad input (InvalidInputError) or a bug: this request alone fails
            callback(exc)
            return
        self._callbacks[request_id] = callback

    def _fail_all(self, exc: Exception) -> None:
        callbacks, self._callbacks = self._callbacks, {}
        for request_id, callback in callbacks.items():
            self.engine.abort_request(request_id)
            callback(exc)

    def _deliver(self, out) -> None:
        callback = self._callbacks.get(out.request_id)
        if callback is None:
            return  # aborted: its last output has nobody to go to
        if out.finished:
            del self._callbacks[out.request_id]
        callback(out)
