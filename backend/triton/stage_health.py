"""The health of a stage client's replicas: which answer, which are lost, and the channels to them
(``backend.triton.stage_client.TritonStages`` is a ``StageHealth``).

Where any stage is remote or replicated (``backend.triton.replicas``), ``watch`` probes every replica every
``health_seconds``: model readiness, a unary call with a gRPC deadline (clean to give up on); an engine's KV-cache
usage is read beside it (the load probe, ``backend.protocol.generate.LOAD_PARAMETER``), in a task of its own, so a
slow answer delays no check. A lost replica (``backend.triton.replicas.LOST_AFTER``) loses its channel (the calls
still on it end) and is probed on a fresh channel each time: a channel that failed to connect backs off, for up to
two minutes by gRPC's defaults, and ``CHANNEL_ARGS`` bound that to two seconds for every channel.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import time

import triton_python_backend_utils as pb_utils

from backend.protocol.errors import Unavailable
from backend.protocol.generate import ERROR_CODES_PARAMETER, LOAD_PARAMETER
from backend.triton.grpc_stream import single_request_stream
from backend.triton.replicas import PROBE_SECONDS, Replica, ReplicaSet

_TAGGED = {ERROR_CODES_PARAMETER: True}  # stages put the error code in the message (see backend.triton.io)


# gRPC channels to the stages: reconnect within a second or two of a server coming (back) up, not after gRPC's
# exponential back-off of up to two minutes; messages as large as tritonclient's own default allows
CHANNEL_ARGS = [("grpc.max_send_message_length", 2**31 - 1), ("grpc.max_receive_message_length", 2**31 - 1),
                ("grpc.initial_reconnect_backoff_ms", 250), ("grpc.min_reconnect_backoff_ms", 250),
                ("grpc.max_reconnect_backoff_ms", 2000)]


class Unreachable(Unavailable):
    """A call to a stage failed itself (no server there, connection lost, replica lost), not the stage's work."""


class Lost(Exception):
    """The replica a call waits on was lost."""


async def unless(awaitable, lost: asyncio.Event):
    """``awaitable``'s result, or ``Lost`` (``awaitable`` cancelled) if ``lost`` is or gets set first."""
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
    return call.result()


class StageHealth:
    """Health checks and channels of a stage client's replicas: ``replicas`` (stage -> ``ReplicaSet``), ``encoders``
    (a ``ReplicaSet`` or None), ``health_seconds``, ``_clients`` (address -> channel) and ``_loads`` are its."""

    def _sets(self) -> list[tuple[ReplicaSet, bool]]:
        """Every replica set with whether it is an engine stage's (answers load probes)."""
        return [*((s, True) for s in self.replicas.values()), *([(self.encoders, False)] if self.encoders else [])]

    def _client(self, address: str):
        import tritonclient.grpc.aio as aio

        if address not in self._clients:
            self._clients[address] = aio.InferenceServerClient(address, channel_args=CHANNEL_ARGS)
        return self._clients[address]

    def _forget(self, address: str) -> None:
        """A replica was lost: its channel goes (the calls still on it end), the next call opens a fresh one (a channel
        to a host that was cut off would wait out TCP's retransmission back-off once the host is back)."""
        client = self._clients.pop(address, None)
        if client is not None:
            asyncio.get_running_loop().create_task(client.close())

    async def watch(self, warn_after: float = 60.0, interval: float = 0.5) -> dict[str, str]:
        """After load: wait until every stage answers ready at one address at least; log that once (INFO), or,
        while one does not after ``warn_after`` seconds, a WARNING naming the stage, the addresses and the last
        answer (then keep waiting: a stage may load late). Then, with ``health_seconds``, check every replica
        that often until cancelled (at unload). Returns stage model -> addresses."""
        waiting = {replicas.stage: replicas for replicas, _ in self._sets()}
        started, warned, last = time.monotonic(), False, {}
        while waiting:
            for model, replicas in list(waiting.items()):
                for replica in replicas.replicas:
                    last[model] = await self._ready(model, replica.address)
                    if last[model] is True:
                        del waiting[model]
                        break
            if waiting and not warned and time.monotonic() - started > warn_after:
                warned = True
                for model, replicas in waiting.items():
                    pb_utils.Logger.log_warn(
                        f"stage {model} not reachable over gRPC at {','.join(replicas.entries)} after {warn_after:.0f} s "
                        f"({last.get(model)}); still waiting (a GPU engine can take minutes to load): until it "
                        f"answers, requests that need it fail UNAVAILABLE; if it never does, check its endpoint in "
                        f"the topology")
            if waiting:
                await asyncio.sleep(interval if not warned else 5.0)
        reached = {replicas.stage: ",".join(replicas.entries) for replicas, _ in self._sets()}
        pb_utils.Logger.log_info("stages reachable over gRPC: " + ", ".join(f"{m} at {u}" for m, u in reached.items()))
        while self.health_seconds:
            await asyncio.gather(*(replicas.check(self._prober(replicas, engine), PROBE_SECONDS)
                                   for replicas, engine in self._sets()))
            await asyncio.sleep(self.health_seconds)
        return reached

    async def _ready(self, model: str, address: str):
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

    def _prober(self, replicas: ReplicaSet, engine: bool):
        """The health probe of ``replicas`` (``backend.triton.replicas.Probe``): model readiness, a unary call
        with a gRPC deadline (clean to give up on). Engines' KV-cache usage is read beside it (``_read_load``)."""
        import tritonclient.grpc.aio as aio

        model = replicas.stage

        async def probe(address: str) -> tuple[bool, float | None]:
            replica = replicas.get(address)
            # a lost replica is probed on a channel of its own each time (a failed channel backs off for minutes)
            fresh = replica is None or replica.lost.is_set()
            client = aio.InferenceServerClient(address, channel_args=CHANNEL_ARGS) if fresh else self._client(address)
            try:
                ready = bool(await client.is_model_ready(model, client_timeout=PROBE_SECONDS))
            finally:
                if fresh:
                    await client.close()
            if ready and engine and not fresh:
                self._read_load(replica, model)
            return ready, None
        return probe

    def _read_load(self, replica: Replica, model: str) -> None:
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
