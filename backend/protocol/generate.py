"""The generate interface every generating model shares, declared once: its Triton tensors (name, dtype, dims,
whether optional, which model kinds take or return it, the Python field it maps to) and its request parameters.

Who derives from it: the model repository's config.pbtxt tensor lists (``backend.deploy.render``), reading requests
and sending responses (``backend.triton.io``), the orchestrator's stage requests (``backend.triton.stage_client``)
and the client library (``clients.triton_client``). Input fields are ``backend.request.generate.RawGenerateInputs``'
attributes, output fields ``backend.engine.serving.ResponseChunk``'s. Media tensors come from the registered
modalities (``backend.protocol.modality``).

Which tensors a model has follows its role (``backend.protocol.stages.Stage``): ``llm`` (one engine, the client's
media), ``epd`` (the orchestrators, colocated ones too: the same request as llm, timings back), ``pd`` (metadata-only
media: layouts, and the client's media beside them with metadata-only off), ``prefill`` and ``decode`` (as pd, plus
the client's media for P/D and KV connector parameters), ``encoder`` (``ENCODER_INPUTS``/``ENCODER_OUTPUTS``).
"""
from __future__ import annotations

import enum
import functools
import json
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from backend.protocol.errors import InvalidInput
from backend.protocol.modality import IMAGE, Modality, modalities
from backend.protocol.stages import Stage

# Request parameters (Triton's per-request parameters, not tensors):
# the error envelope in error messages (backend.protocol.errors): Triton 2.51 turns every BLS error into INTERNAL and
# its gRPC stream errors carry no code, so orchestrators ask their stages for it; clients may ask too
ERROR_CODES_PARAMETER = "epd_error_codes"
# an in-band cancel: the id of the request to cancel (orchestrator.cancel_board)
CANCEL_PARAMETER = "epd_cancel"
# (bool) this request's metadata-only setting, over the orchestrator's `metadata_only` parameter
METADATA_ONLY_PARAMETER = "epd_metadata_only"
# (bool) whether the request goes through the encoders (false: P/D, E/P/D's prefill and decode process the media)
ENCODE_PARAMETER = "epd_encode"
# (string "i/n") an encoder request for part i of n of a video: the tower runs on its temporal patches
# [i*T//n, (i+1)*T//n) only (T: the video's grid t), the layout says which (backend.protocol.layout.VideoLayout.part);
# a part with no temporal patches (n > T) answers an empty layout ("": nothing to consume)
PART_PARAMETER = "epd_part"
# (string) the conversation a request is a turn of: its consumer keeps the items' embeddings for the next turn
# (the consumer's session_seconds, backend.transfer.held); orchestrators pass it on to their stages
SESSION_PARAMETER = "session_id"
MAX_SESSION_ID = 256  # characters
# (JSON text: a list of OpenAI tool definitions, ``{"type": "function", "function": {"name", "description",
# "parameters"}}``) the tools a chat request's template renders into the prompt (vLLM's ``tools``); orchestrators pass it on
TOOLS_PARAMETER = "tools"
# (bool) this request's demand-aware setting, over the orchestrator's `demand_aware` parameter
DEMAND_AWARE_PARAMETER = "epd_demand_aware"
# (JSON {"keys": [content key, ...], "session": id or null}) a lookup, answered by a consumer stage (pd, prefill):
# one response whose text_output is the JSON object {content key: layout document} of the keys it holds
HELD_PARAMETER = "epd_held"
# (bool) a health and load probe, answered by every engine stage (llm, pd, prefill, decode): one response whose
# text_output is the JSON object {"kv_cache_usage": fraction of its KV cache in use or null} (orchestrator.replicas)
LOAD_PARAMETER = "epd_load"
# (int >= 0) the request's priority class, as vLLM's ``priority``: lower is served first, 0 the highest; the
# topology's ``priority_levels`` bounds it (``RequestLimits.priority_levels``). Orchestrators pass it on to their stages.
# Not ``priority``: Triton reserves that parameter name for its own request priority ("Parameter "priority" is a
# reserved parameter and cannot be specified", measured on 2.51), which its Python backend cannot read
PRIORITY_PARAMETER = "epd_priority"
# (number of ms > 0) the request's deadline, counted from when the server received it (the topology's
# ``request_timeout_seconds`` bounds it too): past it the request is answered UNAVAILABLE and its work stops at every stage
DEADLINE_PARAMETER = "deadline_ms"
# (number: Unix time in s) the absolute deadline an orchestrator gives its stages (over deadline_ms)
STAGE_DEADLINE_PARAMETER = "epd_deadline"
MAX_DEADLINE_MS = 24 * 3600 * 1000


def parse_session(value) -> str | None:
    """A ``session_id`` parameter's value: a non-empty string of at most ``MAX_SESSION_ID`` characters, or None."""
    if value is None:
        return None
    if not isinstance(value, str) or not value or len(value) > MAX_SESSION_ID:
        raise InvalidInput(f"parameters.{SESSION_PARAMETER}",
                           f"expected a non-empty string of at most {MAX_SESSION_ID} characters, got {value!r:.80}")
    return value


def parse_tools(value) -> list[dict] | None:
    """A ``tools`` parameter's value (JSON text of a list of objects) as that list, or None."""
    if value is None:
        return None
    try:
        tools = json.loads(value) if isinstance(value, str) else None
    except ValueError:
        tools = None
    if not isinstance(tools, list) or not all(isinstance(tool, dict) for tool in tools):
        raise InvalidInput(f"parameters.{TOOLS_PARAMETER}", f"expected the JSON text of a list of tool objects, got {value!r:.80}")
    return tools


def parse_priority(value) -> int | None:
    """A ``priority`` parameter's value: an integer >= 0, or None (INVALID_ARG naming the parameter)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidInput(f"parameters.{PRIORITY_PARAMETER}", f"expected an integer >= 0 (0: served first), got {value!r:.80}")
    return value


def parse_deadline(parameters: Mapping[str, Any], now: float) -> float | None:
    """The absolute deadline (Unix time, s) a request's parameters give: ``epd_deadline`` (an orchestrator's), else
    ``deadline_ms`` after ``now``; None: neither (INVALID_ARG naming the parameter that is not a number in range)."""
    stage = _number(parameters.get(STAGE_DEADLINE_PARAMETER))
    if stage is not None:
        if isinstance(stage, bool) or not isinstance(stage, (int, float)) or not stage > 0:
            raise InvalidInput(f"parameters.{STAGE_DEADLINE_PARAMETER}", f"expected a Unix time in s, got {stage!r:.80}")
        return float(stage)
    value = _number(parameters.get(DEADLINE_PARAMETER))
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= MAX_DEADLINE_MS:
        raise InvalidInput(f"parameters.{DEADLINE_PARAMETER}",
                           f"expected a number of milliseconds in (0, {MAX_DEADLINE_MS}], got {value!r:.80}")
    return now + value / 1000.0


def _number(value):
    """A number given as text (BLS takes no float parameters; some clients send strings only) as a float; else as is."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    return value


def parse_part(text: str, field: str = f"parameters.{PART_PARAMETER}") -> tuple[int, int]:
    """``"i/n"`` as ``(i, n)``, 0 <= i < n; anything else is InvalidInput naming ``field``."""
    index, _, count = str(text).partition("/")
    if not (index.isdigit() and count.isdigit()) or not 0 <= int(index) < int(count):
        raise InvalidInput(field, f"expected 'i/n' with 0 <= i < n, got {text!r}")
    return int(index), int(count)


def part_range(part: tuple[int, int], total: int) -> tuple[int, int]:
    """The temporal patches ``[first, stop)`` of part ``(i, n)`` of a video of ``total``: ``[i*T//n, (i+1)*T//n)``."""
    index, count = part
    return index * total // count, (index + 1) * total // count

LLM, EPD, PD, PREFILL, DECODE = Stage.LLM, Stage.ORCHESTRATOR, Stage.PD, Stage.PREFILL, Stage.DECODE
KINDS = (LLM, EPD, PD, PREFILL, DECODE)  # the roles that speak the generate interface
_ALL = frozenset(KINDS)
_CONSUMERS = frozenset(k for k in KINDS if k.spec.takes_layouts)  # metadata-only media, from an orchestrator
_PD_STAGES = frozenset(k for k in KINDS if k.spec.kv_role)  # KV connector parameters (and the client's media, P/D)
_CLIENT_MEDIA = frozenset(k for k in KINDS if k.spec.takes_media)
STRING, BOOL, UINT32 = "TYPE_STRING", "TYPE_BOOL", "TYPE_UINT32"


class Form(enum.Enum):
    """What a tensor holds, as a Python value."""

    TEXT = "text"     # one UTF-8 string
    TEXTS = "texts"   # UTF-8 strings, one per item
    BYTES = "bytes"   # byte strings, one per item
    BOOL = "bool"     # one bool
    UINT = "uint"     # one unsigned int
    JSON = "json"     # one JSON document (a dict or list on the Python side)


@dataclass(frozen=True)
class Tensor:
    name: str
    dtype: str
    dims: int
    field: str
    form: Form
    kinds: frozenset[Stage] = _ALL
    optional: bool = True  # an input a request may leave out; an output a response may leave out


# wire names as Triton's vLLM backend has them (text_input, sampling_parameters); the Python fields: prompt, sampling
_PROMPT = (Tensor("text_input", STRING, 1, "prompt", Form.TEXT), Tensor("messages", STRING, 1, "messages", Form.TEXT))
_OPTIONS = (Tensor("stream", BOOL, 1, "stream", Form.BOOL),
            Tensor("sampling_parameters", STRING, 1, "sampling", Form.TEXT),
            *(Tensor(name, BOOL, 1, name, Form.BOOL)
              for name in ("exclude_input_in_output", "return_num_input_tokens", "return_num_output_tokens")))
_ORIGINAL_MEDIA = Tensor("original_media", STRING, -1, "original_media", Form.BYTES, _CONSUMERS)  # metadata-only off
_KV_INPUT = Tensor("kv_transfer_params", STRING, 1, "kv_transfer_params", Form.TEXT, _PD_STAGES)
_OUTPUTS = (Tensor("text_output", STRING, -1, "text_output", Form.TEXT, optional=False),
            Tensor("finish_reason", STRING, -1, "finish_reason", Form.TEXT),
            Tensor("num_input_tokens", UINT32, -1, "num_input_tokens", Form.UINT),
            Tensor("num_output_tokens", UINT32, -1, "num_output_tokens", Form.UINT),
            # the generated tokens' log probabilities (sampling parameter ``logprobs``), those of this response's
            # tokens only: a JSON list (backend.engine.logprobs), on every response of a request that asked for them
            Tensor("logprobs", STRING, -1, "logprobs", Form.JSON),
            # an orchestrator's stage breakdown; llm's: cached_tokens alone (a request with media)
            Tensor("timings", STRING, -1, "timings", Form.JSON, _ALL),
            Tensor("kv_transfer_params", STRING, -1, "kv_transfer_params", Form.JSON, _PD_STAGES))

# The encoder (backend.triton.models.encoder): one item per batch row (an image, or the modality's item it names:
# Modality.name, absent: an image); the layout of its embeddings back.
_ENCODER = frozenset({Stage.ENCODER})
ENCODER_INPUTS = (Tensor(IMAGE.media_tensor, STRING, 1, "data", Form.BYTES, _ENCODER, optional=False),
                  Tensor("content_key", STRING, 1, "content_key", Form.TEXT, _ENCODER),
                  Tensor("modality", STRING, 1, "modality", Form.TEXT, _ENCODER))
ENCODER_OUTPUTS = (Tensor("layout", STRING, 1, "layout", Form.TEXT, _ENCODER, optional=False),)
ENCODER_ITEM, ENCODER_KEY, ENCODER_MODALITY = ENCODER_INPUTS
(ENCODER_LAYOUT,) = ENCODER_OUTPUTS


def media_tensors(m: Modality) -> tuple[Tensor, Tensor]:
    """A modality's inputs: its encoded items and its layouts (metadata-only items)."""
    return (Tensor(m.media_tensor, STRING, -1, m.media_field, Form.BYTES, _CLIENT_MEDIA),
            Tensor(m.layout_tensor, STRING, -1, m.layout_field, Form.TEXTS, _CONSUMERS))


def input_tensors(kind: Stage | str | None = None) -> tuple[Tensor, ...]:
    """The inputs of a model ``kind`` (None: every input of the interface), in config.pbtxt order: the prompt, the
    media in the form the kind is built for (the client's for llm/epd, layouts for the consumers), the options, then
    the stage's own: original_media, prefill/decode's P/D media, kv_transfer_params. Cached per registry state: every
    request and response reads it."""
    return _inputs(None if kind is None else Stage(kind), modalities())


@functools.lru_cache(maxsize=64)
def _inputs(kind: Stage | None, registered: tuple[Modality, ...]) -> tuple[Tensor, ...]:
    media = [t for m in registered for t in media_tensors(m)]
    if kind is None:
        return (*_PROMPT, *media, *_OPTIONS, _ORIGINAL_MEDIA, _KV_INPUT)
    own = [t for t in media if t.form is Form.TEXTS or kind not in _CONSUMERS]
    also = [t for t in media if t not in own]  # P/D: the client's media, beside the layouts
    return tuple(t for t in (*_PROMPT, *own, *_OPTIONS, _ORIGINAL_MEDIA, *also, _KV_INPUT) if kind in t.kinds)


def output_tensors(kind: Stage | str | None = None) -> tuple[Tensor, ...]:
    """The outputs a model ``kind`` returns (None: every output of the interface)."""
    return _outputs(None if kind is None else Stage(kind))


@functools.lru_cache(maxsize=16)
def _outputs(kind: Stage | None) -> tuple[Tensor, ...]:
    return tuple(t for t in _OUTPUTS if kind is None or kind in t.kinds)


def output_names(kind: Stage | str | None = None) -> list[str]:
    return [t.name for t in output_tensors(kind)]


def input_values(fields: Mapping[str, Any]) -> dict[str, Any]:
    """Input name -> value for a request whose fields (``Tensor.field``: ``RawGenerateInputs``' names) are
    ``fields``: bools always, item lists when not empty (as lists), the others when not None. The values are what
    ``backend.triton.grpc_stream.grpc_inputs`` (and Triton's HTTP generate extension, media base64) take."""
    values: dict[str, Any] = {}
    for tensor in input_tensors():
        value = fields.get(tensor.field)
        if tensor.form is Form.BOOL:
            values[tensor.name] = bool(value)
        elif tensor.form in (Form.TEXTS, Form.BYTES):
            if value:
                values[tensor.name] = list(value)
        elif value is not None:
            values[tensor.name] = json.dumps(value) if tensor.form is Form.JSON else value
    return values


def output_fields(value: Callable[[str], Any]) -> dict[str, Any]:
    """``ResponseChunk``'s fields of a response whose output ``name`` holds ``value(name)`` (its first item: str,
    bytes or a number; None where absent). Absent fields are None, ``text_output`` then ""."""
    fields = {}
    for tensor in _OUTPUTS:
        item = value(tensor.name)
        if isinstance(item, bytes):
            item = item.decode("utf-8")
        if tensor.form is Form.JSON:
            item = json.loads(item) if item else None
        elif tensor.form is Form.UINT and item is not None:
            item = int(item)
        fields[tensor.field] = item
    fields["text_output"] = fields["text_output"] or ""
    return fields


@dataclass
class GenerateInputs:
    """One generate request as a client builds it (the client library, the OpenAI frontend, the benchmarks):
    ``as_values`` turns it into the interface's input values."""
    prompt: str | None = None
    messages: list[dict] | str | None = None
    images: Sequence[bytes] = ()
    image_layouts: Sequence[str] = ()  # metadata-only media, for a consumer model (pd, prefill, decode)
    videos: Sequence[bytes] = ()  # encoded videos (MP4, WebM, ...): the items of {"type": "video"} parts
    video_layouts: Sequence[str] = ()
    audios: Sequence[bytes] = ()  # encoded audio files (WAV, FLAC, OGG, ...): the items of {"type": "audio"} parts
    audio_layouts: Sequence[str] = ()
    kv_transfer_params: dict | None = None  # prefill / decode stages: vLLM KV connector parameters
    sampling: dict[str, Any] | str | None = None  # a dict, or JSON text sent as is
    stream: bool = True
    exclude_input_in_output: bool = True
    return_counts: bool = True
    parameters: dict[str, Any] | None = None  # Triton request parameters, e.g. {"epd_metadata_only": False}

    def as_values(self) -> dict[str, Any]:
        """Input name -> value for the shared interface (``input_values``); absent inputs are left out."""
        fields = {name: getattr(self, name, ()) for m in modalities() for name in (m.media_field, m.layout_field)}
        fields.update(prompt=self.prompt, messages=_json_text(self.messages), stream=self.stream,
                      sampling=_json_text(self.sampling), exclude_input_in_output=self.exclude_input_in_output,
                      return_num_input_tokens=self.return_counts, return_num_output_tokens=self.return_counts,
                      kv_transfer_params=None if self.kv_transfer_params is None else json.dumps(self.kv_transfer_params))
        return input_values(fields)


def _json_text(value: Any) -> str | None:
    """A JSON input given as a Python value or as JSON text (sent as is)."""
    return value if value is None or isinstance(value, str) else json.dumps(value)
