"""The media modalities a request may carry, each declared once: what its items are called in chat messages, in
Triton tensors, in the typed request, in prompts and in vLLM.

Shared code (request parsing, the orchestrator's rewrite to metadata-only, tensor I/O, the model repository's tensor
lists in ``backend.protocol.generate``) iterates over ``modalities()`` instead of naming images. A new modality is its
``Modality`` registered here plus one module per stage that handles its items (``backend.request.image``: loading and
validating images; ``backend.encode.encoder``: the vision tower), and its two fields in the typed requests
(``RawGenerateInputs``, the client's ``GenerateInputs``). Images and videos are registered (``backend.request.video``:
loading and validating videos; the Qwen2-VL tower encodes both), and audio (``backend.request.audio``; Qwen2-Audio's
audio tower, ``backend.encode.audio``), whose chat parts also carry base64 data (``input_audio``, as in vLLM's OpenAI
chat API).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Modality:
    name: str               # LayoutMetadata.modality, and the stage modules' registry key
    url_part: str           # chat content part naming an item by URL: {"type": "image_url", "image_url": {"url": ...}}
    item_part: str          # chat content part taking the next tensor item: {"type": "image"} (also the rewrite's form)
    media_tensor: str       # the Triton input of encoded items (client -> llm / epd; P/D: prefill, decode)
    layout_tensor: str      # the Triton input of metadata-only items (epd -> pd / prefill / decode)
    media_field: str        # RawGenerateInputs / GenerateInputs attribute of the encoded items
    layout_field: str       # RawGenerateInputs / GenerateInputs attribute of the layouts
    media_type: str         # the MIME type prefix a data: URL of an item must have
    placeholder_token: str  # the model family's token of one item in a prompt (Qwen2-VL's; Qwen2-Audio's)
    placeholder: str        # what one item becomes in a prompt that names none
    limit_key: str          # vLLM's limit_mm_per_prompt key
    data_key: str           # vLLM's multi_modal_data key
    embeds_key: str         # vLLM's embedding input form: {embeds_key: tensor, grid_key: grid}
    grid_key: str           # (audio: {"audio_embeds": [tensor per item], "audio_num_tokens": [tokens per item]})
    limit_field: str        # the RequestLimits attribute of the per-request item limit
    embeds_per_item: bool = False  # vLLM takes the embeddings as a list, one tensor per item (not concatenated)
    data_part: str = ""     # a chat content part carrying an item's base64 data: {data_part: {"data": ..., "format": ..}}
    data_formats: tuple[str, ...] = ()  # the "format" names such a part may give (lowercase; the decoder's containers)


    def parts(self) -> tuple[str, ...]:
        """The chat content part types of this modality's items."""
        return tuple(p for p in (self.url_part, self.data_part, self.item_part) if p)


_REGISTRY: dict[str, Modality] = {}


def register(modality: Modality) -> Modality:
    """Add ``modality`` (after those registered before it: tensor lists and item order follow registration)."""
    if modality.name in _REGISTRY:
        raise ValueError(f"modality {modality.name!r} is already registered")
    taken = {part for m in _REGISTRY.values() for part in m.parts()} | {"text"}
    if set(modality.parts()) & taken:
        raise ValueError(f"modality {modality.name!r}: content part types {modality.url_part!r}/{modality.item_part!r} "
                         "are taken")
    _REGISTRY[modality.name] = modality
    return modality


def unregister(name: str) -> None:
    del _REGISTRY[name]


def modalities() -> tuple[Modality, ...]:
    return tuple(_REGISTRY.values())


def modality(name: str) -> Modality:
    return _REGISTRY[name]


def content_part(part_type: object) -> tuple[Modality, str] | None:
    """The modality of a chat content part type and how the part gives its item: ``"url"`` (it names it by URL),
    ``"data"`` (it carries its base64 data) or ``"item"`` (it takes the next tensor item); None: no modality's part."""
    for m in _REGISTRY.values():
        for form, part in (("url", m.url_part), ("data", m.data_part), ("item", m.item_part)):
            if part and part_type == part:
                return m, form
    return None


IMAGE = register(Modality(
    name="image", url_part="image_url", item_part="image", media_tensor="image", layout_tensor="image_layouts",
    media_field="images", layout_field="image_layouts", media_type="image/", placeholder_token="<|image_pad|>",
    placeholder="<|vision_start|><|image_pad|><|vision_end|>", limit_key="image", data_key="image",
    embeds_key="image_embeds", grid_key="image_grid_thw", limit_field="max_images"))
VIDEO = register(Modality(
    name="video", url_part="video_url", item_part="video", media_tensor="video", layout_tensor="video_layouts",
    media_field="videos", layout_field="video_layouts", media_type="video/", placeholder_token="<|video_pad|>",
    placeholder="<|vision_start|><|video_pad|><|vision_end|>", limit_key="video", data_key="video",
    embeds_key="video_embeds", grid_key="video_grid_thw", limit_field="max_videos"))
AUDIO = register(Modality(
    name="audio", url_part="audio_url", item_part="audio", media_tensor="audio", layout_tensor="audio_layouts",
    media_field="audios", layout_field="audio_layouts", media_type="audio/", placeholder_token="<|AUDIO|>",
    placeholder="<|audio_bos|><|AUDIO|><|audio_eos|>", limit_key="audio", data_key="audio",
    embeds_key="audio_embeds", grid_key="audio_num_tokens", limit_field="max_audios", embeds_per_item=True,
    data_part="input_audio", data_formats=("wav", "mp3", "flac", "ogg", "aiff", "au", "caf", "w64", "rf64")))
