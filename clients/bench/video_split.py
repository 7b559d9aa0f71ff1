"""TTFT of a long video through E+PD with one encoder instance against two with ``video_split: 2``: for each, start
tritonserver with the topology's E+PD alone, send one warm-up request and then ``--requests`` requests one at a time,
each a fresh clip (no encoder cache hit) that the qwen2_vl loader samples to 64 frames (32 s at 10 fps: 2 fps sampled,
32 temporal patches), and print TTFT, encode time and the encoder instances seen per request, as p50.

    python -m clients.bench.video_split [--topology topologies/default.yaml] [--requests 6] [--size 224]
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
from pathlib import Path

from backend.deploy.local_server import ROOT, TritonServer
from backend.deploy.render import render
from backend.deploy.schema import Topology
from backend.deploy.topology import load
from backend.protocol.generate import GenerateInputs
from clients.triton_client import generate
from clients.videos import make_video

PROMPT = "<|vision_start|><|video_pad|><|vision_end|>Describe."
FRAMES, FPS = 320, 10.0  # 32 s: the qwen2_vl loader samples 2 fps, 64 frames


def split_topology(topology: Topology, modes: tuple[str, ...], encoders: int, split: int) -> Topology:
    """``topology`` serving ``modes`` alone, with ``encoders`` encoder instances and ``video_split: split``."""
    served = topology.only(modes, video_split=split)
    return dataclasses.replace(served, stages={**served.stages, "encoder": dataclasses.replace(
        served.stages["encoder"], instances=encoders)})


def measure(topology: Topology, requests: int, size: int, seed: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="epd-video-split-") as tmp:
        repo = Path(tmp) / "repo"
        render(topology, repo)
        with TritonServer(repo, log_path=Path(tmp) / "server.log") as server:
            results = [generate(server.grpc_url, "epd", GenerateInputs(
                prompt=PROMPT, videos=[make_video(size, size, frames=FRAMES, fps=FPS, seed=seed + i)],
                sampling={"max_tokens": 4, "temperature": 0}), timeout=300) for i in range(requests + 1)]
    results = results[1:]  # the first: warm-up
    return {"ttft_ms": statistics.median(r.ttft * 1000 for r in results),
            "encode_ms": statistics.median(r.timings["encode_ms"] for r in results),
            "encoders": [len(r.timings["encoders"]) for r in results],
            "input_tokens": results[0].num_input_tokens}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--topology", type=Path, default=ROOT / "topologies" / "default.yaml")
    parser.add_argument("--requests", type=int, default=6)
    parser.add_argument("--size", type=int, default=224, help="frame width and height")
    args = parser.parse_args(argv)
    topology = load(args.topology)
    rows = {}
    for encoders, split in ((1, 1), (2, 2)):
        rows[f"{encoders} encoder(s), video_split {split}"] = measure(
            split_topology(topology, ("E+PD",), encoders, split), args.requests, args.size, seed=1000)
        print(rows, flush=True)
    print(f"\n{args.requests} requests of a {FRAMES}-frame {args.size}x{args.size} clip at {FPS:g} fps (64 frames "
          f"sampled), one at a time, p50:\n")
    print("| deployment | TTFT ms | encode ms | encoder instances per request | input tokens |\n|---|---|---|---|---|")
    for name, row in rows.items():
        print(f"| {name} | {row['ttft_ms']:.1f} | {row['encode_ms']:.1f} | {row['encoders']} | {row['input_tokens']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
