"""At scale, on paper: the planner's choice against a 1:1:1 E/P/D split and against the same GPUs running ``llm``
replicas, per workload and budget, simulated on a (derived) GPU profile; one table and one plot.

    python -m clients.plan.scale --profile docs/results/data/plan-2026-12-05/profile-h200-derived.json \
        --workloads docs/results/data/plan-2026-12-05/workloads --budgets 8,64,512 --out docs/results/data/plan-2026-12-05/scale

The offered rate: ``LOAD`` of the best analytic capacity (``planner.capacity``) of any split of the budget, the
workload's own rate set aside; the SLO the workload's. Every option runs on the orchestrators that rate needs
(``orchestrators_for``: one per 8 GPUs at least) and a client of as many threads (the users). Budgets above
``planner.SLICE`` are simulated as a slice of that many GPUs at the matching share of the rate, the figures scaled
back (so 64 and 512 differ from 8 by the ratio's granularity, not by pooling). A workload with a modality the
profile has no line for is named and left out.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import replace
from pathlib import Path

from clients.plan import profile as profiles
from clients.plan import workload as workloads
from clients.plan.planner import SLICE, capacity, candidates, demands, plan, run
from clients.plan.simulate import Layout

OPTIONS = ("planned", "1:1:1", "llm")
LOAD = 0.9  # the offered rate: this share of the best analytic capacity any split of the budget has
ORCHESTRATOR_LOAD = 0.5  # the share of an orchestrator's thread its per-request line may take at the offered rate


def baseline(option: str, gpus: int) -> Layout:
    if option == "llm":
        return Layout(split="llm", llm=gpus)
    third = gpus // 3
    return Layout(split="E/P/D", encoders=third, prefill=third, decode=gpus - 2 * third)


def orchestrators_for(profile, workload, rate: float, gpus: int) -> int:
    """Orchestrators enough for ``rate`` requests/s at ``ORCHESTRATOR_LOAD`` of their thread (the profile's
    per-request line at the workload's mean output, a response a token: an upper bound, the relays coalesce under
    load), and one per 8 GPUs at least. They are host processes, not GPUs: a measured profile's orchestrator (7 ms a
    request and 0.5 ms a streamed token on the H100) saturated one thread per 8 GPUs at the rates the GPUs serve."""
    requests = workload.draw()[:200]
    output = sum(r.output_tokens for r in requests) / len(requests)
    ms = profile.cost("orchestrator", 0).at(output)
    return max(1, math.ceil(gpus / 8), math.ceil(rate * ms / 1000 / ORCHESTRATOR_LOAD))


def _rounded(value, digits: int | None = None):
    """``round`` that keeps NaN (no request served: no percentile) as None."""
    return None if value is None or math.isnan(value) else round(value, digits)


def cell(profile, workload, budget: int, simulate: int) -> dict:
    """The three options at one budget: layout label, goodput, TTFT and TPOT p90, per option."""
    if profile.cores:  # the planner budgets a CPU profile's cores, unsliced: scaling by GPUs would not hold
        raise ValueError(f"{profile.doc.get('name')}: a CPU profile ({profile.cores} cores); the at-scale tables "
                         "need a GPU profile")
    base = Layout(encoder_instances=4, transfer_path="nixl")
    need = demands(profile, workload, base.max_num_seqs, base.encoder_instances)
    best = max(capacity(c, need) for c in candidates(min(budget, SLICE), ["E+PD", "E/P/D", "llm"], base))
    rate = LOAD * best * budget / min(budget, SLICE)
    orchestrators = orchestrators_for(profile, workload, LOAD * best, min(budget, SLICE))
    base = replace(base, orchestrators=orchestrators, clients=orchestrators)
    scaled = workload.with_load(rate=rate)
    planned = plan(profile, scaled, budget, "goodput", ("E+PD", "E/P/D"), base, simulate)
    out = {"workload": workload.name, "gpus": budget, "rate": round(rate, 2)}
    slice_gpus = min(budget, SLICE)
    factor = budget / slice_gpus
    small = scaled.with_load(rate=rate / factor)
    for option in OPTIONS:
        if option == "planned":
            label = planned["chosen"].label() if planned["chosen"] else "none"
            result = planned.get("result") or {}
        else:
            layout = replace(baseline(option, slice_gpus), orchestrators=orchestrators, clients=orchestrators,
                             encoder_instances=4, transfer_path="nixl")
            result, _ = run(layout, profile, small)
            label = baseline(option, budget).label()
        out[option] = {"layout": label, "goodput": round(result.get("goodput", 0.0) * factor, 2),
                       "ttft_p90_ms": _rounded(result.get("ttft_p90_ms")),
                       "tpot_p90_ms": _rounded(result.get("tpot_p90_ms"), 1)}
    return out


def table(rows: list[dict]) -> str:
    lines = ["| workload | GPUs | rate /s | planned | goodput /s | TTFT p90 ms | 1:1:1 goodput | TTFT p90 | llm "
             "goodput | TTFT p90 | planned / llm |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        p, e, lm = r["planned"], r["1:1:1"], r["llm"]
        ratio = f"{p['goodput'] / lm['goodput']:.2f}x" if lm["goodput"] else "-"
        ttft = {k: "-" if r[k]["ttft_p90_ms"] is None else r[k]["ttft_p90_ms"] for k in OPTIONS}
        lines.append(f"| {r['workload']} | {r['gpus']} | {r['rate']} | {p['layout']} | {p['goodput']} | "
                     f"{ttft['planned']} | {e['goodput']} | {ttft['1:1:1']} | {lm['goodput']} | "
                     f"{ttft['llm']} | {ratio} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sorted({r["workload"] for r in rows})
    fig, axes = plt.subplots(1, len(names), figsize=(4 * len(names), 3.5), squeeze=False)
    for ax, name in zip(axes[0], names):
        mine = [r for r in rows if r["workload"] == name]
        for option in OPTIONS:
            ax.plot([r["gpus"] for r in mine], [r[option]["goodput"] / r["rate"] for r in mine], marker="o",
                    label=option)
        ax.set_xscale("log", base=2)
        ax.set_title(name)
        ax.set_xlabel("GPUs")
        ax.set_ylim(0, 1.05)
    axes[0][0].set_ylabel("goodput / offered rate")
    axes[0][-1].legend()
    fig.suptitle(f"within the SLO, simulated on {title}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="The planner at scale against 1:1:1 and llm replicas.")
    parser.add_argument("--profile", type=Path, required=True)
    parser.add_argument("--workloads", type=Path, required=True, help="a folder of workload files")
    parser.add_argument("--budgets", default="8,64,512")
    parser.add_argument("--simulate", type=int, default=4)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    profile = profiles.load(args.profile)
    rows, skipped = [], []
    for path in sorted(args.workloads.glob("*.yaml")):
        workload = workloads.load(path)
        try:
            for budget in (int(b) for b in args.budgets.split(",")):
                rows.append(cell(profile, workload, budget, args.simulate))
                print(json.dumps(rows[-1]), flush=True)
        except profiles.ProfileError as err:  # a modality the profile has no line for (an image-only checkpoint's)
            rows = [r for r in rows if r["workload"] != workload.name]
            skipped.append(f"{workload.name}: not simulated: {err}")
            print(skipped[-1], file=sys.stderr, flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "scale.json").write_text(json.dumps(rows, indent=1) + "\n")
    text = "\n".join([table(rows), *(f"\n{line}" for line in skipped)])
    (args.out / "scale.md").write_text(text + "\n")
    device = profile.doc.get("device") or "a derived profile"
    if rows:
        plot(rows, args.out / "scale.png", f"the profile {profile.name} ({device})")
    print(text)
    return 0 if rows else 1


if __name__ == "__main__":
    raise SystemExit(main())
