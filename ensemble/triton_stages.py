"""``StageClient`` over Triton BLS, for the ``epd`` model (imports ``pb_utils``: adapter code).

``encode`` is one async BLS call to the encoder model per item (Triton's dynamic batcher gathers items
of concurrent requests). ``generate`` is a decoupled BLS call to the generator model; Triton 2.51 hands
back a blocking iterator, so a daemon thread per stream drains it into the event loop (daemon: a stream
whose stage went away must not keep the stub from exiting at unload).

Finished response iterators are kept alive for ``RETIRE_SECONDS`` before this module drops them (on the
event loop, holding the GIL). Measured and traced to the stub's source: in Triton 2.51's Python backend
(r24.10) the stub's message thread erases a finished iterator from its map *without the GIL*; when that
erase drops the last reference, the iterator's responses and their numpy arrays are freed without the
GIL (fixed upstream in python_backend b771f4f, r25.01). Under load that corrupted the heap: refcount
errors on ``np.dtype(object)`` and segfaults in ``obmalloc`` of the ``epd`` stub (exit signal 11, found
with ``dmesg``), which left the generator stage blocked sending to a dead caller. Holding our own
reference until well after the erase makes the last release ours.
"""
from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections import deque
from typing import AsyncIterator

import numpy as np
import triton_python_backend_utils as pb_utils

from backend.request import MediaBytes, RawGenerateInputs
from backend.serving import ResponseChunk
from backend.triton_io import ABORT_PARAMETER, ERROR_CODES_PARAMETER, STAGE_REQUEST_ID_PARAMETER, from_triton_error
from ensemble.orchestrator import Stage

GENERATE_OUTPUTS = ["text_output", "finish_reason", "num_input_tokens", "num_output_tokens", "timings"]
KV_OUTPUT = "kv_transfer_params"
_END = object()
RETIRE_SECONDS = 5.0  # the stub erases a finished iterator within milliseconds; keep ours far longer
_TAGGED = {ERROR_CODES_PARAMETER: True}  # stages put the error code in the message (see backend.triton_io)


def _bytes_tensor(name: str, values: list[bytes], shape) -> "pb_utils.Tensor":
    return pb_utils.Tensor(name, np.array(values, dtype=np.object_).reshape(shape))


def generate_tensors(raw: RawGenerateInputs) -> list:
    tensors = []
    for name in ("text_input", "messages", "sampling_parameters", "kv_transfer_params"):
        value = getattr(raw, name)
        if value is not None:
            tensors.append(_bytes_tensor(name, [value.encode("utf-8")], [1]))
    if raw.image_layouts:
        tensors.append(_bytes_tensor("image_layouts", [s.encode() for s in raw.image_layouts], [len(raw.image_layouts)]))
    for name in ("stream", "exclude_input_in_output", "return_num_input_tokens", "return_num_output_tokens"):
        tensors.append(pb_utils.Tensor(name, np.array([getattr(raw, name)], dtype=bool)))
    return tensors


def _chunk(response) -> ResponseChunk:
    def value(name):
        tensor = pb_utils.get_output_tensor_by_name(response, name)
        if tensor is None:
            return None
        item = tensor.as_numpy().reshape(-1)[0]
        return item.decode("utf-8") if isinstance(item, bytes) else int(item)
    timings, kv_params = value("timings"), value(KV_OUTPUT)
    return ResponseChunk(value("text_output") or "", value("finish_reason"), value("num_input_tokens"),
                         value("num_output_tokens"), json.loads(timings) if timings else None,
                         json.loads(kv_params) if kv_params else None)


class TritonStages:
    def __init__(self, encoder_model: str = "encoder", generator_model: str = "pd", prefill_model: str = "prefill",
                 decode_model: str = "decode"):
        self.encoder_model = encoder_model
        self.models = {Stage.GENERATE: generator_model, Stage.PREFILL: prefill_model, Stage.DECODE: decode_model}
        self._retired: deque = deque()  # (monotonic time, finished BLS response iterator), event-loop owned

    def _retire(self, iterator) -> None:
        """Keep a finished iterator for RETIRE_SECONDS, then drop it here, on the loop (see module doc)."""
        now = time.monotonic()
        if iterator is not None:
            self._retired.append((now, iterator))
        while self._retired and now - self._retired[0][0] > RETIRE_SECONDS:
            self._retired.popleft()

    def _stream(self, request, loop: asyncio.AbstractEventLoop, deliver) -> None:
        """Run in a daemon thread: drain a decoupled BLS call, handing each response (or the exception)
        to ``deliver`` on the loop, then ``_END``; the finished iterator goes to ``_retire``."""
        iterator = None
        try:
            iterator = request.exec(decoupled=True)
            for response in iterator:
                loop.call_soon_threadsafe(deliver, response)
        except Exception as exc:  # noqa: BLE001 - handed to the request's coroutine
            loop.call_soon_threadsafe(deliver, exc)
        finally:
            loop.call_soon_threadsafe(self._retire, iterator)
            del iterator
            loop.call_soon_threadsafe(deliver, _END)

    async def encode(self, item: MediaBytes, key: str) -> str:
        request = pb_utils.InferenceRequest(
            model_name=self.encoder_model, requested_output_names=["layout"], parameters=_TAGGED,
            inputs=[_bytes_tensor("image", [item.data], [1, 1]), _bytes_tensor("content_key", [key.encode()], [1, 1])])
        response = await request.async_exec()
        if response.has_error():
            raise from_triton_error(response.error())
        return pb_utils.get_output_tensor_by_name(response, "layout").as_numpy().reshape(-1)[0].decode()

    async def generate(self, inputs: RawGenerateInputs, stage: Stage = Stage.GENERATE) -> AsyncIterator[ResponseChunk]:
        """Stream the generator's chunks. If the consumer stops early (``aclose``: its client cancelled),
        the generator is told to abort the request, since Triton 2.51 cannot cancel a BLS request."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        stage_id = uuid.uuid4().hex
        model = self.models[stage]
        outputs = GENERATE_OUTPUTS + ([KV_OUTPUT] if stage is Stage.PREFILL else [])
        request = pb_utils.InferenceRequest(model_name=model, inputs=generate_tensors(inputs),
                                            requested_output_names=outputs,
                                            parameters={**_TAGGED, STAGE_REQUEST_ID_PARAMETER: stage_id})

        threading.Thread(target=self._stream, args=(request, loop, queue.put_nowait), name=f"bls-stream-{model}",
                         daemon=True).start()
        finished = False
        try:
            while (response := await queue.get()) is not _END:
                if isinstance(response, Exception):
                    raise response
                if response.has_error():
                    finished = True
                    raise from_triton_error(response.error())
                chunk = _chunk(response)
                finished = chunk.finish_reason is not None
                if chunk.text_output or finished:
                    yield chunk
            finished = True
        finally:
            if not finished:
                await self._abort(model, stage_id)

    async def _abort(self, model: str, stage_id: str) -> None:
        request = pb_utils.InferenceRequest(model_name=model, inputs=[], requested_output_names=[],
                                            parameters={ABORT_PARAMETER: stage_id})
        done = asyncio.get_running_loop().create_future()

        def deliver(item):
            if item is _END and not done.done():
                done.set_result(None)

        threading.Thread(target=self._stream, args=(request, done.get_loop(), deliver), name=f"bls-abort-{model}",
                         daemon=True).start()
        await done

    def close(self) -> None:
        """Stream threads are daemons and end with their streams; retired iterators go with the stub."""
