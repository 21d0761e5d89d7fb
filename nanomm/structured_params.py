"""vLLM's `StructuredOutputsParams`: the shape a request's answer must take (a JSON schema, a regex, a choice, a
grammar). Its own module, loaded by the requests that ask for a shape; the engine's side is
nanomm/engine/structured.py.

Lesson: lessons/18-answers-in-a-shape.md.
"""

import json
from dataclasses import dataclass, fields

from nanomm.errors import InvalidInputError


@dataclass(frozen=True)
class StructuredOutputsParams:
    """vLLM's constraint on the shape of an answer: exactly one of these is set. json: a JSON schema (a dict or
    its text); json_object: any JSON object; regex: a regular expression (Rust's `regex` syntax); choice: one of
    these strings; grammar: a Lark grammar in llguidance's dialect. The engine compiles it with llguidance (the
    `structured` extra) and masks every token that would leave it (nanomm/engine/structured.py)."""
    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self):
        chosen = self.kinds_set()
        _check(len(chosen) == 1, "structured_outputs must set exactly one of json, json_object, regex, choice, "
                                 f"grammar; got {chosen or 'none'}")
        _check(self.json is None or isinstance(self.json, (dict, str)),
               f"structured_outputs.json must be a JSON schema (an object or its text), got {type(self.json).__name__}")
        _check(isinstance(self.json_object, bool), f"structured_outputs.json_object must be a bool, got "
                                                   f"{self.json_object!r}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            _check(value is None or (isinstance(value, str) and value), f"structured_outputs.{name} must be a "
                                                                        f"non-empty string, got {value!r}")
        _check(self.choice is None or (isinstance(self.choice, (list, tuple)) and self.choice
                                       and all(isinstance(c, str) for c in self.choice)),
               f"structured_outputs.choice must be a non-empty list of strings, got {self.choice!r}")

    def kinds_set(self) -> list[str]:
        return [f.name for f in fields(self) if getattr(self, f.name) not in (None, False)]

    def key(self) -> tuple[str, str]:
        """(kind, its text): the same constraint gives the same key, whatever form it came in."""
        kind = self.kinds_set()[0]
        value = getattr(self, kind)
        text = value if isinstance(value, str) else json.dumps(value, sort_keys=True) if kind != "json_object" else ""
        return kind, text


def _check(ok: bool, message: str):
    if not ok:
        raise InvalidInputError(message)
