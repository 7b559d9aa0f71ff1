"""A ``StageClient`` over the replicas of each stage: which replica takes each call, and what a failed call does.

Each generate call and each encode goes to the healthy replica with the fewest of this orchestrator's calls in
flight (generators: then the lowest KV-cache usage; ``orchestrator.replicas``); demand-aware lookups ask every healthy
consumer replica and pin the request to the one holding most of its items, unless that one is overloaded. A call
that fails at the connection level (``Unreachable``) routes around its replica at once; the health checks
(``orchestrator.health``) take it back once it answers again, and end the streams still open to one that is lost, so
nothing waits for a host that is gone. With ``health_seconds`` (any stage remote or replicated), the final response
of each stage names the replica that served it (``timings``: ``pd_replica``, ``prefill_replica``,
``decode_replica``).

The calls to one replica are a transport's (``StageCalls``: Triton's gRPC, ``backend.triton.stage_client``; a fake
in unit tests); encodes with no encoder replicas go to ``local`` (BLS in this server).
"""
from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
from dataclasses import replace
from typing import AsyncIterator, Protocol

from backend.engine.serving import ResponseChunk
from backend.protocol.stages import Stage
from backend.request.generate import MediaBytes, RawGenerateInputs
from orchestrator.health import HealthCalls, Unreachable, watch
from orchestrator.replicas import ReplicaSet

# the consumer replica a demand-aware lookup chose for this request (its task's context): stage -> address
_PINNED: contextvars.ContextVar[dict | None] = contextvars.ContextVar("epd_pinned_replica", default=None)
log = logging.getLogger(__name__)


class StageCalls(HealthCalls, Protocol):
    """One transport's calls to the stage replica at ``address``; a failure of the call itself raises
    ``Unreachable`` (``lost``: set when the replica is lost while it waits), the stage's own error its ``EpdError``."""

    def generate_at(self, address: str, model: str, stage: Stage, inputs: RawGenerateInputs,
                    lost: asyncio.Event | None) -> AsyncIterator[ResponseChunk]:
        """The stage's chunks; closed before its final chunk, the stage's request is cancelled."""

    async def encode_at(self, address: str, model: str, item: MediaBytes, key: str, part: tuple[int, int] | None,
                        lost: asyncio.Event) -> str: ...

    async def held_at(self, address: str, model: str, keys: list[str], session: str | None) -> dict[str, str]: ...

    def forget(self, address: str) -> None:
        """The replica at ``address`` was lost: drop its channel (the calls still on it end)."""

    async def aclose(self) -> None: ...


class RoutedStages:
    """``urls``: each generator stage's replica addresses; ``models``: each stage's model name; ``encoders``: the
    encoder replicas' addresses (None: every encode goes to ``local``, e.g. ``BlsEncoders``). ``health_seconds``:
    between health checks of every replica (0: none; a deployment in one server needs none). ``logger``: where
    ``watch`` says whether the stages answer (the Triton log in a model)."""

    def __init__(self, calls: StageCalls, urls: dict[Stage, list[str]], models: dict[Stage, str], encoder_model: str,
                 encoders: list[str] | None = None, local=None, health_seconds: float = 0.0, logger=log):
        self.calls, self.models, self.encoder_model, self.local = calls, models, encoder_model, local
        self.replicas = {stage: ReplicaSet(models[stage], addresses, calls.forget) for stage, addresses in urls.items()}
        self.encoders = ReplicaSet(encoder_model, encoders, calls.forget) if encoders else None
        self.health_seconds, self.logger = health_seconds, logger

    @property
    def urls(self) -> dict[Stage, str]:
        """Each stage's addresses as one string (for messages)."""
        return {stage: ",".join(r.address for r in replicas.replicas) for stage, replicas in self.replicas.items()}

    async def encode(self, item: MediaBytes, key: str, part: tuple[int, int] | None = None) -> str:
        """``local`` in this server, or one call to the least-loaded healthy encoder replica."""
        if self.encoders is None:
            return await self.local.encode(item, key, part)
        replica = self.encoders.pick()
        with self.encoders.using(replica):
            try:
                return await self.calls.encode_at(replica.address, self.encoder_model, item, key, part, replica.lost)
            except Unreachable as exc:
                self.encoders.failed(replica.address, str(exc), lost=exc.lost)
                raise

    async def generate(self, inputs: RawGenerateInputs, stage: Stage = Stage.PD) -> AsyncIterator[ResponseChunk]:
        """Stream the chunks of the stage's least-loaded healthy replica (the request's pinned one: ``held``).
        Closed early (``aclose``: its client cancelled), the stage's request is cancelled (``StageCalls``)."""
        replicas = self.replicas[stage]
        replica = replicas.pick(prefer=(_PINNED.get() or {}).get(stage))
        lost = replica.lost if self.health_seconds else None
        with replicas.using(replica):
            try:
                async with contextlib.aclosing(self.calls.generate_at(
                        replica.address, self.models[stage], stage, inputs, lost)) as chunks:
                    async for chunk in chunks:
                        if chunk.finish_reason is not None and self.health_seconds:  # which replica served it
                            chunk = replace(chunk, timings={**(chunk.timings or {}),
                                                            f"{stage.value}_replica": replica.address})
                        yield chunk
            except Unreachable as exc:  # the call itself failed: route around the replica
                replicas.failed(replica.address, str(exc), lost=exc.lost)
                raise

    async def held(self, keys: list[str], session: str | None, stage: Stage) -> dict[str, str]:
        """Demand-aware encoding: ask the consumer stage's healthy replicas which of ``keys`` they hold; the answer
        of the one holding most, {content key: layout document}, and the request pinned to it (``generate``) unless
        it is overloaded (``ReplicaSet.pick``). Raises the stage's error (one replica) or when none answers."""
        replicas = self.replicas[stage]
        asked = [r for r in replicas.replicas if r.healthy] or replicas.replicas
        answers = await asyncio.gather(*(self.calls.held_at(r.address, self.models[stage], keys, session)
                                         for r in asked), return_exceptions=len(asked) > 1)
        found = [(a, r) for a, r in zip(answers, asked) if isinstance(a, dict)]
        if not found:
            raise next(a for a in answers if isinstance(a, BaseException))
        answer, holder = max(found, key=lambda pair: len(pair[0]))
        chosen = replicas.pick(prefer=holder.address)
        _PINNED.set({**(_PINNED.get() or {}), stage: chosen.address})
        return answer if chosen is holder else dict(next((a for a, r in found if r is chosen), {}))

    async def watch(self) -> dict[str, str]:
        """``orchestrator.health.watch`` over every stage's replicas (until cancelled, at unload)."""
        sets = [*((s, True) for s in self.replicas.values()), *([(self.encoders, False)] if self.encoders else [])]
        return await watch(self.calls, sets, self.health_seconds, self.logger)

    async def aclose(self) -> None:
        await self.calls.aclose()


__all__ = ["RoutedStages", "StageCalls"]
