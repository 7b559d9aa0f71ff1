"""vLLM's own stacks beside this project's, one client, the same requests, one run, one table (issue 36, item 1).

    .venv/bin/python -m clients.bench.side_by_side --proxy "$VLLM_EPD_PROXY" \\
        --requests 96 --concurrency 16 --out .cache/side-by-side
    # on one GPU (docs/gpu.md, "vLLM's own stack beside ours on the H200"): scripts/gpu_side_by_side.sh
    .venv/bin/python -m clients.bench.side_by_side --topology topologies/checkpoint-gpu.yaml --checkpoint /tmp/q2b \\
        --eager --parallel-start --images-per-request 4 --image-size 448,672,896 --max-tokens 128 \\
        --concurrency 32 --requests 64 --proxy /tmp/vllm-proxy/disagg_epd_proxy.py --rows \\
        vllm-single,vllm-e-pd,vllm-e-p-d,llm,epd,epd_disagg --no-grpc --out $OUT/side

Rows, one stack at a time (never two on the machine at once), in this order: vLLM's ``vllm-single`` (its OpenAI API
server, what ``vllm serve`` runs), ``vllm-e-pd`` (encoder + P/D server, ECExampleConnector, behind vLLM's example EPD
proxy), ``vllm-e-p-d`` (encoder, prefill, decode, NixlConnector with UCX on loopback, behind the proxy) as shipped, and
``vllm-e-p-d-delay`` (the same with NIXL's progress-thread poll delay set, ``--poll-delay-us``); then ours: ``llm``,
``epd``, ``epd_disagg`` (tritonserver on ``--topology`` rendered for that deployment alone, plus ``frontend.openai``),
each driven through the OpenAI endpoint and then, with other requests of the same kind, over Triton's gRPC. Stacks and
engine settings: ``clients.bench.side_stacks``; the client and the requests: ``clients.bench.side_client``; the table,
ratios, token equality and CPU accounting: ``clients.bench.side_table``.

Each row: ``--warmup`` requests (seeds of their own), then the timed window of ``--requests`` requests at
``--concurrency``: the OpenAI rows all get request set A (seeds 0..N-1), the gRPC rows set B (seeds N..2N-1, so neither
the engines' prefix caches nor the encoder's embedding cache serve a request the same server already answered);
``vllm-single`` answers set B too, untimed, as the gRPC rows' reference. With several concurrency levels each stack is
started once and driven at each level in turn, level i with sets of their own (seeds 2iN.. and (2i+1)N..). A request
has ``--images-per-request`` images of ``--image-size`` (``clients.bench.side_client``). Engine settings: the
topology's (``--checkpoint`` in its checkpoint's place), ``--eager`` or ``--compile`` laid over every engine of both
sides. Host CPU per request per process group: CPU
time of each group's processes and their descendants from /proc before and after the window, over the requests
(``client``: this process, shown apart). ``--proxy`` is vLLM's file, kept outside this repository; without it only
``vllm-single`` and ours run. Writes ``results.json`` (settings, rows with every answer, ratios, the servers' command
lines) and the tables into ``--out``; the servers' logs go to ``--out``/logs.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

from backend.deploy.local_server import ROOT
from clients.bench import proc_cpu
from clients.bench import side_client as client, side_profile as profile, side_stacks as stacks, side_table as table
from clients.bench.served import overrides, served_arguments, served_topology

ROWS = (*stacks.VLLM_STACKS, *stacks.OURS)
INTERLEAVED = ("vllm-single", "llm", "vllm-e-pd", "epd", "vllm-e-p-d", "epd_disagg", "vllm-e-p-d-delay")
NEEDS_PROXY = ("vllm-e-pd", "vllm-e-p-d", "vllm-e-p-d-delay")
WARMUP_SEED = 10**6
DECODE = "decode"  # --colocated: decode's engine in E/P/D's colocated orchestrator too
MODES = {"vllm-single": "baseline", "vllm-e-pd": "E+PD", "vllm-e-p-d": "E/P/D", "vllm-e-p-d-delay": "E/P/D",
         **stacks.OURS}  # row -> the topology deployment whose engine settings it runs with


class Run:
    """One run's settings, request sets, references and rows."""

    def __init__(self, args):
        self.args = args
        self.topology = served_topology(args)  # so every engine's, ours and vLLM's, gets --eager / --compile
        self.ours_topology = self.topology  # ours: the deployments of --colocated with their orchestrator colocated
        for mode in (m for m in args.colocated if m != DECODE):
            self.ours_topology = self.ours_topology.with_orchestrator("colocated", mode)
        if DECODE in args.colocated:
            self.ours_topology = self.ours_topology.with_decode_in_process()
        self.poll_delay_us = (args.poll_delay_us if args.poll_delay_us is not None
                              else int(self.topology.transfer.get("nixl_poll_delay_us", 5000)))
        n, sizes, images, fmt = args.requests, args.image_size, args.images_per_request, args.image_format
        # level i (args.concurrency[i]): OpenAI seeds 2iN..(2i+1)N-1, gRPC (2i+1)N..(2i+2)N-1; level 0 as before
        self.sets = {(protocol, c): client.request_set((2 * i + k) * n, n, sizes, images, fmt)
                     for i, c in enumerate(args.concurrency) for k, protocol in enumerate(("openai", "grpc"))}
        self.warm = {"openai": client.request_set(WARMUP_SEED, args.warmup, sizes, images, fmt),
                     "grpc": client.request_set(2 * WARMUP_SEED, args.warmup, sizes, images, fmt)}
        self.references: dict[tuple[str, int], dict[int, str]] = {}
        self.rows: list[dict] = []
        self.commands: dict[str, list[list[str]]] = {}
        self.started_s: dict[str, float] = {}  # stack -> seconds to start (every server healthy)
        self.ec_items: dict[str, int] = {}  # vLLM stack -> items its encoder left in the EC directory
        self.failed: dict[str, str] = {}  # stack -> why it did not run
        self.log_dir = args.out / "logs"
        self.profile_dir = args.out / "profile"

    def drive(self, name: str, protocol: str, url: str, model: str, groups: dict[str, list[int]],
              concurrency: int, warm: bool = True) -> dict:
        """Warm ``url`` up (``warm``), then the timed window of this protocol's request set at ``concurrency``;
        appends and returns the row."""
        a = self.args
        send = client.run_grpc if protocol == "grpc" else client.run_openai
        requests = table.REQUEST_SET[protocol]
        if a.warmup and warm:
            asyncio.run(send(url, model, self.warm[requests], min(2, concurrency), a.max_tokens))
        watched = {group: (pids, True) for group, pids in groups.items()}
        watched["client"] = ([os.getpid()], False)
        before = table.cpu_snapshot(watched)
        recorders = profile.Profiles(self.stack_pids(before), self.profile_dir / f"{name}-{protocol}-c{concurrency}") \
            if a.profile else None
        gpu = proc_cpu.GpuBusy()
        try:
            samples, errors, wall = asyncio.run(send(url, model, self.sets[requests, concurrency], concurrency,
                                                     a.max_tokens))
            after = table.cpu_snapshot(watched)
        finally:
            gpu_busy = gpu.stop()
        recorded = recorders.stop() if recorders else []
        cpu = table.cpu_per_request(before, after, a.requests)
        row = table.summarise(name, protocol, samples, len(errors), wall, a.requests)
        row["concurrency"] = concurrency
        row["cpu_by_process"] = {g: p for g, p in profile.by_process(before, after, a.requests).items() if g != "client"}
        if recorded:
            row["profile"] = self.summarise_profiles(recorded, row["cpu_by_process"])
        row["client_cpu_ms"] = cpu.pop("client")
        row["cpu_ms"], row["cpu_total_ms"] = cpu, round(sum(cpu.values()), 2)
        row["error_examples"] = errors[:3]
        if gpu_busy is not None:
            row["gpu_busy_pct"] = gpu_busy
        self.rows.append(row)
        print(f"{name} [{protocol}, c={concurrency}]: {row['req_per_s']:.2f} req/s, TTFT p50/p90 "
              f"{row['ttft_p50_ms']:.0f}/{row['ttft_p90_ms']:.0f} ms, CPU {row['cpu_total_ms']:.1f} ms/req {cpu}, "
              + (f"GPU busy {gpu_busy}%, " if gpu_busy is not None else "")
              + f"{len(errors)} errors" + (f" ({errors[0][:200]})" if errors else ""), file=sys.stderr, flush=True)
        return row

    @staticmethod
    def stack_pids(snapshot: dict[str, dict[tuple[int, int], float]]) -> list[int]:
        """Every process of the stack's groups in ``snapshot`` (not the client)."""
        return sorted({pid for group, procs in snapshot.items() if group != "client" for pid, _ in procs})

    @staticmethod
    def summarise_profiles(recorded: list[tuple[str, int, Path]], cpu_by_process: dict[str, dict[str, float]]) -> dict:
        """Each process label's py-spy stacks (its processes' files merged) summarised with its CPU per request."""
        from collections import Counter

        merged: dict[str, Counter] = {}
        for name, _, path in recorded:
            merged.setdefault(name, Counter()).update(profile.read_raw(path))
        per_label = {name: ms for group in cpu_by_process.values() for name, ms in group.items()}
        return {name: profile.summarise(stacks, per_label.get(name)) for name, stacks in merged.items()}

    def vllm(self, kind: str) -> None:
        """One of vLLM's stacks: start, drive through its OpenAI endpoint at each concurrency, stop (the EC
        directory removed after, the items its encoder left there counted first)."""
        from backend.deploy.ports import free_ports

        ec_dir = Path(tempfile.mkdtemp(prefix="side-by-side-ec-"))
        try:
            servers = stacks.vllm_stack(kind, self.topology, self.args.proxy, free_ports(6), ec_dir, self.poll_delay_us)
            self.commands[kind] = [s.argv for s in servers]
            started = time.monotonic()
            with stacks.running(servers, self.log_dir / kind, self.args.start_timeout,
                                together=self.args.parallel_start) as groups:
                self.up(kind, started)
                url = f"http://127.0.0.1:{servers[-1].port}"
                for i, c in enumerate(self.args.concurrency):
                    row = self.drive(kind, "openai", url, stacks.SERVED_NAME, groups, c, warm=i == 0)
                    if kind == table.REFERENCE:
                        self.references["openai", c] = dict(row["texts"])
                        if not self.args.no_grpc:  # the gRPC rows' answers to compare with, untimed
                            samples, _, _ = asyncio.run(client.run_openai(url, stacks.SERVED_NAME,
                                                                          self.sets["grpc", c], c,
                                                                          self.args.max_tokens))
                            self.references["grpc", c] = {s.index: s.text for s in samples}
        finally:
            if kind != "vllm-single":
                self.ec_items[kind] = sum(1 for _ in ec_dir.glob("*/*.safetensors"))
            shutil.rmtree(ec_dir, ignore_errors=True)

    def up(self, name: str, started: float) -> None:
        self.started_s[name] = round(time.monotonic() - started, 1)
        print(f"{name}: up in {self.started_s[name]:.0f} s", file=sys.stderr, flush=True)

    def ours(self, name: str) -> None:
        """One of ours: tritonserver + the OpenAI endpoint; driven through the endpoint, then over gRPC, at each
        concurrency."""
        started = time.monotonic()
        with stacks.ours_running(self.ours_topology, name, self.log_dir) as (base_url, grpc_url, model, groups, _):
            self.up(name, started)
            for i, c in enumerate(self.args.concurrency):
                self.drive(name, "openai", base_url, model, groups, c, warm=i == 0)
                if not self.args.no_grpc:
                    self.drive(name, "grpc", grpc_url, model, {"tritonserver group": groups["tritonserver group"]}, c,
                               warm=i == 0)
        if self.args.no_in_process:
            return
        started = time.monotonic()
        with stacks.ours_running(self.ours_topology, name, self.log_dir, in_process=True) as (base_url, _, model, groups, _):
            self.up(f"{name} (endpoint in process)", started)
            for i, c in enumerate(self.args.concurrency):
                self.drive(name, "openai-in", base_url, model, groups, c, warm=i == 0)

    def settings(self) -> dict:
        a = self.args
        return {"rows": a.rows, "requests": a.requests, "concurrency": a.concurrency, "warmup": a.warmup,
                "image_size": a.image_size, "images_per_request": a.images_per_request,
                "image_format": a.image_format, "max_tokens": a.max_tokens, "topology": str(a.topology),
                "checkpoint": str(self.topology.checkpoint), "engine_args_over_topology": overrides(a),
                "image_preprocess": self.topology.stages["encoder"].image_preprocess,
                "parallel_start": a.parallel_start, "proxy": str(a.proxy or ""), "poll_delay_us": self.poll_delay_us,
                "grpc": not a.no_grpc, "in_process": not a.no_in_process, "colocated": a.colocated,
                "started_s": self.started_s, "ec_items": self.ec_items, "failed": self.failed,
                "engine_args": {mode: self.topology.only(mode).engine_args
                                for mode in dict.fromkeys(MODES[row] for row in a.rows)}}


def distinct(rows: list[dict]) -> str:
    """A line saying how many different answers the reference gave (equality with a model that ignored its image
    would prove nothing)."""
    ref = [r for r in rows if r["name"] == table.REFERENCE]
    return "" if not ref else (f"{table.REFERENCE} gave {ref[0]['distinct_texts']} different answers to its "
                               f"{ref[0]['completed']} requests")


def stacks_line(run: Run) -> str:
    """Seconds each stack took to start, the items vLLM's encoders left in their EC directory (0 would mean its
    P/D or prefill encoded every image itself), the stacks that failed."""
    parts = ["started in (s): " + ", ".join(f"{k} {v:.0f}" for k, v in run.started_s.items())] if run.started_s else []
    if run.ec_items:
        parts.append("items in vLLM's EC directory after the stack: "
                     + ", ".join(f"{k} {v}" for k, v in run.ec_items.items()))
    parts += [f"{name} failed: {why[:300]}" for name, why in run.failed.items()]
    return "".join(part + "\n\n" for part in parts)


def report(run: Run) -> str:
    """Set the rows' token equality; the printed text (both tables); write results.json and tables.md to --out."""
    table.add_equality(run.rows, run.references)
    pairs = table.ratios(run.rows)
    a = run.args
    sizes = "/".join(str(s) for s in a.image_size)
    images = (f"one {sizes}x{sizes} {a.image_format}" if a.images_per_request == 1 and len(a.image_size) == 1 else
              f"{a.images_per_request} {a.image_format} image(s) of {sizes} px a side")
    engines = {True: "; engines eager (--eager)",
               False: "; engines compiled (--compile; vLLM's encoder servers eager: side_stacks.encoder_settings)"}.get(
        overrides(a).get("enforce_eager"), "")
    text = (f"\n{a.requests} streaming chat requests per row at concurrency {', '.join(map(str, a.concurrency))}, "
            f"{images} and {a.max_tokens} greedy tokens (ignore_eos) each, the same seeded requests for every "
            f"row of a protocol; topology {a.topology}, checkpoint {run.topology.checkpoint}{engines}; NIXL poll delay "
            f"of vllm-e-p-d-delay {run.poll_delay_us} us; ours with the orchestrator of "
            f"{', '.join(a.colocated) or 'no deployment'} colocated\n\n"
            + table.results_table(run.rows) + "\n\n" + (distinct(run.rows) + "\n\n" if distinct(run.rows) else "")
            + stacks_line(run)
            + "ours / vLLM's (req/s: higher is better for ours; the rest: lower)\n\n"
            + table.ratios_table(pairs) + "\n\nCPU ms per request by process\n\n" + table.process_cpu_table(run.rows)
            + "\n")
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "tables.md").write_text(text)
    if profiled := [row for row in run.rows if row.get("profile")]:
        (a.out / "profile.md").write_text("\n".join(profile.report(f"{row['name']} [{row['protocol']}]", row["profile"])
                                                    for row in profiled))
    (a.out / "results.json").write_text(json.dumps({"settings": run.settings(), "rows": run.rows, "ratios": pairs,
                                                    "commands": run.commands}, indent=1, default=str))
    return text


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--proxy", type=Path, help="vLLM's examples/disaggregated/disaggregated_encoder/"
                                                   "disagg_epd_proxy.py, kept outside this repository")
    parser.add_argument("--rows", default=",".join(ROWS), help=f"of {', '.join(ROWS)}")
    parser.add_argument("--requests", type=int, default=96, help="requests per row's timed window")
    parser.add_argument("--concurrency", type=int_list, default=[16],
                        help="closed-loop clients; several (8,32): a timed window at each, on the same servers")
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--image-size", type=int_list, default=[96],
                        help="the requests' square images, pixels a side; several (448,672,896): taken in turn")
    parser.add_argument("--images-per-request", type=int, default=1)
    parser.add_argument("--image-format", default="PNG", choices=("PNG", "JPEG"))
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--topology", type=Path, default=ROOT / "topologies" / "default.yaml",
                        help="engine settings of both sides, and the topology ours are rendered from")
    served_arguments(parser, eager_help="every engine of both sides eager (enforce_eager)",
                     compile_help="every engine of both sides compiled, CUDA graphs "
                                  "(ours: the GPU encoder's tower too)",
                     image_preprocess_help="ours' encoders' stages.encoder.image_preprocess laid over the topology's "
                                           "(gpu, nvjpeg: a GPU encoder; vLLM's encoder has no such choice)")
    parser.add_argument("--interleave", action="store_true",
                        help="run each of ours right after its vLLM counterpart (a run cut short keeps whole pairs)")
    parser.add_argument("--parallel-start", action="store_true",
                        help="start a vLLM stack's servers at once (then its proxy), as tritonserver starts ours")
    parser.add_argument("--poll-delay-us", type=int,
                        help="NIXL poll delay of vllm-e-p-d-delay (default: the topology's transfer.nixl_poll_delay_us)")
    parser.add_argument("--no-grpc", action="store_true", help="drive ours through the OpenAI endpoint only")
    parser.add_argument("--colocated", default=f"E+PD,E/P/D,{DECODE}",
                        help="our deployments (comma-separated: E+PD, E/P/D; '' for none) whose orchestrator runs in "
                             "its host stage's process (topology stages.<pd|prefill>.orchestrator: colocated); "
                             f"{DECODE!r} after E/P/D: decode's engine in that process too "
                             "(stages.decode.orchestrator: colocated)")
    parser.add_argument("--no-in-process", action="store_true",
                        help="leave out ours with the OpenAI endpoint in the served model's process (openai-in rows)")
    parser.add_argument("--profile", action="store_true",
                        help="py-spy every Python process of each row over its timed window (--out/profile; "
                             "slows the row: where the time goes, not how fast)")
    parser.add_argument("--start-timeout", type=float, default=600.0, help="seconds each vLLM server may take to start")
    parser.add_argument("--out", type=Path, default=ROOT / ".cache" / "side-by-side")
    args = parser.parse_args(argv)
    rows = args.rows.split(",")
    if unknown := [r for r in rows if r not in ROWS]:
        parser.error(f"unknown rows {unknown}; known: {', '.join(ROWS)}")
    if any(r in NEEDS_PROXY for r in rows):
        if args.proxy is None or not args.proxy.is_file():
            parser.error(f"rows {', '.join(r for r in rows if r in NEEDS_PROXY)} need --proxy (vLLM's "
                         "disagg_epd_proxy.py); leave them out of --rows otherwise")
        if args.proxy.resolve().is_relative_to(ROOT.resolve()):
            parser.error("--proxy is vLLM's file: keep it outside this repository")
    args.rows = [r for r in (INTERLEAVED if args.interleave else ROWS) if r in rows]  # the reference first
    args.colocated = [m for m in args.colocated.split(",") if m]
    if bad := [m for m in args.colocated if m not in ("E+PD", "E/P/D", DECODE)]:
        parser.error(f"--colocated: {', '.join(bad)}: expected E+PD and/or E/P/D (and {DECODE})")
    if DECODE in args.colocated and "E/P/D" not in args.colocated:
        parser.error(f"--colocated: {DECODE} runs decode's engine in E/P/D's colocated orchestrator: list E/P/D too")
    if missing := unservable(args.topology, args.rows, args.machine):
        parser.error(f"{args.topology} cannot serve {', '.join(missing)} alone; leave them out of --rows")
    return args


def int_list(text: str, minimum: int = 1) -> list[int]:
    """``8,32`` -> [8, 32] (argparse type; ``functools.partial(int_list, minimum=0)`` where 0 is allowed)."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers separated by commas, got {text!r}") from None
    if not values or min(values) < minimum:
        raise argparse.ArgumentTypeError(f"expected integers >= {minimum}, got {text!r}")
    return values


def unservable(topology: Path, rows: list[str], machine: str | None = None) -> list[str]:
    """The rows whose deployment ``topology`` has no stages for (``Topology.only`` refuses it)."""
    from backend.deploy.schema import TopologyError
    from backend.deploy.topology import load

    served = load(topology, machine=machine)
    missing = []
    for row in rows:
        try:
            served.only(MODES[row])
        except TopologyError:
            missing.append(row)
    return missing


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:  # a killed run stops the stack it is on (finally blocks)
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    run = Run(args)
    try:
        for name in args.rows:
            try:
                run.vllm(name) if name in stacks.VLLM_STACKS else run.ours(name)
            except Exception as exc:  # noqa: BLE001  one stack that fails does not end the run
                print(f"{name}: failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
                run.failed[name] = str(exc)
            report(run)  # what ran so far, should the run be cut short
    except (SystemExit, KeyboardInterrupt):  # stopped (SIGTERM, Ctrl-C): the stack that was up is stopped; report
        print("stopped: the tables hold the rows that finished", file=sys.stderr, flush=True)
    print(report(run))
    return run.rows


if __name__ == "__main__":
    main()
