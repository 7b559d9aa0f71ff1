"""Qwen2.5-VL: frames only into the video processor (vLLM passes the metadata to the HF processor, which uses it for
the timing alone); ``second_per_grid_ts`` = temporal_patch_size / the sampled fps, as
``Qwen2_5_VLProcessor._process_videos`` computes it (``VideoMetadata.sampled_fps``: sampled frames / total frames x
the source fps). The packed tower implements its vision tower (window attention except in
``fullatt_block_indexes``, RMSNorm, gated MLP)."""
from __future__ import annotations

from typing import Any

from backend.encode.families.base import Family, VisionTower, video_metadata


def _tower_class() -> type:
    # deferred: transformers is heavy, and only the encoder builds a tower
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    return Qwen2_5_VisionTransformerPretrainedModel


class Qwen2_5VLFamily(Family):
    def video_timing(self, video, temporal_patch_size: int) -> dict[str, Any]:
        return {"second_per_grid_ts": temporal_patch_size / video_metadata(video).sampled_fps}


FAMILY = Qwen2_5VLFamily("qwen2_5_vl", vision=VisionTower(_tower_class, packed=True), tiny_recipe="qwen2_5_vl")
