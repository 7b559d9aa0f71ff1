"""Routing across pd replicas (issue 20, item 3): the multi-host E+PD of topologies/hosts-e-pd.yaml with one pd host,
then with two (pd-1, pd-2), the same requests at the same concurrency, side by side in one run.

Each deployment starts fresh (``tests.hosts_deploy.HostsDeployment``: every topology host a network namespace with its
own tritonserver, the orchestrator ``epd`` on host ``front``, the encoder on ``encode-1``); the client sends HTTP
generate requests from a client host of its own, ``--concurrency`` in flight at a time (closed loop), after
``--warmup`` requests that are not counted. Printed per deployment: requests/s, TTFT and total latency p50/p90,
errors, how the requests split over the pd replicas (the ``pd_replica`` each answer names, orchestrator.replicas),
the CPU seconds each host's processes and the client used over the measured requests, and the cores busy on the
whole machine (its cores are shared by every host: the figures that say whether a second replica had cores of its
own). Every answer must equal the first
deployment's answer to the same request (text and token count); a mismatch counts as an error. Exit status 1 on any
error. Needs root (network namespaces); nothing is bound outside them.

    python -m clients.bench.replicas [--replicas 1,2] [--requests 64] [--concurrency 16] [--max-tokens 64]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from concurrent.futures import FIRST_COMPLETED, wait
from pathlib import Path

from backend.protocol.generate import GenerateInputs
from clients.bench.load import synthetic_requests
from clients.bench.proc_cpu import _stat
from clients.bench.report import Sample, summarise
from clients.triton_client import GenerateError, GenerateResult

WORKERS = 32  # the client host's threads (tests.hosts_deploy.HostsDeployment): the most requests in flight


def _sizes(text: str) -> list[tuple[int, int]]:
    try:
        sizes = [tuple(int(v) for v in s.split("x")) for s in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or any(len(s) != 2 or min(s) < 1 for s in sizes):
        raise argparse.ArgumentTypeError(f"--image-sizes: expected WxH[,WxH...], got {text!r}")
    return sizes


def _replicas(text: str) -> list[int]:
    try:
        counts = [int(v) for v in text.split(",")]
    except ValueError:
        counts = []
    if not counts or any(not 1 <= n <= 8 for n in counts) or len(set(counts)) != len(counts):
        raise argparse.ArgumentTypeError(f"--replicas: expected distinct pd replica counts 1..8, e.g. 1,2; got {text!r}")
    return counts


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="E+PD across hosts with 1 pd replica against 2, same load, one run")
    parser.add_argument("--replicas", type=_replicas, default=[1, 2], help="pd replica counts, one deployment each")
    parser.add_argument("--requests", type=int, default=64, help="measured requests per deployment")
    parser.add_argument("--concurrency", type=int, default=16, help=f"requests in flight (at most {WORKERS})")
    parser.add_argument("--max-tokens", type=int, default=64, help="greedy tokens per answer, ignore_eos")
    parser.add_argument("--warmup", type=int, default=4, help="requests per deployment before the measured ones")
    parser.add_argument("--image-sizes", type=_sizes, default=_sizes("64x48,80x64,96x96,112x112"),
                        help="one image per request, sizes in turn: WxH,...")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args(argv)
    for flag, value in (("--requests", args.requests), ("--concurrency", args.concurrency),
                        ("--max-tokens", args.max_tokens)):
        if value < 1:
            parser.error(f"{flag}: expected 1 or more, got {value}")
    if args.concurrency > WORKERS:
        parser.error(f"--concurrency: at most {WORKERS} (the client host's threads), got {args.concurrency}")
    if args.warmup < 0:
        parser.error(f"--warmup: expected 0 or more, got {args.warmup}")
    return args


def closed_loop(submit, requests: list[GenerateInputs], concurrency: int) -> tuple[list, float]:
    """Every request through ``submit`` (-> a future), ``concurrency`` in flight: (the outcomes in request order,
    the seconds from the first sent to the last answered)."""
    outcomes, pending, queue = [None] * len(requests), {}, list(enumerate(requests))
    started = time.perf_counter()
    while queue or pending:
        while queue and len(pending) < concurrency:
            index, inputs = queue.pop(0)
            pending[submit(inputs)] = index
        done, _ = wait(pending, return_when=FIRST_COMPLETED)
        for future in done:
            outcomes[pending.pop(future)] = future.result()
    return outcomes, time.perf_counter() - started


def check(outcomes: list, reference: list | None) -> tuple[list[Sample], list[str]]:
    """The samples of the answers, and an error message per request that failed or whose answer differs from
    ``reference`` (the first deployment's outcomes; None: this is the first)."""
    samples, errors = [], []
    for i, got in enumerate(outcomes):
        if isinstance(got, GenerateError):
            errors.append(f"request {i}: {got}")
            continue
        ref = reference[i] if reference is not None else None
        if isinstance(ref, GenerateResult) and (got.text, got.num_output_tokens) != (ref.text, ref.num_output_tokens):
            errors.append(f"request {i}: answer differs from the first deployment's "
                          f"({got.num_output_tokens} tokens {got.text[:40]!r} vs {ref.num_output_tokens} {ref.text[:40]!r})")
            continue
        samples.append(Sample(ttft=got.ttft or got.total, latency=got.total, tokens=got.num_output_tokens or 0,
                              timings=got.timings or {}, text=got.text, index=i))
    return samples, errors


def split(samples: list[Sample], replicas: dict[str, str]) -> dict[str, int]:
    """Answers per pd replica, by host name (``replicas``: gRPC address -> host name); an address the topology does
    not name is counted under itself."""
    counts = {name: 0 for name in replicas.values()}
    for sample in samples:
        address = sample.timings.get("pd_replica", "?")
        name = replicas.get(address, address)
        counts[name] = counts.get(name, 0) + 1
    return counts


def host_cpu(network, hosts: list[str]) -> dict[str, float]:
    """CPU seconds (user + system) so far of the processes living in each host's namespace, of this process (the
    client: its threads live in the client host), and of the whole machine (``machine``: every core's non-idle time,
    whatever runs there, from /proc/stat)."""
    cpu = {host: sum(stat[2] for pid in network.pids(host) if (stat := _stat(pid))) for host in hosts}
    times = os.times()
    cpu["client"] = times.user + times.system
    with open("/proc/stat") as fh:
        jiffies = [int(v) for v in fh.readline().split()[1:]]
    cpu["machine"] = (sum(jiffies) - jiffies[3] - jiffies[4]) / os.sysconf("SC_CLK_TCK")  # less idle and iowait
    return cpu


def table(rows: list[dict]) -> str:
    """The side-by-side markdown table of the deployments' rows (``summarise``'s, plus ``pd_split`` and ``cpu_s``, whose
    ``machine`` entry is the whole machine's and no host's)."""
    lines = ["| pd replicas | req/s | TTFT p50 / p90 ms | total p50 / p90 ms | errors | requests per pd replica "
             "| CPU s per host | cores busy: hosts + client / machine |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        split_cells = ", ".join(f"{name} {n}" for name, n in r["pd_split"].items())
        ours = {host: s for host, s in r["cpu_s"].items() if host != "machine"}
        cpu = ", ".join(f"{host} {s:.2f}" for host, s in ours.items())
        wall = r["wall_s"] if r["wall_s"] > 0 else float("nan")
        busy = f"{sum(ours.values()) / wall:.2f} / {r['cpu_s'].get('machine', float('nan')) / wall:.2f}"
        lines.append(f"| {r['deployment']} | {r['req_per_s']:.2f} | {r['ttft_p50_ms']:.0f} / {r['ttft_p90_ms']:.0f} | "
                     f"{r['latency_p50_ms']:.0f} / {r['latency_p90_ms']:.0f} | {r['errors']} | {split_cells} | "
                     f"{cpu} | {busy} |")
    return "\n".join(lines)


def run_deployment(pd_replicas: int, args, requests, warmup, reference, workdir: Path) -> tuple[dict, list, list[str]]:
    """One deployment started fresh, warmed up, measured and stopped: (its row, its outcomes, its error messages)."""
    from tests.hosts_deploy import HostsDeployment, hosts_e_pd
    from tests.netns import Network

    topology = hosts_e_pd(workdir, pd_replicas)
    pd_hosts = {spec.grpc: name for name, spec in topology.hosts.items() if "pd" in spec.stages}
    with Network(HostsDeployment.addresses(topology)) as net, \
            HostsDeployment(topology, net, workdir / f"pd{pd_replicas}") as deployed:
        submit = lambda inputs: deployed.submit("epd", inputs)  # noqa: E731
        closed_loop(submit, warmup, args.concurrency)
        before = host_cpu(net, list(topology.hosts))
        outcomes, wall = closed_loop(submit, requests, args.concurrency)
        after = host_cpu(net, list(topology.hosts))
    samples, errors = check(outcomes, reference)
    row = summarise(str(pd_replicas), "concurrency", args.concurrency, samples, len(errors), wall)
    row["pd_split"] = split(samples, pd_hosts)
    row["cpu_s"] = {host: after[host] - before[host] for host in after}
    return row, outcomes, errors


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if os.geteuid() != 0:
        sys.exit("replicas: network namespaces need root (ip netns add)")
    requests = synthetic_requests(args.requests, 1, args.image_sizes, args.max_tokens)
    warmup = synthetic_requests(args.warmup, 1, args.image_sizes, args.max_tokens, first=args.requests)
    rows, reference, failures = [], None, []
    with tempfile.TemporaryDirectory(prefix="bench-replicas-") as tmp:
        for n in args.replicas:
            row, outcomes, errors = run_deployment(n, args, requests, warmup, reference, Path(tmp))
            reference = outcomes if reference is None else reference
            rows.append(row)
            failures += [f"{n} pd replica(s): {e}" for e in errors]
            print(f"{n} pd replica(s): {row['completed']} answered, {len(errors)} errors", file=sys.stderr, flush=True)
    print(f"E+PD across hosts (topologies/hosts-e-pd.yaml), {args.requests} one-image requests, "
          f"{args.max_tokens} greedy tokens each (ignore_eos), concurrency {args.concurrency}, {os.cpu_count()} cores\n")
    print(table(rows))
    for failure in failures:
        print(failure)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
