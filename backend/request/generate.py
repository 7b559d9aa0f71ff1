"""The generate request shared by every generating model (``llm``, ``epd``, ``pd`` ...).

Lifecycle of one request in a model: Triton tensors -> ``RawGenerateInputs`` (typed values, done by
``backend.triton.io``) -> ``parse_generate_request`` -> ``GenerateRequest`` (validated prompt or chat
conversation, media items in prompt order, sampling settings) -> engine. Every problem is an
``InvalidInput`` naming the field.

Prompt forms (exactly one):
- ``text_input``: a prompt that may hold the model's image placeholders. If it holds none and media are
  given, one placeholder per item is put in front of the prompt; otherwise counts must match.
- ``messages``: OpenAI-style chat messages JSON. Image parts are ``{"type": "image_url", "image_url":
  {"url": "data:..." | "file://..."}}`` or ``{"type": "image"}``, which takes the next item of the
  ``image`` tensor (or of ``image_layouts``). The parsed conversation has every image part as
  ``{"type": "image"}``: it is both what the chat template renders and the metadata-only rewrite.

What a media item becomes depends on the model (``MediaResolver``): ``llm`` decodes images, ``epd``
keeps the encoded bytes for its encoders, ``pd`` accepts only layout metadata (never media).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Protocol

from backend.protocol.errors import InvalidInput
from backend.protocol.layout import LayoutMetadata
from backend.request.media import MediaLimits, decode_image, load_image_url, read_image_url
from backend.request.sampling import parse_sampling_parameters

ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class PromptFormat:
    """Model-family prompt conventions (Qwen2-VL's by default)."""

    image_token: str = "<|image_pad|>"
    image_placeholder: str = "<|vision_start|><|image_pad|><|vision_end|>"


@dataclass(frozen=True)
class RequestLimits:
    max_images: int = 8
    media: MediaLimits = field(default_factory=MediaLimits)


@dataclass(frozen=True)
class RawGenerateInputs:
    """The request's inputs as plain Python values; ``None`` where the client sent nothing."""

    text_input: str | None = None
    messages: str | None = None
    images: tuple[bytes, ...] = ()
    image_layouts: tuple[str, ...] = ()
    stream: bool = False
    sampling_parameters: str | None = None
    exclude_input_in_output: bool = False
    return_num_input_tokens: bool = False
    return_num_output_tokens: bool = False
    kv_transfer_params: str | None = None      # JSON, between prefill and decode stages
    original_media: tuple[bytes, ...] = ()     # metadata-only off: the client's media beside image_layouts


@dataclass(frozen=True)
class GenerateRequest:
    prompt: str | None                          # text_input (placeholders complete), or None for chat
    conversation: list[dict[str, Any]] | None   # parsed messages, image parts as {"type": "image"}
    images: tuple[Any, ...]                     # per media item, in prompt order: what the resolver made
    sampling: dict[str, Any]
    stream: bool = False
    exclude_input_in_output: bool = False
    return_num_input_tokens: bool = False
    return_num_output_tokens: bool = False
    image_embeds: Any = None                    # set by a consumer once pulled: (embeds, grid_thw)
    timings: dict | None = None                 # stage timings to report on the final response
    kv_transfer_params: dict | None = None      # vLLM KV connector parameters (P -> D)
    original_media: tuple[bytes, ...] = ()      # metadata-only off (backend.diagnostics.naive_media): one per layout

    @property
    def prompt_field(self) -> str:
        """The input the prompt came from, for error messages."""
        return "text_input" if self.prompt is not None else "messages"


@dataclass(frozen=True)
class MediaBytes:
    """An encoded media item and the request field it came from (``image[1]``, ``messages[0].content[2]...``)."""

    data: bytes
    field: str


class MediaResolver(Protocol):
    def from_tensor(self, data: bytes, field: str) -> Any: ...
    def from_url(self, url: str, field: str) -> Any: ...
    def from_layout(self, text: str, field: str) -> Any: ...


class DecodeMedia:
    """``llm``: media are decoded into RGB images here."""

    def __init__(self, limits: MediaLimits = MediaLimits()):
        self.limits = limits

    def from_tensor(self, data, field):
        return decode_image(data, field, self.limits)

    def from_url(self, url, field):
        return load_image_url(url, field, self.limits)

    def from_layout(self, text, field):
        raise InvalidInput(field, "this model takes media, not layout metadata")


class EncodedMedia(DecodeMedia):
    """``epd``: media stay encoded bytes (the encoder decodes them); URLs are read, not decoded."""

    def from_tensor(self, data, field):
        if not data:
            raise InvalidInput(field, "empty image")
        if len(data) > self.limits.max_item_bytes:
            raise InvalidInput(field, f"image is {len(data)} bytes, over the {self.limits.max_item_bytes}-byte limit")
        return MediaBytes(bytes(data), field)

    def from_url(self, url, field):
        return MediaBytes(read_image_url(url, field, self.limits), field)


class LayoutMedia:
    """``pd``: metadata-only items; any media is refused, so nothing is ever decoded here."""

    def __init__(self, model_identity: str):
        self.model_identity = model_identity

    def from_tensor(self, data, field):
        raise InvalidInput(field, "this model takes metadata-only media (image_layouts), not media bytes")

    def from_url(self, url, field):
        raise InvalidInput(field, "this model takes metadata-only media (image_layouts), not media URLs")

    def from_layout(self, text, field):
        return LayoutMetadata.from_json(text, field, expected_model=self.model_identity)


class LayoutOrDecodeMedia(DecodeMedia):
    """``prefill`` / ``decode``: metadata-only items (E/P/D), or media decoded here (P/D: an orchestrator that
    skips the encoders sends both engines the client's media, as vLLM's own P/D proxy does). One request
    takes one kind (``prepare`` of the model refuses a mix)."""

    def __init__(self, model_identity: str, limits: MediaLimits = MediaLimits()):
        super().__init__(limits)
        self.layouts = LayoutMedia(model_identity)

    def from_layout(self, text, field):
        return self.layouts.from_layout(text, field)


def parse_generate_request(raw: RawGenerateInputs, resolver: MediaResolver, limits: RequestLimits = RequestLimits(),
                           fmt: PromptFormat = PromptFormat()) -> GenerateRequest:
    has_text, has_messages = raw.text_input is not None, raw.messages is not None
    if has_text == has_messages:
        raise InvalidInput("text_input", "give exactly one of text_input and messages" +
                           (", not both" if has_text else ", got neither"))
    if raw.images and raw.image_layouts:
        raise InvalidInput("image_layouts", "give media either as image or as image_layouts, not both")
    given = len(raw.images) + len(raw.image_layouts)
    if given > limits.max_images:
        raise InvalidInput("image", f"{given} images, over the per-request limit of {limits.max_images}")
    if raw.original_media and len(raw.original_media) != len(raw.image_layouts):
        raise InvalidInput("original_media", f"{len(raw.original_media)} items for {len(raw.image_layouts)} image_layouts")
    sampling = parse_sampling_parameters(raw.sampling_parameters)
    kv_params = _kv_transfer_params(raw.kv_transfer_params)
    items = ([resolver.from_tensor(data, f"image[{i}]") for i, data in enumerate(raw.images)] +
             [resolver.from_layout(text, f"image_layouts[{i}]") for i, text in enumerate(raw.image_layouts)])
    prompt = conversation = None
    if has_text:
        prompt = _text_prompt(raw.text_input, len(items), fmt, "image_layouts" if raw.image_layouts else "image")
    else:
        conversation, items = _parse_messages(raw.messages, items, resolver)
        if len(items) > limits.max_images:
            raise InvalidInput("messages", f"{len(items)} images, over the per-request limit of {limits.max_images}")
    return GenerateRequest(
        prompt=prompt, conversation=conversation, images=tuple(items), sampling=sampling, stream=raw.stream,
        exclude_input_in_output=raw.exclude_input_in_output,
        return_num_input_tokens=raw.return_num_input_tokens,
        return_num_output_tokens=raw.return_num_output_tokens, kv_transfer_params=kv_params,
        original_media=tuple(raw.original_media),
    )


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


def _text_prompt(text: str, count: int, fmt: PromptFormat, media_field: str) -> str:
    if not text.strip():
        raise InvalidInput("text_input", "empty prompt")
    found = text.count(fmt.image_token)
    if found == 0 and count:
        return fmt.image_placeholder * count + text
    if found != count:
        raise InvalidInput(media_field if count else "text_input",
                           f"prompt has {found} image placeholder(s) ({fmt.image_token}) but {count} image(s) were given")
    return text


def _parse_messages(text: str, tensor_items: list, resolver: MediaResolver):
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidInput("messages", f"not valid JSON ({exc.msg} at position {exc.pos})") from None
    if isinstance(doc, dict) and "messages" in doc:
        doc = doc["messages"]
    if not isinstance(doc, list) or not doc:
        raise InvalidInput("messages", "expected a non-empty JSON list of chat messages")
    pending = list(tensor_items)
    conversation, items = [], []
    for i, message in enumerate(doc):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise InvalidInput(where, "expected an object with 'role' and 'content'")
        role = message.get("role")
        if role not in ROLES:
            raise InvalidInput(f"{where}.role", f"expected one of {', '.join(ROLES)}, got {role!r}")
        content = message.get("content")
        if isinstance(content, str):
            conversation.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise InvalidInput(f"{where}.content", "expected a string or a list of content parts")
        parts = [_content_part(part, f"{where}.content[{j}]", pending, items, resolver) for j, part in enumerate(content)]
        conversation.append({"role": role, "content": parts})
    if pending:
        raise InvalidInput("image", f"{len(pending)} media item(s) not referenced by an {{\"type\": \"image\"}} part")
    return conversation, items


def _content_part(part: Any, where: str, pending: list, items: list, resolver: MediaResolver) -> dict:
    if not isinstance(part, dict):
        raise InvalidInput(where, "expected a content part object")
    kind = part.get("type")
    if kind == "text":
        if not isinstance(part.get("text"), str):
            raise InvalidInput(f"{where}.text", "expected a string")
        return {"type": "text", "text": part["text"]}
    if kind == "image_url":
        ref = part.get("image_url")
        url = ref.get("url") if isinstance(ref, dict) else ref
        if not isinstance(url, str):
            raise InvalidInput(f"{where}.image_url", "expected {\"url\": \"data:...\" | \"file://...\"}")
        items.append(resolver.from_url(url, f"{where}.image_url"))
        return {"type": "image"}
    if kind == "image":
        if not pending:
            raise InvalidInput(where, "an {\"type\": \"image\"} part needs a media item (image or image_layouts), and none is left")
        items.append(pending.pop(0))
        return {"type": "image"}
    raise InvalidInput(f"{where}.type", f"unsupported content type {kind!r}; use text, image_url or image")
