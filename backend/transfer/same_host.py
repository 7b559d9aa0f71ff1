"""The consumer's mappings of producers' memfds on this host: ``SharedMemoryReader`` maps a producer's host pool
(read-only, once per producer) and copies a lease's region out of it, checking the region's tags before and after the
copy (the ``shared_memory`` transport's path); it also maps VRAM pools' lease-tag tables (host memfds too) for the
``cuda_ipc`` transport's reader (``backend.transfer.transports``). One per consumer, shared by both.

The release notification and the NIXL fallback stay with ``backend.transfer.consumer.EmbeddingConsumer``, which owns
them; nothing here is thread-safe (the consumer's pulls are serialised).
"""
from __future__ import annotations

import mmap
import os
import warnings

import numpy as np
import torch

from backend.protocol.errors import Unavailable
from backend.protocol.handles import CudaIpcHandle, SharedMemoryHandle
from backend.transfer.region import HEADER, TRAILER

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class SharedMemoryReader:
    def __init__(self):
        # (agent name, "pool" | "tags") -> (path, map, view): a host pool (bytes) or a VRAM pool's tag table
        self.maps: dict[tuple[str, str], tuple[str, mmap.mmap, object]] = {}

    def pool(self, handle: SharedMemoryHandle) -> torch.Tensor | None:
        """A host pool's bytes, mapped read-only (None: not mappable here, use NIXL)."""
        return self._mapped(handle.agent_name, "pool", handle.shm_path,
                            lambda mapped, size: torch.frombuffer(mapped, dtype=torch.uint8) if size
                            else torch.empty(0, dtype=torch.uint8))

    def tags(self, handle: CudaIpcHandle) -> np.ndarray | None:
        """A VRAM pool's lease-tag table (host memory, int64 words), mapped read-only, or None."""
        return self._mapped(handle.agent_name, "tags", handle.tag_table,
                            lambda mapped, size: np.frombuffer(mapped, np.int64))

    @staticmethod
    def copy(pool: torch.Tensor, handle: SharedMemoryHandle) -> torch.Tensor:
        """The lease's payload, copied out of its producer's mapped pool; ``Unavailable`` if the lease ended
        before or during the copy (its tags no longer match)."""
        start = handle.offset
        end = start + HEADER + handle.nbytes
        expected = int(handle.lease_id, 16)
        if int(pool[start: start + 8].view(torch.int64)[0]) != expected:
            raise Unavailable(f"embedding lease {handle.lease_id} was released or expired before the read")
        payload = pool[start + HEADER: end].clone()
        if int(pool[end: end + TRAILER].view(torch.int64)[0]) != expected or \
                int(pool[start: start + 8].view(torch.int64)[0]) != expected:
            raise Unavailable(f"embedding lease {handle.lease_id} was released or expired during the read")
        return payload

    def forget(self, agent_name: str) -> None:
        """Drop a producer's mappings (it restarted: new memfds)."""
        self.maps.pop((agent_name, "pool"), None)
        self.maps.pop((agent_name, "tags"), None)

    def drop_dead(self) -> None:
        """A mapping keeps a dead producer's memory alive: drop those whose memfd is gone."""
        for key, (path, _, _) in list(self.maps.items()):
            if not os.path.exists(path):
                self.maps.pop(key)

    def _mapped(self, agent_name: str, kind: str, path: str, make_view):
        cached = self.maps.get((agent_name, kind))
        if cached is not None:
            return cached[2]
        if not path:
            return None
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise Unavailable(f"embedding producer {agent_name} is gone") from None
        except OSError:
            return None  # not ours to open (another user, another mount namespace): use NIXL
        try:
            size = os.fstat(fd).st_size
            # MAP_POPULATE: map every page now, once per producer, not one fault per page per pull
            mapped = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        with warnings.catch_warnings():  # read-only by design: we only ever copy out of it
            warnings.simplefilter("ignore", UserWarning)
            view = make_view(mapped, size)
        self.maps[(agent_name, kind)] = (path, mapped, view)
        return view
