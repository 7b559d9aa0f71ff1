"""The consumer side: pull a lease's embeddings with one NIXL READ and tell the producer it is done.

Who calls it: a consumer model (``pd``) before it submits a request to vLLM: ``pull(layout)`` returns a
tensor of the layout's dtype and shape, or raises ``Unavailable`` (lease expired or released, producer
gone, transfer failed); the request then fails, never the engine. The READ carries the notification
``release:<lease_id>``, delivered to the producer when the data has arrived.

Three data paths, chosen per handle:
- same host, producer pool in host memory (``handle.host`` equals ours and the producer's pool memfd can
  be opened): map the pool once per producer (read-only) and copy the region;
- same host, producer pool in VRAM (``handle.ipc_handle`` set) and this process can use CUDA: open the
  pool once per producer through CUDA IPC and copy the region with the GPU's copy engine, into VRAM
  (``device="cuda"``) or host memory (``device="cpu"``);
- otherwise (another host, or no CUDA here): one NIXL READ into ``device``'s memory, carrying the release
  notification.
The same-host paths send the release as a NIXL notification (from a background thread; releases that
come within ``RELEASE_BATCH_SECONDS`` of each other share one). All check the lease's tag after the copy
(the region's tags; for CUDA IPC, the producer's host-memory tag table where it can be mapped), so a
region released or reused mid-copy is detected. ``docs/results/gpu.md`` has the measured bandwidths.

A failed transfer drops the producer from the agent's peers, so the next pull reconnects. A producer
that restarted under the same agent name (new metadata in its handles) is removed and added again
before the pull, so the first pull after the restart already works. Not thread-safe: callers serialise pulls (one executor thread).
"""
from __future__ import annotations

import collections
import logging
import mmap
import os
import queue
import threading
import time
import warnings

import numpy as np
import torch

from backend.protocol.errors import Unavailable
from backend.protocol.layout import LayoutMetadata, host_identity
from backend.transfer.agent import create_agent
from backend.transfer.producer import HEADER, RELEASE_PREFIX, TRAILER

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
RELEASE_BATCH_SECONDS = 0.001  # releases this close together share one notification (see _send_releases)


class EmbeddingConsumer:
    def __init__(self, role: str = "consumer", timeout: float = 10.0, expiry_margin: float = 0.05,
                 same_host_copy: bool = True, poll_delay_us: int | None = None, device: str = "cpu",
                 cuda_ipc: bool = True):
        # Release notifications go out from a background thread (off the pull's critical path: ~10-15 us
        # a call on the GPU machine, as much as a 16 MiB copy); the agent is made thread-safe for it.
        self.agent = create_agent(role, poll_delay_us, thread_safe=True)
        self._releases: "queue.SimpleQueue[tuple[str, str] | None]" = queue.SimpleQueue()
        self._unreachable: set[str] = set()  # peers the release thread could not notify (forgotten on next pull)
        self._release_thread: threading.Thread | None = None
        self.timeout, self.expiry_margin, self.same_host_copy = timeout, expiry_margin, same_host_copy
        self.device = torch.device(device)
        self.host = host_identity()
        self._peers: dict[str, bytes] = {}  # agent name -> the metadata it was added with
        # (agent name, "pool" | "tags") -> (path, map, view): a host pool (bytes) or a VRAM pool's tag table
        self._maps: dict[tuple[str, str], tuple[str, mmap.mmap, object]] = {}
        # agent name -> (producer pid, its OpenedAllocation here, (base pointer, copy stream, bytes mapped))
        self._ipc: dict[str, tuple[int, object, tuple[int, int, int]]] = {}
        self._ipc_api = None  # backend.transfer.cuda_ipc, where this process can use it
        self._no_ipc: set[str] = set()
        if cuda_ipc and same_host_copy:
            from backend.transfer import cuda_ipc as ipc
            self._ipc_api = ipc if ipc.available() else None
        self._use_ipc = self._ipc_api is not None
        self._trailers = self._trailer_words = None
        if self._use_ipc:
            self._grow_trailers(16)
        self._streams: dict[int, torch.cuda.Stream] = {}
        self._next_liveness_check = 0.0
        self.paths: collections.Counter[str] = collections.Counter()  # pulls per data path
        self.bytes_pulled = 0
        self.items_pulled = 0

    def warm(self, handle) -> None:
        """Connect to a producer before any pull from it (``handle``: its pool's, ``EmbeddingPool.pool_handle``):
        add its agent, map its pool (or open its VRAM pool) where a pull on this host will copy from it, and
        start the release thread, so that the first pull costs what later ones do. Never raises (the first
        pull connects if this did not). Call it where pulls run (not thread-safe)."""
        try:
            self._peer(handle)
            if self.same_host_copy and handle.host == self.host:
                if handle.ipc_handle and self._use_ipc:
                    self._ipc_view(handle)
                    self._tag_table(handle)
                elif handle.shm_path and (pool := self._pool_view(handle)) is not None and pool.numel() >= 2 * HEADER:
                    # the ops of a pull (``_copy_same_host``, ``pull_image_embeds``) once: their first call
                    # costs more than a whole later pull
                    part = pool[:HEADER].clone()
                    torch.cat([part.view(torch.int64), part.view(torch.int64)])
                    torch.tensor([[1, 2, 2]], dtype=torch.int64)
            self._start_release_thread()
        except Exception as exc:  # noqa: BLE001 - an optimisation only
            log.warning("could not connect ahead to embedding producer %s: %s", handle.agent_name, exc)

    def pull(self, layout: LayoutMetadata) -> torch.Tensor:
        return self.pull_many([layout])[0]

    def pull_many(self, layouts, names: list[str] | None = None) -> list[torch.Tensor]:
        """Pull every layout; CUDA IPC items of the call share one wait and one release notification per
        producer. A failure raises ``Unavailable`` prefixed with the item's name (``names[i]``, if given)."""
        names = names or [""] * len(layouts)
        while self._unreachable:
            self._forget(self._unreachable.pop())
        self._drop_dead_maps()
        results: list[torch.Tensor | None] = [None] * len(layouts)
        pending = []  # CUDA IPC copies in flight: (index, layout, peer, (payload, tag check), stream)
        if self._use_ipc and len(layouts) > len(self._trailer_words):  # a word for every item, before any copy
            self._grow_trailers(len(layouts))
        try:
            for index, layout in enumerate(layouts):
                handle = layout.handle
                try:
                    if time.time() > handle.expires_at - self.expiry_margin:
                        raise Unavailable(f"embedding lease {handle.lease_id} expired before it was read")
                    peer = self._peer(handle)
                    same_host = self.same_host_copy and handle.host == self.host
                    if same_host and handle.ipc_handle and self._use_ipc and (ipc := self._ipc_view(handle)) is not None:
                        pending.append((index, layout, peer, self._enqueue_ipc(ipc, layout, len(pending)), ipc[1]))
                        continue
                    if same_host and (pool := self._pool_view(handle)) is not None:
                        payload, path = self._copy_same_host(pool, handle, peer).to(self.device), "shared_memory"
                    else:
                        payload, path = self._read(handle, peer), "nixl"
                except Unavailable as exc:
                    raise Unavailable(str(exc), names[index]) from None
                results[index] = self._count(layout, payload.view(_DTYPES[layout.dtype]).reshape(layout.shape), path)
            if pending:
                self._finish_ipc(pending, results, names)
        except BaseException:
            if pending:  # copies may still be running into the payloads: let them finish first
                for stream in {entry[4] for entry in pending}:
                    self._ipc_api.synchronize(stream)
            raise
        return results

    def _count(self, layout, payload: torch.Tensor, path: str) -> torch.Tensor:
        self.paths[path] += 1
        self.bytes_pulled += layout.handle.nbytes
        self.items_pulled += 1
        return payload

    def _grow_trailers(self, slots: int) -> None:
        """Pinned host words the trailer tags of a call's items are copied into, read through numpy (only
        for producers whose lease-tag table this process cannot map)."""
        self._trailers = torch.zeros(slots, dtype=torch.int64, pin_memory=True)
        self._trailer_words = self._trailers.numpy()

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
        self._notify(peer, handle.lease_id)
        return payload

    def _enqueue_ipc(self, pool: tuple[int, int, int], layout, slot: int):
        """Enqueue the copy of ``layout``'s payload (into a new tensor of its dtype and shape, on this
        consumer's device) on the pool's copy stream, no wait. Returns (payload, tag words, index): where
        the lease's tag is to be checked once the copy is done."""
        base, stream, mapped = pool
        handle = layout.handle
        start = handle.offset + HEADER
        if start + handle.nbytes + TRAILER > mapped:
            raise Unavailable(f"embedding lease {handle.lease_id}: region outside the producer's pool")
        tags = self._tag_table(handle)
        if tags is not None and not 0 <= handle.tag_slot < len(tags):
            raise Unavailable(f"embedding lease {handle.lease_id}: tag slot outside the producer's table")
        if tags is not None and int(tags[handle.tag_slot]) != int(handle.lease_id, 16):
            return None, (tags, handle.tag_slot)  # ended already: no copy; it fails in _finish_ipc, as one
            # that ends during the copy does, after the call's other items (which are released as usual)
        # host destinations are pinned (torch caches pinned blocks): device-to-host copies into pageable
        # memory ran at 1-11 GB/s on the H200 machine, into pinned memory at 35-55 GB/s
        payload = torch.empty(layout.shape, dtype=_DTYPES[layout.dtype], device=self.device,
                              pin_memory=self.device.type == "cpu")
        if payload.numel() * payload.element_size() != handle.nbytes:
            raise Unavailable(f"embedding lease {handle.lease_id}: {handle.nbytes} bytes do not make "
                              f"{layout.dtype}{list(layout.shape)}")
        # Where the producer's tag table is mapped here, its word for the lease is checked after the copy
        # (the producer clears it before it touches the region: still set then means nothing was
        # overwritten meanwhile). Otherwise the region's trailer tag is copied after the payload, in
        # stream order, into a pinned word: one more (device-to-host) copy per item.
        trailer = None if tags is not None else self._trailers.data_ptr() + 8 * slot
        self._ipc_api.enqueue_region(base + start, payload.data_ptr(), handle.nbytes, trailer, stream,
                                     to_host=self.device.type == "cpu")
        return payload, (tags, handle.tag_slot) if tags is not None else (self._trailer_words, slot)

    def _finish_ipc(self, pending, results, names) -> None:
        for stream in {entry[4] for entry in pending}:
            self._ipc_api.synchronize(stream)
        releases: dict[str, list[str]] = {}
        failed = None
        for index, layout, peer, (payload, (words, word)), _ in pending:
            if payload is None or int(words[word]) != int(layout.handle.lease_id, 16):
                when = "before" if payload is None else "during"
                failed = failed or (index, f"embedding lease {layout.handle.lease_id} was released or expired "
                                           f"{when} the read")
                continue
            releases.setdefault(peer, []).append(layout.handle.lease_id)
            results[index] = self._count(layout, payload, "cuda_ipc")
        for peer, lease_ids in releases.items():  # one notification per producer for the whole call
            self._notify(peer, ",".join(lease_ids))
        if failed:
            index, message = failed
            raise Unavailable(message, names[index])

    def _stream(self, device) -> int:
        """This consumer's copy stream on the producer pool's GPU, as a raw ``cudaStream_t`` (made once:
        asking torch for the current stream costs as much host time as a small copy)."""
        index = device.index or 0
        stream = self._streams.get(index)
        if stream is None:
            stream = self._streams[index] = torch.cuda.Stream(device=index)
        return stream.cuda_stream

    def _notify(self, peer: str, lease_ids: str) -> None:
        """Queue ``release:<ids>`` for ``peer``. The data is already here: a notification that fails only
        leaves the leases to expire at the producer (logged; the peer is reconnected on the next pull)."""
        self._start_release_thread()
        self._releases.put((peer, lease_ids))

    def _start_release_thread(self) -> None:
        if self._release_thread is None:
            self._release_thread = threading.Thread(target=self._send_releases, name="embedding-releases",
                                                    daemon=True)
            self._release_thread.start()

    def _send_releases(self) -> None:
        """The release thread: releases queued within ``RELEASE_BATCH_SECONDS`` of each other go out as one
        notification per producer (each ``send_notif`` takes host time from the pulls that follow)."""
        stop = False
        while not stop:
            batch = [self._releases.get()]
            time.sleep(RELEASE_BATCH_SECONDS)
            while not self._releases.empty():
                batch.append(self._releases.get())
            by_peer: dict[str, list[str]] = {}
            for item in batch:
                if item is None:
                    stop = True
                else:
                    by_peer.setdefault(item[0], []).append(item[1])
            for peer, lease_ids in by_peer.items():
                try:
                    self.agent.send_notif(peer, RELEASE_PREFIX + ",".join(lease_ids).encode())
                except Exception as exc:  # noqa: BLE001 - the producer reclaims the leases when they expire
                    log.warning("cannot notify embedding producer %s (leases %s expire there): %s", peer,
                                ",".join(lease_ids), exc)
                    self._unreachable.add(peer)

    def _ipc_view(self, handle) -> tuple[int, int, int] | None:
        """The producer's VRAM pool mapped here, as (base pointer, copy stream, bytes), or None where CUDA IPC
        cannot open it (a pool of this very process, a GPU this process cannot see): NIXL then."""
        cached = self._ipc.get(handle.agent_name)
        if cached is None:
            if handle.pid == os.getpid() or handle.agent_name in self._no_ipc:
                return None
            from backend.transfer.cuda_ipc import open_allocation
            try:
                opened = open_allocation(handle.ipc_handle, handle.pool_bytes, self.device)
            except RuntimeError as exc:
                log.warning("CUDA IPC cannot open %s's pool, using NIXL: %s", handle.agent_name, exc)
                self._no_ipc.add(handle.agent_name)
                return None
            view = (opened.tensor.data_ptr(), self._stream(opened.tensor.device), opened.tensor.numel())
            cached = self._ipc[handle.agent_name] = (handle.pid, opened, view)
        return cached[2]

    def close(self) -> None:
        """Send the releases still queued, close CUDA IPC mappings and pool maps (the agent goes with the
        object)."""
        if self._release_thread is not None:
            self._releases.put(None)
            self._release_thread.join(timeout=5)
            self._release_thread = None
        for _, opened, _ in self._ipc.values():
            opened.close()
        self._ipc.clear()
        self._maps.clear()

    def _pool_view(self, handle) -> torch.Tensor | None:
        """A host pool's bytes, mapped read-only (None: not mappable here, use NIXL)."""
        return self._mapped(handle, "pool", handle.shm_path,
                            lambda mapped, size: torch.frombuffer(mapped, dtype=torch.uint8) if size
                            else torch.empty(0, dtype=torch.uint8))

    def _tag_table(self, handle):
        """A VRAM pool's lease-tag table (host memory, int64 words), mapped read-only, or None."""
        return self._mapped(handle, "tags", handle.tag_table, lambda mapped, size: np.frombuffer(mapped, np.int64))

    def _mapped(self, handle, kind: str, path: str, make_view):
        cached = self._maps.get((handle.agent_name, kind))
        if cached is not None:
            return cached[2]
        if not path:
            return None
        try:
            fd = os.open(path, os.O_RDONLY)
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
            view = make_view(mapped, size)
        self._maps[(handle.agent_name, kind)] = (path, mapped, view)
        return view

    def _drop_dead_maps(self) -> None:
        """A mapping keeps a dead producer's memory alive: drop those whose process is gone (checked at
        most once a second)."""
        now = time.monotonic()
        if now < self._next_liveness_check:
            return
        self._next_liveness_check = now + 1.0
        for name, (path, _, _) in list(self._maps.items()):
            if not os.path.exists(path):
                self._maps.pop(name)
        for name, (pid, opened, _) in list(self._ipc.items()):
            if pid and not os.path.exists(f"/proc/{pid}"):
                self._ipc.pop(name)
                opened.close()

    def _read(self, handle, peer: str) -> torch.Tensor:
        region = torch.empty(HEADER + handle.nbytes + TRAILER, dtype=torch.uint8, device=self.device)
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
            self._maps.pop((handle.agent_name, "pool"), None)
            self._maps.pop((handle.agent_name, "tags"), None)
        if handle.agent_name not in self._peers:
            try:
                name = self.agent.add_remote_agent(handle.agent_metadata)
            except Exception as exc:
                raise Unavailable(f"cannot reach embedding producer {handle.agent_name}: {exc}") from exc
            name = name.decode() if isinstance(name, bytes) else name
            self._peers[name] = handle.agent_metadata
        return handle.agent_name

    def _forget(self, peer: str) -> None:
        if peer in self._ipc:
            self._ipc.pop(peer)[1].close()
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
    embeds = consumer.pull_many(layouts, [f"image_layouts[{index}]" for index in range(len(layouts))])
    grid = torch.tensor([list(layout.image_grid_thw) for layout in layouts], dtype=torch.int64)
    return torch.cat(embeds) if len(embeds) > 1 else embeds[0], grid
