"""A request's ``n`` choices (``GenerateCall.choices``): each its own generate request, read together; streamed, their
responses interleave as they come, each tagged with its choice's index."""
from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator

_END = object()


async def indexed(responses, index: int = 0) -> AsyncIterator[tuple]:
    """``responses`` (one choice's pieces) as ``(index, piece)``."""
    try:
        async for piece in responses:
            yield index, piece
    finally:
        await responses.aclose()


async def interleaved(streams: list) -> AsyncIterator[tuple]:
    """``(index, piece)`` of every choice's stream (``streams[i]``: choice i's pieces) as they come, to every
    stream's end; the first error ends it (raised). Closed early, the streams still running are closed (their
    requests cancelled)."""
    if len(streams) == 1:
        async for item in indexed(streams[0]):
            yield item
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream) -> None:
        try:
            async for item in indexed(stream, index):
                await queue.put(item)
        except Exception as exc:  # noqa: BLE001 - the choice's error is the request's: raised by the reader
            await queue.put(exc)
        await queue.put(_END)

    tasks = [asyncio.ensure_future(pump(i, stream)) for i, stream in enumerate(streams)]
    try:
        ended = 0
        while ended < len(tasks):
            item = await queue.get()
            if item is _END:
                ended += 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*tasks, return_exceptions=True)
