"""What the OpenAI-compatible endpoint (``frontend.openai``) costs: the same requests to the same deployment, over
tritonserver's gRPC streaming (``clients.bench.load``) and through the endpoint (SSE over HTTP, aiohttp), closed loop
at the same concurrency, the two alternating ``--rounds`` times in one run; requests/s and latency side by side, and
the ratio and the difference in p50.

    .venv/bin/python -m clients.bench.openai --model epd --concurrency 16 --requests 200 --rounds 3

One server (the committed repository) and one endpoint are started here (or ``--url`` / ``--openai-url`` given);
the requests are chat requests with ``--images`` synthetic PNGs each as ``data:`` URLs, the same bytes both ways.
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request

from clients.bench.load import Results, run_concurrency
from clients.bench.report import Sample, percentile
from clients.triton_client import GenerateInputs


def _messages(seed: int, images: int, size: tuple[int, int]) -> list[dict]:
    from clients.images import image_bytes

    parts = [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(
        image_bytes(*size, seed=seed * 7 + i)).decode()}} for i in range(images)]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": f"Request {seed}: what is in it?"}]}]


async def _openai_one(session, url: str, model: str, messages, max_tokens: int) -> tuple[Sample | None, str | None]:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    started, ttft, tokens, responses = time.perf_counter(), None, 0, 0
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        if resp.status != 200:
            return None, f"HTTP {resp.status}: {(await resp.text())[:200]}"
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                latency = time.perf_counter() - started
                return Sample(ttft or latency, latency, tokens, {}, responses), None
            doc = json.loads(line[6:])
            if "error" in doc:
                return None, doc["error"]["message"]
            if doc.get("usage"):
                tokens = doc["usage"]["completion_tokens"]
            if doc.get("choices") and doc["choices"][0]["delta"].get("content"):
                responses += 1
                ttft = ttft or time.perf_counter() - started
    return None, "stream ended before [DONE]"


async def run_openai(url: str, model: str, concurrency: int, messages: list, max_tokens: int) -> tuple[Results, float]:
    import aiohttp

    class _Quiet:
        def update(self, _n):
            pass

    results, jobs = Results(_Quiet()), asyncio.Queue()
    for m in messages:
        jobs.put_nowait(m)

    async def client(session):
        while not jobs.empty():
            results.add(*await _openai_one(session, url, model, jobs.get_nowait(), max_tokens))

    started = time.perf_counter()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
    return results, time.perf_counter() - started


def _row(path: str, results: Results, wall: float) -> dict:
    lat = [s.latency * 1000 for s in results.samples]
    return {"path": path, "req_per_s": len(results.samples) / wall, "latency_p50_ms": percentile(lat, 50),
            "latency_p90_ms": percentile(lat, 90), "ttft_p50_ms": percentile([s.ttft * 1000 for s in results.samples],
                                                                              50), "errors": len(results.errors)}


async def measure(grpc_url: str, openai_url: str, args) -> list[dict]:
    class _Quiet:
        def update(self, _n):
            pass

    size = tuple(int(v) for v in args.image_size.split("x"))
    rows, seed = [], 0
    for _ in range(args.rounds):
        for path in ("grpc", "openai"):
            messages = [_messages(seed + i, args.images, size) for i in range(args.requests)]
            seed += args.requests  # fresh images every round: no cache serves a repeat
            if path == "grpc":
                inputs = [GenerateInputs(messages=m, sampling={"temperature": 0.0, "max_tokens": args.max_tokens,
                                                               "ignore_eos": True}) for m in messages]
                results, wall = await run_concurrency(grpc_url, args.model, args.concurrency, inputs, _Quiet())
            else:
                results, wall = await run_openai(openai_url, args.model, args.concurrency, messages, args.max_tokens)
            rows.append(_row(path, results, wall))
            print(f"{path}: {rows[-1]['req_per_s']:.1f} req/s, latency p50 {rows[-1]['latency_p50_ms']:.1f} ms",
                  file=sys.stderr, flush=True)
    return rows


def summary(rows: list[dict]) -> str:
    lines = ["| path | round | req/s | latency p50 / p90 ms | TTFT p50 ms | errors |", "|---|---|---|---|---|---|"]
    for i, r in enumerate(rows):
        lines.append(f"| {r['path']} | {i // 2 + 1} | {r['req_per_s']:.1f} | {r['latency_p50_ms']:.1f} / "
                     f"{r['latency_p90_ms']:.1f} | {r['ttft_p50_ms']:.1f} | {r['errors']} |")
    by = {p: [r for r in rows if r["path"] == p] for p in ("grpc", "openai")}
    rps = {p: statistics.mean(r["req_per_s"] for r in v) for p, v in by.items()}
    p50 = {p: statistics.median(r["latency_p50_ms"] for r in v) for p, v in by.items()}
    lines.append(f"\nOpenAI endpoint / gRPC: requests/s {rps['openai'] / rps['grpc']:.3f} (mean of rounds), latency "
                 f"p50 {p50['openai'] - p50['grpc']:+.2f} ms (median of rounds)")
    return "\n".join(lines)


def _wait_healthy(url: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if urllib.request.urlopen(url + "/health", timeout=2).status == 200:
                return
        except OSError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{url} did not become healthy")


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="epd")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--requests", type=int, default=200, help="per path and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--images", type=int, default=1)
    parser.add_argument("--image-size", default="96x96")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--url", help="a running server's gRPC host:port (default: start one)")
    parser.add_argument("--openai-url", help="a running endpoint's http://host:port (default: start one)")
    args = parser.parse_args(argv)
    from backend.deploy.ports import free_ports
    from clients.local_server import ROOT, TritonServer

    with TritonServer(log_path=ROOT / ".cache" / "bench-openai-server.log") if not args.url else _Given() as server:
        grpc_url = args.url or server.grpc_url
        endpoint = None
        if not args.openai_url:
            (port,) = free_ports(1)
            endpoint = subprocess.Popen([sys.executable, "-m", "frontend.openai", "--port", str(port), "--grpc-url",
                                         grpc_url], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
        openai_url = args.openai_url or f"http://127.0.0.1:{port}"
        try:
            _wait_healthy(openai_url)
            rows = asyncio.run(measure(grpc_url, openai_url, args))
        finally:
            if endpoint is not None:
                endpoint.terminate()
                endpoint.wait(timeout=30)
    print(f"\n{args.requests} requests per row, concurrency {args.concurrency}, model {args.model}, {args.images} "
          f"{args.image_size} PNG(s) per request as data: URLs, {args.max_tokens} greedy tokens (ignore_eos)\n")
    print(summary(rows))
    return rows


class _Given:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return None


if __name__ == "__main__":
    main()
