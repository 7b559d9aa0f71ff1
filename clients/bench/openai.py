"""What the OpenAI-compatible endpoint (``frontend.openai``) costs: the same requests to the same deployment, over
tritonserver's gRPC streaming (``clients.bench.load``) and through the endpoint (SSE over HTTP, aiohttp), closed loop
at the same concurrency, the two alternating ``--rounds`` times in one run; requests/s and latency side by side, and
the ratio and the difference in p50.

    .venv/bin/python -m clients.bench.openai --model epd --concurrency 16 --requests 200 --rounds 3

What the endpoint adds to one request, to the millisecond (``--paired N``, after the rounds): N pairs of requests
one at a time, each pair one request each way (which goes first alternates, fresh images each), on a kept gRPC stream
and a kept HTTP connection; the median of the pairs' latency differences with its 95% confidence interval, and the
endpoint's own count of its time outside waiting on tritonserver (``openai_added_seconds`` on its /metrics):

    .venv/bin/python -m clients.bench.openai --model epd --rounds 0 --paired 300

One server (the committed repository) and one endpoint are started here (or ``--url`` / ``--openai-url`` given);
the requests are chat requests with ``--images`` synthetic PNGs each as ``data:`` URLs, the same bytes both ways.
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import os
import statistics
import subprocess
import sys
import time
import urllib.request

from backend.protocol.generate import GenerateInputs
from clients.bench.load import Results, _read_response, _request, run_concurrency
from clients.bench.report import Sample, percentile
from clients.bench.side_client import messages_body as chat_body, stream_chat


def _messages(seed: int, images: int, size: tuple[int, int]) -> list[dict]:
    from clients.images import image_bytes

    parts = [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(
        image_bytes(*size, seed=seed * 7 + i)).decode()}} for i in range(images)]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": f"Request {seed}: what is in it?"}]}]


async def _openai_one(session, url: str, model: str, messages, max_tokens: int) -> tuple[Sample | None, str | None]:
    return await stream_chat(session, url + "/v1/chat/completions", chat_body(model, messages, max_tokens))


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


class _GrpcSession:
    """One kept gRPC stream to the server, one request at a time (as ``clients.bench.load``'s closed-loop client)."""

    def __init__(self, url: str):
        import tritonclient.grpc.aio as grpcclient

        self.client, self.outbox = grpcclient.InferenceServerClient(url), asyncio.Queue()

        async def requests():
            while (item := await self.outbox.get()) is not None:
                yield item

        self.stream = self.client.stream_infer(requests())

    async def one(self, model: str, inputs: GenerateInputs) -> tuple[Sample | None, str | None]:
        started = time.perf_counter()
        await self.outbox.put(_request(model, inputs))
        return await _read_response(self.stream, started)

    async def close(self) -> None:
        from backend.triton.grpc_stream import read_to_end

        await self.outbox.put(None)
        await read_to_end(self.stream)
        await self.client.close()


def median_interval(values: list[float]) -> tuple[float, float, float]:
    """The median of ``values`` and its distribution-free 95% confidence interval (order statistics: the ranks
    n/2 -+ 0.98 sqrt(n), the binomial's normal approximation)."""
    ordered, n = sorted(values), len(values)
    k = max(0, int(n / 2 - 0.98 * n ** 0.5))
    return statistics.median(ordered), ordered[k], ordered[min(n - 1, n - 1 - k)]


async def paired(ask: dict, pairs: int, warm: int, seed: int, images: int, size: tuple[int, int]) -> dict[str, list]:
    """``pairs`` pairs of one-at-a-time requests after ``warm`` not counted, one request per path of ``ask`` (name ->
    ``async (messages) -> Sample``) in each pair, which goes first alternating, fresh images each; per path its
    counted samples, pair by pair."""
    got = {path: [] for path in ask}
    order = list(ask)
    for i in range(warm + pairs):
        for path in order if i % 2 == 0 else order[::-1]:
            messages, seed = _messages(seed, images, size), seed + 1
            sample = await ask[path](messages)
            if i >= warm:
                got[path].append(sample)
    return got


def paired_diffs(got: dict[str, list], path: str, base: str) -> dict[str, tuple[float, float, float]]:
    """``path``'s latency and TTFT less ``base``'s, pair by pair, in ms: their medians with 95% intervals."""
    pairs = list(zip(got[path], got[base]))
    return {"latency_diff_ms": median_interval([(a.latency - b.latency) * 1000 for a, b in pairs]),
            "ttft_diff_ms": median_interval([(a.ttft - b.ttft) * 1000 for a, b in pairs])}


def _checked(path: str, outcome: tuple) -> Sample:
    sample, error = outcome
    if error is not None:
        raise RuntimeError(f"{path}: {error}")
    return sample


async def measure_paired(grpc_url: str, openai_url: str, args, seed: int, warm: int = 10) -> dict:
    """``args.paired`` pairs (``paired``) of a gRPC and an endpoint request: per pair, the endpoint's latency and TTFT
    less gRPC's, in ms."""
    import aiohttp

    size = tuple(int(v) for v in args.image_size.split("x"))
    grpc = _GrpcSession(grpc_url)
    sampling = {"temperature": 0.0, "max_tokens": args.max_tokens, "ignore_eos": True}
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
            async def by_grpc(messages):
                return _checked("grpc", await grpc.one(args.model, GenerateInputs(messages=messages, sampling=sampling)))

            async def by_openai(messages):
                return _checked("openai", await _openai_one(session, openai_url, args.model, messages, args.max_tokens))

            got = await paired({"grpc": by_grpc, "openai": by_openai}, args.paired, warm, seed, args.images, size)
    finally:
        await grpc.close()
    return {"pairs": args.paired, "grpc_p50_ms": statistics.median(s.latency * 1000 for s in got["grpc"]),
            "openai_p50_ms": statistics.median(s.latency * 1000 for s in got["openai"]),
            **paired_diffs(got, "openai", "grpc")}


ENDPOINT_FIGURES = {"openai_added_seconds": "on the request's path", "openai_own_seconds": "all of its own"}


def added_histogram(openai_url: str, model: str) -> dict[str, dict[float, float]]:
    """The endpoint's ``ENDPOINT_FIGURES`` histograms for ``model``: name -> upper bound (s) -> requests at or
    below it."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(openai_url + "/metrics", timeout=10).read().decode()
    return {family.name: {float(s.labels["le"]): s.value for s in family.samples
                          if s.name.endswith("_bucket") and s.labels.get("model") == model}
            for family in text_string_to_metric_families(text) if family.name in ENDPOINT_FIGURES}


def _bucket_summary(before: dict[float, float], after: dict[float, float]) -> tuple[float, str]:
    counts = {le: after[le] - before.get(le, 0.0) for le in sorted(after)}
    total = counts.get(float("inf"), 0.0)
    if not total:
        return 0.0, "no request counted"
    bounds = sorted(counts)
    upper = next(le for le in bounds if counts[le] >= total / 2)
    lower = max([le for le in bounds if le < upper], default=0.0)
    return total, (f"p50 in ({lower * 1000:g}, {upper * 1000:g}] ms, {counts[0.001] / total:.1%} of requests "
                   f"<= 1 ms")


def added_summary(before: dict, after: dict) -> str:
    """What the endpoint counted between two ``added_histogram`` reads: each figure's p50 bucket and the share of
    requests at or below 1 ms."""
    parts, total = [], 0.0
    for name, what in ENDPOINT_FIGURES.items():
        count, text = _bucket_summary(before.get(name, {}), after.get(name, {}))
        total = max(total, count)
        parts.append(f"{what} ({name}): {text}")
    return f"the endpoint's time per request ({int(total)} requests): " + "; ".join(parts)


def paired_summary(row: dict) -> str:
    d, t = row["latency_diff_ms"], row["ttft_diff_ms"]
    return (f"| pairs | gRPC latency p50 ms | endpoint latency p50 ms | endpoint - gRPC, latency (median of pairs, "
            f"95% CI) ms | endpoint - gRPC, TTFT ms |\n|---|---|---|---|---|\n| {row['pairs']} | "
            f"{row['grpc_p50_ms']:.2f} | {row['openai_p50_ms']:.2f} | {d[0]:+.2f} [{d[1]:+.2f}, {d[2]:+.2f}] | "
            f"{t[0]:+.2f} [{t[1]:+.2f}, {t[2]:+.2f}] |")


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
    parser.add_argument("--paired", type=int, default=0, help="pairs of one-at-a-time requests, after the rounds")
    parser.add_argument("--url", help="a running server's gRPC host:port (default: start one)")
    parser.add_argument("--repository", help="the model repository to serve (default: the committed one)")
    parser.add_argument("--openai-url", help="a running endpoint's http://host:port (default: start one)")
    parser.add_argument("--openai-loop", choices=("auto", "uvloop", "asyncio"), default="auto",
                        help="the started endpoint's event loop (frontend.openai --loop)")
    args = parser.parse_args(argv)
    from backend.deploy.local_server import DEFAULT_REPOSITORY, ROOT, TritonServer
    from backend.deploy.ports import free_ports

    with TritonServer(args.repository or DEFAULT_REPOSITORY, log_path=ROOT / ".cache" / "bench-openai-server.log",
                      start_timeout=900) if not args.url else _Given() as server:
        grpc_url = args.url or server.grpc_url
        endpoint = None
        if not args.openai_url:
            (port,) = free_ports(1)
            endpoint = subprocess.Popen([sys.executable, "-m", "frontend.openai", "--port", str(port), "--grpc-url",
                                         grpc_url, "--loop", args.openai_loop], cwd=ROOT,
                                        env={**os.environ, "PYTHONPATH": str(ROOT)})
        openai_url = args.openai_url or f"http://127.0.0.1:{port}"
        try:
            _wait_healthy(openai_url)
            rows = asyncio.run(measure(grpc_url, openai_url, args)) if args.rounds else []
            if args.paired:
                before = added_histogram(openai_url, args.model)
                paired = asyncio.run(measure_paired(grpc_url, openai_url, args, seed=10 ** 6))
                added = added_summary(before, added_histogram(openai_url, args.model))
        finally:
            if endpoint is not None:
                endpoint.terminate()
                endpoint.wait(timeout=30)
    print(f"\n{args.requests} requests per row, concurrency {args.concurrency}, model {args.model}, {args.images} "
          f"{args.image_size} PNG(s) per request as data: URLs, {args.max_tokens} greedy tokens (ignore_eos)\n")
    if rows:
        print(summary(rows))
    if args.paired:
        print(f"\none request at a time, {args.paired} pairs:\n" + paired_summary(paired) + "\n" + added)
        rows.append({"path": "paired", **paired, "added": added})
    return rows


class _Given:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return None


if __name__ == "__main__":
    main()
