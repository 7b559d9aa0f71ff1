"""What the OpenAI endpoint and its HTTP stack cost to a request's first token when tritonserver costs nothing: the
endpoint's application (``frontend.openai.app``) with its backend answering at once (16 pieces, no gRPC), beside a
bare Starlette app that streams the same number of SSE chunks and parses nothing, both under uvicorn in processes of
their own, driven one request at a time by the benchmark's own client (``clients.bench.openai``: aiohttp, the same
chat bodies with a PNG as a ``data:`` URL), alternating which goes first.

    .venv/bin/python -m clients.tools.openai_http_floor --requests 400

The bare app's figures are the HTTP floor (client, uvicorn, Starlette); the endpoint's less the bare app's are what
the endpoint's own code adds before the first token and before [DONE] (issue 19's "adds at most 1 ms p50"; what
lies between the endpoint and tritonserver is not here: ``clients.bench.openai --paired`` measures the whole).

The endpoint's gRPC side alone, against a running server (``--grpc-url``): its ``Backend`` (the same request, request
parameters and kept streams as the endpoint sends) driven in this process, paired with the benchmark's plain gRPC
client (one request each way per pair, alternating which goes first), the median differences with their intervals:

    .venv/bin/python -m clients.tools.openai_http_floor --grpc-url 127.0.0.1:8001 --requests 150

Both applications alone (``--in-process``): each called through ASGI in this process, no uvicorn, no client, no
socket, the same body; each one's CPU per request (the endpoint's code against a bare app's, on and off the path):

    .venv/bin/python -m clients.tools.openai_http_floor --in-process --requests 2000
"""
from __future__ import annotations

import argparse
import asyncio
import socket
import statistics
import subprocess
import sys
import time

MODEL = "epd"
PIECES = 16


def endpoint_app():
    """The endpoint's application, its backend answering every request at once with ``PIECES`` pieces."""
    from frontend.openai.app import Piece, create_app

    app = create_app("127.0.0.1:1", [MODEL])

    async def generate(call, clock=None):
        if clock is not None:
            clock.responded(clock.waiting())
        for _ in range(PIECES - 1):
            yield Piece("a", None, None, None)
        yield Piece("b", "length", (10, PIECES), None, True)

    app.state.backend.generate = generate
    return app


def bare_app():
    """A Starlette app that reads the body and streams ``PIECES`` SSE chunks and [DONE]: no parsing, no translating."""
    from starlette.applications import Starlette
    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    async def chat(request):
        await request.body()

        async def events():
            yield 'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":"a"}}]}\n\n'
            for _ in range(PIECES - 2):
                yield 'data: {"choices":[{"index":0,"delta":{"content":"a"}}]}\n\n'
            yield ('data: {"choices":[{"index":0,"delta":{"content":"b"},"finish_reason":"length"}]}\n\n'
                   f'data: {{"choices":[],"usage":{{"prompt_tokens":10,"completion_tokens":{PIECES}}}}}\n\n'
                   'data: [DONE]\n\n')

        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])


async def measure(urls: dict[str, str], requests: int, warm: int = 20) -> dict[str, dict[str, float]]:
    """``requests`` one-at-a-time requests to each of ``urls`` (name -> base URL), alternating which goes first; per
    name the p50 time to the first token and to [DONE], in ms."""
    import aiohttp

    from clients.bench.openai import _messages, _openai_one

    got = {name: ([], []) for name in urls}
    names = list(urls)
    async with aiohttp.ClientSession() as session:
        for i in range(warm + requests):
            for name in names if i % 2 == 0 else names[::-1]:
                sample, error = await _openai_one(session, urls[name], MODEL, _messages(i, 1, (96, 96)), PIECES)
                if error is not None:
                    raise RuntimeError(f"{name}: {error}")
                if i >= warm:
                    got[name][0].append(sample.ttft * 1000)
                    got[name][1].append(sample.latency * 1000)
    return {name: {"ttft_p50_ms": statistics.median(t), "latency_p50_ms": statistics.median(lat)}
            for name, (t, lat) in got.items()}


async def in_process(requests: int, warm: int = 50) -> dict[str, dict[str, float]]:
    """Each app called ``requests`` times through ASGI directly (no server, no client), alternating in blocks; per app
    the mean time per request in ms, and the body of its answer (checked by the caller: every SSE document, [DONE]
    last)."""
    import json

    from clients.bench.openai import _messages, chat_body

    body = json.dumps(chat_body(MODEL, _messages(1, 1, (96, 96)), PIECES)).encode()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions", "query_string": b"",
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2), "root_path": ""}

    async def call(app) -> bytes:
        sent, out = False, []

        async def receive():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await asyncio.Event().wait()  # the client never leaves: the app ends the exchange

        async def send(message):
            out.append(message.get("body", b""))

        await app(dict(scope), receive, send)
        return b"".join(out)

    apps, spent = {"endpoint": endpoint_app(), "bare": bare_app()}, {"endpoint": 0.0, "bare": 0.0}
    answers = {name: await call(app) for name, app in apps.items()}
    block, counted = max(1, min(100, requests // 10)), 0
    for done in range(-warm, requests, block):
        for name, app in apps.items():
            started = time.perf_counter()
            for _ in range(block):
                await call(app)
            if done >= 0:
                spent[name] += time.perf_counter() - started
        counted += block if done >= 0 else 0
    return {name: {"ms_per_request": spent[name] / counted * 1000, "answer": answers[name].decode()} for name in apps}


async def grpc_side(url: str, pairs: int, warm: int = 10) -> dict[str, tuple[float, float, float]]:
    """``pairs`` pairs (``clients.bench.openai.paired``): the endpoint's ``Backend.generate`` in this process against
    the benchmark's gRPC session, the same chat request each way; median (TTFT, latency) differences in ms, with
    their 95% intervals."""
    from backend.protocol.generate import GenerateInputs
    from clients.bench.openai import _GrpcSession, _checked, chat_body, paired, paired_diffs
    from clients.bench.report import Sample
    from frontend.openai import translate
    from frontend.openai.app import Backend

    direct, backend = _GrpcSession(url), Backend(url, [MODEL])
    sampling = {"temperature": 0.0, "max_tokens": PIECES, "ignore_eos": True}

    async def by_grpc(messages):
        return _checked("grpc", await direct.one(MODEL, GenerateInputs(messages=messages, sampling=sampling)))

    async def by_backend(messages):
        body = chat_body(MODEL, messages, PIECES)
        started, first, pieces = time.perf_counter(), None, 0
        async for piece in backend.generate(translate.chat_call(body, {MODEL})):
            first = first or (time.perf_counter() - started if piece.text else None)
            pieces += 1
            if piece.final:
                break
        latency = time.perf_counter() - started
        return Sample(first or latency, latency, PIECES, {}, pieces)

    try:
        got = await paired({"grpc": by_grpc, "backend": by_backend}, pairs, warm, 10 ** 6, 1, (96, 96))
    finally:
        await direct.close()
        await backend.close()
    return paired_diffs(got, "backend", "grpc")


def _wait(port: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"the app on port {port} did not start")


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=400, help="per app, after 20 not counted")
    parser.add_argument("--grpc-url", help="a running tritonserver's gRPC host:port: measure the gRPC side instead")
    parser.add_argument("--in-process", action="store_true",
                        help="call both apps through ASGI in this process (no server, no client): CPU per request")
    parser.add_argument("--serve", choices=("endpoint", "bare"), help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        import uvicorn

        uvicorn.run(endpoint_app() if args.serve == "endpoint" else bare_app(), host="127.0.0.1", port=args.port,
                    log_level="warning")
        return {}
    if args.grpc_url:
        diffs = asyncio.run(grpc_side(args.grpc_url, args.requests))
        print(f"the endpoint's Backend in process - plain gRPC, {args.requests} pairs, model {MODEL}: " + ", ".join(
            f"{name.removesuffix('_diff_ms')} {m:+.2f} ms [{lo:+.2f}, {hi:+.2f}]" for name, (m, lo, hi) in diffs.items()))
        return diffs
    if args.in_process:
        result = asyncio.run(in_process(args.requests))
        print(f"{args.requests} requests each through ASGI in this process, {PIECES} pieces, a 96x96 PNG per request")
        for name, row in result.items():
            print(f"{name}: {row['ms_per_request']:.3f} ms a request")
        print(f"the endpoint's own code: {result['endpoint']['ms_per_request'] - result['bare']['ms_per_request']:+.3f}"
              " ms of CPU a request (on the path and off it)")
        return result
    from backend.deploy.ports import free_ports

    ports = dict(zip(("endpoint", "bare"), free_ports(2)))
    procs = [subprocess.Popen([sys.executable, "-m", "clients.tools.openai_http_floor", "--serve", name, "--port",
                               str(port)]) for name, port in ports.items()]
    try:
        urls = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
        for port in ports.values():
            _wait(port)
        result = asyncio.run(measure(urls, args.requests))
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=10)
    end, bare = result["endpoint"], result["bare"]
    print(f"{args.requests} requests each, one at a time, {PIECES} pieces, a 96x96 PNG per request")
    print("| app | first token p50 ms | [DONE] p50 ms |\n|---|---|---|")
    for name, row in result.items():
        print(f"| {name} | {row['ttft_p50_ms']:.3f} | {row['latency_p50_ms']:.3f} |")
    print(f"the endpoint's own code: {end['ttft_p50_ms'] - bare['ttft_p50_ms']:+.3f} ms to the first token, "
          f"{end['latency_p50_ms'] - bare['latency_p50_ms']:+.3f} ms to [DONE]")
    return result


if __name__ == "__main__":
    main()
