"""Hold nanomm-serve under many concurrent streaming clients for a while: errors, leaks and memory.

    python scripts/soak_serve.py                             # 32 clients for 180 s on the tiny checkpoint
    python scripts/soak_serve.py --clients 4 --seconds 5 --json soak.json

The server runs in this process (BackgroundServer on 127.0.0.1, a free port). Each client loops until the time
is up: a streamed chat request about a random picture (one of three sizes, or none), read to [DONE], then the
next. At the end: requests done, any error, the server's resident memory at the first and last quarter of the
run, and the KV blocks still in use once every client stopped (0 is the only right answer). Not a test: the
smallest mode runs in tests/test_scripts.py, and nothing asserts a timing.
"""

import argparse
import base64
import io
import json
import random
import resource
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/: bench.py's helpers

from bench import load_checkpoint, machine_info, random_image  # noqa: E402
from nanomm import LLM  # noqa: E402
from nanomm.serve.app import BackgroundServer, Server, ServerConfig  # noqa: E402

IMAGE_SIZES = [None, (56, 56), (224, 168), (448, 448)]


def image_url(size, seed: int) -> str:
    buffer = io.BytesIO()
    random_image(*size, seed).save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def client_loop(base: str, seed: int, stop_at: float, tally: dict, lock: threading.Lock) -> None:
    rng = random.Random(seed)
    with httpx.Client(base_url=base, timeout=120) as http:
        while time.monotonic() < stop_at:
            size = rng.choice(IMAGE_SIZES)
            parts = [] if size is None else [{"type": "image_url", "image_url": {"url": image_url(size, rng.randrange(10**6))}}]
            body = {"model": "soak", "stream": True, "max_tokens": rng.randint(4, 32), "temperature": 0.8,
                    "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "Describe it."}]}]}
            outcome = "ok"
            try:
                with http.stream("POST", "/v1/chat/completions", json=body) as answer:
                    lines = [line for line in answer.iter_lines() if line.startswith("data: ")]
                if answer.status_code != 200 or lines[-1] != "data: [DONE]":
                    outcome = f"HTTP {answer.status_code}: {lines[-1:]}"
            except httpx.HTTPError as exc:
                outcome = f"{type(exc).__name__}: {exc}"
            with lock:
                tally["requests"] += 1
                if outcome != "ok":
                    tally["errors"].append(outcome)


def resident_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--seconds", type=float, default=180.0)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--checkpoint"), p.add_argument("--cache-dir", default="checkpoints/soak")
    p.add_argument("--json")
    args = p.parse_args(argv)
    llm = LLM(str(load_checkpoint(args, print)), max_pixels=448 * 448)
    tally, lock = {"requests": 0, "errors": []}, threading.Lock()
    memory = []
    with BackgroundServer(Server(llm, ServerConfig("soak"))) as base:
        start = time.monotonic()
        stop_at = start + args.seconds
        clients = [threading.Thread(target=client_loop, args=(base, i, stop_at, tally, lock))
                   for i in range(args.clients)]
        for c in clients:
            c.start()
        while any(c.is_alive() for c in clients):
            memory.append((time.monotonic() - start, resident_mib()))
            time.sleep(min(1.0, args.seconds / 20))
        for c in clients:
            c.join()
        elapsed = time.monotonic() - start
        time.sleep(0.5)
        kv_used = llm.stats()["kv_blocks_used"]
    quarter = [m for t, m in memory if t <= elapsed / 4] or [memory[0][1]]
    last = [m for t, m in memory if t >= elapsed * 3 / 4] or [memory[-1][1]]
    result = dict(clients=args.clients, seconds=round(elapsed, 1), requests=tally["requests"],
                  errors=len(tally["errors"]), first_errors=tally["errors"][:5], kv_blocks_used_after=kv_used,
                  rss_mib_first_quarter=round(max(quarter), 1), rss_mib_last_quarter=round(max(last), 1),
                  machine=machine_info())
    print(json.dumps({k: v for k, v in result.items() if k != "machine"}, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    llm.close()
    return 0 if not tally["errors"] and kv_used == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
