"""The ``epd`` orchestration: validate, encode every media item concurrently, rewrite the request to
metadata-only, stream the generator's output back.

Topologies (``Topology``): E+PD sends the rewritten request to one generator (``pd``); E/P/D sends it
to ``prefill`` with ``max_tokens=1`` and ``kv_transfer_params={"do_remote_decode": true}``, then to
``decode`` with the ``kv_transfer_params`` prefill returned (decode pulls the KV through NIXL and needs
only the media layouts), and streams decode's output.

Request lifecycle::

    RECEIVED -> VALIDATED (parse with EncodedMedia: media stay bytes, nothing decoded here)
             -> ENCODING  (one StageClient.encode per item, all at once; text-only requests skip it)
             -> REWRITTEN (image tensor removed, messages' image parts -> {"type": "image"},
                           image_layouts = the encoders' layout metadata, in prompt order;
                           text_input / sampling settings untouched)
             -> [E/P/D: PREFILLING -> kv_transfer_params]
             -> GENERATING (StageClient.generate streams chunks) -> DONE | FAILED | CANCELLED

Written against ``StageClient`` so it runs with a fake in unit tests (``tests/fakes.py``) and with
Triton (BLS to encoders, gRPC streams to generator stages) in the ``epd`` model (``ensemble.triton_stages``).
"""
from __future__ import annotations

import asyncio
import enum
import json
import time
from dataclasses import dataclass, replace
from typing import AsyncIterator, Protocol

from backend.errors import InvalidInput, Unavailable
from backend.layout import content_key
from backend.request import EncodedMedia, MediaBytes, RawGenerateInputs, RequestLimits, parse_generate_request
from backend.serving import Outcome, RequestObserver, ResponseChunk, ResponseSink


class Topology(enum.Enum):
    E_PD = "E+PD"
    E_P_D = "E/P/D"


class Stage(enum.Enum):
    GENERATE = "generate"  # prefill + decode in one engine (pd)
    PREFILL = "prefill"
    DECODE = "decode"


class StageClient(Protocol):
    async def encode(self, item: MediaBytes, key: str) -> str:
        """Encode one item; returns its layout metadata JSON. Raises ``EpdError``s."""

    def generate(self, inputs: RawGenerateInputs, stage: Stage = Stage.GENERATE) -> AsyncIterator[ResponseChunk]:
        """Stream the generator's chunks; the one carrying ``finish_reason`` is the last. Closing the
        stream before that (``aclose``) must stop the stage's work for this request."""


@dataclass(frozen=True)
class Identity:
    """What makes a content key: the model and its processing options."""

    model: str
    processing: str


class Orchestrator:
    def __init__(self, stages: StageClient, identity: Identity, limits: RequestLimits,
                 topology: Topology = Topology.E_PD):
        self.stages, self.identity, self.limits, self.topology = stages, identity, limits, topology
        self.media = EncodedMedia(limits.media)

    def validate(self, raw: RawGenerateInputs):
        """Cheap checks before anything is scheduled (errors are INVALID_ARG naming the field)."""
        return parse_generate_request(raw, self.media, self.limits)

    async def run(self, raw: RawGenerateInputs, sink: ResponseSink, observer: RequestObserver | None = None) -> Outcome:
        started = time.perf_counter()
        outcome, tokens = Outcome.ERROR, 0
        timings = {"items": 0, "encode_ms": 0.0}
        try:
            request = self.validate(raw)
            layouts = await self._encode_all(request.images)
            timings.update(items=len(layouts), encode_ms=_ms(started), encoders=_producers(layouts))
            rewritten = replace(
                raw, images=(), image_layouts=tuple(layouts),
                messages=json.dumps(request.conversation) if request.conversation is not None else None)
            if self.topology is Topology.E_P_D:
                rewritten = await self._prefill(rewritten, timings)
            generate_started = time.perf_counter()
            stream = self.stages.generate(rewritten, Stage.DECODE if self.topology is Topology.E_P_D else Stage.GENERATE)
            try:
                async for chunk in stream:
                    if sink.is_cancelled():
                        sink.close()
                        outcome = Outcome.CANCELLED
                        return outcome
                    final = chunk.finish_reason is not None
                    if final:
                        tokens = chunk.num_output_tokens or 0
                        timings.update(chunk.timings or {})  # the generator's own (pd: transfer_ms)
                        timings.update(generate_ms=_ms(generate_started), total_ms=_ms(started))
                        chunk = replace(chunk, timings=dict(timings))
                    elif "first_chunk_ms" not in timings:
                        timings["first_chunk_ms"] = _ms(started)
                    sink.send(chunk, final=final)
                    if final:
                        outcome = Outcome.OK
                        return outcome
            finally:
                await stream.aclose()  # an unfinished stream tells its stage to abort
            raise RuntimeError("the generator's stream ended without a final response")
        except Exception as exc:
            sink.send_error(exc)
            return outcome
        finally:
            if observer is not None:
                observer.request_finished(outcome, tokens)

    async def _prefill(self, rewritten: RawGenerateInputs, timings: dict) -> RawGenerateInputs:
        """Run prefill for one token; return the request for decode, carrying prefill's KV handle."""
        started = time.perf_counter()
        sampling = json.loads(rewritten.sampling_parameters) if rewritten.sampling_parameters else {}
        sampling = {k: v for k, v in sampling.items() if k not in ("min_tokens",)}
        prefill_inputs = replace(
            rewritten, stream=False, sampling_parameters=json.dumps({**sampling, "max_tokens": 1}),
            kv_transfer_params=json.dumps({"do_remote_decode": True}), exclude_input_in_output=True,
            return_num_input_tokens=False, return_num_output_tokens=False)
        params = None
        async for chunk in self.stages.generate(prefill_inputs, Stage.PREFILL):
            if chunk.finish_reason is not None:
                params = chunk.kv_transfer_params
                timings.update(chunk.timings or {})  # prefill's embedding pull (transfer_ms)
        if not params:
            raise Unavailable("prefill returned no kv_transfer_params")
        timings["prefill_ms"] = _ms(started)
        return replace(rewritten, kv_transfer_params=json.dumps(params))

    async def _encode_all(self, items: tuple[MediaBytes, ...]) -> list[str]:
        if not items:
            return []
        keys = [content_key(item.data, self.identity.processing, self.identity.model) for item in items]
        results = await asyncio.gather(*(self.stages.encode(item, key) for item, key in zip(items, keys)),
                                       return_exceptions=True)
        for item, result in zip(items, results):
            if isinstance(result, InvalidInput):  # the encoder names "image"; the client sent it as item.field
                raise InvalidInput(item.field, result.problem)
            if isinstance(result, BaseException):
                raise result
        return list(results)


def _producers(layouts: list[str]) -> list[str]:
    """The encoder instances (NIXL producer agent names) that served this request's items."""
    names = set()
    for text in layouts:
        try:
            names.add(json.loads(text)["handle"]["agent_name"])
        except (ValueError, KeyError, TypeError):
            pass
    return sorted(names)


def _ms(since: float) -> float:
    return round((time.perf_counter() - since) * 1000, 3)


__all__ = ["Orchestrator", "StageClient", "Identity", "Stage", "Topology"]
