"""Naive EPD's downstream media work, for the metadata-only on/off comparison.

A metadata-only consumer (``pd``, ``prefill``, ``decode``) normally gets each media item's layout metadata
only. With metadata-only off (the orchestrator's ``metadata_only`` parameter), the orchestrator also sends
the original media (``original_media``), as a naive EPD forwards the client's request unchanged; the
consumer then does what such a consumer's input processor does before its embeddings come from the
encoder's cache: decode each item and run the image (or video) processor, or the audio feature extractor, on it.
Its result is checked against the encoder's layout (same grid; an audio's feature length) and otherwise dropped: the
embeddings still come from the encoder.

Who calls it: ``MetadataOnlyModel.prepare``, on the engine loop (where vLLM's own input processing runs);
the seconds it took are reported as ``timings["media_ms"]``.
"""
from __future__ import annotations

import time
from typing import Sequence

from backend.protocol.errors import InvalidInput
from backend.protocol.media_options import MediaOptions
from backend.request.audio import decode_audio
from backend.request.image import decode_image
from backend.request.media import MediaLimits
from backend.request.video import decode_video


def process_original_media(media: Sequence[bytes], layouts: Sequence, processor, limits: MediaLimits,
                           video_processor=None, feature_extractor=None, options: MediaOptions = MediaOptions()) -> float:
    """Decode and preprocess ``media`` (one per layout, in order); return the seconds it took.
    ``processor`` is a Hugging Face image processor (called with ``images=[...]``; None: the checkpoint has none),
    ``video_processor`` its video processor (``videos=[...]``), called for the items whose layout is a video's, and
    ``feature_extractor`` its audio feature extractor, for an audio's (checked against its feature length);
    ``options``: the request's media options (a video sampled as the client asked)."""
    if len(media) != len(layouts):
        raise InvalidInput("original_media", f"{len(media)} items for {len(layouts)} image_layouts")
    started = time.perf_counter()
    for i, (data, layout) in enumerate(zip(media, layouts)):
        field = f"original_media[{i}]"
        name, got, want = _processed(data, field, layout.media, limits, (processor, video_processor, feature_extractor),
                                     options)
        if got != want:
            raise InvalidInput(field, f"processes to {layout.media.modality} {name} {got}, its layout says {want}")
    return time.perf_counter() - started


def _processed(data: bytes, field: str, media, limits: MediaLimits, processors, options: MediaOptions):
    """(what is compared, what ``data`` processes to, what its layout block ``media`` says)."""
    processor, video_processor, feature_extractor = processors
    modality = media.modality
    kinds = {"image": (processor, "image processor"), "video": (video_processor, "video processor"),
             "audio": (feature_extractor, "feature extractor")}
    if kinds[modality][0] is None:
        raise InvalidInput(field, f"a {modality}, and this consumer has no {kinds[modality][1]}")
    if modality == "audio":
        samples = decode_audio(data, field, limits).samples
        batch = feature_extractor([samples], sampling_rate=feature_extractor.sampling_rate, truncation=True,
                                  return_attention_mask=True, padding="max_length", return_tensors="np")
        return "feature_length", int(batch["attention_mask"][0].sum()), media.feature_length
    if modality == "video":
        frames = decode_video(data, field, limits, **options.kwargs("video")).frames
        grid = video_processor(videos=[frames], return_tensors="np")["video_grid_thw"][0]
    else:
        grid = processor(images=[decode_image(data, field, limits)], return_tensors="np")["image_grid_thw"][0]
    return f"{modality}_grid_thw", [int(x) for x in grid], list(media.grid_thw)
