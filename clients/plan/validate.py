"""The simulator against measured runs, side by side (docs/planning.md, "Checked against measured runs"): a benchmark.

    python -m clients.plan.validate --profile docs/results/data/plan-2026-12-06/profile-cpu.json \
        --levels 1,4,16 --requests 48 --out /tmp/plan-validate        # root for the hosts deployment (namespaces)

Two deployments, each started fresh: ``single``, one tritonserver serving E+PD (``topologies/cpu-e-pd.yaml``; the
client: gRPC streaming, ``clients.bench.load``), and ``hosts``, ``topologies/hosts-e-pd.yaml`` with ``--pd-replicas``
pd hosts, every host a network namespace of this machine with its own tritonserver (``tests.hosts_deploy``, as
``clients.bench.replicas`` starts it; the client: HTTP from a host of its own; embeddings over NIXL/UCX TCP). At each
closed-loop concurrency of ``--levels`` the same one-image requests (``--image-sizes`` in turn, ``--max-tokens`` greedy
tokens, ignore_eos) are measured, and the simulator predicts the same workload on the same layout with the profile.
Printed: one table, measured and predicted req/s, TTFT p50 and p90, and the error of each (predicted / measured - 1).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
from pathlib import Path

from clients.bench.load import run_concurrency, synthetic_requests
from clients.bench.replicas import WORKERS, _sizes, check, closed_loop
from clients.bench.report import summarise
from clients.plan import profile as profiles
from clients.plan.simulate import Layout, simulate
from clients.plan.workload import parse

FIGURES = ("req_per_s", "ttft_p50_ms", "ttft_p90_ms")
TOLERANCE = 0.15


class _Quiet:
    def update(self, n: int) -> None:
        pass


def workload(level: int, requests: int, sizes: list[tuple[int, int]], max_tokens: int, text_tokens: int):
    return parse({"arrivals": {"process": "closed", "concurrency": level}, "requests": requests,
                  "mix": [{"prompt_tokens": text_tokens, "output_tokens": max_tokens,
                           "images": {"count": 1, "sizes": [list(s) for s in sizes]}}]})


def measure_single(args, levels: list[int]) -> list[dict]:
    from backend.deploy.local_server import Ports, TritonServer
    from backend.deploy.ports import free_ports
    from backend.deploy.render import render
    from backend.deploy.topology import load

    rows, seed = [], 0
    with tempfile.TemporaryDirectory(prefix="plan-validate-") as repo:
        render(load(Path(args.topology), "cpu").only("E+PD"), Path(repo))
        with TritonServer(Path(repo), ports=Ports(*free_ports(3)), log_path=Path(repo) / "tritonserver.log") as server:
            for level in levels:
                warm = synthetic_requests(args.warmup, 1, args.image_sizes, args.max_tokens, first=100_000 + seed)
                asyncio.run(run_concurrency(server.grpc_url, "epd", level, warm, _Quiet()))
                made = synthetic_requests(args.requests, 1, args.image_sizes, args.max_tokens, first=seed)
                seed += args.requests
                results, wall = asyncio.run(run_concurrency(server.grpc_url, "epd", level, made, _Quiet()))
                rows.append(summarise("single", "concurrency", level, results.samples, len(results.errors), wall))
                print(f"single c={level}: {rows[-1]['req_per_s']:.2f} req/s", flush=True)
    return rows


def measure_hosts(args, levels: list[int]) -> list[dict]:
    from tests.hosts_deploy import HostsDeployment, hosts_e_pd
    from tests.netns import Network

    rows, seed = [], 0
    with tempfile.TemporaryDirectory(prefix="plan-validate-hosts-") as tmp:
        topology = hosts_e_pd(Path(tmp), args.pd_replicas)
        with Network(HostsDeployment.addresses(topology)) as net, \
                HostsDeployment(topology, net, Path(tmp) / "hosts") as deployed:
            def submit(inputs):
                return deployed.submit("epd", inputs)
            for level in levels:
                warm = synthetic_requests(args.warmup, 1, args.image_sizes, args.max_tokens, first=100_000 + seed)
                closed_loop(submit, warm, level)
                made = synthetic_requests(args.requests, 1, args.image_sizes, args.max_tokens, first=seed)
                seed += args.requests
                outcomes, wall = closed_loop(submit, made, level)
                samples, errors = check(outcomes, None)
                rows.append(summarise("hosts", "concurrency", level, samples, len(errors), wall))
                print(f"hosts c={level}: {rows[-1]['req_per_s']:.2f} req/s", flush=True)
    return rows


def layouts(args) -> dict[str, Layout]:
    return {"single": Layout(split="E+PD"),
            "hosts": Layout(split="E+PD", pd=args.pd_replicas, transfer_path="nixl")}


def predict(profile, layout: Layout, level: int, args) -> dict:
    text = round(profile.doc.get("text_tokens", 16))
    return simulate(layout, profile, workload(level, args.requests, args.image_sizes, args.max_tokens, text))


def compare(measured: list[dict], predicted: list[dict]) -> list[dict]:
    out = []
    for m, p in zip(measured, predicted):
        row = {"topology": m["deployment"], "concurrency": int(m["level"]), "errors": m["errors"],
               "utilisation": p.get("utilisation", {})}
        for name in FIGURES:
            row[name] = {"measured": m[name], "predicted": p[name], "error": p[name] / m[name] - 1 if m[name] else None}
        out.append(row)
    return out


def table(rows: list[dict]) -> str:
    lines = ["| topology | c | req/s measured / predicted (err) | TTFT p50 ms measured / predicted (err) | "
             "TTFT p90 ms measured / predicted (err) | within 15% | predicted utilisation |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        cells = []
        for name in FIGURES:
            f = r[name]
            digits = 2 if name == "req_per_s" else 0
            cells.append(f"{f['measured']:.{digits}f} / {f['predicted']:.{digits}f} ({f['error']:+.0%})")
        within = all(r[n]["error"] is not None and abs(r[n]["error"]) <= TOLERANCE for n in FIGURES)
        busy = ", ".join(f"{k} {v:.0%}" for k, v in r["utilisation"].items())
        lines.append(f"| {r['topology']} | {r['concurrency']} | " + " | ".join(cells) +
                     f" | {'yes' if within else 'no'} | {busy} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Simulated against measured: req/s and TTFT, two deployments.")
    parser.add_argument("--profile", type=Path, required=True)
    parser.add_argument("--deployments", default="single,hosts")
    parser.add_argument("--levels", default="1,4,16", help="closed-loop concurrencies")
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--image-sizes", type=_sizes, default=_sizes("64x48,80x64,96x96,112x112"))
    parser.add_argument("--topology", default="topologies/cpu-e-pd.yaml", help="the single server's")
    parser.add_argument("--pd-replicas", type=int, default=2, help="the hosts deployment's pd hosts")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    levels = [int(v) for v in args.levels.split(",")]
    chosen = args.deployments.split(",")
    if "hosts" in chosen and (os.geteuid() != 0 or max(levels) > WORKERS):
        parser.error(f"hosts: needs root (network namespaces) and levels of at most {WORKERS}")
    profile = profiles.load(args.profile)
    rows = []
    for name in chosen:
        measured = (measure_single if name == "single" else measure_hosts)(args, levels)
        rows += compare(measured, [predict(profile, layouts(args)[name], lv, args) for lv in levels])
    text = table(rows)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "validation.json").write_text(json.dumps(rows, indent=1))
        (args.out / "validation.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
