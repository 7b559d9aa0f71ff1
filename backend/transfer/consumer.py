"""The consumer side: pull a lease's embeddings and tell the producer it is done.

Who calls it: a consumer model (``pd``, ``prefill``) before it submits a request to vLLM: ``pull(layout)`` returns a
tensor of the layout's dtype and shape, or raises ``Unavailable`` (lease expired or released, producer
gone, transfer failed); the request then fails, never the engine.

The data path is chosen per handle by its transport (``handle.transport``, a key of the transport registry,
``backend.transfer.transports``) and where it is:
- from this host (``handle.host`` equals ours), a transport with a same-host reader here: the reader's copy
  (``shared_memory``: the pool's memfd mapped once per producer, read-only, and the region copied; ``cuda_ipc``, where
  this process can use CUDA: the pool opened once per producer through CUDA IPC and the region copied with the GPU's
  copy engine, into VRAM (``device="cuda"``) or host memory (``device="cpu"``), the call's copies finished together);
- otherwise (a ``nixl`` handle, another host, a pool the reader cannot open, or no CUDA here): one NIXL READ into
  ``device``'s memory, carrying the notification ``release:<lease_id>``, delivered to the producer when the data has
  arrived.
The same-host paths send the release as a NIXL notification (from a background thread; releases that
come within ``RELEASE_BATCH_SECONDS`` of each other share one). All check the lease's tag after the copy
(the region's tags; for CUDA IPC, the producer's host-memory tag table where it can be mapped), so a
region released or reused mid-copy is detected. ``docs/results/gpu.md`` has the measured bandwidths.

A failed transfer drops the producer from the agent's peers, so the next pull reconnects. A producer
that restarted under the same agent name (new metadata in its handles) is removed and added again
before the pull, so the first pull after the restart already works. Not thread-safe: callers serialise pulls
(one executor thread).
"""
from __future__ import annotations

import collections
import logging
import queue
import threading
import time

import torch

from backend.protocol.errors import Unavailable
from backend.protocol.layout import LayoutMetadata, host_identity
from backend.transfer.agent import create_agent
from backend.transfer.region import HEADER, RELEASE_PREFIX, TRAILER
from backend.transfer.same_host import DTYPES, SharedMemoryReader
from backend.transfer.transports import SameHostReader, transports

log = logging.getLogger(__name__)

RELEASE_BATCH_SECONDS = 0.001  # releases this close together share one notification (see _send_releases)


class EmbeddingConsumer:
    def __init__(self, role: str = "consumer", timeout: float = 10.0, expiry_margin: float = 0.05,
                 same_host_copy: bool = True, poll_delay_us: int | None = None, device: str = "cpu",
                 same_host: tuple[str, ...] | None = None):
        """``same_host_copy``: take the same-host readers at all; ``same_host``: the transports whose reader this
        consumer may take (None: every registered one's)."""
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
        self._shm = SharedMemoryReader()
        self.readers: dict[str, SameHostReader] = {}  # transport name -> its same-host reader here
        for t in transports() if same_host_copy else ():
            if t.reader is not None and (same_host is None or t.name in same_host) and \
                    (reader := t.reader(self.device, self._shm)) is not None:
                self.readers[t.name] = reader
        self._next_liveness_check = 0.0
        self.paths: collections.Counter[str] = collections.Counter()  # pulls per data path
        self.bytes_pulled = 0
        self.items_pulled = 0
        # Destinations of READs given up before they finished (timed out: e.g. a partition). UCX may still write
        # into them: over TCP the connection outlives a partition and the data lands once it heals, after the
        # handle was released and the peer removed. Freed, the next allocations there were corrupted (seen:
        # "malloc(): largebin double linked list corrupted", tests/e2e/test_netns_transfer.py); so they are kept.
        self.abandoned: list[torch.Tensor] = []

    def warm(self, handle) -> None:
        """Connect to a producer before any pull from it (``handle``: its pool's, ``EmbeddingPool.pool_handle``):
        add its agent, map its pool (or open its VRAM pool) where a pull on this host will copy from it, and
        start the release thread, so that the first pull costs what later ones do. Never raises (the first
        pull connects if this did not). Call it where pulls run (not thread-safe)."""
        try:
            self._peer(handle)
            if (reader := self._reader(handle)) is not None:
                reader.warm(handle)
            self._start_release_thread()
        except Exception as exc:  # noqa: BLE001 - an optimisation only
            log.warning("could not connect ahead to embedding producer %s: %s", handle.agent_name, exc)

    def pull(self, layout: LayoutMetadata) -> torch.Tensor:
        return self.pull_many([layout])[0]

    def pull_many(self, layouts, names: list[str] | None = None) -> list[torch.Tensor]:
        """Pull every layout; items a reader enqueued (CUDA IPC) share one wait and one release notification per
        producer. A failure raises ``Unavailable`` prefixed with the item's name (``names[i]``, if given)."""
        names = names or [""] * len(layouts)
        while self._unreachable:
            self._forget(self._unreachable.pop())
        self._drop_dead_maps()
        results: list[torch.Tensor | None] = [None] * len(layouts)
        pending = []  # copies in flight (CUDA IPC): (index, layout, peer, *what the reader's read gave)
        for reader in self.readers.values():  # e.g. a trailer word for every item, before any copy
            reader.reserve(len(layouts))
        try:
            for index, layout in enumerate(layouts):
                try:
                    pulled = self._pull_or_enqueue(layout, len(pending))
                except Unavailable as exc:
                    raise Unavailable(str(exc), names[index]) from None
                if isinstance(pulled, tuple):
                    pending.append((index, layout, *pulled))
                else:
                    results[index] = pulled
            if pending:
                self._finish(pending, results, names)
        except BaseException:
            for name, group in _by_transport(pending).items():  # copies may still be running into the payloads
                self.readers[name].wait(group)
            raise
        return results

    def _pull_or_enqueue(self, layout: LayoutMetadata, slot: int):
        """One item: its tensor, or, for a copy a reader enqueued, (peer, *what the reader's read gave)."""
        handle = layout.handle
        if time.time() > handle.expires_at - self.expiry_margin:
            raise Unavailable(f"embedding lease {handle.lease_id} expired before it was read")
        peer = self._peer(handle)
        reader = self._reader(handle)
        pulled = reader.read(layout, peer, slot) if reader is not None else None
        if isinstance(pulled, tuple):
            return (peer, *pulled)
        if pulled is not None:  # copied here: the lease can go
            self._notify(peer, handle.lease_id)
            payload, path = pulled.to(self.device), handle.transport
        else:
            payload, path = self._read(handle, peer), "nixl"
        return self._count(layout, payload.view(DTYPES[layout.dtype]).reshape(layout.shape), path)

    def _reader(self, handle) -> SameHostReader | None:
        """The same-host reader of ``handle``'s transport, where its producer is on this host; else None (NIXL)."""
        return self.readers.get(handle.transport) if handle.host == self.host else None

    def _count(self, layout, payload: torch.Tensor, path: str) -> torch.Tensor:
        self.paths[path] += 1
        self.bytes_pulled += layout.handle.nbytes
        self.items_pulled += 1
        return payload

    def _finish(self, pending, results, names) -> None:
        """Complete the call's enqueued copies, per transport: one release notification per producer."""
        for name, group in _by_transport(pending).items():
            done, failed = self.readers[name].finish(group)
            releases: dict[str, list[str]] = {}
            for index, layout, peer, payload in done:
                releases.setdefault(peer, []).append(layout.handle.lease_id)
                results[index] = self._count(layout, payload, name)
            for peer, lease_ids in releases.items():  # one notification per producer for the whole call
                self._notify(peer, ",".join(lease_ids))
            if failed:
                index, message = failed
                raise Unavailable(message, names[index])

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

    def close(self) -> None:
        """Send the releases still queued, close the readers' mappings (CUDA IPC) and pool maps (the agent goes with
        the object)."""
        if self._release_thread is not None:
            self._releases.put(None)
            self._release_thread.join(timeout=5)
            self._release_thread = None
        for reader in self.readers.values():
            reader.close()
        self._shm.maps.clear()

    def _drop_dead_maps(self) -> None:
        """A mapping keeps a dead producer's memory alive: drop those whose process is gone (checked at
        most once a second)."""
        now = time.monotonic()
        if now < self._next_liveness_check:
            return
        self._next_liveness_check = now + 1.0
        self._shm.drop_dead()
        for reader in self.readers.values():
            reader.drop_dead()

    def _read(self, handle, peer: str) -> torch.Tensor:
        region = torch.empty(HEADER + handle.nbytes + TRAILER, dtype=torch.uint8, device=self.device)
        reg = self.agent.register_memory(region)
        xfer, state = None, None
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
                if state not in ("DONE", "ERR"):
                    self.abandoned.append(region)
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
            self._shm.forget(handle.agent_name)
        if handle.agent_name not in self._peers:
            try:
                name = self.agent.add_remote_agent(handle.agent_metadata)
            except Exception as exc:
                raise Unavailable(f"cannot reach embedding producer {handle.agent_name}: {exc}") from exc
            name = name.decode() if isinstance(name, bytes) else name
            self._peers[name] = handle.agent_metadata
        return handle.agent_name

    def _forget(self, peer: str) -> None:
        for reader in self.readers.values():
            reader.forget(peer)
        if peer in self._peers:
            del self._peers[peer]
            try:
                self.agent.remove_remote_agent(peer)
            except Exception:
                pass


def _by_transport(pending: list) -> dict[str, list]:
    """The enqueued copies ``pending`` grouped by their handle's transport, in order."""
    groups: dict[str, list] = {}
    for entry in pending:
        groups.setdefault(entry[1].handle.transport, []).append(entry)
    return groups
