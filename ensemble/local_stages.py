"""A ``StageClient`` whose generator stage runs in this process: the colocated E+PD orchestrator.

Who uses it: ``ensemble.colocated_model`` (topology ``stages.pd.orchestrator: colocated``), whose model
hosts the orchestrator and a vLLM engine in one Triton stub. Encoders stay a separate Triton model
(``encode`` is delegated, BLS in production); ``generate`` hands the orchestrator's metadata-only request
to the engine here instead of sending it through tritonserver's gRPC endpoint to a ``pd`` model. Per
response that saves a second stub's response, tritonserver forwarding it, and parsing it in the
orchestrator's gRPC client.

What ``generate`` keeps of the ``pd`` model: the request is parsed as ``pd`` parses it (``LayoutMedia``:
layouts only, media refused), ``prepare`` runs before the engine (pull every item's embeddings by handle;
a failed pull raises ``Unavailable`` before anything is submitted, and the orchestrator's recovery encodes
again and retries), the responses follow ``backend.serving.Chunker`` (stream interval, prompt in front of
non-streaming output), and a stream closed before its final chunk (client cancel, deadline) aborts the
engine request.

Lifecycle of one ``generate`` call::

    PARSED (layouts resolved) -> PREPARED (embeddings pulled; timings: transfer_ms, transfer_bytes)
          -> STREAMING (engine deltas -> chunks) -> DONE (final chunk yielded)
                                                 | ABORTED (closed early or failed: engine.abort)
"""
from __future__ import annotations

import contextlib
import uuid
from typing import AsyncIterator, Awaitable, Callable

from backend.request import GenerateRequest, MediaBytes, MediaResolver, RawGenerateInputs, RequestLimits, parse_generate_request
from backend.serving import Chunker, GenerationEngine, ResponseChunk
from ensemble.orchestrator import Stage


class LocalStages:
    """``StageClient`` with in-process generation: ``encoders.encode`` for media, ``engine`` for text."""

    def __init__(self, encoders, engine: GenerationEngine, resolver: MediaResolver, limits: RequestLimits,
                 prepare: Callable[[GenerateRequest], Awaitable[GenerateRequest]] | None = None,
                 interval: float = 0.0):
        """``encoders``: anything with the ``StageClient.encode`` coroutine (``BlsEncoders``). ``resolver``
        and ``limits``: how the metadata-only request is parsed (``pd``'s: ``LayoutMedia``). ``prepare``:
        runs on each parsed request before the engine sees it (the embedding pull). ``interval``: the
        stream interval of ``Chunker``."""
        self.encoders, self.engine, self.resolver, self.limits = encoders, engine, resolver, limits
        self.prepare, self.interval = prepare, interval

    async def encode(self, item: MediaBytes, key: str) -> str:
        return await self.encoders.encode(item, key)

    async def generate(self, inputs: RawGenerateInputs, stage: Stage = Stage.GENERATE) -> AsyncIterator[ResponseChunk]:
        if stage is not Stage.GENERATE:
            raise ValueError(f"an in-process generator serves E+PD only, not the {stage.value} stage")
        request = parse_generate_request(inputs, self.resolver, self.limits)
        if self.prepare is not None:
            request = await self.prepare(request)
        request_id = uuid.uuid4().hex
        chunker = Chunker(self.engine, request, self.interval)
        finished = False
        try:
            async with contextlib.aclosing(self.engine.generate(request, request_id)) as deltas:
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
                    await self.engine.abort(request_id)
