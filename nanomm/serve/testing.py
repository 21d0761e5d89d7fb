"""Run a server in a background thread, for tests, lessons and benchmarks; and pick a free port for one that starts
later in a process of its own.

    with BackgroundServer(Server(llm, ServerConfig("demo"))) as url:     # any object with an ASGI `app`
        httpx.post(url + "/v1/completions", json=...)

Lessons: lessons/11-serving-under-load.md and lessons/13-three-topologies.md serve through it; Ray Serve's replicas
(serve/ray.py) serve their connector port with it. `nanomm-serve` itself (cli.py) runs uvicorn in the foreground.
"""

import random
import socket
import threading
import time
from pathlib import Path

import uvicorn


class BackgroundServer:
    """Serve `server.app` on a thread: `with BackgroundServer(s) as url:`; the server stops when the block ends."""

    def __init__(self, server, host: str = "127.0.0.1", port: int = 0):
        self.uvicorn = uvicorn.Server(uvicorn.Config(server.app, host=host, port=port, log_level="warning",
                                                     lifespan="on"))
        self._thread = threading.Thread(target=self.uvicorn.run, name="nanomm-http", daemon=True)

    def __enter__(self) -> str:
        self._thread.start()
        for _ in range(1000):
            if self.uvicorn.started:
                host, port = self.uvicorn.servers[0].sockets[0].getsockname()[:2]
                return f"http://{host}:{port}"
            time.sleep(0.01)
        raise RuntimeError("the server did not start within 10 s")

    def __exit__(self, *exc) -> None:
        self.uvicorn.should_exit = True
        self._thread.join(timeout=30)


def free_local_port(rng: random.Random | None = None) -> int:
    """A free port on 127.0.0.1 for a server process that starts later (tests, lesson 13's clusters, the load
    generator), chosen below the kernel's ephemeral range (Linux: ip_local_port_range, 32768 and up by default).
    Asking the kernel for port 0 and closing it would hand out a port from that range, which any outgoing
    connection made before the server binds (a health check, a peer's request) may take: then the server dies
    with "address already in use"."""
    rng = rng or random.Random()
    top = min(32768, ephemeral_ports_start())
    for _ in range(200):
        port = rng.randrange(max(1024, top - 12768), top)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:  # taken: try another
                continue
        return port
    raise RuntimeError(f"no free port below {top} on 127.0.0.1")


def ephemeral_ports_start() -> int:
    """The first port the kernel hands out to outgoing connections (32768 where it does not say)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768
