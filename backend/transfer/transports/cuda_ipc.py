"""CUDA IPC: a VRAM pool. A consumer on the producer's host opens the pool once per producer through CUDA IPC
(``backend.transfer.cuda_ipc``) and enqueues each lease's copy on a copy stream of its own (into VRAM, or pinned host
memory), at device bandwidth; the tag is checked after the copy: the producer's tag-table word where that table is
mapped here, else the region's trailer tag, copied back after the payload in stream order. The items of one pull call
share one wait (``finish``) and one release notification per producer.
"""
from __future__ import annotations

import logging
import os

import torch

from backend.protocol.errors import Unavailable
from backend.protocol.handles import CudaIpcHandle
from backend.transfer import cuda_ipc as runtime
from backend.transfer.region import HEADER, TRAILER
from backend.transfer.same_host import DTYPES, SharedMemoryReader
from backend.transfer.transports.base import SameHostReader, Transport

log = logging.getLogger(__name__)


def _handle(pool, common: dict, offset: int, tag_slot: int) -> CudaIpcHandle | None:
    """A VRAM pool's handle where it has a CUDA IPC handle, else None."""
    if not pool.ipc_handle:
        return None
    return CudaIpcHandle(**common, ipc_handle=pool.ipc_handle, pool_bytes=pool.buffer.numel(), offset=offset,
                         tag_table=pool.tag_table, tag_slot=tag_slot)


class CudaIpcReader(SameHostReader):
    """``api``: ``backend.transfer.cuda_ipc`` (the calls of a pull: ``enqueue_region``, ``synchronize``);
    ``shm`` maps the producers' tag tables."""

    def __init__(self, api, device: torch.device, shm: SharedMemoryReader):
        self.api, self.device, self.shm = api, device, shm
        # agent name -> (producer pid, its OpenedAllocation here, (base pointer, copy stream, bytes mapped))
        self.mappings: dict[str, tuple[int, object, tuple[int, int, int]]] = {}
        self._refused: set[str] = set()  # producers whose pool CUDA IPC could not open: NIXL for them
        self._streams: dict[int, torch.cuda.Stream] = {}
        self._trailers = self._trailer_words = None
        self.reserve(16)

    @classmethod
    def create(cls, device: torch.device, shm: SharedMemoryReader) -> "CudaIpcReader | None":
        """A reader where this process can use CUDA IPC, else None."""
        return cls(runtime, device, shm) if runtime.available() else None

    def warm(self, handle: CudaIpcHandle) -> None:
        self.view(handle)
        self.shm.tags(handle)

    def read(self, layout, peer: str, slot: int) -> tuple | None:
        """The copy of ``layout``'s payload enqueued, as (enqueue's result, stream); None where CUDA IPC cannot open
        the producer's pool (``view``)."""
        ipc = self.view(layout.handle)
        return None if ipc is None else (self.enqueue(ipc, layout, slot), ipc[1])

    def reserve(self, items: int) -> None:
        """Pinned host words for the trailer tags of a call's ``items`` (read through numpy; used only for
        producers whose lease-tag table this process cannot map). Before any copy of the call."""
        if self._trailer_words is None or items > len(self._trailer_words):
            self._trailers = torch.zeros(items, dtype=torch.int64, pin_memory=True)
            self._trailer_words = self._trailers.numpy()

    def view(self, handle: CudaIpcHandle) -> tuple[int, int, int] | None:
        """The producer's VRAM pool mapped here, as (base pointer, copy stream, bytes), or None where CUDA IPC
        cannot open it (a pool of this very process, a GPU this process cannot see): NIXL then."""
        cached = self.mappings.get(handle.agent_name)
        if cached is None:
            if handle.pid == os.getpid() or handle.agent_name in self._refused:
                return None
            try:
                opened = runtime.open_allocation(handle.ipc_handle, handle.pool_bytes, self.device)
            except RuntimeError as exc:
                log.warning("CUDA IPC cannot open %s's pool, using NIXL: %s", handle.agent_name, exc)
                self._refused.add(handle.agent_name)
                return None
            view = (opened.tensor.data_ptr(), self._stream(opened.tensor.device), opened.tensor.numel())
            cached = self.mappings[handle.agent_name] = (handle.pid, opened, view)
        return cached[2]

    def enqueue(self, pool: tuple[int, int, int], layout, slot: int):
        """Enqueue the copy of ``layout``'s payload (into a new tensor of its dtype and shape, on this
        consumer's device) on the pool's copy stream, no wait. Returns (payload, (tag words, index)): where
        the lease's tag is to be checked once the copy is done (payload None: the lease had ended already)."""
        base, stream, mapped = pool
        handle = layout.handle
        start = handle.offset + HEADER
        if start + handle.nbytes + TRAILER > mapped:
            raise Unavailable(f"embedding lease {handle.lease_id}: region outside the producer's pool")
        tags = self.shm.tags(handle)
        if tags is not None and not 0 <= handle.tag_slot < len(tags):
            raise Unavailable(f"embedding lease {handle.lease_id}: tag slot outside the producer's table")
        if tags is not None and int(tags[handle.tag_slot]) != int(handle.lease_id, 16):
            return None, (tags, handle.tag_slot)  # ended already: no copy; it fails in finish, as one
            # that ends during the copy does, after the call's other items (which are released as usual)
        # host destinations are pinned (torch caches pinned blocks): device-to-host copies into pageable
        # memory ran at 1-11 GB/s on the H200 machine, into pinned memory at 35-55 GB/s
        payload = torch.empty(layout.shape, dtype=DTYPES[layout.dtype], device=self.device,
                              pin_memory=self.device.type == "cpu")
        if payload.numel() * payload.element_size() != handle.nbytes:
            raise Unavailable(f"embedding lease {handle.lease_id}: {handle.nbytes} bytes do not make "
                              f"{layout.dtype}{list(layout.shape)}")
        # Where the producer's tag table is mapped here, its word for the lease is checked after the copy
        # (the producer clears it before it touches the region: still set then means nothing was
        # overwritten meanwhile). Otherwise the region's trailer tag is copied after the payload, in
        # stream order, into a pinned word: one more (device-to-host) copy per item.
        trailer = None if tags is not None else self._trailers.data_ptr() + 8 * slot
        self.api.enqueue_region(base + start, payload.data_ptr(), handle.nbytes, trailer, stream,
                                to_host=self.device.type == "cpu")
        return payload, (tags, handle.tag_slot) if tags is not None else (self._trailer_words, slot)

    def finish(self, pending):
        """Wait for the copies of ``pending`` ((index, layout, peer, enqueue's result, stream) each) and check
        their tags. Returns (the items read, as (index, layout, peer, payload), and the first failure as
        (index, message), or None)."""
        self.wait(pending)
        done, failed = [], None
        for index, layout, peer, (payload, (words, word)), _ in pending:
            if payload is None or int(words[word]) != int(layout.handle.lease_id, 16):
                when = "before" if payload is None else "during"
                failed = failed or (index, f"embedding lease {layout.handle.lease_id} was released or expired "
                                           f"{when} the read")
                continue
            done.append((index, layout, peer, payload))
        return done, failed

    def wait(self, pending) -> None:
        """Wait for every copy of ``pending`` (once per stream)."""
        for stream in {entry[4] for entry in pending}:
            self.api.synchronize(stream)

    def _stream(self, device) -> int:
        """This consumer's copy stream on the producer pool's GPU, as a raw ``cudaStream_t`` (made once:
        asking torch for the current stream costs as much host time as a small copy)."""
        index = device.index or 0
        stream = self._streams.get(index)
        if stream is None:
            stream = self._streams[index] = torch.cuda.Stream(device=index)
        return stream.cuda_stream

    def forget(self, agent_name: str) -> None:
        """Close the mapping of a producer (unreachable, or restarted: a new pool)."""
        if agent_name in self.mappings:
            self.mappings.pop(agent_name)[1].close()

    def drop_dead(self) -> None:
        """Close the mappings of producers whose process is gone (a mapping keeps their VRAM alive)."""
        for name, (pid, opened, _) in list(self.mappings.items()):
            if pid and not os.path.exists(f"/proc/{pid}"):
                self.mappings.pop(name)
                opened.close()

    def close(self) -> None:
        for _, opened, _ in self.mappings.values():
            opened.close()
        self.mappings.clear()


TRANSPORT = Transport("cuda_ipc", CudaIpcHandle, _handle, CudaIpcReader.create)
