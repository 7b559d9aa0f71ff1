"""``StageClient`` for the ``epd`` model: encoders over BLS, generator stages over the server's gRPC endpoint.

``encode`` is one non-decoupled BLS call (``async_exec``) to the encoder model per item (or per part of a video:
the request parameter ``epd_part``); Triton's dynamic batcher gathers the items of concurrent requests. A video's
parts are meant for different instances, but asked for at once the batcher (even without a queue delay) often takes
them into one batch: part i is sent ``i * PART_STAGGER_SECONDS`` later, so that an idle instance has taken the one
before.

``generate`` streams a generator stage (``pd``, ``prefill``, ``decode``) through the server's own gRPC
endpoint (tritonclient's asyncio client, on the model's event loop), not through decoupled BLS: Triton 2.51's
decoupled BLS deadlocks and crashes the calling stub under load (a lock-order inversion between the response
iterator, its map and the GIL; heap corruption fixed upstream only in python_backend r25.01; docs/results/epd.md,
"Limits found"). A gRPC stream has neither problem and keeps the stage's error codes. It is never cancelled, though: cancelling a decoupled stream while
the stage sends on it can deadlock (or crash) Triton 2.51's gRPC frontend (``backend.triton.cancel_board``). A
stage request the orchestrator gives up on (its client cancelled, the deadline passed) is cancelled in band,
by a second request naming its request id; the stage aborts its engine request and ends the stream.

``BlsEncoders`` is the encoder half alone: the colocated E+PD model (``backend.triton.models.colocated``) pairs it
with its in-process generator (``ensemble.local_stages``).

Each generator stage's gRPC address comes from the topology (its ``endpoint``, rendered as the orchestrator's
``<role>_endpoint`` parameter): ``local`` is this server's own gRPC endpoint, read from its command line at load
(``backend.deploy.server_address``). ``watch`` checks after load that every stage answers there and logs the outcome, so a
deployment whose stages cannot be reached says so before a request fails.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from typing import AsyncIterator

import numpy as np
import triton_python_backend_utils as pb_utils

from backend.protocol import generate as interface
from backend.protocol.errors import Unavailable
from backend.protocol.generate import (ENCODER_ITEM, ENCODER_KEY, ENCODER_LAYOUT, ENCODER_MODALITY, HELD_PARAMETER,
                                       PART_PARAMETER, SESSION_PARAMETER)
from backend.deploy.server_address import resolve
from backend.protocol.media_options import MEDIA_IO_PARAMETER
from backend.request.generate import MediaBytes, RawGenerateInputs
from backend.engine.serving import ResponseChunk
from backend.triton.io import ERROR_CODES_PARAMETER, from_triton_error
from backend.triton.grpc_stream import cancel_in_band, grpc_inputs, single_request_stream
from backend.protocol.stages import Stage

# What the orchestrator asks of a stage's responses: pd's outputs (decode's too: its kv_transfer_params are not relayed),
# prefill's with the kv_transfer_params decode needs.
GENERATE_OUTPUTS = interface.output_names(interface.PD)
PREFILL_OUTPUTS = interface.output_names(interface.PREFILL)
log = logging.getLogger(__name__)
_TAGGED = {ERROR_CODES_PARAMETER: True}  # stages put the error code in the message (see backend.triton.io)
PART_STAGGER_SECONDS = 0.002  # between the BLS requests of a video's parts (see above)


def stage_values(raw: RawGenerateInputs) -> dict:
    """The shared interface's input values of a stage request (``backend.triton.grpc_stream.grpc_inputs``)."""
    return interface.input_values(vars(raw))


def _chunk(result) -> ResponseChunk:
    def value(name):
        array = result.as_numpy(name)
        return array.reshape(-1)[0] if array is not None and array.size else None
    return ResponseChunk(**interface.output_fields(value))


async def _unavailable_if_unreachable(stream, model: str, url: str):
    """The stream's items; a gRPC failure of the call itself (server not listening at ``url``, connection
    lost) is UNAVAILABLE naming the stage and the endpoint (see ``grpc_url`` above)."""
    import grpc

    iterator = stream.__aiter__()
    while True:
        try:
            item = await iterator.__anext__()
        except StopAsyncIteration:
            return
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.CANCELLED:
                raise
            raise Unavailable(f"stage {model} not reachable over gRPC at {url} (its endpoint in the topology): "
                              f"{exc.code().name} {exc.details()}") from None
        yield item


def _is_final(result) -> bool:
    param = result.get_response().parameters.get("triton_final_response")
    return bool(param and param.bool_param)


def stage_urls(targets: dict[Stage, tuple[str, str]], stages) -> dict[Stage, str]:
    """The gRPC address of each of ``stages`` from its model name and endpoint (``targets``: the orchestrator's
    ``<role>_model`` / ``<role>_endpoint`` parameters, ``RoutingSettings.targets``); raises
    ``backend.deploy.server_address.EndpointError`` naming the stage."""
    return {stage: resolve(*targets[stage]) for stage in stages}


class BlsEncoders:
    """The encoder half of a ``StageClient``: one non-decoupled BLS call per item (also used by the
    colocated E+PD model, ``backend.triton.models.colocated``, whose generator runs in process)."""

    def __init__(self, encoder_model: str = "encoder"):
        self.encoder_model = encoder_model

    async def encode(self, item: MediaBytes, key: str, part: tuple[int, int] | None = None) -> str:
        parameters = {**_TAGGED, PART_PARAMETER: f"{part[0]}/{part[1]}"} if part else _TAGGED
        if item.options:  # the request's options for its modality (backend.protocol.media_options)
            parameters = {**parameters, MEDIA_IO_PARAMETER: json.dumps({item.modality: json.loads(item.options)})}
        if part and part[0]:
            await asyncio.sleep(part[0] * PART_STAGGER_SECONDS)
        request = pb_utils.InferenceRequest(
            model_name=self.encoder_model, requested_output_names=[ENCODER_LAYOUT.name], parameters=parameters,
            inputs=[pb_utils.Tensor(ENCODER_ITEM.name, np.array([[item.data]], dtype=np.object_)),
                    pb_utils.Tensor(ENCODER_KEY.name, np.array([[key.encode()]], dtype=np.object_)),
                    pb_utils.Tensor(ENCODER_MODALITY.name, np.array([[item.modality.encode()]], dtype=np.object_))])
        response = await request.async_exec()
        if response.has_error():
            raise from_triton_error(response.error(), self.encoder_model)
        return pb_utils.get_output_tensor_by_name(response, ENCODER_LAYOUT.name).as_numpy().reshape(-1)[0].decode()


class TritonStages(BlsEncoders):
    """``urls``: the gRPC address of each generator stage role this orchestrator asks (``backend.deploy.server_address``);
    one client per address."""

    def __init__(self, urls: dict[Stage, str], encoder_model: str = "encoder", generator_model: str = "pd",
                 prefill_model: str = "prefill", decode_model: str = "decode"):
        super().__init__(encoder_model)
        self.models = {Stage.PD: generator_model, Stage.PREFILL: prefill_model, Stage.DECODE: decode_model}
        self.urls = dict(urls)
        self._clients: dict[str, object] = {}  # address -> tritonclient.grpc.aio client, made on the event loop

    def _client(self, stage: Stage):
        import tritonclient.grpc.aio as aio

        url = self.urls[stage]
        if url not in self._clients:
            self._clients[url] = aio.InferenceServerClient(url)
        return self._clients[url]

    async def watch(self, warn_after: float = 60.0, interval: float = 0.5) -> dict[str, str]:
        """After load: wait until every stage answers ready at its address; log that once (INFO), or, while one
        does not after ``warn_after`` seconds, a WARNING naming the stage, the address and the last answer (then
        keep waiting: a stage may load late). Returns stage model -> address. Cancelled at unload."""
        import tritonclient.grpc.aio as aio

        waiting = {self.models[stage]: stage for stage in self.urls}
        started, warned, last = time.monotonic(), False, {}
        while waiting:
            for model, stage in list(waiting.items()):
                # A channel of its own per probe: one that failed to connect (the server's endpoints open only
                # after every model loaded) backs off before it tries again, and would fail requests meanwhile.
                probe = aio.InferenceServerClient(self.urls[stage])
                try:
                    if await probe.is_model_ready(model):
                        del waiting[model]
                        continue
                    last[model] = "not ready"
                except Exception as exc:  # noqa: BLE001 - the answer is what we log
                    last[model] = str(exc)
                finally:
                    await probe.close()
            if waiting and not warned and time.monotonic() - started > warn_after:
                warned = True
                for model, stage in waiting.items():
                    pb_utils.Logger.log_warn(
                        f"stage {model} not reachable over gRPC at {self.urls[stage]} after {warn_after:.0f} s "
                        f"({last.get(model)}); still waiting (a GPU engine can take minutes to load): until it "
                        f"answers, requests that need it fail UNAVAILABLE; if it never does, check its endpoint in "
                        f"the topology")
            if waiting:
                await asyncio.sleep(interval if not warned else 5.0)
        reached = {self.models[stage]: url for stage, url in self.urls.items()}
        pb_utils.Logger.log_info("stages reachable over gRPC: " + ", ".join(f"{m} at {u}" for m, u in reached.items()))
        return reached

    async def generate(self, inputs: RawGenerateInputs, stage: Stage = Stage.PD) -> AsyncIterator[ResponseChunk]:
        """Stream the stage's chunks. If the consumer stops early (``aclose``: its client cancelled), the
        gRPC stream is cancelled, and with it the stage's request."""
        import tritonclient.grpc as grpcclient

        client, url = self._client(stage), self.urls[stage]
        outputs = PREFILL_OUTPUTS if stage is Stage.PREFILL else GENERATE_OUTPUTS
        request_id = f"epd-{uuid.uuid4().hex}"
        parameters = {**_TAGGED, SESSION_PARAMETER: inputs.session_id} if inputs.session_id else _TAGGED
        if inputs.media_io:  # consumers that decode media (metadata-only off, P/D) sample them as the client asked
            parameters = {**parameters, MEDIA_IO_PARAMETER: inputs.media_io.parameter()}
        request = {"model_name": self.models[stage], "inputs": grpc_inputs(stage_values(inputs)), "parameters": parameters,
                   "outputs": [grpcclient.InferRequestedOutput(name) for name in outputs], "request_id": request_id}
        finished = False
        async with single_request_stream(client, request) as stream:
            try:
                async with contextlib.aclosing(_unavailable_if_unreachable(stream, self.models[stage], url)) as items:
                    async for result, error in items:
                        if error is not None:
                            finished = True
                            raise from_triton_error(error, self.models[stage])
                        chunk = _chunk(result)
                        finished = chunk.finish_reason is not None or _is_final(result)
                        if chunk.text_output or chunk.finish_reason is not None:
                            yield chunk
                        if finished:
                            return
            finally:
                if not finished:  # the block's exit then reads the stream to its end, which the stage closes
                    await self._cancel(client, self.models[stage], request_id)

    async def held(self, keys: list[str], session: str | None, stage: Stage) -> dict[str, str]:
        """Demand-aware encoding: ask the consumer stage which of ``keys`` it holds (``HELD_PARAMETER``, on a stream
        of its own); its answer, {content key: layout document}. Raises the stage's error."""
        import tritonclient.grpc as grpcclient

        query = json.dumps({"keys": keys, "session": session})
        request = {"model_name": self.models[stage], "inputs": [], "parameters": {**_TAGGED, HELD_PARAMETER: query},
                   "outputs": [grpcclient.InferRequestedOutput("text_output")]}
        async with single_request_stream(self._client(stage), request) as stream:
            async for result, error in _unavailable_if_unreachable(stream, self.models[stage], self.urls[stage]):
                if error is not None:
                    raise from_triton_error(error, self.models[stage])
                answer = json.loads(result.as_numpy("text_output").reshape(-1)[0])
                return answer if isinstance(answer, dict) else {}
        return {}

    async def _cancel(self, client, model: str, request_id: str) -> None:
        """Cancel a stage request in band (``backend.triton.cancel_board``: cancelling the gRPC stream can deadlock
        Triton 2.51's gRPC frontend). Should this fail, the stream is still read to its end, and cancelled
        after ``backend.triton.grpc_stream.END_OF_STREAM_SECONDS`` (``read_to_end``)."""
        try:
            await cancel_in_band(client, model, request_id, _TAGGED)
        except Exception as exc:  # noqa: BLE001 - the stream's own end is the fallback
            log.warning("cancelling %s request %s in band: %s", model, request_id, exc)

    async def aclose(self) -> None:
        clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            await client.close()
