"""A client on a host of its own: the multi-host tests run this in a network namespace (``tests.netns``), so requests
reach the servers over the namespaces' veth addresses, as a client on another machine would.

    python -m tests.hosts_client ready URL [URL ...] --timeout 300       # wait until each server is ready
    python -m tests.hosts_client ask cases.json out.json [--concurrency N]

A case is a JSON object: ``url`` (a server's gRPC ``host:port``), ``model``, and ``clients.triton_client.GenerateInputs``
fields (``images``: base64), optional ``delay`` (seconds after the start before it is sent); each result is
{text, finish_reason, num_input_tokens, num_output_tokens, timings, ttft, total, chunks} or {error: {status,
message}}, in the cases' order. Exit status 0 even where requests failed (the test reads the results).
"""
from __future__ import annotations

import argparse
import base64
import json
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from clients.triton_client import GenerateError, GenerateInputs, generate


def ready(urls: list[str], timeout: float) -> int:
    """Wait until every ``urls`` (HTTP base URLs) answers ready; 1 (naming the ones that did not) after ``timeout``."""
    deadline, waiting = time.monotonic() + timeout, list(urls)
    while waiting and time.monotonic() < deadline:
        for url in list(waiting):
            try:
                if urllib.request.urlopen(f"{url}/v2/health/ready", timeout=2).status == 200:
                    waiting.remove(url)
            except OSError:
                pass
        if waiting:
            time.sleep(0.5)
    if waiting:
        print(f"not ready after {timeout:.0f} s: {', '.join(waiting)}", file=sys.stderr)
        return 1
    return 0


def ask_one(case: dict, started: float) -> dict:
    case = dict(case)
    url, model, delay = case.pop("url"), case.pop("model"), case.pop("delay", 0.0)
    case["images"] = [base64.b64decode(i) for i in case.get("images", [])]
    time.sleep(max(0.0, started + delay - time.monotonic()))
    try:
        result = generate(url, model, GenerateInputs(**case), protocol="grpc", timeout=180)
    except GenerateError as exc:
        return {"error": {"status": exc.status, "message": exc.message}, "sent": round(time.monotonic() - started, 3)}
    return {"text": result.text, "finish_reason": result.finish_reason, "num_input_tokens": result.num_input_tokens,
            "num_output_tokens": result.num_output_tokens, "timings": result.timings, "ttft": result.ttft,
            "total": result.total, "chunks": len(result.chunks), "sent": round(time.monotonic() - started, 3)}


def ask(cases_path: Path, out_path: Path, concurrency: int) -> int:
    cases = json.loads(cases_path.read_text())
    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
        results = list(pool.map(lambda case: ask_one(case, started), cases))
    out_path.write_text(json.dumps(results))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    wait = sub.add_parser("ready")
    wait.add_argument("urls", nargs="+")
    wait.add_argument("--timeout", type=float, default=300.0)
    run = sub.add_parser("ask")
    run.add_argument("cases", type=Path)
    run.add_argument("out", type=Path)
    run.add_argument("--concurrency", type=int, default=1)
    args = parser.parse_args(argv)
    if args.command == "ready":
        return ready(args.urls, args.timeout)
    return ask(args.cases, args.out, args.concurrency)


if __name__ == "__main__":
    sys.exit(main())
