"""Hold nanomm-serve under many concurrent streaming clients for a while: errors, leaks and memory.

    nanomm-bench soak                             # 32 clients for 180 s on the tiny checkpoint
    nanomm-bench soak --clients 4 --seconds 5 --json soak.json

Lesson: lessons/11-serving-under-load.md (the server under load; this holds it there for a while).

The server runs as its own process (`python -m nanomm.serve.cli` on 127.0.0.1, as the load generator starts it),
so that its memory is its own. Each client loops until the time is up: a streamed chat request about a random
picture (one of three sizes, or none), read to [DONE], then the next. Every second the server's resident memory
(VmRSS in /proc) and its KV blocks in use (/metrics) are sampled. At the end: requests done, any error, the
memory curve, and the KV blocks still in use once every client stopped (0 is the only right answer). Not a
test: the smallest mode runs in tests/test_scripts.py, and nothing asserts a timing.
"""

import argparse
import json
import random
import threading
import time
from pathlib import Path

import httpx


from nanomm.bench.load import image_data_url, scrape, start_server
from nanomm.bench.machine import machine_info
from nanomm.bench.requests import load_checkpoint

IMAGE_SIZES = [None, (56, 56), (224, 168), (448, 448)]


def client_loop(base: str, seed: int, stop_at: float, tally: dict, lock: threading.Lock) -> None:
    rng = random.Random(seed)
    with httpx.Client(base_url=base, timeout=120) as http:
        while time.monotonic() < stop_at:
            size = rng.choice(IMAGE_SIZES)
            parts = [] if size is None else [
                {"type": "image_url", "image_url": {"url": image_data_url(*size, rng.randrange(10**6), "PNG")}}]
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


def resident_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def engine_gauges(base: str) -> dict[str, float]:
    """The server's engine gauges (KV blocks used, requests running and waiting), read from /metrics."""
    samples = scrape(base)
    return {name: samples[name] for name in ("nanomm_kv_blocks_used", "nanomm_requests_running",
                                             "nanomm_requests_waiting")}


def window_peaks(curve: list[tuple[float, float]], seconds: float, windows: int) -> list[float | None]:
    """The most resident memory (MiB) in each of `windows` equal slices of the run (None: no sample in it)."""
    peaks = []
    for w in range(windows):
        inside = [m for t, m in curve if w * seconds / windows <= t <= (w + 1) * seconds / windows]
        peaks.append(round(max(inside), 1) if inside else None)
    return peaks


def memory_summary(curve: list[tuple[float, float]], seconds: float) -> dict:
    """Resident memory at the start, its peak in each tenth and each quarter of the run, and the growth from
    the second quarter's peak to the last one's (after the warm-up a plateau shows as ~0)."""
    quarters = window_peaks(curve, seconds, 4)
    growth = None if None in (quarters[1], quarters[3]) else round(100 * (quarters[3] - quarters[1]) / quarters[1], 2)
    return dict(rss_mib_start=round(curve[0][1], 1), rss_mib_peak_by_tenth=window_peaks(curve, seconds, 10),
                rss_mib_peak_by_quarter=quarters, rss_growth_second_half_pct=growth)


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--seconds", type=float, default=180.0)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--checkpoint"), p.add_argument("--cache-dir", default="checkpoints/soak")
    p.add_argument("--json")


def main(args) -> int:
    server, base = start_server(load_checkpoint(args, print), "soak", ["--max-pixels", str(448 * 448)], print)
    tally, lock = {"requests": 0, "errors": []}, threading.Lock()
    curve, kv_peak = [], 0.0
    try:
        start = time.monotonic()
        stop_at = start + args.seconds
        clients = [threading.Thread(target=client_loop, args=(base, i, stop_at, tally, lock))
                   for i in range(args.clients)]
        for c in clients:
            c.start()
        while any(c.is_alive() for c in clients):
            curve.append((round(time.monotonic() - start, 2), round(resident_mib(server.pid), 1)))
            kv_peak = max(kv_peak, engine_gauges(base)["nanomm_kv_blocks_used"])
            time.sleep(min(1.0, args.seconds / 20))
        for c in clients:
            c.join()
        elapsed = time.monotonic() - start
        time.sleep(0.5)
        after = engine_gauges(base)
    finally:
        server.terminate()
        server.wait(timeout=30)
    result = dict(clients=args.clients, seconds=round(elapsed, 1), requests=tally["requests"],
                  errors=len(tally["errors"]), first_errors=tally["errors"][:5],
                  kv_blocks_used_peak=kv_peak, kv_blocks_used_after=after["nanomm_kv_blocks_used"],
                  requests_left=after["nanomm_requests_running"] + after["nanomm_requests_waiting"],
                  **memory_summary(curve, elapsed), rss_curve=curve, machine=machine_info())
    print(json.dumps({k: v for k, v in result.items() if k not in ("machine", "rss_curve")}, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0 if not tally["errors"] and result["kv_blocks_used_after"] == 0 else 1
