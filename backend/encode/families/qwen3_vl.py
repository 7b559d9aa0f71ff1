"""Qwen3-VL: frames with their ``VideoMetadata``; where the loader kept every frame it leaves the sampling to the
processor (``do_sample_frames``), which vLLM decides per video (``Qwen3VLMultiModalProcessor._call_hf_processor``
calls the processor once a video). The encoder calls it once for many videos, so ``sample_frames`` samples such a
video first, with the processor's own ``sample_frames`` (the frames and indices vLLM's processor takes), and every
video then goes in with ``do_sample_frames`` off: one flag for the whole call would sample an already sampled video
with another's setting (an IndexError, or other frames than ``llm``'s). ``timestamps``: per temporal patch the mean
time of its frames (``Qwen3VLProcessingInfo._calculate_timestamps``: frame index / source fps, the last frame
repeated to fill a patch). Its video processor sizes frames by their count (its pixel budget is for all frames).

The tower (``Qwen3VLVisionModel``, run by transformers: the packed tower does not implement it) returns the merged
embeddings and one per DeepStack level; vLLM takes them concatenated, ``out_hidden_size x (1 +
len(deepstack_visual_indexes))`` wide (``base.config_width``, ``Family.tower_output``).
"""
from __future__ import annotations

from typing import Any

from backend.encode.families.base import Family, VisionTower, video_metadata


def _tower_class() -> type:
    # deferred: transformers is heavy, and only the encoder builds a tower
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

    return Qwen3VLVisionModel


class Qwen3VLFamily(Family):
    def sample_frames(self, video_processor, video):
        """Where the loader left the sampling to the processor (``do_sample_frames``): the frames the processor's
        ``sample_frames`` takes, and ``do_sample_frames`` off."""
        if not video.metadata.get("do_sample_frames", False):
            return video
        indices = [int(i) for i in video_processor.sample_frames(video_metadata(video))]
        metadata = dict(video.metadata, frames_indices=indices, do_sample_frames=False)
        return type(video)(video.frames[indices], metadata)

    def video_kwargs(self, videos: list) -> dict[str, Any]:
        return {"video_metadata": [video_metadata(v) for v in videos], "do_sample_frames": False}

    def video_timing(self, video, temporal_patch_size: int) -> dict[str, Any]:
        return {"timestamps": tuple(frame_timestamps(video.metadata["frames_indices"], video.metadata["fps"],
                                                     temporal_patch_size))}

    def resize_depends_on_frames(self, video_processor) -> bool:
        return True


def frame_timestamps(indices, fps: float, temporal_patch_size: int) -> list[float]:
    """The time of each temporal patch: the mean of its first and last frame's ``index / fps`` (the last frame
    repeated to fill the final patch), as vLLM's ``Qwen3VLProcessingInfo._calculate_timestamps``."""
    indices = list(indices)
    if len(indices) % temporal_patch_size:
        indices += [indices[-1]] * (temporal_patch_size - len(indices) % temporal_patch_size)
    seconds = [index / fps for index in indices]
    last = temporal_patch_size - 1
    return [(seconds[i] + seconds[i + last]) / 2 for i in range(0, len(seconds), temporal_patch_size)]


FAMILY = Qwen3VLFamily("qwen3_vl", vision=VisionTower(_tower_class), tiny_recipe="qwen3_vl")
