"""Write tests/data/video/sampling.json: what transformers' whole processors make of a request's fps, num_frames
and do_sample_frames, for each of the three families, on a clip of 5 frames and one of 12.

Qwen2VLVideoProcessor (Qwen2-VL and Qwen2.5-VL) samples frames only when do_sample_frames is true (its default is
false), so an `fps` alone keeps every frame; Qwen3VLVideoProcessor samples by default (fps 2). The kwargs are passed
to the processor's call flat, as vLLM passes a request's mm_processor_kwargs, with the clip's own rate and
frame indices in video_metadata (what a decoded clip carries). Per case the fixture holds the kept frame indices,
sampled_fps, video_grid_thw, the expanded input_ids (the tiny tokenizer of nanomm's test checkpoints),
Qwen2.5-VL's second_per_grid_ts and the sha256 of pixel_values_videos. tests/test_video_sampling.py runs nanomm's
engine on the same frames and settings, checks all of it, and compares its greedy tokens with transformers' models
given these inputs.

The processors are built as for the fixtures of make_video_fixtures.py (Qwen2-VL, Qwen2.5-VL: AutoVideoProcessor
from the tiny checkpoints' preprocessor_config.json) and make_qwen3_video_fixtures.py (Qwen3-VL: the values of
Qwen3-VL's video_preprocessor_config.json). It needs torchvision, which the main environment must not have, so it
runs in a side environment with torch, torchvision, transformers 5.24, numpy and safetensors:

    /tmp/tvenv/bin/python scripts/workshop/make_video_sampling_fixtures.py
"""

import json
import tempfile
from pathlib import Path

from nanomm.tools.hf_files import preprocessor_config
from nanomm.tools.tokenizers import write_tiny_tokenizer
from nanomm.tools.weights import model_spec
from nanomm.workshop.video_fixtures import noise_frames, sha256, versions

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "tests" / "data" / "video" / "sampling.json"

QWEN3_VIDEO_CONFIG = {"fps": 2, "min_frames": 4, "max_frames": 768, "do_sample_frames": True,
                      "size": {"shortest_edge": 4096, "longest_edge": 25165824}, "patch_size": 16,
                      "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
                      "image_std": [0.5, 0.5, 0.5]}
PROMPT = "<|im_start|>user\n<|vision_start|><|video_pad|><|vision_end|>what happens?<|im_end|>\n<|im_start|>assistant\n"
# name: (seed, frames, the clip's fps, (height, width) for 28-px and for 32-px merged patches)
CLIPS = {"odd": (60, 5, 4.0, (56, 84), (64, 96)), "long": (61, 12, 8.0, (56, 168), (64, 192))}
ON = {"do_sample_frames": True}
# per family and clip: the request's mm_processor_kwargs
# (Qwen2VLVideoProcessor given do_sample_frames with neither a rate nor a count fails: a TypeError in sample_frames)
QWEN2_CASES = {"odd": [{}, {"fps": 2.0}, {"num_frames": 2}, {**ON, "fps": 2.0}, {**ON, "num_frames": 2}],
               "long": [{}, {"fps": 6.0}, {**ON, "fps": 6.0}, {**ON, "num_frames": 6}]}
QWEN3_CASES = {"odd": [{}, {"do_sample_frames": False}, {"fps": 4.0}, {"num_frames": 3},
                       {"do_sample_frames": False, "fps": 1.0}],
               "long": [{}, {"fps": 6.0}, {"num_frames": 5}, {"do_sample_frames": False}]}


def processors(tokenizer):
    """family -> (processor, its video processor, the cases)."""
    from transformers import (AutoVideoProcessor, Qwen2_5_VLProcessor, Qwen2VLImageProcessor, Qwen2VLProcessor,
                              Qwen3VLProcessor, Qwen3VLVideoProcessor)

    config = preprocessor_config(model_spec("tiny"), "old")  # what both checkpoints of the tests carry
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "preprocessor_config.json").write_text(json.dumps(config))
        qwen2_video = AutoVideoProcessor.from_pretrained(folder)
    assert type(qwen2_video).__name__ == "Qwen2VLVideoProcessor" and qwen2_video.do_sample_frames is False
    qwen3_video = Qwen3VLVideoProcessor(**QWEN3_VIDEO_CONFIG)
    images = Qwen2VLImageProcessor(**config)
    return {"qwen2_vl": (Qwen2VLProcessor(images, tokenizer, qwen2_video), qwen2_video, QWEN2_CASES),
            "qwen2_5_vl": (Qwen2_5_VLProcessor(images, tokenizer, qwen2_video), qwen2_video, QWEN2_CASES),
            "qwen3_vl": (Qwen3VLProcessor(Qwen2VLImageProcessor(patch_size=16), tokenizer, qwen3_video), qwen3_video,
                         QWEN3_CASES)}


def hf_kwargs(family: str, request: dict) -> dict:
    """The call's kwargs: the request's, and for Qwen3-VL with a count fps=None (its own fps 2 would clash)."""
    extra = {"fps": None} if family == "qwen3_vl" and "num_frames" in request else {}
    return {**request, **extra, "cap_pixels_per_frame": False}


def run_case(family, processor, video_processor, clip: str, request: dict) -> dict:
    seed, frames, fps, small, large = CLIPS[clip]
    video = noise_frames(seed, frames, *(large if family == "qwen3_vl" else small))
    metadata = {"fps": fps, "total_num_frames": frames, "frames_indices": list(range(frames))}
    kwargs = hf_kwargs(family, request)
    out = processor(text=[PROMPT], videos=[video], video_metadata=[dict(metadata)], return_tensors="pt", **kwargs)
    alone = video_processor(videos=[video], video_metadata=[dict(metadata)], return_metadata=True, **kwargs)
    pixel_values = out["pixel_values_videos"]
    assert (alone["pixel_values_videos"] == pixel_values).all()
    kept = alone["video_metadata"][0]
    case = {"family": family, "clip": clip, "mm_processor_kwargs": request, "hf_kwargs": kwargs, "seed": seed,
            "frames_thwc": list(video.shape), "frames_sha256": sha256(video), "fps": fps,
            "frames_indices": [int(i) for i in kept.frames_indices], "sampled_fps": kept.sampled_fps,
            "video_grid_thw": out["video_grid_thw"][0].tolist(), "input_ids": out["input_ids"][0].tolist(),
            "pixel_values_shape": list(pixel_values.shape), "pixel_values_sha256": sha256(pixel_values.numpy())}
    if "second_per_grid_ts" in out:
        case["second_per_grid_ts"] = [float(s) for s in out["second_per_grid_ts"]]
    return case


def main() -> None:
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as folder:
        write_tiny_tokenizer(Path(folder))
        tokenizer = AutoTokenizer.from_pretrained(folder)
    cases = []
    for family, (processor, video_processor, family_cases) in processors(tokenizer).items():
        for clip, requests in family_cases.items():
            for request in requests:
                case = run_case(family, processor, video_processor, clip, request)
                cases.append(case)
                print(f"{family} {clip} {request}: frames {case['frames_indices']}, grid {case['video_grid_thw']}"
                      + (f", second_per_grid_ts {case['second_per_grid_ts']}" if "second_per_grid_ts" in case else ""))
    meta = {"command": "/tmp/tvenv/bin/python scripts/workshop/make_video_sampling_fixtures.py",
            "processor": "processor(text=[prompt], videos=[frames], video_metadata=[{fps, total_num_frames, "
                         "frames_indices: 0..n-1}], return_tensors='pt', **hf_kwargs)",
            "frames": "numpy.random.default_rng(seed).integers(0, 256, frames_thwc, dtype=numpy.uint8)",
            "versions": versions(), "qwen3_video_config": QWEN3_VIDEO_CONFIG, "prompt": PROMPT, "cases": cases}
    OUT.write_text(json.dumps(meta, indent=1) + "\n")
    print(f"wrote {OUT.relative_to(ROOT)}: {len(cases)} cases")


if __name__ == "__main__":
    main()
