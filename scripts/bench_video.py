"""A clip's time to first token, its longest step and the process's peak memory, encoded whole or patch by patch.

    python scripts/bench_video.py --frames 16 64 256 --json video.json

The engine encodes a video one temporal patch at a time, as prefill reaches it (inputs/prompt.py splits each clip
into its patches). How many it encodes in one step is the encoder budget (`max_num_encoder_tokens`) and the token
budget of the step. "whole": both budgets hold the whole clip, so the first step encodes every frame and prefills
the whole prompt, as an engine that encodes a video before its first chunk does. "streamed": 512-token steps, so a
step encodes only the patches its chunk reaches. Each run is a process of its own (the random `2b-shaped`
checkpoint: Qwen2-VL-2B's widths, one text layer and one vision block), so that its peak resident memory (VmHWM)
is its own; the table shows it above the process's resident memory just before the request. Lesson 17.
"""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

BUDGETS = {"whole": None, "streamed": 512}  # tokens per step (and visual tokens encoded per step); None: the clip


def memory_kib(field: str) -> int:
    """VmRSS or VmHWM of this process, in KiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def one_run(checkpoint: str, frames: int, mode: str, side: int) -> dict:
    """In this process: one clip of `frames` frames through a fresh engine; its TTFT, longest step, peak memory."""
    import numpy as np

    from nanomm import LLM, SamplingParams

    clip = np.random.default_rng(frames).integers(0, 256, (frames, side, side, 3), dtype=np.uint8)
    tokens = frames // 2 * (side // 28) ** 2 + 64
    budget = BUDGETS[mode] or tokens
    with LLM(checkpoint, device="cpu", dtype="float32", max_model_len=tokens + 64, num_preprocess_workers=0,
             max_num_batched_tokens=budget, max_num_encoder_tokens=budget, enable_prefix_caching=False) as llm:
        prompt = {"prompt": "<|vision_start|><|video_pad|><|vision_end|>What happens?",
                  "multi_modal_data": {"video": clip}}
        llm.generate(["warm up"], SamplingParams(max_tokens=2), use_tqdm=False)
        before, steps, first_token_step, final = memory_kib("VmRSS"), [], None, None
        llm.engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
        while llm.engine.has_unfinished_requests():
            start = time.perf_counter()
            outputs = llm.engine.step()
            steps.append(time.perf_counter() - start)
            if outputs and first_token_step is None:
                first_token_step = len(steps)
            final = next((o for o in outputs if o.finished), final)
        m = final.metrics
        return {"frames": frames, "mode": mode, "visual_tokens": m.num_visual_tokens, "ttft_s": m.ttft_s,
                "encode_s": m.encode_s, "prefill_s": m.prefill_s, "steps_to_first_token": first_token_step,
                "longest_step_s": max(steps[:first_token_step]),
                "peak_over_rss_mib": (memory_kib("VmHWM") - before) / 1024}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--frames", type=int, nargs="+", default=[16, 64, 256])
    p.add_argument("--side", type=int, default=224, help="frame width and height in pixels")
    p.add_argument("--preset", default="2b-shaped"), p.add_argument("--cache-dir", default="checkpoints/bench-2b-shaped")
    p.add_argument("--checkpoint"), p.add_argument("--json")
    p.add_argument("--one", nargs=2, metavar=("FRAMES", "MODE"), help=argparse.SUPPRESS)  # a child process's run
    args = p.parse_args(argv)
    from nanomm.bench.machine import machine_info
    from nanomm.bench.requests import load_checkpoint

    checkpoint = str(load_checkpoint(args, print))
    if args.one:
        print(json.dumps(one_run(checkpoint, int(args.one[0]), args.one[1], args.side)))
        return 0
    rows = []
    for frames in args.frames:
        for mode in BUDGETS:
            child = [sys.executable, __file__, "--one", str(frames), mode, "--side", str(args.side),
                     "--checkpoint", checkpoint]
            rows.append(json.loads(subprocess.run(child, capture_output=True, text=True, check=True).stdout
                                   .strip().splitlines()[-1]))
            r = rows[-1]
            print(f"{frames:4} frames, {mode:8}: {r['visual_tokens']:6,} visual tokens, TTFT {r['ttft_s']:.2f} s "
                  f"(encode {r['encode_s']:.2f} s) in {r['steps_to_first_token']} steps, longest step "
                  f"{r['longest_step_s']:.2f} s, peak {r['peak_over_rss_mib']:,.0f} MiB over the resident memory",
                  flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"command": "scripts/bench_video.py " + " ".join(argv or sys.argv[1:]),
                                               "machine": machine_info(), "preset": args.preset, "side": args.side,
                                               "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
