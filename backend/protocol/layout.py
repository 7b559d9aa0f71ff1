"""Layout metadata: the one document that travels through Triton for an encoded media item.

Who writes it: the ``encoder`` model, once per item, after the embeddings are in a producer buffer.
Who reads it: the ``epd`` orchestrator (passes it on untouched), the consumer (``pd``, ``prefill``), which checks
the version and the model identity before pulling the embeddings the handle names, and ``decode`` (the
per-modality block only: the image's or video's grid, the audio's token count).

Wire format: JSON with plain numeric arrays; the only opaque parts are NIXL's own agent metadata and
serialized descriptors, carried base64-encoded inside the handle (they are NIXL blobs, not tensors)::

    {"version": 6, "content_key": "..", "modality": "image", "model": "..", "dtype": "float32",
     "shape": [64, 1536], "handle": {"transport": "shared_memory", ..}, "image": {"grid_thw": [1, 16, 16]}}

Two parts vary, each named by a discriminator and parsed into its own class:

- ``handle.transport``: how a consumer on the producer's host can read the lease (``TRANSPORTS``). Every handle
  names a NIXL-registered region (agent, descriptors): the READ any consumer can do, and the channel its release
  notification takes; ``shared_memory`` and ``cuda_ipc`` add what their same-host fast path needs.
- ``modality``: the per-modality block, under the modality's own key (``MODALITY_LAYOUTS``): ``image`` and
  ``video`` (``{"grid_thw": [t, h, w]}`` each; a video encoded in parts adds ``"part": [first_t, total_t]``), and
  ``audio`` (``{"num_tokens": n, "feature_length": f}``, ``AudioLayout``); the common part is the same for all.
  ``shape`` is the embeddings' own (the encoder's output as measured, ``[tokens, width]``), whatever the modality.
"""
from __future__ import annotations

import base64
import binascii
import dataclasses
import json
import math
import string
from dataclasses import dataclass
from typing import Any, ClassVar

from backend.protocol.errors import InvalidInput
from backend.protocol.identity import content_key, host_identity  # noqa: F401 - what a layout names, declared there

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
SCHEMA_VERSION = 6
DTYPES = {"float32": 4, "bfloat16": 2, "float16": 2}  # name -> bytes per element


# -- wire values ------------------------------------------------------------------------------------
def _str(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"expected a string, got {type(value).__name__}")
    return value


def _int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"expected an integer, got {type(value).__name__}")
    return value


def _float(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TypeError(f"expected a finite number, got {value!r}")
    return float(value)


def _bytes(value: Any) -> bytes:
    return base64.b64decode(_str(value), validate=True)


def _ints(value: Any, count: int) -> tuple[int, ...]:
    if not isinstance(value, list) or len(value) != count:
        raise TypeError(f"expected a list of {count} integers, got {value!r}")
    return tuple(_int(x) for x in value)


_PARSE = {"str": _str, "int": _int, "float": _float, "bytes": _bytes}  # a handle member's type -> its parser
_HEX_DIGITS = frozenset(string.hexdigits)
_MISSING = object()


# -- transfer handles ---------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class TransferHandle:
    """Where the embeddings are and for how long: a lease on a producer's NIXL-registered pool. The common part of
    every transport; parse with ``TransferHandle.from_doc``, which returns the variant ``transport`` names."""

    transport: ClassVar[str] = ""
    agent_name: str           # the producer's NIXL agent: READs and release notifications go to it
    agent_metadata: bytes     # nixl get_agent_metadata() of the producer
    descriptors: bytes        # nixl get_serialized_descs() of the leased region (empty for a pool's own handle)
    lease_id: str             # hex; also the region's tag ("" for a pool's own handle)
    nbytes: int               # the payload's size
    expires_at: float         # unix time; the producer reclaims the lease after it
    host: str = ""            # producer's host identity (boot id + network namespace)
    pid: int = 0              # producer's process id (announcements of a dead producer are dropped)

    def __post_init__(self):
        if type(self).transport not in TRANSPORTS:
            raise TypeError(f"{type(self).__name__} is no transport's handle (one of {', '.join(TRANSPORTS)})")

    def to_doc(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"transport": self.transport}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            doc[f.name] = base64.b64encode(value).decode() if isinstance(value, bytes) else value
        return doc

    @staticmethod
    def from_doc(doc: Any, field: str) -> "TransferHandle":
        """The handle of ``doc`` (the ``handle`` member of layout ``field``), as the class its transport names;
        anything malformed is InvalidInput naming the member at fault (``<field>.handle.<member>``)."""
        where = f"{field}.handle"
        if not isinstance(doc, dict):
            raise InvalidInput(where, "malformed transfer handle (expected a JSON object)")
        transport = doc.get("transport")
        cls = TRANSPORTS.get(transport) if isinstance(transport, str) else None
        if cls is None:
            raise InvalidInput(f"{where}.transport", f"unknown transport {transport!r}; this consumer understands "
                                                     f"{', '.join(TRANSPORTS)}")
        values = {}
        for f in dataclasses.fields(cls):
            if f.name not in doc:
                raise InvalidInput(f"{where}.{f.name}", f"malformed transfer handle (no {f.name})")
            try:
                values[f.name] = _PARSE[f.type](doc[f.name])
            except (TypeError, ValueError, binascii.Error) as exc:
                raise InvalidInput(f"{where}.{f.name}", f"malformed transfer handle ({exc})") from None
        handle = cls(**values)
        handle.check(where)
        return handle

    def check(self, where: str) -> None:
        """Value checks beyond the types (``where``: the handle's field)."""
        if not set(self.lease_id) <= _HEX_DIGITS:
            raise InvalidInput(f"{where}.lease_id", "malformed transfer handle (lease_id must be hex)")
        for f in dataclasses.fields(self):
            if f.type == "int" and getattr(self, f.name) < 0:
                raise InvalidInput(f"{where}.{f.name}", f"malformed transfer handle ({f.name} must be >= 0)")


@dataclass(frozen=True, kw_only=True)
class NixlHandle(TransferHandle):
    """A pool only NIXL reads (a VRAM pool where CUDA IPC is not available): the common part alone."""

    transport: ClassVar[str] = "nixl"


@dataclass(frozen=True, kw_only=True)
class SharedMemoryHandle(TransferHandle):
    """A host-memory pool in a memfd: a consumer on the same host maps it and copies the region itself."""

    transport: ClassVar[str] = "shared_memory"
    shm_path: str             # the producer's pool memfd, as /proc/<pid>/fd/<n>
    offset: int = 0           # the lease's region within that pool

    def check(self, where: str) -> None:
        super().check(where)
        if not self.shm_path:
            raise InvalidInput(f"{where}.shm_path", "malformed transfer handle (shm_path must not be empty)")


@dataclass(frozen=True, kw_only=True)
class CudaIpcHandle(TransferHandle):
    """A VRAM pool: a consumer on the same host opens it through CUDA IPC and copies at device bandwidth."""

    transport: ClassVar[str] = "cuda_ipc"
    ipc_handle: str           # the producer's VRAM pool as a CUDA IPC handle (64 bytes, hex)
    pool_bytes: int           # size of the producer's pool (what an IPC mapping covers)
    offset: int = 0           # the lease's region within that pool
    tag_table: str = ""       # the lease-tag table (host memfd, int64 words), as /proc/<pid>/fd/<n>; "": none
    tag_slot: int = 0         # the lease's word in that table: its id while the lease is open, 0 after

    def check(self, where: str) -> None:
        super().check(where)
        if len(self.ipc_handle) != 128 or not set(self.ipc_handle) <= _HEX_DIGITS:
            raise InvalidInput(f"{where}.ipc_handle", "malformed transfer handle (ipc_handle must be 64 bytes as hex)")


TRANSPORTS: dict[str, type[TransferHandle]] = {cls.transport: cls for cls in (NixlHandle, SharedMemoryHandle,
                                                                            CudaIpcHandle)}


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
    (``backend.transfer.consumer.media_grids``). None: the whole video."""

    modality: ClassVar[str] = "video"
    part: tuple[int, int] | None = None

    def __post_init__(self):
        if self.part is not None:
            first, total = self.part
            if first < 0 or first + self.grid_thw[0] > total:
                raise ValueError(f"part {list(self.part)} does not hold a slice of {self.grid_thw[0]} temporal patches")

    def to_doc(self) -> dict[str, Any]:
        doc = super().to_doc()
        if self.part is not None:
            doc["part"] = list(self.part)
        return doc

    @classmethod
    def from_doc(cls, doc: dict[str, Any], where: str) -> "VideoLayout":
        grid = GridLayout.from_doc(doc, where).grid_thw
        if "part" not in doc:
            return cls(grid)
        try:
            part = _ints(doc["part"], 2)
            return cls(grid, part)
        except (TypeError, ValueError) as exc:
            raise InvalidInput(f"{where}.part", f"expected [first_t, total_t] holding grid_thw's t ({exc})") from None


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
            raise InvalidInput(f"{field}.audio.num_tokens", f"{self.num_tokens} tokens, the embeddings have {shape[0]} rows")


MODALITY_LAYOUTS: dict[str, type[ModalityLayout]] = {cls.modality: cls for cls in (ImageLayout, VideoLayout, AudioLayout)}


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
    def from_json(cls, text: str | bytes, field: str, expected_model: str | None = None) -> "LayoutMetadata":
        """Parse and check a layout document; ``expected_model`` is the consumer's model identity. Anything it does
        not understand is InvalidInput naming the member at fault (``<field>.<member>``)."""
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
