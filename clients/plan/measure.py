"""Measure a stage profile (``clients.plan.profile``) against a running E+PD deployment.

    python -m clients.plan.measure --out docs/results/data/plan-2026-12-05/profile-cpu.json   # starts one server
    python -m clients.plan.measure --url 127.0.0.1:8001 --metrics http://127.0.0.1:8002/metrics --pid PID --out P.json
    python -m clients.plan.measure --topology topologies/checkpoint-gpu.yaml --checkpoint CKPT --compile --out P.json

A deployment whose engines run on a GPU (``--topology``'s pd stage, or ``--kind gpu`` with ``--url``) is profiled by
``clients.plan.measure_gpu`` (wall times of its encoders and engine). On a CPU, every line is CPU work, per process,
so the simulator's sharing of the cores makes the waits (a wall time measured under load would count them twice).
Phases of requests (``clients.plan.phases``), one at a time (no contention), each on fresh images: text only; one
image at four sizes; four images a request; one video; a longer answer. Read per phase: the CPU of each process of
the server's group (``proc_cpu``: ``stub encoder``, ``EngineCore pd``, ``stub pd``, ``stub epd`` + ``tritonserver``,
the load generator), vLLM's prompt tokens (``epd_vllm_prompt_tokens_total``), the orchestrator's ``timings``
(``transfer_ms``, ``transfer_bytes``). Fitted (``fit``): encoder item and batch lines, media tokens per item, prefill
and decode steps, the stub's, orchestrator's and client's per request and per streamed token, the same-host pull.
Not measured here: the cross-host (NIXL) pull and E/P/D's KV pull (``derived`` says where they come from). Then the
by-load step (``with_by_load``, validate's too): every process's CPU per request and per token by load
(``clients.plan.loads``: closed loops of 1, 2, 8 and 24, short and long answers): the profile's ``by_load`` rows, the
decode step by batch fitted through the engine's, the stub's send interval at each load; and the calibration on the
load-1 phase's TTFT with the background measured during it: ``before_first_token`` and ``hop``, what light-load TTFT
has beyond the CPU work (the gRPC hops' latency); then, on the other loads' TTFT, the share of the engine's per-request
CPU done before the first token (``engine_first_token_by_load``: at load 1 its by-load base is 0), and the share of
the engine's CPU on its step thread (``engine_thread_share``: the light load's time per token over its CPU per token).
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from backend.deploy.schema import TopologyError
from clients.bench.served import refuse_with_url, served_arguments
from clients.plan import measure_gpu
from clients.plan.deployments import Served, grpc_run, served_topology, single
from clients.plan.phases import (LONG, SHORT, Session, calibrate, calibrate_engine, cpu_of, encoder_lines, images,
                                 shared_lines, video_phase)
from clients.plan.profile import Line, Profile, fit, save

SIZES = (64, 160, 256, 384)


def run_phases(session: Session, repeat: int) -> dict:
    phases = {"text": session.phase(images(64, 0), repeat)}
    for size in SIZES:
        phases[f"image{size}"] = session.phase(images(size), repeat)
    phases["batch4"] = session.phase(images(160, 4), repeat)
    phases["video"] = video_phase(session, 64, repeat)
    phases["long"] = session.phase(images(64, tokens=LONG), repeat)
    return phases


def lines(phases: dict) -> dict:
    """The profile's lines from the phases (module docstring): the encoder's and the engine's from their CPU."""
    engine = ("EngineCore pd",)
    engine_per_token = (cpu_of(phases["long"], *engine) - cpu_of(phases["image64"], *engine)) / (LONG - SHORT)
    encoder = encoder_lines({s: cpu_of(phases[f"image{s}"], "stub encoder") for s in SIZES},
                            cpu_of(phases["batch4"], "stub encoder"), 160, cpu_of(phases["video"], "stub encoder"),
                            phases["video"]["units"])
    prefill = fit([(p["prompt_tokens"], cpu_of(p, *engine) - (SHORT - 1) * engine_per_token)
                   for name, p in phases.items() if name == "text" or name.startswith("image")])
    decode = Line(engine_per_token, 0.0)  # at batch 1; by batch: ``loads.decode_line`` (``measure``)
    return {"encoder": encoder, **shared_lines(phases, SIZES, "image64"),
            "prefill": Line(max(0.0, prefill.base), max(0.0, prefill.slope)).as_dict(),
            "decode": Line(max(0.0, decode.base), max(0.0, decode.slope)).as_dict(), "decode_context": Line().as_dict()}


def fit_interval(doc: dict, layout, workload, want: float, high: float = 20.0) -> float:
    """The stub's least time between two sends at which the simulated ``workload`` has ``want`` responses per request:
    vLLM merges the steps a stub has not sent yet, and the scheduler's time slices leave a stub behind more often
    than processor sharing does (bisection)."""
    from clients.plan.simulate import simulate

    def responses(interval: float) -> float:
        trial = Profile({**doc, "send_interval_ms": interval, "send_interval_by_load": None})
        return simulate(layout, trial, workload)["responses_per_request"]

    low = 0.0
    if responses(low) <= want:
        return 0.0
    for _ in range(12):
        mid = (low + high) / 2
        low, high = (mid, high) if responses(mid) > want else (low, mid)
    return round(high, 3)


def fit_intervals(doc: dict, layout, merging: dict[int, dict], tokens: int, replicas: int) -> list[list[float]]:
    """``send_interval_by_load``: at each load of ``merging`` (``clients.plan.loads.by_load``: the long answers'
    responses per request, requests and background), the interval at which the simulated phase has its responses."""
    from clients.plan.workload import closed

    out = []
    for load, got in sorted(merging.items()):
        workload = closed(load, got["count"], round(doc["text_tokens"]), tokens)
        trial = {**doc, "background": {"step_s": got["step_s"], "cores": got["series"]}}
        out.append([round(load / replicas, 3), fit_interval(trial, layout, workload, got["responses"])])
    return out


def nixl_line() -> dict:
    """The cross-host pull, from docs/benchmarks.md "Cross-host transfer" (tcp veth p50: 0.9 ms at 256 KiB, 3.7 ms
    at 1 MiB, 21.8 ms at 8 MiB, the two runs' mean): not measured by this command."""
    return fit([(0.25, 0.94), (1.0, 3.67), (8.0, 21.77)]).as_dict()


def with_by_load(doc: dict, served: Served, layout, long: int) -> dict:
    """``doc`` with ``served``'s CPU by load measured now (``clients.plan.loads.by_load``, answers of ``loads.SHORT``
    and ``long`` tokens): its rows, the decode step fitted through the engine's, the send interval at each load; then
    calibrated on ``layout`` against the load-1 phase's TTFT with the background measured in that phase
    (``light_background``), and the engine's share before the first token against the other loads' TTFT
    (``calibrate_engine``); the share of the engine's CPU on its step thread from the light load's time per token
    (``loads.thread_share``). The by-load step of ``measure`` and of ``clients.plan.validate.measured_profile``."""
    from clients.plan import loads

    got = loads.by_load(served, long=long)
    doc = {k: v for k, v in doc.items() if k != "engine_after_ms"}  # the engine's by-load row has all its CPU
    doc.update(by_load=got["by_load"], light_ttft_ms=got["light_ttft_ms"], by_load_phases=got["phases"],
               decode=loads.decode_line(got["by_load"]["engine"]).as_dict(), by_load_measured=time.strftime("%F %T"))
    doc["send_interval_by_load"] = fit_intervals(doc, layout, got["merging"], long, served.replicas)
    doc["light_background"] = {"step_s": loads.WINDOW, "cores": got["series"]}
    doc["first_token_by_load"] = got["first_token"]
    doc["speed_probe_ms"] = got["speed_ms"]  # the cores' speed while the rows were measured (clients.bench.speed)
    doc["engine_thread_share"] = loads.thread_share(got["by_load"]["engine"], got["light_tpot_ms"])
    fitted = calibrate({**doc, "background": doc["light_background"]}, layout)
    return calibrate_engine({k: v for k, v in fitted.items() if k != "background"}, layout, got["first_token"])


def measure(session: Session, repeat: int, name: str) -> dict:
    """The profile: the phases' lines (``lines``), the server's engine arguments where known (the planner writes
    them into its topology), then the by-load step on the same server (``with_by_load``)."""
    from clients.plan.loads import LONG
    from clients.plan.simulate import Layout

    measured = lines(run_phases(session, repeat))
    doc = {"name": name, "kind": "cpu", "cores": os.cpu_count(), "measured": time.strftime("%Y-%m-%d %H:%M"),
           **measured, "kv_bytes_per_token": 1024, "kv_transfer": measured["transfer"]["shared_memory"],
           "derived": {"transfer.nixl": "docs/benchmarks.md, Cross-host transfer (tcp veth p50), not this run",
                       "kv_transfer": "assumed equal to the same-host embedding pull; not measured (E/P/D not run)",
                       "kv_bytes_per_token": "tiny Qwen2-VL: 2 layers x K,V x 2 heads x 32 x fp32"}}
    doc["transfer"]["nixl"] = nixl_line()
    if session.served.engine_args:
        doc["engine_args"] = session.served.engine_args
    return with_by_load(doc, session.served, Layout(), LONG)


def _profile(session: Session, args) -> dict:
    """``measure``, or ``clients.plan.measure_gpu.measure`` where the deployment's engines run on a GPU."""
    served = session.served
    if served.device == "gpu":
        name = args.name or f"gpu-{(served.checkpoint or Path('checkpoint')).name}"
        return measure_gpu.measure(session, args.repeat, name, served.checkpoint)
    return measure(session, args.repeat, args.name or "cpu-2core-tiny-qwen2-vl")


def _serve(args) -> dict:
    """The profile of a server of its own (``deployments.single``: ``--topology``'s E+PD), after a warm-up."""
    with single(args) as served:
        session = Session(served)
        session.phase(images(64), 3)  # warm-up (a GPU engine's first requests compile)
        return _profile(session, args)


def _running(args) -> Served:
    """The server at ``--url`` (its metrics at ``--metrics``, its processes ``--pid``'s group; ``--kind``)."""
    from backend.deploy.local_server import group_members

    return Served("measure", grpc_run(args.url), lambda: group_members(args.pid), metrics=args.metrics,
                  device=args.kind, checkpoint=args.checkpoint)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Measure a stage profile against an E+PD deployment.")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--topology", default="topologies/cpu-e-pd.yaml", help="served when no --url is given")
    served_arguments(parser)
    parser.add_argument("--url", help="a running server's gRPC address (with --metrics and --pid)")
    parser.add_argument("--metrics", help="its metrics URL")
    parser.add_argument("--pid", type=int, help="its tritonserver's pid (the CPU of its process group)")
    parser.add_argument("--kind", choices=("cpu", "gpu"), default="cpu",
                        help="with --url: where its engines run (gpu: wall-time lines, clients.plan.measure_gpu)")
    parser.add_argument("--repeat", type=int, default=16, help="requests per phase")
    parser.add_argument("--name", help="the profile's name (default: cpu-2core-tiny-qwen2-vl; gpu-<checkpoint>)")
    args = parser.parse_args(argv)
    if args.url and not (args.metrics and args.pid):
        parser.error("--url needs --metrics and --pid")
    refuse_with_url(parser, args, keep=("checkpoint",))  # --checkpoint with --url: its config gives the KV size
    if not args.url:
        try:
            served_topology(args)
        except TopologyError as err:
            parser.error(str(err))
    doc = _profile(Session(_running(args)), args) if args.url else _serve(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    save(Profile(doc).check(), args.out)
    print(json.dumps({k: v for k, v in doc.items() if k not in ("cpu_ms_per_request", "by_load_phases")}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
