"""A validation run's predictions again, from its files, with where the time goes (docs/planning.md, "Checked against
measured runs"): which stage the model gets wrong where a row misses.

    python -m clients.plan.replay docs/results/data/plan-2026-12-05/run3

Reads ``validation.json`` and ``profile-<topology>.json`` (``clients.plan.validate --measure-profile --out``), predicts
every repetition again on its recorded background (the simulator is deterministic: the figures equal the recorded
ones, which is checked), and prints per row the medians over the repetitions, measured against predicted: the
orchestrator's encoder call (``encode_ms``), its first chunk (measured: from its start; predicted: the engine's first
token, from the client's send) and the client's TTFT; then the validation's own table with these predictions
(``--out FILE``: also written there), which differs from the run's where the model changed since (the drift line
says by how much; exit status 1). ``--set KEY=JSON`` (repeatable; ``null`` removes the key) predicts with the
profiles changed: what a fitted figure is worth on the run's own files, e.g.
``--set engine_first_token_by_load=null`` (then the drift is the change's effect); ``--at-profile-speed`` and
``--at-probed-speed`` predict without and with the speed probes' scaling (``clients.bench.speed``; else as the run
did).
"""
from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
from pathlib import Path

from clients.plan import profile as profiles
from clients.plan.loads import WINDOW
from clients.plan.simulate import Layout
from clients.plan import validate
from clients.plan.validate import COMMAND, FIGURES, arguments, layouts, predict


def run_arguments(command: str) -> argparse.Namespace:
    """The arguments the run was made with (its workload: requests, tokens, image sizes, replicas), read back from
    the command its ``validation.json`` records, with ``validate``'s own parser."""
    words = shlex.split(command)
    if words[:len(COMMAND.split())] != COMMAND.split():
        raise ValueError(f"not a clients.plan.validate command: {command!r}")
    return arguments().parse_args(words[len(COMMAND.split()):])


def _median(values: list) -> float:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else float("nan")


def replay_row(row: dict, profile, args) -> dict:
    """The row's repetitions predicted again: stage medians measured and predicted, and the largest difference from
    the recorded predictions (0 where the run's files reproduce it)."""
    layout = Layout(**row["layout"]) if "layout" in row else layouts(args)[row["topology"]]
    predicted = [predict(profile.at_speed(_factor(rep, args)).with_background(WINDOW, rep["series"]), layout,
                         row["concurrency"], args) for rep in row["repeats"]]
    drift = max(abs(p[key] - rep["predicted"][key]) / max(abs(rep["predicted"][key]), 1e-9)
                for p, rep in zip(predicted, row["repeats"]) for key in FIGURES)
    measured = [rep.get("stages_p50_ms", {}) for rep in row["repeats"]]
    again = [{**rep, "predicted": {k: p[k] for k in FIGURES}, "utilisation": p["utilisation"]}
             for p, rep in zip(predicted, row["repeats"])]
    return {"topology": row["topology"], "c": row["concurrency"], "drift": drift,
            "row": validate.compare(row["topology"], row["concurrency"], again, layout),
            "encode": (_median([m.get("encode_ms") for m in measured]), _median([p["encode_p50_ms"] for p in predicted])),
            "first": (_median([m.get("first_chunk_ms") for m in measured]),
                      _median([p["emitted_p50_ms"] for p in predicted])),
            "ttft": (row["ttft_p50_ms"]["measured"], _median([p["ttft_p50_ms"] for p in predicted]))}


def _factor(rep: dict, args) -> float:
    """The speed factor to predict the repetition with: the one it was predicted with (``speed.applied``; runs before
    the probe: 1), or ``--at-profile-speed``'s 1, or ``--at-probed-speed``'s probed factor."""
    probed = rep.get("speed", {})
    choice = getattr(args, "speed_choice", "recorded")
    if choice == "profile" or not probed:
        return 1.0
    return probed["factor"] if choice == "probed" or probed.get("applied", True) else 1.0


def _change(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise ValueError(f"expected KEY=JSON, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{key}: not JSON: {value!r} ({exc.msg})") from None


def _changed(profile, changes: dict):
    """``profile`` with its top-level keys set (a None value: removed)."""
    if not changes:
        return profile
    doc = {k: v for k, v in profile.doc.items() if changes.get(k, 0) is not None}
    return type(profile)({**doc, **{k: v for k, v in changes.items() if v is not None}})


def table(rows: list[dict]) -> str:
    lines = ["| topology | c | encoder call ms measured / predicted | first chunk (engine's first token) ms | "
             "TTFT p50 ms |", "|---|---|---|---|---|"]
    for r in rows:
        cells = [f"{r[k][0]:.0f} / {r[k][1]:.0f}" for k in ("encode", "first", "ttft")]
        lines.append(f"| {r['topology']} | {r['c']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="A validation run's predictions again, stage by stage.")
    parser.add_argument("run", type=Path, help="the --out folder of clients.plan.validate --measure-profile")
    parser.add_argument("--out", type=Path, help="write the validation's table with these predictions here")
    speed = parser.add_mutually_exclusive_group()
    speed.add_argument("--at-profile-speed", dest="speed_choice", action="store_const", const="profile",
                       default="recorded", help="predict on the profiles as measured (no speed probe's scaling)")
    speed.add_argument("--at-probed-speed", dest="speed_choice", action="store_const", const="probed",
                       help="predict on the profiles scaled by each repetition's probed speed (clients.bench.speed)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=JSON",
                        help="what if: the profiles' KEY set to JSON (null: removed), e.g. engine_thread_share=1")
    given = parser.parse_args(argv)
    run = given.run
    doc = json.loads((run / "validation.json").read_text())
    args = run_arguments(doc["command"])
    args.speed_choice = given.speed_choice
    try:
        changes = dict(_change(text) for text in given.set)
    except ValueError as exc:
        parser.exit(2, f"error: --set: {exc}\n")
    rows = [replay_row(row, _changed(profiles.load(run / f"profile-{row['topology']}.json"), changes), args)
            for row in doc["rows"]]
    print(table(rows))
    again = validate.table([r["row"] for r in rows])
    print(again)
    if given.out:
        given.out.write_text(again + "\n")
    worst = max(r["drift"] for r in rows)
    print(f"largest difference from the recorded predictions: {worst:.1%}")
    return 0 if worst < 1e-6 else 1


if __name__ == "__main__":
    sys.exit(main())
