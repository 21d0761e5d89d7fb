"""What the engine holds when nothing is traced: every call does nothing, and the step timeline (trace.py) is not
loaded.

Lesson: lessons/12-capstone.md ("The whole run on one timeline").
"""

import contextlib


class NoTrace:
    def span(self, name: str, **args):
        return contextlib.nullcontext()

    def __getattr__(self, name):
        return _ignore


def _ignore(*args, **kwargs) -> None:
    return None
