"""A ``StageClient`` with one generator stage in this process: the colocated orchestrators.

Who uses it: ``backend.triton.models.colocated`` (topology ``stages.pd.orchestrator: colocated`` for E+PD,
``stages.prefill.orchestrator: colocated`` for E/P/D), whose model hosts the orchestrator and a vLLM engine
in one Triton stub. ``local`` names the stage that engine serves: ``Stage.PD`` (E+PD: prefill and
decode, the pd engine) or ``Stage.PREFILL`` (E/P/D: a KV producer, one token per request); ``others`` the further
stages whose engines are in the process too (E/P/D with ``stages.decode.orchestrator: colocated``: decode's, a KV
consumer). Everything else goes to ``remote``, a ``StageClient`` of other Triton models: encoders over BLS (both),
and for E/P/D the decode stage over the server's gRPC endpoint (``backend.triton.stage_client.triton_stages``),
whose stream the orchestrator relays.
Per response of the local stage that saves a second stub's response, tritonserver forwarding it, and parsing it
in the orchestrator's gRPC client.

What the local ``generate`` keeps of the stage's own model (``pd``, ``prefill``): the request is parsed as
that model parses it (``LayoutMedia``: layouts only, media refused; prefill: ``kv_transfer_params``
``do_remote_decode``), ``prepare`` runs before the engine (pull every item's embeddings by handle; a failed pull
raises ``Unavailable`` before anything is submitted and the orchestrator's recovery encodes again and
retries), the responses follow ``backend.engine.serving.Chunker`` (stream interval, prompt in front of non-streaming
output; prefill's final chunk carries the ``kv_transfer_params`` decode needs), and a stream closed before its
final chunk (client cancel, deadline) aborts the engine request. Prefill's blocks stay held after its final
chunk until decode has read them (or vLLM's abort timeout frees them).

Lifecycle of one local ``generate`` call::

    PARSED (layouts resolved) -> PREPARED (embeddings pulled, or grids only; timings: transfer_ms, transfer_bytes)
          -> STREAMING (engine deltas -> chunks) -> DONE (final chunk yielded)
                                                 | ABORTED (closed early or failed: engine.abort)
"""
from __future__ import annotations

import contextlib
import uuid
from dataclasses import dataclass
from typing import AsyncIterator, Awaitable, Callable

from backend.request.generate import GenerateRequest, MediaBytes, MediaResolver, RawGenerateInputs, RequestLimits, parse_generate_request
from backend.engine.serving import Chunker, GenerationEngine, ResponseChunk
from backend.protocol.stages import Stage


@dataclass(frozen=True)
class LocalEngine:
    """A stage served in this process: its engine, how it parses its metadata-only request, and what runs on each
    parsed request before the engine sees it (None: nothing)."""

    engine: GenerationEngine
    resolver: MediaResolver
    prepare: Callable[[GenerateRequest], Awaitable[GenerateRequest]] | None = None


class LocalStages:
    """``StageClient`` with the ``local`` stage (``engine``) and ``others`` in process, the rest on ``remote``."""

    def __init__(self, remote, engine: GenerationEngine, resolver: MediaResolver, limits: RequestLimits,
                 prepare: Callable[[GenerateRequest], Awaitable[GenerateRequest]] | None = None,
                 interval: float = 0.0, local: Stage = Stage.PD, held=None,
                 others: dict[Stage, LocalEngine] | None = None):
        """``remote``: the ``StageClient`` of the other stages; ``encode`` at least (``BlsEncoders``), and
        ``generate`` where the orchestrator asks other generator stages (E/P/D's decode: ``triton_stages``).
        ``resolver`` and ``limits``: how the local stage parses its metadata-only request (``LayoutMedia``).
        ``prepare``: runs on each parsed request before the engine sees it. ``interval``: the stream interval
        of ``Chunker``. ``held``: the local stage's lookup of its copies (``HeldEmbeddings.lookup``; None: it keeps
        none), for demand-aware encoding. ``others``: further stages served here (E/P/D's decode)."""
        self.remote, self.limits, self.interval, self.local, self._held = remote, limits, interval, local, held
        self.engines = {local: LocalEngine(engine, resolver, prepare), **(others or {})}

    async def encode(self, item: MediaBytes, key: str, part: tuple[int, int] | None = None) -> str:
        return await self.remote.encode(item, key, part)

    async def held(self, keys: list[str], session: str | None, stage: Stage) -> dict[str, str]:
        """The layouts of the ``keys`` this process's stage holds (in process: exact, no round trip); another stage's
        over ``remote``."""
        if stage is self.local:
            return self._held(keys, session) if self._held is not None else {}
        return await self.remote.held(keys, session, stage)

    def generate(self, inputs: RawGenerateInputs, stage: Stage = Stage.PD) -> AsyncIterator[ResponseChunk]:
        if stage in self.engines:
            return self._generate_here(inputs, self.engines[stage])
        if not hasattr(self.remote, "generate"):
            raise ValueError(f"this process serves the {self.local.value} stage; no client for the {stage.value} stage")
        return self.remote.generate(inputs, stage)

    async def aclose(self) -> None:
        if hasattr(self.remote, "aclose"):
            await self.remote.aclose()

    async def _generate_here(self, inputs: RawGenerateInputs, here: LocalEngine) -> AsyncIterator[ResponseChunk]:
        request = parse_generate_request(inputs, here.resolver, self.limits)
        if here.prepare is not None:
            request = await here.prepare(request)
        request_id = uuid.uuid4().hex
        chunker = Chunker(here.engine, request, self.interval)
        finished = False
        try:
            async with contextlib.aclosing(here.engine.generate(request, request_id)) as deltas:
                async for delta in deltas:
                    chunk = chunker.add(delta)
                    if chunk is None:
                        continue
                    finished = delta.finished
                    yield chunk
                    if finished:
                        return
            raise RuntimeError("engine stream ended without a finished output")
        finally:
            if not finished:  # closed early (cancel, deadline) or failed: the engine stops this request
                with contextlib.suppress(Exception):
                    await here.engine.abort(request_id)
