"""Naive EPD's downstream media work, for the metadata-only on/off comparison.

A metadata-only consumer (``pd``, ``prefill``, ``decode``) normally gets each media item's layout metadata
only. With metadata-only off (the orchestrator's ``metadata_only`` parameter), the orchestrator also sends
the original media (``original_media``), as a naive EPD forwards the client's request unchanged; the
consumer then does what such a consumer's input processor does before its embeddings come from the
encoder's cache: decode each item and run the image (or video) processor on it. Its result is checked against the
encoder's layout (same grid) and otherwise dropped: the embeddings still come from the encoder.

Who calls it: ``MetadataOnlyModel.prepare``, on the engine loop (where vLLM's own input processing runs);
the seconds it took are reported as ``timings["media_ms"]``.
"""
from __future__ import annotations

import time
from typing import Sequence

from backend.protocol.errors import InvalidInput
from backend.request.image import decode_image
from backend.request.media import MediaLimits
from backend.request.video import decode_video


def process_original_media(media: Sequence[bytes], layouts: Sequence, processor, limits: MediaLimits,
                           video_processor=None) -> float:
    """Decode and preprocess ``media`` (one per layout, in order); return the seconds it took.
    ``processor`` is a Hugging Face image processor (called with ``images=[...]``), ``video_processor`` its video
    processor (``videos=[...]``), called for the items whose layout is a video's."""
    if len(media) != len(layouts):
        raise InvalidInput("original_media", f"{len(media)} items for {len(layouts)} image_layouts")
    started = time.perf_counter()
    for i, (data, layout) in enumerate(zip(media, layouts)):
        field = f"original_media[{i}]"
        if layout.media.modality == "video":
            if video_processor is None:
                raise InvalidInput(field, "a video, and this consumer has no video processor")
            frames = decode_video(data, field, limits).frames
            grid = tuple(int(x) for x in video_processor(videos=[frames], return_tensors="np")["video_grid_thw"][0])
        else:
            image = decode_image(data, field, limits)
            grid = tuple(int(x) for x in processor(images=[image], return_tensors="np")["image_grid_thw"][0])
        if grid != tuple(layout.media.grid_thw):
            raise InvalidInput(field, f"processes to {layout.media.modality}_grid_thw {list(grid)}, its layout says "
                                      f"{list(layout.media.grid_thw)}")
    return time.perf_counter() - started
