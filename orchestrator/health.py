"""The health of a stage client's replicas: which answer, which are lost (``orchestrator.routing.RoutedStages`` runs it).

After load, ``watch`` waits until every stage answers ready at one address at least and says so once (or warns
while one does not); then, where any stage is remote or replicated, it probes every replica every
``health_seconds``: model readiness, a unary call with a deadline; an engine's KV-cache usage is read beside it
(``HealthCalls.read_load``, in a task of its own, so a slow answer delays no check). A replica lost
(``orchestrator.replicas.LOST_AFTER``) is probed on a fresh channel each time (``fresh``). The calls themselves are a
transport's (``HealthCalls``: Triton's gRPC in ``backend.triton.stage_client``; a fake in unit tests).
"""
from __future__ import annotations

import asyncio
import time
from typing import Protocol

from backend.protocol.errors import Unavailable
from orchestrator.replicas import PROBE_SECONDS, Replica, ReplicaSet


class Unreachable(Unavailable):
    """A call to a stage failed itself (no server there, connection lost, replica lost), not the stage's work.
    ``lost``: at the connection level (the calls still open there end too), not only slow (a deadline passed)."""

    def __init__(self, message: str = "", field: str = "", *, lost: bool = True):
        super().__init__(message, field)
        self.lost = lost


class Lost(Exception):
    """The replica a call waits on was lost."""


def cancelled_here() -> bool:
    """Whether the running task itself is being cancelled; a ``CancelledError`` otherwise came from a call under it
    (grpc.aio raises it from a call cancelled locally, e.g. by its channel closing when its replica was lost)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


async def unless(awaitable, lost: asyncio.Event):
    """``awaitable``'s result, or ``Lost`` (``awaitable`` cancelled) if ``lost`` is or gets set first, or is set when
    ``awaitable`` failed: the lost replica's channel closes at once (``on_lost``), which cancels the calls on it, and
    that may end the call in the same turn of the loop as ``lost`` wakes this task."""
    call = asyncio.ensure_future(awaitable)
    if lost.is_set():
        call.cancel()
        raise Lost
    waiter = asyncio.ensure_future(lost.wait())
    try:
        await asyncio.wait((call, waiter), return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # this task cancelled: the call goes too
        call.cancel()
        raise
    finally:
        waiter.cancel()
    if not call.done():
        call.cancel()
        raise Lost
    if lost.is_set() and (call.cancelled() or call.exception() is not None):
        raise Lost
    return call.result()


class HealthCalls(Protocol):
    async def ready(self, model: str, address: str) -> "bool | str":
        """True if ``model`` answers ready at ``address``, else what it answered (on a channel of its own)."""

    async def probe(self, model: str, address: str, fresh: bool) -> bool:
        """One health probe within ``PROBE_SECONDS``; ``fresh``: on a channel of its own (a lost replica)."""

    def read_load(self, replica: Replica, model: str) -> None:
        """Start reading ``replica``'s KV-cache usage into ``replica.kv_usage`` (one read at a time per replica)."""


def prober(calls: HealthCalls, replicas: ReplicaSet, engine: bool):
    """The health probe of ``replicas`` (``orchestrator.replicas.Probe``); engines' KV-cache usage is read beside it."""
    async def probe(address: str) -> tuple[bool, float | None]:
        replica = replicas.get(address)
        fresh = replica is None or replica.lost.is_set()  # a failed channel backs off for minutes
        ready = await calls.probe(replicas.stage, address, fresh)
        if ready and engine and not fresh:
            calls.read_load(replica, replicas.stage)
        return ready, None
    return probe


async def watch(calls: HealthCalls, sets: list[tuple[ReplicaSet, bool]], health_seconds: float, logger,
                warn_after: float = 60.0, interval: float = 0.5) -> dict[str, str]:
    """After load: wait until every stage of ``sets`` (each replica set with whether it is an engine stage's)
    answers ready at one address at least; say so once (``logger.info``), or, while one does not after
    ``warn_after`` seconds, warn naming the stage, the addresses and the last answer (then keep waiting: a stage
    may load late). Then, with ``health_seconds``, check every replica that often until cancelled (at unload).
    Returns stage model -> addresses."""
    waiting = {replicas.stage: replicas for replicas, _ in sets}
    started, warned, last = time.monotonic(), False, {}
    while waiting:
        for model, replicas in list(waiting.items()):
            for replica in replicas.replicas:
                last[model] = await calls.ready(model, replica.address)
                if last[model] is True:
                    del waiting[model]
                    break
        if waiting and not warned and time.monotonic() - started > warn_after:
            warned = True
            for model, replicas in waiting.items():
                logger.warning(
                    f"stage {model} not reachable over gRPC at {','.join(replicas.entries)} after {warn_after:.0f} s "
                    f"({last.get(model)}); still waiting (a GPU engine can take minutes to load): until it answers, "
                    f"requests that need it fail UNAVAILABLE; if it never does, check its endpoint in the topology")
        if waiting:
            await asyncio.sleep(interval if not warned else 5.0)
    reached = {replicas.stage: ",".join(replicas.entries) for replicas, _ in sets}
    logger.info("stages reachable over gRPC: " + ", ".join(f"{m} at {u}" for m, u in reached.items()))
    while health_seconds:
        await asyncio.gather(*(replicas.check(prober(calls, replicas, engine), PROBE_SECONDS)
                               for replicas, engine in sets))
        await asyncio.sleep(health_seconds)
    return reached


__all__ = ["Unreachable", "Lost", "cancelled_here", "unless", "HealthCalls", "prober", "watch"]
