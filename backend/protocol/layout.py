"""Layout metadata: the one document that travels through Triton for an encoded media item.

Who writes it: the ``encoder`` model, once per item, after the embeddings are in a producer buffer.
Who reads it: the ``epd`` orchestrator (passes it on untouched), the consumer (``pd``, ``prefill``), which checks
the version and the model identity before pulling the embeddings the handle names, and ``decode`` (the
per-modality block only: the image's or video's grid (an audio's token count)).

Wire format: JSON with plain numeric arrays; the only opaque parts are NIXL's own agent metadata and
serialized descriptors, carried base64-encoded inside the handle (they are NIXL blobs, not tensors)::

    {"version": 7, "content_key": "..", "modality": "image", "model": "..", "dtype": "float32",
     "shape": [64, 1536], "handle": {"transport": "shared_memory", ..}, "image": {"grid_thw": [1, 16, 16]}}

Two parts vary, each named by a discriminator and parsed into its own class:

- ``handle.transport``: how a consumer on the producer's host can read the lease (``TRANSPORTS``, declared in
  ``backend.protocol.handles``). Every handle names a NIXL-registered region (agent, descriptors): the READ any
  consumer can do, and the channel its release notification takes; ``shared_memory`` and ``cuda_ipc`` add what
  their same-host fast path needs.
- ``modality``: the per-modality block, under the modality's own key (``MODALITY_LAYOUTS``): ``image`` and
  ``video`` (``{"grid_thw": [t, h, w]}`` each; a video encoded in parts adds ``"part": [first_t, total_t]``; a
  video of a family whose prompt positions or text depend on time adds its timing: Qwen2.5-VL
  ``"second_per_grid_ts": 1.0``, Qwen3-VL ``"timestamps": [0.25, 1.25, ..]``, one per temporal patch).
  ``audio``: ``{"num_tokens": n, "feature_length": f}`` (``AudioLayout``); the common part is the same for all.
  ``shape`` is the embeddings' own (the encoder's output as measured, ``[tokens, width]``), whatever the modality.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, ClassVar

from backend.protocol.errors import InvalidInput
from backend.protocol.handles import (TRANSPORTS, CudaIpcHandle, NixlHandle, SharedMemoryHandle,  # noqa: F401
                                      TransferHandle, _float, _floats, _int, _ints, _str, host_identity)  # re-exported

# What each version of the document added (a consumer accepts its own version only):
#   1  content_key, modality, model, dtype, shape, image_grid_thw; handle: agent_name, agent_metadata,
#      descriptors, lease_id, nbytes, expires_at (NIXL READ of a producer's registered host memory)
#   2  handle.host, handle.shm_path, handle.offset (same-host copy out of the producer's pool memfd)
#   3  handle.ipc_handle, handle.pid, handle.pool_bytes (CUDA IPC for VRAM pools)
#   4  handle.tag_table, handle.tag_slot (a VRAM pool's lease-tag table in host memory)
#   5  handle.transport: one handle type per transport, with only its own fields; the per-modality block
#      ("image": {"grid_thw"}) in place of the top-level image_grid_thw; "video": {"grid_thw"} (a modality a
#      version-5 consumer may not know is refused naming <field>.modality, so adding one is no new version)
#   6  video.part: [first_t, total_t] for a slice of a video's temporal patches (one encoder's share of a video split
#      across encoders); a version-5 consumer would ignore the member and take each slice for a whole video
#   7  video.second_per_grid_ts (Qwen2.5-VL: seconds per temporal patch, its M-RoPE's temporal positions) and
#      video.timestamps (Qwen3-VL: each temporal patch's time in seconds, the "<t seconds>" text of its prompt), each
#      optional (a family without it leaves it out); a version-6 consumer would ignore them and give the engine
#      other positions or another prompt than the baseline's: a new version
SCHEMA_VERSION = 7
DTYPES = {"float32": 4, "bfloat16": 2, "float16": 2}  # name -> bytes per element
_MISSING = object()


# -- per-modality blocks ------------------------------------------------------------------------------
class ModalityLayout:
    """A modality's block of the document, under the key ``modality``: what a consumer needs of that modality
    besides the embeddings. A subclass is a frozen dataclass, listed in ``MODALITY_LAYOUTS``."""

    modality: ClassVar[str] = ""

    def to_doc(self) -> dict[str, Any]:
        raise NotImplementedError

    @classmethod
    def from_doc(cls, doc: dict[str, Any], where: str) -> "ModalityLayout":
        """Parse the block (``doc``, a JSON object); ``where``: its field, for errors."""
        raise NotImplementedError

    def check_shape(self, shape: tuple[int, ...], field: str) -> None:
        """Refuse embeddings of ``shape`` that this block cannot describe (``field``: the layout's)."""


@dataclass(frozen=True)
class GridLayout(ModalityLayout):
    """A block of one patch grid (temporal, height, width): what vLLM's ``<modality>_grid_thw`` input wants (M-RoPE
    positions and placeholder expansion need it; ``decode`` needs nothing else)."""

    grid_thw: tuple[int, int, int]

    def to_doc(self) -> dict[str, Any]:
        return {"grid_thw": list(self.grid_thw)}

    @classmethod
    def from_doc(cls, doc: dict[str, Any], where: str) -> "GridLayout":
        try:
            grid = _ints(doc["grid_thw"], 3)
        except KeyError:
            raise InvalidInput(f"{where}.grid_thw", "expected three positive ints (missing)") from None
        except TypeError as exc:
            raise InvalidInput(f"{where}.grid_thw", f"expected three positive ints ({exc})") from None
        if min(grid) <= 0:
            raise InvalidInput(f"{where}.grid_thw", f"expected three positive ints, got {list(grid)}")
        return cls(grid)


@dataclass(frozen=True)
class ImageLayout(GridLayout):
    """An image's block: its patch grid (``t`` is 1), vLLM's ``image_grid_thw``."""

    modality: ClassVar[str] = "image"


@dataclass(frozen=True)
class VideoLayout(GridLayout):
    """A video's block: its patch grid, ``t`` the temporal patches (sampled frames / temporal_patch_size), vLLM's
    ``video_grid_thw`` (Qwen2-VL's M-RoPE needs nothing else of a video; its tower attends within each ``t``).

    ``part``: for one slice of a video encoded in parts (``backend.protocol.generate.PART_PARAMETER``), the slice's
    first temporal patch and the whole video's count, ``(first_t, total_t)``; ``grid_thw`` is then the slice's own
    grid. The consumer joins consecutive slices that cover ``[0, total_t)`` into the video's grid row
    (``backend.transfer.engine_inputs.media_grids``). None: the whole video.

    Timing, for vLLM's field of that name (None: the family has none): ``second_per_grid_ts``, Qwen2.5-VL's seconds
    per temporal patch (scales M-RoPE's temporal positions; a part carries its video's); ``timestamps``, Qwen3-VL's
    time of each temporal patch (a part: its slice's), which vLLM writes into the prompt as ``<t seconds>``."""

    modality: ClassVar[str] = "video"
    part: tuple[int, int] | None = None
    second_per_grid_ts: float | None = None
    timestamps: tuple[float, ...] | None = None

    def __post_init__(self):
        if self.part is not None:
            first, total = self.part
            if first < 0 or first + self.grid_thw[0] > total:
                raise ValueError(f"part {list(self.part)} does not hold a slice of {self.grid_thw[0]} temporal patches")
        if self.second_per_grid_ts is not None and not self.second_per_grid_ts > 0:
            raise ValueError(f"second_per_grid_ts must be > 0, got {self.second_per_grid_ts}")
        if self.timestamps is not None and len(self.timestamps) != self.grid_thw[0]:
            raise ValueError(f"{len(self.timestamps)} timestamps for {self.grid_thw[0]} temporal patches")

    def to_doc(self) -> dict[str, Any]:
        doc = super().to_doc()
        for name in ("part", "second_per_grid_ts", "timestamps"):
            value = getattr(self, name)
            if value is not None:
                doc[name] = list(value) if isinstance(value, tuple) else value
        return doc

    @classmethod
    def from_doc(cls, doc: dict[str, Any], where: str) -> "VideoLayout":
        grid = GridLayout.from_doc(doc, where).grid_thw
        values = {}
        for name, parse, expected in (("part", lambda v: _ints(v, 2), "[first_t, total_t] holding grid_thw's t"),
                                      ("second_per_grid_ts", _float, "seconds per temporal patch, > 0"),
                                      ("timestamps", _floats, "one time in seconds per temporal patch of grid_thw")):
            if name in doc:
                try:
                    values[name] = parse(doc[name])
                    cls(grid, **values)
                except (TypeError, ValueError) as exc:
                    raise InvalidInput(f"{where}.{name}", f"expected {expected} ({exc})") from None
        return cls(grid, **values)


@dataclass(frozen=True)
class AudioLayout(ModalityLayout):
    """An audio item's block: ``num_tokens``, its embeddings' rows, what vLLM's ``audio_num_tokens`` input wants (the
    placeholder's length: all ``decode`` needs), and ``feature_length``, the feature frames the checkpoint's feature
    extractor kept of it (Qwen2-Audio: 10 ms mel frames, before the encoder's 4x downsampling), so a reader can tell
    what was encoded (a clip past the extractor's window is cut to it)."""

    modality: ClassVar[str] = "audio"
    num_tokens: int
    feature_length: int

    def to_doc(self) -> dict[str, Any]:
        return {"num_tokens": self.num_tokens, "feature_length": self.feature_length}

    @classmethod
    def from_doc(cls, doc: dict[str, Any], where: str) -> "AudioLayout":
        try:
            values = {name: _int(doc[name]) for name in ("num_tokens", "feature_length")}
        except (KeyError, TypeError) as exc:
            raise InvalidInput(where, f"expected positive ints num_tokens and feature_length ({exc!r})") from None
        if min(values.values()) <= 0:
            raise InvalidInput(where, f"expected positive ints num_tokens and feature_length, got {values}")
        return cls(**values)

    def check_shape(self, shape: tuple[int, ...], field: str) -> None:
        if shape[0] != self.num_tokens:
            raise InvalidInput(f"{field}.audio.num_tokens", f"{self.num_tokens} tokens, the embeddings have {shape[0]} "
                                                            "rows")


MODALITY_LAYOUTS: dict[str, type[ModalityLayout]] = {cls.modality: cls for cls in (ImageLayout, VideoLayout,
                                                                                  AudioLayout)}


# -- the document -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LayoutMetadata:
    content_key: str
    model: str                          # model identity: the checkpoint's fingerprint
    dtype: str
    shape: tuple[int, int]              # [tokens, hidden]
    handle: TransferHandle
    media: ModalityLayout               # the per-modality block (ImageLayout for an image)
    version: int = SCHEMA_VERSION

    @property
    def modality(self) -> str:
        return self.media.modality

    def to_json(self) -> str:
        doc = {"version": self.version, "content_key": self.content_key, "modality": self.modality,
               "model": self.model, "dtype": self.dtype, "shape": list(self.shape), "handle": self.handle.to_doc(),
               self.modality: self.media.to_doc()}
        return json.dumps(doc, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes, field: str, expected_model: str | None = None,
                  expected_width: int | None = None) -> "LayoutMetadata":
        """Parse and check a layout document; ``expected_model`` is the consumer's model identity, ``expected_width``
        the embedding width its model takes (``backend.encode.checkpoint.embedding_width``). Anything it does not
        understand is InvalidInput naming the member at fault (``<field>.<member>``)."""
        try:
            doc = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise InvalidInput(field, f"layout metadata is not valid JSON ({exc})") from None
        if not isinstance(doc, dict):
            raise InvalidInput(field, "layout metadata must be a JSON object")
        _check_version(doc.get("version", _MISSING), field)
        if expected_model is not None and doc.get("model") != expected_model:
            raise InvalidInput(f"{field}.model", f"embeddings are for model {doc.get('model')!r}, "
                                                 f"this consumer serves {expected_model!r}")
        modality = doc.get("modality")
        media_cls = MODALITY_LAYOUTS.get(modality) if isinstance(modality, str) else None
        if media_cls is None:
            raise InvalidInput(f"{field}.modality", f"unsupported modality {modality!r}")
        if not isinstance(doc.get(modality), dict):
            raise InvalidInput(f"{field}.{modality}", f"malformed layout metadata (no {modality} block)")
        try:
            common = {name: _member(doc, name, parse, field) for name, parse in _COMMON.items()}
        except KeyError as exc:
            raise InvalidInput(field, f"malformed layout metadata (KeyError: {exc})") from None
        layout = cls(**common, handle=TransferHandle.from_doc(doc.get("handle"), field),
                     media=media_cls.from_doc(doc[modality], f"{field}.{modality}"))
        layout.validate(field)
        if expected_width is not None and layout.shape[1] != expected_width:
            raise InvalidInput(f"{field}.shape", f"embeddings are {layout.shape[1]} wide, this consumer's model takes "
                                                 f"{expected_width}-wide {layout.modality} embeddings")
        return layout

    def validate(self, field: str) -> None:
        if self.dtype not in DTYPES:
            raise InvalidInput(f"{field}.dtype", f"unsupported dtype {self.dtype!r}")
        if len(self.shape) != 2 or min(self.shape) <= 0:
            raise InvalidInput(f"{field}.shape", f"expected [tokens, hidden] > 0, got {list(self.shape)}")
        if self.handle.nbytes != self.shape[0] * self.shape[1] * DTYPES[self.dtype]:
            raise InvalidInput(f"{field}.handle.nbytes", "does not match shape and dtype")
        self.media.check_shape(self.shape, field)


def _shape(value: Any) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise TypeError(f"expected a list, got {type(value).__name__}")
    return tuple(_int(x) for x in value)


_COMMON = {"content_key": _str, "model": _str, "dtype": _str, "shape": _shape}  # the common members' parsers


def _member(doc: dict[str, Any], name: str, parse, field: str):
    """``doc[name]`` through ``parse``; a value of the wrong type is InvalidInput naming ``<field>.<name>``."""
    try:
        return parse(doc[name])
    except (TypeError, ValueError) as exc:
        raise InvalidInput(f"{field}.{name}", f"malformed layout metadata ({exc})") from None


def _check_version(version: Any, field: str) -> None:
    """Only documents of this consumer's own version are read: an older one lacks what this consumer needs to pick
    a transport, a newer one may carry what it would misread."""
    if version is _MISSING:
        raise InvalidInput(f"{field}.version", f"no layout schema version; this consumer understands {SCHEMA_VERSION}")
    if isinstance(version, bool) or not isinstance(version, int):
        raise InvalidInput(f"{field}.version", f"unsupported layout schema version {version!r}; "
                                               f"this consumer understands {SCHEMA_VERSION}")
    if version != SCHEMA_VERSION:
        which = "older" if version < SCHEMA_VERSION else "newer"
        raise InvalidInput(f"{field}.version", f"unsupported layout schema version {version!r} ({which} than this "
                                               f"consumer's {SCHEMA_VERSION}: encoder and consumer must be of one "
                                               f"release)")


def content_key(data: bytes, processing: str, model: str, part: tuple[int, int] | None = None,
                options: str = "") -> str:
    """The identity of one encoded item: its bytes, the processing options applied to it, and the model
    (the same picture through another processor config or model is another item); ``part``: ``(i, n)`` for part i
    of n of a video (``backend.protocol.generate.PART_PARAMETER``), a key of its own, never the whole item's;
    ``options``: the request's options for its modality (``MediaOptions.key``: the same video sampled at another
    fps is another item)."""
    import hashlib

    h = hashlib.sha256()
    for piece in (model.encode(), b"\x00", processing.encode(), b"\x00", data):
        h.update(piece)
    if part is not None:
        h.update(f"\x00part {part[0]}/{part[1]}".encode())
    if options:
        h.update(b"\x00options " + options.encode())
    return h.hexdigest()[:32]
