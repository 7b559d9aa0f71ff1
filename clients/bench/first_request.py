"""What the first requests of a fresh server cost against later ones: start tritonserver with the E+PD and E/P/D
deployments of a topology, send ``--requests`` requests (a new image each) to ``epd`` and then ``epd_disagg``
one at a time, and print, per deployment, the first request's transfer, encode and TTFT beside the median of the
others (and their ratio).

    python -m clients.bench.first_request [--topology topologies/default.yaml] [--requests 8]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from backend.deploy.local_server import ROOT, TritonServer
from backend.deploy.render import render
from backend.deploy.topology import load
from backend.protocol.generate import GenerateInputs
from clients.images import image_bytes
from clients.triton_client import generate

PH = "<|vision_start|><|image_pad|><|vision_end|>"
FIGURES = (("transfer_ms", lambda r: r.timings["transfer_ms"]), ("encode_ms", lambda r: r.timings["encode_ms"]),
           ("ttft_ms", lambda r: r.ttft * 1000))


def measure(url: str, model: str, requests: int, seed: int) -> list:
    return [generate(url, model, GenerateInputs(prompt=f"{PH}Describe.", images=[image_bytes(112, 84, seed=seed + i)],
                                                sampling={"max_tokens": 4}), timeout=120) for i in range(requests)]


def table(rows: dict[str, list]) -> str:
    lines = ["| deployment | figure | first | median of the rest | first / median |", "|---|---|---|---|---|"]
    for model, results in rows.items():
        for name, value in FIGURES:
            first, rest = value(results[0]), statistics.median(value(r) for r in results[1:])
            lines.append(f"| {model} | {name} | {first:.2f} | {rest:.2f} | {first / rest:.1f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--topology", type=Path, default=ROOT / "topologies" / "default.yaml")
    parser.add_argument("--requests", type=int, default=8)
    args = parser.parse_args(argv)
    if args.requests < 2:
        parser.error("--requests: at least 2 (the first, and others to compare it with)")
    with tempfile.TemporaryDirectory(prefix="epd-first-") as tmp:
        repo = Path(tmp) / "repo"
        render(load(args.topology).only(("E+PD", "E/P/D")), repo)
        with TritonServer(repo, log_path=Path(tmp) / "server.log") as server:
            print(f"server ready in {server.ready_seconds:.1f} s", flush=True)
            rows = {model: measure(server.grpc_url, model, args.requests, 100 * index)
                    for index, model in enumerate(("epd", "epd_disagg"))}
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
