"""The demo model: `demo_checkpoint()` and the shipped weights, and the quality harness that scores a lever.

A few-million-parameter Qwen2-VL, trained to answer questions about generated scenes, ships with the package so
that every lever (the pixel cap, compression, quantization, speculation) has an accuracy number next to its
speed-up. `demo_checkpoint()` finds it (and its draft). The harness that lessons and users call:

- scenes.py: the picture generator (what is in a scene, and how it is drawn);
- tasks.py: the questions and answers, and how a reply is graded;
- evaluation.py: the held-out set and the accuracy tables (scripts/eval_demo.py).

Training the model, and the independent second renderer that checks it off its training pictures, are workshop
code outside the package: scripts/workshop/ (scripts/train_demo.py runs the training).
lessons/A1-what-pixels-buy.md measures the model; lessons/A2-how-the-demo-model-was-made.md tells how it was made.
"""

import os
from pathlib import Path

from nanomm.errors import CheckpointError

DEMO_MODELS = ("model", "draft")


def demo_checkpoint(which: str = "model") -> Path:
    """The folder of the trained demo Qwen2-VL that ships with the package ("model"), or of its draft ("draft").

    Both are Hugging Face layout folders (config.json, model.safetensors, tokenizer files) that `nanomm.LLM` and
    transformers load; they share one tokenizer. Made by scripts/train_demo.py."""
    if which not in DEMO_MODELS:
        raise ValueError(f"demo_checkpoint: which must be one of {DEMO_MODELS}, got {which!r}")
    folder = Path(__file__).resolve().parent / "checkpoints" / which
    if not (folder / "model.safetensors").is_file():
        raise CheckpointError(f"the demo {which} is not installed at {folder}: reinstall nanomm (pip install .), "
                              "or train one with scripts/train_demo.py")
    return folder


def demo_folder(choice: str, console) -> Path:
    """--demo: the trained demo model shipped with the package; --demo random: a tiny random-weight one."""
    if choice == "random":
        return random_demo_checkpoint(console)
    return demo_checkpoint()


def random_demo_checkpoint(console) -> Path:
    """A tiny random-weight Qwen2-VL checkpoint, generated once into a cache folder (no network needed); console: a
    rich Console, which shows a status line while it is made."""
    from nanomm.tools.random_checkpoint import make_checkpoint

    cache = Path(os.environ.get("NANOMM_CACHE", Path.home() / ".cache" / "nanomm"))
    folder = cache / "demo-tiny"
    if not (folder / "model.safetensors").is_file():
        with console.status(f"generating the demo model in {folder} ..."):
            make_checkpoint(folder, preset="tiny")
    return folder
