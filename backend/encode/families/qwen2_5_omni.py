"""Qwen2.5-Omni (its thinker; vLLM 0.32 serves ``Qwen2_5OmniModel`` / ``Qwen2_5OmniForConditionalGeneration`` with
``Qwen2_5OmniThinkerForConditionalGeneration`` and skips the talker): a vision tower (images and videos) and an audio
tower in one checkpoint, their configs under ``thinker_config``, their tensors under ``thinker.``.

- Vision: Qwen2.5-VL's windowed tower (transformers' ``Qwen2_5OmniVisionEncoder``, run by transformers: the packed
  tower is not checked against it), ``out_hidden_size`` wide.
- Video: vLLM calls ``Qwen2_5OmniProcessor``, whose own defaults size the frames (``VIDEO_SIZE``: 128 to 768 merge
  units of 28 px per frame; they override the video processor's saved ``size``), and whose ``second_per_grid_ts`` is
  ``temporal_patch_size`` / 2.0 whatever the video (vLLM passes no fps, and the processor takes 2.0 then): the encoder
  calls the video processor with that size and the layout carries that timing.
- Audio: transformers' ``Qwen2_5OmniAudioEncoder`` (the module vLLM runs), which takes the items' mel frames
  concatenated with their lengths, attends within chunks of ``n_window`` x 2 frames and projects to ``output_dim``
  itself (no separate projector).
- Widths per modality: the vision tower's ``out_hidden_size`` for images and videos, the audio tower's ``output_dim``
  for audio (both the language model's hidden size in the published checkpoints).
- Placeholders: ``<|IMAGE|>``, ``<|VIDEO|>`` (between ``<|vision_start|>`` / ``<|vision_end|>``, as vLLM's
  ``get_placeholder_str``), ``<|AUDIO|>`` between ``<|audio_bos|>`` / ``<|audio_eos|>``.
"""
from __future__ import annotations

from typing import Any, Mapping

from backend.encode.families.base import AudioTower, Family, VisionTower, config_width
from backend.protocol.modality import AUDIO, IMAGE, VIDEO


def _vision_class() -> type:
    # deferred: transformers is heavy, and only the encoder builds a tower
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniVisionEncoder

    return Qwen2_5OmniVisionEncoder


def _audio_class() -> type:
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniAudioEncoder

    return Qwen2_5OmniAudioEncoder


# Qwen2_5OmniProcessorKwargs._defaults (transformers 5.19): what vLLM's processor call resizes video frames with
VIDEO_SIZE = {"shortest_edge": 128 * 28 * 28, "longest_edge": 768 * 28 * 28}
PROCESSOR_FPS = 2.0  # Qwen2_5OmniProcessor's fps where its call gives none (vLLM gives none)


class Qwen2_5OmniFamily(Family):
    def video_kwargs(self, videos: list) -> dict[str, Any]:
        return {"size": dict(VIDEO_SIZE)}

    def video_timing(self, video, temporal_patch_size: int) -> dict[str, Any]:
        return {"second_per_grid_ts": temporal_patch_size / PROCESSOR_FPS}

    def embedding_widths(self, config: Mapping[str, Any]) -> dict[str, int]:
        thinker = self.tower_config(config)
        vision = config_width(thinker, thinker["vision_config"].get("out_hidden_size"))
        audio = int(thinker["audio_config"]["output_dim"])
        return {IMAGE.name: vision, VIDEO.name: vision, AUDIO.name: audio}


FAMILY = Qwen2_5OmniFamily(
    "qwen2_5_omni",
    vision=VisionTower(_vision_class, prefixes=("thinker.visual.",)),
    audio=AudioTower(_audio_class, prefixes=("thinker.audio_tower.",), projector_prefixes=(), packed_features=True),
    placeholders={IMAGE.name: ("<|IMAGE|>", "<|vision_start|><|IMAGE|><|vision_end|>"),
                  VIDEO.name: ("<|VIDEO|>", "<|vision_start|><|VIDEO|><|vision_end|>"),
                  AUDIO.name: ("<|AUDIO|>", "<|audio_bos|><|AUDIO|><|audio_eos|>")},
    tiny_recipe="qwen2_5_omni", towers_config="thinker_config")
