"""The transports embeddings move by, by their handle's ``transport`` name: one module each (its producer and
consumer sides; ``base.Transport``), registered here in the producer's order of preference (a pool's handle is the
first transport's that offers it).

Who asks: ``backend.transfer.producer`` (``handle_for``: a lease's handle) and ``backend.transfer.consumer``
(``transports()``: a same-host reader per transport, picked by ``layout.handle.transport``); neither branches on a
transport's name or handle class. A new transport: its handle class in ``backend.protocol.handles`` (the wire type),
its module here and its line in ``TRANSPORTS``.
"""
from __future__ import annotations

from backend.protocol.handles import TransferHandle
from backend.protocol.registry import Registry
from backend.transfer.transports import cuda_ipc, nixl, shared_memory
from backend.transfer.transports.base import SameHostReader, Transport

TRANSPORTS = (cuda_ipc.TRANSPORT, shared_memory.TRANSPORT, nixl.TRANSPORT)  # the producer's order of preference

class UnknownTransport(ValueError):
    """A transport name no registered transport has."""


_REGISTRY: Registry[Transport] = Registry("transport known as", lambda t: t.name, UnknownTransport)
register, unregister = _REGISTRY.register, _REGISTRY.unregister  # later ones come after: the producer prefers earlier
transport = _REGISTRY.get  # the transport registered under a name; UnknownTransport naming the known ones otherwise
transports = _REGISTRY.entries  # the registered transports, in the producer's order of preference


def handle_for(pool, common: dict, offset: int = 0, tag_slot: int = 0) -> TransferHandle:
    """The handle of a lease of ``pool`` (``common``: the members every handle has): the first registered transport's
    that offers the pool."""
    for t in transports():
        if (handle := t.handle(pool, common, offset, tag_slot)) is not None:
            return handle
    raise UnknownTransport(f"no registered transport offers this pool (known: {', '.join(_REGISTRY.names())})")


for _transport in TRANSPORTS:
    register(_transport)

__all__ = ["SameHostReader", "TRANSPORTS", "Transport", "UnknownTransport", "handle_for", "register", "transport",
           "transports", "unregister"]
