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

import torch

from backend.errors import Overloaded
from backend.layout import TransferHandle, host_identity
from backend.transfer.agent import create_agent

HEADER = 16
TRAILER = 8
ALIGN = 64
RELEASE_PREFIX = b"release:"


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
        self.host = host_identity()
        self._fd, self._map, self._allocation, self.shm_path, self.ipc_handle = None, None, None, "", ""
        if self.device.type == "cuda":  # VRAM: CUDA IPC for consumers on this host, NIXL READ across hosts
            from backend.transfer import cuda_ipc
            if cuda_ipc.available():
                self._allocation = cuda_ipc.DeviceAllocation(pool_bytes, self.device)
                self.buffer, self.ipc_handle = self._allocation.tensor, self._allocation.ipc_handle
            else:
                self.buffer = torch.zeros(pool_bytes, dtype=torch.uint8, device=self.device)
            self._mem, self._dev_id = "VRAM", self.device.index or 0
        else:
            self._fd = os.memfd_create(f"epd-{role}-pool", 0)
            os.ftruncate(self._fd, pool_bytes)
            os.posix_fallocate(self._fd, 0, pool_bytes)  # pages exist up front: no faults per publish or per pull
            self._map = mmap.mmap(self._fd, pool_bytes)
            self.buffer = torch.frombuffer(self._map, dtype=torch.uint8)
            self.shm_path = f"/proc/{os.getpid()}/fd/{self._fd}"
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
        tag = int(lease.lease_id, 16)
        region = self.buffer[lease.offset: lease.offset + size]
        header = torch.tensor([tag, nbytes], dtype=torch.int64).view(torch.uint8).to(self.device)
        region[HEADER: HEADER + nbytes].copy_(payload)
        region[HEADER + nbytes: HEADER + nbytes + TRAILER].copy_(header[:8])
        region[:HEADER].copy_(header)
        with self._agent_lock:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # the bytes must be in place before anyone can READ them
            descs = self.agent.get_xfer_descs([(self._base + lease.offset, HEADER + nbytes + TRAILER, self._dev_id)],
                                              self._mem)
            serialized = self.agent.get_serialized_descs(descs)
        with self._cond:
            lease.state = LeaseState.PUBLISHED
        return TransferHandle(agent_name=self.agent.name, agent_metadata=self.agent_metadata, descriptors=serialized,
                              lease_id=lease.lease_id, nbytes=nbytes, expires_at=lease.expires_at,
                              host=self.host, shm_path=self.shm_path, offset=lease.offset,
                              ipc_handle=self.ipc_handle, pid=os.getpid(), pool_bytes=self.buffer.numel())

    def release(self, lease_id: str, state: LeaseState = LeaseState.RELEASED) -> bool:
        """End a lease (idempotent). Returns False if it was not open."""
        with self._cond:
            lease = self._leases.pop(lease_id, None)
            if lease is None:
                return False
            lease.state = state
            self.buffer[lease.offset: lease.offset + 8].zero_()
            nbytes = int(self.buffer[lease.offset + 8: lease.offset + 16].view(torch.int64)[0])
            self.buffer[lease.offset + HEADER + nbytes: lease.offset + HEADER + nbytes + TRAILER].zero_()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # tags gone before the region can be reused or read
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
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # a tensor view still exists; the mapping goes with it
                pass
            os.close(self._fd)

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
                    if free >= size:
                        self._free[i: i + 1] = [(offset + size, free - size)] if free > size else []
                        lease = _Lease(secrets.token_hex(7), offset, size, time.time() + self.lease_seconds)
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
