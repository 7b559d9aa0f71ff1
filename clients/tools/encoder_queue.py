"""The encoder's time in Triton's queue, with and without the priority queue (docs/results/epd.md, "The encoder's
queue"): one server of ``--topology``'s E+PD (orchestrator colocated) rendered twice, once as is and once with an
``admission`` block (``priority_levels``: Triton's batcher then has priority levels and a queue policy), each given
``--bursts`` bursts of ``--requests`` chat requests sent at once, one new 1280x720 screenshot each, 2 s apart; per
burst, the encoder model's queue and compute time (Triton's statistics, ms summed over the burst's requests).

    python -m clients.tools.encoder_queue --bursts 12

Triton 2.51's dynamic batcher cannot prefetch through priority levels or a queue policy, and a request queued while
the instance is busy then waited up to the batcher's 500 ms idle wait (``backend.deploy.render._encoder_batching``).
"""
from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from backend.deploy.local_server import ROOT, TritonServer
from backend.deploy.render import render
from backend.deploy.topology import load
from backend.protocol.generate import GenerateInputs
from clients.images import screenshot_bytes
from clients.triton_client import generate


def encoder_stats(client) -> dict[str, float]:
    """The encoder model's inference statistics: ms summed over its requests, per phase (queue, compute_infer)."""
    stats = client.get_inference_statistics("encoder", as_json=True)["model_stats"][0]["inference_stats"]
    return {phase: int(stats.get(phase, {}).get("ns", 0)) / 1e6 for phase in ("queue", "compute_infer")}


def bursts(url: str, count: int, requests: int, seed: int) -> list[dict[str, float]]:
    """``count`` bursts of ``requests`` concurrent one-screenshot requests to ``epd``; each burst's encoder phases."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(url)

    def ask(i: int) -> None:
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": f"Step {i}."}]}]
        generate(url, "epd", GenerateInputs(messages=messages, images=[screenshot_bytes(1280, 720, seed + i)],
                                            sampling={"max_tokens": 8, "temperature": 0, "ignore_eos": True}))

    out = []
    for burst in range(count):
        before = encoder_stats(client)
        with ThreadPoolExecutor(requests) as pool:
            list(pool.map(ask, range(burst * requests, (burst + 1) * requests)))
        after = encoder_stats(client)
        out.append({phase: round(after[phase] - before[phase], 1) for phase in after})
        time.sleep(2)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--topology", type=Path, default=ROOT / "topologies" / "cpu-reuse.yaml")
    parser.add_argument("--bursts", type=int, default=12)
    parser.add_argument("--requests", type=int, default=4, help="requests per burst, sent at once")
    args = parser.parse_args(argv)
    topology = load(args.topology, "cpu").with_orchestrator("colocated", "E+PD").only("E+PD")
    variants = {"single queue": dataclasses.replace(topology, admission={}),
                "priority queue": dataclasses.replace(topology, admission={"priority_levels": 4})}
    for seed, (name, variant) in enumerate(variants.items()):
        with tempfile.TemporaryDirectory(prefix="encoder-queue-") as repo:
            render(variant, Path(repo))
            with TritonServer(Path(repo), log_path=Path(repo) / "server.log") as server:
                rows = bursts(server.grpc_url, args.bursts, args.requests, 10_000 * (seed + 1))
        queue = [row["queue"] for row in rows]
        print(f"{name}: encoder queue ms per burst {queue}; bursts over 400 ms: {sum(q > 400 for q in queue)} "
              f"of {len(queue)}; compute ms per burst, median {sorted(r['compute_infer'] for r in rows)[len(rows) // 2]}",
              flush=True)


if __name__ == "__main__":
    main()
