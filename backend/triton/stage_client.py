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

Several replicas (an endpoint that lists several addresses, or a DNS name of several: ``backend.triton.replicas``):
each generate call and each encode goes to the healthy replica with the fewest of this orchestrator's calls in
flight (generators: then the lowest KV-cache usage); demand-aware lookups ask every healthy consumer replica and
pin the request to the one holding most of its items, unless that one is overloaded. The encoder too may live on
other servers (``encoder_endpoint``: a list of addresses): then each item is one gRPC ``infer`` to a replica, with a
deadline (``STAGE_CALL_SECONDS``), instead of BLS. Where any stage is remote or replicated, its replicas are
health-checked (``backend.triton.stage_health``): one that fails a call at the connection level or a check is
routed around at once and taken back once it answers again; the streams still open to one that is lost end with
UNAVAILABLE naming the stage and the replica, so nothing waits for a host that is gone. The final response of each
stage names the replica that served it (``timings``: ``pd_replica``, ``prefill_replica``, ``decode_replica``).
"""
from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import logging
import uuid
from dataclasses import replace
from typing import AsyncIterator

import numpy as np
import triton_python_backend_utils as pb_utils

from backend.protocol import generate as interface
from backend.protocol.generate import (ENCODER_ITEM, ENCODER_KEY, ENCODER_LAYOUT, ENCODER_MODALITY, HELD_PARAMETER,
                                       PART_PARAMETER, SESSION_PARAMETER)
from backend.deploy.server_address import LOCAL, endpoint_list, resolve
from backend.protocol.media_options import MEDIA_IO_PARAMETER
from backend.request.generate import MediaBytes, RawGenerateInputs
from backend.engine.serving import ResponseChunk
from backend.triton.io import ERROR_CODES_PARAMETER, from_triton_error
from backend.triton.grpc_stream import StreamPool, cancel_in_band, grpc_inputs, single_request_stream
from backend.protocol.stages import Stage
from backend.triton.replicas import Replica, ReplicaSet
from backend.triton.stage_health import Lost, StageHealth, Unreachable, unless

# What the orchestrator asks of a stage's responses: pd's outputs (decode's too: its kv_transfer_params are not relayed),
# prefill's with the kv_transfer_params decode needs.
GENERATE_OUTPUTS = interface.output_names(interface.PD)
PREFILL_OUTPUTS = interface.output_names(interface.PREFILL)
log = logging.getLogger(__name__)
_TAGGED = {ERROR_CODES_PARAMETER: True}  # stages put the error code in the message (see backend.triton.io)
PART_STAGGER_SECONDS = 0.002  # between the BLS requests of a video's parts (see above)
STAGE_CALL_SECONDS = 120.0  # deadline of one encode over gRPC (a remote encoder)
# the consumer replica a demand-aware lookup chose for this request (its task's context): stage -> address
_PINNED: contextvars.ContextVar[dict | None] = contextvars.ContextVar("epd_pinned_replica", default=None)


def stage_values(raw: RawGenerateInputs) -> dict:
    """The shared interface's input values of a stage request (``backend.triton.grpc_stream.grpc_inputs``)."""
    return interface.input_values(vars(raw))


def _chunk(result) -> ResponseChunk:
    def value(name):
        array = result.as_numpy(name)
        return array.reshape(-1)[0] if array is not None and array.size else None
    return ResponseChunk(**interface.output_fields(value))


async def _unavailable_if_unreachable(stream, model: str, url: str, lost: asyncio.Event | None = None):
    """The stream's items; a gRPC failure of the call itself (server not listening at ``url``, connection
    lost) is UNAVAILABLE naming the stage and the endpoint (see ``grpc_url`` above), and so is ``lost`` set
    while waiting (the replica stopped answering health checks: ``backend.triton.replicas``)."""
    import grpc

    iterator = stream.__aiter__()
    while True:
        try:
            item = await (iterator.__anext__() if lost is None else unless(iterator.__anext__(), lost))
        except StopAsyncIteration:
            return
        except Lost:
            raise Unreachable(f"stage {model} at {url} was lost (it stopped answering health checks)") from None
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.CANCELLED:
                raise
            raise Unreachable(f"stage {model} not reachable over gRPC at {url} (its endpoint in the topology): "
                              f"{exc.code().name} {exc.details()}") from None
        yield item


def _is_final(result) -> bool:
    param = result.get_response().parameters.get("triton_final_response")
    return bool(param and param.bool_param)


def stage_urls(targets: dict[Stage, tuple[str, str]], stages) -> dict[Stage, list[str]]:
    """The gRPC addresses of each of ``stages`` (one per replica) from its model name and endpoint (``targets``: the
    orchestrator's ``<role>_model`` / ``<role>_endpoint`` parameters, ``RoutingSettings.targets``); raises
    ``backend.deploy.server_address.EndpointError`` naming the stage."""
    return {stage: [resolve(targets[stage][0], entry) for entry in endpoint_list(targets[stage][1]) or [LOCAL]]
            for stage in stages}


def encoder_urls(model: str, endpoint: str) -> list[str] | None:
    """The gRPC addresses of the encoder replicas (``encoder_endpoint``), or None: ``local``, BLS in this server."""
    entries = endpoint_list(endpoint)
    return [resolve(model, entry) for entry in entries] or None


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


class TritonStages(StageHealth, BlsEncoders):
    """``urls``: the gRPC addresses of each generator stage role this orchestrator asks, one per replica
    (``backend.deploy.server_address``); ``encoders``: the encoder replicas' addresses, None: BLS in this server.
    ``health_seconds``: between health checks of every replica (0: none; a deployment in one server needs none).
    One client per address."""

    def __init__(self, urls: dict[Stage, list[str]], encoder_model: str = "encoder", generator_model: str = "pd",
                 prefill_model: str = "prefill", decode_model: str = "decode", encoders: list[str] | None = None,
                 health_seconds: float = 0.0):
        super().__init__(encoder_model)
        self.models = {Stage.PD: generator_model, Stage.PREFILL: prefill_model, Stage.DECODE: decode_model}
        self.replicas = {stage: ReplicaSet(self.models[stage], addresses, self._forget) for stage, addresses in urls.items()}
        self.encoders = ReplicaSet(encoder_model, encoders, self._forget) if encoders else None
        self.health_seconds = health_seconds
        self._clients: dict[str, object] = {}  # address -> tritonclient.grpc.aio client, made on the event loop
        self._pools: dict[str, StreamPool] = {}  # address -> its kept streams (generate)
        self._loads: dict[str, asyncio.Task] = {}  # address -> its KV-cache usage read in flight (_read_load)

    @property
    def urls(self) -> dict[Stage, str]:
        """Each stage's addresses as one string (for messages)."""
        return {stage: ",".join(r.address for r in replicas.replicas) for stage, replicas in self.replicas.items()}

    async def encode(self, item: MediaBytes, key: str, part: tuple[int, int] | None = None) -> str:
        """BLS in this server, or (remote encoders) one gRPC call to the least-loaded healthy encoder replica."""
        if self.encoders is None:
            return await super().encode(item, key, part)
        import tritonclient.grpc as grpcclient
        from tritonclient.utils import InferenceServerException

        parameters = {**_TAGGED, PART_PARAMETER: f"{part[0]}/{part[1]}"} if part else dict(_TAGGED)
        if item.options:
            parameters[MEDIA_IO_PARAMETER] = json.dumps({item.modality: json.loads(item.options)})
        inputs = []
        for name, value in ((ENCODER_ITEM.name, item.data), (ENCODER_KEY.name, key.encode()),
                            (ENCODER_MODALITY.name, item.modality.encode())):
            inputs.append(grpcclient.InferInput(name, [1, 1], "BYTES"))  # the encoder batches: [1, 1]
            inputs[-1].set_data_from_numpy(np.array([[value]], dtype=np.object_))
        replica = self.encoders.pick()
        with self.encoders.using(replica):
            try:
                result = await unless(self._client(replica.address).infer(
                    self.encoder_model, inputs, outputs=[grpcclient.InferRequestedOutput(ENCODER_LAYOUT.name)],
                    parameters=parameters, client_timeout=STAGE_CALL_SECONDS), replica.lost)
            except Lost:
                raise Unreachable(f"stage {self.encoder_model} at {replica.address} was lost "
                                  f"(it stopped answering health checks)") from None
            except InferenceServerException as exc:
                raise self._call_failed(self.encoders, replica, exc) from None
        return result.as_numpy(ENCODER_LAYOUT.name).reshape(-1)[0].decode()

    def _call_failed(self, replicas: ReplicaSet, replica: Replica, exc) -> Exception:
        """A failed call's error: the stage's own (tagged) error as it is; a failure of the call itself (no server
        there, connection lost, deadline passed, no such model) routes around the replica and is UNAVAILABLE."""
        message = exc.message() or ""
        if message.startswith("[") or (exc.status() or "") not in ("StatusCode.UNAVAILABLE",
                                                                   "StatusCode.DEADLINE_EXCEEDED"):
            return from_triton_error(exc, replicas.stage)
        replicas.failed(replica.address, message, lost=exc.status() != "StatusCode.DEADLINE_EXCEEDED")
        return Unreachable(f"stage {replicas.stage} not reachable over gRPC at {replica.address}: {message}")

    async def generate(self, inputs: RawGenerateInputs, stage: Stage = Stage.PD) -> AsyncIterator[ResponseChunk]:
        """Stream the chunks of the stage's least-loaded healthy replica (the request's pinned one: ``held``).
        If the consumer stops early (``aclose``: its client cancelled), the stage's request is cancelled in band."""
        import tritonclient.grpc as grpcclient

        replicas = self.replicas[stage]
        replica = replicas.pick(prefer=(_PINNED.get() or {}).get(stage))
        client, url, model = self._client(replica.address), replica.address, self.models[stage]
        outputs = PREFILL_OUTPUTS if stage is Stage.PREFILL else GENERATE_OUTPUTS
        request_id = f"epd-{uuid.uuid4().hex}"
        parameters = {**_TAGGED, SESSION_PARAMETER: inputs.session_id} if inputs.session_id else _TAGGED
        if inputs.media_io:  # consumers that decode media (metadata-only off, P/D) sample them as the client asked
            parameters = {**parameters, MEDIA_IO_PARAMETER: inputs.media_io.parameter()}
        request = {"model_name": model, "inputs": grpc_inputs(stage_values(inputs)), "parameters": parameters,
                   "outputs": [grpcclient.InferRequestedOutput(name) for name in outputs], "request_id": request_id,
                   "enable_empty_final_response": True}  # every response says whether it is the last (StreamPool)
        finished, lost = False, replica.lost if self.health_seconds else None
        with replicas.using(replica):
            async with self._pool(url).stream(request) as stream:  # a kept stream: no call set-up per request
                try:
                    async with contextlib.aclosing(_unavailable_if_unreachable(stream, model, url, lost)) as items:
                        async for result, error in items:
                            if error is not None:
                                finished = True
                                raise from_triton_error(error, model)
                            chunk = _chunk(result)
                            finished = chunk.finish_reason is not None or _is_final(result)
                            if chunk.finish_reason is not None and self.health_seconds:  # which replica served it
                                chunk = replace(chunk, timings={**(chunk.timings or {}), f"{stage.value}_replica": url})
                            if chunk.text_output or chunk.finish_reason is not None:
                                yield chunk
                            if finished:
                                return
                except Unreachable as exc:  # the call itself failed: route around the replica
                    finished = True
                    replicas.failed(url, str(exc))
                    stream.cancel()  # the server is gone or cut off: no in-band cancel can reach it
                    raise
                finally:
                    if not finished:  # the block's exit then reads the stream to its end, which the stage closes
                        await self._cancel(client, model, request_id)

    async def held(self, keys: list[str], session: str | None, stage: Stage) -> dict[str, str]:
        """Demand-aware encoding: ask the consumer stage's healthy replicas which of ``keys`` they hold
        (``HELD_PARAMETER``, on a stream of their own); the answer of the one holding most, {content key: layout
        document}, and the request pinned to it (``generate``) unless it is overloaded (``ReplicaSet.pick``).
        Raises the stage's error (one replica) or when none answers."""
        replicas = self.replicas[stage]
        asked = [r for r in replicas.replicas if r.healthy] or replicas.replicas
        answers = await asyncio.gather(*(self._held_at(r.address, keys, session, stage) for r in asked),
                                       return_exceptions=len(asked) > 1)
        found = [(a, r) for a, r in zip(answers, asked) if isinstance(a, dict)]
        if not found:
            raise next(a for a in answers if isinstance(a, BaseException))
        answer, holder = max(found, key=lambda pair: len(pair[0]))
        chosen = replicas.pick(prefer=holder.address)
        _PINNED.set({**(_PINNED.get() or {}), stage: chosen.address})
        return answer if chosen is holder else dict(next((a for a, r in found if r is chosen), {}))

    async def _held_at(self, address: str, keys: list[str], session: str | None, stage: Stage) -> dict[str, str]:
        import tritonclient.grpc as grpcclient

        query = json.dumps({"keys": keys, "session": session})
        request = {"model_name": self.models[stage], "inputs": [], "parameters": {**_TAGGED, HELD_PARAMETER: query},
                   "outputs": [grpcclient.InferRequestedOutput("text_output")]}
        async with single_request_stream(self._client(address), request) as stream:
            async for result, error in _unavailable_if_unreachable(stream, self.models[stage], address):
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

    def _pool(self, address: str) -> StreamPool:
        """The kept gRPC streams to ``address`` (``backend.triton.grpc_stream.StreamPool``: measured, a new stream per
        stage request was the orchestrator's largest cost per E/P/D request after the loop itself, docs/benchmarks.md)."""
        client = self._client(address)
        pool = self._pools.get(address)
        if pool is None or pool.client is not client:  # a lost replica's channel was replaced (_forget)
            pool = self._pools[address] = StreamPool(client)
        return pool

    async def aclose(self) -> None:
        for task in self._loads.values():
            task.cancel()
        pools, self._pools = list(self._pools.values()), {}
        for pool in pools:  # before the channels close (read_to_end)
            await pool.close()
        clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            await client.close()
