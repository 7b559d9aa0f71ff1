"""Validation of the ``sampling_parameters`` JSON shared by every generating model.

Values may be JSON numbers/booleans or their string forms (Triton's vllm_backend clients send
``{"temperature": "0.1"}``). Unknown keys and out-of-range values are ``InvalidInput`` naming the key,
so a typo never silently falls back to a default.
"""
from __future__ import annotations

import json
import math
from typing import Any, Callable

from backend.protocol.errors import InvalidInput

FIELD = "sampling_parameters"


def _num(kind: type, lo: float | None = None, hi: float | None = None, lo_open: bool = False):
    def check(key: str, value: Any):
        if isinstance(value, bool):
            raise InvalidInput(f"{FIELD}.{key}", f"expected a number, got {value!r}")
        try:
            num = kind(value) if not isinstance(value, str) or kind is float else int(value, 10)
        except (TypeError, ValueError):
            raise InvalidInput(f"{FIELD}.{key}", f"expected {'an integer' if kind is int else 'a number'}, got {value!r}") from None
        if kind is int and isinstance(value, float) and not value.is_integer():
            raise InvalidInput(f"{FIELD}.{key}", f"expected an integer, got {value!r}")
        if isinstance(num, float) and not math.isfinite(num):
            raise InvalidInput(f"{FIELD}.{key}", f"must be finite, got {value!r}")
        if lo is not None and (num <= lo if lo_open else num < lo):
            raise InvalidInput(f"{FIELD}.{key}", f"must be {'>' if lo_open else '>='} {lo}, got {value!r}")
        if hi is not None and num > hi:
            raise InvalidInput(f"{FIELD}.{key}", f"must be <= {hi}, got {value!r}")
        return num
    return check


def _bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise InvalidInput(f"{FIELD}.{key}", f"expected true or false, got {value!r}")


def _str_list(key: str, value: Any) -> list[str]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) and s for s in items):
        raise InvalidInput(f"{FIELD}.{key}", "expected a non-empty string or a list of them")
    return items


def _int_list(key: str, value: Any) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value):
        raise InvalidInput(f"{FIELD}.{key}", "expected a list of non-negative integers")
    return value


def _logprobs(key: str, value: Any) -> int:
    """vLLM's ``logprobs``: how many of the most likely tokens to return at each step beside the sampled one (0: the
    sampled token alone), -1 for the whole vocabulary. The upper bound is the engine's ``max_logprobs`` (vLLM's
    engine argument, 20 by default), which the engine checks: INVALID_ARG naming this key too."""
    count = _num(int)(key, value)
    if count < -1:
        raise InvalidInput(f"{FIELD}.{key}", f"must be >= 0 (how many most likely tokens) or -1 (all), got {value!r}")
    return count


STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")  # vLLM's StructuredOutputsParams fields


def _structured(key: str, value: Any) -> dict[str, Any]:
    """vLLM's ``structured_outputs``: one constraint on the generated text, ``{"json": schema}`` (a JSON Schema, an
    object or its text), ``{"json_object": true}``, ``{"regex": ...}``, ``{"choice": [...]}`` or ``{"grammar": ...}``.
    The engine compiles it (a schema it cannot compile: INVALID_ARG naming this key)."""
    if not isinstance(value, dict) or len(value) != 1 or next(iter(value)) not in STRUCTURED_KINDS:
        raise InvalidInput(f"{FIELD}.{key}", f"expected an object with one of {', '.join(STRUCTURED_KINDS)}")
    (kind, spec), = value.items()
    if kind == "json_object" and spec is not True:
        raise InvalidInput(f"{FIELD}.{key}.json_object", "must be true")
    if kind == "json" and not isinstance(spec, (dict, str)):
        raise InvalidInput(f"{FIELD}.{key}.json", "expected a JSON Schema (an object, or its JSON text)")
    if kind in ("regex", "grammar") and not (isinstance(spec, str) and spec):
        raise InvalidInput(f"{FIELD}.{key}.{kind}", "expected a non-empty string")
    if kind == "choice" and not (isinstance(spec, list) and spec and all(isinstance(c, str) for c in spec)):
        raise InvalidInput(f"{FIELD}.{key}.choice", "expected a non-empty list of strings")
    return value


_SPEC: dict[str, Callable[[str, Any], Any]] = {
    "temperature": _num(float, 0.0),
    "top_p": _num(float, 0.0, 1.0, lo_open=True),
    "top_k": _num(int, -1),
    "min_p": _num(float, 0.0, 1.0),
    "max_tokens": _num(int, 1),
    "min_tokens": _num(int, 0),
    "seed": _num(int, 0, 2**63 - 1),
    "presence_penalty": _num(float, -2.0, 2.0),
    "frequency_penalty": _num(float, -2.0, 2.0),
    "repetition_penalty": _num(float, 0.0, lo_open=True),
    "ignore_eos": _bool,
    "skip_special_tokens": _bool,
    "spaces_between_special_tokens": _bool,
    "include_stop_str_in_output": _bool,
    "stop": _str_list,
    "stop_token_ids": _int_list,
    "logprobs": _logprobs,
    "structured_outputs": _structured,
}
SUPPORTED_KEYS = tuple(sorted(_SPEC))


def parse_sampling(text: str | None) -> dict[str, Any]:
    """Parse and validate the JSON text; returns keyword arguments for ``vllm.SamplingParams``."""
    if text is None or not text.strip():
        return {}
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidInput(FIELD, f"not valid JSON ({exc.msg} at position {exc.pos})") from None
    if not isinstance(doc, dict):
        raise InvalidInput(FIELD, f"expected a JSON object, got {type(doc).__name__}")
    out: dict[str, Any] = {}
    for key, value in doc.items():
        check = _SPEC.get(key)
        if check is None:
            raise InvalidInput(f"{FIELD}.{key}", f"unknown parameter; supported: {', '.join(SUPPORTED_KEYS)}")
        out[key] = check(key, value)
    if "min_tokens" in out and out["min_tokens"] > out.get("max_tokens", out["min_tokens"]):
        raise InvalidInput(f"{FIELD}.min_tokens", "must not exceed max_tokens")
    return out
