"""The workshop: code that makes and measures the demo model and the benchmarks, kept out of the runtime package.

Nothing under nanomm/ imports it; the scripts beside it (`scripts/train_demo.py`, `scripts/eval_demo.py`,
`scripts/bench.py`, ...) and the tests do. Scripts run as `python scripts/NAME.py` find it on their own path;
tests/conftest.py puts scripts/ on the path for the tests and the lessons.

- training.py, trainer.py: the demo model's training sequences, loss and loop (lessons/A2-how-the-demo-model-was-made.md);
- other_renderer.py: pictures and answers drawn by independent code, the second oracle of the demo model's accuracy;
- op_count.py: counts the kernels and host syncs of a piece of code (a decode step's, per layer).
"""
