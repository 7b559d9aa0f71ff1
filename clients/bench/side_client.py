"""The one client of ``clients.bench.side_by_side``: the same seeded requests to every stack, over the OpenAI protocol
(streaming chat completions, aiohttp) or over Triton's gRPC (``clients.bench.load.run_concurrency``).

A request set is ``count`` requests from seed ``first``: request ``s`` (seed) has ``images`` random-pixel square images
(PNG, or JPEG with ``fmt``), image ``j`` of ``sizes[(s + j) % len(sizes)]`` px a side drawn from seed ``s + j * 10**7``
(``clients.images.image_bytes``; one image of one size: ``image_bytes(size, size, seed=s)``, as before), then the text
``Request <s>: what is in the picture?``, greedy sampling, ``max_tokens`` tokens with ``ignore_eos``. Both protocols
send the same chat (the image parts, then the text part), so a deployment's answers can be compared with vLLM's single
engine's, request by request.

Load: closed loop, ``concurrency`` clients, each sending its next request when its previous one finished; a request's
TTFT is the time to its first token (OpenAI: the first chunk with a choice; gRPC: the first streamed response, whose
text may still be ""), its latency the time to its last byte (``clients.bench.report.Sample``).
"""
from __future__ import annotations

import asyncio
import base64
import json
import time
from dataclasses import dataclass

from clients.bench.report import Sample


IMAGE_SEED_STRIDE = 10**7  # image j > 0 of request s is drawn from seed s + j * stride: no two requests share an image


@dataclass(frozen=True)
class Request:
    seed: int
    images: tuple[bytes, ...]  # PNG or JPEG
    text: str

    @property
    def image(self) -> bytes:
        """The first image."""
        return self.images[0]


def request_set(first: int, count: int, size: int | list[int], images: int = 1, fmt: str = "PNG") -> list[Request]:
    """``count`` requests from seed ``first`` (the module's contract); the same arguments give the same bytes."""
    from clients.images import image_bytes

    sizes = [size] if isinstance(size, int) else list(size)

    def image(seed: int, j: int) -> bytes:
        side = sizes[(seed + j) % len(sizes)]
        return image_bytes(side, side, seed=seed + j * IMAGE_SEED_STRIDE, fmt=fmt)

    return [Request(seed, tuple(image(seed, j) for j in range(images)), f"Request {seed}: what is in the picture?")
            for seed in range(first, first + count)]


def data_url(image: bytes) -> str:
    """``image`` as a ``data:`` URL of its type (JPEG or PNG, by its first bytes)."""
    mime = "image/jpeg" if image[:3] == b"\xff\xd8\xff" else "image/png"
    return f"data:{mime};base64," + base64.b64encode(image).decode()


def messages_body(model: str, messages: list[dict], max_tokens: int) -> dict:
    """The benchmarks' OpenAI chat-completions body: greedy, ``max_tokens`` tokens whatever the text (``ignore_eos``),
    streamed with the usage chunk last."""
    return {"model": model, "stream": True, "stream_options": {"include_usage": True}, "max_tokens": max_tokens,
            "temperature": 0.0, "ignore_eos": True, "messages": messages}


def chat_body(model: str, request: Request, max_tokens: int) -> dict:
    """The OpenAI streaming chat-completions body of ``request``."""
    parts = [{"type": "image_url", "image_url": {"url": data_url(image)}} for image in request.images]
    return messages_body(model, [{"role": "user", "content": [*parts, {"type": "text", "text": request.text}]}],
                         max_tokens)


def grpc_inputs(request: Request, max_tokens: int):
    """The same request as Triton generate inputs (``backend.protocol.generate.GenerateInputs``)."""
    from backend.protocol.generate import GenerateInputs

    content = [*({"type": "image"} for _ in request.images), {"type": "text", "text": request.text}]
    return GenerateInputs(messages=[{"role": "user", "content": content}], images=list(request.images),
                          sampling={"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True}, stream=True)


def parse_sse_line(line: bytes) -> dict | str | None:
    """One SSE line of a chat-completions stream: its JSON object, ``"[DONE]"``, or None (not a data line)."""
    line = line.strip()
    if not line.startswith(b"data:"):
        return None
    payload = line[5:].strip()
    return "[DONE]" if payload == b"[DONE]" else json.loads(payload)


def first_token_event(event) -> bool:
    """Whether a parsed stream event is one a first token's time can be read from: any chunk with a choice, as
    vLLM's own benchmark client reads TTFT (both servers send their first choice chunk, role and content, when the
    engine gives its first token). Not "the first non-empty text": a random-weight checkpoint's tokens often decode
    to "" (the H100 run of 2026-12-05 read TTFT = the whole request that way, TPOT 0)."""
    return isinstance(event, dict) and bool(event.get("choices"))


async def stream_chat(session, url: str, body: dict) -> tuple[Sample | None, str | None]:
    """POST ``body`` to the chat-completions ``url`` and read its stream: (the sample, None), or (None, the error: a
    status, an error event, a stream that ended before [DONE]). TTFT at the first chunk with a choice
    (``first_token_event``); tokens from the usage chunk, else the chunks with text."""
    started = time.perf_counter()
    ttft, chunks, tokens, responses = None, [], None, 0
    async with session.post(url, json=body) as resp:
        if resp.status != 200:
            return None, f"HTTP {resp.status}: {(await resp.text())[:300]}"
        async for line in resp.content:
            event = parse_sse_line(line)
            if event is None:
                continue
            if event == "[DONE]":
                break
            if "error" in event:
                return None, f"error in stream: {str(event['error'])[:300]}"
            if ttft is None and first_token_event(event):
                ttft = time.perf_counter() - started
            for choice in event.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content") or ""
                if piece:
                    responses += 1
                    chunks.append(piece)
            if event.get("usage"):
                tokens = event["usage"].get("completion_tokens")
        else:
            return None, "stream ended before [DONE]"
    latency = time.perf_counter() - started
    return Sample(ttft if ttft is not None else latency, latency, tokens if tokens is not None else responses,
                  responses=responses, text="".join(chunks)), None


async def run_openai(base_url: str, model: str, requests: list[Request], concurrency: int,
                     max_tokens: int) -> tuple[list[Sample], list[str], float]:
    """(samples with ``index`` = position in ``requests``, errors, wall seconds) of ``requests`` sent to
    ``base_url``/v1/chat/completions by ``concurrency`` closed-loop clients."""
    import aiohttp

    queue: asyncio.Queue = asyncio.Queue()
    for job in enumerate(requests):
        queue.put_nowait(job)
    samples, errors = [], []
    url = f"{base_url}/v1/chat/completions"

    async def client(session):
        while not queue.empty():
            index, request = queue.get_nowait()
            try:
                sample, error = await stream_chat(session, url, chat_body(model, request, max_tokens))
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
                sample, error = None, f"{type(exc).__name__}: {exc}"
            if sample is not None:
                sample.index = index
                samples.append(sample)
            if error is not None:
                errors.append(error)

    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency), timeout=timeout) as session:
        started = time.perf_counter()
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
        return samples, errors, time.perf_counter() - started


class _Quiet:
    def update(self, n: int = 1) -> None:
        pass


async def run_grpc(grpc_url: str, model: str, requests: list[Request], concurrency: int,
                   max_tokens: int) -> tuple[list[Sample], list[str], float]:
    """As ``run_openai``, over Triton's gRPC streaming endpoint at ``grpc_url`` (``clients.bench.load``)."""
    from clients.bench.load import run_concurrency

    results, wall = await run_concurrency(grpc_url, model, concurrency,
                                          [grpc_inputs(r, max_tokens) for r in requests], _Quiet())
    return results.samples, results.errors, wall
