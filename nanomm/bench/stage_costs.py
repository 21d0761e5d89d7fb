"""Measure the topology simulator's stage costs on this machine, for the model nanomm-serve would serve.

    nanomm-bench stage-costs --demo --json costs.json          # the trained demo model
    nanomm-bench stage-costs --checkpoint DIR --threads 1 --json costs.json   # one thread an engine
    nanomm-bench simulate --costs costs.json --topologies integrated 1e1p1d ...   # then predict with them

Lesson: lessons/13-three-topologies.md (the prediction against a measured load).

Each cost of `StageCosts` (nanomm/sim/stages.py) comes from nanomm's own engine, in this process, on the
device and dtype the server would pick (cpu and float32 here), after a warm-up:

- encode: requests of 1-3 new pictures of several sizes, one output token each; each request's
  `RequestMetrics.encode_s` is fitted as encode_s_per_image x images + encode_s_per_visual_token x tokens;
- prefill: text prompts of 16-1,024 random token ids, one output token each, one engine step each; the step's
  wall time, up to 512 tokens, is fitted as step_overhead_s + prefill_s_per_token x tokens (the intercept is the
  step overhead; past 512 tokens attention's quadratic term shows, which the simulator does not model);
- decode: b sequences (b from 1 to 48) decoding together; the median of their pure-decode steps is fitted as
  c + b x decode_s_per_sequence, and decode_s_per_step = c - step_overhead_s (the simulator adds the overhead);
- the link, over the loopback, as the split engine uses it: an encode round trip of a picture the encoder
  service already holds (no compute: a small body each way) and a KV pull of a long prompt from a prefill
  instance (GET /v1/kv/<id>) are two (bytes, seconds) points on seconds = link_latency_s + bytes /
  link_bytes_per_s;
- visual_bytes_per_token and kv_bytes_per_token: the model's hidden size and KV layout in its dtype;
- shared_cpu_workers, the one cost that is not a stage's: instances on one machine share its cores. The same
  engine work (an encode, a prefill, decode steps) runs in one process alone, then in three at once (the split
  engine's encoder, prefill and decode instance); K = 3 x time alone / time together is how many busy workers
  the machine runs at full speed, and the simulator runs n > K busy workers at K / n of their speed.

`--threads N` measures an engine with N torch threads (each instance of a split engine on a 2-core machine
gets one: `nanomm-bench load --instance-threads 1`; two threads each would oversubscribe the cores).

Every fit is least squares over the medians of --repeats runs. A sample during which other processes used more
than a tenth of the CPU is taken again once the machine is quiet (the machine may be shared). The JSON holds
the costs under the simulator's names (what `--costs` reads), with the samples, the fits, the machine and the
command. Not a test: tests/test_scripts.py runs it with --quick, and nothing asserts a timing.
"""

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import httpx
import torch

from nanomm import LLM, SamplingParams
from nanomm.bench import load
from nanomm.bench.load import cpu_seconds, other_cpu_share
from nanomm.bench.machine import machine_info
from nanomm.bench.requests import WORDS, random_image
from nanomm.engine.sizing import kv_bytes_per_token
from nanomm.serve.app import Server, ServerConfig
from nanomm.serve.encoder_server import EncoderServer, load_encoder
from nanomm.serve.testing import BackgroundServer
from nanomm.topology import parse_topology
from nanomm.sim.twin import HOST_KEYS, HostCosts, TwinCosts, simulate_twin
from nanomm.sim.workload import requests_from_load
from nanomm.transfer import RemoteEncoder

ENCODE_SHAPES = [(1, 56), (1, 112), (1, 168), (1, 224), (2, 112), (3, 56), (2, 224)]  # (images, side in pixels)
PREFILL_LENGTHS = [16, 32, 64, 128, 256, 512, 1024]
GUARD = {"on": True}  # wait for a quiet machine and measure again when disturbed (off with --quick)
QUICK = {"encode": [(1, 56), (2, 56), (1, 112)], "prefill": [16, 64, 256], "decode": [1, 4]}  # --quick: a smoke run
PREFILL_FIT_TOKENS = 512  # the fit: prompts up to this long (longer ones add attention's quadratic term)
DECODE_BATCHES = [1, 2, 4, 8, 16, 32, 48]


def wait_until_quiet(log, limit_s: float = 600.0, busy_below: float = 0.1) -> None:
    """Wait until the machine's other processes have been idle (under busy_below of the CPU) for 3 s running."""
    if not GUARD["on"]:
        return
    deadline, quiet = time.monotonic() + limit_s, 0
    while quiet < 3 and time.monotonic() < deadline:
        before, start = cpu_seconds([os.getpid()]), time.monotonic()
        time.sleep(1.0)
        share = other_cpu_share(before, cpu_seconds([os.getpid()]), time.monotonic() - start)
        quiet = quiet + 1 if share is None or share < busy_below else 0
    if quiet < 3:
        log(f"  (the machine was not quiet within {limit_s:g} s: measuring anyway)")


def own_cpu() -> tuple[float, float] | None:
    """cpu_seconds of this process and its finished children (the contention probes)."""
    sample, t = cpu_seconds([os.getpid()]), os.times()
    return None if sample is None else (sample[0], sample[1] + t.children_user + t.children_system)


def quietly(measure_point, log, tries: int = 6, busy_below: float = 0.1):
    """measure_point() again, after waiting for quiet, whenever other processes used more than busy_below of
    the CPU while it ran (the machine may be shared); its result, and the other processes' share of the last try."""
    if not GUARD["on"]:
        return measure_point(), None
    for attempt in range(tries):
        before, start = own_cpu(), time.perf_counter()
        result = measure_point()
        share = other_cpu_share(before, own_cpu(), time.perf_counter() - start)
        if share is None or share < busy_below:
            return result, share
        log(f"    (other processes used {share:.0%} of the CPU meanwhile: measured again)")
        wait_until_quiet(log)
    return result, share


def least_squares(rows: list[list[float]], ys: list[float]) -> list[float]:
    """The coefficients minimising |rows @ x - ys|^2 (torch's lstsq, in float64)."""
    a = torch.tensor(rows, dtype=torch.float64)
    b = torch.tensor(ys, dtype=torch.float64).unsqueeze(1)
    return torch.linalg.lstsq(a, b).solution.squeeze(1).tolist()


def trimmed_least_squares(rows: list[list[float]], ys: list[float], spread: float = 3.0) -> list[float]:
    """least_squares without the points that miss its first fit by more than `spread` x the median miss: a few
    requests that queued behind another (or overtook one) would pull a fit of the unqueued path off."""
    coefficients = least_squares(rows, ys)
    misses = [abs(y - sum(c * x for c, x in zip(coefficients, row))) for row, y in zip(rows, ys)]
    limit = spread * max(statistics.median(misses), 1e-3)
    kept = [(row, y) for row, y, miss in zip(rows, ys, misses) if miss <= limit]
    return least_squares([r for r, _ in kept], [y for _, y in kept]) if len(kept) > len(rows[0]) else coefficients


def image_prompt(llm: LLM, images: list, words: str = "What colour is the shape?") -> dict:
    messages = [{"role": "user", "content": [*({"type": "image", "image": im} for im in images),
                                             {"type": "text", "text": words}]}]
    text, loaded = llm.tokenizer.apply_chat_template(messages)
    return {"prompt": text, "multi_modal_data": {"image": loaded}}


def plain_ids(llm: LLM, count: int, rng: random.Random) -> list[int]:
    """`count` random token ids, none of them an image or vision marker (text the engine takes as it is)."""
    config = llm.model.config
    special = {config.image_token_id, config.video_token_id, config.vision_start_token_id,
               config.vision_end_token_id, getattr(config, "vision_token_id", None)}
    ids = []
    while len(ids) < count:
        token = rng.randrange(config.text.vocab_size)
        if token not in special:
            ids.append(token)
    return ids


def run_alone(llm: LLM, prompt: dict, params: SamplingParams) -> tuple[object, list[float]]:
    """One request through add_request / step, alone: its final output and the wall time of each step."""
    engine = llm.engine
    engine.add_request(prompt, params)
    steps, final = [], None
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        for out in engine.step():
            final = out
        steps.append(time.perf_counter() - start)
    return final, steps


def measure_encode(llm: LLM, repeats: int, rng: random.Random, log, shapes=ENCODE_SHAPES) -> dict:
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    samples = []
    for count, side in shapes:
        def point():
            times, tokens = [], 0
            for _ in range(repeats):
                images = [random_image(side, side, rng.randrange(2**31)) for _ in range(count)]  # new: no cache hit
                out, _ = run_alone(llm, image_prompt(llm, images), one)
                times.append(out.metrics.encode_s)
                tokens = out.metrics.num_visual_tokens
            return tokens, statistics.median(times)
        (tokens, encode_s), _ = quietly(point, log)
        samples.append({"images": count, "side": side, "visual_tokens": tokens, "encode_s": encode_s})
        log(f"  encode {count} x {side}x{side}: {tokens} visual tokens, {samples[-1]['encode_s'] * 1e3:.2f} ms")
    per_image, per_token = least_squares([[s["images"], s["visual_tokens"]] for s in samples],
                                         [s["encode_s"] for s in samples])
    return {"samples": samples, "encode_s_per_image": per_image, "encode_s_per_visual_token": per_token}


def measure_prefill(llm: LLM, repeats: int, rng: random.Random, log, lengths=PREFILL_LENGTHS) -> dict:
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    budget = llm.engine.config.max_num_batched_tokens
    samples = []
    for length in [n for n in lengths if n <= budget]:
        def point():
            times = []
            for _ in range(repeats):
                ids = plain_ids(llm, length, rng)  # new ids: no prefix-cache hit
                _, steps = run_alone(llm, {"prompt_token_ids": ids}, one)
                assert len(steps) == 1, f"a {length}-token prompt took {len(steps)} steps"  # within the budget
                times.append(steps[0])
            return statistics.median(times)
        samples.append({"tokens": length, "step_s": quietly(point, log)[0]})
        log(f"  prefill {length} tokens: {samples[-1]['step_s'] * 1e3:.2f} ms")
    fitted = [s for s in samples if s["tokens"] <= PREFILL_FIT_TOKENS]
    overhead, per_token = least_squares([[1.0, s["tokens"]] for s in fitted], [s["step_s"] for s in fitted])
    return {"samples": samples, "step_overhead_s": overhead, "prefill_s_per_token": per_token}


def measure_decode(llm: LLM, repeats: int, rng: random.Random, log, prompt_tokens: int = 64,
                   decode_steps: int = 16, batches: list[int] = DECODE_BATCHES) -> dict:
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=decode_steps + 2, ignore_eos=True)
    samples = []
    for batch in [b for b in batches if b <= engine.config.max_num_seqs]:
        def point():
            times = []
            for _ in range(repeats):
                for _ in range(batch):
                    engine.add_request({"prompt_token_ids": plain_ids(llm, prompt_tokens, rng)}, params)
                first_tokens = 0
                while first_tokens < batch:  # the prefill steps: every request's first token
                    first_tokens += sum(len(out.outputs[0].token_ids) == 1 for out in engine.step())
                for _ in range(decode_steps):  # every running request decodes one token a step
                    start = time.perf_counter()
                    engine.step()
                    times.append(time.perf_counter() - start)
                while engine.has_unfinished_requests():
                    engine.step()
            return statistics.median(times)
        samples.append({"batch": batch, "step_s": quietly(point, log)[0] if len(batches) > 1 else point()})
        log(f"  decode batch {batch}: {samples[-1]['step_s'] * 1e3:.2f} ms a step")
    if len(samples) < 2:
        return {"samples": samples}
    intercept, per_sequence = least_squares([[1.0, s["batch"]] for s in samples], [s["step_s"] for s in samples])
    return {"samples": samples, "intercept_s": intercept, "decode_s_per_sequence": per_sequence}


def measure_link(llm: LLM, model: str, repeats: int, rng: random.Random, log, kv_prompt_words: int = 900) -> dict:
    """The loopback link as the split engine uses it: an encode round trip of a picture the encoder service has
    cached (no compute: a small body each way) and a KV pull of a long prompt from a prefill instance. Two
    (bytes, seconds) points on the line seconds = latency + bytes / bandwidth."""
    images = [random_image(168, 168, rng.randrange(2**31))]
    prepared = llm.engine.prepare(image_prompt(llm, images), None)
    text = llm.model.config.text
    with BackgroundServer(EncoderServer(load_encoder(model), "m")) as encoder_url:
        remote = RemoteEncoder(encoder_url, text.hidden_size, llm.model.dtype, llm.model.device)
        remote.encode(prepared.images)  # encoded once; every later call is a cache hit: no compute
        trip_bytes = remote.bytes_sent + remote.bytes_received  # one call's, both ways

        def round_trips():
            trips = []
            for _ in range(max(repeats, 5)):
                start = time.perf_counter()
                remote.encode(prepared.images)
                trips.append(time.perf_counter() - start)
            return statistics.median(trips)
        round_trip_s, _ = quietly(round_trips, log)
    log(f"  encode round trip (a cached picture, {trip_bytes:,.0f} bytes both ways): {round_trip_s * 1e3:.2f} ms")
    prefill = Server(LLM(model, num_preprocess_workers=0), ServerConfig("m", role="prefill"))
    with BackgroundServer(prefill) as prefill_url, httpx.Client(base_url=prefill_url, timeout=120) as http:
        def pulls():
            out = []
            for _ in range(max(repeats, 3)):
                words = " ".join(rng.choice(WORDS) for _ in range(kv_prompt_words))  # new words: no cache hit
                answer = http.post("/v1/completions", json={"model": "m", "prompt": words, "max_tokens": 2,
                                                            "kv_transfer_params": {"do_remote_decode": True}})
                answer.raise_for_status()
                params = answer.json()["kv_transfer_params"]
                start = time.perf_counter()
                body = http.get(f"/v1/kv/{params['transfer_id']}").content
                out.append((time.perf_counter() - start, len(body), len(params["prompt_token_ids"])))
            return out
        samples, _ = quietly(pulls, log)
    pull_s = statistics.median(p[0] for p in samples)
    _, pull_bytes, kv_tokens = max(samples, key=lambda p: p[1])
    bytes_per_s = (pull_bytes - trip_bytes) / max(pull_s - round_trip_s, 1e-6)
    latency = max(0.0, round_trip_s - trip_bytes / bytes_per_s)
    log(f"  KV pull of {kv_tokens:,} tokens ({pull_bytes:,} bytes): {pull_s * 1e3:.2f} ms -> "
        f"{bytes_per_s / 1e9:.2f} GB/s and {latency * 1e3:.2f} ms of latency")
    return {"encode_round_trip_s": round_trip_s, "encode_round_trip_bytes": trip_bytes,
            "kv_pull_s": pull_s, "kv_pull_bytes": pull_bytes, "kv_pull_tokens": kv_tokens,
            "link_latency_s": latency, "link_bytes_per_s": bytes_per_s}


PROBE = """
import random, time
from nanomm.bench import stage_costs as m
from nanomm import LLM, SamplingParams
llm = LLM({model!r}, num_preprocess_workers=0)
rng = random.Random({seed})
def work():  # encode, prefill and decode, as a worker of any pool does
    m.run_alone(llm, m.image_prompt(llm, [m.random_image(224, 224, rng.randrange(2**31))]),
                SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    m.measure_decode(llm, 1, rng, lambda line: None, batches=[8])
work()
start = time.perf_counter()
for _ in range({rounds}):
    work()
print(time.perf_counter() - start)
"""


def measure_contention(model: str, seed: int, threads: int, log, copies: int = 3, rounds: int = 8) -> dict:
    """shared_cpu_workers: the same engine work (an encode, a prefill, decode steps at batch 8) in one process
    alone, then in `copies` processes at once (a split engine's encoder, prefill and decode instance), each with
    `threads` threads. K = copies x time alone / time together: how many workers' worth of processor the
    machine has (K >= copies: they never slow each other down)."""
    code = PROBE.format(model=model, seed=seed, rounds=rounds)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}

    def run(n: int) -> float:
        procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
                 for _ in range(n)]
        return statistics.mean(float(p.communicate()[0].split()[-1]) for p in procs)

    alone, _ = quietly(lambda: run(1), log)
    together, _ = quietly(lambda: run(copies), log, busy_below=0.1)
    workers = copies * alone / together
    log(f"  the same work alone {alone:.2f} s, {copies} at once {together:.2f} s each: the processors hold "
        f"{workers:.2f} busy workers at full speed")
    return {"alone_s": alone, "together_s": together, "copies": copies, "threads": threads,
            "shared_cpu_workers": workers}


def measure(model: str, repeats: int, seed: int, threads: int, log, quick: bool = False) -> dict:
    rng = random.Random(seed)
    torch.set_num_threads(threads)
    wait_until_quiet(log)
    llm = LLM(model, num_preprocess_workers=0)  # the server's engine, preprocessing inline (timed apart)
    text = llm.model.config.text
    log(f"model {model}: {llm.model.device.type}, {llm.model.dtype}, {torch.get_num_threads()} threads")
    warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for _ in range(3):  # a process's first forwards are slow (allocations, thread pools, packing)
        run_alone(llm, image_prompt(llm, [random_image(224, 224, rng.randrange(2**31))]), warm)
    log("encode (vision tower, per request):")
    encode = measure_encode(llm, repeats, rng, log, *([QUICK["encode"]] if quick else []))
    log("prefill (one step per prompt):")
    prefill = measure_prefill(llm, repeats, rng, log, *([QUICK["prefill"]] if quick else []))
    log("decode (pure decode steps):")
    decode = measure_decode(llm, repeats, rng, log, **({"batches": QUICK["decode"]} if quick else {}))
    log("link (127.0.0.1, HTTP):")
    link = measure_link(llm, model, repeats, rng, log, **({"kv_prompt_words": 100} if quick else {}))
    llm.close()
    log(f"contention ({threads}-thread engine processes sharing this machine's cores):")
    contention = measure_contention(model, seed, threads, log, **({"rounds": 1} if quick else {}))
    costs = {
        "encode_s_per_visual_token": encode["encode_s_per_visual_token"],
        "encode_s_per_image": max(0.0, encode["encode_s_per_image"]),
        "prefill_s_per_token": prefill["prefill_s_per_token"],
        "step_overhead_s": max(0.0, prefill["step_overhead_s"]),
        "decode_s_per_step": max(0.0, decode["intercept_s"] - max(0.0, prefill["step_overhead_s"])),
        "decode_s_per_sequence": decode["decode_s_per_sequence"],
        "visual_bytes_per_token": text.hidden_size * llm.model.dtype.itemsize,
        "kv_bytes_per_token": kv_bytes_per_token(text.num_hidden_layers, text.num_key_value_heads, text.head_dim,
                                                 llm.model.dtype),
        "link_bytes_per_s": link["link_bytes_per_s"],
        "link_latency_s": link["link_latency_s"],
        "shared_cpu_workers": contention["shared_cpu_workers"],
    }
    return {"costs": costs, "encode": encode, "prefill": prefill, "decode": decode, "link": link,
            "contention": contention,
            "device": llm.model.device.type, "dtype": str(llm.model.dtype).removeprefix("torch."),
            "torch_threads": torch.get_num_threads()}


# -- the host's costs on the emulated device (--emulate): what the engine-faithful simulator adds ---------------

TWIN_DECODE_BATCHES = [1, 16, 48]
TWIN_TOPOLOGIES = ("integrated", "1e1pd", "1e1p1d")  # one of each shape: HostCosts keys its delays by shape
TWIN_MIX = "1x2240x2240:1,1x896x896:1,0x0x0:1"  # two picture sizes and text: the body's bytes vary widely


def twin_step_host(url: str, costs, log, batches=TWIN_DECODE_BATCHES, max_tokens: int = 64) -> dict:
    """An engine step's host work, as a served client sees it: b text requests sent at once decode together;
    their median TPOT less the cost model's time for a step of b decodes is the host's part, fitted as
    step_s + step_s_per_sequence x b."""
    rows, ys = [], []
    for b in batches:
        records = asyncio.run(load.run_load(url, "twin", load.parse_mix("0x0x0:1"), rate=1e6, num_requests=b,
                                            max_tokens=max_tokens, seed=b, content_seed=b))
        tpot = statistics.median(r.tpot_s for r in records if r.tpot_s is not None)
        context = statistics.median(r.prompt_tokens for r in records) + max_tokens // 2
        device = costs.device.step_seconds([(1, context)] * b)
        rows.append([1.0, float(b)])
        ys.append(tpot - device)
        log(f"  {b:>3} decoding: TPOT {tpot * 1e3:.2f} ms, device {device * 1e3:.2f} ms, host {ys[-1] * 1e3:.2f} ms")
    step_s, per_sequence = least_squares(rows, ys) if len(rows) > 1 else (ys[0], 0.0)
    return {"step_s": max(0.0, step_s), "step_s_per_sequence": max(0.0, per_sequence),
            "samples": [{"sequences": r[1], "host_s": y} for r, y in zip(rows, ys)]}


def twin_request_delay(topology: str, records: list[dict], costs, log, rounds: int = 4) -> dict:
    """A request's delay outside the engines in one topology, fitted as a + b x body bytes on TTFTs measured at a
    rate where little queues: each round simulates the same requests with the delay fitted so far and fits what
    is left (the delay changes the order in which requests reach the engine, so one round is not enough)."""
    key = HOST_KEYS[parse_topology(topology).shape]
    requests = requests_from_load({"records": records})
    measured = sorted((r for r in records if r["error"] is None), key=lambda r: r["sent_at"])
    rows = [[1.0, float(r["body_bytes"])] for r in measured]
    fixed = per_byte = 0.0
    for _ in range(rounds):
        costs.host.request_s[key], costs.host.request_s_per_byte[key] = fixed, per_byte
        simulated, _ = simulate_twin(topology, costs, requests)
        kept = [(row, (r["first_token_at"] - r["sent_at"]) - s[0]) for row, r, s in zip(rows, measured, simulated)
                if s is not None]  # a request the simulator failed (none should) has no TTFT to compare
        left = [y for _, y in kept]
        more_fixed, more_per_byte = trimmed_least_squares([row for row, _ in kept], left)
        fixed, per_byte = fixed + more_fixed, per_byte + more_per_byte
    costs.host.request_s[key], costs.host.request_s_per_byte[key] = fixed, per_byte  # the last round's too
    log(f"  {topology}: {fixed * 1e3:.1f} ms + {per_byte * 1e9:.1f} ms per MB of body ({len(left)} requests, "
        f"left before the last round's fit {statistics.median(abs(x) for x in left) * 1e3:.1f} ms median)")
    return {"request_s": fixed, "request_s_per_byte": per_byte,
            "samples": [{"body_bytes": row[1], "left_s": y} for row, y in kept]}


def measure_twin(emulate: str, log, quick: bool = False) -> dict:
    """HostCosts (nanomm/sim/twin.py) of `nanomm-serve --emulate`, each instance its own process."""
    from nanomm.emulate import load_configs, parse_emulate

    costs = TwinCosts.for_twin(emulate, HostCosts())
    vision = load_configs(parse_emulate(emulate)[1])[0].vision
    host, found = HostCosts(), {}
    for topology in (["integrated"] if quick else TWIN_TOPOLOGIES):
        commands, front = load.topology_commands(topology, ["--emulate", emulate], "twin", [])
        started = load.start_servers(commands, log)
        try:
            url = started[front][1]
            asyncio.run(load.run_load(url, "twin", load.parse_mix("1x448x448:1"), rate=1e6, num_requests=2,
                                      max_tokens=2, seed=0, content_seed=-1))  # warm-up
            if topology == "integrated":
                log("engine step (host):")
                found["step"] = twin_step_host(url, costs, log, [1, 4] if quick else TWIN_DECODE_BATCHES)
                host.step_s, host.step_s_per_sequence = found["step"]["step_s"], found["step"]["step_s_per_sequence"]
                costs.host = host
                log("request path (host), by topology:")
            records = asyncio.run(load.run_load(url, "twin", load.parse_mix(TWIN_MIX), rate=0.4 if not quick else 4,
                                                num_requests=6 if quick else 40, max_tokens=16, seed=1,
                                                content_seed=1, pictures="smooth"))
        finally:
            load.stop_servers(started)
        found[topology] = twin_request_delay(topology, [asdict(r) for r in records], costs, log)
        pictures = [(r.body_bytes, r.visual_tokens) for r in records if r.visual_tokens]
        pixels_per_token = (vision.patch_size * vision.spatial_merge_size) ** 2  # what a visual token's area is
        host.body_bytes_per_pixel = sum(b for b, _ in pictures) / sum(t * pixels_per_token for _, t in pictures)
    return {"host": asdict(host), "samples": found}


def add_cli_args(p: argparse.ArgumentParser) -> None:
    which = p.add_mutually_exclusive_group()
    which.add_argument("--demo", action="store_true", help="the trained demo model (the default)")
    which.add_argument("--checkpoint", help="a checkpoint folder (what `nanomm-bench load --checkpoint` serves)")
    p.add_argument("--repeats", type=int, default=3, help="runs per sample (the median is fitted)")
    p.add_argument("--threads", type=int, help="torch threads per engine (default: torch's, the cores); "
                   "what `nanomm-bench load --instance-threads` gives each instance")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="a smoke run: a few samples each, one repeat, no waiting "
                   "for a quiet machine")
    p.add_argument("--json", help="write the costs here (the simulator's --costs reads it)")
    p.add_argument("--emulate", metavar="GPU:MODEL", help="instead: the host's costs of nanomm-serve --emulate "
                   "(what the simulator's --host-costs reads), e.g. h200:qwen2-vl-2b")


def main(args) -> int:
    command = args.command_line
    machine = machine_info()
    print(f"command: {command}\nmachine: {machine['cpu']}, {machine['usable_cores']} cores, "
          f"{machine['memory_gib']} GiB, torch {machine['torch']}", flush=True)
    if args.emulate:
        result = measure_twin(args.emulate, lambda line: print(line, flush=True), args.quick)
        report = {**result["host"], "measured": result["samples"], "emulate": args.emulate, "machine": machine,
                  "command": command}
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=1))
        return 0
    if args.checkpoint:
        model = args.checkpoint
    else:
        from nanomm import demo_checkpoint
        model = str(demo_checkpoint())
    GUARD["on"] = not args.quick
    threads = args.threads or torch.get_num_threads()
    result = measure(model, 1 if args.quick else args.repeats, args.seed, threads,
                     lambda line: print(line, flush=True), args.quick)
    costs = result["costs"]
    print("StageCosts:")
    for name, value in costs.items():
        print(f"  {name:<26} {value:.4g}")
    report = {**costs, "measured": {k: v for k, v in result.items() if k != "costs"},
              "model": "demo" if not args.checkpoint else args.checkpoint, "machine": machine, "command": command}
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0
