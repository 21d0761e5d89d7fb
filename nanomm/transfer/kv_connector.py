"""The KV connector: how a decode instance gets the prompt KV a prefill instance computed.

Lesson: lessons/13-three-topologies.md.

vLLM's idea, kept to its core: the engine does not care how KV moves between instances, only that something
hands it the KV of the positions it asks for, checked. `KVConnector.pull` is that something. A prefill instance
*parks* a request after its first token (engine/handoff.py) and the decode instance pulls from it, so the prefill
side never pushes to a peer that may not be there: a decode instance that never comes costs the prefill side
only a timeout (its parked blocks are then freed).

`HttpKVConnector` is the one implementation: GET `/v1/kv/<transfer id>?from_token=K` on the prefill instance,
answered with a safetensors body (transfer/wire.py). It works between machines; on one machine it is a copy
through the loopback, which the lesson measures. Other transports (NCCL, RDMA, shared memory) would implement
`pull` against their own producer; the engines around them stay as they are.
"""

import time
import urllib.error
import urllib.request
from abc import ABC, abstractmethod

import torch

from nanomm.errors import PeerError
from nanomm.transfer.wire import expect, unpack


class KVConnector(ABC):
    @abstractmethod
    def pull(self, remote_url: str, transfer_id: str, from_token: int, num_tokens: int,
             layout: dict[str, tuple[torch.dtype, tuple]]) -> tuple[dict[str, torch.Tensor], int]:
        """The KV of positions from_token..num_tokens-1 of a parked request, as named tensors matching `layout`
        (name -> (dtype, shape)), and the bytes that crossed the wire. PeerError on any failure or mismatch."""


class HttpKVConnector(KVConnector):
    def __init__(self, timeout_s: float = 30.0):
        self.timeout_s = timeout_s
        self.bytes_received, self.pull_s = 0, 0.0

    def pull(self, remote_url, transfer_id, from_token, num_tokens, layout):
        peer = f"the prefill instance at {remote_url}"
        url = f"{remote_url.rstrip('/')}/v1/kv/{transfer_id}?from_token={from_token}"
        start = time.perf_counter()
        try:
            with urllib.request.urlopen(url, timeout=self.timeout_s) as response:
                body = response.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read()[:300].decode(errors="replace")
            raise PeerError(f"{peer} answered {exc.code}: {detail}", 503 if exc.code == 503 else 502) from None
        except (urllib.error.URLError, OSError) as exc:
            raise PeerError(f"{peer} did not answer ({exc})", 504 if "timed out" in str(exc) else 502) from None
        tensors, message = unpack(body, peer)
        if message.get("num_tokens") != num_tokens or message.get("from_token") != from_token:
            raise PeerError(f"{peer} sent positions {message.get('from_token')}..{message.get('num_tokens')}, "
                            f"not {from_token}..{num_tokens}")
        if set(tensors) != set(layout):
            raise PeerError(f"{peer} sent KV tensors {sorted(tensors)}, this instance stores {sorted(layout)} "
                            "(do both use the same kv_cache_dtype?)")
        for name, (dtype, shape) in layout.items():
            expect(tensors[name], name, dtype, shape, peer)
        self.bytes_received += len(body)
        self.pull_s += time.perf_counter() - start
        return tensors, len(body)
