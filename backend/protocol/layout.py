"""Layout metadata: the one document that travels through Triton for an encoded media item.

Who writes it: the ``encoder`` model, once per item, after the embeddings are in a producer buffer.
Who reads it: the ``epd`` orchestrator (passes it on untouched) and the consumer (``pd``), which checks
the version and the model identity before pulling the embeddings the handle names.

Wire format: JSON with plain numeric arrays; the only opaque parts are NIXL's own agent metadata and
serialized descriptors, carried base64-encoded inside the handle (they are NIXL blobs, not tensors).
"""
from __future__ import annotations

import base64
import json
from dataclasses import asdict, dataclass
from typing import Any

from backend.protocol.errors import InvalidInput

SCHEMA_VERSION = 1
DTYPES = ("float32", "bfloat16", "float16")
MODALITIES = ("image",)


def host_identity() -> str:
    """This host as seen by a peer: the kernel boot id and the network namespace. Processes in other
    network namespaces count as other hosts (that is how tests model a second machine)."""
    import os

    with open("/proc/sys/kernel/random/boot_id") as fh:
        boot = fh.read().strip()
    return f"{boot}/{os.stat('/proc/self/ns/net').st_ino}"


@dataclass(frozen=True)
class TransferHandle:
    """Where the embeddings are and for how long: a lease on a producer's NIXL-registered buffer."""

    agent_name: str
    agent_metadata: bytes     # nixl get_agent_metadata() of the producer
    descriptors: bytes        # nixl get_serialized_descs() of the leased region
    lease_id: str
    nbytes: int
    expires_at: float         # unix time; the producer reclaims the lease after it
    host: str = ""            # producer's host identity (boot id + network namespace)
    shm_path: str = ""        # same-host fast path: the producer's pool memfd, as /proc/<pid>/fd/<n>
    offset: int = 0           # the lease's region within that pool
    ipc_handle: str = ""      # same-host GPU path: the producer's VRAM pool as a CUDA IPC handle (hex)
    pid: int = 0              # producer's process id (same-host paths: a mapping of a dead producer is dropped)
    pool_bytes: int = 0       # size of the producer's pool (what an IPC mapping covers)
    tag_table: str = ""       # VRAM pools: the lease-tag table (host memfd, int64 words), as /proc/<pid>/fd/<n>
    tag_slot: int = 0         # the lease's word in that table: its id while the lease is open, 0 after

    def to_doc(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["agent_metadata"] = base64.b64encode(self.agent_metadata).decode()
        doc["descriptors"] = base64.b64encode(self.descriptors).decode()
        return doc

    @classmethod
    def from_doc(cls, doc: dict[str, Any], field: str) -> "TransferHandle":
        try:
            handle = cls(agent_name=str(doc["agent_name"]), agent_metadata=base64.b64decode(doc["agent_metadata"]),
                       descriptors=base64.b64decode(doc["descriptors"]), lease_id=str(doc["lease_id"]),
                       nbytes=int(doc["nbytes"]), expires_at=float(doc["expires_at"]), host=str(doc.get("host", "")),
                       shm_path=str(doc.get("shm_path", "")), offset=int(doc.get("offset", 0)),
                       ipc_handle=str(doc.get("ipc_handle", "")), pid=int(doc.get("pid", 0)),
                       pool_bytes=int(doc.get("pool_bytes", 0)), tag_table=str(doc.get("tag_table", "")),
                       tag_slot=int(doc.get("tag_slot", 0)))
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidInput(f"{field}.handle", f"malformed transfer handle ({exc})") from None
        if handle.tag_slot < 0:
            raise InvalidInput(f"{field}.handle", "malformed transfer handle (tag_slot must be >= 0)")
        if handle.ipc_handle and (len(handle.ipc_handle) != 128 or not _is_hex(handle.ipc_handle)):
            raise InvalidInput(f"{field}.handle", "malformed transfer handle (ipc_handle must be 64 bytes as hex)")
        return handle


def _is_hex(text: str) -> bool:
    try:
        bytes.fromhex(text)
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class LayoutMetadata:
    content_key: str
    modality: str
    model: str                          # model identity: the checkpoint's fingerprint
    dtype: str
    shape: tuple[int, int]              # [tokens, hidden]
    image_grid_thw: tuple[int, int, int]
    handle: TransferHandle
    version: int = SCHEMA_VERSION

    def to_json(self) -> str:
        doc = asdict(self)
        doc["shape"], doc["image_grid_thw"] = list(self.shape), list(self.image_grid_thw)
        doc["handle"] = self.handle.to_doc()
        return json.dumps(doc, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes, field: str, expected_model: str | None = None) -> "LayoutMetadata":
        """Parse and check a layout document; ``expected_model`` is the consumer's model identity."""
        try:
            doc = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise InvalidInput(field, f"layout metadata is not valid JSON ({exc})") from None
        if not isinstance(doc, dict):
            raise InvalidInput(field, "layout metadata must be a JSON object")
        version = doc.get("version")
        if version != SCHEMA_VERSION:
            raise InvalidInput(f"{field}.version", f"unsupported layout schema version {version!r}; "
                                                   f"this consumer understands {SCHEMA_VERSION}")
        if expected_model is not None and doc.get("model") != expected_model:
            raise InvalidInput(f"{field}.model", f"embeddings are for model {doc.get('model')!r}, "
                                                 f"this consumer serves {expected_model!r}")
        try:
            layout = cls(content_key=str(doc["content_key"]), modality=doc["modality"], model=str(doc["model"]),
                         dtype=doc["dtype"], shape=tuple(int(x) for x in doc["shape"]),
                         image_grid_thw=tuple(int(x) for x in doc["image_grid_thw"]),
                         handle=TransferHandle.from_doc(doc["handle"], field), version=version)
        except InvalidInput:
            raise
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidInput(field, f"malformed layout metadata ({type(exc).__name__}: {exc})") from None
        layout.validate(field)
        return layout

    def validate(self, field: str) -> None:
        if self.modality not in MODALITIES:
            raise InvalidInput(f"{field}.modality", f"unsupported modality {self.modality!r}")
        if self.dtype not in DTYPES:
            raise InvalidInput(f"{field}.dtype", f"unsupported dtype {self.dtype!r}")
        if len(self.shape) != 2 or min(self.shape) <= 0:
            raise InvalidInput(f"{field}.shape", f"expected [tokens, hidden] > 0, got {list(self.shape)}")
        if len(self.image_grid_thw) != 3 or min(self.image_grid_thw) <= 0:
            raise InvalidInput(f"{field}.image_grid_thw", f"expected three positive ints, got {list(self.image_grid_thw)}")
        itemsize = 4 if self.dtype == "float32" else 2
        if self.handle.nbytes != self.shape[0] * self.shape[1] * itemsize:
            raise InvalidInput(f"{field}.handle.nbytes", "does not match shape and dtype")


def content_key(data: bytes, processing: str, model: str) -> str:
    """The identity of one encoded item: its bytes, the processing options applied to it, and the model
    (the same picture through another processor config or model is another item)."""
    import hashlib

    h = hashlib.sha256()
    for part in (model.encode(), b"\x00", processing.encode(), b"\x00", data):
        h.update(part)
    return h.hexdigest()[:32]
