"""Qwen2-VL: frames only into the video processor (vLLM's data parser drops the loader's metadata for it); no video
timing. Its config's ``vision_config.hidden_size`` is the merger's output (there is no ``out_hidden_size``); the
packed tower implements its vision tower (full attention per image, LayerNorm, fc1/fc2 MLP)."""
from __future__ import annotations

from typing import Any, Mapping

from backend.encode.families.base import Family, VisionTower, config_width


def _tower_class() -> type:
    # deferred: transformers is heavy, and only the encoder builds a tower
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

    return Qwen2VisionTransformerPretrainedModel


class Qwen2VLFamily(Family):
    def embedding_widths(self, config: Mapping[str, Any]) -> dict[str, int]:
        vision = config.get("vision_config", {})
        width = config_width(config, vision.get("out_hidden_size") or vision.get("hidden_size"))
        return {name: width for name in self.modalities}


FAMILY = Qwen2VLFamily("qwen2_vl", vision=VisionTower(_tower_class, packed=True), tiny_recipe="qwen2_vl")
