"""OpenAI's ``response_format`` as vLLM's structured outputs (the sampling parameter ``structured_outputs``,
``backend.request.sampling``): the engines constrain the generated tokens to the format (on E/P/D, decode's tokens:
every stage gets the same sampling parameters). A schema is checked here against its JSON Schema meta-schema, so a
malformed one is a 400 naming the field before any stage sees it; what the engine then cannot compile comes back as
its error naming ``sampling_parameters.structured_outputs``, which the endpoint names in the client's terms."""
from __future__ import annotations

from typing import Any

STRUCTURED_PARAM = "sampling_parameters.structured_outputs"  # the engine's name for the constraint's errors


class SchemaError(ValueError):
    """A JSON Schema that is no valid schema: ``problem`` says why."""

    def __init__(self, problem: str):
        super().__init__(problem)
        self.problem = problem


def check_schema(schema: Any) -> None:
    """SchemaError unless ``schema`` is a JSON Schema (an object valid under its ``$schema``'s meta-schema, or the
    latest draft's)."""
    import jsonschema  # deferred: only requests with a schema pay its import

    if not isinstance(schema, dict):
        raise SchemaError(f"expected a JSON Schema object, got {type(schema).__name__}")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "".join(f"[{p!r}]" for p in exc.absolute_path)
        raise SchemaError(f"not a valid JSON Schema: {exc.message}" + (f" (at {where})" if where else "")) from None


def response_format(value: Any) -> tuple[dict | None, str]:
    """(the ``structured_outputs`` sampling parameter or None, the field its errors name) of a ``response_format``
    (``{"type": "text"}``, ``{"type": "json_object"}``, ``{"type": "json_schema", "json_schema": {"name", "schema",
    ...}}``); a bad one raises ``FieldError``."""
    if value is None:
        return None, "response_format"
    if not isinstance(value, dict):
        raise FieldError("response_format", "must be an object with a type")
    kind = value.get("type")
    if kind == "text":
        return None, "response_format"
    if kind == "json_object":
        return {"json_object": True}, "response_format"
    if kind != "json_schema":
        raise FieldError("response_format.type", f"expected text, json_object or json_schema, got {kind!r:.40}")
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or "schema" not in spec:
        raise FieldError("response_format.json_schema", "expected an object with a schema")
    try:
        check_schema(spec["schema"])
    except SchemaError as exc:
        raise FieldError("response_format.json_schema", exc.problem) from None
    return {"json": spec["schema"]}, "response_format.json_schema"


class FieldError(ValueError):
    """A bad request field: ``param`` names it (the endpoint answers 400 with it)."""

    def __init__(self, param: str, problem: str):
        super().__init__(f"{param}: {problem}")
        self.param, self.problem = param, problem
