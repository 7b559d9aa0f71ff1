"""orchestrator.routing.RoutedStages over a fake transport: which replica takes each call, what a failed call does, the
demand-aware pin, the replica named in the final timings, early close reaching the transport, and the health watch."""
from __future__ import annotations

import asyncio
import contextlib

import pytest

from backend.engine.serving import ResponseChunk
from backend.protocol.errors import InvalidInput
from backend.protocol.stages import Stage
from backend.request.generate import MediaBytes, RawGenerateInputs
from orchestrator.health import Unreachable
from orchestrator.routing import RoutedStages

A, B = "10.0.0.1:8001", "10.0.0.2:8001"
MODELS = {Stage.PD: "pd", Stage.PREFILL: "prefill", Stage.DECODE: "decode"}


class FakeCalls:
    """Records every call; ``down``: addresses whose calls fail as unreachable; ``holds``: address -> held keys."""

    def __init__(self, down=(), holds=None, ready_after=0):
        self.calls, self.down, self.holds = [], set(down), holds or {}
        self.closed_early, self.forgotten, self.ready_asks, self.ready_after = [], [], 0, ready_after

    async def generate_at(self, address, model, stage, inputs, lost):
        self.calls.append(("generate", address, model))
        if address in self.down:
            raise Unreachable(f"stage {model} not reachable at {address}")
        finished = False
        try:
            yield ResponseChunk("a")
            finished = True
            yield ResponseChunk("b", finish_reason="length", timings={"transfer_ms": 1.0})
        finally:
            if not finished:
                self.closed_early.append(address)

    async def encode_at(self, address, model, item, key, part, lost):
        self.calls.append(("encode", address, model))
        if address in self.down:
            raise Unreachable(f"{model} deadline at {address}", lost=False)
        return "{}"

    async def held_at(self, address, model, keys, session):
        return {k: "layout" for k in keys if k in self.holds.get(address, ())}

    def forget(self, address):
        self.forgotten.append(address)

    async def ready(self, model, address):
        self.ready_asks += 1
        return True if self.ready_asks > self.ready_after else "not ready"

    async def probe(self, model, address, fresh):
        return address not in self.down

    def read_load(self, replica, model):
        replica.kv_usage = 0.5

    async def aclose(self):
        pass


class LocalEncoder:
    def __init__(self):
        self.items = []

    async def encode(self, item, key, part=None):
        self.items.append(key)
        return "local"


class Logs:
    def __init__(self):
        self.infos, self.warnings = [], []

    def info(self, message):
        self.infos.append(message)

    def warning(self, message):
        self.warnings.append(message)


def stages(calls, pd=(A, B), encoders=None, health=0.0, logger=None):
    return RoutedStages(calls, {Stage.PD: list(pd)}, MODELS, "encoder", encoders, LocalEncoder(), health,
                        logger or Logs())


async def collect(routed, stage=Stage.PD):
    return [chunk async for chunk in routed.generate(RawGenerateInputs(), stage)]


def test_an_unreachable_replica_is_routed_around_and_the_error_reaches_the_caller():
    async def go():
        calls = FakeCalls(down={A})
        routed = stages(calls)
        with pytest.raises(Unreachable, match="not reachable"):
            await collect(routed)  # A: fewest served, first in order
        assert routed.replicas[Stage.PD].get(A).healthy is False
        assert routed.replicas[Stage.PD].get(A).lost.is_set() and calls.forgotten == [A]
        chunks = await collect(routed)
        assert [c.text_output for c in chunks] == ["a", "b"]
        assert [address for _, address, _ in calls.calls] == [A, B]
    asyncio.run(go())


def test_the_final_chunk_names_the_replica_only_with_health_checks():
    async def go():
        for health, expected in ((0.0, None), (5.0, A)):
            final = (await collect(stages(FakeCalls(), pd=(A,), health=health)))[-1]
            assert final.timings.get("pd_replica") == expected and final.timings["transfer_ms"] == 1.0
    asyncio.run(go())


def test_a_stream_closed_early_is_closed_at_the_transport():
    async def go():
        calls = FakeCalls()
        routed = stages(calls, pd=(A,))
        async with contextlib.aclosing(routed.generate(RawGenerateInputs(), Stage.PD)) as chunks:
            async for _ in chunks:
                break
        assert calls.closed_early == [A]
        assert routed.replicas[Stage.PD].get(A).outstanding == 0
    asyncio.run(go())


def test_a_demand_aware_lookup_pins_the_request_to_the_holder():
    async def go():
        calls = FakeCalls(holds={B: {"k1", "k2"}, A: {"k1"}})
        routed = stages(calls)
        found = await routed.held(["k1", "k2", "k3"], None, Stage.PD)
        assert found == {"k1": "layout", "k2": "layout"}
        await collect(routed)
        assert calls.calls[-1] == ("generate", B, "pd")
    asyncio.run(go())


def test_encodes_go_local_without_encoder_replicas_and_a_deadline_does_not_lose_a_replica():
    async def go():
        item = MediaBytes(b"x", "image[0]", "image")
        local = stages(FakeCalls())
        assert await local.encode(item, "key") == "local" and local.local.items == ["key"]
        calls = FakeCalls(down={A})
        remote = stages(calls, encoders=[A, B])
        with pytest.raises(Unreachable):
            await remote.encode(item, "key")
        replica = remote.encoders.get(A)
        assert not replica.healthy and not replica.lost.is_set() and calls.forgotten == []
        assert await remote.encode(item, "key") == "{}" and calls.calls[-1] == ("encode", B, "encoder")
    asyncio.run(go())


def test_a_stage_error_is_not_a_routing_failure():
    class Refusing(FakeCalls):
        async def generate_at(self, address, model, stage, inputs, lost):
            raise InvalidInput("image[0]", "bad")
            yield  # an async generator

    async def go():
        routed = stages(Refusing())
        with pytest.raises(InvalidInput):
            await collect(routed)
        assert all(r.healthy for r in routed.replicas[Stage.PD].replicas)
    asyncio.run(go())


def test_watch_says_when_the_stages_answer_then_checks_every_replica():
    async def go():
        calls, logs = FakeCalls(ready_after=1), Logs()
        routed = stages(calls, health=0.01, logger=logs)
        task = asyncio.ensure_future(routed.watch())
        await asyncio.sleep(0.7)  # one "not ready", then the half-second wait, then ready and health checks
        calls.down.add(B)
        await asyncio.sleep(0.1)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        assert logs.infos == [f"stages reachable over gRPC: pd at {A},{B}"] and logs.warnings == []
        assert routed.replicas[Stage.PD].get(A).kv_usage == 0.5  # the engine's load read beside the probe
        assert routed.replicas[Stage.PD].get(B).healthy is False
    asyncio.run(go())
