"""perf_analyzer for the generating models: real-image ``--input-data`` JSON, a gRPC streaming run, the figures.

``make-inputs`` writes perf_analyzer's input-data JSON for the shared Triton interface: each entry a prompt
(from ``--prompts``, a text file with one prompt per line, or a built-in set), ``--images`` real PNG images
of ``--image-sizes`` (synthetic pictures, or the files of ``--image-dir``) in the ``image`` tensor, greedy
sampling with ``--max-tokens`` tokens (ignore_eos) and ``stream: true``. BYTES tensors go in as ``b64`` of
Triton's serialized form (a 4-byte little-endian length before each element).

``run`` makes the inputs, runs the ``perf_analyzer`` of the venv (tritonclient 2.51, gRPC streaming,
concurrency sweep) against a model of a running server, and prints and saves its CSV report::

    python -m clients.perf_analyzer run --url 127.0.0.1:8001 --model epd --concurrency 1,4,16 --images 1
    python -m clients.perf_analyzer make-inputs --out inputs.json --images 2 --image-sizes 64x48,112x112

Without ``--url``, ``run`` starts a server on the committed repository for the run and stops it after.
"""
from __future__ import annotations

import argparse
import base64
import csv
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

from clients.local_server import ROOT, VENV, TritonServer

PROMPTS = ("What is in the picture?", "Describe the image in one sentence.", "Which colours do you see?",
           "Is there any text in the image?", "What would you call this picture?")
LIB_DIR = VENV / "lib" / "triton-extra"  # libb64 / libcudart links made by scripts/post_install.py


def serialized_bytes(elements: list[bytes]) -> str:
    """Base64 of a BYTES tensor in Triton's raw form: each element as <uint32 LE length><bytes>."""
    return base64.b64encode(b"".join(struct.pack("<I", len(e)) + e for e in elements)).decode()


def load_images(count: int, sizes: list[tuple[int, int]], image_dir: Path | None, seed: int) -> list[bytes]:
    if image_dir is not None:
        files = sorted(p for p in image_dir.iterdir() if p.suffix.lower() in (".png", ".jpg", ".jpeg", ".webp"))
        if not files:
            raise SystemExit(f"{image_dir}: no .png/.jpg/.jpeg/.webp files")
        return [files[(seed + i) % len(files)].read_bytes() for i in range(count)]
    from clients.images import image_bytes

    return [image_bytes(*sizes[(seed + i) % len(sizes)], seed=seed * 7 + i) for i in range(count)]


def make_inputs(entries: int, images: int, sizes, prompts: list[str], max_tokens: int, image_dir: Path | None = None) -> dict:
    sampling = json.dumps({"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True})
    data = []
    for i in range(entries):
        entry = {"text_input": {"content": [prompts[i % len(prompts)]], "shape": [1]},
                 "sampling_parameters": {"content": [sampling], "shape": [1]},
                 "stream": {"content": [True], "shape": [1]}}
        if images:
            entry["image"] = {"b64": serialized_bytes(load_images(images, sizes, image_dir, i)), "shape": [images]}
        data.append(entry)
    return {"data": data}


def perf_analyzer_command(url: str, model: str, inputs: Path, concurrency: int, report: Path,
                          window_ms: int, stability: int) -> list[str]:
    return [str(VENV / "bin" / "perf_analyzer"), "-m", model, "-u", url, "-i", "grpc", "--streaming",
            "--input-data", str(inputs), "--concurrency-range", f"{concurrency}:{concurrency}",
            "--measurement-interval", str(window_ms), "-s", str(stability), "--percentile", "90",
            "-f", str(report), "--verbose-csv"]


def run(args) -> list[dict]:
    sizes = [tuple(int(v) for v in s.split("x")) for s in args.image_sizes.split(",")]
    prompts = Path(args.prompts).read_text().splitlines() if args.prompts else list(PROMPTS)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    inputs = out / f"perf-inputs-{args.images}img.json"
    inputs.write_text(json.dumps(make_inputs(args.entries, args.images, sizes, prompts, args.max_tokens, args.image_dir)))
    rows: list[dict] = []
    env = dict(os.environ, LD_LIBRARY_PATH=f"{LIB_DIR}:{os.environ.get('LD_LIBRARY_PATH', '')}")

    def against(url: str) -> None:
        for model in args.model.split(","):
            for level in (int(c) for c in args.concurrency.split(",")):
                report = out / f"perf-{model}-c{level}.csv"
                command = perf_analyzer_command(url, model, inputs, level, report, args.window_ms, args.stability)
                print("$", " ".join(command), flush=True)
                done = subprocess.run(command, env=env, capture_output=True, text=True)
                (out / f"perf-{model}-c{level}.log").write_text(done.stdout + done.stderr)
                if done.returncode != 0:
                    raise SystemExit(f"perf_analyzer failed ({done.returncode}) for {model}:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
                with report.open() as fh:
                    rows.extend({"model": model, **row} for row in csv.DictReader(fh))

    if args.url:
        against(args.url)
    else:
        with TritonServer(log_path=ROOT / ".cache" / "perf-analyzer-server.log") as server:
            against(server.grpc_url)
    print_rows(rows)
    return rows


def print_rows(rows: list[dict]) -> None:
    """perf_analyzer 2.51's CSV: latencies in µs, end to end (it reports no time to first token)."""
    print("| model | concurrency | requests/s | responses/s | p50 / p90 / p99 latency ms |")
    print("|---|---|---|---|---|")
    for r in rows:
        ms = lambda key: f"{float(r[key]) / 1000:.1f}"
        print(f"| {r['model']} | {r['Concurrency']} | {float(r['Inferences/Second']):.1f} | {float(r['Response Throughput']):.0f} | "
              f"{ms('p50 latency')} / {ms('p90 latency')} / {ms('p99 latency')} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("make-inputs", "run"):
        p = sub.add_parser(name)
        p.add_argument("--images", type=int, default=1, help="images per request (0: text only)")
        p.add_argument("--image-sizes", default="64x48,80x64,96x96,112x112")
        p.add_argument("--image-dir", type=Path, help="use these image files instead of synthetic ones")
        p.add_argument("--prompts", help="text file, one prompt per line (default: a built-in set)")
        p.add_argument("--entries", type=int, default=16, help="distinct requests in the input data")
        p.add_argument("--max-tokens", type=int, default=16)
    sub.choices["make-inputs"].add_argument("--out", type=Path, required=True)
    r = sub.choices["run"]
    r.add_argument("--model", default="llm,epd", help="comma-separated generating models")
    r.add_argument("--concurrency", default="1,4,16", help="comma-separated; one perf_analyzer run per value")
    r.add_argument("--url", help="host:port of a running server's gRPC endpoint (default: start one)")
    r.add_argument("--out-dir", default=str(ROOT / ".cache" / "perf_analyzer"))
    r.add_argument("--window-ms", type=int, default=3000, help="measurement interval (3000 is stable on 2 cores)")
    r.add_argument("--stability", type=int, default=50, help="stability percentage (-s)")
    args = parser.parse_args(argv)
    if args.command == "make-inputs":
        sizes = [tuple(int(v) for v in s.split("x")) for s in args.image_sizes.split(",")]
        prompts = Path(args.prompts).read_text().splitlines() if args.prompts else list(PROMPTS)
        args.out.write_text(json.dumps(make_inputs(args.entries, args.images, sizes, prompts, args.max_tokens, args.image_dir)))
        print(f"wrote {args.entries} requests to {args.out}")
        return 0
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
