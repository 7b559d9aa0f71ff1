"""The consumer side: pull a lease's embeddings with one NIXL READ and tell the producer it is done.

Who calls it: a consumer model (``pd``) before it submits a request to vLLM: ``pull(layout)`` returns a
tensor of the layout's dtype and shape, or raises ``Unavailable`` (lease expired or released, producer
gone, transfer failed); the request then fails, never the engine. The READ carries the notification
``release:<lease_id>``, delivered to the producer when the data has arrived.

Two data paths, chosen per handle:
- same host (``handle.host`` equals ours and the producer's pool memfd can be opened): map the pool once
  per producer (read-only) and copy the region; the release goes as a NIXL notification;
- otherwise: one NIXL READ, carrying the release notification.
Both check the lease tags around the payload, so a region released or reused mid-copy is detected.

A failed transfer drops the producer from the agent's peers, so the next pull reconnects. A producer
that restarted under the same agent name (new metadata in its handles) is removed and added again
before the pull, so the first pull after the restart already works. Not thread-safe: callers serialise pulls (one executor thread).
"""
from __future__ import annotations

import mmap
import os
import time
import warnings

import torch

from backend.errors import Unavailable
from backend.layout import LayoutMetadata, host_identity
from backend.transfer.agent import create_agent
from backend.transfer.producer import HEADER, RELEASE_PREFIX, TRAILER

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class EmbeddingConsumer:
    def __init__(self, role: str = "consumer", timeout: float = 10.0, expiry_margin: float = 0.05,
                 same_host_copy: bool = True, poll_delay_us: int | None = None):
        self.agent = create_agent(role, poll_delay_us)
        self.timeout, self.expiry_margin, self.same_host_copy = timeout, expiry_margin, same_host_copy
        self.host = host_identity()
        self._peers: dict[str, bytes] = {}  # agent name -> the metadata it was added with
        self._maps: dict[str, tuple[str, mmap.mmap, torch.Tensor]] = {}  # agent name -> (path, map, bytes)
        self.bytes_pulled = 0
        self.items_pulled = 0

    def pull(self, layout: LayoutMetadata) -> torch.Tensor:
        handle = layout.handle
        if time.time() > handle.expires_at - self.expiry_margin:
            raise Unavailable(f"embedding lease {handle.lease_id} expired before it was read")
        peer = self._peer(handle)
        self._drop_dead_maps()
        pool = self._pool_view(handle) if self.same_host_copy and handle.host == self.host else None
        if pool is not None:
            payload = self._copy_same_host(pool, handle, peer)
        else:
            payload = self._read(handle, peer)
        self.bytes_pulled += handle.nbytes
        self.items_pulled += 1
        return payload.view(_DTYPES[layout.dtype]).reshape(layout.shape)

    def _copy_same_host(self, pool: torch.Tensor, handle, peer: str) -> torch.Tensor:
        start = handle.offset
        end = start + HEADER + handle.nbytes
        expected = int(handle.lease_id, 16)
        if int(pool[start: start + 8].view(torch.int64)[0]) != expected:
            raise Unavailable(f"embedding lease {handle.lease_id} was released or expired before the read")
        payload = pool[start + HEADER: end].clone()
        if int(pool[end: end + TRAILER].view(torch.int64)[0]) != expected or \
                int(pool[start: start + 8].view(torch.int64)[0]) != expected:
            raise Unavailable(f"embedding lease {handle.lease_id} was released or expired during the read")
        try:
            self.agent.send_notif(peer, RELEASE_PREFIX + handle.lease_id.encode())
        except Exception as exc:
            self._forget(peer)
            raise Unavailable(f"cannot notify embedding producer {peer}: {exc}") from exc
        return payload

    def _pool_view(self, handle) -> torch.Tensor | None:
        cached = self._maps.get(handle.agent_name)
        if cached is not None:
            return cached[2]
        if not handle.shm_path:
            return None
        try:
            fd = os.open(handle.shm_path, os.O_RDONLY)
        except FileNotFoundError:
            raise Unavailable(f"embedding producer {handle.agent_name} is gone") from None
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
            view = torch.frombuffer(mapped, dtype=torch.uint8) if size else torch.empty(0, dtype=torch.uint8)
        self._maps[handle.agent_name] = (handle.shm_path, mapped, view)
        return view

    def _drop_dead_maps(self) -> None:
        """A mapping keeps a dead producer's memory alive: drop those whose process is gone."""
        for name, (path, _, _) in list(self._maps.items()):
            if not os.path.exists(path):
                self._maps.pop(name)

    def _read(self, handle, peer: str) -> torch.Tensor:
        region = torch.empty(HEADER + handle.nbytes + TRAILER, dtype=torch.uint8)
        reg = self.agent.register_memory(region)
        xfer = None
        try:
            remote = self.agent.deserialize_descs(handle.descriptors)
            local = self.agent.get_xfer_descs(region)
            xfer = self.agent.initialize_xfer("READ", local, remote, peer, RELEASE_PREFIX + handle.lease_id.encode())
            state = self.agent.transfer(xfer)
            deadline = time.monotonic() + self.timeout
            spins = 0
            while state not in ("DONE", "ERR"):
                if time.monotonic() > deadline:
                    raise Unavailable(f"embedding transfer from {peer} timed out after {self.timeout} s")
                spins += 1
                if spins > 1000:
                    time.sleep(0.0002)
                state = self.agent.check_xfer_state(xfer)
            if state == "ERR":
                raise Unavailable(f"embedding transfer from {peer} failed")
        except Unavailable:
            self._forget(peer)
            raise
        except Exception as exc:  # NIXL raises its own errors (e.g. nixlRemoteDisconnectError)
            self._forget(peer)
            raise Unavailable(f"embedding transfer from {peer} failed: {type(exc).__name__}: {exc}") from exc
        finally:
            if xfer is not None:
                self.agent.release_xfer_handle(xfer)
            self.agent.deregister_memory(reg)
        tags = region[:8].view(torch.int64)[0], region[HEADER + handle.nbytes:].view(torch.int64)[0]
        expected = int(handle.lease_id, 16)
        if int(tags[0]) != expected or int(tags[1]) != expected:
            raise Unavailable(f"embedding lease {handle.lease_id} was released or expired before the read")
        return region[HEADER: HEADER + handle.nbytes]

    def _peer(self, handle) -> str:
        known = self._peers.get(handle.agent_name)
        if known is not None and known != handle.agent_metadata:
            # The same name with new metadata: the producer restarted (new process, new memory, new
            # connection details). Remove the old agent and add the new one, or every pull would go to
            # the dead one.
            self._forget(handle.agent_name)
            self._maps.pop(handle.agent_name, None)
        if handle.agent_name not in self._peers:
            try:
                name = self.agent.add_remote_agent(handle.agent_metadata)
            except Exception as exc:
                raise Unavailable(f"cannot reach embedding producer {handle.agent_name}: {exc}") from exc
            name = name.decode() if isinstance(name, bytes) else name
            self._peers[name] = handle.agent_metadata
        return handle.agent_name

    def _forget(self, peer: str) -> None:
        if peer in self._peers:
            del self._peers[peer]
            try:
                self.agent.remove_remote_agent(peer)
            except Exception:
                pass


def pull_image_embeds(consumer: EmbeddingConsumer, layouts) -> tuple[torch.Tensor, torch.Tensor]:
    """Pull every item of a request, in prompt order: (embeddings concatenated [tokens, hidden],
    image_grid_thw [items, 3]) as vLLM's ``image_embeds`` input wants them. A failed pull is
    ``Unavailable`` naming the item (``image_layouts[i]: ...``)."""
    embeds = []
    for index, layout in enumerate(layouts):
        try:
            embeds.append(consumer.pull(layout))
        except Unavailable as exc:
            raise Unavailable(f"image_layouts[{index}]: {exc}") from None
    grid = torch.tensor([list(layout.image_grid_thw) for layout in layouts], dtype=torch.int64)
    return torch.cat(embeds) if len(embeds) > 1 else embeds[0], grid
