"""A patch of vLLM's Qwen2.5-Omni thinker: precomputed audio embeddings through the audio modality's embedding input,
``{"audio": {"audio_embeds": [tensor per item], "audio_num_tokens": [tokens per item]}}`` (what the consumers give
every family: ``backend.protocol.modality.AUDIO``; Qwen2-Audio takes it unpatched), and the token counts alone on a
KV consumer (``decode``: vLLM's ``allow_missing_mm_embeddings``).

vLLM 0.32's thinker takes, as audio "embeddings", only mel features (``input_audio_features`` with
``audio_feature_lengths``) and runs its audio tower on them: the encoder's output could not reach the language model.
The patch (switched on by ``EPD_OMNI_AUDIO_EMBEDS=1``, which ``backend.engine.host.PROCESS_ENV_DEFAULTS`` sets):

- the data parser turns such a dict into embedding items with ``audio_feature_lengths`` = 4 x tokens - 1, a mel
  length the tower maps to exactly that many tokens (``((f - 1) // 2 + 1 - 2) // 2 + 1``): the prompt update and the
  M-RoPE positions of a standalone audio item depend on its token count only;
- the model takes ``audio_embeds`` as they are (no tower) where they are given;
- precomputed image and video embeddings are split per item (vLLM 0.32's thinker hands them on as one tensor,
  which fails every such request: ``_split_embeds``).

``use_audio_in_video`` (audio interleaved in a video's chunks) is not served this way.
"""
from __future__ import annotations

import torch

from backend.protocol.versions import Guard

OMNI_AUDIO = Guard("Qwen2.5-Omni audio embeddings", "vllm", "0.32", "0.33",
                   "Qwen2.5-Omni's thinker refuses precomputed audio embeddings: epd and epd_disagg fail audio "
                   "items on that family")


def feature_lengths(tokens: torch.Tensor) -> torch.Tensor:
    """A mel length per item that the audio tower turns into ``tokens`` tokens."""
    return torch.as_tensor(tokens, dtype=torch.int64).flatten() * 4 - 1


def patch_omni_audio_embeds() -> None:
    """Idempotent; skipped (logged) outside the checked vLLM versions."""
    from vllm.model_executor.models import qwen2_5_omni_thinker as omni

    parser, model = omni.Qwen2_5OmniThinkerMultiModalDataParser, omni.Qwen2_5OmniThinkerForConditionalGeneration
    if not OMNI_AUDIO.allows(parser, "_parse_audio_data") or not OMNI_AUDIO.allows(
            model, "_parse_and_validate_multimodal_inputs", "embed_multimodal"):
        return
    if getattr(parser._parse_audio_data, "epd_patched", False):
        return
    omni.create_qwen2_5_omni_thinker_field_factory = _fields_factory(omni.create_qwen2_5_omni_thinker_field_factory,
                                                                     omni.MultiModalFieldConfig)
    parser._parse_audio_data = _parse_audio_data(parser._parse_audio_data, omni)
    model.embed_multimodal = _embed_multimodal(model.embed_multimodal)
    for name, grid in (("_process_image_input", "image_grid_thw"), ("_process_video_input", "video_grid_thw")):
        setattr(model, name, _split_embeds(getattr(model, name), grid))


def _fields_factory(real, field_config):
    """vLLM's field factory of the thinker (its processor's and the parser's), with ``audio_embeds`` one tensor per
    audio item."""
    def create(spatial_merge_size: int):
        factory = real(spatial_merge_size)
        return lambda hf_inputs: {**factory(hf_inputs), "audio_embeds": field_config.batched("audio")}

    return create


def _parse_audio_data(real, omni):
    def parse(self, data):
        if not isinstance(data, dict) or "audio_num_tokens" not in data:
            return real(self, data)
        fields = {"audio_feature_lengths": feature_lengths(data["audio_num_tokens"])}
        if data.get("audio_embeds") is not None:
            fields["audio_embeds"] = data["audio_embeds"]
        elif not self.allow_missing_mm_embeddings:
            raise ValueError("audio: audio_num_tokens without audio_embeds")
        factory = omni.create_qwen2_5_omni_thinker_field_factory(self._spatial_merge_size)
        return omni.DictEmbeddingItems(fields, modality="audio", required_fields={"audio_feature_lengths"},
                                       optional_fields={"audio_embeds"}, fields_factory=factory)

    parse.epd_patched = True
    return parse


def _split_embeds(real, grid_key: str):
    """vLLM 0.32's thinker returns precomputed image or video embeddings as one tensor, which its caller takes row by
    row (``Expected number of multimodal embeddings to match number of input items: 1, but got
    len(mm_embeddings)=12``): split per item by its grid, as Qwen2.5-VL's model does."""
    def process(self, inputs):
        out = real(self, inputs)
        if not isinstance(out, torch.Tensor):
            return out
        grid = inputs[grid_key]
        merge = self.config.vision_config.spatial_merge_size
        return out.split((grid.prod(-1) // merge // merge).tolist())

    return process


def _embed_multimodal(real):
    def embed(self, **kwargs):
        audio = kwargs.pop("audio_embeds", None)
        if audio is None:
            return real(self, **kwargs)
        kwargs.pop("audio_feature_lengths", None)
        rest = tuple(real(self, **kwargs)) if kwargs else ()
        # the items of each modality in the order their inputs came (vLLM groups a batch's features by modality)
        if isinstance(audio, torch.Tensor):  # items of one size come stacked, [items, tokens, hidden]
            audio = list(audio) if audio.dim() == 3 else [audio]
        return rest + tuple(a.to(self.visual.dtype) for a in audio)

    return embed
