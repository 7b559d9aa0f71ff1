"""A generate request's gRPC stream to a Triton server, for every caller of the shared interface: the
orchestrator's stage client (``backend.triton.stage_client``), the client library (``clients.triton_client``)
and the benchmarks. Input tensors from the interface's values, one request per stream read to its end (Triton
2.51's gRPC frontend leaks a stream cancelled by its client), and the in-band cancel.
"""
from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import numpy as np

from backend.protocol.generate import CANCEL_PARAMETER


def grpc_inputs(values: dict[str, Any]):
    """Triton gRPC input tensors for the shared interface's values (see ``GenerateInputs.as_values``)."""
    import tritonclient.grpc as grpcclient

    tensors = []
    for name, value in values.items():
        if isinstance(value, bool):
            arr, dtype = np.array([value], dtype=bool), "BOOL"
        elif isinstance(value, list):
            arr, dtype = np.array(value, dtype=np.object_), "BYTES"
        else:
            arr, dtype = np.array([value.encode() if isinstance(value, str) else value], dtype=np.object_), "BYTES"
        tensor = grpcclient.InferInput(name, list(arr.shape), dtype)
        tensor.set_data_from_numpy(arr)
        tensors.append(tensor)
    return tensors


END_OF_STREAM_SECONDS = 5.0


class _Stream:
    """tritonclient's gRPC response iterator (``stream_infer``), remembering whether it was cancelled."""

    def __init__(self, inner, done: asyncio.Event | None = None):
        self._inner, self.cancelled, self._done = inner, False, done

    def done_writing(self) -> None:
        """Close the request side now: the stream then ends once the server has completed the request (a bare
        final flag, e.g. after an in-band cancel, sends no response over gRPC; only the stream's end shows it)."""
        if self._done is not None:
            self._done.set()

    def __aiter__(self):
        return self

    async def __anext__(self):
        return await self._inner.__anext__()

    def cancel(self):
        self.cancelled = True
        return self._inner.cancel()


async def read_to_end(stream, timeout: float = END_OF_STREAM_SECONDS) -> None:
    """Read a gRPC stream whose request side is closed to its end: the server's OK status. A client that closes
    its channel (or drops the call) after the last response but before that status cancels the RPC, and Triton
    2.51's gRPC frontend can then leak the stream's state and the request it holds: the server grows, and the
    model never unloads, so the server waits out its exit timeout (docs/results/robustness.md, "Shutdown"). Cancels
    the stream if it has not ended within ``timeout``."""
    try:
        async with asyncio.timeout(timeout):
            async for _ in stream:
                pass
    except TimeoutError:
        stream.cancel()
    except Exception:  # noqa: BLE001 - the RPC ended with an error status: it ended
        pass


@contextlib.asynccontextmanager
async def single_request_stream(client, request: dict):
    """A gRPC stream (``tritonclient.grpc.aio`` ``client``) carrying one request (``stream_infer``'s dict).
    Its request side stays open until the block exits, so Triton keeps streaming the responses; a caller
    leaving before the last response should ``cancel()`` the yielded stream, which cancels the request.
    Otherwise the block's exit closes the request side and reads the stream to its end (``read_to_end``)."""
    done = asyncio.Event()

    async def requests():
        yield request
        await done.wait()

    stream = _Stream(client.stream_infer(requests()), done)
    try:
        yield stream
    finally:
        done.set()
        if not stream.cancelled:
            await read_to_end(stream)


async def cancel_in_band(client, model: str, request_id: str, parameters: dict | None = None,
                         timeout: float = END_OF_STREAM_SECONDS) -> None:
    """Cancel the request ``request_id`` of ``model`` (one of this project's) in band: a second request, on
    its own stream of ``client`` (``tritonclient.grpc.aio``), whose parameter ``epd_cancel`` names it
    (``orchestrator.cancel_board``). Raises the server's error, or TimeoutError."""
    async def one_request():  # then the request side closes, so the stream ends once the server answered
        yield {"model_name": model, "inputs": [], "parameters": {**(parameters or {}), CANCEL_PARAMETER: request_id}}

    stream, failed = client.stream_infer(one_request()), None
    try:
        async with asyncio.timeout(timeout):
            async for _result, error in stream:  # no response: the model sends the final flag alone
                failed = failed or error
    except TimeoutError:
        stream.cancel()
        raise
    if failed is not None:
        raise failed


class _KeptStream:
    """One gRPC stream of a ``StreamPool``: its request side stays open, fed one request at a time."""

    def __init__(self, client):
        self.outbox: asyncio.Queue = asyncio.Queue()

        async def requests():
            while (item := await self.outbox.get()) is not None:
                yield item

        self.responses = _Stream(client.stream_infer(requests()))

    def alive(self) -> bool:
        return not self.responses.cancelled and not self.responses._inner._grpc_call.done()

    async def close(self) -> None:
        """Close the request side and read the stream to its end (``read_to_end``)."""
        await self.outbox.put(None)
        if not self.responses.cancelled:
            await read_to_end(self.responses)


class _Pooled:
    """A request's responses on a kept stream, as ``single_request_stream`` yields them: (result, error) pairs up
    to its final response or its error. ``clean`` once the final response came: the stream may take the next
    request."""

    def __init__(self, kept: _KeptStream):
        self.kept, self.clean, self.cancelled, self.over = kept, False, False, False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.over:  # after the final response, or an error (the request's last word here)
            raise StopAsyncIteration
        result, error = await self.kept.responses.__anext__()
        if error is not None:
            self.over = True  # clean stays False: the stream is closed, not reused
        elif result.get_response().parameters["triton_final_response"].bool_param:
            self.over = self.clean = True
        return result, error

    def done_writing(self) -> None:
        self.clean = False
        self.kept.outbox.put_nowait(None)

    def cancel(self):
        self.cancelled, self.clean = True, False
        return self.kept.responses.cancel()


class StreamPool:
    """Kept gRPC streams of ``client`` (``tritonclient.grpc.aio``), each carrying one request at a time, as a
    closed-loop client's stream does: a new stream per request costs the caller the call's set-up, its half-close
    and its final status (the OpenAI endpoint's largest CPU cost per request, measured: docs/benchmarks.md). A
    request's stream is kept for the next one only when the request ended with its final response; after an error,
    a cancel or a caller that left early it is closed (``single_request_stream``'s ending). At most ``keep`` idle
    streams are kept, each for ``IDLE_SECONDS``: tritonserver's exit waits for the streams open to it."""

    IDLE_SECONDS = 0.5  # an idle stream is closed after this: tritonserver's exit waits for open streams

    def __init__(self, client, keep: int = 64):
        self.client, self.keep, self._idle, self._closing = client, keep, [], set()

    @contextlib.asynccontextmanager
    async def stream(self, request: dict):
        """``single_request_stream`` for ``request`` on a kept stream (or a new one)."""
        kept = None
        while self._idle and kept is None:
            candidate = self._idle.pop()
            candidate.expiry.cancel()
            if candidate.alive():
                kept = candidate
            else:
                await candidate.close()
        kept = kept or _KeptStream(self.client)
        pooled = _Pooled(kept)
        await kept.outbox.put(request)
        try:
            yield pooled
        finally:
            if pooled.clean and kept.alive() and len(self._idle) < self.keep:
                kept.expiry = asyncio.get_running_loop().call_later(self.IDLE_SECONDS, self._expire, kept)
                self._idle.append(kept)
            else:
                await kept.close()

    def _expire(self, kept: _KeptStream) -> None:
        if kept in self._idle:
            self._idle.remove(kept)
            task = asyncio.ensure_future(kept.close())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    async def close(self) -> None:
        """Close every idle stream (before the client's channel closes: see ``read_to_end``)."""
        idle, self._idle = self._idle, []
        for kept in idle:
            kept.expiry.cancel()
            await kept.close()
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)
