"""What the benchmarks send: random pictures and words, chat prompts, workloads, and the checkpoint they run on.

Lesson: lessons/11-serving-under-load.md.
"""

import argparse
import json
import random
from pathlib import Path

import torch
from PIL import Image

from nanomm import LLM, SamplingParams
from nanomm.inputs.tokenizer import IMAGE_PLACEHOLDER
from nanomm.tools.random_checkpoint import make_checkpoint
from nanomm.tools.weights import PRESETS

WORDS = ("the a cat dog sat on mat and looked at picture of red blue green house tree sky river boat "
         "mountain city street window small large old new bright dark quickly slowly under over").split()


def random_image(width: int, height: int, seed: int) -> Image.Image:
    """Uniform noise: every patch is different, so nothing about the image is cheaper than a real photo."""
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), dtype=torch.uint8, generator=g)
    return Image.frombytes("RGB", (width, height), pixels.numpy().tobytes())


def chat_prompt(text: str, images=(), mm_kwargs=None):
    """A Qwen2-VL user turn with the images first, as the chat template renders it."""
    body = IMAGE_PLACEHOLDER * len(images) + text
    prompt = (f"<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n{body}<|im_end|>\n"
              f"<|im_start|>assistant\n")
    if not images:
        return prompt
    out = {"prompt": prompt, "multi_modal_data": {"image": list(images)}}
    if mm_kwargs:
        out["mm_processor_kwargs"] = dict(mm_kwargs)
    return out


def make_workload(seed: int, num: int, images: tuple[int, int], size: tuple[int, int], words: tuple[int, int],
                  alternate: bool = False, mm_kwargs=None) -> list:
    """`num` prompts; image count in [images] (alternating 0/1 when `alternate`), side lengths in [size],
    text of [words] words. Everything is drawn from one seeded RNG, so a workload is the same on every run."""
    rng = random.Random(seed)
    prompts = []
    for i in range(num):
        n_images = i % 2 if alternate else rng.randint(*images)
        imgs = [random_image(rng.randint(*size), rng.randint(*size), seed * 100_003 + i * 10 + j)
                for j in range(n_images)]
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(*words)))
        prompts.append(chat_prompt(text, imgs, mm_kwargs))
    return prompts


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def add_all(engine, prompts: list, sampling: SamplingParams, prefix: str) -> list[str]:
    """Prepare every prompt, then add them all (admitted at once, as in generate); their request ids."""
    prepared = engine.prepare_all(prompts, [sampling] * len(prompts))
    return [engine.add_request(p, sampling, request_id=f"{prefix}-{i}", prepared=pp)
            for i, (p, pp) in enumerate(zip(prompts, prepared))]


def abort_all(engine, request_ids: list[str]) -> None:
    """Abort the requests and step until the engine has given everything back."""
    for request_id in request_ids:
        engine.abort_request(request_id)
    while engine.has_unfinished_requests():
        engine.step()


def load_checkpoint(args, log) -> Path:
    if args.checkpoint:
        return Path(args.checkpoint)
    folder = Path(args.cache_dir)
    marker = folder / "bench_checkpoint.json"  # written last: a folder without it is incomplete
    want = {"preset": args.preset, "seed": 0}
    if not marker.exists() or json.loads(marker.read_text()) != want:
        log(f"generating the random '{args.preset}' checkpoint in {folder} ...")
        make_checkpoint(folder, preset=args.preset)
        marker.write_text(json.dumps(want))
    return folder


def warm_up(llm: LLM) -> list:
    """A tiny generate first (first-call allocations, thread pools); returns its prompts, for transformers'."""
    prompts = make_workload(12345, 2, (0, 1), (56, 84), (4, 8), alternate=True)
    llm.generate(prompts, greedy(4))
    return prompts



def add_workload_args(p) -> None:
    """The checkpoint and the three offline workloads (decode, prefill, burst) of scripts/bench.py, which other
    measurements reuse (`workload_args`)."""
    src = p.add_argument_group("checkpoint")
    src.add_argument("--checkpoint", help="a local Qwen2-VL folder (HF layout); overrides --preset")
    src.add_argument("--preset", choices=list(PRESETS), default="small", help="random checkpoint to generate")
    src.add_argument("--cache-dir", default="checkpoints/bench-small", help="where the preset is generated once")
    w = p.add_argument_group("workloads")
    w.add_argument("--workload", choices=["decode", "prefill", "both", "burst"], default="both")
    w.add_argument("--num-requests", type=int, default=32, help="decode workload: requests")
    w.add_argument("--max-tokens", type=int, default=128, help="decode workload: output tokens per request")
    w.add_argument("--max-pixels", type=int, default=28 * 28 * 64, help="decode workload: per-prompt pixel cap")
    w.add_argument("--prefill-num-requests", type=int, default=32)
    w.add_argument("--prefill-max-tokens", type=int, default=8)
    w.add_argument("--prefill-max-pixels", type=int, default=28 * 28 * 256,
                   help="prefill workload: per-prompt pixel cap (mm_processor_kwargs), larger images")
    w.add_argument("--burst-num-requests", type=int, default=32, help="burst workload: requests arriving at once")
    w.add_argument("--burst-image-side", type=int, default=896, help="burst workload: each picture's side, px")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--quick", action="store_true", help="smoke run: few requests, few tokens, small sizes")


def shape_workloads(p, args):
    """The words and pictures per prompt, and --quick's smaller defaults (flags given explicitly still win)."""
    args.decode_words, args.prefill_words, args.prefill_images = (8, 64), (200, 500), (1, 3)
    if args.quick:
        args.prefill_words, args.prefill_images = (40, 80), (1, 2)
        quick = dict(num_requests=4, max_tokens=8, prefill_num_requests=4, prefill_max_tokens=2, burst_num_requests=4,
                     burst_image_side=112)
        for key, value in quick.items():
            if getattr(args, key) == p.get_default(key):
                setattr(args, key, value)
    return args


def workload_args(argv=None):
    """scripts/bench.py's checkpoint and workload arguments alone, for measurements that reuse its workloads."""
    p = argparse.ArgumentParser(add_help=False)
    add_workload_args(p)
    return shape_workloads(p, p.parse_args(argv))


def workloads(args) -> dict[str, dict]:
    out = {}
    if args.workload in ("decode", "both"):
        out["decode"] = dict(
            prompts=make_workload(args.seed, args.num_requests, (0, 1), (56, 224), args.decode_words, alternate=True,
                                  mm_kwargs={"max_pixels": args.max_pixels}),
            max_tokens=args.max_tokens)
    if args.workload in ("prefill", "both"):
        out["prefill"] = dict(
            prompts=make_workload(args.seed + 1, args.prefill_num_requests, args.prefill_images, (224, 448),
                                  args.prefill_words, mm_kwargs={"max_pixels": args.prefill_max_pixels}),
            max_tokens=args.prefill_max_tokens)
    if args.workload == "burst":
        side = args.burst_image_side
        out["burst"] = dict(prompts=[chat_prompt(f"Describe picture {i} in one line.", [random_image(side, side, i)],
                                                 {"max_pixels": side * side}) for i in range(args.burst_num_requests)],
                            max_tokens=args.prefill_max_tokens)
    return out
