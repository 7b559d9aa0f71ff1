"""The consumer's same-host readers: a producer on this host is read without NIXL moving the bytes.

- ``SharedMemoryReader`` (``SharedMemoryHandle``): maps the producer's host pool (its memfd, read-only) once per
  producer and copies the lease's region out of it, checking the region's tags before and after the copy. It also
  maps VRAM pools' lease-tag tables (host memfds too) for the CUDA IPC reader.
- ``CudaIpcReader`` (``CudaIpcHandle``): opens the producer's VRAM pool once per producer through CUDA IPC and
  enqueues each lease's copy on a copy stream of this consumer (into VRAM, or pinned host memory); the tag is
  checked after the copy: the producer's tag-table word where that table is mapped here, else the region's
  trailer tag, copied back after the payload in stream order.

Both leave the release notification and the NIXL fallback to ``backend.transfer.consumer.EmbeddingConsumer``,
which owns them; nothing here is thread-safe (the consumer's pulls are serialised).
"""
from __future__ import annotations

import logging
import mmap
import os
import warnings

import numpy as np
import torch

from backend.protocol.errors import Unavailable
from backend.protocol.layout import CudaIpcHandle, SharedMemoryHandle
from backend.transfer import cuda_ipc
from backend.transfer.producer import HEADER, TRAILER

log = logging.getLogger(__name__)

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


class CudaIpcReader:
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
        return cls(cuda_ipc, device, shm) if cuda_ipc.available() else None

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
                opened = cuda_ipc.open_allocation(handle.ipc_handle, handle.pool_bytes, self.device)
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
