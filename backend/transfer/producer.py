"""The producer side: a pool of NIXL-registered host memory, handed out as leases.

Lease lifecycle (``LeaseState``)::

    ALLOCATED --write--> PUBLISHED --consumer READ + notif--> READ --> RELEASED
                             \\--------- expires_at passes --------> EXPIRED

The pool is one memfd-backed mapping registered with NIXL: consumers on other hosts READ it through
NIXL; a consumer on the same host maps the memfd (``/proc/<pid>/fd/<n>``, gone with the process, so
nothing can leak) and copies the region itself, which is ~3x faster than UCX's cross-memory attach here.
A pool on a GPU (``device="cuda"``) is one ``cudaMalloc`` registered as NIXL VRAM; consumers on the same
host open it through CUDA IPC (``backend.transfer.cuda_ipc``) and copy at device bandwidth, others READ it
through NIXL.

A region is laid out as ``[tag u64 | nbytes u64 | payload | tag u64]``. The tag is the lease id; it is
zeroed when the lease ends, before the region can be reused, so a consumer that reads after the end
sees a mismatch and fails the item instead of using someone else's bytes (NIXL itself enforces no lease).
A VRAM pool also keeps each open lease's tag in a host-memory table (a memfd of ``TAG_SLOTS`` int64 words,
the ``CudaIpcHandle``'s ``tag_table`` and ``tag_slot``), cleared first when the lease ends: CUDA IPC consumers check
that word after their copy instead of copying the trailer back from the GPU, one device-to-host copy less
per item. The region's own tags stay for NIXL readers on other hosts.

Who calls it: the ``encoder`` model: ``publish`` per item (blocks up to ``alloc_timeout`` for space, then
``Overloaded``, an UNAVAILABLE), ``stats`` for metrics, ``close`` in ``finalize``. A service thread drains NIXL
notifications (``release:<lease_id>`` from consumers) and reclaims expired leases every ``poll_interval``.
"""
from __future__ import annotations

import enum
import mmap
import os
import secrets
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch

from backend.protocol.errors import Overloaded
from backend.protocol.layout import TransferHandle, host_identity
from backend.transfer import cuda_ipc
from backend.transfer.agent import create_agent
from backend.transfer.region import ALIGN, HEADER, RELEASE_PREFIX, TRAILER  # noqa: F401 - HEADER re-exported
from backend.transfer.transports import handle_for

TAG_SLOTS = 1 << 16  # open leases a VRAM pool can hold (its tag table: 512 KiB of host memory)


def wait_without_spinning(stream: torch.cuda.Stream) -> None:
    """Wait until ``stream`` has done what was queued on it so far, the thread asleep meanwhile: a blocking-sync
    event (``synchronize()`` spins a core for as long as the GPU works, host CPU the encoder's accounting pays:
    135 ms a 4-image request on the H100, docs/results/gpu.md, 2026-12-06)."""
    done = torch.cuda.Event(blocking=True)
    done.record(stream)
    done.synchronize()


class LeaseState(enum.Enum):
    ALLOCATED = "allocated"
    PUBLISHED = "published"
    READ = "read"
    RELEASED = "released"
    EXPIRED = "expired"


@dataclass
class _Lease:
    lease_id: str
    offset: int
    size: int
    expires_at: float
    state: LeaseState = LeaseState.ALLOCATED
    nbytes: int = 0  # the payload's size, known here: release needs no read of the region's header
    slot: int = -1   # VRAM pools: the lease's word in the tag table


@dataclass(frozen=True)
class PoolStats:
    capacity_bytes: int
    used_bytes: int
    open_leases: int
    released_total: int
    expired_total: int


class EmbeddingPool:
    def __init__(self, pool_bytes: int = 64 << 20, lease_seconds: float = 30.0, alloc_timeout: float = 1.0,
                 poll_interval: float = 0.02, role: str = "encoder", poll_delay_us: int | None = None,
                 device: str = "cpu", agent_name: str | None = None):
        self.lease_seconds, self.alloc_timeout, self.poll_interval = lease_seconds, alloc_timeout, poll_interval
        self.agent = create_agent(role, poll_delay_us, agent_name)
        self.device = torch.device(device)
        self.host, self._pid = host_identity(), os.getpid()
        self._fd, self._map, self._allocation, self.shm_path, self.ipc_handle = None, None, None, "", ""
        self._table_fd, self._table_map, self._table, self._free_slots, self.tag_table = None, None, None, None, ""
        if self.device.type == "cuda":  # VRAM: CUDA IPC for consumers on this host, NIXL READ across hosts
            if cuda_ipc.available():
                self._allocation = cuda_ipc.DeviceAllocation(pool_bytes, self.device)
                self.buffer, self.ipc_handle = self._allocation.tensor, self._allocation.ipc_handle
            else:
                self.buffer = torch.zeros(pool_bytes, dtype=torch.uint8, device=self.device)
            self._mem, self._dev_id = "VRAM", self.device.index or 0
            # Lease tags also live in host memory for VRAM pools, one int64 word per open lease: consumers on
            # this host check it after their CUDA IPC copy instead of copying the region's trailer tag back
            # (one device-to-host copy less per item), and ending a lease clears it before anything else.
            self._table_fd = os.memfd_create(f"epd-{role}-tags", 0)
            os.ftruncate(self._table_fd, TAG_SLOTS * 8)
            self._table_map = mmap.mmap(self._table_fd, TAG_SLOTS * 8)
            self._table = np.frombuffer(self._table_map, dtype=np.int64)
            self._free_slots = list(range(TAG_SLOTS - 1, -1, -1))
            self.tag_table = f"/proc/{self._pid}/fd/{self._table_fd}"
            self._release_stream = torch.cuda.Stream(device=self.device)
        else:
            self._fd = os.memfd_create(f"epd-{role}-pool", 0)
            os.ftruncate(self._fd, pool_bytes)
            os.posix_fallocate(self._fd, 0, pool_bytes)  # pages exist up front: no faults per publish or per pull
            self._map = mmap.mmap(self._fd, pool_bytes)
            self.buffer = torch.frombuffer(self._map, dtype=torch.uint8)
            self.shm_path = f"/proc/{self._pid}/fd/{self._fd}"
            self._mem, self._dev_id = "DRAM", 0
        self._base = self.buffer.data_ptr()
        self._reg = self.agent.register_memory(self.buffer)
        self.agent_metadata = self.agent.get_agent_metadata()
        self._free: list[tuple[int, int]] = [(0, pool_bytes)]  # sorted (offset, size)
        self._leases: dict[str, _Lease] = {}
        self._released = self._expired = 0
        self._gave_up_at = float("-inf")  # when an allocation last waited alloc_timeout in vain
        self._cond = threading.Condition()
        self._agent_lock = threading.Lock()  # the agent is created without NIXL's own thread sync
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._service, name="embedding-pool", daemon=True)
        self._thread.start()

    # -- producer API -------------------------------------------------------------------------
    def publish(self, tensor: torch.Tensor, timeout: float | None = None) -> TransferHandle:
        """Copy ``tensor`` into a new lease and return its handle; ``Overloaded`` (UNAVAILABLE) if the pool
        stays full for ``timeout`` seconds (default ``alloc_timeout``)."""
        payload = tensor.detach().to(self.device).contiguous().reshape(-1).view(torch.uint8)
        nbytes = payload.numel()
        size = -(-(HEADER + nbytes + TRAILER) // ALIGN) * ALIGN
        lease = self._allocate(size, self.alloc_timeout if timeout is None else timeout)
        lease.nbytes = nbytes
        tag = int(lease.lease_id, 16)
        region = self.buffer[lease.offset: lease.offset + size]
        region[HEADER: HEADER + nbytes].copy_(payload)
        # the header's two words written in place (fill_ takes the value as a kernel argument: no copy from host
        # memory, which on a GPU would wait, spinning, for everything before it on the stream: the tower's work)
        words = region[:HEADER].view(torch.int64)
        words[0].fill_(tag)
        words[1].fill_(nbytes)
        region[HEADER + nbytes: HEADER + nbytes + TRAILER].copy_(region[:8])
        with self._agent_lock:
            if self.device.type == "cuda":
                # the bytes must be in place before anyone can READ them
                wait_without_spinning(torch.cuda.current_stream(self.device))
            descs = self.agent.get_xfer_descs([(self._base + lease.offset, HEADER + nbytes + TRAILER, self._dev_id)],
                                              self._mem)
            serialized = self.agent.get_serialized_descs(descs)
        with self._cond:
            if self._table is not None:
                self._table[lease.slot] = tag
            lease.state = LeaseState.PUBLISHED
        return self._handle(lease_id=lease.lease_id, nbytes=nbytes, expires_at=lease.expires_at, descriptors=serialized,
                            offset=lease.offset, tag_slot=max(lease.slot, 0))

    def pool_handle(self) -> TransferHandle:
        """The pool itself, no lease (no descriptors, nothing to read): what ``backend.transfer.announce`` tells
        consumers on this host, so they connect to it before their first pull."""
        return self._handle()

    def _handle(self, lease_id: str = "", nbytes: int = 0, expires_at: float = 0.0, descriptors: bytes = b"",
                offset: int = 0, tag_slot: int = 0) -> TransferHandle:
        """A handle of this pool's transport: the first registered transport that offers this pool
        (``backend.transfer.transports``: CUDA IPC for a VRAM pool that has an IPC handle, shared memory for a host
        pool (its memfd), NIXL alone otherwise)."""
        common = dict(agent_name=self.agent.name, agent_metadata=self.agent_metadata, descriptors=descriptors,
                      lease_id=lease_id, nbytes=nbytes, expires_at=expires_at, host=self.host, pid=self._pid)
        return handle_for(self, common, offset, tag_slot)

    def release(self, lease_id: str, state: LeaseState = LeaseState.RELEASED) -> bool:
        """End a lease (idempotent). Returns False if it was not open."""
        with self._cond:
            lease = self._leases.pop(lease_id, None)
            if lease is None:
                return False
            lease.state = state
            if self._table is not None:  # first: same-host consumers check this word after their copy
                self._table[lease.slot] = 0
                self._free_slots.append(lease.slot)
            trailer = lease.offset + HEADER + lease.nbytes
            if self.device.type == "cuda":  # on a stream of its own: waiting must not wait for the encoder's work
                with torch.cuda.stream(self._release_stream):
                    self.buffer[lease.offset: lease.offset + 8].zero_()
                    self.buffer[trailer: trailer + TRAILER].zero_()
                wait_without_spinning(self._release_stream)  # tags gone before the region can be reused or read
            else:
                self.buffer[lease.offset: lease.offset + 8].zero_()
                self.buffer[trailer: trailer + TRAILER].zero_()
            self._give_back(lease.offset, lease.size)
            if state is LeaseState.EXPIRED:
                self._expired += 1
            else:
                self._released += 1
            self._cond.notify_all()
            return True

    def lease_state(self, lease_id: str) -> LeaseState | None:
        with self._cond:
            lease = self._leases.get(lease_id)
            return lease.state if lease else None

    def stats(self) -> PoolStats:
        with self._cond:
            used = sum(lease.size for lease in self._leases.values())
            return PoolStats(self.buffer.numel(), used, len(self._leases), self._released, self._expired)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        with self._agent_lock:
            self.agent.deregister_memory(self._reg)
        del self.buffer
        if self._allocation is not None:
            self._allocation.close()
        for mapped, fd in ((self._map, self._fd), (self._table_map, self._table_fd)):
            if mapped is None:
                continue
            self._table = None
            try:
                mapped.close()
            except BufferError:  # a view still exists; the mapping goes with it
                pass
            os.close(fd)

    # -- allocation -----------------------------------------------------------------------------
    def _allocate(self, size: int, timeout: float) -> _Lease:
        """A free region of ``size`` bytes, waiting up to ``timeout`` for one. While the pool is
        overloaded (an allocation waited in vain less than ``alloc_timeout`` ago and there is still no
        room), others fail at once: the waits would otherwise queue up one after another behind the
        encoder, and requests with them."""
        now = time.monotonic()
        if now - self._gave_up_at < self.alloc_timeout:
            timeout = 0.0
        deadline = now + timeout
        with self._cond:
            while True:
                for i, (offset, free) in enumerate(self._free):
                    if free >= size and self._free_slots != []:
                        self._free[i: i + 1] = [(offset + size, free - size)] if free > size else []
                        lease = _Lease(secrets.token_hex(7), offset, size, time.time() + self.lease_seconds)
                        if self._free_slots is not None:
                            lease.slot = self._free_slots.pop()
                        self._leases[lease.lease_id] = lease
                        return lease
                left = deadline - time.monotonic()
                if size > self.buffer.numel() or left <= 0:
                    if timeout > 0 and size <= self.buffer.numel():
                        self._gave_up_at = time.monotonic()
                    raise Overloaded(f"embedding pool full: {size} bytes wanted, "
                                      f"{self.buffer.numel() - sum(l.size for l in self._leases.values())} of "
                                      f"{self.buffer.numel()} free in pieces; try again later")
                self._cond.wait(left)

    def _give_back(self, offset: int, size: int) -> None:
        free = sorted(self._free + [(offset, size)])
        merged: list[tuple[int, int]] = []
        for off, sz in free:
            if merged and merged[-1][0] + merged[-1][1] == off:
                merged[-1] = (merged[-1][0], merged[-1][1] + sz)
            else:
                merged.append((off, sz))
        self._free = merged

    # -- service thread -------------------------------------------------------------------------
    def _service(self) -> None:
        while not self._stop.wait(self.poll_interval):
            with self._agent_lock:
                notifs = self.agent.get_new_notifs()
            for messages in notifs.values():
                for message in messages:
                    if message.startswith(RELEASE_PREFIX):  # release:<id>[,<id>...]
                        for lease_id in message[len(RELEASE_PREFIX):].decode().split(","):
                            with self._cond:
                                if lease_id in self._leases:
                                    self._leases[lease_id].state = LeaseState.READ
                            self.release(lease_id)
            now = time.time()
            with self._cond:
                expired = [l.lease_id for l in self._leases.values() if l.expires_at <= now]
            for lease_id in expired:
                self.release(lease_id, LeaseState.EXPIRED)
