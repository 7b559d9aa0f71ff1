"""The overload benchmark (docs/benchmarks.md, "Overload"): one E+PD server, the same deployment with admission and
priorities (``epd``) and without (``epd_open``: the same encoder and pd, an orchestrator with no budgets, requests
without a priority), driven over the OpenAI protocol by open-loop Poisson arrivals at multiples of the measured
capacity, two priority classes (``--high-share`` high), a TTFT SLO; one table, one plot.

    .venv/bin/python -m clients.bench.overload [--loads 0.5,1,2,4] [--seconds 15] [--repeats 1] [--slo-ms 0]
                                               [--endpoint in-process] [--out DIR]

Steps: the topology (``topologies/cpu-overload.yaml``: its ``admission`` block, ``max_queue_ms`` laid over by
``--max-queue-ms``, by default half the SLO) is rendered for E+PD (``--split E/P/D``: E/P/D, both orchestrators over
the same prefill and decode) and ``epd_open`` added beside ``epd``; tritonserver starts on free ports, with
the OpenAI endpoint in each orchestrator's process (``--endpoint in-process``, the default, each on a port of its
own) or ``frontend.openai`` as its own process serving both (``--endpoint process``); the light-load TTFT (sequential
requests) is measured; the capacity is what ``--capacity-concurrency`` closed-loop clients get served from
``epd_open``; then each load level runs on ``epd_open``, then on ``epd``. Per class and level: goodput (requests
served within the SLO, per second), TTFT p50/p99, shed rate, how fast a shed request was answered and whether it had
``Retry-After``; per run: requests lost or hung, the server's memory (RSS of its process tree) before the load, at
each level's start and end, and ``--settle-seconds`` after the load. ``--repeats``: the levels run that many times in
turn; the checks pool each level's repeats (overload_table). ``--variant KEY=VALUE,...``: a third deployment,
``epd_b``, the same as ``epd`` with those admission settings over its own (e.g. ``high_priority_burst_percent=100``),
served beside it and run at each level right after or before it (the order alternates by repeat): two settings
compared in the same minutes, where two runs one after the other meet this machine's cores at different speeds
(docs/planning.md, "Run 9").
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import tempfile
import time
from pathlib import Path

from backend.deploy.schema import ENCODER_QUEUES
from clients.bench import speed
from clients.bench.overload_load import CLASSES, closed_loop_rate, open_loop, summary
from clients.bench.report import parse_metrics, percentile

# the bench's options laid over the topology's admission block: argument -> (key, what it sets)
ADMISSION_OPTIONS = {
    "first_token_target_ms": ("first_token_target_ms", "epd's generator gates follow their first tokens toward this "
                              "(0: fixed budgets; orchestrator.admission)"),
    "reserve_percent": ("high_priority_reserve_percent", "the share of each of epd's budgets only the high class may use"),
    "burst_percent": ("high_priority_burst_percent", "the share over each of epd's budgets the high class may use too"),
}
SPLITS = ("E+PD", "E/P/D")  # the deployment measured: served alone, its orchestrator model is ``epd``
DEPLOYMENTS = {"epd_open": False, "epd": True}  # model -> admission and priorities on
VARIANT = "epd_b"  # ``--variant``: epd with other admission settings


def deployments(variant: dict | None) -> dict[str, bool]:
    """The models a run measures: model -> admission and priorities on."""
    return {**DEPLOYMENTS, **({VARIANT: True} if variant else {})}


def render_both(topology, repo: Path, max_queue_ms: float = 0, openai_ports: dict[str, int] | None = None,
                split: str = "E+PD", variant: dict | None = None) -> None:
    """``split`` with admission as ``epd`` (``max_queue_ms``: over the topology's; 0: its own) and, beside it,
    ``epd_open``: the same orchestrator without budgets over the same stages, and with ``variant`` (admission
    settings over epd's), ``epd_b``. ``openai_ports``: model -> the port of the OpenAI endpoint in that orchestrator's
    process (none: none there)."""
    from backend.deploy.render import copy_model, render

    ports, model = openai_ports or {}, "epd"
    admission = {**topology.admission, **({"max_queue_ms": max_queue_ms} if max_queue_ms else {})}
    render(topology.only(split, admission=admission, openai_port=ports.get(model, 0)), repo)
    others = {f"{model}_open": {"priority_levels": admission.get("priority_levels", 4)},
              **({VARIANT: {**admission, **variant}} if variant else {})}
    for name, settings in others.items():
        with tempfile.TemporaryDirectory() as other:
            render(topology.only(split, admission=settings, openai_port=ports.get(name, 0)), Path(other))
            copy_model(Path(other), model, repo, name)


def parse_variant(text: str) -> dict:
    """``--variant``'s ``KEY=VALUE,...``: admission keys with the values the topology's ``admission`` block takes
    (numbers read as such); ValueError (the topology's TopologyError) naming what is wrong."""
    from backend.deploy.topology import check_admission

    variant = {}
    for part in filter(None, text.split(",")):
        key, sep, value = (piece.strip() for piece in part.partition("="))
        if not sep:
            raise ValueError(f"{part!r}: expected KEY=VALUE")
        try:
            number = float(value)
            variant[key] = int(number) if number.is_integer() else number
        except ValueError:
            variant[key] = value
    if not variant:
        raise ValueError("no KEY=VALUE given")
    return check_admission(variant, "admission")


def server_rss(pid: int) -> int:
    import psutil

    try:
        proc = psutil.Process(pid)
        return sum(p.memory_info().rss for p in [proc, *proc.children(recursive=True)])
    except psutil.Error:
        return 0


def rss_by_process(pid: int) -> dict[str, int]:
    """MiB of RSS of each process of the server's tree, named by what it is: ``tritonserver``, a stub by its model
    (``stub epd``), ``EngineCore`` by its stub's model (a forked EngineCore shares its stub's pages: the sum over the
    tree counts them twice, as ``server_rss`` does)."""
    import psutil

    named: dict[str, int] = {}
    try:
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
        stubs = {p.pid: _model_of(p.cmdline()) for p in procs if "triton_python_backend_stub" in p.name()}
        for proc in procs:
            if proc.pid == pid:
                name = "tritonserver"
            elif proc.pid in stubs:
                name = f"stub {stubs[proc.pid]}"
            else:
                name = f"{proc.name().removeprefix('VLLM::')} of {stubs.get(proc.ppid(), proc.ppid())}"
            named[name] = named.get(name, 0) + round(proc.memory_info().rss / 2**20)
    except psutil.Error:
        pass
    return named


def _model_of(cmdline: list[str]) -> str:
    """A stub's model: its ``model.py``'s folder two up (``<repo>/<model>/<version>/model.py``)."""
    script = next((arg for arg in cmdline if arg.endswith("model.py")), "")
    return Path(script).parent.parent.name or "?"


def scrape(metrics_url: str) -> str:
    import urllib.request

    return urllib.request.urlopen(metrics_url, timeout=10).read().decode()


def loop_lag_buckets(text: str, model: str) -> dict[float, float]:
    """``model``'s ``epd_loop_lag_seconds`` buckets in a scrape: {upper bound in seconds: wake-ups at most that
    late}."""
    return {float(le): count for (_, le), count in
            parse_metrics(text, "epd_loop_lag_seconds_bucket{", by="le", where={"model": model}).items()}


def loop_lag(before: dict[float, float], after: dict[float, float], over: float = 0.05) -> dict:
    """A level's wake-ups of the orchestrator's loop (``backend.engine.loop.watch_lag``, every 50 ms) from two
    ``loop_lag_buckets``: how many, how many later than ``over`` seconds, and the bucket bound the latest is within
    (ms; ``inf``: beyond the last bound)."""
    moved = {le: after.get(le, 0.0) - before.get(le, 0.0) for le in after}
    if not moved:
        return {}
    total = moved.get(math.inf, max(moved.values()))
    within = [le for le, count in sorted(moved.items()) if count >= total]
    return {"wakeups": round(total), "late": round(total - max((c for le, c in moved.items() if le <= over), default=0)),
            "late_over_ms": round(over * 1000), "worst_within_ms": within[0] * 1000 if within else math.inf}


def limits_of(text: str, model: str) -> dict[str, float]:
    """``model``'s generator gates' limits in a scrape (``epd_admission_limit`` by stage; none where no limit moved
    yet: fixed budgets, or no admission)."""
    return {stage: value for (_, stage), value in
            parse_metrics(text, "epd_admission_limit{", by="stage", where={"model": model}).items()}


async def light_ttft(base: str, model: str, count: int, args) -> list[float]:
    """TTFTs of ``count`` requests sent one after another."""
    _, fates = await closed_loop_rate(base, model, 1, count, args.max_tokens, args.image_size, 90)
    return [f.ttft for f in fates if f.ttft is not None]


def run(args) -> dict:
    from backend.deploy.local_server import Ports, TritonServer, start_openai_process
    from backend.deploy.ports import free_ports
    from backend.deploy.schema import ADMISSION_DEFAULTS
    from backend.deploy.topology import load
    from clients.bench.side_stacks import wait_healthy

    topology = load(Path(args.topology), "cpu")
    if args.engine_nice is not None:
        topology = dataclasses.replace(topology, engine_nice=args.engine_nice)
    if args.encoder_queue is not None:
        topology = dataclasses.replace(topology, admission={**topology.admission, "encoder_queue": args.encoder_queue})
    # the admission settings given on the command line, over the topology's; each recorded with the results
    given = {key: getattr(args, arg) for arg, (key, _) in ADMISSION_OPTIONS.items() if getattr(args, arg) is not None}
    topology = dataclasses.replace(topology, admission={**topology.admission, **given})
    for arg, (key, _) in ADMISSION_OPTIONS.items():
        setattr(args, arg, topology.admission.get(key, 0))
    args.engine_nice = topology.engine_nice  # recorded with the results
    args.encoder_queue = topology.admission.get("encoder_queue", ADMISSION_DEFAULTS["encoder_queue"])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    args.deployments = deployments(args.variant)
    taken = free_ports(4 + len(args.deployments))
    server_ports, port, own = taken[:3], taken[3], taken[4:]
    in_process = args.endpoint == "in-process"
    ports = dict(zip(args.deployments, own)) if in_process else {m: port for m in args.deployments}
    bases = {model: f"http://127.0.0.1:{p}" for model, p in ports.items()}
    with tempfile.TemporaryDirectory(prefix="overload-") as repo, tempfile.TemporaryDirectory(prefix="overload-tmp-") as tmp:
        slo = args.slo_ms / 1000
        render_both(topology, Path(repo), args.max_queue_ms or args.slo_ms / 2, ports if in_process else None, args.split,
                    args.variant)
        with TritonServer(Path(repo), ports=Ports(*server_ports), log_path=out / "tritonserver.log",
                          env={**os.environ, "TMPDIR": tmp}) as server:
            endpoint = None if in_process else start_openai_process(port, server.grpc_url, "--models", ",".join(args.deployments))
            try:
                for base in set(bases.values()):
                    wait_healthy(f"{base}/health", 120, endpoint or server.proc)
                return asyncio.run(_measure(bases, server, slo, args))
            finally:
                if endpoint is not None:
                    endpoint.terminate()
                    endpoint.wait(timeout=30)


async def _measure(bases: dict[str, str], server, slo: float, args) -> dict:
    for model in args.deployments:  # warm-up
        await light_ttft(bases[model], model, 2, args)
    light = await light_ttft(bases["epd_open"], "epd_open", 8, args)
    capacity = args.capacity or (await closed_loop_rate(bases["epd_open"], "epd_open", args.capacity_concurrency,
                                                        args.capacity_requests, args.max_tokens, args.image_size, 7))[0]
    print(f"light-load TTFT p50 {percentile(light, 50) * 1000:.0f} ms -> SLO {slo * 1000:.0f} ms; "
          f"capacity {capacity:.2f} req/s", flush=True)
    runs, rss_start, processes_start = [], _rss_mib(server), rss_by_process(server.proc.pid)
    for repeat in range(args.repeats):
        for load in args.loads:
            for model in _order(args.deployments, repeat):
                on = args.deployments[model]
                started, rss_before = time.perf_counter(), _rss_mib(server)
                lag_before = loop_lag_buckets(scrape(server.metrics_url), model)
                with speed.Sampler() as cores:
                    fates = await open_loop(bases[model], model, load * capacity, args.seconds, args.high_share,
                                            args.max_tokens, args.image_size, seed=int(load * 1000) + 7919 * repeat,
                                            priorities=on)
                after = scrape(server.metrics_url)
                row = {"model": model, "load": load, "repeat": repeat, "rate": round(load * capacity, 2),
                       "wall_s": round(time.perf_counter() - started, 1), "rss_before_mib": rss_before,
                       "rss_mib": _rss_mib(server), "limits": limits_of(after, model),
                       "loop_lag": loop_lag(lag_before, loop_lag_buckets(after, model)),
                       "cores_probe_ms": cores.median_ms(),
                       "all": summary(fates, args.seconds, slo), **{c: summary(fates, args.seconds, slo, c) for c in CLASSES}}
                runs.append(row)
                print(_line(row), flush=True)
    await asyncio.sleep(args.settle_seconds)  # idle: does the memory the load took come back?
    rss_after, processes_after = _rss_mib(server), rss_by_process(server.proc.pid)
    print(f"server RSS {rss_start} MiB before the load, {rss_after} MiB {args.settle_seconds:g} s after it; by process "
          f"(before -> after): {_moved(processes_start, processes_after)}", flush=True)
    return {"split": args.split, "endpoint": args.endpoint, "engine_nice": args.engine_nice,
            "encoder_queue": args.encoder_queue, **{arg: getattr(args, arg) for arg in ADMISSION_OPTIONS},
            **({"variant": args.variant} if args.variant else {}),
            "slo_ms": round(slo * 1000), "light_ttft_p50_ms": round(percentile(light, 50) * 1000, 1),
            "capacity_rps": round(capacity, 2), "seconds": args.seconds, "high_share": args.high_share,
            "repeats": args.repeats, "rss_start_mib": rss_start, "rss_after_load_mib": rss_after,
            "settle_seconds": args.settle_seconds, "rss_by_process_mib": {"start": processes_start,
                                                                          "after_load": processes_after},
            "runs": runs}


def _order(models: dict[str, bool], repeat: int) -> list[str]:
    """A level's deployments in the order they run: the one without admission first, then the others, reversed on
    odd repeats (``epd`` and ``epd_b`` take turns at running first)."""
    on = [model for model, admission in models.items() if admission]
    return [m for m, admission in models.items() if not admission] + (on[::-1] if repeat % 2 else on)


def _moved(before: dict[str, int], after: dict[str, int]) -> str:
    return ", ".join(f"{name} {before.get(name, 0)} -> {after.get(name, 0)}" for name in sorted({*before, *after}))


def _rss_mib(server) -> int:
    return round(server_rss(server.proc.pid) / 2**20)


def _line(row: dict) -> str:
    a, h, lo = row["all"], row["high"], row["low"]
    return (f"{row['model']:>8} x{row['load']:<4} #{row.get('repeat', 0)} {row['rate']:6.2f}/s goodput {a['goodput']:5.2f}/s "
            f"(high {h['goodput']:.2f}, low {lo['goodput']:.2f}) TTFT p99 high {h['ttft_p99_ms']} ms low "
            f"{lo['ttft_p99_ms']} ms shed {a['shed_rate']:.0%} (answered max {a['shed_answer_max_ms']} ms) "
            f"lost+hung {a['lost'] + a['hung']} rss {row['rss_mib']} MiB"
            + (f" cores probe {row['cores_probe_ms']:.2f} ms" if row.get("cores_probe_ms") else "")
            + "".join(f" {stage} limit {value:g}" for stage, value in row.get("limits", {}).items())
            + (f" loop late >{lag['late_over_ms']} ms {lag['late']} of {lag['wakeups']} (worst <= {lag['worst_within_ms']:g} ms)"
               if (lag := row.get("loop_lag")) else ""))


def main(argv=None) -> int:
    from clients.bench.overload_table import checks, plot, tables

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--topology", default="topologies/cpu-overload.yaml")
    parser.add_argument("--loads", type=lambda s: [float(x) for x in s.split(",")], default=[0.5, 1.0, 2.0, 4.0])
    parser.add_argument("--seconds", type=float, default=15.0, help="arrivals per level")
    parser.add_argument("--repeats", type=int, default=1,
                        help="run the levels this many times, in turn (the checks pool each level's repeats: a light "
                             "level's p99 is then not one request's time)")
    parser.add_argument("--settle-seconds", type=float, default=20.0,
                        help="idle after the last level before the server's RSS is read again")
    parser.add_argument("--slo-ms", type=float, default=500, help="the TTFT SLO")
    parser.add_argument("--max-queue-ms", type=float, default=0,
                        help="epd's queue bound, over the topology's (0: half the SLO: an admitted request still has "
                             "the other half)")
    parser.add_argument("--high-share", type=float, default=0.2)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--capacity", type=float, default=0,
                        help="the capacity (req/s) the loads are multiples of (0: measured, closed loop on epd_open); "
                             "given, two runs (e.g. --engine-nice 0 and 10) offer the same rates")
    parser.add_argument("--capacity-concurrency", type=int, default=16)
    parser.add_argument("--capacity-requests", type=int, default=192)
    parser.add_argument("--engine-nice", type=int, choices=range(20), metavar="0-19",
                        help="the engines' niceness, over the topology's engine_nice")
    parser.add_argument("--encoder-queue", choices=ENCODER_QUEUES,
                        help="the encoder's Triton queue, over the topology's admission.encoder_queue (docs/results/"
                             "epd.md, \"The encoder's queue\": Triton 2.51's priority queue can wait 500 ms)")
    for arg, (key, what) in ADMISSION_OPTIONS.items():
        parser.add_argument(f"--{arg.replace('_', '-')}", type=float, help=f"{what}, over the topology's admission.{key}")
    parser.add_argument("--variant", default="",
                        help="KEY=VALUE,...: admission settings for a third deployment, epd_b, over epd's (e.g. "
                             "high_priority_burst_percent=100): compared with epd in the same run")
    parser.add_argument("--split", choices=SPLITS, default="E+PD", help="the deployment measured")
    parser.add_argument("--endpoint", choices=["in-process", "process"], default="in-process",
                        help="the OpenAI endpoint in each orchestrator's process (docs/openai.md; under overload it "
                             "answers refusals faster than the separate one: docs/benchmarks.md), or python -m "
                             "frontend.openai as its own process serving both")
    parser.add_argument("--out", default="/tmp/overload")
    args = parser.parse_args(argv)
    try:
        args.variant = parse_variant(args.variant) if args.variant else None
    except ValueError as exc:
        parser.error(f"--variant: {exc}")
    results = run(args)
    out = Path(args.out)
    (out / "results.json").write_text(json.dumps(results))  # one line: every served request's TTFT is in it
    text = tables(results) + "\n" + checks(results)
    (out / "tables.md").write_text(text)
    print(text)
    plot(results, out / "overload.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
