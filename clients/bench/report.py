"""The benchmark driver's reporting (``clients.bench.e2e``): per-request samples -> rows, rows -> markdown
table, CSV and JSON, samples -> PNG plots. Pure functions (matplotlib only in the plot helpers), unit-tested.

A row is one deployment at one load level (a concurrency, or a request rate in requests/s). Latencies are
client-side: TTFT from sending the request to its first token (the first streamed response, whose text may still
be "": the server sends the first token's response at once, as vLLM's OpenAI server sends its first chunk, and a
random checkpoint's answers often begin with tokens that decode to ""; before 2026-12-06 the first non-empty text,
for such answers the whole request), end-to-end latency to the final response, time per output token (TPOT) = (latency - TTFT) / (tokens - 1) per request. Stage times are the
p50 of what the orchestrators return in ``timings`` (encode, transfer, prefill, generate, and ``media_ms``,
the consumers' own media processing with metadata-only off). ``vllm_queue_ms``: the mean time requests
waited in the engines' queues, from the servers' ``epd_vllm_queue_time_*`` metrics (servers started by the driver).
"""
from __future__ import annotations

import csv
import math
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable

STAGES = ("encode_ms", "transfer_ms", "media_ms", "prefill_ms", "generate_ms")
PERCENTILES = (50, 90, 99)


@dataclass
class Sample:
    """One finished request, as the client saw it (seconds)."""

    ttft: float
    latency: float
    tokens: int
    timings: dict = field(default_factory=dict)
    responses: int = 0  # streamed responses (fewer than tokens when the server coalesced under load)
    text: str = ""  # the answer's text, all chunks joined (the reuse benchmark compares it with the baseline's)
    index: int | None = None  # the request's position in the list the load functions were given

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first; None for a one-token answer."""
        return (self.latency - self.ttft) / (self.tokens - 1) if self.tokens > 1 else None


def percentile(values: Iterable[float], q: float) -> float:
    """The ``q``-th percentile (0..100), linear between closest ranks (numpy's default); NaN when empty."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarise(label: str, mode: str, level: float, samples: list[Sample], errors: int, wall: float) -> dict:
    """One row; ``mode`` is ``concurrency`` or ``rate``, ``level`` its value; ``wall``: seconds of the level."""
    series = {"ttft": [s.ttft * 1000 for s in samples], "latency": [s.latency * 1000 for s in samples],
              "tpot": [s.tpot * 1000 for s in samples if s.tpot is not None]}
    row = {"deployment": label, "mode": mode, "level": level, "completed": len(samples), "errors": errors,
           "wall_s": round(wall, 3), "req_per_s": len(samples) / wall if wall > 0 else float("nan"),
           "tok_per_s": sum(s.tokens for s in samples) / wall if wall > 0 else float("nan")}
    for name, values in series.items():
        for q in PERCENTILES:
            row[f"{name}_p{q}_ms"] = percentile(values, q)
    row["responses_per_request"] = statistics.mean(s.responses for s in samples) if samples else float("nan")
    for stage in STAGES:
        values = [s.timings[stage] for s in samples if stage in s.timings]
        row[f"{stage}_p50"] = percentile(values, 50) if values else None
    return row


CSV_FIELDS = (["deployment", "mode", "level", "completed", "errors", "wall_s", "req_per_s", "tok_per_s"]
              + [f"{n}_p{q}_ms" for n in ("ttft", "tpot", "latency") for q in PERCENTILES]
              + ["responses_per_request"] + [f"{s}_p50" for s in STAGES] + ["vllm_queue_ms"])


def csv_rows(rows: list[dict]) -> list[list[str]]:
    """Header and one line per row; floats with 3 decimals, missing values empty."""
    def cell(value) -> str:
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return ""
        return f"{value:.3f}" if isinstance(value, float) else str(value)
    return [list(CSV_FIELDS)] + [[f"{row[name]:g}" if name == "level" else cell(row.get(name)) for name in CSV_FIELDS]
                                 for row in rows]


def write_csv(path: Path, rows: list[dict]) -> None:
    with open(path, "w", newline="") as fh:
        csv.writer(fh).writerows(csv_rows(rows))


def markdown_table(rows: list[dict]) -> str:
    def num(value, digits=1) -> str:
        return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"

    lines = ["| deployment | load | req/s | tok/s | TTFT p50 / p90 / p99 ms | TPOT p50 / p90 ms | e2e p50 / p90 / p99 ms "
             "| encode / transfer / media / prefill / generate p50 ms | vLLM queue ms | errors |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        load = f"c={r['level']:g}" if r["mode"] == "concurrency" else f"{r['level']:g} req/s"
        stages = " / ".join(num(r[f"{s}_p50"]) for s in STAGES)
        lines.append(
            f"| {r['deployment']} | {load} | {num(r['req_per_s'])} | {num(r['tok_per_s'], 0)} | "
            f"{num(r['ttft_p50_ms'])} / {num(r['ttft_p90_ms'])} / {num(r['ttft_p99_ms'])} | "
            f"{num(r['tpot_p50_ms'], 2)} / {num(r['tpot_p90_ms'], 2)} | "
            f"{num(r['latency_p50_ms'])} / {num(r['latency_p90_ms'])} / {num(r['latency_p99_ms'])} | {stages} | "
            f"{num(r.get('vllm_queue_ms'), 2)} | {r['errors']} |")
    return "\n".join(lines)


def cpu_table(rows: list[dict]) -> str:
    """CPU ms per request of each process role (``row["cpu_ms"]``, ``clients.bench.proc_cpu``), one line per row;
    ``busy``: the share of all cores those processes used over the row."""
    labels = list(dict.fromkeys(label for r in rows for label in (r.get("cpu_ms") or {})))
    lines = ["| deployment | load | " + " | ".join(labels) + " | total ms/req | busy |",
             "|---|---|" + "---|" * (len(labels) + 2)]
    for r in rows:
        cpu = r.get("cpu_ms") or {}
        load = f"c={r['level']:g}" if r["mode"] == "concurrency" else f"{r['level']:g} req/s"
        cells = " | ".join(f"{cpu[label]:.2f}" if label in cpu else "-" for label in labels)
        lines.append(f"| {r['deployment']} | {load} | {cells} | {sum(cpu.values()):.2f} | {r.get('cpu_busy', float('nan')):.0%} |")
    return "\n".join(lines)


def results_json(rows: list[dict], samples: dict[tuple[str, float], list[Sample]], settings: dict) -> dict:
    """Everything of a run: its settings, the rows, and every sample (for plots made later)."""
    return {"settings": settings, "rows": rows,
            "samples": [{"deployment": label, "level": level, "samples": [asdict(s) for s in items]}
                        for (label, level), items in samples.items()]}


def plot_latency_cdf(samples: dict[tuple[str, float], list[Sample]], path: Path, metric: str = "latency") -> None:
    """One CDF line per deployment and load level of ``metric`` (``latency`` or ``ttft``), in ms."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for (label, level), items in samples.items():
        values = sorted(getattr(s, metric) * 1000 for s in items)
        if values:
            ax.step(values, [(i + 1) / len(values) for i in range(len(values))], where="post", label=f"{label} @ {level:g}")
    ax.set_xlabel(f"{'end-to-end latency' if metric == 'latency' else 'TTFT'} (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.01)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def plot_throughput(rows: list[dict], path: Path) -> None:
    """Requests/s (left) and TTFT p50 (right) against the load level, one line per deployment."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for label in dict.fromkeys(r["deployment"] for r in rows):
        mine = sorted((r for r in rows if r["deployment"] == label), key=lambda r: r["level"])
        levels = [r["level"] for r in mine]
        left.plot(levels, [r["req_per_s"] for r in mine], marker="o", label=label)
        right.plot(levels, [r["ttft_p50_ms"] for r in mine], marker="o", label=label)
    xlabel = "concurrency" if rows and rows[0]["mode"] == "concurrency" else "offered load (req/s)"
    for ax, ylabel in ((left, "throughput (req/s)"), (right, "TTFT p50 (ms)")):
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if rows and rows[0]["mode"] == "concurrency":
            levels = sorted({r["level"] for r in rows})
            ax.set_xscale("log", base=2)
            ax.set_xticks(levels, [f"{v:g}" for v in levels])
            ax.minorticks_off()
    left.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def parse_metrics(text: str, prefix: str = "epd_vllm_queue_time_", by: str = "model",
                  where: dict[str, str] | None = None) -> dict[tuple[str, str], float]:
    """Prometheus text -> {(metric name, ``by`` label): value} for the metrics starting with ``prefix`` whose labels
    match ``where``, summed over the other labels (a model's instances: ``instance``)."""
    out = {}
    for line in text.splitlines():
        if not line.startswith(prefix) or "{" not in line:
            continue
        name, rest = line.split("{", 1)
        body, _, value = rest.rpartition("} ")
        labels = dict(part.split("=", 1) for part in body.split(",") if "=" in part)
        labels = {key: label.strip('"') for key, label in labels.items()}
        if any(labels.get(key) != wanted for key, wanted in (where or {}).items()):
            continue
        key = (name, labels.get(by, ""))
        out[key] = out.get(key, 0.0) + float(value)
    return out


def engine_queue_ms(before: dict, after: dict) -> float | None:
    """Mean time a request waited in vLLM's queues between two ``parse_metrics`` snapshots, summed over the
    engines it went through (E/P/D: prefill's and decode's): sum over models of delta seconds / delta count."""
    total, seen = 0.0, False
    for (name, model), count in after.items():
        if name != "epd_vllm_queue_time_count_total":
            continue
        moved = count - before.get((name, model), 0.0)
        if moved > 0:
            key = ("epd_vllm_queue_time_seconds_total", model)
            total += (after.get(key, 0.0) - before.get(key, 0.0)) / moved
            seen = True
    return total * 1000 if seen else None
