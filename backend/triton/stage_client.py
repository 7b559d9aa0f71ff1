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
the stage sends on it can deadlock (or crash) Triton 2.51's gRPC frontend (``orchestrator.cancel_board``). A
stage request the orchestrator gives up on (its client cancelled, the deadline passed) is cancelled in band,
by a second request naming its request id; the stage aborts its engine request and ends the stream.

``BlsEncoders`` is the encoder half alone: the colocated E+PD model (``backend.triton.models.colocated``) pairs it
with its in-process generator (``orchestrator.local_stages``).

Each generator stage's gRPC address comes from the topology (its ``endpoint``, rendered as the orchestrator's
``<role>_endpoint`` parameter): ``local`` is this server's own gRPC endpoint, read from its command line at load
(``backend.deploy.server_address``). ``watch`` checks after load that every stage answers there and logs the outcome, so a
deployment whose stages cannot be reached says so before a request fails.

Several replicas, remote encoders (``encoder_endpoint``: a list of addresses; each item is then one gRPC ``infer``
with a deadline, ``STAGE_CALL_SECONDS``, instead of BLS), health checks: ``orchestrator.routing.RoutedStages`` chooses the
replica of each call and ``orchestrator.health`` checks them; ``GrpcStageCalls`` here makes the calls to one replica
(the channels, ``CHANNEL_ARGS``), and ``triton_stages`` puts the two together for the orchestrator models.
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
from backend.protocol.generate import (ENCODER_ITEM, ENCODER_KEY, ENCODER_LAYOUT, ENCODER_MODALITY, HELD_PARAMETER,
                                       LOAD_PARAMETER, PART_PARAMETER, SESSION_PARAMETER,
                                       TOOLS_PARAMETER)
from backend.deploy.server_address import LOCAL, endpoint_list, resolve
from backend.protocol.errors import DeadlineExceeded
from backend.protocol.media_options import MEDIA_IO_PARAMETER
from backend.request.generate import MediaBytes, RawGenerateInputs
from backend.engine.serving import ResponseChunk
from backend.triton.io import ERROR_CODES_PARAMETER, from_triton_error
from backend.triton.grpc_stream import StreamPool, cancel_in_band, grpc_inputs, single_request_stream
from backend.protocol.stages import Stage
from orchestrator.admission import URGENCY, Urgency
from orchestrator.health import Lost, Unreachable, cancelled_here, unless
from orchestrator.replicas import PROBE_SECONDS, Replica
from orchestrator.routing import RoutedStages

# What the orchestrator asks of a stage's responses: pd's outputs (decode's too: its kv_transfer_params are not relayed),
# prefill's with the kv_transfer_params decode needs.
GENERATE_OUTPUTS = interface.output_names(interface.PD)
PREFILL_OUTPUTS = interface.output_names(interface.PREFILL)
log = logging.getLogger(__name__)
_TAGGED = {ERROR_CODES_PARAMETER: True}  # stages put the error code in the message (see backend.triton.io)
PART_STAGGER_SECONDS = 0.002  # between the BLS requests of a video's parts (see above)
STAGE_CALL_SECONDS = 120.0  # deadline of one encode over gRPC (a remote encoder)
# gRPC channels to the stages: reconnect within a second or two of a server coming (back) up, not after gRPC's
# exponential back-off of up to two minutes; messages as large as tritonclient's own default allows
CHANNEL_ARGS = [("grpc.max_send_message_length", 2**31 - 1), ("grpc.max_receive_message_length", 2**31 - 1),
                ("grpc.initial_reconnect_backoff_ms", 250), ("grpc.min_reconnect_backoff_ms", 250),
                ("grpc.max_reconnect_backoff_ms", 2000)]


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
    lost, the call cancelled under this task by its channel closing) is UNAVAILABLE naming the stage and the
    endpoint (see ``grpc_url`` above), and so is ``lost`` set while waiting (the replica stopped answering health
    checks: ``orchestrator.replicas``)."""
    import grpc

    iterator = stream.__aiter__()
    while True:
        try:
            item = await (iterator.__anext__() if lost is None else unless(iterator.__anext__(), lost))
        except StopAsyncIteration:
            return
        except Lost:
            raise Unreachable(f"stage {model} at {url} was lost (it stopped answering health checks)") from None
        except asyncio.CancelledError:
            if cancelled_here():
                raise
            raise _channel_closed(model, url) from None
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.CANCELLED:
                raise
            raise Unreachable(f"stage {model} not reachable over gRPC at {url} (its endpoint in the topology): "
                              f"{exc.code().name} {exc.details()}") from None
        yield item


def _channel_closed(model: str, url: str) -> Unreachable:
    """A ``CancelledError`` from a call under the request, not the request's own cancel: grpc.aio raises it when
    the replica's channel closes (``orchestrator.replicas`` closes a lost replica's)."""
    return Unreachable(f"stage {model} at {url}: the call was cancelled under the request (its channel closed: the "
                       "replica was lost)")


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


def encode_parameters(item: MediaBytes, part: tuple[int, int] | None) -> dict:
    """An encoder request's parameters: the part of a video, the item's media options (its modality's), the urgency
    of the request it is for (``orchestrator.admission.URGENCY``: the encoder checks the deadline before it starts)."""
    parameters = {**_TAGGED, **URGENCY.get().parameters()}
    if part:
        parameters[PART_PARAMETER] = f"{part[0]}/{part[1]}"
    if item.options:  # the request's options for its modality (backend.protocol.media_options)
        parameters[MEDIA_IO_PARAMETER] = json.dumps({item.modality: json.loads(item.options)})
    return parameters


class BlsEncoders:
    """The encoder half of a ``StageClient``: one non-decoupled BLS call per item (also used by the
    colocated E+PD model, ``backend.triton.models.colocated``, whose generator runs in process)."""

    def __init__(self, encoder_model: str = "encoder"):
        self.encoder_model = encoder_model

    async def encode(self, item: MediaBytes, key: str, part: tuple[int, int] | None = None) -> str:
        parameters = encode_parameters(item, part)
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


class TritonLogger:
    """``orchestrator.routing.RoutedStages``' logger: the Triton server's log."""

    @staticmethod
    def info(message: str) -> None:
        pb_utils.Logger.log_info(message)

    @staticmethod
    def warning(message: str) -> None:
        pb_utils.Logger.log_warn(message)


def triton_stages(urls: dict[Stage, list[str]], encoder_model: str = "encoder", generator_model: str = "pd",
                  prefill_model: str = "prefill", decode_model: str = "decode", encoders: list[str] | None = None,
                  health_seconds: float = 0.0) -> RoutedStages:
    """The orchestrator models' stage client: ``urls``, the gRPC addresses of each generator stage role asked, one
    per replica (``backend.deploy.server_address``); ``encoders``: the encoder replicas' addresses, None: BLS in this
    server. ``health_seconds``: between health checks of every replica (0: none)."""
    models = {Stage.PD: generator_model, Stage.PREFILL: prefill_model, Stage.DECODE: decode_model}
    return RoutedStages(GrpcStageCalls(), urls, models, encoder_model, encoders, BlsEncoders(encoder_model),
                        health_seconds, TritonLogger())


class GrpcStageCalls:
    """``orchestrator.routing.StageCalls`` over Triton's gRPC endpoint: one channel per address (made on the event
    loop), kept streams for generate calls (``StreamPool``), the in-band cancel, the health probes."""

    def __init__(self):
        self._clients: dict[str, object] = {}  # address -> tritonclient.grpc.aio client
        self._pools: dict[str, StreamPool] = {}  # address -> its kept streams (generate)
        self._loads: dict[str, asyncio.Task] = {}  # address -> its KV-cache usage read in flight (read_load)

    def _client(self, address: str):
        import tritonclient.grpc.aio as aio  # deferred: the models that never call a stage over gRPC load none of it

        if address not in self._clients:
            self._clients[address] = aio.InferenceServerClient(address, channel_args=CHANNEL_ARGS)
        return self._clients[address]

    def forget(self, address: str) -> None:
        """A replica was lost: its channel goes (the calls still on it end), the next call opens a fresh one (a channel
        to a host that was cut off would wait out TCP's retransmission back-off once the host is back)."""
        client = self._clients.pop(address, None)
        if client is not None:
            asyncio.get_running_loop().create_task(client.close())

    async def encode_at(self, address: str, model: str, item: MediaBytes, key: str, part: tuple[int, int] | None,
                        lost: asyncio.Event) -> str:
        """One gRPC ``infer`` of the encoder at ``address``, within ``STAGE_CALL_SECONDS``."""
        import tritonclient.grpc as grpcclient
        from tritonclient.utils import InferenceServerException

        parameters, urgency = encode_parameters(item, part), URGENCY.get()
        inputs = []
        for name, value in ((ENCODER_ITEM.name, item.data), (ENCODER_KEY.name, key.encode()),
                            (ENCODER_MODALITY.name, item.modality.encode())):
            inputs.append(grpcclient.InferInput(name, [1, 1], "BYTES"))  # the encoder batches: [1, 1]
            inputs[-1].set_data_from_numpy(np.array([[value]], dtype=np.object_))
        try:
            result = await unless(self._client(address).infer(
                model, inputs, outputs=[grpcclient.InferRequestedOutput(ENCODER_LAYOUT.name)],
                parameters=parameters, client_timeout=STAGE_CALL_SECONDS, **queue_terms(urgency)), lost)
        except Lost:
            raise Unreachable(f"stage {model} at {address} was lost (it stopped answering health checks)") from None
        except InferenceServerException as exc:
            raise _call_failed(model, address, exc) from None
        return result.as_numpy(ENCODER_LAYOUT.name).reshape(-1)[0].decode()

    async def generate_at(self, address: str, model: str, stage: Stage, inputs: RawGenerateInputs,
                          lost: asyncio.Event | None) -> AsyncIterator[ResponseChunk]:
        """The stage's chunks over a kept stream. Closed before the final one, the stage's request is cancelled in
        band; a failure of the call itself cancels the stream (no in-band cancel can reach a server that is gone)."""
        import tritonclient.grpc as grpcclient

        client = self._client(address)
        outputs = PREFILL_OUTPUTS if stage is Stage.PREFILL else GENERATE_OUTPUTS
        request_id = f"epd-{uuid.uuid4().hex}"
        parameters = {**_TAGGED, SESSION_PARAMETER: inputs.session_id} if inputs.session_id else _TAGGED
        if inputs.media_io:  # consumers that decode media (metadata-only off, P/D) sample them as the client asked
            parameters = {**parameters, MEDIA_IO_PARAMETER: inputs.media_io.parameter()}
        parameters = {**parameters, **Urgency(inputs.priority or 0, inputs.deadline).parameters()}
        if inputs.tools:  # the chat template renders them at every engine stage alike
            parameters = {**parameters, TOOLS_PARAMETER: inputs.tools}
        request = {"model_name": model, "inputs": grpc_inputs(stage_values(inputs)), "parameters": parameters,
                   "outputs": [grpcclient.InferRequestedOutput(name) for name in outputs], "request_id": request_id,
                   "enable_empty_final_response": True}  # every response says whether it is the last (StreamPool)
        finished = False
        try:
            async with self._pool(address).stream(request) as stream:  # a kept stream: no call set-up per request
                try:
                    async with contextlib.aclosing(_unavailable_if_unreachable(stream, model, address, lost)) as items:
                        async for result, error in items:
                            if error is not None:
                                finished = True
                                raise from_triton_error(error, model)
                            chunk = _chunk(result)
                            finished = chunk.finish_reason is not None or _is_final(result)
                            # every response but a bare final flag (after an in-band cancel): a first token's response
                            # may have no text yet and still carries its token's logprobs (Chunker sends it at once)
                            if not finished or chunk.finish_reason is not None or chunk.text_output or chunk.logprobs:
                                yield chunk
                            if finished:
                                return
                except Unreachable:
                    finished = True
                    stream.cancel()
                    raise
                finally:
                    if not finished:  # the block's exit then reads the stream to its end, which the stage closes
                        await self._cancel(client, model, request_id)
        except asyncio.CancelledError:  # from the stream's set-up, the in-band cancel or the stream's end (CI,
            if cancelled_here():        # 2026-12-07: a partitioned replica's request ended naming no stage)
                raise
            raise _channel_closed(model, address) from None

    async def held_at(self, address: str, model: str, keys: list[str], session: str | None) -> dict[str, str]:
        """Which of ``keys`` the consumer at ``address`` holds (``HELD_PARAMETER``, on a stream of its own)."""
        import tritonclient.grpc as grpcclient

        query = json.dumps({"keys": keys, "session": session})
        request = {"model_name": model, "inputs": [], "parameters": {**_TAGGED, HELD_PARAMETER: query},
                   "outputs": [grpcclient.InferRequestedOutput("text_output")]}
        async with single_request_stream(self._client(address), request) as stream:
            async for result, error in _unavailable_if_unreachable(stream, model, address):
                if error is not None:
                    raise from_triton_error(error, model)
                answer = json.loads(result.as_numpy("text_output").reshape(-1)[0])
                return answer if isinstance(answer, dict) else {}
        return {}

    async def ready(self, model: str, address: str):
        """True if ``model`` answers ready at ``address``, else what it answered. A channel of its own per probe:
        one that failed to connect (the server's endpoints open only after every model loaded) backs off before it
        tries again, and would fail requests meanwhile."""
        import tritonclient.grpc.aio as aio

        probe = aio.InferenceServerClient(address)
        try:
            return True if await probe.is_model_ready(model) else "not ready"
        except Exception as exc:  # noqa: BLE001 - the answer is what we log
            return str(exc)
        finally:
            await probe.close()

    async def probe(self, model: str, address: str, fresh: bool) -> bool:
        """Model readiness, a unary call with a gRPC deadline (clean to give up on); ``fresh``: on a channel of its
        own (a lost replica's: a failed channel backs off for minutes)."""
        import tritonclient.grpc.aio as aio

        client = aio.InferenceServerClient(address, channel_args=CHANNEL_ARGS) if fresh else self._client(address)
        try:
            return bool(await client.is_model_ready(model, client_timeout=PROBE_SECONDS))
        finally:
            if fresh:
                await client.close()

    def read_load(self, replica: Replica, model: str) -> None:
        """Read the replica's KV-cache usage (the load probe, ``LOAD_PARAMETER``) in a task of its own, one at a time
        per replica: a slow answer delays no health check."""
        import tritonclient.grpc as grpcclient

        if self._loads.get(replica.address) is not None and not self._loads[replica.address].done():
            return

        async def read() -> None:
            request = {"model_name": model, "inputs": [], "parameters": {**_TAGGED, LOAD_PARAMETER: True},
                       "outputs": [grpcclient.InferRequestedOutput("text_output")]}
            with contextlib.suppress(Exception):
                async with single_request_stream(self._client(replica.address), request) as stream:
                    async for result, error in stream:
                        if error is None:
                            usage = json.loads(result.as_numpy("text_output").reshape(-1)[0]).get("kv_cache_usage")
                            if isinstance(usage, (int, float)):
                                replica.kv_usage = float(usage)
                        break
        self._loads[replica.address] = asyncio.get_running_loop().create_task(read())

    async def _cancel(self, client, model: str, request_id: str) -> None:
        """Cancel a stage request in band (``orchestrator.cancel_board``: cancelling the gRPC stream can deadlock
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
        if pool is None or pool.client is not client:  # a lost replica's channel was replaced (forget)
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


def queue_terms(urgency: Urgency) -> dict:
    """An encoder request's place in the encoder's queues (``backend.deploy.render``'s dynamic batcher): Triton's
    priority level (``epd_priority`` + 1), and the time left to the request's deadline (microseconds; Triton rejects
    it in the queue once it passes). A deadline already past: ``DeadlineExceeded``, nothing sent."""
    terms = {"priority": urgency.priority + 1}
    if urgency.deadline is not None:
        left = urgency.deadline - time.time()
        if left <= 0:
            raise DeadlineExceeded("deadline passed before the item was sent to the encoder", "encoder")
        terms["timeout"] = max(1, int(left * 1e6))
    return terms


QUEUE_TIMEOUT = "Request timeout expired"  # Triton's error for a request whose timeout passed in the queue


def _call_failed(model: str, address: str, exc) -> Exception:
    """A failed call's error: the stage's own (tagged) error as it is; the request's deadline passed in the stage's
    queue: ``DeadlineExceeded``; a failure of the call itself (no server there, connection lost, deadline passed, no
    such model) is ``Unreachable`` (lost unless only the deadline passed)."""
    message = exc.message() or ""
    if QUEUE_TIMEOUT in message:
        return DeadlineExceeded(f"deadline passed in stage {model}'s queue at {address}", model)
    if message.startswith("[") or (exc.status() or "") not in ("StatusCode.UNAVAILABLE", "StatusCode.DEADLINE_EXCEEDED"):
        return from_triton_error(exc, model)
    return Unreachable(f"stage {model} not reachable over gRPC at {address}: {message}",
                       lost=exc.status() != "StatusCode.DEADLINE_EXCEEDED")
