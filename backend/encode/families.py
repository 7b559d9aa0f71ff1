"""What the encoder does differently per model family (``model_type`` of the checkpoint's config): the vision tower's
transformers class, whether the packed tower runs it, how the video processor is called and the video timing the
layout carries. Each rule here mirrors what vLLM 0.32's own processing of that family does with the raw video (the
``llm`` baseline), so the embeddings and the prompt built from the layout are the baseline's.

- ``qwen2_vl``: frames only (vLLM's data parser drops the loader's metadata for it); no timing.
- ``qwen2_5_vl``: frames only into the video processor (vLLM passes the metadata to the HF processor, which uses it
  for the timing alone); ``second_per_grid_ts`` = temporal_patch_size / the sampled fps, as
  ``Qwen2_5_VLProcessor._process_videos`` computes it (``VideoMetadata.sampled_fps``: sampled frames / total
  frames x the source fps).
- ``qwen3_vl``: frames with their ``VideoMetadata``; where the loader kept every frame it leaves the sampling to the
  processor (``do_sample_frames``), which vLLM decides per video (``Qwen3VLMultiModalProcessor._call_hf_processor``
  calls the processor once a video). The encoder calls it once for many videos, so ``sample_frames`` samples such a
  video first, with the processor's own ``sample_frames`` (the frames and indices vLLM's processor takes), and every
  video then goes in with ``do_sample_frames`` off: one flag for the whole call would sample an already sampled
  video with another's setting (an IndexError, or other frames than ``llm``'s). ``timestamps``: per temporal patch
  the mean time of its frames (``Qwen3VLProcessingInfo._calculate_timestamps``: frame index / source fps, the last
  frame repeated to fill a patch). The tower (``Qwen3VLVisionModel``) returns the merged embeddings and one per DeepStack level; vLLM takes
  them concatenated, ``out_hidden_size x (1 + len(deepstack_visual_indexes))`` wide.
"""
from __future__ import annotations

from typing import Any

PACKED = ("qwen2_vl", "qwen2_5_vl")  # the families backend.encode.packed_tower implements


def tower_class(model_type: str):
    """The checkpoint's transformers vision tower class."""
    if model_type == "qwen2_vl":
        from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel
        return Qwen2VisionTransformerPretrainedModel
    if model_type == "qwen2_5_vl":
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel
        return Qwen2_5_VisionTransformerPretrainedModel
    if model_type == "qwen3_vl":
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel
        return Qwen3VLVisionModel
    raise ValueError(f"no vision tower known for model_type {model_type!r}")


def tower_output(out) -> Any:
    """The embeddings vLLM takes of a transformers tower's output: ``pooler_output`` (the merged embeddings), with
    the DeepStack levels' concatenated after it where the tower has them (Qwen3-VL)."""
    import torch

    merged = getattr(out, "pooler_output", out)
    deepstack = getattr(out, "deepstack_features", None)
    return torch.cat([merged, *deepstack], dim=-1) if deepstack else merged


def _metadata(video):
    """The loader's metadata of a decoded video as HF's ``VideoMetadata`` (vLLM drops ``do_sample_frames`` too)."""
    from transformers.video_utils import VideoMetadata

    return VideoMetadata(**{k: v for k, v in video.metadata.items() if k != "do_sample_frames"})


def sample_frames(model_type: str, video_processor, video):
    """``video`` (a ``DecodedVideo``) with the frames its family's processor samples from it where the loader left
    the sampling to the processor (``do_sample_frames``: Qwen3-VL), and ``do_sample_frames`` off; else ``video``."""
    if model_type != "qwen3_vl" or not video.metadata.get("do_sample_frames", False):
        return video
    indices = [int(i) for i in video_processor.sample_frames(_metadata(video))]
    metadata = dict(video.metadata, frames_indices=indices, do_sample_frames=False)
    return type(video)(video.frames[indices], metadata)


def video_kwargs(model_type: str, videos: list) -> dict[str, Any]:
    """What the video processor is called with besides the frames, for decoded ``videos`` (one call for all; each
    video already sampled: ``sample_frames``)."""
    if model_type != "qwen3_vl":
        return {}
    return {"video_metadata": [_metadata(v) for v in videos], "do_sample_frames": False}


def video_timing(model_type: str, video, temporal_patch_size: int) -> dict[str, Any]:
    """The ``VideoLayout`` timing members of a decoded video (``{}``: the family has none)."""
    if model_type == "qwen2_5_vl":
        return {"second_per_grid_ts": temporal_patch_size / _metadata(video).sampled_fps}
    if model_type == "qwen3_vl":
        return {"timestamps": tuple(frame_timestamps(video.metadata["frames_indices"], video.metadata["fps"],
                                                     temporal_patch_size))}
    return {}


def frame_timestamps(indices, fps: float, temporal_patch_size: int) -> list[float]:
    """Qwen3-VL's time of each temporal patch: the mean of its first and last frame's ``index / fps`` (the last
    frame repeated to fill the final patch), as vLLM's ``Qwen3VLProcessingInfo._calculate_timestamps``."""
    indices = list(indices)
    if len(indices) % temporal_patch_size:
        indices += [indices[-1]] * (temporal_patch_size - len(indices) % temporal_patch_size)
    seconds = [index / fps for index in indices]
    last = temporal_patch_size - 1
    return [(seconds[i] + seconds[i + last]) / 2 for i in range(0, len(seconds), temporal_patch_size)]


def resize_depends_on_frames(video_processor) -> bool:
    """Whether the video processor sizes a frame by how many frames the video has (then a video part's frames are
    preprocessed with the whole video's): Qwen3-VL's always (its pixel budget is for all frames), Qwen2-VL's with
    ``cap_pixels_per_frame``."""
    return bool(getattr(video_processor, "cap_pixels_per_frame", None)) or \
        type(video_processor).__name__.startswith("Qwen3VL")
