"""Image decoding and resizing off the engine's critical path: a pool of worker threads.

Lesson: lessons/07-encoder-cache.md (the TTFT breakdown).

Decoding a 2000x1500 JPEG and resizing it takes tens of milliseconds of CPU; done inline in `add_request`,
every new request would stall the engine loop (and every running decode) for that long. Here `add_request`
only validates what needs no pixels and hands the rest to a worker; `step()` keeps running the requests
already admitted and picks up each prompt once its pixels are ready. Threads are enough: Pillow releases
the GIL while it decodes and resizes. The workers do no torch work: the float patches are built later, on the
engine's thread (see `nanomm.inputs.image.ProcessedImage` for why).

A prompt whose image fails in a worker comes back as the exception, and the engine turns it into an error
result for that request alone; nothing else is disturbed and nothing was allocated for it.
"""

from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait


class PreprocessPool:
    def __init__(self, num_workers: int):
        self.num_workers = num_workers
        self._executor = ThreadPoolExecutor(num_workers, thread_name_prefix="nanomm-preprocess") \
            if num_workers > 0 else None
        self._pending: dict[str, Future] = {}  # request id -> its preprocessing, in submission order
        self.closed = False

    @property
    def inline(self) -> bool:
        """No workers: preprocessing runs on the caller's thread (num_preprocess_workers=0)."""
        return self._executor is None

    def __len__(self) -> int:
        return len(self._pending)

    def submit(self, request_id: str, job: Callable[[], object]) -> None:
        self._check_open()
        self._pending[request_id] = self._executor.submit(job)

    def cancel(self, request_id: str) -> bool:
        future = self._pending.pop(request_id, None)
        if future is not None:
            future.cancel()  # if it already runs, its result is simply dropped
        return future is not None

    def poll(self, wait_s: float = 0.0) -> list[tuple[str, object]]:
        """(request id, result or the exception it raised) for every finished job, in submission order."""
        if wait_s and self._pending and not any(f.done() for f in self._pending.values()):
            wait(list(self._pending.values()), timeout=wait_s, return_when=FIRST_COMPLETED)
        done = [rid for rid, f in self._pending.items() if f.done()]
        return [(rid, _outcome(self._pending.pop(rid))) for rid in done]

    def map(self, jobs: list[Callable[[], object]]) -> list[object]:
        """Run jobs in parallel and wait for all: each result, or the exception it raised."""
        self._check_open()
        if self.inline:
            return [_call(job) for job in jobs]
        futures = [self._executor.submit(job) for job in jobs]
        return [_outcome(f) for f in futures]

    def shutdown(self) -> None:
        """Cancel queued jobs, wait for the running ones (one image decode at most each), stop the threads."""
        self.closed = True
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("this engine is closed (LLM.close()): create a new LLM to generate again")


def _outcome(future: Future) -> object:
    try:
        return future.result()
    except Exception as exc:  # noqa: BLE001 - any failure becomes that request's error result
        return exc


def _call(job: Callable[[], object]) -> object:
    try:
        return job()
    except Exception as exc:  # noqa: BLE001
        return exc
