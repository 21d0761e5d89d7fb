"""One thread owns the engine: it adds requests, aborts them and steps; nothing else touches the engine.

Lesson: lessons/05-continuous-batching.md (what one step does; here it runs in a loop of its own).

HTTP handlers run on an asyncio event loop, and a model step takes milliseconds to seconds: stepping on the event
loop would freeze every connection for that long. So the engine lives on its own thread, and the two sides talk
through queues, the pattern vLLM's AsyncLLM and SGLang's tokenizer manager follow across processes:

- handlers put commands ("add this request", "abort that one") on a thread-safe queue;
- the engine thread drains it between steps, steps, and hands each request's outputs to the callback that came
  with it (the server's callback posts them to an `OutputMailbox`, which moves them onto the handlers' asyncio
  queues: one wake-up of the event loop for all the outputs of a step, not one a request).

An error from `add_request` (bad input) goes to the same callback, as the exception itself. `call` runs any
function on the engine thread and returns a Future of its result: how a prefill instance's KV route reads a
parked request's blocks, and how a decode instance takes its cached prefix, without racing the steps.
"""

import asyncio
import queue
import threading
from concurrent.futures import Future
from typing import Callable

from nanomm.engine.engine import LLMEngine
from nanomm.outputs import RequestOutput

IDLE_WAIT_S = 0.05  # how long an idle engine thread waits for a command before looking again


class EngineLoop:
    def __init__(self, engine: LLMEngine, on_step: Callable[[dict], None] = lambda stats: None,
                 on_finished: Callable[[RequestOutput], None] = lambda out: None, parks_kv: bool = False):
        self.engine = engine
        self.parks_kv = parks_kv  # a prefill instance: parked KV that no decode instance takes expires here
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

    def admit(self, request_id: str, add: Callable[[LLMEngine], object], callback: Callable) -> None:
        """From any thread: add(engine) adds the request on the engine thread (`add_request`, or a decode
        instance's `handoffs.add_transferred`). callback(RequestOutput, or the exception add raised) is called there."""
        self._commands.put(("add", request_id, add, callback))

    def call(self, function: Callable[[LLMEngine], object]) -> Future:
        """Run function(engine) on the engine thread, between steps; the Future holds its result or error."""
        future: Future = Future()
        self._commands.put(("call", function, future))
        return future

    def abort(self, request_id: str) -> None:
        """From any thread: stop the request and free its KV blocks (its callback gets no more outputs)."""
        self._commands.put(("abort", request_id))

    @property
    def num_requests(self) -> int:
        """Requests added and not finished (read from other threads: an approximate count is fine there)."""
        return len(self._callbacks) + self._commands.qsize()

    def _run(self) -> None:
        while not self._stopping.is_set():
            if self.parks_kv and self.engine.handoffs.expire():  # a decode peer never came: its KV blocks are free
                self.on_step(self.engine.stats())
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
        """Apply every queued command, waiting up to wait_s for the first one. When no step follows, publish fresh
        stats here (a KV export frees blocks without any step); a step publishes its own."""
        applied = False
        try:
            self._apply(self._commands.get(timeout=wait_s) if wait_s else self._commands.get_nowait())
            applied = True
            while True:
                self._apply(self._commands.get_nowait())
        except queue.Empty:
            pass
        if applied and not self.engine.has_unfinished_requests():
            self.on_step(self.engine.stats())

    def _apply(self, command: tuple) -> None:
        if command[0] == "abort":
            self._callbacks.pop(command[1], None)
            self.engine.abort_request(command[1])
            return
        if command[0] == "call":
            _, function, future = command
            try:
                future.set_result(function(self.engine))
            except Exception as exc:  # noqa: BLE001 - the caller's to handle
                future.set_exception(exc)
            return
        _, request_id, add, callback = command
        try:
            add(self.engine)
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


class OutputMailbox:
    """Outputs from the engine thread to an event loop's queues, in batches: the first post since the loop last
    emptied the mailbox wakes it (`call_soon_threadsafe`), later ones ride along. A step that finishes a token for
    a hundred streams costs the event loop one wake-up, not a hundred."""

    def __init__(self, event_loop: asyncio.AbstractEventLoop):
        self.event_loop = event_loop
        self._lock = threading.Lock()
        self._pending: list[tuple[asyncio.Queue, object]] = []

    def post(self, outputs: asyncio.Queue, item) -> None:
        """From any thread: put item on outputs, on the event loop's thread."""
        with self._lock:
            self._pending.append((outputs, item))
            wake = len(self._pending) == 1
        if wake:
            self.event_loop.call_soon_threadsafe(self._empty)

    def _empty(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for outputs, item in pending:
            outputs.put_nowait(item)
