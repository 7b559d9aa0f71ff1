"""``python -m tests.differential --family qwen3_vl --cases 2000 --seed 7``: start the family's tritonserver (and the
OpenAI endpoint), send the seeded cases concurrently through llm, epd and epd_disagg, print every mismatch with its
replay command and a summary; exit status 1 on any mismatch or error, 0 otherwise. ``--only 12 40`` replays those
cases; ``--show`` prints the cases' shapes and stops (no server); ``--grpc-url`` (and ``--openai-url``) use a running
server instead of starting one."""
from __future__ import annotations

import argparse
import json
import sys

from tests.differential.cases import generate_all
from tests.differential.families import FAMILIES, family
from tests.differential.runner import ROUTES, Summary, Target, run


def _args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tests.differential", description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", action="append", choices=list(FAMILIES),
                        help="a family (repeat for several; default: all four, one server after the other)")
    parser.add_argument("--cases", type=int, default=50, help="cases per family (default 50)")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--only", type=int, nargs="+", help="replay these case indices only")
    parser.add_argument("--routes", default=",".join(ROUTES), help="grpc,openai (default both)")
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight (default 8)")
    parser.add_argument("--window", type=int, default=24, help="cases whose requests are mixed at once (default 24)")
    parser.add_argument("--show", action="store_true", help="print the cases (shape, and --json) and exit")
    parser.add_argument("--json", action="store_true", help="with --show: each case's full description as JSON")
    parser.add_argument("--grpc-url", help="a running server's gRPC address (one --family) instead of starting one")
    parser.add_argument("--openai-url", help="with --grpc-url: the OpenAI endpoint's base URL in front of it")
    parser.add_argument("--log-dir", help="where the server's log goes (default: a temporary directory)")
    return parser.parse_args(argv)


def _progress(summary: Summary, failures) -> None:
    for failure in failures:
        print(failure.report(), flush=True)
    print(f"[differential] {summary.line()}", flush=True)


def _one(name: str, args: argparse.Namespace, routes: tuple[str, ...]) -> Summary:
    fam = family(name)
    cases = generate_all(fam, args.seed, args.cases, args.only)
    if args.show:
        for case in cases:
            print(f"{case.index}: {case.shape()}")
            if args.json:
                print(json.dumps(case.as_dict()))
        return Summary()
    options = dict(routes=routes, concurrency=args.concurrency, window=args.window, seed=args.seed,
                   on_window=_progress)
    if args.grpc_url:
        return run(cases, Target(args.grpc_url, args.openai_url), **options)
    from pathlib import Path

    from tests.differential.servers import encoder_batching, served

    with served(fam, routes, Path(args.log_dir) / name if args.log_dir else None) as (target, server):
        summary = run(cases, target, **options)
        print(f"[differential] {encoder_batching(server)}", flush=True)
        return summary


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    routes = tuple(r for r in args.routes.split(",") if r)
    if set(routes) - set(ROUTES) or "grpc" not in routes:
        raise SystemExit(f"--routes: grpc, optionally with openai; got {args.routes!r}")
    if args.openai_url is None and args.grpc_url:
        routes = ("grpc",)
    names = args.family or list(FAMILIES)
    if args.grpc_url and len(names) != 1:
        raise SystemExit("--grpc-url goes with one --family (the one that server serves)")
    results = {name: _one(name, args, routes) for name in names}
    if args.show:
        return 0
    print("\n[differential] summary (seed %d)" % args.seed)
    for name, summary in results.items():
        print(f"  {name}: {summary.line()}")
    return 1 if any(s.failures for s in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
