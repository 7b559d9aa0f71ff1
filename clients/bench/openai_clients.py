"""The comparison users make: one OpenAI client (vLLM's ``vllm bench serve --backend openai-chat``), the same requests
(``random-mm``: synthetic images, fixed seed), against this project's ``llm``, ``epd`` and ``epd_disagg`` through the
OpenAI-compatible endpoint (``frontend.openai``) and against vLLM's own ``vllm serve`` of the same checkpoint with the
same engine arguments, one after the other on this machine; one table.

    .venv/bin/python -m clients.bench.openai_clients --num-prompts 100 --max-concurrency 8

Started here: tritonserver with the committed repository, the endpoint, and ``vllm serve`` (each on free 127.0.0.1
ports; ``vllm serve`` only while its rows run, so it and tritonserver's engines do not share the CPU).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from backend.deploy.local_server import ROOT

VLLM = ROOT / ".venv" / "bin" / "vllm"
METRICS = [("request_throughput", "req/s", 2), ("output_throughput", "out tok/s", 1), ("median_ttft_ms", "TTFT p50 ms", 1),
           ("p99_ttft_ms", "TTFT p99 ms", 1), ("median_tpot_ms", "TPOT p50 ms", 2), ("median_itl_ms", "ITL p50 ms", 2),
           ("completed", "completed", 0)]


def vllm_serve_argv(port: int, served_name: str = "vllm-serve") -> list[str]:
    """``vllm serve`` of the default topology's checkpoint with its engine arguments (what ``llm`` runs)."""
    from backend.deploy.topology import load

    topology = load(ROOT / "topologies" / "default.yaml")
    argv = [str(VLLM), "serve", str(topology.checkpoint), "--host", "127.0.0.1", "--port", str(port),
            "--served-model-name", served_name, "--limit-mm-per-prompt", json.dumps({"image": 4, "video": 0})]
    for key, value in topology.engine_args.items():
        flag = "--" + key.replace("_", "-")
        argv += [flag] if value is True else [] if value is False else [flag, str(value)]
    return argv


def bench_argv(base_url: str, model: str, tokenizer: Path, args, out: Path) -> list[str]:
    return [str(VLLM), "bench", "serve", "--backend", "openai-chat", "--base-url", base_url, "--endpoint",
            "/v1/chat/completions", "--model", model, "--tokenizer", str(tokenizer), "--dataset-name", "random-mm",
            "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len), "--ignore-eos",
            "--random-mm-base-items-per-request", str(args.images), "--random-mm-limit-mm-per-prompt",
            json.dumps({"image": args.images, "video": 0}), "--random-mm-bucket-config",
            json.dumps({f"({args.image_size}, {args.image_size}, 1)": 1.0}).replace('"(', "(").replace(')"', ")"),
            "--num-prompts", str(args.num_prompts), "--max-concurrency", str(args.max_concurrency), "--seed", "0",
            "--temperature", "0", "--save-result", "--result-dir", str(out.parent), "--result-filename", out.name]


def wait_healthy(url: str, timeout: float) -> None:
    """Poll ``url`` until it answers 200 (the endpoint's ``/health``: every model of the repository ready)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if urllib.request.urlopen(url, timeout=2).status == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} not healthy after {timeout:.0f} s")


@contextlib.contextmanager
def openai_endpoint(log_path: Path):
    """tritonserver with the committed repository and ``frontend.openai`` in front of it, both on free 127.0.0.1 ports,
    as users start them; yields the endpoint's base URL once ``/health`` is 200, stops both on exit."""
    from backend.deploy.local_server import TritonServer, start_openai_process
    from backend.deploy.ports import free_ports

    with TritonServer(log_path=log_path) as server:
        (port,) = free_ports(1)
        endpoint = start_openai_process(port, server.grpc_url)
        try:
            wait_healthy(f"http://127.0.0.1:{port}/health", 120)
            yield f"http://127.0.0.1:{port}"
        finally:
            endpoint.terminate()
            endpoint.wait(timeout=30)


def run(target: str, base_url: str, model: str, args, workdir: Path) -> dict:
    out = workdir / f"{target}.json"
    done = subprocess.run(bench_argv(base_url, model, ROOT / "models" / "tiny-qwen2-vl", args, out), cwd=ROOT,
                          capture_output=True, text=True, timeout=3600)
    if done.returncode != 0 or not out.exists():
        raise RuntimeError(f"vllm bench serve against {target} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    result = json.loads(out.read_text())
    print(f"{target}: {result['request_throughput']:.2f} req/s, TTFT p50 {result['median_ttft_ms']:.1f} ms",
          file=sys.stderr, flush=True)
    return {"target": target, **{k: result.get(k) for k, _, _ in METRICS}, "failed": result.get("failed", 0)}


def table(rows: list[dict]) -> str:
    head = "| target | " + " | ".join(label for _, label, _ in METRICS) + " | failed |"
    lines = [head, "|" + "---|" * (len(METRICS) + 2)]
    for r in rows:
        cells = [f"{r[k]:.{d}f}" if isinstance(r[k], float) else str(r[k]) for k, _, d in METRICS]
        lines.append(f"| {r['target']} | " + " | ".join(cells) + f" | {r['failed']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--targets", default="llm,epd,epd_disagg,vllm-serve")
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--max-concurrency", type=int, default=8)
    parser.add_argument("--images", type=int, default=1)
    parser.add_argument("--image-size", type=int, default=96)
    parser.add_argument("--input-len", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--out", type=Path, help="keep vllm bench serve's result files here")
    args = parser.parse_args(argv)
    from backend.deploy.ports import free_ports

    targets = args.targets.split(",")
    workdir = args.out or Path(tempfile.mkdtemp(prefix="bench-openai-clients-"))
    workdir.mkdir(parents=True, exist_ok=True)
    rows = []
    ours = [t for t in targets if t != "vllm-serve"]
    if ours:
        with openai_endpoint(ROOT / ".cache" / "bench-openai-clients-server.log") as base_url:
            rows += [run(t, base_url, t, args, workdir) for t in ours]
    if "vllm-serve" in targets:
        (port,) = free_ports(1)
        log = open(ROOT / ".cache" / "bench-openai-clients-vllm-serve.log", "w")
        proc = subprocess.Popen(vllm_serve_argv(port), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "VLLM_PLUGINS": ""}, start_new_session=True)
        try:
            wait_healthy(f"http://127.0.0.1:{port}/health", 600)
            rows.append(run("vllm-serve", f"http://127.0.0.1:{port}", "vllm-serve", args, workdir))
        finally:
            os.killpg(proc.pid, 15)
            proc.wait(timeout=60)
    print(f"\nvllm bench serve --backend openai-chat, random-mm: {args.num_prompts} prompts, concurrency "
          f"{args.max_concurrency}, {args.images} {args.image_size}x{args.image_size} image(s) per request, "
          f"{args.input_len} input / {args.output_len} output tokens (ignore_eos), seed 0; results in {workdir}\n")
    print(table(rows))
    return rows


if __name__ == "__main__":
    main()
