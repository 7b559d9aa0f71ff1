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
from backend.transfer.transports import cuda_ipc, nixl, shared_memory
from backend.transfer.transports.base import SameHostReader, Transport

TRANSPORTS = (cuda_ipc.TRANSPORT, shared_memory.TRANSPORT, nixl.TRANSPORT)  # the producer's order of preference

_REGISTRY: dict[str, Transport] = {}


class UnknownTransport(ValueError):
    """A transport name no registered transport has."""


def register(transport: Transport) -> Transport:
    """Add ``transport`` (after those registered before it: the producer prefers earlier ones)."""
    if transport.name in _REGISTRY:
        raise ValueError(f"transport {transport.name!r} is already registered")
    _REGISTRY[transport.name] = transport
    return transport


def unregister(name: str) -> None:
    del _REGISTRY[name]


def transport(name: str) -> Transport:
    """The transport registered under ``name``; ``UnknownTransport`` naming it and the known ones otherwise."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UnknownTransport(f"no transport known as {name!r}; known: {', '.join(_REGISTRY)}") from None


def transports() -> tuple[Transport, ...]:
    """The registered transports, in the producer's order of preference."""
    return tuple(_REGISTRY.values())


def handle_for(pool, common: dict, offset: int = 0, tag_slot: int = 0) -> TransferHandle:
    """The handle of a lease of ``pool`` (``common``: the members every handle has): the first registered transport's
    that offers the pool."""
    for t in _REGISTRY.values():
        if (handle := t.handle(pool, common, offset, tag_slot)) is not None:
            return handle
    raise UnknownTransport(f"no registered transport offers this pool (known: {', '.join(_REGISTRY)})")


for _transport in TRANSPORTS:
    register(_transport)

__all__ = ["SameHostReader", "TRANSPORTS", "Transport", "UnknownTransport", "handle_for", "register", "transport",
           "transports", "unregister"]
