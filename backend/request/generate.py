"""The generate request shared by every generating model (``llm``, ``epd``, ``pd`` ...).

Lifecycle of one request in a model: Triton tensors -> ``RawGenerateInputs`` (typed values, done by
``backend.triton.io``) -> ``parse_generate_request`` -> ``GenerateRequest`` (validated prompt or chat
conversation, media items in prompt order, sampling settings) -> engine. Every problem is an
``InvalidInput`` naming the field.

Prompt forms (exactly one):
- ``text_input``: a prompt that may hold the model's image placeholders. If it holds none and media are
  given, one placeholder per item is put in front of the prompt; otherwise counts must match.
- ``messages``: OpenAI-style chat messages JSON. Media parts are each registered modality's
  (``backend.protocol.modality``), for images ``{"type": "image_url", "image_url": {"url": "data:..." |
  "file://..."}}`` or ``{"type": "image"}``, which takes the next item of the ``image`` tensor (or of
  ``image_layouts``); audio also ``{"type": "input_audio", "input_audio": {"data": "<base64>", "format": "wav"}}``.
  The parsed conversation has every image part as ``{"type": "image"}``: it is both what
  the chat template renders and the metadata-only rewrite.

What a media item becomes depends on the model (``MediaResolver``): ``llm`` decodes images, ``epd``
keeps the encoded bytes for its encoders, ``pd`` accepts only layout metadata (never media). How a modality's
items are decoded or read is its request-stage module's (``backend.request.image``, registered in
``backend.request.media``).
"""
from __future__ import annotations

import base64
import binascii
import copy
import json
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol

from backend.protocol.errors import InvalidInput
from backend.protocol.generate import PRIORITY_PARAMETER, SESSION_PARAMETER, TOOLS_PARAMETER, parse_tools, Form, input_tensors, parse_deadline, \
    parse_priority, parse_session
from backend.protocol.layout import LayoutMetadata
from backend.protocol.media_options import MediaOptions
from backend.protocol.modality import Modality, content_part, modalities
from backend.request import audio, image, video  # noqa: F401 - register the modalities' MediaHandlers
from backend.request.media import MediaLimits, check_encoded, handler
from backend.request.sampling import parse_sampling

ROLES = ("system", "user", "assistant", "tool")
TOOL_FIELDS = {"tool_calls": list, "tool_call_id": str, "name": str}  # kept on a message for the chat template


@dataclass(frozen=True)
class PromptFormat:
    """Model-family prompt conventions: per modality name, its placeholder token and what one item becomes in a
    prompt that names none; a modality not named here: its own (``Modality.placeholder*``, Qwen2-VL's)."""

    placeholders: Mapping[str, tuple[str, str]] = field(default_factory=dict)

    def of(self, m: Modality) -> tuple[str, str]:
        return self.placeholders.get(m.name, (m.placeholder_token, m.placeholder))


@dataclass(frozen=True)
class RequestLimits:
    max_images: int = 8  # per request: each modality's limit is its ``Modality.limit_field`` here
    max_videos: int = 8
    max_audios: int = 8
    media: MediaLimits = field(default_factory=MediaLimits)
    priority_levels: int = 4  # a request's priority is 0 .. priority_levels - 1 (backend.protocol.generate)


@dataclass(frozen=True)
class RawGenerateInputs:
    """The request's inputs as plain Python values; ``None`` where the client sent nothing. Its fields are the
    generate interface's inputs (``backend.protocol.generate``), named by ``Tensor.field``: ``prompt`` and
    ``sampling`` for the tensors ``text_input`` and ``sampling_parameters``; each modality has two
    (``Modality.media_field``, ``Modality.layout_field``)."""

    prompt: str | None = None                  # the text_input tensor
    messages: str | None = None
    images: tuple[bytes, ...] = ()
    image_layouts: tuple[str, ...] = ()
    videos: tuple[bytes, ...] = ()
    video_layouts: tuple[str, ...] = ()
    audios: tuple[bytes, ...] = ()
    audio_layouts: tuple[str, ...] = ()
    stream: bool = False
    sampling: str | None = None                # the sampling_parameters tensor (JSON text)
    exclude_input_in_output: bool = False
    return_num_input_tokens: bool = False
    return_num_output_tokens: bool = False
    kv_transfer_params: str | None = None      # JSON, between prefill and decode stages
    original_media: tuple[bytes, ...] = ()     # metadata-only off: the client's media beside image_layouts
    session_id: str | None = None              # the request parameter (backend.protocol.generate.SESSION_PARAMETER)
    media_io: MediaOptions = MediaOptions()    # the request parameter media_io_kwargs (backend.protocol.media_options)
    priority: int | None = None                # the request parameter priority (checked against the limits later)
    deadline: float | None = None              # Unix time (s): the request parameter epd_deadline or deadline_ms
    tools: str | None = None                   # the request parameter tools (JSON text, passed on as is)


def raw_inputs(values: Mapping[str, Any], parameters: Mapping[str, Any]) -> RawGenerateInputs:
    """A request given as input name -> value (``backend.protocol.generate.input_values``' form: what a client sends
    as tensors) and its request parameters, without tensors: what ``backend.triton.io.read_generate_inputs`` reads
    from a Triton request (InvalidInput for a bad ``session_id`` or ``media_io_kwargs``). Used by the endpoint that
    runs inside a model's process (``frontend.openai.in_process``)."""
    tensors = {t.name: t for t in input_tensors()}
    fields = {tensors[name].field: tuple(value) if tensors[name].form in (Form.TEXTS, Form.BYTES) else value
              for name, value in values.items() if name in tensors}
    return RawGenerateInputs(**fields, **parameter_inputs(parameters))


def parameter_inputs(parameters: Mapping[str, Any]) -> dict[str, Any]:
    """The ``RawGenerateInputs`` fields a request's parameters give: ``session_id``, ``media_io``, ``priority`` and
    ``deadline`` (InvalidInput naming the parameter that is wrong)."""
    return {"session_id": parse_session(parameters.get(SESSION_PARAMETER)),
            "media_io": MediaOptions.from_parameters(dict(parameters)),
            "priority": parse_priority(parameters.get(PRIORITY_PARAMETER)),
            "deadline": parse_deadline(parameters, time.time()),
            "tools": _tools_text(parameters.get(TOOLS_PARAMETER))}


def _tools_text(value) -> str | None:
    """The ``tools`` parameter, checked (``parse_tools``) and kept as its JSON text."""
    return None if parse_tools(value) is None else value


@dataclass(frozen=True)
class GenerateRequest:
    prompt: str | None                          # text_input (placeholders complete), or None for chat
    conversation: list[dict[str, Any]] | None   # parsed messages, media parts as {"type": Modality.item_part}
    items: tuple[Any, ...]                      # per media item (every modality), in prompt order: what the resolver made
    sampling: dict[str, Any]
    stream: bool = False
    exclude_input_in_output: bool = False
    return_num_input_tokens: bool = False
    return_num_output_tokens: bool = False
    media_embeds: Mapping[str, tuple] | None = None  # set by a consumer: modality name -> (embeds or None, grid_thw)
    media_kwargs: Mapping[str, Mapping[str, Any]] | None = None  # and its other vLLM fields (video timing) per modality
    media_uuids: Mapping[str, tuple[str, ...]] | None = None  # and its items' content keys, per modality (vLLM's ids)
    timings: dict | None = None                 # stage timings to report on the final response
    kv_transfer_params: dict | None = None      # vLLM KV connector parameters (P -> D)
    original_media: tuple[bytes, ...] = ()      # metadata-only off (backend.request.naive_media): one per layout
    session_id: str | None = None               # the conversation this request is a turn of
    media_io: MediaOptions = MediaOptions()     # its media options (metadata-only off: original_media decode alike)
    priority: int = 0                           # its priority class (0: served first; as vLLM's)
    deadline: float | None = None               # Unix time (s) past which no stage works on it
    tools: list[dict] | None = None             # the tools the chat template renders (OpenAI's tool definitions)

    @property
    def prompt_field(self) -> str:
        """The input the prompt came from, for error messages."""
        return "text_input" if self.prompt is not None else "messages"


@dataclass(frozen=True)
class MediaBytes:
    """An encoded media item, the request field it came from (``image[1]``, ``messages[0].content[2]...``) and its
    modality's name."""

    data: bytes
    field: str
    modality: str
    options: str = ""  # its modality's per-request options, canonical JSON (MediaOptions.key): part of its content key


class MediaResolver(Protocol):
    def from_tensor(self, data: bytes, field: str, modality: Modality) -> Any: ...
    def from_url(self, url: str, field: str, modality: Modality) -> Any: ...
    def from_layout(self, text: str, field: str, modality: Modality) -> Any: ...
    def with_options(self, options: MediaOptions) -> "MediaResolver": ...


class DecodeMedia:
    """``llm``: media are decoded here (images into RGB images)."""

    options = MediaOptions()  # this request's (with_options)

    def __init__(self, limits: MediaLimits = MediaLimits()):
        self.limits = limits

    def with_options(self, options: MediaOptions) -> "DecodeMedia":
        """This resolver for one request's media options (its modality's go to each item's loader)."""
        resolver = copy.copy(self)
        resolver.options = options
        return resolver

    def from_tensor(self, data, field, modality):
        return handler(modality).decode(data, field, self.limits, **self.options.kwargs(modality.name))

    def from_url(self, url, field, modality):
        items = handler(modality)
        return items.decode(items.read_url(url, field, self.limits), field, self.limits,
                            **self.options.kwargs(modality.name))

    def from_layout(self, text, field, modality):
        raise InvalidInput(field, "this model takes media, not layout metadata")


class EncodedMedia(DecodeMedia):
    """``epd``: media stay encoded bytes (the encoder decodes them); URLs are read, not decoded."""

    def from_tensor(self, data, field, modality):
        return MediaBytes(check_encoded(data, field, self.limits, modality), field, modality.name,
                          self.options.key(modality.name))

    def from_url(self, url, field, modality):
        return MediaBytes(handler(modality).read_url(url, field, self.limits), field, modality.name,
                          self.options.key(modality.name))


class LayoutMedia:
    """``pd``: metadata-only items; any media is refused, so nothing is ever decoded here. ``embedding_width``: the
    width of the embeddings this model takes (``backend.encode.checkpoint.embedding_width``; None: not checked)."""

    def __init__(self, model_identity: str, embedding_width: int | None = None):
        self.model_identity, self.embedding_width = model_identity, embedding_width

    def with_options(self, options: MediaOptions) -> "LayoutMedia":
        return self  # layouts were made with the options already (their content keys say so)

    def from_tensor(self, data, field, modality):
        raise InvalidInput(field, f"this model takes metadata-only media ({modality.layout_tensor}), not media bytes")

    def from_url(self, url, field, modality):
        raise InvalidInput(field, f"this model takes metadata-only media ({modality.layout_tensor}), not media URLs")

    def from_layout(self, text, field, modality):
        return LayoutMetadata.from_json(text, field, expected_model=self.model_identity,
                                        expected_width=self.embedding_width)


class LayoutOrDecodeMedia(DecodeMedia):
    """``prefill`` / ``decode``: metadata-only items (E/P/D), or media decoded here (P/D: an orchestrator that
    skips the encoders sends both engines the client's media, as vLLM's own P/D proxy does). One request
    takes one kind (``prepare`` of the model refuses a mix)."""

    def __init__(self, model_identity: str, limits: MediaLimits = MediaLimits(), embedding_width: int | None = None):
        super().__init__(limits)
        self.layouts = LayoutMedia(model_identity, embedding_width)

    def from_layout(self, text, field, modality):
        return self.layouts.from_layout(text, field, modality)


def checkpoint_media(model_dir) -> dict[str, Any]:
    """The ``MediaLimits`` fields a checkpoint decides: its HF video processor (which picks vLLM's video loader) and
    its audio feature extractor's sampling rate (what audio items are resampled to)."""
    return {"video_processor": video.video_processor_for(model_dir), "audio_sampling_rate": audio.sampling_rate_for(model_dir)}


def media_of(raw: RawGenerateInputs, m: Modality) -> tuple[bytes, ...]:
    """The request's encoded items of modality ``m`` (its tensor)."""
    return getattr(raw, m.media_field, ())


def layouts_of(raw: RawGenerateInputs, m: Modality) -> tuple[str, ...]:
    """The request's layouts (metadata-only items) of modality ``m``."""
    return getattr(raw, m.layout_field, ())


def parse_generate_request(raw: RawGenerateInputs, resolver: MediaResolver, limits: RequestLimits = RequestLimits(),
                           fmt: PromptFormat = PromptFormat()) -> GenerateRequest:
    has_text, has_messages = raw.prompt is not None, raw.messages is not None
    if has_text == has_messages:
        raise InvalidInput("text_input", "give exactly one of text_input and messages" +
                           (", not both" if has_text else ", got neither"))
    _check_media(raw, limits)
    if raw.media_io:
        resolver = resolver.with_options(raw.media_io)
    sampling = parse_sampling(raw.sampling)
    kv_params = _kv_transfer_params(raw.kv_transfer_params)
    given = {m.name: [resolver.from_tensor(data, f"{m.media_tensor}[{i}]", m) for i, data in enumerate(media_of(raw, m))] +
             _grouped([resolver.from_layout(text, f"{m.layout_tensor}[{i}]", m) for i, text in enumerate(layouts_of(raw, m))])
             for m in modalities()}
    for m in modalities():
        _check_count(m, len(given[m.name]), limits)
    prompt = conversation = None
    if has_text:
        prompt = _text_prompt(raw, {m: len(given[m.name]) for m in modalities()}, fmt)
        items = [item for m in modalities() for item in given[m.name]]
    else:
        conversation, items = _parse_messages(raw.messages, given, resolver, limits)
    return GenerateRequest(
        prompt=prompt, conversation=conversation,
        items=tuple(layout for item in items for layout in (item if isinstance(item, VideoParts) else (item,))), sampling=sampling, stream=raw.stream,
        exclude_input_in_output=raw.exclude_input_in_output,
        return_num_input_tokens=raw.return_num_input_tokens,
        return_num_output_tokens=raw.return_num_output_tokens, kv_transfer_params=kv_params,
        original_media=tuple(raw.original_media), session_id=raw.session_id, media_io=raw.media_io,
        priority=_priority(raw.priority, limits), deadline=raw.deadline, tools=parse_tools(raw.tools),
    )


def _priority(value: int | None, limits: RequestLimits) -> int:
    if value is None:
        return 0
    if value >= limits.priority_levels:
        raise InvalidInput(f"parameters.{PRIORITY_PARAMETER}",
                           f"expected 0 .. {limits.priority_levels - 1} (this deployment's priority_levels), got {value}")
    return value


def _check_media(raw: RawGenerateInputs, limits: RequestLimits) -> None:
    layouts = 0
    for m in modalities():
        media, own = media_of(raw, m), layouts_of(raw, m)
        if media and own:
            raise InvalidInput(m.layout_tensor, f"give media either as {m.media_tensor} or as {m.layout_tensor}, not both")
        _check_count(m, len(media), limits)  # before any is decoded; layouts once their video parts are joined
        layouts += len(own)
    if raw.original_media and len(raw.original_media) != layouts:
        names = " + ".join(m.layout_tensor for m in modalities())
        raise InvalidInput("original_media", f"{len(raw.original_media)} items for {layouts} {names}")


def _check_count(m: Modality, count: int, limits: RequestLimits) -> None:
    limit = getattr(limits, m.limit_field)
    if count > limit:
        raise InvalidInput(m.media_tensor, f"{count} {m.media_field}, over the per-request limit of {limit}")


class VideoParts(tuple):
    """The layouts of one video's parts, in order: one item of a request until ``GenerateRequest.items``."""


def _grouped(layouts: list) -> list:
    """Consecutive parts of one video (``VideoLayout.part``: those past its first join the one before) as one item,
    ``VideoParts``: one placeholder, one item against the limits. ``GenerateRequest.items`` has them flat
    again, in order; ``backend.transfer.engine_inputs.media_grids`` checks that they make up their video."""
    out: list = []
    for layout in layouts:
        part = getattr(getattr(layout, "media", None), "part", None)
        if part is not None and part[0] > 0 and out:
            out[-1] = VideoParts((*out[-1], layout) if isinstance(out[-1], VideoParts) else (out[-1], layout))
        else:
            out.append(layout)
    return out


def _kv_transfer_params(text: str | None) -> dict | None:
    if text is None or not text.strip():
        return None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidInput("kv_transfer_params", f"not valid JSON ({exc.msg})") from None
    if not isinstance(doc, dict):
        raise InvalidInput("kv_transfer_params", "expected a JSON object")
    return doc


def _text_prompt(raw: RawGenerateInputs, counts: dict[Modality, int], fmt: PromptFormat) -> str:
    """``text_input`` with every item's placeholder: those it names (per modality, as many as items given), or,
    naming none, one per item in front."""
    text = raw.prompt
    if not text.strip():
        raise InvalidInput("text_input", "empty prompt")
    found = {m: text.count(fmt.of(m)[0]) for m in counts}
    if not any(found.values()):
        return "".join(fmt.of(m)[1] * count for m, count in counts.items()) + text
    for m, count in counts.items():
        if found[m] != count:
            media_field = m.layout_tensor if layouts_of(raw, m) else m.media_tensor
            raise InvalidInput(media_field if count else "text_input", f"prompt has {found[m]} {m.name} placeholder(s) "
                               f"({fmt.of(m)[0]}) but {count} {m.name}(s) were given")
    return text


def _parse_messages(text: str, given: dict[str, list], resolver: MediaResolver, limits: RequestLimits):
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidInput("messages", f"not valid JSON ({exc.msg} at position {exc.pos})") from None
    if isinstance(doc, dict) and "messages" in doc:
        doc = doc["messages"]
    if not isinstance(doc, list) or not doc:
        raise InvalidInput("messages", "expected a non-empty JSON list of chat messages")
    pending = {name: list(items) for name, items in given.items()}
    conversation, items, kinds = [], [], []
    for i, message in enumerate(doc):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise InvalidInput(where, "expected an object with 'role' and 'content'")
        role = message.get("role")
        if role not in ROLES:
            raise InvalidInput(f"{where}.role", f"expected one of {', '.join(ROLES)}, got {role!r}")
        extra = _tool_fields(message, where)
        content = message.get("content")
        if content is None and extra.get("tool_calls"):
            content = ""  # an assistant turn that only called tools
        if isinstance(content, str):
            conversation.append({"role": role, "content": content, **extra})
            continue
        if not isinstance(content, list):
            raise InvalidInput(f"{where}.content", "expected a string or a list of content parts")
        parts = [_content_part(part, f"{where}.content[{j}]", pending, items, kinds, resolver)
                 for j, part in enumerate(content)]
        conversation.append({"role": role, "content": parts, **extra})
    for m in modalities():
        if pending[m.name]:
            raise InvalidInput(m.media_tensor, f"{len(pending[m.name])} media item(s) not referenced by an "
                                               f"{{\"type\": \"{m.item_part}\"}} part")
    for m in modalities():
        if kinds.count(m.name) > getattr(limits, m.limit_field):
            raise InvalidInput("messages", f"{kinds.count(m.name)} {m.media_field}, over the per-request limit of "
                                           f"{getattr(limits, m.limit_field)}")
    return conversation, items


def _tool_fields(message: dict, where: str) -> dict[str, Any]:
    """A message's tool-calling fields (an assistant's ``tool_calls``, a tool turn's ``tool_call_id`` and ``name``),
    kept for the chat template."""
    extra = {}
    for name, kind in TOOL_FIELDS.items():
        if message.get(name) is not None:
            if not isinstance(message[name], kind):
                raise InvalidInput(f"{where}.{name}", f"expected a {'list' if kind is list else 'string'}")
            extra[name] = message[name]
    return extra


def _content_part(part: Any, where: str, pending: dict[str, list], items: list, kinds: list,
                  resolver: MediaResolver) -> dict:
    if not isinstance(part, dict):
        raise InvalidInput(where, "expected a content part object")
    kind = part.get("type")
    if kind == "text":
        if not isinstance(part.get("text"), str):
            raise InvalidInput(f"{where}.text", "expected a string")
        return {"type": "text", "text": part["text"]}
    found = content_part(kind)
    if found is None:
        names = ["text", *(p for m in modalities() for p in m.parts())]
        raise InvalidInput(f"{where}.type", f"unsupported content type {kind!r}; use {', '.join(names[:-1])} or {names[-1]}")
    m, form = found
    if form == "url":
        ref = part.get(m.url_part)
        url = ref.get("url") if isinstance(ref, dict) else ref
        if not isinstance(url, str):
            raise InvalidInput(f"{where}.{m.url_part}", "expected {\"url\": \"data:...\" | \"file://...\"}")
        items.append(resolver.from_url(url, f"{where}.{m.url_part}", m))
    elif form == "data":
        items.append(resolver.from_tensor(*_part_data(part.get(m.data_part), f"{where}.{m.data_part}", m), m))
    else:
        if not pending[m.name]:
            raise InvalidInput(where, f"an {{\"type\": \"{m.item_part}\"}} part needs a media item ({m.media_tensor} "
                                      f"or {m.layout_tensor}), and none is left")
        items.append(pending[m.name].pop(0))
    kinds.append(m.name)
    return {"type": m.item_part}


def _part_data(ref: Any, where: str, m: Modality) -> tuple[bytes, str]:
    """The item bytes of a data part (``{"data": "<base64>", "format": "wav"}``, vLLM's ``input_audio``) and their
    field (``<where>.data``). ``format`` may be left out; given, it must name a container the modality's decoder reads
    (``Modality.data_formats``, any case), else InvalidInput naming ``<where>.format``. The decoder reads the file's
    own header, so a known name is not compared with the bytes."""
    if not isinstance(ref, dict) or not isinstance(ref.get("data"), str):
        raise InvalidInput(f"{where}.data", "expected {\"data\": \"<base64>\", \"format\": \"wav\" | ...}")
    fmt = ref.get("format")
    if fmt is not None and (not isinstance(fmt, str) or fmt.lower() not in m.data_formats):
        raise InvalidInput(f"{where}.format", f"unknown format {fmt!r}: expected one of {', '.join(m.data_formats)}")
    try:
        data = base64.b64decode(ref["data"], validate=True)
    except (binascii.Error, ValueError):
        raise InvalidInput(f"{where}.data", "not valid base64") from None
    return data, f"{where}.data"
