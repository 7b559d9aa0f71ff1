"""Soak: many mixed requests against one deployment, some clients cancelling, and what is left afterwards.

Requests (seeded): text-only or 1-4 synthetic images of 48..160 px, streaming or not, 8-24 greedy tokens;
``--cancel-fraction`` of the streaming ones are cancelled by their client after the first chunk (``--cancel-via``:
in band by default; a gRPC stream cancel can deadlock or crash Triton 2.51's gRPC frontend). Every
request must end (a response, an error, or the client's own cancel) within ``--timeout`` seconds, else it
counts as hung. Reported: completions, cancels, errors by code (the clients ask the server to put the code
in front of error messages), hung requests, latency p50/p99, and before/after (after a short settle) the
RSS of every server process, the encoder pool's open leases and the ``/dev/shm`` entries.

    python -m clients.tools.soak --requests 2000 --concurrency 16 --deployment E/P/D
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import tempfile
import time
import urllib.request
import uuid
from collections import Counter
from pathlib import Path

from backend.protocol.generate import GenerateInputs
from clients.bench.report import percentile
from clients.triton_client import cancel_in_band, grpc_inputs, single_request_stream

ERROR_CODES = {"epd_error_codes": True}


def request_mix(rng: random.Random) -> tuple[list[tuple[int, int]], int]:
    """The soak's mix: the sizes of 0-4 images (48..160 px a side; one image most often) and 8-24 tokens."""
    count = rng.choice([0, 1, 1, 2, 3, 4])
    return [(rng.randint(48, 160), rng.randint(48, 160)) for _ in range(count)], rng.randint(8, 24)


def make_request(rng: random.Random, seed: int) -> GenerateInputs:
    from clients.images import image_bytes

    sizes, max_tokens = request_mix(rng)
    images = [image_bytes(w, h, seed=seed * 5 + i) for i, (w, h) in enumerate(sizes)]
    placeholders = "<|vision_start|><|image_pad|><|vision_end|>" * len(sizes)
    return GenerateInputs(prompt=f"{placeholders}Request {seed}: describe.", images=images, stream=rng.random() < 0.5,
                          sampling={"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True})


async def one(url: str, model: str, inputs: GenerateInputs, cancel: str | None, timeout: float) -> tuple[str, float]:
    """Outcome ('ok', 'cancelled', 'hung' or the error code) and seconds. ``cancel``: None, or how the client
    cancels after the first response: "grpc" cancels the stream, "request" cancels in band
    (``clients.triton_client.cancel_in_band``) and reads the stream to its end."""
    import tritonclient.grpc.aio as aio

    client = aio.InferenceServerClient(url)
    request_id = uuid.uuid4().hex
    request = {"model_name": model, "inputs": grpc_inputs(inputs.as_values()), "parameters": ERROR_CODES,
               "request_id": request_id}
    started = time.perf_counter()
    try:
        async with single_request_stream(client, request) as stream:
            async def cancel_stream() -> bool:
                stream.cancel()
                return True  # the outcome is decided: nothing more comes

            async def cancel_request() -> bool:
                await cancel_in_band(client, model, request_id, ERROR_CODES)
                stream.done_writing()  # then the stream ends once the server has stopped the request
                return False

            cancelling = {None: None, "grpc": cancel_stream, "request": cancel_request}[cancel]
            return await _outcome(stream, cancelling, timeout, started)
    finally:
        await client.close()


async def _outcome(stream, cancel, timeout: float, started: float) -> tuple[str, float]:
    """``cancel``: None, or what cancels after the first response (True: the request ends there)."""
    cancelled = False
    try:
        async with asyncio.timeout(timeout):
            async for result, error in stream:
                if error is not None:
                    match = re.match(r"\[([A-Z_]+)\]", error.message())
                    return (match.group(1) if match else "UNTAGGED"), time.perf_counter() - started
                if cancel is not None and not cancelled:
                    cancelled = True
                    if await cancel():
                        return "cancelled", time.perf_counter() - started
                    continue
                finish = result.as_numpy("finish_reason")
                if finish is not None and finish.size and finish.reshape(-1)[0]:
                    return ("cancelled" if cancelled else "ok"), time.perf_counter() - started
        return ("cancelled" if cancelled else "ENDED_WITHOUT_FINAL"), time.perf_counter() - started
    except TimeoutError:
        stream.cancel()
        return "hung", time.perf_counter() - started


async def drive(url: str, model: str, count: int, concurrency: int, cancel_fraction: float, timeout: float, seed: int,
                cancel_via: str = "request"):
    from tqdm import tqdm

    rng = random.Random(seed)
    requests = [make_request(rng, i) for i in range(count)]
    jobs = [(inputs, cancel_via if inputs.stream and rng.random() < cancel_fraction * 2 else None)  # half stream
            for inputs in requests]
    queue: asyncio.Queue = asyncio.Queue()
    for job in jobs:
        queue.put_nowait(job)
    outcomes: Counter = Counter()
    latencies: list[float] = []
    with tqdm(total=count, desc="soak", unit="req") as progress:
        async def worker():
            while not queue.empty():
                inputs, cancel = queue.get_nowait()
                outcome, seconds = await one(url, model, inputs, cancel, timeout)
                outcomes[outcome] += 1
                if outcome == "ok":
                    latencies.append(seconds * 1000)
                progress.update(1)
        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return outcomes, latencies, time.perf_counter() - started


def snapshot(server) -> dict:
    import psutil

    root = psutil.Process(server.proc.pid)
    rss = {}
    for proc in [root] + root.children(recursive=True):
        try:
            cmd = proc.cmdline()
            name = next((part.split("/")[-3] for part in cmd if part.endswith("/1/model.py")), None) or proc.name()
            rss[f"{name}:{proc.pid}"] = proc.memory_info().rss
        except psutil.Error:
            pass
    metrics = urllib.request.urlopen(server.metrics_url, timeout=5).read().decode()
    leases = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines() if line.startswith("epd_pool_leases{"))
    return {"rss": rss, "leases": leases, "shm": sorted(os.listdir("/dev/shm"))}


def report(outcomes: Counter, latencies: list[float], wall: float, before: dict, after: dict, rss_rounds: list[dict]) -> None:
    total = sum(outcomes.values())
    errors = {k: v for k, v in outcomes.items() if k not in ("ok", "cancelled")}
    print(f"\n{total} requests in {wall:.1f} s ({total / wall:.1f} req/s): ok {outcomes['ok']}, "
          f"cancelled by their clients {outcomes['cancelled']}, errors {sum(errors.values())} {dict(errors) or ''}")
    print(f"latency of completed requests: p50 {percentile(latencies, 50):.0f} ms, p99 {percentile(latencies, 99):.0f} ms")
    print(f"open leases: {before['leases']:.0f} before, {after['leases']:.0f} after; /dev/shm entries: "
          f"{len(before['shm'])} before, {len(after['shm'])} after (new: {sorted(set(after['shm']) - set(before['shm']))})")
    rounds = " | ".join(f"after round {i + 1}" for i in range(len(rss_rounds)))
    print(f"| process | RSS before MiB | {rounds} |\n|---|---|{'---|' * len(rss_rounds)}")
    fmt = lambda v: "-" if v is None else f"{v / 2**20:.0f}"
    for name in sorted(set(before["rss"]) | set(after["rss"])):
        print(f"| {name} | {fmt(before['rss'].get(name))} | " + " | ".join(fmt(r.get(name)) for r in rss_rounds) + " |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--deployment", default="E/P/D", choices=("baseline", "E+PD", "E/P/D"))
    parser.add_argument("--cancel-fraction", type=float, default=0.1, help="of all requests (all streaming)")
    parser.add_argument("--cancel-via", choices=("grpc", "request"), default="request",
                        help="how clients cancel: in band (a request naming the request's id; the default) or by "
                             "cancelling the gRPC stream, which can deadlock or crash Triton 2.51 (docs/results/robustness.md)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds before a request counts as hung")
    parser.add_argument("--warmup", type=int, default=32)
    parser.add_argument("--settle", type=float, default=5.0, help="seconds to wait before the after-snapshot")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=1, help="repeat the load; RSS after each round tells growth from a leak")
    parser.add_argument("--topology", type=Path, default=Path(__file__).resolve().parents[2] / "topologies" / "default.yaml")
    args = parser.parse_args(argv)

    from backend.deploy.local_server import ROOT, TritonServer
    from backend.deploy.render import render
    from backend.deploy.topology import load

    with tempfile.TemporaryDirectory(prefix="soak-") as repo:
        served = render(load(args.topology).only(args.deployment), Path(repo))
        model = "llm" if "llm" in served else "epd"
        (ROOT / ".cache").mkdir(exist_ok=True)
        with TritonServer(Path(repo), log_path=ROOT / ".cache" / "soak-server.log") as server:
            print(f"{args.deployment}: server ready in {server.ready_seconds:.1f} s ({', '.join(served)}); "
                  f"clients cancel via {args.cancel_via}")
            asyncio.run(drive(server.grpc_url, model, args.warmup, 4, 0.0, args.timeout, seed=10**6))
            time.sleep(args.settle)
            before = snapshot(server)
            outcomes, latencies, wall, rss_rounds = Counter(), [], 0.0, []
            for round_ in range(args.rounds):
                counts, times, seconds = asyncio.run(drive(server.grpc_url, model, args.requests, args.concurrency,
                                                           args.cancel_fraction, args.timeout, args.seed + round_,
                                                           args.cancel_via))
                outcomes.update(counts)
                latencies += times
                wall += seconds
                time.sleep(args.settle)
                after = snapshot(server)
                rss_rounds.append(after["rss"])
        report(outcomes, latencies, wall, before, after, rss_rounds)
        print(f"stragglers after stop: {server.stragglers or 'none'}")
        stopped = set(os.listdir("/dev/shm"))
        print(f"server stopped in {server.stop_seconds:.1f} s; /dev/shm after the stop: {len(stopped)} entries "
              f"(new since before the load: {sorted(stopped - set(before['shm'])) or 'none'}); stub regions the "
              f"server left behind (removed by the launcher): {server.leftover_shm or 'none'}")
    return 0 if set(outcomes) <= {"ok", "cancelled"} else 1


if __name__ == "__main__":
    raise SystemExit(main())
