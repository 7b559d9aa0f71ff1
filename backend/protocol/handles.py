"""Transfer handles: where an item's embeddings are and for how long (a lease on a producer's NIXL-registered pool),
one class per transport, and the typed parsers of the layout document's wire values. Part of the layout document
(``backend.protocol.layout``, which re-exports these names); announcements (``backend.transfer.announce``) carry a
pool's own handle."""
from __future__ import annotations

import base64
import binascii
import dataclasses
import math
import string
from dataclasses import dataclass
from typing import Any, ClassVar

from backend.protocol.errors import InvalidInput


def host_identity() -> str:
    """This host as seen by a peer: the kernel boot id, the network namespace, and the host's name in its topology
    (``EPD_HOST``, set by its launch command: ``backend.deploy.hosts``). Processes in other network namespaces, or
    of another topology host, count as other hosts: their consumers never take the same-host shared-memory or CUDA
    IPC path to each other's producers, even where a /dev/shm is shared (two hosts of a topology on one machine)."""
    import os

    with open("/proc/sys/kernel/random/boot_id") as fh:
        boot = fh.read().strip()
    name = os.environ.get("EPD_HOST", "")
    return f"{boot}/{os.stat('/proc/self/ns/net').st_ino}" + (f"/{name}" if name else "")


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


def _floats(value: Any) -> tuple[float, ...]:
    if not isinstance(value, list):
        raise TypeError(f"expected a list of numbers, got {type(value).__name__}")
    return tuple(_float(x) for x in value)


def _ints(value: Any, count: int) -> tuple[int, ...]:
    if not isinstance(value, list) or len(value) != count:
        raise TypeError(f"expected a list of {count} integers, got {value!r}")
    return tuple(_int(x) for x in value)


_PARSE = {"str": _str, "int": _int, "float": _float, "bytes": _bytes}  # a handle member's type -> its parser
_HEX_DIGITS = frozenset(string.hexdigits)


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
