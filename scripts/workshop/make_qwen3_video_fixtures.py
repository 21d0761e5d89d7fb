"""Write tests/data/video/qwen3_vl_video.*: what transformers' own Qwen3VLProcessor makes of a few seeded clips.

Qwen3-VL's video processor differs from Qwen2-VL's in three ways that change the prompt and the pixels: it samples
frames (2 a second by default, between min_frames and max_frames), it caps the pixels of the whole clip rather than
of each frame, and it writes each temporal patch's time into the prompt. So the fixture holds the whole processor's
output for a prompt with one video: the expanded input_ids (with the tiny tokenizer that nanomm's test checkpoints
carry), video_grid_thw, the kept frame indices, the timestamps, and pixel_values_videos (stored losslessly as in
make_video_fixtures.py). tests/test_video_processor.py runs nanomm's engine on the same frames and compares.

The processor is transformers 5.24's Qwen3VLProcessor with a Qwen3VLVideoProcessor built with Qwen3-VL's
video_preprocessor_config.json values (fps 2, min_frames 4, max_frames 768, size 4096..25165824, 16-px patches,
mean and std 0.5); a clip's own settings are passed to the call. It needs torchvision, which the main environment
must not have, so it runs in a side environment with torch, torchvision, transformers 5.24, numpy and safetensors:

    /tmp/tvenv/bin/python scripts/workshop/make_qwen3_video_fixtures.py
"""

import json
import tempfile
from pathlib import Path

import torch

from nanomm.tools.tokenizers import write_tiny_tokenizer
from nanomm.workshop.video_fixtures import decode, encode, noise_frames, sha256, versions

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "tests" / "data" / "video"

VIDEO_CONFIG = {"fps": 2, "min_frames": 4, "max_frames": 768, "do_sample_frames": True,
                "size": {"shortest_edge": 4096, "longest_edge": 25165824}, "patch_size": 16, "temporal_patch_size": 2,
                "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}
PROMPT = "<|im_start|>user\n<|vision_start|><|video_pad|><|vision_end|>what happens?<|im_end|>\n<|im_start|>assistant\n"
# name: (seed, frames, height, width, the clip's fps, the call's settings as nanomm's mm_processor_kwargs names)
CLIPS = {
    "sampled": (1, 48, 64, 96, 24.0, {}),  # 2 s at 24 fps -> 4 frames: 0, 16, 31, 47
    "odd": (2, 10, 64, 64, 4.0, {}),  # 2.5 s at 4 fps -> 5 frames, the last repeated
    "few": (3, 3, 32, 64, 30.0, {}),  # 0.1 s: min_frames 4, but only 3 exist
    "budget": (4, 8, 200, 300, 2.0, {"video_max_pixels": 8 * 32 * 32 * 6}),  # the clip's budget shrinks each frame
    "narrow": (5, 4, 20, 90, 2.0, {}),  # a side under 32 px is scaled up first
    "count": (6, 20, 48, 80, 10.0, {"num_frames": 6}),  # a frame count instead of a rate
    "rate": (7, 30, 64, 64, 10.0, {"fps": 4}),  # another rate: 12 frames of 30
}


def hf_kwargs(settings: dict) -> dict:
    kwargs = {}
    for key, value in settings.items():
        if key == "video_max_pixels":
            kwargs["size"] = {"shortest_edge": VIDEO_CONFIG["size"]["shortest_edge"], "longest_edge": value}
        else:
            kwargs[key] = value
    if "num_frames" in settings:  # the processor's own fps (2) would otherwise clash with it
        kwargs["fps"] = None
    return kwargs


def main() -> None:
    from transformers import AutoTokenizer, Qwen2VLImageProcessor, Qwen3VLProcessor, Qwen3VLVideoProcessor

    with tempfile.TemporaryDirectory() as folder:
        write_tiny_tokenizer(Path(folder))
        tokenizer = AutoTokenizer.from_pretrained(folder)
    video_processor = Qwen3VLVideoProcessor(**VIDEO_CONFIG)
    processor = Qwen3VLProcessor(image_processor=Qwen2VLImageProcessor(patch_size=16), tokenizer=tokenizer,
                                 video_processor=video_processor)
    tensors, clips = {}, {}
    for name, (seed, frames, height, width, fps, settings) in CLIPS.items():
        video = noise_frames(seed, frames, height, width)
        out = processor(text=[PROMPT], videos=[video], video_metadata=[{"fps": fps, "total_num_frames": frames}],
                        return_tensors="pt", videos_kwargs={"return_metadata": True, "cap_pixels_per_frame": False,
                                                            **hf_kwargs(settings)})
        pixel_values, grid = out["pixel_values_videos"], out["video_grid_thw"]
        alone = video_processor(videos=[video], video_metadata=[{"fps": fps, "total_num_frames": frames}],
                                return_metadata=True, cap_pixels_per_frame=False, **hf_kwargs(settings))
        assert torch.equal(alone["pixel_values_videos"], pixel_values)
        metadata = alone["video_metadata"][0]
        indices = [int(i) for i in metadata.frames_indices]
        timestamps = processor._calculate_timestamps(list(indices), metadata.fps, video_processor.temporal_patch_size)
        table, codes = encode(pixel_values, channels=3)
        assert torch.equal(decode(table, codes), pixel_values)
        tensors[f"{name}.table"], tensors[f"{name}.codes"] = table, codes
        clips[name] = {"seed": seed, "frames_thwc": list(video.shape), "frames_sha256": sha256(video), "fps": fps,
                       "mm_processor_kwargs": settings, "frames_indices": indices, "timestamps": timestamps,
                       "video_grid_thw": grid[0].tolist(), "input_ids": out["input_ids"][0].tolist(),
                       "pixel_values_shape": list(pixel_values.shape),
                       "pixel_values_sha256": sha256(pixel_values.numpy())}
        print(f"{name}: {video.shape} @ {fps} fps {settings} -> frames {indices}, grid {grid[0].tolist()}, "
              f"times {[round(t, 3) for t in timestamps]}")

    from safetensors.torch import save_file
    save_file(tensors, OUT / "qwen3_vl_video.safetensors")
    meta = {
        "command": "/tmp/tvenv/bin/python scripts/workshop/make_qwen3_video_fixtures.py",
        "processor": "transformers.Qwen3VLProcessor(Qwen2VLImageProcessor(patch_size=16), the tiny tokenizer, "
                     "Qwen3VLVideoProcessor(**video_config)), called as processor(text=[prompt], videos=[frames], "
                     "video_metadata=[{fps, total_num_frames}], return_tensors='pt', videos_kwargs={return_metadata: "
                     "True, cap_pixels_per_frame: False, plus the clip's settings})",
        "frames": "numpy.random.default_rng(seed).integers(0, 256, frames_thwc, dtype=numpy.uint8)",
        "versions": versions(),
        "video_config": VIDEO_CONFIG, "prompt": PROMPT, "clips": clips,
    }
    (OUT / "qwen3_vl_video.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(f"wrote {OUT.relative_to(ROOT)}/qwen3_vl_video.{{json,safetensors}}")


if __name__ == "__main__":
    main()
