"""The generate request shared by every generating model (``llm``, ``epd``, ``pd`` ...).

Lifecycle of one request in a model: Triton tensors -> ``RawGenerateInputs`` (typed values, done by
``backend.triton_io``) -> ``parse_generate_request`` -> ``GenerateRequest`` (validated prompt, decoded
images, sampling settings) -> engine. Every problem is an ``InvalidInput`` naming the field.

Prompt forms (exactly one):
- ``text_input``: a prompt that may hold the model's image placeholders. If it holds none and images are
  given, one placeholder per image is put in front of the prompt; otherwise counts must match.
- ``messages``: OpenAI-style chat messages JSON. Image parts are ``{"type": "image_url", "image_url":
  {"url": "data:..." | "file://..."}}`` or ``{"type": "image"}``, which takes the next ``image`` tensor item.
  The model's chat template is applied server-side (``ChatRenderer``).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Protocol

from PIL import Image

from backend.errors import InvalidInput
from backend.media import MediaLimits, decode_image, load_image_url
from backend.sampling import parse_sampling_parameters

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
    stream: bool = False
    sampling_parameters: str | None = None
    exclude_input_in_output: bool = False
    return_num_input_tokens: bool = False
    return_num_output_tokens: bool = False


@dataclass(frozen=True)
class GenerateRequest:
    prompt: str
    images: tuple[Image.Image, ...]
    sampling: dict[str, Any]
    stream: bool = False
    exclude_input_in_output: bool = False
    return_num_input_tokens: bool = False
    return_num_output_tokens: bool = False
    prompt_field: str = "text_input"  # the input the prompt came from, for error messages


class ChatRenderer(Protocol):
    def __call__(self, conversation: list[dict[str, Any]]) -> str:
        """Apply the model's chat template (with the generation prompt) to a conversation whose
        content parts are ``{"type": "text", "text": ...}`` or ``{"type": "image"}``."""


def parse_generate_request(raw: RawGenerateInputs, render_chat: ChatRenderer,
                           limits: RequestLimits = RequestLimits(), fmt: PromptFormat = PromptFormat()) -> GenerateRequest:
    has_text, has_messages = raw.text_input is not None, raw.messages is not None
    if has_text == has_messages:
        raise InvalidInput("text_input", "give exactly one of text_input and messages" +
                           (", not both" if has_text else ", got neither"))
    if len(raw.images) > limits.max_images:
        raise InvalidInput("image", f"{len(raw.images)} images, over the per-request limit of {limits.max_images}")
    sampling = parse_sampling_parameters(raw.sampling_parameters)
    tensor_images = [decode_image(data, f"image[{i}]", limits.media) for i, data in enumerate(raw.images)]
    if has_text:
        prompt, images = _text_prompt(raw.text_input, tensor_images, fmt), tensor_images
    else:
        conversation, images = _parse_messages(raw.messages, tensor_images, limits)
        prompt = render_chat(conversation)
    if len(images) > limits.max_images:
        raise InvalidInput("messages", f"{len(images)} images, over the per-request limit of {limits.max_images}")
    return GenerateRequest(
        prompt=prompt, images=tuple(images), sampling=sampling, stream=raw.stream,
        exclude_input_in_output=raw.exclude_input_in_output,
        return_num_input_tokens=raw.return_num_input_tokens,
        return_num_output_tokens=raw.return_num_output_tokens,
        prompt_field="text_input" if has_text else "messages",
    )


def _text_prompt(text: str, images: list[Image.Image], fmt: PromptFormat) -> str:
    if not text.strip():
        raise InvalidInput("text_input", "empty prompt")
    found = text.count(fmt.image_token)
    if found == 0 and images:
        return fmt.image_placeholder * len(images) + text
    if found != len(images):
        raise InvalidInput("image" if images else "text_input",
                           f"prompt has {found} image placeholder(s) ({fmt.image_token}) but {len(images)} image(s) were given")
    return text


def _parse_messages(text: str, tensor_images: list[Image.Image], limits: RequestLimits):
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidInput("messages", f"not valid JSON ({exc.msg} at position {exc.pos})") from None
    if isinstance(doc, dict) and "messages" in doc:
        doc = doc["messages"]
    if not isinstance(doc, list) or not doc:
        raise InvalidInput("messages", "expected a non-empty JSON list of chat messages")
    pending = list(tensor_images)
    conversation, images = [], []
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
        parts = []
        for j, part in enumerate(content):
            parts.append(_content_part(part, f"{where}.content[{j}]", pending, images, limits))
        conversation.append({"role": role, "content": parts})
    if pending:
        raise InvalidInput("image", f"{len(pending)} image tensor item(s) not referenced by an {{\"type\": \"image\"}} part")
    return conversation, images


def _content_part(part: Any, where: str, pending: list, images: list, limits: RequestLimits) -> dict:
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
        images.append(load_image_url(url, f"{where}.image_url", limits.media))
        return {"type": "image"}
    if kind == "image":
        if not pending:
            raise InvalidInput(where, "an {\"type\": \"image\"} part needs an item in the image tensor, and none is left")
        images.append(pending.pop(0))
        return {"type": "image"}
    raise InvalidInput(f"{where}.type", f"unsupported content type {kind!r}; use text, image_url or image")
