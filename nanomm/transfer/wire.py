"""One body format for every transfer: a safetensors file whose header also carries a JSON document.

Lesson: lessons/13-three-topologies.md.

Safetensors is the checkpoints' format: an 8-byte header length, a JSON header naming each tensor's dtype,
shape and byte range, then the raw bytes. No pickle, so a body from another machine can be read without
trusting it to run code, and its header says exactly what the bytes are. The header's free-form
`__metadata__` (string -> string) carries the rest of the message as one JSON string under "nanomm".

A receiver never trusts a body to be what it asked for: `expect` checks a tensor's dtype and shape and raises
`PeerError` naming the difference, so a peer serving another model (other layers, heads, hidden size or dtype)
is an error, never silent garbage.
"""

import json

import torch
from safetensors.torch import load, save

from nanomm.errors import PeerError

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
