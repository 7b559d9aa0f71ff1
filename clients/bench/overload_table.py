"""The overload benchmark's table, its checks against the issue's targets, and its plot (``clients.bench.overload``)."""
from __future__ import annotations

import math
from pathlib import Path

from clients.bench.overload_load import STAGE_TIMES
from clients.bench.report import percentile


def tables(results: dict) -> str:
    target = results.get("first_token_target_ms") or 0
    head = (f"SLO: TTFT <= {results['slo_ms']} ms (light-load p50 {results['light_ttft_p50_ms']} ms); capacity "
            f"{results['capacity_rps']} req/s; {results['seconds']:g} s of arrivals per level; "
            f"{results['high_share']:.0%} high priority; epd's first-token target "
            f"{f'{target:g} ms' if target else 'off (fixed budgets)'}"
            + (f"; the high class's reserve {results['reserve_percent']:g}% of each budget"
               if "reserve_percent" in results else "")
            + (f", its burst {results['burst_percent']:g}% over it" if "burst_percent" in results else "")
            + (f"; epd_b: epd with {_settings(results['variant'])}" if results.get("variant") else "") + "\n\n")
    rows = ["| deployment | load | class | sent | served | goodput /s | TTFT p50 ms | TTFT p99 ms | shed | shed answered "
            "p99 / max ms | expired | lost + hung | server RSS MiB (level's start -> end) | gate limits after the level |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    repeats = results.get("repeats", 1)
    for run in results["runs"]:
        level = f"{run['load']:g}x ({run['rate']:g}/s)" + (f" #{run['repeat'] + 1}" if repeats > 1 else "")
        if run.get("cores_probe_ms"):  # the cores' speed during the level (clients.bench.speed: more ms is slower)
            level += f", cores probe {run['cores_probe_ms']:.2f} ms"
        rss = f"{run['rss_before_mib']} -> {run['rss_mib']}" if "rss_before_mib" in run else run["rss_mib"]
        for cls in ("high", "low", "all"):
            s = run[cls]
            rows.append(f"| {run['model']} | {level} | {cls} | {s['sent']} | {s['served']} | "
                        f"{s['goodput']:.2f} | {s['ttft_p50_ms']} | {s['ttft_p99_ms']} | {s['shed']} ({s['shed_rate']:.0%}) | "
                        f"{s['shed_answer_p99_ms']} / {s['shed_answer_max_ms']} | {s['expired']} | "
                        f"{s['lost'] + s['hung']} | {rss if cls == 'all' else ''} | "
                        f"{_limits(run) if cls == 'all' else ''} |")
    return head + "\n".join(rows) + "\n"


def _settings(variant: dict) -> str:
    return ", ".join(f"{key} {value}" for key, value in variant.items())


def _models(results: dict) -> list[str]:
    """The run's deployments: ``epd``, ``epd_b`` where the run had a variant, ``epd_open``."""
    present = {r["model"] for r in results["runs"]}
    return [model for model in ("epd", "epd_b", "epd_open") if model in present]


def _limits(run: dict) -> str:
    """The generator gates' limits read after the level (``first_token_target_ms``; empty: fixed budgets)."""
    return ", ".join(f"{stage} {value:g}" for stage, value in run.get("limits", {}).items())


def _runs(results: dict, model: str, load: float) -> list[dict]:
    return [r for r in results["runs"] if r["model"] == model and r["load"] == load]


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def _pooled_p99(runs: list[dict], cls: str) -> float:
    """The p99 TTFT of ``cls`` over every repeat's served requests (a run without them: its own p99)."""
    if runs and all("ttfts_ms" in r[cls] for r in runs):
        return percentile([t for r in runs for t in r[cls]["ttfts_ms"]], 99)
    return runs[0][cls]["ttft_p99_ms"] if len(runs) == 1 else math.nan


def checks(results: dict) -> str:
    """The issue's targets, each with the figure it rests on (``nan`` where the run has no such level). Repeats of a
    level are pooled: goodput is their mean (the peak: the best level's mean of any deployment, or the capacity the
    loads are multiples of where that is higher), the high class's p99 is over all their requests, and the ratio of
    each repeat is listed beside it. Then, per deployment, where the slowest requests and refusals at 2x spent their
    time, and the server's memory before and after the load."""
    lines = [f"Targets (epd, {results.get('split', 'E+PD')}; the same figures for "
             + (f"epd_b ({_settings(results['variant'])}) and " if results.get("variant") else "")
             + "epd_open beside them):"]
    levels = {(r["model"], r["load"]) for r in results["runs"]}
    best = max([_mean([r["all"]["goodput"] for r in _runs(results, *level)]) for level in levels]
               + [results.get("capacity_rps", 0.0)])  # a run of 0.5x and 2x alone has its 2x as its best level
    for name in _models(results):
        twos = _runs(results, name, 2.0)
        lines.append(_targets(results, name, best))
        lines += _slowest_requests(name, twos) + _slowest_refusals(name, twos) + _loop_lag(name, twos)
    return "\n".join(lines + _memory(results)) + "\n"


def _targets(results: dict, name: str, best: float) -> str:
    """One deployment's figures against the issue's targets."""
    twos, halves = _runs(results, name, 2.0), _runs(results, name, 0.5)
    runs = [r for r in results["runs"] if r["model"] == name]
    ratio = _mean([r["all"]["goodput"] for r in twos]) / best if twos and best else math.nan
    high = _pooled_p99(twos, "high") / _pooled_p99(halves, "high") if twos and halves else math.nan
    each = [two["high"]["ttft_p99_ms"] / half["high"]["ttft_p99_ms"] for two, half in zip(twos, halves)]
    shed = [r["all"]["shed_answer_max_ms"] for r in twos if r["all"]["shed"]]
    missing = sum(r["all"]["shed_without_retry_after"] for r in runs)
    lost = sum(r["all"]["lost"] + r["all"]["hung"] + r["all"]["broken"] for r in runs)
    rss = [r["rss_mib"] for r in runs]
    grew = [r["rss_mib"] - r["rss_before_mib"] for r in twos if "rss_before_mib" in r]
    each_text = "; each repeat: " + ", ".join(f"{e:.2f}" for e in each) if len(each) > 1 else ""
    return (f"- {name}: goodput at 2x / the peak = {ratio:.2f} (target >= 0.90); high class TTFT p99 at 2x / at "
            f"0.5x = {high:.2f} (target <= 1.5{each_text}); "
            f"slowest shed answer at 2x {max(shed, default=math.nan)} ms (target <= 50), "
            f"{missing} shed without Retry-After; lost or hung {lost} (target 0, every level); server RSS "
            f"{min(rss, default=0)}-{max(rss, default=0)} MiB at the levels' ends"
            + (f", {', '.join(f'{g:+d}' for g in grew)} MiB over each 2x level" if grew else ""))


def _slowest_requests(name: str, twos: list[dict]) -> list[str]:
    """Where the slowest high-class requests at 2x spent their time, per repeat (none for a run without them)."""
    if not twos or "slowest" not in twos[0]["high"]:
        return []
    times = lambda w: " / ".join(f"{w.get(k):g}" if w.get(k) is not None else "-" for k in STAGE_TIMES)
    per_repeat = (f"#{r.get('repeat', 0) + 1} " + ", ".join(f"{w['at_s']:g}: {w['ttft_ms']:g}, {w['late_ms']:g}, {times(w)}"
                                                           for w in r["high"]["slowest"][:3]) for r in twos)
    return [f"  - {name}'s slowest high-class requests at 2x (arrival s: TTFT ms, client's lateness ms, "
            "the server's queued / encoded / first chunk ms): " + "; ".join(per_repeat)
            + "; the client's lateness p99 at 2x " + ", ".join(f"{r['all']['client_late_p99_ms']:g}" for r in twos) + " ms"]


def _slowest_refusals(name: str, twos: list[dict]) -> list[str]:
    """The slowest refusals at 2x and how late the client sent them, per repeat (none where nothing was refused)."""
    refusals = [r for r in twos if r["all"].get("slowest_shed")]
    if not refusals:
        return []
    lagged = "client_loop_ms" in refusals[0]["all"]["slowest_shed"][0]
    cell = lambda w: f"{w['at_s']:g}: {w['answered_ms']:g}, {w['late_ms']:g}" + (f", {w['client_loop_ms']:g}" if lagged else "")
    per_repeat = (f"#{r.get('repeat', 0) + 1} " + ", ".join(cell(w) for w in r["all"]["slowest_shed"][:3]) for r in refusals)
    return [f"  - {name}'s slowest refusals at 2x (arrival s: answered ms, client's lateness ms"
            + (", the client's loop's latest wake-up while it was out ms" if lagged else "") + "): " + "; ".join(per_repeat)]


def _loop_lag(name: str, twos: list[dict]) -> list[str]:
    """How often the orchestrator's event loop woke late at 2x, per repeat (a refusal arriving then waited as long;
    none for a run without the figure)."""
    lags = [r["loop_lag"] for r in twos if r.get("loop_lag")]
    if not lags:
        return []
    return [f"  - {name}'s event loop at 2x, woke more than {lags[0]['late_over_ms']} ms late (of its wake-ups every "
            "50 ms): " + ", ".join(f"{lag['late']} of {lag['wakeups']} (the latest within {lag['worst_within_ms']:g} ms)"
                                   for lag in lags)]


def _memory(results: dict) -> list[str]:
    """The server's RSS before the load and after it settled, and which processes moved (a run with the figures)."""
    if "rss_after_load_mib" not in results:
        return []
    by = results.get("rss_by_process_mib", {})
    moved = {name: by["after_load"].get(name, 0) - by["start"].get(name, 0)
             for name in {*by.get("start", {}), *by.get("after_load", {})}}
    by_process = f" (by process: {', '.join(f'{n} {m:+d}' for n, m in sorted(moved.items(), key=lambda x: -x[1]))})"
    return [f"- the server's RSS: {results['rss_start_mib']} MiB before the load, {results['rss_after_load_mib']} "
            f"MiB {results['settle_seconds']:g} s after it" + (by_process if moved else "")]


def plot(results: dict, path: Path) -> None:
    """Goodput and the high class's TTFT p99 against the load, each deployment."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    styles = {"epd": "o-", "epd_b": "^-.", "epd_open": "s--"}
    for model in _models(results):
        style = styles[model]
        loads = sorted({r["load"] for r in results["runs"] if r["model"] == model})
        levels = [_runs(results, model, load) for load in loads]  # a level's repeats: goodput's mean, pooled p99
        left.plot(loads, [_mean([r["all"]["goodput"] for r in runs]) for runs in levels], style, label=f"{model} all")
        left.plot(loads, [_mean([r["high"]["goodput"] for r in runs]) for runs in levels], style, alpha=0.5,
                  label=f"{model} high")
        right.plot(loads, [_pooled_p99(runs, "high") for runs in levels], style, label=f"{model} high")
        right.plot(loads, [_pooled_p99(runs, "low") for runs in levels], style, alpha=0.5, label=f"{model} low")
    left.set(xlabel="offered load (x capacity)", ylabel=f"goodput (req/s within {results['slo_ms']} ms TTFT)")
    right.set(xlabel="offered load (x capacity)", ylabel="TTFT p99 (ms, served requests)", yscale="log")
    right.axhline(results["slo_ms"], color="grey", lw=0.8)
    for axis in (left, right):
        axis.legend(fontsize=8)
        axis.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
