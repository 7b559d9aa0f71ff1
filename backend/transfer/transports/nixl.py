"""NIXL alone: a pool only NIXL reads (a VRAM pool where CUDA IPC is not available). The handle is the common part;
no same-host path: the consumer READs it through NIXL (``backend.transfer.consumer``), as it does any handle that no
same-host reader takes."""
from __future__ import annotations

from backend.protocol.handles import NixlHandle
from backend.transfer.transports.base import Transport


def _handle(pool, common: dict, offset: int, tag_slot: int) -> NixlHandle:
    return NixlHandle(**common)


TRANSPORT = Transport("nixl", NixlHandle, _handle)
