"""The overload benchmark's table, its checks against the issue's targets, and its plot (``clients.bench.overload``)."""
from __future__ import annotations

import math
from pathlib import Path


def tables(results: dict) -> str:
    target = results.get("first_token_target_ms") or 0
    head = (f"SLO: TTFT <= {results['slo_ms']} ms (light-load p50 {results['light_ttft_p50_ms']} ms); capacity "
            f"{results['capacity_rps']} req/s; {results['seconds']:g} s of arrivals per level; "
            f"{results['high_share']:.0%} high priority; epd's first-token target "
            f"{f'{target:g} ms' if target else 'off (fixed budgets)'}\n\n")
    rows = ["| deployment | load | class | sent | served | goodput /s | TTFT p50 ms | TTFT p99 ms | shed | shed answered "
            "p99 / max ms | expired | lost + hung | server RSS MiB | gate limits after the level |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for run in results["runs"]:
        for cls in ("high", "low", "all"):
            s = run[cls]
            rows.append(f"| {run['model']} | {run['load']:g}x ({run['rate']:g}/s) | {cls} | {s['sent']} | {s['served']} | "
                        f"{s['goodput']:.2f} | {s['ttft_p50_ms']} | {s['ttft_p99_ms']} | {s['shed']} ({s['shed_rate']:.0%}) | "
                        f"{s['shed_answer_p99_ms']} / {s['shed_answer_max_ms']} | {s['expired']} | "
                        f"{s['lost'] + s['hung']} | {run['rss_mib'] if cls == 'all' else ''} | "
                        f"{_limits(run) if cls == 'all' else ''} |")
    return head + "\n".join(rows) + "\n"


def _limits(run: dict) -> str:
    """The generator gates' limits read after the level (``first_token_target_ms``; empty: fixed budgets)."""
    return ", ".join(f"{stage} {value:g}" for stage, value in run.get("limits", {}).items())


def _run(results: dict, model: str, load: float) -> dict | None:
    return next((r for r in results["runs"] if r["model"] == model and r["load"] == load), None)


def checks(results: dict) -> str:
    """The issue's targets, each with the figure it rests on (``n/a`` where the run has no such level)."""
    lines = [f"Targets (epd, {results.get('split', 'E+PD')}; the same figures for epd_open beside them):"]
    for name in ("epd", "epd_open"):
        two, half = _run(results, name, 2.0), _run(results, name, 0.5)
        runs = [r for r in results["runs"] if r["model"] == name]
        best = max((r["all"]["goodput"] for r in results["runs"]), default=0.0)  # the peak of any run
        ratio = two["all"]["goodput"] / best if two and best else math.nan
        high = two["high"]["ttft_p99_ms"] / half["high"]["ttft_p99_ms"] if two and half else math.nan
        shed_max = two["all"]["shed_answer_max_ms"] if two and two["all"]["shed"] else math.nan
        missing = sum(r["all"]["shed_without_retry_after"] for r in runs)
        lost = sum(r["all"]["lost"] + r["all"]["hung"] + r["all"]["broken"] for r in runs)
        rss = [r["rss_mib"] for r in runs]
        lines.append(f"- {name}: goodput at 2x / the peak of any run = {ratio:.2f} (target >= 0.90); high class TTFT p99 at 2x / at "
                     f"0.5x = {high:.2f} (target <= 1.5); slowest shed answer at 2x {shed_max} ms (target <= 50), "
                     f"{missing} shed without Retry-After; lost or hung {lost} (target 0, every level); server RSS {min(rss, default=0)}"
                     f"-{max(rss, default=0)} MiB over the levels")
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> None:
    """Goodput and the high class's TTFT p99 against the load, both deployments."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for model, style in (("epd", "o-"), ("epd_open", "s--")):
        runs = sorted((r for r in results["runs"] if r["model"] == model), key=lambda r: r["load"])
        loads = [r["load"] for r in runs]
        left.plot(loads, [r["all"]["goodput"] for r in runs], style, label=f"{model} all")
        left.plot(loads, [r["high"]["goodput"] for r in runs], style, alpha=0.5, label=f"{model} high")
        right.plot(loads, [r["high"]["ttft_p99_ms"] for r in runs], style, label=f"{model} high")
        right.plot(loads, [r["low"]["ttft_p99_ms"] for r in runs], style, alpha=0.5, label=f"{model} low")
    left.set(xlabel="offered load (x capacity)", ylabel=f"goodput (req/s within {results['slo_ms']} ms TTFT)")
    right.set(xlabel="offered load (x capacity)", ylabel="TTFT p99 (ms, served requests)", yscale="log")
    right.axhline(results["slo_ms"], color="grey", lw=0.8)
    for axis in (left, right):
        axis.legend(fontsize=8)
        axis.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
