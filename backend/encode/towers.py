"""An encoder over several towers of one checkpoint: a family with a vision tower and an audio tower (an omni model,
``Family.vision`` and ``Family.audio`` both set) gets its ``VisionEncoder`` and its ``AudioEncoder`` behind one
``TowersEncoder``, which the encoder model uses as it uses either (``encode``, ``modalities``, ``temporal_patches``,
``warm_up``, ``identity``, ``load_report``, ``width``, ``dtype``, ``video_processor``).

Who calls it: ``backend.encode.encoder.load_encoder``. ``encode(items)`` routes each item to the tower whose
``modalities`` take it (``backend.request.media.modality_of``; a ``VideoPart`` is a video) and puts the results back
in the items' order: one call per tower for a batch, so a batch mixing images, videos and audio costs one vision and
one audio forward. Each tower checked its own width at load against its modality's (``checkpoint.embedding_widths``).
"""
from __future__ import annotations

from backend.encode.checkpoint import LoadReport
from backend.protocol.errors import InvalidInput
from backend.protocol.modality import IMAGE, VIDEO, modality
from backend.request.media import modality_of


class TowersEncoder:
    def __init__(self, encoders: list):
        self.encoders = encoders
        first = encoders[0]
        self.identity, self.device, self.dtype, self.width = first.identity, first.device, first.dtype, first.width
        self.video_processor = next((e.video_processor for e in encoders if e.video_processor is not None), None)
        self.modalities = tuple(m for e in encoders for m in e.modalities)
        reports = [e.load_report for e in encoders]
        self.load_report = LoadReport(sum(r.seconds for r in reports), sum(r.bytes_read for r in reports),
                                      reports[0].checkpoint_bytes)

    def _encoder_of(self, name: str):
        for encoder in self.encoders:
            if name in encoder.modalities:
                return encoder
        m = modality(name)
        raise InvalidInput(m.media_tensor, f"this checkpoint's encoder takes {' and '.join(self.modalities)}, "
                                           f"not {m.name}")

    def encode(self, items: list) -> list:
        """Embeddings of ``items`` (any mix of the towers' modalities), in their order: one ``encode`` per tower."""
        groups: dict[int, list[int]] = {}
        for i, item in enumerate(items):
            groups.setdefault(id(self._encoder_of(_modality(item))), []).append(i)
        out: list = [None] * len(items)
        for encoder in self.encoders:
            indices = groups.get(id(encoder), [])
            for i, encoded in zip(indices, encoder.encode([items[i] for i in indices]) if indices else []):
                out[i] = encoded
        return out

    def temporal_patches(self, video) -> int:
        return self._encoder_of(VIDEO.name).temporal_patches(video)

    def warm_up(self) -> None:
        for encoder in self.encoders:
            encoder.warm_up()


def _modality(item) -> str:
    """A decoded item's modality: a ``VideoPart`` (a video and its part) is a video; an image on a device (a uint8
    tensor, ``image_preprocess: gpu``) has no handler type of its own and is an image."""
    if hasattr(item, "part") and hasattr(item, "video"):
        return VIDEO.name
    try:
        return modality_of(item)
    except TypeError:
        return IMAGE.name


__all__ = ["TowersEncoder"]
