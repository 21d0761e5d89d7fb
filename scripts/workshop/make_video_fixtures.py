"""Write tests/data/video/: what transformers' own Qwen2VLVideoProcessor makes of a few seeded noise clips.

tests/test_video_processor.py feeds the same frames to nanomm.inputs.video and compares pixel_values and
video_grid_thw exactly. The processor is loaded the way transformers 5.24 loads it for a Qwen2-VL checkpoint
that ships no video_preprocessor_config.json: AutoVideoProcessor.from_pretrained on a folder holding the tiny
random checkpoint's preprocessor_config.json (nanomm.tools.hf_files.preprocessor_config, what make_checkpoint
writes), whose min_pixels / max_pixels then apply per frame. It is called with its defaults (no frame sampling),
and for the SAMPLED clips with do_sample_frames=True, the clip's rate in video_metadata and a rate or a count.

It needs torchvision, which the main environment must not have (it breaks transformers' Qwen2.5-VL import), so
it runs in a side environment with torch, torchvision, transformers 5.24, numpy and safetensors:

    /tmp/tvenv/bin/python scripts/workshop/make_video_fixtures.py

What it writes, kept small (the tests carry it):
  - qwen2_vl_video.json: the command, the versions, the preprocessor config, and per clip its seed and shape,
    the sha256 of its frames (the test regenerates the frames from the seed and checks them against it), the
    pixel cap of the call, HF's video_grid_thw, and the sha256 of HF's float32 pixel_values_videos.
  - qwen2_vl_video.safetensors: HF's pixel_values_videos, stored losslessly in a quarter of the bytes. The values
    come from uint8 pixels, so each channel holds at most 256 distinct floats: `<clip>.table` (C, 256) float32
    lists them per channel, `<clip>.codes` (rows, C, T*P*P) uint8 indexes them, and
    table[c, codes[:, c]] is HF's tensor exactly (checked here before writing, and by the test via the sha256).
"""

import json
import tempfile
from pathlib import Path

import torch

from nanomm.tools.hf_files import preprocessor_config
from nanomm.tools.weights import model_spec
from nanomm.workshop.video_fixtures import decode, encode, noise_frames, sha256, versions

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "tests" / "data" / "video"

# name: (seed, frames, height, width, (min_pixels, max_pixels) for the call or None for the checkpoint's)
CLIPS = {
    "noise16": (16, 16, 56, 84, None),  # no resize: 56x84 is already 2x3 blocks of 28
    "odd5": (5, 5, 56, 56, None),  # an odd count: the last frame is repeated
    "upscale": (75, 2, 75, 100, (3136, 28 * 28 * 16)),  # both sides grow: 75x100 -> 84x112
    "mixed": (40, 3, 40, 130, None),  # one side shrinks, one grows: 40x130 -> 28x140 (torch and PIL differ most)
    "downscale": (70, 2, 70, 90, (3136, 3136)),  # both shrink under the cap: 70x90 -> 28x56
}
# Frame sampling, which the processor runs only when asked (do_sample_frames=True): name -> (seed, frames, height,
# width, the clip's fps, the call's sampling settings)
SAMPLED = {
    "rate": (80, 30, 28, 56, 10.0, {"fps": 2}),  # 3 s at 10 fps, 2 a second: 6 frames, every fifth
    "count": (81, 17, 28, 28, 24.0, {"num_frames": 5}),  # rounded to whole temporal patches: 4 frames
    "min_frames": (82, 9, 28, 28, 30.0, {"fps": 2}),  # 0.3 s: min_frames (4) wins over the rate
}


def main() -> None:
    from transformers import AutoVideoProcessor

    config = preprocessor_config(model_spec("tiny"), "old")
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "preprocessor_config.json").write_text(json.dumps(config))
        processor = AutoVideoProcessor.from_pretrained(folder)
    assert type(processor).__name__ == "Qwen2VLVideoProcessor", type(processor)
    assert processor.do_sample_frames is False

    tensors, clips = {}, {}
    for name, (seed, frames, height, width, cap) in CLIPS.items():
        video = noise_frames(seed, frames, height, width)
        kwargs = {} if cap is None else {"size": {"shortest_edge": cap[0], "longest_edge": cap[1]}}
        out = processor(videos=[video], return_tensors="pt", **kwargs)
        pixel_values, grid = out["pixel_values_videos"], out["video_grid_thw"]
        assert pixel_values.dtype == torch.float32 and grid.shape == (1, 3)
        table, codes = encode(pixel_values, channels=3)
        assert torch.equal(decode(table, codes), pixel_values)  # lossless, bit for bit
        tensors[f"{name}.table"], tensors[f"{name}.codes"] = table, codes
        min_pixels, max_pixels = cap or (config["min_pixels"], config["max_pixels"])
        clips[name] = {"seed": seed, "frames_thwc": list(video.shape), "frames_sha256": sha256(video),
                       "min_pixels": min_pixels, "max_pixels": max_pixels, "video_grid_thw": grid[0].tolist(),
                       "pixel_values_shape": list(pixel_values.shape),
                       "pixel_values_sha256": sha256(pixel_values.numpy())}
        print(f"{name}: {video.shape} -> grid {grid[0].tolist()}, pixel_values {tuple(pixel_values.shape)}")

    for name, (seed, frames, height, width, fps, sampling) in SAMPLED.items():
        video = noise_frames(seed, frames, height, width)
        out = processor(videos=[video], video_metadata=[{"fps": fps, "total_num_frames": frames}],
                        do_sample_frames=True, return_metadata=True, return_tensors="pt", **sampling)
        pixel_values, grid = out["pixel_values_videos"], out["video_grid_thw"]
        table, codes = encode(pixel_values, channels=3)
        assert torch.equal(decode(table, codes), pixel_values)
        tensors[f"{name}.table"], tensors[f"{name}.codes"] = table, codes
        indices = [int(i) for i in out["video_metadata"][0].frames_indices]
        clips[name] = {"seed": seed, "frames_thwc": list(video.shape), "frames_sha256": sha256(video), "fps": fps,
                       "sampling": sampling, "frames_indices": indices,
                       "sampled_fps": out["video_metadata"][0].sampled_fps, "min_pixels": config["min_pixels"],
                       "max_pixels": config["max_pixels"], "video_grid_thw": grid[0].tolist(),
                       "pixel_values_shape": list(pixel_values.shape),
                       "pixel_values_sha256": sha256(pixel_values.numpy())}
        print(f"{name}: {video.shape} @ {fps} fps {sampling} -> frames {indices}, grid {grid[0].tolist()}")

    from safetensors.torch import save_file
    OUT.mkdir(parents=True, exist_ok=True)
    save_file(tensors, OUT / "qwen2_vl_video.safetensors")
    meta = {
        "command": "/tmp/tvenv/bin/python scripts/workshop/make_video_fixtures.py",
        "processor": f"transformers.{type(processor).__name__} via AutoVideoProcessor.from_pretrained(folder with "
                     "only preprocessor_config.json), called as processor(videos=[frames], return_tensors='pt') "
                     "plus size={shortest_edge, longest_edge} where a clip has its own pixel cap",
        "frames": "numpy.random.default_rng(seed).integers(0, 256, frames_thwc, dtype=numpy.uint8)",
        "versions": versions(),
        "preprocessor_config": config,
        "processor_size": dict(processor.size),
        "clips": clips,
    }
    (OUT / "qwen2_vl_video.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(f"wrote {OUT.relative_to(ROOT)}/qwen2_vl_video.{{json,safetensors}}")


if __name__ == "__main__":
    main()
