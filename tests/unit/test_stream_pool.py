"""``backend.triton.grpc_stream.StreamPool``'s logic (which stream takes a request, which is kept, which is closed)
on a fake gRPC client; the real one is driven through the OpenAI endpoint (tests/e2e/test_openai.py)."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

from backend.triton.grpc_stream import StreamPool


def _result(final: bool):
    flag = SimpleNamespace(bool_param=final)
    return SimpleNamespace(get_response=lambda: SimpleNamespace(parameters={"triton_final_response": flag}))


class FakeStream:
    """One stream: per request read from the request side, a first response then a final one (model "bad": an
    error); ends when the request side closes."""

    def __init__(self, requests):
        self.requests, self.pending, self.served, self.ended = requests.__aiter__(), [], [], False
        self._grpc_call = SimpleNamespace(done=lambda: self.ended)

    def __aiter__(self):
        return self

    async def __anext__(self):
        await asyncio.sleep(0)  # a response takes a while: other requests run meanwhile
        if not self.pending:
            try:
                request = await self.requests.__anext__()
            except StopAsyncIteration:
                self.ended = True
                raise
            self.served.append(request["model_name"])
            self.pending = [(None, "bad input")] if request["model_name"] == "bad" else \
                [(_result(False), None), (_result(True), None)]
        return self.pending.pop(0)

    def cancel(self):
        self.ended = True


class FakeClient:
    def __init__(self):
        self.streams: list[FakeStream] = []

    def stream_infer(self, requests):
        self.streams.append(FakeStream(requests))
        return self.streams[-1]


async def _one(pool: StreamPool, model: str, leave_after: int | None = None) -> list:
    got = []
    async with pool.stream({"model_name": model}) as stream:
        async for result, error in stream:
            got.append(error or result.get_response().parameters["triton_final_response"].bool_param)
            if leave_after is not None and len(got) == leave_after:
                break
    return got


def test_a_stream_is_kept_after_a_final_response_and_closed_otherwise():
    async def scenario():
        client = FakeClient()
        pool = StreamPool(client, keep=1)
        assert await _one(pool, "a") == [False, True]
        assert await _one(pool, "b") == [False, True]   # the same stream, kept
        assert len(client.streams) == 1 and client.streams[0].served == ["a", "b"]
        assert await _one(pool, "bad") == ["bad input"]  # an error: that stream is closed
        assert client.streams[0].ended and len(pool._idle) == 0
        assert await _one(pool, "c", leave_after=1) == [False]  # left before the final response: a new stream, closed
        assert len(client.streams) == 2 and client.streams[1].ended and len(pool._idle) == 0
        await asyncio.gather(_one(pool, "d"), _one(pool, "e"))  # two at once: two streams, one kept (keep=1)
        assert len(client.streams) == 4 and sum(not s.ended for s in client.streams) == 1
        await _one(pool, "f")
        assert len(client.streams) == 4  # the kept one took it
        await pool.close()
        assert all(s.ended for s in client.streams) and not pool._idle

    asyncio.run(scenario())


def test_a_kept_stream_that_ended_meanwhile_is_not_used_and_an_idle_one_is_closed():
    async def scenario():
        client = FakeClient()
        pool = StreamPool(client)
        await _one(pool, "a")
        client.streams[0].ended = True  # e.g. the server went away
        assert await _one(pool, "b") == [False, True]
        assert len(client.streams) == 2 and client.streams[1].served == ["b"]
        await asyncio.sleep(pool.IDLE_SECONDS * 2)  # idle that long: closed (tritonserver's exit waits for it)
        assert client.streams[1].ended and not pool._idle
        await pool.close()

    asyncio.run(scenario())
