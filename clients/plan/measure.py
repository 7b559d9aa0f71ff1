"""Measure a stage profile (``clients.plan.profile``) against a running E+PD deployment.

    python -m clients.plan.measure --out docs/results/data/plan-2026-12-05/profile-cpu.json   # starts one server
    python -m clients.plan.measure --url 127.0.0.1:8001 --metrics http://127.0.0.1:8002/metrics --pid PID --out P.json

Every line is CPU work, per process, so the simulator's sharing of the cores makes the waits (a wall time measured
under load would count them twice). Phases of requests, one at a time (no contention), each on fresh images: text
only; one image at four sizes; four images a request; one video; a longer answer. Read per phase: the CPU of each process of the server's group (``proc_cpu``: ``stub
encoder``, ``EngineCore pd``, ``stub pd``, ``stub epd`` + ``tritonserver``, the load generator), vLLM's prompt tokens
(``epd_vllm_prompt_tokens_total``), the orchestrator's ``timings`` (``transfer_ms``, ``transfer_bytes``). Fitted
(``fit``): encoder item and batch lines, media tokens per item, prefill and decode steps, the stub's, orchestrator's
and client's per request and per streamed token, the same-host pull. Not measured here: the cross-host (NIXL) pull and
E/P/D's KV pull (``derived`` says where they come from). Then the by-load step (``with_by_load``, validate's too):
every process's CPU per request and per token by load (``clients.plan.loads``: closed loops of 1, 2, 8 and 24, short
and long answers): the profile's ``by_load`` rows, the decode step by batch fitted through the engine's, the stub's
send interval at each load; and the calibration on the load-1 phase's TTFT with the background measured during it:
``before_first_token`` and ``hop``, what light-load TTFT has beyond the CPU work (the gRPC hops' latency).
"""
from __future__ import annotations

import argparse
import json
import os
import time
import urllib.request
from pathlib import Path

from clients.bench.load import synthetic_requests, synthetic_video_requests
from clients.bench.proc_cpu import per_request, snapshot_of
from clients.bench.report import parse_metrics, percentile
from clients.plan.deployments import Served, grpc_run, single
from clients.plan.profile import Line, Profile, fit, save

SIZES = (64, 160, 256, 384)
SHORT, LONG = 16, 80  # greedy tokens of the phases, and of the longer answers


class Session:
    """The server under measurement (a ``deployments.Served`` with its ``metrics`` URL) and the first seed of the
    next phase's requests."""

    def __init__(self, served: Served):
        self.served, self.seed = served, 1000

    def _tokens(self) -> float:
        text = urllib.request.urlopen(self.served.metrics, timeout=10).read().decode()
        return parse_metrics(text, "epd_vllm_prompt_tokens_total").get(("epd_vllm_prompt_tokens_total", "pd"), 0.0)

    def phase(self, make, count: int, concurrency: int = 1) -> dict:
        """``count`` requests ``make(count, first_seed)``: CPU ms per request per process, prompt tokens per request,
        the samples."""
        requests = make(count, self.seed)
        self.seed += count * 10
        cpu0, tokens0 = snapshot_of(self.served.pids()), self._tokens()
        samples, errors, wall = self.served.run(requests, concurrency)
        time.sleep(1.5)  # the counters are handed to Triton every 0.25 s
        if errors:
            raise RuntimeError(f"measure: {len(errors)} requests failed: {errors[0]}")
        cpu = per_request(cpu0, snapshot_of(self.served.pids()), count)
        return {"cpu": cpu, "prompt_tokens": (self._tokens() - tokens0) / count, "samples": samples,
                "wall": wall, "count": count}


def _cpu(phase: dict, *labels: str) -> float:
    return sum(phase["cpu"].get(label, 0.0) for label in labels)


def _mean(phase: dict, key: str) -> float:
    values = [s.timings.get(key, 0.0) for s in phase["samples"]]
    return sum(values) / len(values)


def images(size: int, count: int = 1, tokens: int = SHORT):
    return lambda n, seed: synthetic_requests(n, count, [(size, size)], tokens, first=seed)


def run_phases(session: Session, repeat: int) -> dict:
    phases = {"text": session.phase(images(64, 0), repeat)}
    for size in SIZES:
        phases[f"image{size}"] = session.phase(images(size), repeat)
    phases["batch4"] = session.phase(images(160, 4), repeat)
    phases["video"] = session.phase(lambda n, seed: synthetic_video_requests(n, 1, (64, 64), 8, 4.0, SHORT, seed), repeat)
    phases["long"] = session.phase(images(64, tokens=LONG), repeat)
    return phases


def lines(phases: dict) -> dict:
    """The profile's lines from the phases (module docstring)."""
    orchestrator, engine = ("stub epd", "tritonserver"), ("EngineCore pd",)
    text_tokens = phases["text"]["prompt_tokens"]
    kpix = {size: size * size / 1000 for size in SIZES}
    per_token = {name: (_cpu(phases["long"], *labels) - _cpu(phases["image64"], *labels)) / (LONG - SHORT)
                 for name, labels in (("engine", engine), ("stub", ("stub pd",)), ("orchestrator", orchestrator),
                                      ("client", ("load generator",)))}
    single = fit([(kpix[s], _cpu(phases[f"image{s}"], "stub encoder")) for s in SIZES])
    item160 = (_cpu(phases["batch4"], "stub encoder") - single.at(kpix[160])) / 3
    batch = Line(max(0.0, single.at(kpix[160]) - item160), 0.0)
    image = Line(item160 - single.slope * kpix[160], single.slope)
    video_units = 8 * 64 * 64 / 1000
    video = Line(0.0, max(0.0, _cpu(phases["video"], "stub encoder") - batch.base) / video_units)
    prefill = fit([(p["prompt_tokens"], _cpu(p, *engine) - (SHORT - 1) * per_token["engine"])
                   for name, p in phases.items() if name == "text" or name.startswith("image")])
    decode = Line(per_token["engine"], 0.0)  # at batch 1; by batch: ``loads.decode_line`` (``measure``)
    transfer = fit([(s.timings.get("transfer_bytes", 0) / 2**20, s.timings.get("transfer_ms", 0.0))
                    for name, p in phases.items() if name.startswith("image") for s in p["samples"]])
    media = [(kpix[s], phases[f"image{s}"]["prompt_tokens"] - text_tokens) for s in SIZES]
    pulled = sum(_mean(phases[f"image{s}"], "transfer_ms") for s in SIZES) / len(SIZES)

    def per_request(name: str, labels, less: float = 0.0) -> dict:
        base = _cpu(phases["image64"], *labels) - SHORT * per_token[name] - less
        return Line(max(0.0, base), max(0.0, per_token[name])).as_dict()

    media_tokens = phases["image256"]["prompt_tokens"] - text_tokens
    return {"encoder": {"batch": batch.as_dict(), "image": image.as_dict(), "video": video.as_dict()},
            "tokens": {"image": fit(media).as_dict(),
                       "video": Line(0.0, (phases["video"]["prompt_tokens"] - text_tokens) / video_units).as_dict()},
            "prefill": Line(max(0.0, prefill.base), max(0.0, prefill.slope)).as_dict(),
            "decode": Line(max(0.0, decode.base), max(0.0, decode.slope)).as_dict(), "decode_context": Line().as_dict(),
            "transfer": {"shared_memory": Line(max(0.0, transfer.base), max(0.0, transfer.slope)).as_dict()},
            "embedding_bytes_per_token": round(_mean(phases["image256"], "transfer_bytes") / max(media_tokens, 1), 1),
            "stub": per_request("stub", ("stub pd",), pulled), "orchestrator": per_request("orchestrator", orchestrator),
            "client": per_request("client", ("load generator",)), "text_tokens": text_tokens,
            "light_tpot_ms": percentile([s.tpot * 1000 for s in phases["long"]["samples"] if s.tpot], 50),
            "cpu_ms_per_request": {name: p["cpu"] for name, p in phases.items()}}


def calibrate(doc: dict, layout) -> dict:
    """Fit the light load (simulated at concurrency 1, image 64 px, on ``layout``) against ``light_ttft_ms``: the
    share of the per-request work done before the first token (``before_first_token``), and ``hop``, what TTFT has
    beyond all of it (0 where the share is below 1). Called by ``with_by_load``."""
    from clients.plan.simulate import simulate
    from clients.plan.workload import closed

    workload = closed(1, 20, round(doc["text_tokens"]), SHORT)

    def ttft(share: float) -> float:
        trial = {**doc, "before_first_token": share, "hop": Line().as_dict()}
        return simulate(layout, Profile(trial), workload)["ttft_p50_ms"]

    low, high, measured = ttft(0.0), ttft(1.0), doc["light_ttft_ms"]
    share = 1.0 if high <= low else min(1.0, max(0.0, (measured - low) / (high - low)))
    return {**doc, "before_first_token": round(share, 3), "hop": Line(max(0.0, measured - high), 0.0).as_dict()}


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
    (``light_background``). The by-load step of ``measure`` and of ``clients.plan.validate.measured_profile``."""
    from clients.plan import loads

    got = loads.by_load(served, long=long)
    doc = {k: v for k, v in doc.items() if k != "engine_after_ms"}  # the engine's by-load row has all its CPU
    doc.update(by_load=got["by_load"], light_ttft_ms=got["light_ttft_ms"], by_load_phases=got["phases"],
               decode=loads.decode_line(got["by_load"]["engine"]).as_dict(), by_load_measured=time.strftime("%F %T"))
    doc["send_interval_by_load"] = fit_intervals(doc, layout, got["merging"], long, served.replicas)
    doc["light_background"] = {"step_s": loads.WINDOW, "cores": got["series"]}
    fitted = calibrate({**doc, "background": doc["light_background"]}, layout)
    return {k: v for k, v in fitted.items() if k != "background"}


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


def _serve(args) -> dict:
    """``measure`` on a server of its own (``deployments.single``: ``--topology``'s E+PD), after a warm-up."""
    with single(args) as served:
        session = Session(served)
        session.phase(images(64), 3)  # warm-up
        return measure(session, args.repeat, args.name)


def _running(args) -> Served:
    """The server at ``--url`` (its metrics at ``--metrics``, its processes ``--pid``'s group)."""
    from backend.deploy.local_server import group_members

    return Served("measure", grpc_run(args.url), lambda: group_members(args.pid), metrics=args.metrics)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Measure a stage profile against an E+PD deployment.")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--topology", default="topologies/cpu-e-pd.yaml", help="served when no --url is given")
    parser.add_argument("--url", help="a running server's gRPC address (with --metrics and --pid)")
    parser.add_argument("--metrics", help="its metrics URL")
    parser.add_argument("--pid", type=int, help="its tritonserver's pid (the CPU of its process group)")
    parser.add_argument("--repeat", type=int, default=16, help="requests per phase")
    parser.add_argument("--name", default="cpu-2core-tiny-qwen2-vl")
    args = parser.parse_args(argv)
    if args.url and not (args.metrics and args.pid):
        parser.error("--url needs --metrics and --pid")
    doc = measure(Session(_running(args)), args.repeat, args.name) if args.url else _serve(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    save(Profile(doc).check(), args.out)
    print(json.dumps({k: v for k, v in doc.items() if k != "cpu_ms_per_request"}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
