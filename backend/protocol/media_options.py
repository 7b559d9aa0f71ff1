"""Per-request media processing options: vLLM's ``media_io_kwargs`` (its OpenAI chat field of that name, keyed by
modality), the request parameter ``media_io_kwargs`` here, a JSON object such as ``{"video": {"fps": 1}}``.

Who reads them: every model that decodes media (``llm``, the encoders, and with metadata-only off or P/D the
consumers) passes them to vLLM's loader as vLLM's media connector would; the orchestrators put each item's options
into its content key (``backend.protocol.layout.content_key``), so an embedding made with other options is never
served for it, and send them to the encoders with the item. Only options whose effect every path reproduces are
taken; any other key is INVALID_ARG naming it.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Callable

from backend.protocol.errors import InvalidInput

MEDIA_IO_PARAMETER = "media_io_kwargs"
FIELD = f"parameters.{MEDIA_IO_PARAMETER}"
# vLLM's other per-request processing field: not taken (the encoders would need the HF processor's options per item);
# refused by name rather than ignored, so no request is processed otherwise than it asked
PROCESSOR_PARAMETER = "mm_processor_kwargs"
MAX_FPS = 240.0        # vLLM's Qwen2-VL loader samples at most 30 a second; a bound on the value, not on the work
MAX_NUM_FRAMES = 1 << 16


def _fps(value: Any, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not 0 < value <= MAX_FPS:
        raise InvalidInput(field, f"expected a number of frames a second in (0, {MAX_FPS:g}], got {value!r:.40}")
    return float(value)


def _num_frames(value: Any, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not (value == -1 or 1 <= value <= MAX_NUM_FRAMES):
        raise InvalidInput(field, f"expected -1 (every frame) or a frame count in [1, {MAX_NUM_FRAMES}], "
                                  f"got {value!r:.40}")
    return value


# modality -> option -> its check (the value as the loader takes it); what vLLM's VideoMediaIO passes its loader
ALLOWED: dict[str, dict[str, Callable[[Any, str], Any]]] = {"video": {"fps": _fps, "num_frames": _num_frames}}


@dataclass(frozen=True)
class MediaOptions:
    """A request's options per modality, each as canonical JSON (sorted keys): what the content key takes."""

    by_modality: tuple[tuple[str, str], ...] = ()

    @classmethod
    def from_parameters(cls, params: dict) -> "MediaOptions":
        """A request's options from its parameters; ``mm_processor_kwargs`` is InvalidInput naming it."""
        if params.get(PROCESSOR_PARAMETER) not in (None, "", "{}"):
            raise InvalidInput(f"parameters.{PROCESSOR_PARAMETER}", "not supported (per-request HF processor options "
                                                                    f"are not taken; {MEDIA_IO_PARAMETER} is)")
        return cls.parse(params.get(MEDIA_IO_PARAMETER))

    @classmethod
    def parse(cls, value: Any) -> "MediaOptions":
        """The parameter's value (a JSON object's text, or the object; None: no options)."""
        if value is None or value == "":
            return cls()
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise InvalidInput(FIELD, f"not JSON ({exc})") from None
        if not isinstance(value, dict):
            raise InvalidInput(FIELD, f'expected a JSON object keyed by modality, e.g. {{"video": {{"fps": 1}}}}, '
                                      f"got {type(value).__name__}")
        found = []
        for modality, options in sorted(value.items()):
            where = f"{FIELD}.{modality}"
            if modality not in ALLOWED:
                raise InvalidInput(where, f"no per-request options for this modality (taken: {', '.join(ALLOWED)})")
            if not isinstance(options, dict):
                raise InvalidInput(where, f"expected an object of options, got {type(options).__name__}")
            checks = ALLOWED[modality]
            unknown = sorted(set(options) - set(checks))
            if unknown:
                raise InvalidInput(f"{where}.{unknown[0]}", f"unsupported option (taken: {', '.join(checks)})")
            if options:
                checked = {name: checks[name](options[name], f"{where}.{name}") for name in sorted(options)}
                found.append((modality, json.dumps(checked, sort_keys=True, separators=(",", ":"))))
        return cls(tuple(found))

    def __bool__(self) -> bool:
        return bool(self.by_modality)

    def key(self, modality: str) -> str:
        """``modality``'s options as canonical JSON ("" for none): what goes into its items' content keys."""
        return dict(self.by_modality).get(modality, "")

    def kwargs(self, modality: str) -> dict[str, Any]:
        """``modality``'s options as keyword arguments of its loader."""
        text = self.key(modality)
        return json.loads(text) if text else {}

    def parameter(self) -> str:
        """The request parameter's value that gives these options ("" for none)."""
        return json.dumps({m: json.loads(text) for m, text in self.by_modality}, sort_keys=True) if self else ""


__all__ = ["ALLOWED", "MEDIA_IO_PARAMETER", "PROCESSOR_PARAMETER", "MediaOptions"]
