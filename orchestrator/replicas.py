"""The replicas of a stage and the choice among them: healthy, least loaded, the one that holds a request's items.

A stage the topology puts on several hosts has one gRPC address per replica (an orchestrator's ``<role>_endpoint``
parameter: a comma-separated list, ``backend.deploy.hosts``); a DNS name that resolves to several addresses (a
Kubernetes headless Service, one address per ready pod) counts each, and is resolved again at every health check,
so pods that come and go are routed to and around.

``ReplicaSet.pick`` gives the healthy replica with the fewest outstanding calls of this orchestrator (ties: the
lowest KV-cache usage a health check read, in tenths, then the one that served fewest); a ``prefer``red replica (demand-aware
encoding: the consumer that holds the request's items) is taken unless it has ``PREFER_SLACK`` more outstanding
calls than the least loaded. ``failed`` routes around a replica at once (a call to it failed at the connection
level); the health check (``check``, every ``period`` seconds, run by the stage client) takes it back once it
answers again, and routes around one that stopped answering though no call failed yet. With every replica down,
the one that failed longest ago is tried: the caller gets the error of a real call, never a made-up one.

No Triton import: unit-tested.
"""
from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Iterable

log = logging.getLogger(__name__)
PROBE_SECONDS = 1.5  # a health probe not answered within this counts as failed
PREFER_SLACK = 2  # outstanding calls a preferred replica may have beyond the least loaded one and still be taken
# KV-cache usage breaks ties in steps of 1/KV_STEPS: an idle engine's gauge is its last step's, a few percent
# that mean nothing, and would otherwise send every request of a light load to the other replica
KV_STEPS = 10
LOST_AFTER = 2  # health checks failed in a row after which a replica counts as lost (its open streams end)
# a health probe: address -> (answers, KV-cache usage 0..1 or None where unknown); raises or times out: down
Probe = Callable[[str], Awaitable[tuple[bool, float | None]]]


@dataclass
class Replica:
    address: str  # host:port of its gRPC endpoint
    outstanding: int = 0  # this orchestrator's calls in flight to it
    healthy: bool = True
    failed_at: float = 0.0  # time.monotonic() of its last failure (0: none)
    kv_usage: float = 0.0  # its engine's KV-cache usage, 0..1, as the last health check read it
    served: int = 0  # calls given to it
    failures: int = 0  # health checks failed in a row
    # set while the replica is lost (a connection-level failure, or LOST_AFTER failed checks): calls still open to it end
    lost: asyncio.Event = field(default_factory=asyncio.Event)


def _host_port(entry: str) -> tuple[str, str]:
    host, _, port = entry.rpartition(":")
    return host.strip("[]"), port


def _is_literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


async def expand(entry: str) -> list[str]:
    """The addresses ``entry`` (``host:port``) stands for: itself for an IP address, every address a DNS name
    resolves to (IPv4 first), or the entry itself when it does not resolve now (its calls then fail and say so)."""
    host, port = _host_port(entry)
    if _is_literal(host) or host == "localhost":
        return [entry]
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    except (OSError, ValueError):
        return [entry]
    addresses = sorted({info[4][0] for info in infos}, key=lambda a: (":" in a, a))
    return [f"[{a}]:{port}" if ":" in a else f"{a}:{port}" for a in addresses] or [entry]


class ReplicaSet:
    """The replicas of one stage (``stage``: its name in messages), from its endpoint ``entries``."""

    def __init__(self, stage: str, entries: Iterable[str], on_lost: Callable[[str], None] | None = None):
        """``on_lost(address)``: called when a replica becomes lost (the stage client drops its channel there)."""
        self.stage, self.entries, self.on_lost = stage, list(entries), on_lost
        if not self.entries:
            raise ValueError(f"stage {stage}: no replica addresses")
        self._replicas = {entry: Replica(entry) for entry in self.entries}  # until the first refresh resolves names

    @property
    def replicas(self) -> list[Replica]:
        return list(self._replicas.values())

    def get(self, address: str) -> Replica | None:
        return self._replicas.get(address)

    async def refresh(self) -> None:
        """Resolve the entries again: new addresses join (healthy), addresses gone leave once idle."""
        resolved = [address for entry in self.entries for address in await expand(entry)]
        for address in resolved:
            self._replicas.setdefault(address, Replica(address))
        for address, replica in list(self._replicas.items()):
            if address not in resolved and replica.outstanding == 0:
                del self._replicas[address]

    def pick(self, prefer: str | None = None, exclude: Iterable[str] = ()) -> Replica:
        """The replica for the next call (see the module's docstring); ``exclude``: addresses not to use unless
        nothing else is left (a retry after a failure there)."""
        excluded = set(exclude)
        pool = [r for r in self._replicas.values() if r.address not in excluded] or list(self._replicas.values())
        healthy = [r for r in pool if r.healthy]
        if not healthy:  # every one down: the one that failed longest ago (its call says what is wrong)
            return min(pool, key=lambda r: r.failed_at)
        best = min(healthy, key=lambda r: (r.outstanding, int(r.kv_usage * KV_STEPS), r.served))
        chosen = self._replicas.get(prefer) if prefer else None
        if chosen is not None and chosen.healthy and chosen.address not in excluded \
                and chosen.outstanding <= best.outstanding + PREFER_SLACK:
            return chosen
        return best

    @contextlib.contextmanager
    def using(self, replica: Replica):
        """Count a call to ``replica`` as outstanding while the block runs."""
        replica.outstanding += 1
        replica.served += 1
        try:
            yield replica
        finally:
            replica.outstanding -= 1

    def failed(self, address: str, why: str, lost: bool = True) -> None:
        """A call to ``address`` failed: route around it until a health check finds it. ``lost``: at the connection
        level (the server is gone or cut off: the calls still open to it end too), not only slow."""
        replica = self._replicas.get(address)
        if replica is None:
            return
        replica.failed_at = time.monotonic()
        if lost and not replica.lost.is_set():
            replica.lost.set()
            if self.on_lost is not None:
                self.on_lost(address)
        if replica.healthy:
            replica.healthy = False
            log.warning("stage %s replica %s is down (%s); routing around it until it answers a health check",
                        self.stage, address, why)

    def answered(self, address: str, ok: bool, kv_usage: float | None = None, why: str = "") -> None:
        """A health check's outcome for ``address``."""
        replica = self._replicas.get(address)
        if replica is None:
            return
        if not ok:
            replica.failures += 1
            self.failed(address, why or "no answer to a health check", lost=replica.failures >= LOST_AFTER)
            return
        replica.failures = 0
        replica.lost.clear()
        if kv_usage is not None:
            replica.kv_usage = kv_usage
        if not replica.healthy:
            replica.healthy = True
            log.warning("stage %s replica %s answers again; routing to it", self.stage, address)

    async def check(self, probe: Probe, timeout: float) -> None:
        """One health check of every replica (names resolved again first), all at once, each within ``timeout``."""
        await self.refresh()

        async def one(replica: Replica) -> None:
            try:
                async with asyncio.timeout(timeout):
                    ok, usage = await probe(replica.address)
                self.answered(replica.address, ok, usage, "" if ok else "not ready")
            except Exception as exc:  # noqa: BLE001 - any failure is "down"; what it was is logged
                self.answered(replica.address, False, why=f"health check: {type(exc).__name__} {exc}".strip())

        await asyncio.gather(*(one(r) for r in self.replicas))


__all__ = ["Replica", "ReplicaSet", "expand", "PREFER_SLACK", "LOST_AFTER"]
