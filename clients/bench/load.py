"""The benchmark driver's requests and load (``clients.bench.e2e``): datasets, a closed-loop concurrency
mode and an open-loop request-rate mode, over tritonclient's asyncio gRPC streaming.

- Datasets: ``synthetic_requests`` (random-pixel PNGs of the given sizes), ``folder_requests`` (the
  images of a folder, in name order, reused round-robin), ``synthetic_video_requests`` (MP4 clips of
  ``clients.videos``, one colour pair per request) or ``synthetic_audio_requests`` (WAV files of ``clients.audios``);
  items per request, ``max_tokens`` greedy tokens with
  ``ignore_eos`` so every request generates the same length.
- ``run_concurrency``: ``concurrency`` simulated clients, each with one gRPC stream, sending its next
  request when the previous one finished (closed loop: the load adapts to the server).
- ``run_until``: the same closed loop, each request made as it is sent, until a deadline (``clients.bench.reuse``'s
  background traffic).
- ``run_rate``: requests sent at Poisson arrival times (``rate_schedule``: exponential gaps of mean
  1/rate, seeded), each on its own stream, whatever the server's state (open loop: queues grow when the
  rate exceeds what the server can do, which is what a rate sweep is for).
"""
from __future__ import annotations

import asyncio
import json
import random
import time
import uuid
from pathlib import Path

from backend.protocol.generate import GenerateInputs
from clients.bench.report import Sample
from clients.triton_client import grpc_inputs, read_to_end, single_request_stream

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif")


def _prompt(i: int) -> str:
    return f"Request {i}: what is in the picture?"


def _sampling(max_tokens: int) -> dict:
    return {"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True}


def synthetic_requests(count: int, images: int, sizes: list[tuple[int, int]], max_tokens: int, first: int = 0,
                       fmt: str = "PNG") -> list[GenerateInputs]:
    from clients.images import image_bytes

    out = []
    for seed in range(first, first + count):
        media = [image_bytes(*sizes[(seed + i) % len(sizes)], seed=seed * 7 + i, fmt=fmt) for i in range(images)]
        out.append(GenerateInputs(prompt=_prompt(seed), images=media, sampling=_sampling(max_tokens), stream=True))
    return out


def synthetic_video_requests(count: int, videos: int, size: tuple[int, int], frames: int, fps: float, max_tokens: int,
                             first: int = 0, codec: str = "mp4v") -> list[GenerateInputs]:
    """``videos`` clips of ``frames`` frames at ``fps`` per request, as ``{"type": "video"}`` chat parts; ``codec``:
    ``mp4v`` (OpenCV's writer) or ``h264`` (PyAV's libx264, moving gradients: what NVDEC decodes)."""
    from clients.videos import make_h264_video, make_video

    if codec == "h264":
        def make(seed):
            return make_h264_video(*size, frames=frames, fps=round(fps), seed=seed, noise=False)
    else:
        def make(seed):
            return make_video(*size, frames=frames, fps=fps, seed=seed)
    return _chat_requests(count, videos, make, "video", "what happens?", max_tokens, first)


def synthetic_audio_requests(count: int, audios: int, seconds: float, rate: int, max_tokens: int,
                             first: int = 0) -> list[GenerateInputs]:
    """``audios`` WAV files of ``seconds`` at ``rate`` Hz (mono) per request, as ``{"type": "audio"}`` chat parts."""
    from clients.audios import make_audio

    return _chat_requests(count, audios, lambda seed: make_audio(seconds, rate, seed=seed), "audio",
                          "what is this sound?", max_tokens, first)


def _chat_requests(count: int, per_request: int, make, modality: str, question: str, max_tokens: int,
                   first: int) -> list[GenerateInputs]:
    """Chat requests of ``per_request`` items ``make(seed)`` each, as ``{"type": <modality>}`` parts, in the
    modality's tensor (``videos``, ``audios``)."""
    out = []
    for seed in range(first, first + count):
        items = [make(seed * 7 + i) for i in range(per_request)]
        content = [{"type": modality}] * per_request + [{"type": "text", "text": f"Request {seed}: {question}"}]
        out.append(GenerateInputs(messages=[{"role": "user", "content": content}], **{f"{modality}s": items},
                                  sampling=_sampling(max_tokens), stream=True))
    return out


def folder_images(folder: Path) -> list[bytes]:
    files = sorted(p for p in Path(folder).iterdir() if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())
    if not files:
        raise SystemExit(f"{folder}: no images ({', '.join(IMAGE_SUFFIXES)})")
    return [p.read_bytes() for p in files]


def folder_requests(media: list[bytes], count: int, images: int, max_tokens: int, first: int = 0) -> list[GenerateInputs]:
    """Request ``i`` takes ``images`` consecutive items of ``media`` from item ``i * images`` on, wrapping."""
    return [GenerateInputs(prompt=_prompt(i), images=[media[(i * images + k) % len(media)] for k in range(images)],
                           sampling=_sampling(max_tokens), stream=True) for i in range(first, first + count)]


def rate_schedule(rate: float, count: int, seed: int = 0) -> list[float]:
    """Send times (seconds from the start) of ``count`` Poisson arrivals at ``rate`` requests/s; the first at 0.
    ``rate`` inf: all at once."""
    if rate <= 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    rng, at, times = random.Random(seed), 0.0, []
    for _ in range(count):
        times.append(at)
        at += 0.0 if rate == float("inf") else rng.expovariate(rate)
    return times


async def _read_response(stream, started: float) -> tuple[Sample | None, str | None]:
    """Read one request's responses from ``stream`` up to its final one."""
    ttft, tokens, timings, responses, chunks = None, 0, {}, 0, []
    async for result, error in stream:
        if error is not None:
            return None, str(error)
        responses += 1
        final = result.get_response().parameters["triton_final_response"].bool_param
        text = result.as_numpy("text_output")
        has_text = text is not None and text.size and text.reshape(-1)[0]
        if has_text:
            chunks.append(_text(text.reshape(-1)[0]))
        if ttft is None and (has_text or not final):  # a streamed response before the final one: a token came
            ttft = time.perf_counter() - started
        count = result.as_numpy("num_output_tokens")
        if count is not None:
            tokens = int(count.reshape(-1)[0])
        stage = result.as_numpy("timings")
        if stage is not None:
            timings = json.loads(stage.reshape(-1)[0])
        if final:
            latency = time.perf_counter() - started
            return Sample(ttft or latency, latency, tokens, timings, responses, "".join(chunks)), None
    return None, "stream ended before the final response"


def _text(value) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _request(model: str, inputs: GenerateInputs) -> dict:
    request = {"model_name": model, "inputs": grpc_inputs(inputs.as_values()), "request_id": uuid.uuid4().hex,
               "enable_empty_final_response": True}
    if inputs.parameters:
        request["parameters"] = inputs.parameters
    return request


class Results:
    def __init__(self, progress):
        self.samples: list[Sample] = []
        self.errors: list[str] = []
        self.progress = progress

    def add(self, sample: Sample | None, error: str | None, index: int | None = None) -> None:
        """One request's outcome; ``index``: its position in the requests given (``Sample.index``)."""
        if sample is not None:
            sample.index = index
            self.samples.append(sample)
        if error is not None:
            self.errors.append(error)
        if self.progress is not None:
            self.progress.update(1)


async def _closed_loop_client(url: str, model: str, next_job, results: Results) -> None:
    """One simulated client on one gRPC stream: ``next_job()`` -> (index, inputs), or None when there is no more."""
    import tritonclient.grpc.aio as grpcclient

    client = grpcclient.InferenceServerClient(url)
    outbox: asyncio.Queue = asyncio.Queue()

    async def requests():
        while (item := await outbox.get()) is not None:
            yield item

    stream = client.stream_infer(requests())
    try:
        while (job := next_job()) is not None:
            index, inputs = job
            started = time.perf_counter()
            await outbox.put(_request(model, inputs))
            results.add(*await _read_response(stream, started), index=index)
    finally:
        await outbox.put(None)
        await read_to_end(stream)  # before closing the channel: see read_to_end
        await client.close()


async def run_concurrency(url: str, model: str, concurrency: int, requests: list[GenerateInputs], progress) -> tuple[Results, float]:
    jobs: asyncio.Queue = asyncio.Queue()
    for job in enumerate(requests):
        jobs.put_nowait(job)
    results = Results(progress)
    started = time.perf_counter()
    await asyncio.gather(*(_closed_loop_client(url, model, lambda: None if jobs.empty() else jobs.get_nowait(), results)
                           for _ in range(concurrency)))
    return results, time.perf_counter() - started


async def run_until(url: str, model: str, concurrency: int, make, deadline: float, progress) -> tuple[Results, float]:
    """Closed loop like ``run_concurrency``, with requests ``make(i)`` (i = 0, 1, ...) made as they are sent, until
    ``time.monotonic()`` passes ``deadline``: no request is sent after it (those in flight finish)."""
    counter = iter(range(1 << 62))

    def next_job():
        if time.monotonic() >= deadline:
            return None
        i = next(counter)
        return i, make(i)

    results = Results(progress)
    started = time.perf_counter()
    await asyncio.gather(*(_closed_loop_client(url, model, next_job, results) for _ in range(concurrency)))
    return results, time.perf_counter() - started


async def run_rate(url: str, model: str, rate: float, requests: list[GenerateInputs], progress, seed: int = 0) -> tuple[Results, float]:
    """Each request at its Poisson send time on a stream of its own; the wall time runs to the last answer."""
    import tritonclient.grpc.aio as grpcclient

    client = grpcclient.InferenceServerClient(url)
    results = Results(progress)
    start = time.perf_counter()

    async def one(index: int, at: float, inputs: GenerateInputs) -> None:
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        started = time.perf_counter()
        try:
            async with single_request_stream(client, _request(model, inputs)) as stream:
                results.add(*await _read_response(stream, started), index=index)
        except Exception as exc:  # noqa: BLE001 - a failed request is an error row, not the end of the run
            results.add(None, f"{type(exc).__name__}: {exc}")

    try:
        await asyncio.gather(*(one(i, at, inputs) for i, (at, inputs)
                               in enumerate(zip(rate_schedule(rate, len(requests), seed), requests))))
    finally:
        await client.close()
    return results, time.perf_counter() - start
