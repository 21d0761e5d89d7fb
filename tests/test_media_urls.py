"""http(s) image and video URLs behind --allowed-media-domains (nanomm/inputs/media_fetch.py), against a real HTTP
server on 127.0.0.1: an allowed URL answers as the same bytes sent as a data URL; a host off the list, a redirect,
a private or metadata address (refused when resolved, by a resolver the test controls: nothing connects), a slow
server, an oversized body with and without Content-Length and a wrong content type are each a 400 naming the
reason, and the engine never sees the request. Names like pictures.test resolve through the test's resolver only."""

import base64
import io
import select
import socket
import threading
import time
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from helpers import assert_no_leaks, chat_prompt, random_image
from nanomm import LLM, SamplingParams
from nanomm.engine.config import EngineConfig
from nanomm.errors import InvalidInputError
from nanomm.inputs import media_fetch
from nanomm.inputs.media_fetch import MediaUrlPolicy
from nanomm.serve.app import Server, ServerConfig
from nanomm.serve.cli import media_url_policy, parse_args
from nanomm.serve.testing import BackgroundServer

MODEL = "tiny"
GREEDY = {"max_tokens": 4, "temperature": 0}


def png_bytes(seed: int) -> bytes:
    buffer = io.BytesIO()
    random_image(56, 56, seed).save(buffer, "PNG")
    return buffer.getvalue()


def gif_bytes(num_frames: int = 4) -> bytes:
    frames = [random_image(56, 56, 100 + i) for i in range(num_frames)]
    buffer = io.BytesIO()
    frames[0].save(buffer, "GIF", save_all=True, append_images=frames[1:], duration=500, loop=0)
    return buffer.getvalue()


def data_url(data: bytes, media_type: str) -> str:
    return f"data:{media_type};base64," + base64.b64encode(data).decode()


PNG, GIF = png_bytes(7), gif_bytes()


# -- the media server -------------------------------------------------------------------------------------------

class MediaServer(ThreadingHTTPServer):
    """127.0.0.1: each path a route; it records every request's path, and whether a slow route's client left."""
    daemon_threads = True

    def __init__(self):
        super().__init__(("127.0.0.1", 0), MediaHandler)
        self.seen: list[str] = []
        self.client_left = threading.Event()
        self.release = threading.Event()  # ends the slow routes' waits at teardown
        self.port = self.server_address[1]


class MediaHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self):
        self.server.seen.append(self.path)
        route = ROUTES.get(self.path)
        if route is None:
            self.send_error(404)
        else:
            route(self)

    def log_message(self, *args):
        pass

    def body(self, data: bytes, content_type: str, chunked: bool = False) -> None:
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Transfer-Encoding" if chunked else "Content-Length", "chunked" if chunked else len(data))
        self.end_headers()
        if not chunked:
            self.wfile.write(data)
            return
        for start in range(0, len(data), 512):  # no Content-Length: the size is known only while reading
            piece = data[start:start + 512]
            self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
        self.wfile.write(b"0\r\n\r\n")

    def redirect(self, location: str) -> None:
        self.send_response(302)
        self.send_header("Location", location.format(port=self.server.port))
        self.send_header("Content-Length", "0")
        self.end_headers()

    def stall(self) -> None:
        """Send nothing for up to 10 s; note whether the client closed the connection meanwhile."""
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not self.server.release.is_set():
            if select.select([self.connection], [], [], 0.05)[0]:  # the request was read: readable means closed
                try:
                    closed = self.connection.recv(1, socket.MSG_PEEK) == b""
                except OSError:
                    closed = True
                if closed:
                    self.server.client_left.set()
                    return
        self.close_connection = True


ROUTES = {
    "/cat.png": lambda h: h.body(PNG, "image/png"),
    "/cat-chunked.png": lambda h: h.body(PNG, "image/png; charset=binary", chunked=True),
    "/clip.gif": lambda h: h.body(GIF, "image/gif"),
    "/page.html": lambda h: h.body(PNG, "text/html"),
    "/octet.png": lambda h: h.body(PNG, "application/octet-stream"),
    "/redirect": lambda h: h.redirect("/cat.png"),
    "/redirect-away": lambda h: h.redirect("http://elsewhere.test:{port}/cat.png"),
    "/slow.png": lambda h: h.stall(),
}

NAMES = {"pictures.test": "127.0.0.1", "elsewhere.test": "127.0.0.1", "internal.test": "10.0.0.5",
         "metadata.test": "169.254.169.254", "mapped.test": "::ffff:10.0.0.5"}


def resolver(host: str, port: int) -> list[str]:
    if host not in NAMES:
        raise socket.gaierror(f"the test's resolver does not know {host}")
    return [NAMES[host]]


def policy(**changes) -> MediaUrlPolicy:
    """pictures.test and the test's other names listed; 127.0.0.1 allowed unless changed."""
    return MediaUrlPolicy(**{"allowed_domains": ("pictures.test", "internal.test", "metadata.test", "mapped.test"),
                             "allow_private_addresses": True, "resolver": resolver, **changes})


@pytest.fixture(scope="module")
def media():
    server = MediaServer()
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield server
    server.release.set()
    server.shutdown()
    server.server_close()
    thread.join(timeout=10)


@pytest.fixture(scope="module")
def served(ckpt, media):
    llm = LLM(str(ckpt), device="cpu", dtype="float32", max_pixels=28 * 28 * 16)
    server = Server(llm, ServerConfig(MODEL, disconnect_poll_s=0.05))
    with BackgroundServer(server) as base:
        yield llm, server, base
    llm.close()


@pytest.fixture
def connections(monkeypatch):
    """Every address a fetch connects to, in order."""
    addresses = []
    open_socket = media_fetch._PinnedHTTPConnection._open_socket

    def recording(self):
        addresses.append(self.address)
        return open_socket(self)

    monkeypatch.setattr(media_fetch._PinnedHTTPConnection, "_open_socket", recording)
    return addresses


def chat(base: str, url: str, kind: str = "image", timeout: float = 60) -> httpx.Response:
    part = {"type": f"{kind}_url", f"{kind}_url": {"url": url}}
    messages = [{"role": "user", "content": [part, {"type": "text", "text": "what is it?"}]}]
    return httpx.post(base + "/v1/chat/completions", json={"messages": messages, **GREEDY}, timeout=timeout)


def answer(response: httpx.Response) -> tuple[str, dict]:
    assert response.status_code == 200, response.text
    body = response.json()
    return body["choices"][0]["message"]["content"], body["usage"]


# -- through the server ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("path, kind, media_type, data", [("/cat.png", "image", "image/png", PNG),
                                                           ("/cat-chunked.png", "image", "image/png", PNG),
                                                           ("/redirect", "image", "image/png", PNG),
                                                           ("/clip.gif", "video", "image/gif", GIF)],
                         ids=["png", "png chunked", "png after a redirect", "gif video"])
def test_an_allowed_url_answers_as_the_same_bytes_in_a_data_url(served, media, path, kind, media_type, data):
    llm, server, base = served
    server.config.media_urls = policy(allow_redirects=True)
    text, usage = answer(chat(base, f"http://pictures.test:{media.port}{path}", kind))
    data_text, data_usage = answer(chat(base, data_url(data, media_type), kind))
    assert (text, usage["prompt_tokens"], usage["visual_tokens"]) == \
        (data_text, data_usage["prompt_tokens"], data_usage["visual_tokens"])
    assert usage["visual_tokens"] > 0
    if kind == "image":  # the same picture: the data URL's found the URL's in the encoder cache
        assert data_usage["encoder_cache_hits"] == 1
    assert_no_leaks(llm)


REFUSALS = {  # path or URL, the policy's changes, what the 400 says
    "no host listed": ("http://pictures.test:{port}/cat.png", {"allowed_domains": ()},
                       "list 'pictures.test' with --allowed-media-domains"),
    "a host off the list": ("http://elsewhere.test:{port}/cat.png", {}, "'elsewhere.test' of"),
    "a redirect": ("/redirect", {}, "redirects are not followed"),
    "a redirect off the list": ("/redirect-away", {}, "whose host 'elsewhere.test' is not an allowed media domain"),
    "a redirect off the list, redirects allowed": ("/redirect-away", {"allow_redirects": True},
                                                   "whose host 'elsewhere.test' is not an allowed media domain"),
    "loopback behind an allowed name": ("/cat.png", {"allow_private_addresses": False},
                                        "resolves to 127.0.0.1, a loopback address"),
    "a private address": ("http://internal.test:{port}/cat.png", {"allow_private_addresses": False},
                          "resolves to 10.0.0.5, a private address"),
    "a private address, IPv4-mapped": ("http://mapped.test:{port}/cat.png", {"allow_private_addresses": False},
                                       "resolves to ::ffff:10.0.0.5, a private address"),
    "cloud metadata, private addresses allowed": ("http://metadata.test:{port}/cat.png", {},
                                                  "resolves to 169.254.169.254, a cloud metadata address"),
    "a slow server": ("/slow.png", {"image_timeout_s": 0.3}, "took longer than 0.3 s"),
    "oversized, with Content-Length": ("/cat.png", {"max_image_bytes": 100}, "100-byte cap on fetched media "
                                       f"(Content-Length {len(PNG):,})"),
    "oversized, chunked": ("/cat-chunked.png", {"max_image_bytes": 100}, "(more than 100 bytes read)"),
    "a wrong content type": ("/page.html", {}, "has Content-Type 'text/html', not an image (image/*)"),
    "application/octet-stream": ("/octet.png", {}, "has Content-Type 'application/octet-stream'"),
    "not found": ("/missing.png", {}, "answered 404"),
    "a video of the wrong type": ("/page.html", {}, "not a video (video/* or image/*)"),
}


@pytest.mark.parametrize("case", REFUSALS)
def test_each_refusal_is_a_400_naming_the_reason_before_the_engine(served, media, connections, case):
    llm, server, base = served
    where, changes, reason = REFUSALS[case]
    server.config.media_urls = policy(**changes)
    url = where.format(port=media.port) if where.startswith("http") else f"http://pictures.test:{media.port}{where}"
    steps = llm.stats()["steps"]
    response = chat(base, url, "video" if "video" in case else "image")
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]
    assert reason in message and repr(url) in message, message  # the reason, and the URL
    assert llm.stats()["steps"] == steps  # the engine never saw it
    assert_no_leaks(llm)
    if "resolves to" in reason or case in ("no host listed", "a host off the list"):
        assert connections == [], connections  # refused before connecting: when resolved, or before that
    assert set(connections) <= {"127.0.0.1"}  # nothing else was ever dialled


def test_a_client_that_leaves_stops_the_fetch(served, media):
    llm, server, base = served
    server.config.media_urls = policy(image_timeout_s=60.0)
    media.client_left.clear()
    steps = llm.stats()["steps"]
    with pytest.raises(httpx.ReadTimeout):
        chat(base, f"http://pictures.test:{media.port}/slow.png", timeout=0.5)
    assert media.client_left.wait(timeout=10), "the fetch went on after its client left"  # 60 s otherwise
    assert llm.stats()["steps"] == steps
    assert_no_leaks(llm)


# -- offline, the command line, the engine argument ----------------------------------------------------------------

def test_offline_llm_fetches_only_with_allowed_domains(served, ckpt, media):
    refusing, _, _ = served
    url = f"http://pictures.test:{media.port}/cat.png"
    prompt = chat_prompt("what is it?", [url])
    with pytest.raises(InvalidInputError, match="prompt 0, image 0: URLs are not fetched here .* allowed_media_dom"):
        refusing.generate([prompt], use_tqdm=False)
    params = SamplingParams(temperature=0.0, max_tokens=4)
    with LLM(str(ckpt), device="cpu", dtype="float32", max_pixels=28 * 28 * 16,
             media_url_policy={"allowed_domains": ["pictures.test"], "allow_private_addresses": True,
                               "resolver": resolver}) as fetching:
        by_url = fetching.generate([prompt], params, use_tqdm=False)[0]
        by_bytes = fetching.generate([chat_prompt("what is it?", [PNG])], params, use_tqdm=False)[0]
        assert by_url.outputs[0].token_ids == by_bytes.outputs[0].token_ids
        assert by_url.prompt_token_ids == by_bytes.prompt_token_ids
        fetching.engine.config.media_url_policy = replace(fetching.engine.config.media_url_policy,
                                                          allow_private_addresses=False)
        with pytest.raises(InvalidInputError, match="prompt 0, image 0: .* a loopback address"):
            fetching.generate([prompt], params, use_tqdm=False)


def test_the_flags_and_the_engine_argument_make_the_policy():
    args = parse_args(["--allowed-media-domains", "Pictures.Example", "*.cdn.example", "--media-url-allow-redirects",
                       "--media-fetch-timeout", "2", "9"])
    made = media_url_policy(args)
    assert (made.allowed_domains, made.allow_redirects, made.allow_private_addresses) == \
        (("pictures.example", "*.cdn.example"), True, False)
    assert (made.image_timeout_s, made.video_timeout_s) == (2.0, 9.0)
    assert made.allows_host("a.cdn.example") and not made.allows_host("cdn.example")
    assert media_url_policy(parse_args([])) is None
    config = EngineConfig(allowed_media_domains=["pictures.example"])
    assert config.media_url_policy.allowed_domains == ("pictures.example",)
    assert replace(config).media_url_policy == config.media_url_policy
    assert EngineConfig().media_url_policy is None
    with pytest.raises(ValueError, match="allowed_media_domains must be a list of host names"):
        EngineConfig(allowed_media_domains="pictures.example")
