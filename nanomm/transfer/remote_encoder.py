"""The engine's side of an encoder service: `LLM(model, encoder_url="http://...")` runs no vision tower.

Lesson: lessons/13-three-topologies.md (the E+PD topology).

The model runner's encode stage (engine/model_runner.py, `_encode_images`) calls an `encode(images)` function.
In one integrated engine that is the local tower (inputs/compression.py, `encode_visual_tokens`); with an
encoder URL it is `RemoteEncoder.encode`: one POST of the step's images to `/v1/encode` of the encoder service
(serve/encoder_server.py), which answers with their visual tokens. The engine's encoder cache and prefix cache
are unchanged: what comes back is cached locally under the same key a local encode would have used, so a
picture crosses the network once per engine, not once per request.

The request body carries, per image, what its visual tokens depend on and nothing more: the resized RGB bytes
(uint8, 3 bytes a pixel: a quarter of the float32 patches the tower takes), the patch grid, the content hash
(the service's cache key) and the compression policy; plus the preprocessing constants, which the service
checks against its own. The answer carries each image's tokens, and the kept tokens' grid coordinates for a
compressed image. Every answer is checked (count, shape, dtype) before it reaches the model.

A service that is down, slow past `timeout_s`, or answers with an error fails the step's requests with a
`PeerError`, never a hang (engine/engine.py turns it into an error output for those requests alone).
"""

import time
import urllib.error
import urllib.request

import torch

from nanomm.errors import PeerError
from nanomm.inputs.compression import VisualTokens
from nanomm.transfer.wire import MEDIA_TYPE, expect, pack, unpack

PREPROCESSING_KEYS = ("patch_size", "temporal_patch_size", "merge_size", "image_mean", "image_std",
                      "rescale_factor")


def encode_request(images: list) -> bytes:
    """The body of POST /v1/encode for these preprocessed images (`ProcessedImage`)."""
    tensors = {f"rgb.{i}": torch.frombuffer(bytearray(im.resized_rgb), dtype=torch.uint8)
               for i, im in enumerate(images)}
    message = {
        "images": [{"grid_thw": list(im.grid_thw), "content_hash": im.content_hash,
                    "compression": None if im.compression is None else
                    {"method": im.compression.method, "keep_ratio": im.compression.keep_ratio}}
                   for im in images],
        "preprocessing": {key: getattr(images[0].config, key) for key in PREPROCESSING_KEYS},
    }
    return pack(tensors, message)


def read_encode_response(body: bytes, images: list, hidden_size: int, dtype: torch.dtype, peer: str
                         ) -> list[VisualTokens]:
    """The visual tokens of each image, checked against what this engine expects of them."""
    tensors, message = unpack(body, peer)
    out = []
    for i, im in enumerate(images):
        embeds = expect(tensors.get(f"embeds.{i}"), f"embeds.{i}", dtype, (im.num_tokens, hidden_size), peer)
        coords = tensors.get(f"coords.{i}")
        if im.compression is not None:
            coords = expect(coords, f"coords.{i}", torch.long, (3, im.num_tokens), peer)
        out.append(VisualTokens(embeds, coords))
    if len(tensors) != sum(2 if im.compression is not None else 1 for im in images):
        raise PeerError(f"{peer} sent {len(tensors)} tensors for {len(images)} images")
    return out


def post(url: str, body: bytes, timeout_s: float, what: str) -> bytes:
    """POST a safetensors body; the answer's bytes, or a PeerError that says which peer failed and how."""
    request = urllib.request.Request(url, data=body, method="POST", headers={"Content-Type": MEDIA_TYPE})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.read()
    except urllib.error.HTTPError as exc:
        detail = exc.read()[:300].decode(errors="replace")
        # The caller's input was checked before it got here: any refusal is this deployment's fault (a 502),
        # or the peer being busy (a 503, passed on).
        raise PeerError(f"{what} at {url} answered {exc.code}: {detail}", 503 if exc.code == 503 else 502) from None
    except (urllib.error.URLError, OSError) as exc:  # refused, reset, timed out
        timed_out = "timed out" in str(exc)
        raise PeerError(f"{what} at {url} did not answer ({exc})", 504 if timed_out else 502) from None


class RemoteEncoder:
    """`encode(images) -> [VisualTokens]` over HTTP, with the byte and time counters `/metrics` shows."""

    def __init__(self, url: str, hidden_size: int, dtype: torch.dtype, device: torch.device,
                 timeout_s: float = 30.0):
        self.url = url.rstrip("/")
        self.hidden_size, self.dtype, self.device, self.timeout_s = hidden_size, dtype, device, timeout_s
        self.bytes_sent = self.bytes_received = 0
        self.wait_s = 0.0

    def encode(self, images: list, url: str | None = None) -> list[VisualTokens]:
        """The images' visual tokens from the service at url (None: this engine's default)."""
        url = (url or self.url).rstrip("/")
        body = encode_request(images)
        start = time.perf_counter()
        answer = post(f"{url}/v1/encode", body, self.timeout_s, "the encoder service")
        self.wait_s += time.perf_counter() - start
        self.bytes_sent += len(body)
        self.bytes_received += len(answer)
        tokens = read_encode_response(answer, images, self.hidden_size, self.dtype, f"the encoder service at {url}")
        return [VisualTokens(t.embeds.to(self.device), t.coords) for t in tokens]

    def stats(self) -> dict:
        return {"visual_token_bytes_received": self.bytes_received, "encoder_request_bytes_sent": self.bytes_sent,
                "remote_encode_wait_s": self.wait_s}
