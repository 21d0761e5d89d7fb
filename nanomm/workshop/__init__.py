"""The workshop: code that makes and measures the demo model, kept out of the runtime.

Lesson: lessons/A2-how-the-demo-model-was-made.md (training) and lessons/A3-cpu-kernels.md (the op counter).

The runtime never imports it (tests/test_layout.py checks), and it is the only place under nanomm/ that trains.
The scripts (`scripts/train_demo.py`, `scripts/eval_demo.py`, `scripts/bench.py`, ...), the tests and the
lessons import it as any other package.

- training.py, trainer.py: the demo model's training sequences, loss and loop;
- other_renderer.py: pictures and answers drawn by independent code, the second oracle of the demo model's accuracy;
- op_count.py: counts the kernels and host syncs of a piece of code (a decode step's, per layer);
- video_fixtures.py: what the video-fixture scripts (scripts/workshop/) share.
"""
