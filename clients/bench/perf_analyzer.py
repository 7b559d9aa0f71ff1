"""perf_analyzer for the generating models: real-image ``--input-data`` JSON, a gRPC streaming run, the figures.

``make-inputs`` writes perf_analyzer's input-data JSON for the shared Triton interface: each entry a prompt
(from ``--prompts``, a text file with one prompt per line, or a built-in set), ``--images`` real PNG images
of ``--image-sizes`` (synthetic pictures, or the files of ``--image-dir``) in the ``image`` tensor, greedy
sampling with ``--max-tokens`` tokens (ignore_eos) and ``stream: true``. BYTES tensors go in as ``b64`` of
Triton's serialized form (a 4-byte little-endian length before each element).

``run`` makes the inputs, runs the ``perf_analyzer`` of the venv (tritonclient 2.51, gRPC streaming,
concurrency sweep) against a model of a running server, and prints and saves its CSV report::

    python -m clients.bench.perf_analyzer run --url 127.0.0.1:8001 --model epd --concurrency 1,4,16 --images 1
    python -m clients.bench.perf_analyzer make-inputs --out inputs.json --images 2 --image-sizes 64x48,112x112

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

from backend.deploy.local_server import ROOT, TritonServer, VENV

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
        values = {"text_input": prompts[i % len(prompts)], "sampling_parameters": sampling, "stream": True}
        if images:
            values["image"] = load_images(images, sizes, image_dir, i)
        data.append(input_entry(values))
    return {"data": data}


def input_entry(values: dict) -> dict:
    """One perf_analyzer input-data entry for the shared interface's values (``GenerateInputs.as_values``)."""
    entry = {}
    for name, value in values.items():
        if isinstance(value, list):  # BYTES elements (images, layouts): Triton's serialized form as b64
            entry[name] = {"b64": serialized_bytes([v if isinstance(v, bytes) else v.encode() for v in value]),
                           "shape": [len(value)]}
        else:
            entry[name] = {"content": [value], "shape": [1]}
    return entry


def load_level(url: str, model: str, concurrency: int, requests: list, workdir: Path, max_tokens: int):
    """Send ``requests`` (``GenerateInputs``, each once) at ``concurrency`` with perf_analyzer as the load
    generator (C++; what genai-perf drives), reading each request's send and response times from its
    profile export: ``(samples, errors, wall seconds, CPU seconds perf_analyzer used)``. Time to first token
    is the first response with text, as ``clients.bench.load`` measures it."""
    import resource

    workdir.mkdir(parents=True, exist_ok=True)
    inputs, export = workdir / f"{model}-c{concurrency}-inputs.json", workdir / f"{model}-c{concurrency}-export.json"
    inputs.write_text(json.dumps({"data": [input_entry(r.as_values()) for r in requests]}))
    export.unlink(missing_ok=True)
    command = [*base_command(url, model, inputs, concurrency, requests[0].parameters if requests else None),
               "--request-count", str(len(requests)), "--profile-export-file", str(export)]
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    run_command(command, workdir / f"{model}-c{concurrency}.log", f"{model} at {concurrency}", export)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - used.ru_utime - used.ru_stime
    # 2.51 writes BYTES inputs into the JSON as raw bytes (not UTF-8): read it as latin-1
    sent = json.loads(export.read_bytes().decode("latin-1"))["experiments"][0]["requests"]
    samples = export_samples(sent, max_tokens)
    wall = (max(max(r["response_timestamps"]) for r in sent if r["response_timestamps"])
            - min(r["timestamp"] for r in sent)) / 1e9 if samples else 0.0
    return samples, len(requests) - len(samples), wall, cpu


def export_samples(requests: list[dict], max_tokens: int) -> list:
    """``bench_report.Sample``s of the requests of a perf_analyzer profile export (timestamps in ns); a
    request without a final response (``finish_reason``) is not a sample."""
    from clients.bench.report import Sample

    samples = []
    for request in requests:
        times, outputs = request.get("response_timestamps") or [], request.get("response_outputs") or []
        if not times or len(outputs) != len(times) or not outputs[-1].get("finish_reason"):
            continue
        sent = request["timestamp"]
        first = next((t for t, out in zip(times, outputs) if out.get("text_output")), times[-1])
        timings = outputs[-1].get("timings")
        tokens = outputs[-1].get("num_output_tokens", 0)
        if not 0 < tokens <= max_tokens:  # 2.51 misreads the counts; ignore_eos: every request makes max_tokens
            tokens = max_tokens if outputs[-1]["finish_reason"] == "length" else sum(1 for o in outputs if o.get("text_output"))
        samples.append(Sample((first - sent) / 1e9, (times[-1] - sent) / 1e9, tokens,
                              json.loads(timings.encode("latin-1")) if timings else {}, len(times)))
    return samples


def base_command(url: str, model: str, inputs: Path, concurrency: int, parameters: dict | None = None) -> list[str]:
    """perf_analyzer of the venv, gRPC streaming, ``inputs`` at one concurrency; ``parameters`` (the same for
    every request, e.g. ``{"epd_metadata_only": False}``) as ``--request-parameter``s."""
    command = [str(VENV / "bin" / "perf_analyzer"), "-m", model, "-u", url, "-i", "grpc", "--streaming",
               "--input-data", str(inputs), "--concurrency-range", f"{concurrency}:{concurrency}"]
    for name, value in (parameters or {}).items():
        kind = "bool" if isinstance(value, bool) else "int" if isinstance(value, int) else "string"
        command += ["--request-parameter", f"{name}:{str(value).lower() if kind == 'bool' else value}:{kind}"]
    return command


def perf_analyzer_command(url: str, model: str, inputs: Path, concurrency: int, report: Path,
                          window_ms: int, stability: int) -> list[str]:
    return [*base_command(url, model, inputs, concurrency), "--measurement-interval", str(window_ms),
            "-s", str(stability), "--percentile", "90", "-f", str(report), "--verbose-csv"]


def run_command(command: list[str], log: Path, what: str, output: Path) -> None:
    """Run perf_analyzer (with the libraries it looks for on ``LD_LIBRARY_PATH``), its output into ``log``;
    raises unless it succeeded and wrote ``output``."""
    env = dict(os.environ, LD_LIBRARY_PATH=f"{LIB_DIR}:{os.environ.get('LD_LIBRARY_PATH', '')}")
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    log.write_text(done.stdout + done.stderr)
    if done.returncode != 0 or not output.exists():
        raise RuntimeError(f"perf_analyzer failed ({done.returncode}) for {what}: {(done.stdout + done.stderr)[-2000:]}")


def run(args) -> list[dict]:
    sizes = [tuple(int(v) for v in s.split("x")) for s in args.image_sizes.split(",")]
    prompts = Path(args.prompts).read_text().splitlines() if args.prompts else list(PROMPTS)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    inputs = out / f"perf-inputs-{args.images}img.json"
    inputs.write_text(json.dumps(make_inputs(args.entries, args.images, sizes, prompts, args.max_tokens, args.image_dir)))
    rows: list[dict] = []

    def against(url: str) -> None:
        for model in args.model.split(","):
            for level in (int(c) for c in args.concurrency.split(",")):
                report = out / f"perf-{model}-c{level}.csv"
                command = perf_analyzer_command(url, model, inputs, level, report, args.window_ms, args.stability)
                print("$", " ".join(command), flush=True)
                report.unlink(missing_ok=True)
                run_command(command, out / f"perf-{model}-c{level}.log", model, report)
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
