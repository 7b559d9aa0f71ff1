"""What a transport is to the producer and the consumer: the ``Transport`` record each transport module fills in, and
the ``SameHostReader`` its consumer side implements.

A transport is named by its handle's ``transport`` (the wire type, ``backend.protocol.handles``: the layout document
is parsed in ``backend.protocol``, which knows every handle). It has two sides:

- producer (``Transport.handle``): given a pool (``backend.transfer.producer.EmbeddingPool``) and the common handle
  members, the transport's handle for a lease of that pool, or None where the pool does not offer the transport (a
  host pool has no CUDA IPC handle). The producer takes the first registered transport that offers its pool.
- consumer (``Transport.reader``): a ``SameHostReader`` for handles of this transport from a producer on this host
  (None: the transport has no same-host path, or this process cannot take it). Every handle names a NIXL-registered
  region, so the consumer's NIXL READ (``backend.transfer.consumer``) is the path of any handle a reader does not
  take: another host, a pool the reader cannot open, a transport without a reader.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from backend.protocol.handles import TransferHandle


class SameHostReader:
    """A transport's consumer side on the producer's host. ``read`` per item; the rest are hooks with no-op defaults.
    The consumer serialises its calls (one pull thread)."""

    def warm(self, handle: TransferHandle) -> None:
        """Map or open the producer's pool (``handle``: its pool's) ahead of the first pull."""

    def reserve(self, items: int) -> None:
        """Room for a call of ``items`` pulls, before any copy of the call."""

    def read(self, layout, peer: str, slot: int) -> torch.Tensor | tuple | None:
        """``layout``'s payload (bytes, on the host or where the reader copied it): the consumer then releases the
        lease; or a tuple (a copy enqueued, completed by ``finish``); or None (not here: the consumer READs through
        NIXL). ``slot``: the item's index among the call's enqueued copies. ``Unavailable`` if the lease ended."""
        return None

    def finish(self, pending: list) -> tuple[list, tuple[int, str] | None]:
        """Complete the enqueued copies ``pending`` ((index, layout, peer, *read's tuple) each): the items read, as
        (index, layout, peer, payload), and the first failure as (index, message), or None."""
        return [], None

    def wait(self, pending: list) -> None:
        """Wait for the enqueued copies ``pending`` (a call that fails must not free their destinations early)."""

    def forget(self, agent_name: str) -> None:
        """Drop what is held of a producer (unreachable, or restarted)."""

    def drop_dead(self) -> None:
        """Drop what is held of producers whose process is gone."""

    def close(self) -> None:
        """Release everything held."""


HandleMaker = Callable[[Any, dict, int, int], "TransferHandle | None"]
ReaderMaker = Callable[[torch.device, Any], "SameHostReader | None"]


@dataclass(frozen=True)
class Transport:
    """One transport: ``name`` (its handle's ``transport``), ``handle(pool, common, offset, tag_slot)`` (the
    producer side) and ``reader(device, shm)`` (the consumer side; ``shm``: the consumer's
    ``backend.transfer.same_host.SharedMemoryReader``, which maps producers' memfds for every transport)."""

    name: str
    handle_class: type[TransferHandle]
    handle: HandleMaker
    reader: ReaderMaker | None = None

    def __post_init__(self):
        if self.handle_class.transport != self.name:
            raise ValueError(f"transport {self.name!r} has the handle of {self.handle_class.transport!r}")
