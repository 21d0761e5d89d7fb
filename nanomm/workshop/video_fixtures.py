"""What the two video-fixture scripts share (scripts/workshop/make_video_fixtures.py and
make_qwen3_video_fixtures.py): seeded noise clips, their hashes, a lossless packing of transformers' pixel values,
and the versions that made them.

Lesson: lessons/17-video.md.
"""

import hashlib
import platform

import numpy as np
import torch


def noise_frames(seed: int, frames: int, height: int, width: int) -> np.ndarray:
    """(T, H, W, 3) uint8 noise; the test makes the same frames with the same call."""
    return np.random.default_rng(seed).integers(0, 256, (frames, height, width, 3), dtype=np.uint8)


def sha256(array) -> str:
    return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()


def encode(pixel_values: torch.Tensor, channels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, C*K) float32 -> table (C, 256) float32 and codes (rows, C, K) uint8, with table[c, codes[:, c]] == it."""
    per_channel = pixel_values.view(pixel_values.shape[0], channels, -1)  # (rows, C, K)
    table = torch.zeros(channels, 256, dtype=torch.float32)
    codes = torch.empty(per_channel.shape, dtype=torch.uint8)
    for c in range(channels):
        values, index = torch.unique(per_channel[:, c], sorted=True, return_inverse=True)
        assert len(values) <= 256, f"channel {c} holds {len(values)} distinct values"
        table[c, :len(values)] = values
        codes[:, c] = index.to(torch.uint8)
    return table, codes


def decode(table: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    channel = torch.arange(table.shape[0]).view(1, -1, 1)  # (1, C, 1)
    return table[channel, codes.long()].reshape(codes.shape[0], -1)  # (rows, C*K)


def versions() -> dict:
    """The versions that made a fixture (the side environment's)."""
    import PIL
    import torchvision
    import transformers

    return {"python": platform.python_version(), "torch": torch.__version__, "torchvision": torchvision.__version__,
            "transformers": transformers.__version__, "pillow": PIL.__version__, "numpy": np.__version__,
            "cpu_capability": torch.backends.cpu.get_cpu_capability()}
