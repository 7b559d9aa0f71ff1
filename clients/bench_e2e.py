"""End-to-end serving benchmark: several models side by side, one run, one table.

An asyncio load generator (tritonclient gRPC streaming, one bidirectional stream per simulated client)
keeps ``concurrency`` requests in flight against each model in turn, for each concurrency of the sweep.
Requests: a prompt and ``--images`` synthetic images (sizes drawn from ``--image-sizes``), greedy,
``--max-tokens`` tokens with ignore_eos. Reported per model and concurrency: requests/s, output tokens/s,
TTFT and end-to-end latency p50/p90/p99, and the stage breakdown the orchestrators return (p50 of
encode, transfer, prefill, generate), and the mean number of streamed responses per request (the
server coalesces tokens when the client falls behind).

Servers: by default each deployment runs alone, on a server of its own rendered from ``--topology``
(``llm`` = the baseline, ``epd`` = E+PD, ``epd_disagg`` = E/P/D, each called as its topology names it),
one after the other in this run: on a 2-core machine, idle engines of the other deployments would
otherwise share the cores. ``--shared`` benchmarks the models of one server started on the committed
repository instead, and ``--url`` a server that is already running. ``--compile`` runs the engines with
torch.compile (vLLM's default; the committed topologies run eager, which starts faster).

    python -m clients.bench_e2e --models llm,epd,epd_disagg --concurrency 1,4,16 --requests 200 --compile
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from clients.triton_client import GenerateInputs, grpc_inputs

LABELS = {"llm": "llm (one engine)", "epd": "E+PD", "epd_disagg": "E/P/D"}
DEPLOYMENT_OF = {"llm": "baseline", "epd": "E+PD", "epd_disagg": "E/P/D"}
STAGES = ("encode_ms", "transfer_ms", "prefill_ms", "generate_ms")


@dataclass
class Sample:
    ttft: float
    latency: float
    tokens: int
    timings: dict = field(default_factory=dict)
    responses: int = 0  # streamed responses (fewer than tokens when the server coalesced under load)


def _images(count: int, sizes: list[tuple[int, int]], seed: int) -> list[bytes]:
    from clients.images import image_bytes

    return [image_bytes(*sizes[(seed + i) % len(sizes)], seed=seed * 7 + i) for i in range(count)]


def make_request(seed: int, images: int, sizes: list[tuple[int, int]], max_tokens: int) -> GenerateInputs:
    return GenerateInputs(prompt=f"Request {seed}: what is in the picture?", images=_images(images, sizes, seed),
                          sampling={"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True}, stream=True)


async def _client(url: str, model: str, jobs: asyncio.Queue, samples: list[Sample], errors: list[str], progress) -> None:
    import tritonclient.grpc.aio as grpcclient

    client = grpcclient.InferenceServerClient(url)
    outbox: asyncio.Queue = asyncio.Queue()

    async def requests():
        while (item := await outbox.get()) is not None:
            yield item

    stream = client.stream_infer(requests())
    try:
        while True:
            try:
                inputs = jobs.get_nowait()
            except asyncio.QueueEmpty:
                break
            started = time.perf_counter()
            ttft, tokens, timings, responses = None, 0, {}, 0
            await outbox.put({"model_name": model, "inputs": grpc_inputs(inputs.as_values()),
                              "request_id": uuid.uuid4().hex, "enable_empty_final_response": True})
            async for result, error in stream:
                if error is not None:
                    errors.append(str(error))
                    break
                responses += 1
                text = result.as_numpy("text_output")
                if ttft is None and text is not None and text.size and text.reshape(-1)[0]:
                    ttft = time.perf_counter() - started
                count = result.as_numpy("num_output_tokens")
                if count is not None:
                    tokens = int(count.reshape(-1)[0])
                stage = result.as_numpy("timings")
                if stage is not None:
                    timings = json.loads(stage.reshape(-1)[0])
                if result.get_response().parameters["triton_final_response"].bool_param:
                    samples.append(Sample(ttft or time.perf_counter() - started, time.perf_counter() - started,
                                          tokens, timings, responses))
                    break
            progress.update(1)
    finally:
        await outbox.put(None)
        await client.close()


async def run_level(url: str, model: str, concurrency: int, requests: list[GenerateInputs], progress) -> tuple[list[Sample], list[str], float]:
    jobs: asyncio.Queue = asyncio.Queue()
    for inputs in requests:
        jobs.put_nowait(inputs)
    samples: list[Sample] = []
    errors: list[str] = []
    started = time.perf_counter()
    await asyncio.gather(*(_client(url, model, jobs, samples, errors, progress) for _ in range(concurrency)))
    return samples, errors, time.perf_counter() - started


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def summarise(model: str, concurrency: int, samples: list[Sample], errors: list[str], wall: float) -> dict:
    ttft = [s.ttft * 1000 for s in samples]
    latency = [s.latency * 1000 for s in samples]
    row = {"model": model, "concurrency": concurrency, "completed": len(samples), "errors": len(errors),
           "req_per_s": len(samples) / wall, "tok_per_s": sum(s.tokens for s in samples) / wall,
           "ttft_p50_ms": _pct(ttft, 0.5), "ttft_p90_ms": _pct(ttft, 0.9), "ttft_p99_ms": _pct(ttft, 0.99),
           "latency_p50_ms": _pct(latency, 0.5), "latency_p90_ms": _pct(latency, 0.9),
           "latency_p99_ms": _pct(latency, 0.99),
           "responses_per_request": statistics.mean(s.responses for s in samples) if samples else float("nan")}
    for stage in STAGES:
        values = [s.timings[stage] for s in samples if stage in s.timings]
        row[f"{stage}_p50"] = statistics.median(values) if values else None
    return row


def print_table(rows: list[dict]) -> None:
    print("| model | conc. | req/s | tok/s | TTFT p50 / p90 / p99 ms | e2e p50 / p90 ms | encode / transfer / prefill / generate p50 ms | resp./req | errors |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        stages = " / ".join("-" if r[f"{s}_p50"] is None else f"{r[f'{s}_p50']:.1f}" for s in STAGES)
        print(f"| {LABELS.get(r['model'], r['model'])} | {r['concurrency']} | {r['req_per_s']:.1f} | {r['tok_per_s']:.0f} | "
              f"{r['ttft_p50_ms']:.1f} / {r['ttft_p90_ms']:.1f} / {r['ttft_p99_ms']:.1f} | "
              f"{r['latency_p50_ms']:.1f} / {r['latency_p90_ms']:.1f} | {stages} | {r['responses_per_request']:.1f} | {r['errors']} |")


async def bench(url: str, models: list[str], levels: list[int], count: int, images: int, sizes, max_tokens: int,
                warmup: int, label: str | None = None) -> list[dict]:
    """Rows for ``models`` of the server at ``url`` (``label``: the name rows carry instead of the model's)."""
    from tqdm import tqdm

    rows = []
    total = len(models) * (len(levels) * count + warmup)
    with tqdm(total=total, desc=f"requests ({label or ','.join(models)})", unit="req") as progress:
        for model in models:
            await run_level(url, model, 2, [make_request(10**6 + i, images, sizes, max_tokens) for i in range(warmup)], progress)
            for level in levels:
                requests = [make_request(i, images, sizes, max_tokens) for i in range(count)]
                samples, errors, wall = await run_level(url, model, level, requests, progress)
                rows.append(summarise(label or model, level, samples, errors, wall))
    return rows


def bench_isolated(topology_path: Path, models: list[str], compile_engines: bool, run,
                   stream_interval_ms: float | None = None) -> list[dict]:
    """One server per deployment, rendered from ``topology_path``, started and stopped in turn."""
    import tempfile

    from backend.topology import load, render
    from clients.local_server import ROOT, TritonServer

    base, rows = load(topology_path), []
    for model in models:
        changes = {} if stream_interval_ms is None else {"stream_interval_ms": stream_interval_ms}
        topology = base.only(DEPLOYMENT_OF[model], {"enforce_eager": False} if compile_engines else None, **changes)
        with tempfile.TemporaryDirectory(prefix=f"bench-{model}-") as repo:
            served = render(topology, Path(repo))
            target = "llm" if "llm" in served else "epd"
            with TritonServer(Path(repo), log_path=ROOT / ".cache" / f"bench-e2e-{model}.log") as server:
                print(f"{LABELS[model]}: server ready in {server.ready_seconds:.1f} s ({', '.join(served)})")
                rows += run(server.grpc_url, [target], model)
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="llm,epd,epd_disagg")
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument("--requests", type=int, default=200, help="requests per model and concurrency")
    parser.add_argument("--images", type=int, default=1, help="images per request")
    parser.add_argument("--image-sizes", default="64x48,80x64,96x96,112x112")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--url", help="host:port of a running server's gRPC endpoint (default: start servers)")
    parser.add_argument("--shared", action="store_true", help="one server on the committed repository for all models")
    parser.add_argument("--topology", type=Path, default=Path(__file__).resolve().parent.parent / "topologies" / "default.yaml",
                        help="topology the per-deployment servers are rendered from")
    parser.add_argument("--compile", action="store_true", help="engines with torch.compile (enforce_eager: false)")
    parser.add_argument("--stream-interval-ms", type=float, help="the topology's stream_interval_ms for the servers started here")
    parser.add_argument("--json", type=Path, help="write the rows here too")
    args = parser.parse_args(argv)
    sizes = [tuple(int(v) for v in s.split("x")) for s in args.image_sizes.split(",")]
    models, levels = args.models.split(","), [int(c) for c in args.concurrency.split(",")]
    def run(url, names=models, label=None):
        return asyncio.run(bench(url, names, levels, args.requests, args.images, sizes, args.max_tokens, args.warmup, label))

    if args.url:
        rows = run(args.url)
    elif not args.shared:
        rows = bench_isolated(args.topology, models, args.compile, run, args.stream_interval_ms)
    else:
        from clients.local_server import ROOT, TritonServer

        with TritonServer(log_path=ROOT / ".cache" / "bench-e2e-server.log") as server:
            print(f"server ready in {server.ready_seconds:.1f} s")
            rows = run(server.grpc_url)
    servers = "given server" if args.url else "one shared server" if args.shared else "one server per deployment"
    print(f"\n{args.requests} streaming requests per row, {args.images} image(s) of {args.image_sizes}, "
          f"{args.max_tokens} greedy tokens (ignore_eos); {servers}; engines "
          f"{'compiled' if args.compile and not args.url else 'as configured'}"
          + (f"; stream_interval_ms {args.stream_interval_ms:g}" if args.stream_interval_ms is not None else "") + "\n")
    print_table(rows)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return rows


if __name__ == "__main__":
    main()
