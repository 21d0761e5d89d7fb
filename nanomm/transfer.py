"""What travels between the instances of a split engine, and how: visual tokens from an encoder service, a
request's KV from a prefill instance to a decode instance. Safetensors bodies over HTTP, checked on arrival.

Lesson: lessons/13-three-topologies.md.

**The wire.** Every body is a safetensors file, the checkpoints' format: an 8-byte header length, a JSON header
naming each tensor's dtype, shape and byte range, then the raw bytes. No pickle, so a body from another machine
can be read without trusting it to run code. The header's free-form `__metadata__` carries the rest of the
message as one JSON string under "nanomm". A receiver never trusts a body to be what it asked for: `expect`
checks each tensor's dtype and shape and raises `PeerError` naming the difference, so a peer serving another
model (other layers, heads, hidden size or dtype) is an error, never silent garbage.

**An encoder service** (`LLM(model, encoder_url=...)` runs no vision tower). The model runner's encode stage
(engine/model_runner.py) calls `RemoteEncoder.encode`: one POST of the step's images to `/v1/encode` of the
service (serve/encoder_server.py). The body carries, per image, what its visual tokens depend on and nothing
more: the resized RGB bytes (uint8: a quarter of the float32 patches the tower takes), the patch grid, the
content hash (the service's cache key) and the compression policy; plus the preprocessing constants, which the
service checks against its own. What comes back is cached in the engine's encoder cache under the key a local
encode would have used, so a picture crosses the network once per engine, and the prefix cache is unchanged.

**The KV connector** (vLLM's idea, kept to its core): the engine does not care how KV moves between instances,
only that something hands it the KV of the positions it asks for, checked. A prefill instance *parks* a request
after its first token (engine/handoff.py) and the decode instance pulls from it, so the prefill side never
pushes to a peer that may not be there: a decode instance that never comes costs the prefill side only a
timeout. `HttpKVConnector` is the one implementation: GET `/v1/kv/<transfer id>?from_token=K` on the prefill
instance. It works between machines; on one machine it is a copy through the loopback. Other transports (NCCL,
RDMA, shared memory) would implement `KVConnector.pull`; the engines around them stay as they are.

A peer that is down, slow past its timeout, or answers with an error is a `PeerError`, never a hang.
"""

import json
import threading
import time
import urllib.error
import urllib.request
from abc import ABC, abstractmethod

import torch
from safetensors.torch import load, save

from nanomm.errors import PeerError
from nanomm.inputs.compression import VisualTokens

MEDIA_TYPE = "application/vnd.nanomm.safetensors"


def pack(tensors: dict[str, torch.Tensor], message: dict) -> bytes:
    """Tensors (moved to the CPU, made contiguous) and a JSON-able message, as one safetensors body."""
    cpu = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
    return save(cpu, metadata={"nanomm": json.dumps(message)})


def unpack(body: bytes, peer: str) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors, message) of a body from `peer`; anything unreadable is a PeerError naming the peer."""
    try:
        header_length = int.from_bytes(body[:8], "little")
        header = json.loads(body[8:8 + header_length])
        message = json.loads(header["__metadata__"]["nanomm"])
        return load(body), message
    except Exception as exc:  # noqa: BLE001 - whatever is wrong with it, it is not a body we can use
        raise PeerError(f"{peer} sent a body that is not a nanomm safetensors message ({type(exc).__name__}: "
                        f"{str(exc)[:120]})") from None


def expect(tensor: torch.Tensor | None, name: str, dtype: torch.dtype, shape: tuple, peer: str) -> torch.Tensor:
    """The tensor, if it has this dtype and shape (None in `shape` matches any size); else a PeerError."""
    if tensor is None:
        raise PeerError(f"{peer} sent no tensor {name!r}")
    fits = len(tensor.shape) == len(shape) and all(s is None or s == t for s, t in zip(shape, tensor.shape))
    if tensor.dtype != dtype or not fits:
        wanted = tuple("*" if s is None else s for s in shape)
        raise PeerError(f"{peer} sent {name!r} as {tensor.dtype} {tuple(tensor.shape)}; this instance needs "
                        f"{dtype} {wanted} (is the peer serving the same model, dtype and KV cache dtype?)")
    return tensor


# -- an encoder service ---------------------------------------------------------------------------------------

PREPROCESSING_KEYS = ("patch_size", "temporal_patch_size", "merge_size", "image_mean", "image_std",
                      "rescale_factor")


def encode_request(images: list) -> bytes:
    """The body of POST /v1/encode for these preprocessed images (`ProcessedImage`) and videos' temporal patches
    (`VideoGroup`: its frames, "video": true, and the videos' own preprocessing constants, which may differ)."""
    tensors = {f"rgb.{i}": torch.frombuffer(bytearray(_resized_rgb(im)), dtype=torch.uint8)
               for i, im in enumerate(images)}
    message = {
        "images": [{"grid_thw": list(im.grid_thw), "content_hash": im.content_hash,
                    "compression": None if im.compression is None else
                    {"method": im.compression.method, "keep_ratio": im.compression.keep_ratio}}
                   | ({"video": True} if getattr(im, "is_video", False) else {})
                   | ({"kept": im.kept_rows.tolist()} if getattr(im, "kept_rows", None) is not None else {})
                   for im in images],
    }
    for kind, items in (("preprocessing", [im for im in images if not getattr(im, "is_video", False)]),
                        ("video_preprocessing", [im for im in images if getattr(im, "is_video", False)])):
        if items:
            message[kind] = {key: getattr(items[0].config, key) for key in PREPROCESSING_KEYS}
    return pack(tensors, message)


def _resized_rgb(item) -> bytes:
    """A picture's resized pixels, or a temporal patch's frames: what the visual tokens are computed from."""
    return item.frames_rgb if getattr(item, "is_video", False) else item.resized_rgb


def read_encode_response(body: bytes, images: list, hidden_size: int, dtype: torch.dtype, peer: str,
                         levels: int = 1) -> list[VisualTokens]:
    """The visual tokens of each image, checked against what this engine expects of them: (tokens, hidden), or
    for a DeepStack model (levels, tokens, hidden), every level."""
    tensors, message = unpack(body, peer)
    out = []
    for i, im in enumerate(images):
        shape = (im.num_tokens, hidden_size) if levels == 1 else (levels, im.num_tokens, hidden_size)
        embeds = expect(tensors.get(f"embeds.{i}"), f"embeds.{i}", dtype, shape, peer)
        coords = tensors.get(f"coords.{i}")
        if im.compression is not None:
            coords = expect(coords, f"coords.{i}", torch.long, (3, im.num_tokens), peer)
        out.append(VisualTokens(embeds, coords))
    if len(tensors) != sum(2 if im.compression is not None else 1 for im in images):
        raise PeerError(f"{peer} sent {len(tensors)} tensors for {len(images)} images")
    return out


def fetch(request: "urllib.request.Request | str", timeout_s: float, peer: str) -> bytes:
    """The answer's bytes (a GET of a URL, or the request given), or a PeerError that says which peer failed
    and how. The caller's input was checked before it got here: any refusal is this deployment's fault (a 502),
    or the peer being busy (a 503, passed on); a peer that says nothing in time is a 504."""
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.read()
    except urllib.error.HTTPError as exc:
        detail = exc.read()[:300].decode(errors="replace")
        raise PeerError(f"{peer} answered {exc.code}: {detail}", 503 if exc.code == 503 else 502) from None
    except (urllib.error.URLError, OSError) as exc:  # refused, reset, timed out
        raise PeerError(f"{peer} did not answer ({exc})", 504 if "timed out" in str(exc) else 502) from None


class RemoteEncoder:
    """`encode(images) -> [VisualTokens]` over HTTP, with the byte and time counters `/metrics` shows."""

    def __init__(self, url: str, hidden_size: int, dtype: torch.dtype, device: torch.device,
                 timeout_s: float = 30.0, levels: int = 1):
        self.url = url.rstrip("/")
        self.hidden_size, self.dtype, self.device, self.timeout_s = hidden_size, dtype, device, timeout_s
        self.levels = levels  # 1 + a DeepStack model's extra levels
        self.bytes_sent = self.bytes_received = 0
        self.wait_s = 0.0
        self._counting = threading.Lock()  # encodes may run on several threads at once (encode-ahead)

    def encode(self, images: list, url: str | None = None) -> list[VisualTokens]:
        """The images' visual tokens from the service at url (None: this engine's default)."""
        url, body = (url or self.url).rstrip("/"), encode_request(images)
        peer = f"the encoder service at {url}"
        request = urllib.request.Request(f"{url}/v1/encode", data=body, method="POST",
                                         headers={"Content-Type": MEDIA_TYPE})
        start = time.perf_counter()
        answer = fetch(request, self.timeout_s, peer)
        with self._counting:
            self.wait_s += time.perf_counter() - start
            self.bytes_sent += len(body)
            self.bytes_received += self.received_bytes(answer, images)
        tokens = read_encode_response(answer, images, self.hidden_size, self.dtype, peer, self.levels)
        return [VisualTokens(t.embeds.to(self.device), t.coords) for t in tokens]

    def received_bytes(self, answer: bytes, images: list) -> int:
        """The bytes an answer counts as received: its own."""
        return len(answer)

    def stats(self) -> dict:
        return {"visual_token_bytes_received": self.bytes_received, "encoder_request_bytes_sent": self.bytes_sent,
                "remote_encode_wait_s": self.wait_s}


# -- the KV connector --------------------------------------------------------------------------------------------

class KVConnector(ABC):
    """Both ends of a KV transfer: the prefill instance's body (`export`), the decode instance's `pull`."""
    media_type = MEDIA_TYPE  # what `export`'s body is

    def export(self, tensors: dict[str, torch.Tensor], from_token: int, num_tokens: int) -> tuple[bytes, int]:
        """The body a parked request's KV leaves in, and the bytes it counts as sent."""
        body = pack(tensors, {"from_token": from_token, "num_tokens": num_tokens})
        return body, len(body)

    @abstractmethod
    def pull(self, remote_url: str, transfer_id: str, from_token: int, num_tokens: int,
             layout: dict[str, tuple[torch.dtype, tuple]]) -> tuple[dict[str, torch.Tensor], int]:
        """The KV of positions from_token..num_tokens-1 of a parked request, as named tensors matching `layout`
        (name -> (dtype, shape)), and the bytes that crossed the wire. PeerError on any failure or mismatch."""


class HttpKVConnector(KVConnector):
    def __init__(self, timeout_s: float = 30.0):
        self.timeout_s = timeout_s

    def pull(self, remote_url, transfer_id, from_token, num_tokens, layout):
        tensors, peer, body_bytes = self.receive(remote_url, transfer_id, from_token, num_tokens)
        if set(tensors) != set(layout):
            raise PeerError(f"{peer} sent KV tensors {sorted(tensors)}, this instance stores {sorted(layout)} "
                            "(do both use the same kv_cache_dtype?)")
        for name, (dtype, shape) in layout.items():
            expect(tensors[name], name, dtype, shape, peer)
        return tensors, body_bytes

    def receive(self, remote_url, transfer_id, from_token, num_tokens) -> tuple[dict[str, torch.Tensor], str, int]:
        """GET the parked request's body: (its tensors, the peer's name for errors, the body's bytes), once its
        positions are checked to be the ones asked for."""
        peer = f"the prefill instance at {remote_url}"
        body = fetch(f"{remote_url.rstrip('/')}/v1/kv/{transfer_id}?from_token={from_token}", self.timeout_s, peer)
        tensors, message = unpack(body, peer)
        if message.get("num_tokens") != num_tokens or message.get("from_token") != from_token:
            raise PeerError(f"{peer} sent positions {message.get('from_token')}..{message.get('num_tokens')}, "
                            f"not {from_token}..{num_tokens}")
        return tensors, peer, len(body)
