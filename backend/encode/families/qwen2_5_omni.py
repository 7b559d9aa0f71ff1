"""Qwen2.5-Omni (its thinker; vLLM 0.32 serves ``Qwen2_5OmniModel`` / ``Qwen2_5OmniForConditionalGeneration`` with
``Qwen2_5OmniThinkerForConditionalGeneration`` and skips the talker): a vision tower (images and videos) and an audio
tower in one checkpoint, their configs under ``thinker_config``, their tensors under ``thinker.``.

- Vision: Qwen2.5-VL's windowed tower (transformers' ``Qwen2_5OmniVisionEncoder``, run by transformers: the packed
  tower is not checked against it), ``out_hidden_size`` wide; a video's layout carries ``second_per_grid_ts`` as
  Qwen2.5-VL's does (``Qwen2_5VLFamily.video_timing``).
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

from backend.encode.families.base import AudioTower, VisionTower, config_width
from backend.encode.families.qwen2_5_vl import Qwen2_5VLFamily
from backend.protocol.modality import AUDIO, IMAGE, VIDEO


def _vision_class() -> type:
    # deferred: transformers is heavy, and only the encoder builds a tower
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniVisionEncoder

    return Qwen2_5OmniVisionEncoder


def _audio_class() -> type:
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniAudioEncoder

    return Qwen2_5OmniAudioEncoder


class Qwen2_5OmniFamily(Qwen2_5VLFamily):
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
