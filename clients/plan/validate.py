"""The simulator against measured runs, side by side (docs/planning.md, "Checked against measured runs"): a benchmark.

    python -m clients.plan.validate --profile docs/results/data/plan-2026-12-05/profile-cpu.json --measure-profile \
        --levels 1,4,16 --requests 48 --repeats 3 --out /tmp/plan-validate    # root for the hosts deployment

Two deployments, each started fresh (``clients.plan.deployments``: ``single``, one tritonserver serving E+PD, gRPC
streaming client; ``hosts``, E+PD over network namespaces with ``--pd-replicas`` pd hosts, HTTP client). With
``--measure-profile`` each deployment's processes' CPU by load (``clients.plan.loads``) is measured on it right
before its levels, merged into ``--profile`` and calibrated on its light-load TTFT (written as ``profile-<name>.json``
under ``--out``); on ``single`` the phases' lines are measured first (``clients.plan.measure``: encoder, media tokens,
prefill, the relays; ``--phase-requests`` a phase), which ``hosts`` then takes: every line of the run's window. At
each closed-loop concurrency of ``--levels`` the same one-image requests (``--image-sizes`` in turn, ``--max-tokens``
greedy tokens, ignore_eos) are measured ``--repeats`` times; around each repetition the
machine's background load (busy cores not this deployment's) is read and the simulator predicts that repetition on
the cores it left (``Profile.with_cores``). The cores' speed is probed during every phase (``clients.bench.speed``; the
2-core machines switch between two speeds ~1.65x apart every few seconds) and recorded beside each repetition as a
factor over the speed during the profile's by-load rows; ``--speed-probe`` scales the profile's CPU costs by it
(``Profile.at_speed``; measured 2026-12-07: better for one deployment, worse for the other, so not the default).
Printed: one table, the medians over the repetitions of measured and predicted req/s, TTFT p50 and p90, the error of
each (predicted / measured - 1), the background and the speed factor.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

from backend.deploy.schema import TopologyError
from clients.bench import speed
from clients.bench.load import synthetic_requests
from clients.bench.replicas import WORKERS, _sizes
from clients.bench.report import percentile, summarise
from clients.bench.served import served_arguments
from clients.plan import loads
from clients.plan import profile as profiles
from clients.plan import measure_gpu
from clients.plan.deployments import DEPLOYMENTS, served_topology
from clients.plan.measure import lines, run_phases, with_by_load
from clients.plan.phases import Session
from clients.plan.profile import Profile
from clients.plan.simulate import Layout, simulate
from clients.plan.workload import closed

FIGURES = ("req_per_s", "ttft_p50_ms", "ttft_p90_ms")
TOLERANCE = 0.15


def measured_profile(served, base: Profile | None, layout: Layout, long: int, repeat: int) -> Profile:
    """``base`` (less the CPU per request of the phases it was measured with) with ``served``'s CPU by load measured
    now and calibrated on its light-load TTFT (``measure.with_by_load``); on a deployment with one metrics endpoint
    (``single``) the phases' lines first (``with_lines``), in this run's window too. A deployment whose engines run on
    a GPU: its whole profile measured now (``clients.plan.measure_gpu``; ``base`` is not read)."""
    served.run(loads.requests_for(8, loads.SHORT, 900_000), 4)  # warm-up
    if served.device == "gpu":
        name = f"gpu-{(served.checkpoint or Path('checkpoint')).name}"
        return Profile(measure_gpu.measure(Session(served), 16, name, served.checkpoint)).check()
    doc = {k: v for k, v in base.doc.items() if k != "cpu_ms_per_request"}
    if served.metrics:
        doc = with_lines(doc, lines(run_phases(Session(served), repeat)))
    return Profile(with_by_load(doc, served, layout, long)).check()


def with_lines(doc: dict, measured: dict) -> dict:
    """``doc`` with the lines of ``clients.plan.measure.lines`` measured now (encoder, media tokens, prefill, decode at
    batch 1, the relays, the same-host pull; the cross-host pull and KV pull of ``doc`` kept): a profile measured on
    another day predicted a window whose encoder was 2.5x faster (docs/planning.md, "Run 5")."""
    measured = {k: v for k, v in measured.items() if k != "cpu_ms_per_request"}
    return {**doc, **measured, "transfer": {**doc.get("transfer", {}), **measured["transfer"]},
            "lines_measured": time.strftime("%F %T")}


def measure_level(served, profile: Profile, layout: Layout, level: int, args, seed: int) -> list[dict]:
    """``--repeats`` closed loops at ``level``, each with its prediction on the cores its background left."""
    warm = synthetic_requests(args.warmup, 1, args.image_sizes, args.max_tokens, first=100_000 + seed)
    served.run(warm, level)
    out = []
    for rep in range(args.repeats):
        made = synthetic_requests(args.requests, 1, args.image_sizes, args.max_tokens, first=seed + rep * args.requests)
        got = loads.phase(served, made, level)
        measured = summarise(served.name, "concurrency", level, got["samples"], len(got["errors"]), got["wall"])
        slower = speed.factor(got["speed_ms"], profile.doc.get("speed_probe_ms"))
        at = profile.at_speed(slower) if args.speed_probe else profile
        predicted = predict(at.with_background(loads.WINDOW, got["series"]), layout, level, args)
        out.append({"measured": {k: measured[k] for k in FIGURES}, "predicted": {k: predicted[k] for k in FIGURES},
                    "errors": len(got["errors"]), "background": round(got["background"], 3), "series": got["series"],
                    "utilisation": predicted["utilisation"], "at": time.strftime("%T"), "cpu_ms_per_request": got["cpu"],
                    "speed": {"probe_ms": got["speed_ms"], "factor": round(slower, 4), "applied": args.speed_probe},
                    "responses_per_request": {"measured": round(got["responses"], 2),
                                              "predicted": round(predicted["responses_per_request"], 2)},
                    "stages_p50_ms": stages(got["samples"])})
        print(f"{served.name} c={level} rep {rep}: {measured['req_per_s']:.2f} req/s measured, "
              f"{predicted['req_per_s']:.2f} predicted, background {got['background']:.2f} cores, "
              f"cores probed at {slower:.2f}x the profile's time", flush=True)
    return out


def layouts(args, served=None) -> dict[str, Layout]:
    """The layout the simulator gives each deployment (``served``: the running one's encoder instances and engines'
    ``max_num_seqs``; a run's ``validation.json`` records the one it used)."""
    instances = served.encoder_instances if served else 1
    seqs = int(served.engine_args.get("max_num_seqs", 32)) if served else 32
    return {"single": Layout(split="E+PD", encoder_instances=instances, max_num_seqs=seqs),
            "hosts": Layout(split="E+PD", pd=args.pd_replicas, transfer_path="nixl")}


def predict(profile, layout: Layout, level: int, args) -> dict:
    text = round(profile.doc.get("text_tokens", 16))
    return simulate(layout, profile, closed(level, args.requests, text, args.max_tokens, args.image_sizes))


def stages(samples: list) -> dict:
    """The orchestrator's own timings (p50): its encoder call, its first chunk and its whole request."""
    return {key: percentile([s.timings[key] for s in samples if key in s.timings], 50)
            for key in ("encode_ms", "transfer_ms", "first_chunk_ms", "total_ms") if any(key in s.timings for s in samples)}


def compare(name: str, level: int, reps: list[dict], layout: Layout) -> dict:
    """One row: the medians over the repetitions of each figure, measured and predicted, and their error."""
    row = {"topology": name, "concurrency": level, "layout": dataclasses.asdict(layout),
           "errors": sum(r["errors"] for r in reps),
           "background": statistics.median(r["background"] for r in reps),
           "utilisation": reps[len(reps) // 2]["utilisation"], "repeats": reps}
    if all("speed" in r for r in reps):  # probed (runs from 2026-12-07 22:00 on)
        row["speed"] = statistics.median(r["speed"]["factor"] for r in reps)
    for key in FIGURES:
        m = statistics.median(r["measured"][key] for r in reps)
        p = statistics.median(r["predicted"][key] for r in reps)
        row[key] = {"measured": m, "predicted": p, "error": p / m - 1 if m else None}
    return row


def table(rows: list[dict]) -> str:
    """The validation's table; a run whose repetitions were probed (``speed``) has the cores' time column too."""
    probed = any("speed" in r for r in rows)
    lines = ["| topology | c | req/s measured / predicted (err) | TTFT p50 ms measured / predicted (err) | "
             "TTFT p90 ms measured / predicted (err) | within 15% | background cores | "
             + ("cores' time (x profile's) | " if probed else "") + "predicted utilisation |",
             "|---|---|---|---|---|---|---|---|" + ("---|" if probed else "")]
    for r in rows:
        cells = []
        for name in FIGURES:
            f = r[name]
            digits = 2 if name == "req_per_s" else 0
            cells.append(f"{f['measured']:.{digits}f} / {f['predicted']:.{digits}f} ({f['error']:+.0%})")
        within = all(r[n]["error"] is not None and abs(r[n]["error"]) <= TOLERANCE for n in FIGURES)
        busy = ", ".join(f"{k} {v:.0%}" for k, v in r["utilisation"].items())
        speed_cell = f" {r.get('speed', 1.0):.2f} |" if probed else ""
        lines.append(f"| {r['topology']} | {r['concurrency']} | " + " | ".join(cells) +
                     f" | {'yes' if within else 'no'} | {r['background']:.2f} |{speed_cell} {busy} |")
    return "\n".join(lines)


def run(name: str, base: Profile | None, args, levels: list[int]) -> tuple[list[dict], Profile]:
    """One deployment: its profile (measured now, with ``--measure-profile``), then every level's rows."""
    with DEPLOYMENTS[name](args) as served:
        layout = layouts(args, served)[name]
        profile = measured_profile(served, base, layout, args.max_tokens, args.phase_requests) \
            if args.measure_profile else base
        if args.out and args.measure_profile:
            profiles.save(profile, args.out / f"profile-{name}.json")
        return [compare(name, level, measure_level(served, profile, layout, level, args, seed=i * 1000), layout)
                for i, level in enumerate(levels)], profile


def arguments() -> argparse.ArgumentParser:
    """The command line (also how ``replay`` reads a run's own arguments back from its ``validation.json``)."""
    parser = argparse.ArgumentParser(description="Simulated against measured: req/s and TTFT, two deployments.")
    parser.add_argument("--profile", type=Path, help="the profile predicted with (with --measure-profile on a GPU "
                                                     "deployment: not needed, its whole profile is measured)")
    parser.add_argument("--measure-profile", action="store_true",
                        help="measure each deployment's CPU by load right before its levels (clients.plan.loads), "
                             "and on single the phases' lines (clients.plan.measure)")
    parser.add_argument("--phase-requests", type=int, default=16, help="requests per phase of the lines (--repeat "
                                                                      "of clients.plan.measure)")
    parser.add_argument("--deployments", default="single,hosts")
    parser.add_argument("--levels", default="1,4,16", help="closed-loop concurrencies")
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each level (the table: their medians)")
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--image-sizes", type=_sizes, default=_sizes("64x48,80x64,96x96,112x112"))
    parser.add_argument("--topology", default="topologies/cpu-e-pd.yaml", help="the single server's")
    served_arguments(parser)
    parser.add_argument("--pd-replicas", type=int, default=2, help="the hosts deployment's pd hosts")
    parser.add_argument("--speed-probe", action="store_true",
                        help="predict each repetition on the profile scaled by the cores' speed probed during it over "
                             "their speed during the profile's by-load rows (clients.bench.speed; probed and recorded "
                             "either way)")
    parser.add_argument("--out", type=Path)
    return parser


COMMAND = "python -m clients.plan.validate"  # validation.json's command starts so


def main(argv: list[str] | None = None) -> int:
    parser = arguments()
    args = parser.parse_args(argv)
    levels = [int(v) for v in args.levels.split(",")]
    chosen = args.deployments.split(",")
    if "hosts" in chosen and (os.geteuid() != 0 or max(levels + list(loads.LOADS)) > WORKERS):
        parser.error(f"hosts: needs root (network namespaces) and levels of at most {WORKERS}")
    if args.repeats < 1 or any(name not in DEPLOYMENTS for name in chosen):
        parser.error(f"--repeats: 1 or more; --deployments: of {', '.join(DEPLOYMENTS)}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
    try:
        device = served_topology(args).stages["pd"].device if "single" in chosen else "cpu"
    except TopologyError as err:
        parser.error(str(err))
    if args.profile is None and not (args.measure_profile and chosen == ["single"] and device == "gpu"):
        parser.error("--profile is needed (without it: --measure-profile on a GPU deployment, single)")
    base, rows = (profiles.load(args.profile) if args.profile else None), []
    started, load = time.strftime("%F %T"), os.getloadavg()
    for name in chosen:  # a later deployment takes the lines the one before measured (hosts: single's)
        got, base = run(name, base, args, levels)
        rows += got
    text = table(rows)
    print(text)
    if args.out:
        doc = {"command": shlex.join([*COMMAND.split(), *(argv if argv is not None else sys.argv[1:])]),
               "started": started, "ended": time.strftime("%F %T"), "load_average": {"started": load, "ended": os.getloadavg()},
               "rows": rows}
        (args.out / "validation.json").write_text(json.dumps(doc, indent=1))
        (args.out / "validation.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
