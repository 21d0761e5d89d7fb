"""Errors a caller can act on.

Everything wrong with what a caller sends (a prompt, an image, a sampling parameter) raises
`InvalidInputError` with a message naming the input, before any model compute runs.
"""


class InvalidInputError(ValueError):
    """Something the caller sent is invalid; the message says what and which input."""


class CheckpointError(ValueError):
    """A folder or hub id that does not hold a usable Qwen2-VL checkpoint."""
