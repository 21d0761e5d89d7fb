"""Errors a caller can act on.

Everything wrong with what a caller sends (a prompt, an image, a sampling parameter) raises
`InvalidInputError` with a message naming the input, before any model compute runs.
"""

import math
import operator


class InvalidInputError(ValueError):
    """Something the caller sent is invalid; the message says what and which input."""


class CheckpointError(ValueError):
    """A folder or hub id that does not hold a usable Qwen2-VL checkpoint."""


def is_finite_number(x) -> bool:
    """An int or a float that is finite; never a bool."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def check_int(value, name: str, *, minimum: int = 1, error: type[ValueError] = ValueError) -> int:
    """`value` as an int >= minimum, or `error` naming it and quoting what the caller gave.

    Python and numpy integers pass; bools, floats and strings never do (True is not a block size).
    """
    try:
        as_int = operator.index(value)
    except TypeError:
        as_int = None
    if isinstance(value, bool) or as_int is None or as_int < minimum:
        wanted = "a positive int" if minimum == 1 else f"an int >= {minimum}"
        raise error(f"{name} must be {wanted}, got {value!r}")
    return as_int


class PeerError(RuntimeError):
    """Another nanomm instance this one depends on (an encoder service, a prefill or decode peer) failed, refused,
    or did not answer in time; or what it sent does not fit this instance. Over HTTP: a 502 (503 when the peer
    says it is busy, 504 on a timeout). The message names the peer and what went wrong."""

    def __init__(self, message: str, status: int = 502):
        super().__init__(message)
        self.status = status
