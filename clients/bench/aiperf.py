"""NVIDIA AIPerf (genai-perf's successor) against this project's OpenAI-compatible endpoint (``frontend.openai``) with
images: the same synthetic requests (noise images, synthetic prompts, fixed seed) against ``llm``, ``epd`` and
``epd_disagg`` one after the other on one tritonserver, streamed, and one table read from AIPerf's own export files.

    scripts/setup_aiperf.sh                                    # once: .venv-aiperf with the pinned AIPerf
    .venv/bin/python -m clients.bench.aiperf --requests 64 --concurrency 4 --out .cache/aiperf

Why: AIPerf is the client NVIDIA's serving stacks (Dynamo, Triton) are measured with; a run of it through the endpoint
shows the endpoint speaks what it expects (``image_url`` data URLs, SSE, ``max_completion_tokens``,
``stream_options.include_usage``) and gives its figures beside vLLM's (``clients.bench.openai_clients``). AIPerf
lives in ``.venv-aiperf`` (its pins conflict with ``.venv``'s), so it runs as a subprocess; this module never imports
it. Started here as users do: tritonserver with the committed repository and the endpoint, on free 127.0.0.1 ports
(``clients.bench.openai_clients.openai_endpoint``). Exit status 1 if AIPerf fails or reports a failed request.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from backend.deploy.local_server import ROOT

AIPERF = ROOT / ".venv-aiperf" / "bin" / "aiperf"
TOKENIZER = ROOT / "models" / "tiny-qwen2-vl"
EXPORT = "profile_export_aiperf.json"  # AIPerf's summary export in its artifact directory (no --profile-export-prefix)
# column label -> (AIPerf metric tag, statistic, decimals)
COLUMNS = {"requests": ("request_count", "avg", 0), "errors": ("error_request_count", "avg", 0),
           "req/s": ("request_throughput", "avg", 2), "TTFT p50 ms": ("time_to_first_token", "p50", 1),
           "TTFT p90 ms": ("time_to_first_token", "p90", 1), "ITL p50 ms": ("inter_token_latency", "p50", 2),
           "e2e p50 ms": ("request_latency", "p50", 1)}
# With HF_HUB_OFFLINE or TRANSFORMERS_OFFLINE set, AIPerf 0.13.0 looks a local tokenizer directory up as a hub repo id
# in the HF cache and fails (HFValidationError); without them a directory is read from disk, the hub never asked.
OFFLINE_FLAGS = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")


def aiperf_argv(base_url: str, model: str, args: argparse.Namespace, artifact_dir: Path,
                tokenizer: Path = TOKENIZER, aiperf: Path = AIPERF) -> list[str]:
    """``aiperf profile`` for one model: chat, streamed, ``args.images`` noise images of ``args.image_size`` square per
    request, ``args.input_len`` synthetic prompt tokens, ``args.output_len`` output tokens (``ignore_eos``, greedy),
    ``args.requests`` at ``args.concurrency`` after ``args.warmup`` warm-up requests; seed 0, so every model gets the
    same requests. Token counts are the server's (``usage``); AIPerf's own services stay on 127.0.0.1."""
    return [str(aiperf), "profile", "--model", model, "--url", base_url, "--endpoint-type", "chat", "--streaming",
            "--tokenizer", str(tokenizer), "--use-server-token-count",
            "--image-batch-size", str(args.images), "--image-width-mean", str(args.image_size),
            "--image-height-mean", str(args.image_size), "--image-format", args.image_format,
            "--prompt-input-tokens-mean", str(args.input_len), "--prompt-input-tokens-stddev", "0",
            "--prompt-output-tokens-mean", str(args.output_len),
            "--extra-inputs", json.dumps({"ignore_eos": True, "temperature": 0}),
            "--concurrency", str(args.concurrency), "--request-count", str(args.requests),
            "--random-seed", "0", "--request-timeout-seconds", "300",
            "--output-artifact-dir", str(artifact_dir), "--ui-type", "none", "--no-server-metrics",
            "--no-gpu-telemetry", "--zmq-host", "127.0.0.1",
            # AIPerf refuses --warmup-request-count 0 ("Input should be greater than 0"): no warm-up is no flag
            *(["--warmup-request-count", str(args.warmup)] if args.warmup > 0 else [])]


def aiperf_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment AIPerf runs in: this one without the offline flags (``OFFLINE_FLAGS``) and this checkout's
    PYTHONPATH (AIPerf's venv imports nothing of ours)."""
    env = dict(os.environ if base is None else base)
    for name in (*OFFLINE_FLAGS, "PYTHONPATH"):
        env.pop(name, None)
    return {**env, "HF_HUB_DISABLE_TELEMETRY": "1"}


def require_aiperf(aiperf: Path = AIPERF) -> None:
    """Fail before any server starts when AIPerf is not installed, naming the script that installs it."""
    if not os.access(aiperf, os.X_OK):
        raise SystemExit(f"{aiperf} not found: AIPerf lives in a venv of its own, run scripts/setup_aiperf.sh "
                         "(docs/benchmarks.md, \"AIPerf\")")


def row(model: str, export: dict) -> dict:
    """One table row from AIPerf's JSON summary export: each column's metric and statistic (``COLUMNS``); errors are
    ``error_request_count`` (absent when none failed) or, if larger, the requests in its ``error_summary``."""
    values: dict = {"model": model}
    for label, (tag, stat, _) in COLUMNS.items():
        values[label] = (export.get(tag) or {}).get(stat)
    summarised = sum(int(e.get("count", 1)) for e in export.get("error_summary") or [])
    values["errors"] = max(int(values["errors"] or 0), summarised)
    values["requests"] = int(values["requests"] or 0)
    return values


def read_export(model: str, artifact_dir: Path) -> dict:
    path = artifact_dir / EXPORT
    if not path.exists():
        raise RuntimeError(f"aiperf wrote no {EXPORT} for {model} in {artifact_dir}")
    return row(model, json.loads(path.read_text()))


def table(rows: list[dict]) -> str:
    labels = list(COLUMNS)
    lines = ["| model | " + " | ".join(labels) + " |", "|" + "---|" * (len(labels) + 1)]
    for r in rows:
        cells = ["-" if r[label] is None else f"{r[label]:.{COLUMNS[label][2]}f}" if isinstance(r[label], float)
                 else str(r[label]) for label in labels]
        lines.append(f"| {r['model']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def failures(rows: list[dict], expected: int) -> list[str]:
    """What makes the run fail: a model with failed requests or fewer completed ones than asked for."""
    found = []
    for r in rows:
        if r["errors"]:
            found.append(f"{r['model']}: {r['errors']} failed request(s)")
        if r["requests"] != expected:
            found.append(f"{r['model']}: {r['requests']} of {expected} requests completed")
    return found


def profile(base_url: str, model: str, args: argparse.Namespace, workdir: Path) -> dict:
    """Run AIPerf against one model; its console output goes to ``<workdir>/<model>/aiperf.log``."""
    artifact_dir = workdir / model
    artifact_dir.mkdir(parents=True, exist_ok=True)
    log = artifact_dir / "aiperf.log"
    print(f"aiperf profile --model {model} ...", file=sys.stderr, flush=True)
    with open(log, "w") as out:
        done = subprocess.run(aiperf_argv(base_url, model, args, artifact_dir), cwd=artifact_dir, stdout=out,
                              stderr=subprocess.STDOUT, env=aiperf_env(), timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"aiperf against {model} exited {done.returncode}; the end of {log}:\n"
                           f"{log.read_text()[-3000:]}")
    result = read_export(model, artifact_dir)
    print(f"{model}: {result['req/s']} req/s, TTFT p50 {result['TTFT p50 ms']} ms, errors {result['errors']}",
          file=sys.stderr, flush=True)
    return result


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="llm,epd,epd_disagg")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=4, help="warm-up requests per model, not counted")
    parser.add_argument("--images", type=int, default=1, help="images per request")
    parser.add_argument("--image-size", type=int, default=256, help="width and height of each image, pixels")
    parser.add_argument("--image-format", default="png", choices=["png", "jpeg"])
    parser.add_argument("--input-len", type=int, default=16, help="synthetic prompt tokens")
    parser.add_argument("--output-len", type=int, default=16, help="output tokens (ignore_eos)")
    parser.add_argument("--out", type=Path, help="keep AIPerf's artifact directories here (one per model)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    require_aiperf()
    from clients.bench.openai_clients import openai_endpoint

    workdir = (args.out or Path(tempfile.mkdtemp(prefix="bench-aiperf-"))).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    (ROOT / ".cache").mkdir(exist_ok=True)
    with openai_endpoint(ROOT / ".cache" / "bench-aiperf-server.log") as base_url:
        rows = [profile(base_url, model, args, workdir) for model in args.models.split(",")]
    version = subprocess.run([str(AIPERF), "--version"], capture_output=True, text=True, env=aiperf_env()).stdout
    print(f"\naiperf {version.strip()} profile --endpoint-type chat --streaming: {args.requests} requests, concurrency "
          f"{args.concurrency} ({args.warmup} warm-up), {args.images} {args.image_size}x{args.image_size} "
          f"{args.image_format} noise image(s) per request, {args.input_len} input / {args.output_len} output tokens "
          f"(ignore_eos), seed 0; AIPerf's exports in {workdir}\n")
    print(table(rows))
    problems = failures(rows, args.requests)
    if problems:
        raise SystemExit("aiperf reported failures: " + "; ".join(problems))
    return rows


if __name__ == "__main__":
    main()
