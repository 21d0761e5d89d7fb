"""The demo model's workshop: pictures, questions, training and evaluation for a small Qwen2-VL that sees.

Not on the request path, and not yet a shipped model: the recipe here trains and measures one (issue "A Qwen2-VL
that actually sees"), and the engine serves whatever checkpoint it writes, unchanged. Reading order:

- scenes.py: the picture generator (what is in a scene, and how it is drawn);
- tasks.py: the questions and answers, and how a reply is graded;
- training.py, trainer.py: chats as training sequences, the loss, the loop (scripts/train_demo.py runs them);
- evaluation.py: the held-out set and the accuracy tables (scripts/eval_demo.py);
- other_renderer.py: pictures drawn by independent code, to check that a model did not learn one renderer.
"""
