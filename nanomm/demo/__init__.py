"""The demo model's workshop: pictures, questions, training and evaluation for a small Qwen2-VL that sees.

Not on the request path: the recipe here trains and measures the demo model, and the engine serves the
checkpoint it writes, unchanged. `demo_checkpoint()` finds the trained model (and its draft) shipped with the
package. Reading order:

- scenes.py: the picture generator (what is in a scene, and how it is drawn);
- tasks.py: the questions and answers, and how a reply is graded;
- training.py, trainer.py: chats as training sequences, the loss, the loop (scripts/train_demo.py runs them);
- evaluation.py: the held-out set and the accuracy tables (scripts/eval_demo.py);
- other_renderer.py: pictures drawn by independent code, to check that a model did not learn one renderer.

lessons/11-what-pixels-buy.md measures the model; lessons/12-how-the-demo-model-was-made.md tells how it was made.
"""

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
