"""Shared memory: a host-memory pool in a memfd. A consumer on the producer's host maps it (once per producer,
read-only: ``backend.transfer.same_host.SharedMemoryReader``) and copies the lease's region itself, checking the
region's tags before and after the copy; ~3x faster than UCX's cross-memory attach here."""
from __future__ import annotations

import torch

from backend.protocol.handles import SharedMemoryHandle
from backend.transfer.region import HEADER
from backend.transfer.same_host import SharedMemoryReader
from backend.transfer.transports.base import SameHostReader, Transport


def _handle(pool, common: dict, offset: int, tag_slot: int) -> SharedMemoryHandle | None:
    """A host pool's handle (its memfd), None for a pool without one."""
    return SharedMemoryHandle(**common, shm_path=pool.shm_path, offset=offset) if pool.shm_path else None


class SharedMemoryPath(SameHostReader):
    def __init__(self, shm: SharedMemoryReader):
        self.shm = shm

    def warm(self, handle: SharedMemoryHandle) -> None:
        if (pool := self.shm.pool(handle)) is not None and pool.numel() >= 2 * HEADER:
            # the ops of a pull (``SharedMemoryReader.copy``, ``pull_media_embeds``) once: their first call costs
            # more than a whole later pull
            part = pool[:HEADER].clone()
            torch.cat([part.view(torch.int64), part.view(torch.int64)])
            torch.tensor([[1, 2, 2]], dtype=torch.int64)

    def read(self, layout, peer: str, slot: int) -> torch.Tensor | None:
        """The lease's payload copied out of the mapped pool (None: the memfd cannot be opened here)."""
        pool = self.shm.pool(layout.handle)
        return None if pool is None else self.shm.copy(pool, layout.handle)


def _reader(device: torch.device, shm: SharedMemoryReader) -> SharedMemoryPath:
    return SharedMemoryPath(shm)


TRANSPORT = Transport("shared_memory", SharedMemoryHandle, _handle, _reader)
