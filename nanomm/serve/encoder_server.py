"""`nanomm-serve MODEL --role encoder`: the vision tower as a service. Images in, visual tokens out.

    nanomm-serve --demo --role encoder --port 8001
    nanomm-serve --demo --encoder-url http://127.0.0.1:8001      # an engine that runs no tower of its own

Lesson: lessons/13-three-topologies.md.

POST /v1/encode takes the body transfer.py builds (each image's resized RGB bytes, patch grid,
content hash and compression policy, and the preprocessing constants) and answers with each image's visual
tokens (and a compressed image's kept coordinates), one safetensors body each way. A video comes a temporal
patch at a time, as the engine's prefill reaches it (lesson 17): the patch's frames, marked "video", normalised
with the videos' own constants (which the body carries too, and which are checked the same way). The service keeps its own
encoder cache (engine/encoder_cache.py), keyed exactly as an engine's: sha256(image content hash, model
identity). So a picture that many engines ask about is encoded once, and the cache can be as large as this
instance's memory allows, apart from the KV pools.

What is checked before any compute (a 400 naming it): the body's format, each image's grid against its bytes
and the model's merge size, the compression policy, and that the preprocessing constants are this model's (an
engine preprocessing for another model would get tokens that mean nothing to it).

One thread owns the tower (`TowerBatches`). Each call waits on its own future, holding no thread, and the event
loop keeps answering /health and /metrics while the tower works. The pictures of calls that arrive while the
tower is busy go into its next vision forward, up to `max_num_encoder_tokens` visual tokens (the name of an
engine's tower budget per step; a picture larger than the budget goes alone), and each call gets exactly its own
pictures' tokens back. The tower attends within each picture, so those are the tokens it gets alone (bit for bit
on the CPU, tests/test_encoder_batching.py; a GPU may pick other matmul kernels for another batch size). A
picture the cache holds, or that another call already queued, is not encoded again. A bad body is refused
before its pictures join a batch, so it never fails its batch-mates. The language model's decoder layers are
dropped at load: this instance never runs them.

The content hash is the client's word: the service trusts the engines that call it (it runs inside the
deployment, like vLLM's encoder-cache connector), and binds 127.0.0.1 unless told otherwise.
"""

import asyncio
import re
import threading
import time
from collections import deque
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field

import torch
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from nanomm.engine.config import EngineConfig
from nanomm.engine.encoder_cache import EncoderCache, encoder_cache_key
from nanomm.errors import InvalidInputError, PeerError, check_int
from nanomm.inputs.compression import VisualTokens, encode_visual_tokens, parse_policy
from nanomm.inputs.image import ImageProcessorConfig, ProcessedImage
from nanomm.serve import protocol
from nanomm.serve.metrics import LATENCY_BUCKETS, HostCPUCollector
from nanomm.transfer import PREPROCESSING_KEYS
from nanomm.transfer import MEDIA_TYPE, pack, unpack

HEX64 = re.compile(r"[0-9a-f]{64}")
DEFAULT_MAX_NUM_ENCODER_TOKENS = EngineConfig.max_num_batched_tokens  # an engine's tower budget per step, unless set
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


class EncoderService:
    """The vision tower, its cache and its counters; `encode(body) -> body`, from any number of threads at once."""

    def __init__(self, model, image_config: ImageProcessorConfig, cache_tokens: int = 65536, tower=None,
                 counted_bytes=None, video_config: ImageProcessorConfig | None = None,
                 max_num_encoder_tokens: int | None = None):
        """tower(images) -> visual tokens, and counted_bytes(answer, images) -> what /metrics counts as sent: the
        model's own tower and the answer's length unless given (the emulated device gives both: nanomm/emulate).
        video_config: how videos are normalised and patched (inputs/video_settings.py); None: the family's.
        max_num_encoder_tokens: visual tokens one vision forward encodes at most (None: an engine's default)."""
        self.model, self.image_config, self._video_config = model, image_config, video_config
        self.tower = tower or (lambda images: encode_visual_tokens(self.model, images))
        self.counted_bytes = counted_bytes or (lambda answer, images: len(answer))
        self.model_identity = f"{model.name_or_path}:{model.dtype}"  # as the engine names it (engine.py)
        self.cache = EncoderCache(cache_tokens)
        budget = DEFAULT_MAX_NUM_ENCODER_TOKENS if max_num_encoder_tokens is None else max_num_encoder_tokens
        self.batches = TowerBatches(self._run_tower, self.cache, check_int(budget, "max_num_encoder_tokens"))
        self.registry = CollectorRegistry()
        self.encoded_tokens = Counter("nanomm_encoder_visual_tokens", "visual tokens this instance's tower encoded",
                                      registry=self.registry)
        self.transfer_bytes = Counter("nanomm_visual_token_transfer_bytes", "visual-token bytes moved",
                                      ["direction"], registry=self.registry)
        self.images = Counter("nanomm_encoder_images", "images asked for", ["cache"], registry=self.registry)
        self.encode_seconds = Histogram("nanomm_encoder_encode_seconds", "one vision forward (a batch of cache "
                                        "misses)", buckets=LATENCY_BUCKETS, registry=self.registry)
        self.busy_seconds = Counter("nanomm_encoder_busy_seconds", "seconds the tower encoded (its rate is the "
                                    "encoder's utilisation)", registry=self.registry)
        self.num_batches = Counter("nanomm_encoder_batches", "vision forwards run, each over the pictures of the "
                                   "calls that waited for the tower", registry=self.registry)
        self.batch_images = Histogram("nanomm_encoder_batch_images", "pictures per vision forward",
                                      buckets=BATCH_SIZE_BUCKETS, registry=self.registry)
        self.registry.register(_CacheCollector(self.batches))
        self.registry.register(HostCPUCollector())

    def encode(self, body: bytes) -> bytes:
        """The answer to a request body, waiting on this thread for the tower if it must."""
        return self.answer(self.submit(body))

    def submit(self, body: bytes) -> "EncodeCall":
        """Check a request body and ask for its pictures' tokens; `call.pending` is done when they are all there.
        A bad body is an InvalidInputError here, in its own call, before any of its pictures joins a batch."""
        images = self.read_request(body)
        keys = [encoder_cache_key(im.content_hash, self.model_identity) for im in images]
        return EncodeCall(images, keys, self.batches.ask(dict(zip(keys, images))))

    def answer(self, call: "EncodeCall") -> bytes:
        """The answer's body: each picture's tokens, in the order asked (raises what the tower raised)."""
        tokens = call.pending.done.result()
        queued = call.pending.queued
        self.images.labels(cache="hit").inc(len(call.images) - queued)
        self.images.labels(cache="miss").inc(queued)
        answer = pack(_answer_tensors(call.keys, tokens), {"encoded_images": queued})
        self.transfer_bytes.labels(direction="sent").inc(self.counted_bytes(answer, call.images))
        return answer

    def _run_tower(self, images: list) -> list[VisualTokens]:
        """One vision forward over a batch's pictures, timed and counted (on the tower's thread)."""
        start = time.perf_counter()
        with torch.inference_mode():
            tokens = list(self.tower(images))
        elapsed = time.perf_counter() - start
        if len(tokens) != len(images):
            raise RuntimeError(f"the tower gave {len(tokens)} results for {len(images)} pictures")
        self.encode_seconds.observe(elapsed)
        self.busy_seconds.inc(elapsed)
        self.num_batches.inc()
        self.batch_images.observe(len(images))
        self.encoded_tokens.inc(sum(im.num_encoded_tokens for im in images))
        return tokens

    def read_request(self, body: bytes) -> list[ProcessedImage]:
        """The images of a request body, each checked; InvalidInputError names the first problem."""
        try:
            tensors, message = unpack(body, "the client")
        except PeerError as exc:
            raise InvalidInputError(str(exc)) from None
        entries = message.get("images") if isinstance(message, dict) else None
        if not isinstance(entries, list) or not entries or len(tensors) != len(entries):
            raise InvalidInputError("the body must list at least one image, with one 'rgb.i' tensor each")
        videos = sum(isinstance(entry, dict) and entry.get("video") is True for entry in entries)
        if videos < len(entries) or "preprocessing" in message:
            _check_preprocessing(message.get("preprocessing"), self.image_config, "images")
        if videos or "video_preprocessing" in message:
            _check_preprocessing(message.get("video_preprocessing"), self.video_config, "videos")
        return [self._image(i, entry, tensors.get(f"rgb.{i}")) for i, entry in enumerate(entries)]

    @property
    def video_config(self) -> ImageProcessorConfig:
        """How this model's videos are normalised: the family's (imported with the first video)."""
        if self._video_config is None:
            from nanomm.inputs.video_settings import VideoSettings

            self._video_config = VideoSettings.for_model(self.model.config.model_type, self.image_config).pixels
        return self._video_config

    def _image(self, i: int, entry, rgb: torch.Tensor | None):
        """A picture (`ProcessedImage`), or a video's temporal patch: a one-patch `ProcessedVideo`."""
        name = f"image {i}"
        keys = {"grid_thw", "content_hash", "compression"}
        if (not isinstance(entry, dict) or set(entry) - {"video", "kept"} != keys or entry.get("video", True) is not True
                or ("kept" in entry and "video" not in entry)):
            raise InvalidInputError(f"{name}: needs exactly grid_thw, content_hash and compression (and "
                                    "'video': true for a video's temporal patch, with 'kept' if it was pruned)")
        video = entry.get("video", False)
        grid, content_hash = entry["grid_thw"], entry["content_hash"]
        cfg = self.video_config if video else self.image_config
        merge = cfg.merge_size
        if not (isinstance(grid, list) and len(grid) == 3 and all(type(g) is int and g > 0 for g in grid)
                and grid[0] == 1 and grid[1] % merge == 0 and grid[2] % merge == 0):
            raise InvalidInputError(f"{name}: grid_thw must be [1, h, w] with h and w multiples of {merge}, "
                                    f"got {grid!r:.80}")
        pixels = grid[1] * grid[2] * cfg.patch_size ** 2
        if pixels > cfg.max_image_pixels:
            raise InvalidInputError(f"{name}: {pixels:,} pixels, over this encoder's limit of {cfg.max_image_pixels:,}")
        frames = cfg.temporal_patch_size if video else 1
        if rgb is None or rgb.dtype != torch.uint8 or tuple(rgb.shape) != (frames * pixels * 3,):
            raise InvalidInputError(f"{name}: 'rgb.{i}' must be {frames * pixels * 3} uint8 values for grid {grid}")
        if not (isinstance(content_hash, str) and HEX64.fullmatch(content_hash)):
            raise InvalidInputError(f"{name}: content_hash must be 64 lowercase hex digits")
        policy = parse_policy(entry["compression"], f"{name}: compression")
        if video:
            return _video_patch(entry, rgb.numpy().tobytes(), tuple(grid), content_hash, cfg, policy, name)
        return ProcessedImage(rgb.numpy().tobytes(), tuple(grid), content_hash, cfg, policy)


@dataclass
class EncodeCall:
    """One /v1/encode call: its checked pictures, their cache keys, and their tokens to come."""
    images: list
    keys: list[str]
    pending: "PendingTokens"


def _answer_tensors(keys: list[str], tokens: dict[str, VisualTokens]) -> dict[str, torch.Tensor]:
    """The answer's tensors: each picture's tokens in the order asked (and a compressed one's coordinates)."""
    tensors = {}
    for i, key in enumerate(keys):
        tensors[f"embeds.{i}"] = tokens[key].embeds
        if tokens[key].coords is not None:
            tensors[f"coords.{i}"] = tokens[key].coords
    return tensors


@dataclass
class PendingTokens:
    """A call's pictures' tokens ({cache key: tokens}): the cached ones at once, the others as the batches
    holding them finish. `done` holds them all (or what the tower raised); `queued`: the pictures this call
    put in the queue (the others were cached, or queued by another call)."""
    waiting: set[str] = field(default_factory=set)
    tokens: dict[str, VisualTokens] = field(default_factory=dict)
    queued: int = 0
    done: Future = field(default_factory=Future)

    def give(self, key: str, tokens: VisualTokens) -> None:
        self.tokens[key] = tokens
        self.waiting.discard(key)
        if not self.waiting:
            _settle(self.done.set_result, self.tokens)

    def fail(self, error: Exception) -> None:
        _settle(self.done.set_exception, error)


def _settle(setter, value) -> None:
    """Set a future's outcome unless it has one: another of the call's pictures failed, or it was cancelled."""
    try:
        setter(value)
    except InvalidStateError:
        pass


class TowerBatches:
    """The one thread that runs the tower, and the cache in front of it.

    A call's pictures the cache holds are answered at once; the others join a queue, in arrival order, unless a
    call before it already queued the same picture (then the call waits for that one). The thread takes the
    queue's head as one batch, up to `budget_tokens` visual tokens (the first picture always: one larger than
    the budget goes alone), runs `encode_batch` on it, adds the tokens to the cache and hands each waiting call
    its own. It starts when a picture is queued and ends when the queue is empty. If a batch fails, its pictures
    are encoded again one by one, so a failure reaches only the calls waiting for the picture that fails."""

    def __init__(self, encode_batch, cache: EncoderCache, budget_tokens: int):
        self.encode_batch, self.cache, self.budget_tokens = encode_batch, cache, budget_tokens
        self._lock = threading.Lock()  # the cache, the queue and the waiting calls
        self._queue: deque[tuple[str, object]] = deque()  # (cache key, picture) not yet in a batch
        self._calls: dict[str, list[PendingTokens]] = {}  # cache key -> the calls waiting for it (queued or encoding)
        self._running = False

    @property
    def num_queued(self) -> int:
        """Pictures waiting for the tower (not those in the batch it runs)."""
        with self._lock:
            return len(self._queue)

    def cache_stats(self) -> dict:
        """The cache's counters (`EncoderCache.stats`), read while the tower's thread changes nothing."""
        with self._lock:
            return self.cache.stats()

    def ask(self, pictures: dict) -> PendingTokens:
        """The tokens of these pictures ({cache key: picture}), to come (wait on `.done`, from a thread or, with
        asyncio.wrap_future, from the event loop)."""
        call = PendingTokens()
        with self._lock:
            for key, picture in pictures.items():
                self._look_up(key, picture, call)
            if not call.waiting:  # all cached
                call.done.set_result(call.tokens)
            if self._queue and not self._running:
                self._running = True
                threading.Thread(target=self._run, name="nanomm-encoder-tower", daemon=True).start()
        return call

    def _look_up(self, key: str, picture, call: PendingTokens) -> None:
        """Under the lock: a picture's tokens from the cache, else the call waits for them (queued if no
        other call queued them already)."""
        if key in self._calls:  # queued or encoding for another call: shared, as the engine counts it
            self.cache.count_shared_hit()
        elif self.cache.lookup(key) is not None:
            entry = self.cache.entries[key]
            call.tokens[key] = VisualTokens(entry.embeds, entry.coords)
            return
        else:
            self._queue.append((key, picture))
            self._calls[key] = []
            call.queued += 1
        self._calls[key].append(call)
        call.waiting.add(key)

    def _run(self) -> None:
        while batch := self._next_batch():
            for part, outcome in self._encode(batch):
                self._deliver(part, outcome)

    def _next_batch(self) -> list[tuple[str, object]]:
        """The queue's head up to the budget (at least one picture); empty, and the thread ends, if none wait."""
        with self._lock:
            batch, num_tokens = [], 0
            while self._queue:
                cost = self._queue[0][1].num_encoded_tokens  # the tower's tokens, before any compression
                if batch and num_tokens + cost > self.budget_tokens:
                    break
                batch.append(self._queue.popleft())
                num_tokens += cost
            self._running = bool(batch)
            return batch

    def _encode(self, batch: list) -> list[tuple[list, list[VisualTokens] | Exception]]:
        """(pictures, their tokens or the error) for the batch, or for each of its pictures alone if it failed."""
        try:
            return [(batch, self.encode_batch([picture for _, picture in batch]))]
        except Exception as error:
            if len(batch) == 1:
                return [(batch, error)]
            return [self._encode([one])[0] for one in batch]

    def _deliver(self, pictures: list, outcome: list[VisualTokens] | Exception) -> None:
        with self._lock:
            for i, (key, _) in enumerate(pictures):
                calls = self._calls.pop(key)
                if isinstance(outcome, Exception):
                    for call in calls:
                        call.fail(outcome)
                    continue
                self.cache.add(key, outcome[i].embeds, outcome[i].coords)
                for call in calls:
                    call.give(key, outcome[i])
            self.cache.trim()  # after the calls took their tokens: an entry larger than the cache still goes out


def _video_patch(entry: dict, frames: bytes, grid: tuple, content_hash: str, config: ImageProcessorConfig, policy,
                 name: str):
    """A video's temporal patch (checked as a picture is) as a one-patch `ProcessedVideo`: pruned, with the kept
    tokens the engine chose, or compressed, not both."""
    from nanomm.inputs.video import ProcessedVideo
    from nanomm.inputs.video_pruning import check_kept

    if policy is not None and "kept" in entry:
        raise InvalidInputError(f"{name}: a pruned video patch is not compressed too")
    kept = None if "kept" not in entry else (
        check_kept(entry["kept"], grid[1] * grid[2] // config.merge_size ** 2, f"{name}: kept"),)
    return ProcessedVideo(frames, grid, content_hash, config, fps=1.0, kept=kept, compression=policy)


def _check_preprocessing(given, config: ImageProcessorConfig, what: str) -> None:
    """The constants the engine preprocessed with must be this model's: other ones give tokens that mean nothing."""
    ours = {key: getattr(config, key) for key in PREPROCESSING_KEYS}
    if not isinstance(given, dict) or {k: _tuple(given.get(k)) for k in ours} != {k: _tuple(v) for k, v in ours.items()}:
        raise InvalidInputError(f"the {what} were preprocessed with {given!r:.200}; this encoder's model takes {ours}")


def _tuple(value):
    return tuple(value) if isinstance(value, (list, tuple)) else value


class _CacheCollector:
    def __init__(self, batches: "TowerBatches"):
        self.batches = batches

    def collect(self):
        for key, value in self.batches.cache_stats().items():
            family = GaugeMetricFamily(f"nanomm_{key}", f"the encoder service's cache: {key.replace('_', ' ')}")
            family.add_metric([], float(value))
            yield family


class EncoderServer:
    """The routes over one EncoderService: POST /v1/encode, GET /health, /metrics, /v1/models."""

    def __init__(self, service: EncoderService, model_name: str, max_body_bytes: int = 256 * 2**20):
        self.service, self.model_name, self.max_body_bytes = service, model_name, max_body_bytes
        routes = [Route("/v1/encode", self.encode, methods=["POST"]), Route("/health", self.health),
                  Route("/metrics", self.scrape), Route("/v1/models", self.models)]
        self.app = Starlette(routes=routes)

    async def encode(self, request: Request) -> Response:
        body = await request.body()
        if len(body) > self.max_body_bytes:
            message = f"the request body is larger than {self.max_body_bytes} bytes"
            return JSONResponse(protocol.error_body(message, 413), 413)
        self.service.transfer_bytes.labels(direction="received").inc(0)  # the series exists from the start
        try:
            call = await asyncio.to_thread(self.service.submit, body)
            await asyncio.wait([asyncio.wrap_future(call.pending.done)])  # no thread held while the tower works
            answer = await asyncio.to_thread(self.service.answer, call)
        except InvalidInputError as exc:
            return JSONResponse(protocol.error_body(str(exc), 400), 400)
        return Response(answer, media_type=MEDIA_TYPE)

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", "role": "encoder"})

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                                         "owned_by": "nanomm", "role": "encoder"}]})

    async def scrape(self, request: Request) -> Response:
        return Response(generate_latest(self.service.registry), media_type=CONTENT_TYPE_LATEST)


def load_encoder(folder: str, device: str | None = None, dtype: str | None = None, max_pixels: int | None = None,
                 max_num_encoder_tokens: int | None = None) -> EncoderService:
    """The model's vision tower, on cuda in bfloat16 when there is one (as `LLM` chooses), without its decoder."""
    from dataclasses import replace

    from nanomm.model.config import read_checkpoint_json
    from nanomm.model.loader import load_model, resolve_checkpoint

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = dtype or ("bfloat16" if torch.device(device).type == "cuda" else "float32")
    path = resolve_checkpoint(folder)
    model = load_model(path, device=device, dtype=dtype)
    model.language_model.layers = torch.nn.ModuleList()  # never run here; the embedding stays (device, dtype)
    image_config = ImageProcessorConfig.from_pretrained(path)
    if max_pixels is not None:
        image_config = replace(image_config, max_pixels=max_pixels)
    video_file = read_checkpoint_json(path / "video_preprocessor_config.json", required=False)
    video_config = None
    if video_file:  # else the family's, when the first video comes
        from nanomm.inputs.video_settings import VideoSettings

        video_config = VideoSettings.for_model(model.config.model_type, image_config, video_file).pixels
    return EncoderService(model, image_config, video_config=video_config, max_num_encoder_tokens=max_num_encoder_tokens)


def load_emulated_encoder(emulate: str, max_pixels: int | None = None, cost_file: str | None = None,
                          sleep=time.sleep, max_num_encoder_tokens: int | None = None) -> EncoderService:
    """`--role encoder --emulate GPU:MODEL`: the real service over the twin's model tree and the real model's image
    processor, its tower the emulated device's (nanomm/emulate: the cost model's time for each batch, placeholders
    sent, the real visual tokens' bytes counted). The tower is `service.tower`, its call times
    `service.tower.seconds`."""
    from dataclasses import replace

    from nanomm.emulate import EmulatedDevice  # only for this role

    device = EmulatedDevice.from_value(emulate, cost_file)
    image_config = device.image_config if max_pixels is None else replace(device.image_config, max_pixels=max_pixels)
    tower = device.tower(sleep)
    return EncoderService(device.twin_model(), image_config, tower=tower, counted_bytes=tower.counted_bytes,
                          max_num_encoder_tokens=max_num_encoder_tokens)
