"""What EVS-style pruning (inputs/video_pruning.py) costs the demo model's answers, on clips drawn here (lesson 17).

    python scripts/video_pruning.py --items 40 --json lessons/data/17-pruning.json

Each item is a held-out scene of the demo model's tasks whose answer does not depend on where things are (colour,
shape, count, number), made into an 8-frame clip at 2 frames a second, two ways:

  - static: the same scene in every frame, each frame with its own sensor noise (a camera on a tripod);
  - moving: every shape drifts across the frame and back, a few pixels a frame, over its own noise.

Each clip is asked its question at each pruning rate. Reported per motion and rate: the visual tokens of a clip,
the accuracy (graded against the scene), and how often the answer is the unpruned one's. The demo model was trained
on still pictures only: a still picture is a temporal patch whose two frames are the same, so it reads a clip's
patches as pictures, and these numbers measure what pruning takes from it, not a video skill it has.
"""

import argparse
import copy
import json
import math
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from nanomm import LLM, SamplingParams, demo_checkpoint
from nanomm.demo.evaluation import held_out_items
from nanomm.demo.scenes import render
from nanomm.demo.tasks import grade
from nanomm.inputs.video_io import VideoInput

TASKS = ("colour", "shape", "count", "number")  # answers that motion does not change
RATES = (0.0, 0.25, 0.5, 0.75, 0.9)
FRAMES, FPS = 8, 2.0
GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


def clip(scene, motion: str, seed: int) -> VideoInput:
    """FRAMES frames of the scene: still, or with every shape drifting sideways and back (kept inside the frame)."""
    frames = []
    for f in range(FRAMES):
        moved = copy.deepcopy(scene)
        if motion == "moving":
            for shape in moved.shapes:
                room = max(0.0, min(shape.x - shape.radius, scene.width - shape.x - shape.radius))
                shape.x += min(room, 24.0) * math.sin(2 * math.pi * f / FRAMES)
        frames.append(render(moved, random.Random(f"nanomm-video-pruning/{seed}/{f}")))
    return VideoInput(tuple(frames), FPS)


def conversation(video: VideoInput, question: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "video", "video": video}, {"type": "text", "text": question}]}]


def measure(llm, items: list, motion: str) -> list[dict]:
    """Per rate: tokens per clip, accuracy, agreement with the unpruned answers."""
    chats = [conversation(clip(item.scenes[0], motion, i), item.turns[-1].question) for i, item in enumerate(items)]
    rows, unpruned = [], None
    for rate in RATES:
        outputs = llm.chat(chats, GREEDY, use_tqdm=False, mm_processor_kwargs={"video_pruning_rate": rate})
        answers = [out.outputs[0].text for out in outputs]
        unpruned = unpruned or answers
        rows.append({"motion": motion, "pruning_rate": rate,
                     "visual_tokens": sum(out.metrics.num_visual_tokens for out in outputs) / len(items),
                     "right": sum(grade(item.turns[-1], a) for item, a in zip(items, answers)),
                     "same_as_unpruned": sum(a == b for a, b in zip(answers, unpruned)), "items": len(items)})
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--items", type=int, default=40, help="held-out items per task")
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args(argv)
    items = [item for task in TASKS for item in held_out_items(task, args.items, seed=17)]
    with LLM(str(demo_checkpoint()), device="cpu", dtype="float32") as llm:
        rows = [row for motion in ("static", "moving") for row in measure(llm, items, motion)]
    print("| motion | pruning rate | visual tokens per clip | accuracy | same answer as unpruned |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['motion']} | {r['pruning_rate']:.2f} | {r['visual_tokens']:.0f} | "
              f"{r['right'] / r['items']:.1%} | {r['same_as_unpruned'] / r['items']:.1%} |")
    if args.json:
        args.json.write_text(json.dumps({"command": "python scripts/video_pruning.py --items "
                                                    f"{args.items} --json {args.json}", "frames": FRAMES,
                                         "fps": FPS, "tasks": TASKS, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
