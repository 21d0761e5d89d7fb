"""Time to first token with the caches, and the preprocessing worker pool, on the benchmark checkpoint.

    python scripts/bench_cache.py                    # preset "small" (~100M params), CPU
    python scripts/bench_cache.py --json cache.json

Three measurements, each a ratio taken in one run on one machine (results in BENCHMARKS.md):
  encoder cache   a request whose 448x448 image is already in the encoder cache, with *different* text before the
                  image (so the prefix cache cannot help), against the same request with a never-seen image of
                  the same size: median TTFT warm / cold.
  two-turn chat   the second turn of a chat about one image (prefix cache + encoder cache) against the same
                  prompt sent to an engine that has never seen it: median TTFT turn 2 / cold.
  worker pool     16 requests with 2000x1500 JPEG files, streamed through the engine (add_request, then step until
                  all finish), with images decoded and resized by the worker pool against inline in add_request:
                  wall time inline / pool. (LLM.generate preprocesses every prompt before any compute, so the
                  pool only parallelises there; the streaming path is where decoding overlaps model steps.)
Benchmarks are not tests: nothing asserts a timing.
"""

import argparse
import io
import json
import statistics
import sys
import time
from pathlib import Path


from nanomm.bench.machine import add_device_args, machine_info
from nanomm.bench.requests import chat_prompt, load_checkpoint, random_image
from rich.console import Console

from nanomm import LLM, SamplingParams
from nanomm.inputs.tokenizer import IMAGE_PLACEHOLDER

FIRST_TOKEN = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)


def other_system_prompt(text: str, images) -> dict:
    """The same user turn under a different system prompt: the token ids differ before the image."""
    prompt = (f"<|im_start|>system\nYou are a terse assistant who answers in one line.<|im_end|>\n"
              f"<|im_start|>user\n{IMAGE_PLACEHOLDER * len(images)}{text}<|im_end|>\n<|im_start|>assistant\n")
    return {"prompt": prompt, "multi_modal_data": {"image": list(images)}}


def new_engine(folder, device: dict, **kwargs) -> LLM:
    """device: {"device": ..., "dtype": ...} from the command line."""
    llm = LLM(str(folder), **device, max_pixels=448 * 448, **kwargs)
    llm.generate(chat_prompt("warm up", [random_image(64, 64, 999)]), FIRST_TOKEN)  # one-time kernel setup
    return llm


def ttft(llm: LLM, prompt) -> tuple[float, object]:
    out = llm.generate(prompt, FIRST_TOKEN)[0]
    return out.metrics.ttft_s, out.metrics


def encoder_cache_ratio(folder, repeats: int, device: dict) -> dict:
    llm = new_engine(folder, device)
    question = "What is in this picture, and what colours dominate it?"
    cold, warm, cached_tokens, hits = [], [], [], []
    for k in range(repeats):
        cold.append(ttft(llm, other_system_prompt(question, [random_image(448, 448, 100 + k)]))[0])
        seen = random_image(448, 448, 200 + k)
        llm.generate(chat_prompt(question, [seen]), FIRST_TOKEN)  # puts the image in the encoder cache
        t, m = ttft(llm, other_system_prompt(question, [seen]))
        warm.append(t)
        cached_tokens.append(m.num_cached_tokens)
        hits.append(m.encoder_cache_hits)
    return dict(cold_ttft_s=cold, warm_ttft_s=warm, ratio=statistics.median(warm) / statistics.median(cold),
                prefix_cached_tokens=cached_tokens, encoder_cache_hits=hits)


def two_turn_ratio(folder, repeats: int, device: dict) -> dict:
    llm = new_engine(folder, device)
    turn2_times, cold_times, cached = [], [], []
    for k in range(repeats):
        image = random_image(448, 448, 300 + k)
        turn1 = [{"role": "user", "content": [{"type": "image", "image": image},
                                              {"type": "text", "text": "Describe this picture."}]}]
        reply = llm.chat(turn1, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0].outputs[0].text
        turn2 = turn1 + [{"role": "assistant", "content": reply}, {"role": "user", "content": "And the colours?"}]
        out = llm.chat(turn2, FIRST_TOKEN)[0]
        turn2_times.append(out.metrics.ttft_s)
        cached.append(out.metrics.num_cached_tokens)
        fresh = new_engine(folder, device)  # has never seen this image or this conversation
        cold_times.append(fresh.chat(turn2, FIRST_TOKEN)[0].metrics.ttft_s)
    return dict(turn2_ttft_s=turn2_times, cold_ttft_s=cold_times, prefix_cached_tokens=cached,
                ratio=statistics.median(turn2_times) / statistics.median(cold_times))


def jpeg_files(folder: Path, count: int) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for k in range(count):
        path = folder / f"photo{k}.jpg"
        if not path.exists():
            buffer = io.BytesIO()
            random_image(2000, 1500, 400 + k).save(buffer, format="JPEG", quality=90)
            path.write_bytes(buffer.getvalue())
        paths.append(path)
    return paths


def stream_all(llm: LLM, prompts, params) -> float:
    start = time.perf_counter()
    for prompt in prompts:
        llm.engine.add_request(prompt, params)
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    return time.perf_counter() - start


def worker_pool_ratio(folder, files: list[Path], workers: int, max_tokens: int, device: dict) -> dict:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    prompts = [chat_prompt(f"Photo {k}: what is in it?", [str(path)]) for k, path in enumerate(files)]
    times = {}
    for name, n in (("inline", 0), ("pool", workers)):
        # A fresh engine for each run: nothing cached from the other run.
        times[name] = stream_all(new_engine(folder, device, num_preprocess_workers=n), prompts, params)
    return dict(inline_s=times["inline"], pool_s=times["pool"], workers=workers, requests=len(files),
                max_tokens=max_tokens, ratio=times["inline"] / times["pool"])


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", help="a local Qwen2-VL folder; default: the benchmark's 'small' preset")
    p.add_argument("--preset", default="small")
    p.add_argument("--cache-dir", default="checkpoints/bench-small")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--workers", type=int, default=2, help="num_preprocess_workers for the pool run")
    p.add_argument("--jpeg-requests", type=int, default=16)
    p.add_argument("--jpeg-max-tokens", type=int, default=16)
    p.add_argument("--json", help="write every number to this file")
    add_device_args(p)
    args = p.parse_args(argv)
    device = dict(device=args.device, dtype=args.dtype)
    console = Console()
    console.print(f"command: python {' '.join(sys.argv)}")
    console.print(f"machine: {machine_info()}")
    folder = load_checkpoint(args, console.print)
    results = dict(machine=machine_info(), checkpoint=str(folder))
    results["encoder_cache"] = encoder_cache_ratio(folder, args.repeats, device)
    console.print(f"encoder cache: TTFT warm / cold = {results['encoder_cache']['ratio']:.2f} "
                  f"(median of {args.repeats}; prefix-cached tokens {results['encoder_cache']['prefix_cached_tokens']})")
    results["two_turn"] = two_turn_ratio(folder, args.repeats, device)
    console.print(f"two-turn chat: TTFT turn 2 / cold = {results['two_turn']['ratio']:.2f} "
                  f"(prefix-cached tokens {results['two_turn']['prefix_cached_tokens']})")
    files = jpeg_files(Path(args.cache_dir) / "jpegs", args.jpeg_requests)
    results["worker_pool"] = worker_pool_ratio(folder, files, args.workers, args.jpeg_max_tokens, device)
    wp = results["worker_pool"]
    console.print(f"worker pool: {wp['requests']} x 2000x1500 JPEG, {wp['max_tokens']} tokens each: inline "
                  f"{wp['inline_s']:.2f} s, pool ({wp['workers']} workers) {wp['pool_s']:.2f} s, "
                  f"inline / pool = {wp['ratio']:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2, default=str))
    return results


if __name__ == "__main__":
    main()
