"""The encoder service batches the pictures of concurrent calls (serve/encoder_server.py, `TowerBatches`): calls
that arrive while the tower is busy share its next vision forward, within `max_num_encoder_tokens`, and each gets
exactly the tokens it would get alone. Concurrency is made, not hoped for: the tower's first call waits at a gate
until the other calls are seen in the queue."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from helpers import random_image
from nanomm.inputs.compression import encode_visual_tokens
from nanomm.inputs.image import preprocess_image
from nanomm.serve.encoder_server import EncoderServer, load_emulated_encoder, load_encoder
from nanomm.serve.testing import BackgroundServer
from nanomm.transfer import encode_request, pack, unpack


class GatedTower:
    """A tower that records each call's pictures and holds its calls until `gate` is set."""

    def __init__(self, tower):
        self.tower, self.calls = tower, []
        self.busy, self.gate = threading.Event(), threading.Event()

    def __call__(self, images: list) -> list:
        self.calls.append([im.content_hash for im in images])
        self.busy.set()
        assert self.gate.wait(timeout=60), "the test never opened the gate"
        return self.tower(images)


def wait_until(condition, what: str) -> None:
    """Poll until `condition()` holds (a deadline only against a hang: no time is asserted)."""
    deadline = time.monotonic() + 60
    while not condition():
        assert time.monotonic() < deadline, f"still waiting for {what}"
        time.sleep(0.005)


def pictures(service, sizes, first_seed: int) -> list:
    """Preprocessed random pictures of these (width, height), one seed each."""
    return [preprocess_image(random_image(w, h, first_seed + i), service.image_config)
            for i, (w, h) in enumerate(sizes)]


def post(url: str, body: bytes) -> httpx.Response:
    return httpx.post(url + "/v1/encode", content=body, timeout=120)


def embeds_of(answer: httpx.Response) -> list[torch.Tensor]:
    assert answer.status_code == 200, answer.text
    tensors, _ = unpack(answer.content, "the service")
    return [tensors[f"embeds.{i}"] for i in range(len(tensors))]


def metric(text: str, name: str) -> float:
    (line,) = [line for line in text.splitlines() if line.startswith(name + " ")]
    return float(line.split()[-1])


def while_the_tower_is_busy(url: str, service, busy: threading.Event, gate: threading.Event, first: bytes,
                            later: list[bytes]) -> tuple[list[httpx.Response], list[bool]]:
    """POST `first`; once the tower runs it (`busy`), POST each of `later` in turn, each once the service has
    looked its pictures up (so they queue in this order) or answered it; then open the `gate`. The answers, and
    which came before the gate opened."""
    lookups = lambda: service.cache.hits + service.cache.misses  # noqa: E731 (counted under the batches' lock)
    with ThreadPoolExecutor(len(later) + 1) as pool:
        answers = [pool.submit(post, url, first)]
        assert busy.wait(timeout=60), "the tower never started"
        for body in later:
            before = lookups()
            answers.append(pool.submit(post, url, body))
            wait_until(lambda: answers[-1].done() or lookups() > before, "the call to reach the service")
        early = [answer.done() for answer in answers]
        gate.set()
        return [answer.result() for answer in answers], early


@pytest.fixture
def gated(ckpt):
    """serve(**load_encoder's options) -> an encoder service of the tiny checkpoint with a `GatedTower`, and its
    BackgroundServer."""
    def serve(**options):
        service = load_encoder(str(ckpt), **options)
        service.tower = GatedTower(service.tower)
        return service, BackgroundServer(EncoderServer(service, "m"))
    return serve


def run_gated(url: str, service, first: list, later: list[list]) -> tuple[list[httpx.Response], list[bool]]:
    tower = service.tower
    return while_the_tower_is_busy(url, service, tower.busy, tower.gate, encode_request(first),
                                   [body if isinstance(body, bytes) else encode_request(body) for body in later])


def test_concurrent_calls_share_a_forward_and_each_gets_its_own_tokens_exactly(gated):
    service, server = gated()
    cached, shared = pictures(service, [(56, 56), (112, 56)], first_seed=100)
    first = pictures(service, [(56, 56)], first_seed=1)
    later = [pictures(service, [(112, 112), (56, 56)], 10) + [shared], [shared, cached],
             pictures(service, [(84, 140), (224, 224)], 20), [cached]]
    with server as url:
        service.tower.gate.set()
        assert post(url, encode_request([cached])).status_code == 200  # in the cache before the others come
        service.tower = GatedTower(service.tower.tower)
        answers, _ = run_gated(url, service, first, later)
        metrics = httpx.get(url + "/metrics").text
    with torch.inference_mode():
        alone = [[encode_visual_tokens(service.model, [im])[0].embeds for im in images] for images in [first] + later]
    got = [embeds_of(answer) for answer in answers]
    assert [[torch.equal(mine, own) for mine, own in zip(a, b)] for a, b in zip(got, alone)] == \
        [[True] * len(images) for images in [first] + later]
    batched = [im.content_hash for im in later[0] + later[2]]  # the shared picture once, the cached one never
    assert service.tower.calls == [[first[0].content_hash], batched]  # 2 forwards for 5 calls
    assert metric(metrics, "nanomm_encoder_batches_total") == 3  # with the warm-up's
    assert metric(metrics, "nanomm_encoder_batch_images_count") == 3
    assert metric(metrics, "nanomm_encoder_batch_images_sum") == 1 + 1 + 5
    assert metric(metrics, 'nanomm_encoder_images_total{cache="miss"}') == 1 + 1 + 5
    assert metric(metrics, 'nanomm_encoder_images_total{cache="hit"}') == 3  # shared once, cached twice


def test_a_batch_stays_within_the_budget_and_a_larger_picture_goes_alone(gated):
    service, server = gated(max_num_encoder_tokens=16)
    first = pictures(service, [(56, 56)], first_seed=1)
    later = pictures(service, [(112, 56), (56, 56), (56, 56), (112, 56), (224, 224), (56, 56)], first_seed=10)
    assert [im.num_encoded_tokens for im in later] == [8, 4, 4, 8, 64, 4]
    with server as url:
        answers, _ = run_gated(url, service, first, [[im] for im in later])
    assert [answer.status_code for answer in answers] == [200] * 7
    tokens_of = {im.content_hash: im.num_encoded_tokens for im in first + later}
    assert [[tokens_of[h] for h in call] for call in service.tower.calls] == [[4], [8, 4, 4], [8], [64], [4]]


def test_a_bad_call_among_concurrent_good_ones_gets_its_400_before_any_compute(gated):
    service, server = gated()
    first = pictures(service, [(56, 56)], first_seed=1)
    good = [pictures(service, [(112, 56)], first_seed=10), pictures(service, [(56, 56)], first_seed=11)]
    tensors, message = unpack(encode_request(pictures(service, [(56, 56)], first_seed=12)), "the test")
    message["images"][0]["grid_thw"] = [1, 8, 4]  # not what its bytes hold
    with server as url:
        answers, early = run_gated(url, service, first, [good[0], pack(tensors, message), good[1]])
    assert [answer.status_code for answer in answers] == [200, 200, 400, 200]
    assert early == [False, False, True, False]  # refused while the tower was still held
    assert "'rgb.0' must be" in answers[2].json()["error"]["message"]
    assert service.tower.calls == [[first[0].content_hash], [good[0][0].content_hash, good[1][0].content_hash]]


def test_a_picture_the_tower_fails_on_fails_only_the_calls_that_sent_it(gated):
    service, server = gated()
    first = pictures(service, [(56, 56)], first_seed=1)
    fine, cursed = pictures(service, [(56, 56), (112, 56)], first_seed=10)
    tower = service.tower.tower

    def breaks_on_cursed(images):
        if any(im.content_hash == cursed.content_hash for im in images):
            raise RuntimeError("this picture breaks the tower")
        return tower(images)

    service.tower.tower = breaks_on_cursed
    with server as url:
        answers, _ = run_gated(url, service, first, [[cursed], [fine]])
    assert [answer.status_code for answer in answers] == [200, 500, 200]
    assert service.tower.calls[1:] == [[cursed.content_hash, fine.content_hash], [cursed.content_hash],
                                       [fine.content_hash]]  # the batch failed, then each picture alone


def test_the_emulated_tower_takes_the_cost_model_s_time_for_each_batch():
    """One encode floor a batch: two pictures batched cost less than a forward of each."""
    busy, gate = threading.Event(), threading.Event()

    def sleep(seconds: float) -> None:
        busy.set()
        assert gate.wait(timeout=60)

    service = load_emulated_encoder("h200:qwen2-vl-2b", sleep=sleep)
    first, *later = pictures(service, [(448, 448), (448, 336), (448, 448)], first_seed=1)
    with BackgroundServer(EncoderServer(service, "twin")) as url:
        answers, _ = while_the_tower_is_busy(url, service, busy, gate, encode_request([first]),
                                             [encode_request([im]) for im in later])
    assert [answer.status_code for answer in answers] == [200, 200, 200]
    tower, costs = service.tower, service.tower.costs
    assert tower.patches == [[1024], [768, 1024]]
    assert tower.seconds == [costs.encode_seconds([1024]), costs.encode_seconds([768, 1024])]
    assert tower.seconds[1] < costs.encode_seconds([768]) + costs.encode_seconds([1024])


def test_the_budget_must_be_a_positive_int(ckpt):
    with pytest.raises(ValueError, match="max_num_encoder_tokens"):
        load_encoder(str(ckpt), max_num_encoder_tokens=0)
