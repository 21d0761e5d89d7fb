"""The answer's shape a request body asks for: OpenAI's `response_format`, or vLLM's `structured_outputs` extra.

Lesson: "Answers in a shape" (structured outputs), to come. The engine side is nanomm/engine/structured.py.
"""

from nanomm.errors import InvalidInputError
from nanomm.structured_params import StructuredOutputsParams

STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")
RESPONSE_FORMATS = ("text", "json_object", "json_schema")


def structured_outputs(body: dict) -> StructuredOutputsParams | None:
    """The answer's shape a body asks for, from `response_format` or vLLM's `structured_outputs` (not both)."""
    from_format = _response_format(body.get("response_format"))
    extra = body.get("structured_outputs")
    if extra is None:
        return from_format
    if from_format is not None:
        raise InvalidInputError("set either 'response_format' or 'structured_outputs', not both")
    if not isinstance(extra, dict):
        raise InvalidInputError(f"'structured_outputs' must be an object, got {extra!r}")
    unknown = sorted(set(extra) - set(STRUCTURED_KINDS))
    if unknown:
        raise InvalidInputError(f"'structured_outputs': unsupported field(s) {unknown}; supported: {STRUCTURED_KINDS}")
    return StructuredOutputsParams(**{k: v for k, v in extra.items() if v is not None})


def _response_format(value) -> StructuredOutputsParams | None:
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in RESPONSE_FORMATS:
        raise InvalidInputError(f"'response_format' must be an object whose 'type' is one of {RESPONSE_FORMATS}, "
                                f"got {value!r}")
    unknown = sorted(set(value) - {"type", "json_schema"})
    if unknown:
        raise InvalidInputError(f"'response_format': unsupported field(s) {unknown}")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
        raise InvalidInputError("'response_format' of type 'json_schema' needs 'json_schema': {'name': ..., "
                                f"'schema': {{...}}, 'strict': ...}}, got {spec!r}")
    unknown = sorted(set(spec) - {"name", "schema", "strict", "description"})
    if unknown:
        raise InvalidInputError(f"'response_format.json_schema': unsupported field(s) {unknown}")
    return StructuredOutputsParams(json=spec.get("schema", {}))
