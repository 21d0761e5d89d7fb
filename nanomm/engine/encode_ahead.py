"""Encode-ahead: a request whose pictures an encoder service encodes waits for their visual tokens off the engine's
step, so no step waits on a remote encode.

Lesson: lessons/13-three-topologies.md (the encoder as a stage of its own).

Without it, the model runner calls the encoder service inside the step that reaches a picture, and every request
in that step waits for the answer (vLLM's engine never does: a request whose inputs are remote waits in a state
of its own, WAITING_FOR_REMOTE_KVS, while the scheduler runs the others). Here the engine fetches in the
background, once a request is preprocessed (the intake asks `start`):

- the pictures that are not in the encoder cache go to the service on a worker thread, one call per request;
- until they land the request is not the scheduler's: no KV block is taken, other requests step on;
- when they land (`landed`, polled at the start of each step) they enter the encoder cache, held, and the
  request is admitted; `hand_over` then gives it those holds (its `held_images`, which its prefill releases as
  it passes each picture, as it does the model runner's own), so its chunks find every picture in the cache and
  the step encodes nothing;
- a service that fails or times out fails that request alone (PeerError's message), and nothing stays held;
- an abort drops the fetch; tokens that still land are not kept for it.

Integrated engines keep the tower inside the step, as vLLM does: there is nothing to wait for off it.
"""

import time
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from nanomm.engine.encoder_cache import EncoderCache
from nanomm.engine.intake import error_message, final_output
from nanomm.errors import PeerError
from nanomm.inputs.prompt import PreparedPrompt


@dataclass
class Fetch:
    """One request's pictures on their way from the encoder service."""
    keys: list[str]  # the encoder-cache keys fetched, in the order of the service's answer
    future: Future
    started: float = field(default_factory=time.perf_counter)


class EncodeAhead:
    def __init__(self, encode, encoder_cache: EncoderCache, cache_key, adopt, encoder_url_of, workers: int = 4):
        """encode(images, url) -> their VisualTokens from the encoder service at url (None: the default), the
        model runner's remote encode; it raises ImagesUnavailable when the service fails. cache_key(image) -> its
        encoder-cache key. adopt(request_id, {image index: cache key}) -> whether the admitted request took
        those holds (False: a request with n > 1 completions, or one already gone). encoder_url_of(request_id) ->
        the encoder service its router named, or None: the default."""
        self.encode, self.encoder_cache = encode, encoder_cache
        self.cache_key, self.adopt, self.encoder_url_of = cache_key, adopt, encoder_url_of
        self.executor = ThreadPoolExecutor(workers, thread_name_prefix="nanomm-encode-ahead")
        self.fetching: dict[str, Fetch] = {}  # request id -> its pictures' fetch
        self.held: dict[str, list[str]] = {}  # landed, not yet handed over: request id -> the cache keys held
        self.num_fetched = 0  # requests whose pictures were fetched ahead

    def start(self, request_id: str, prepared: PreparedPrompt) -> bool:
        """Fetch the request's pictures that the cache lacks; False when it lacks none (admit the request now)."""
        missing = {}
        for image in prepared.images:
            key = self.cache_key(image)
            if key not in self.encoder_cache and key not in missing:
                missing[key] = image
        if not missing:
            return False
        url = self.encoder_url_of(request_id)
        future = self.executor.submit(self.encode, list(missing.values()), url)
        self.fetching[request_id] = Fetch(list(missing), future)
        return True

    def landed(self) -> list[tuple[str, Exception | None]]:
        """(request id, None) for each request whose pictures are now in the cache, held for it; (request id, the
        error) for each whose fetch failed."""
        done = []
        for request_id, fetch in list(self.fetching.items()):
            if not fetch.future.done():
                continue
            del self.fetching[request_id]
            try:
                tokens = fetch.future.result()
            except Exception as exc:  # noqa: BLE001 - the service's failure is this request's alone
                done.append((request_id, exc))
                continue
            seconds = time.perf_counter() - fetch.started
            for key, visual in zip(fetch.keys, tokens):
                # another request may have brought it meanwhile: then it stays theirs
                self.encoder_cache.add(key, visual.embeds, visual.coords, fetched_s=seconds / len(fetch.keys))
                self.encoder_cache.hold(key)
            self.held[request_id] = fetch.keys
            self.num_fetched += 1
            done.append((request_id, None))
        return done

    def hand_over(self, request_id: str, prepared: PreparedPrompt, admitted: bool) -> None:
        """The landed pictures' holds go to the admitted request, one per picture it shows; a request that was
        not admitted, or cannot take them, leaves nothing held."""
        keys = self.held.pop(request_id)
        held = {i: key for i, key in enumerate(map(self.cache_key, prepared.images)) if key in keys}
        for key in held.values():  # one hold landed per key: a picture shown twice takes one more
            self.encoder_cache.hold(key)
        for key in keys:
            self.encoder_cache.release(key)
        if admitted and not self.adopt(request_id, held):
            for key in held.values():
                self.encoder_cache.release(key)

    def cancel(self, request_id: str) -> bool:
        """Drop a request's fetch (an abort); False if it was not waiting for one."""
        fetch = self.fetching.pop(request_id, None)
        if fetch is not None:
            fetch.future.cancel()  # one already running finishes, and nothing keeps what it brings
        return fetch is not None

    def admit_landed(self, waiting: dict, admit, outputs: list) -> None:
        """The waiting requests ({id: (validated, prepared, params)}) whose visual tokens landed, admitted by
        `admit(request_id, prepared, params)`; one whose service failed, or whose admission raised, ends alone with
        an error output (a failed service's: 502, 503 or 504)."""
        for request_id, error in self.landed():
            _, prepared, params = waiting.pop(request_id)
            if error is None:
                try:
                    admit(request_id, prepared, params)
                    self.hand_over(request_id, prepared, admitted=True)
                    continue
                except Exception as exc:  # noqa: BLE001 - whatever it is, it is this request's alone
                    self.hand_over(request_id, prepared, admitted=False)
                    error = exc
            error = getattr(error, "cause", error)  # ImagesUnavailable: the service's PeerError
            status = error.status if isinstance(error, PeerError) else 400
            outputs.append(final_output(request_id, prepared, "error", error_message(error, f"request {request_id}"),
                                        prepared.arrival_time, status))

    def wait(self, timeout_s: float) -> None:
        """Until a fetch is done, or timeout_s."""
        if self.fetching and timeout_s > 0:
            futures.wait([f.future for f in self.fetching.values()], timeout_s, futures.FIRST_COMPLETED)

    def has_pending(self) -> bool:
        return bool(self.fetching)

    def stats(self) -> dict:
        return {"remote_encodes_waiting": len(self.fetching), "requests_encoded_ahead": self.num_fetched}

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)


def encode_ahead_for(engine) -> EncodeAhead:
    """An engine's EncodeAhead: through its model runner's client of the encoder service (the emulated device's
    moves placeholders), into its encoder cache, each request's pictures handed to its scheduled request."""
    runner = engine.runner

    def encode(images: list, url: str | None) -> list:  # ImagesUnavailable when the service fails
        return runner.encode(images, [url] * len(images))

    def encoder_url_of(request_id: str) -> str | None:  # a prefill instance's request names its router's pick
        return engine._handoffs.marked.get(request_id) if engine._handoffs is not None else None

    def adopt(request_id: str, held: dict[int, str]) -> bool:
        """The admitted request takes the holds of its pictures fetched ahead, and is charged the wait for them (a
        request with n > 1 completions is not one request: its children hold their own)."""
        request = engine.requests.get(request_id)
        if request is None:
            return False
        for i, key in held.items():
            request.held_images[i] = key
            wait = engine.encoder_cache.take_fetch_time(key) or 0.0
            request.record_image_ready(False, wait, on_this_device=False)
            request.metrics.encode_ahead_s += wait  # waited before it was scheduled: not queue, not prefill
        return True

    return EncodeAhead(encode, engine.encoder_cache, engine.encoder_cache_key_for, adopt, encoder_url_of)
