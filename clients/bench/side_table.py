"""The pure parts of ``clients.bench.side_by_side``: rows from samples, token equality with vLLM's single engine,
ratios ours/vLLM per pair, the tables, and the CPU accounting of process groups.

A row is one stack driven through one protocol: ``name`` (``vllm-single``, ``vllm-e-pd``, ``vllm-e-p-d``,
``vllm-e-p-d-delay``, ``llm``, ``epd``, ``epd_disagg``), ``protocol`` (``openai`` or ``grpc``), req/s over the timed
window, TTFT p50/p90 and TPOT p50 (ms, client side: ``clients.bench.report.Sample``), ``cpu_ms``: host CPU ms per request
per process group of the stack (``cpu_per_request``), ``cpu_total_ms`` their sum, and ``same_text``: how many of its
requests' answers equal vLLM's single engine's answer to the same request (greedy), out of how many were compared.

CPU accounting: a snapshot maps each group to ``{(pid, start time): CPU seconds}`` over the group's root processes
and all their descendants (``group_pids``); ``cpu_per_request`` is, per group, the CPU seconds the processes of the
later snapshot used since the earlier one (a process that was not in the earlier one counts from 0: it started in the
window), in ms per request. A process that exited inside the window is not counted.
"""
from __future__ import annotations

import math
import os
from pathlib import Path

from clients.bench.report import Sample, percentile

# (ours, vLLM's) rows compared: the same deployment shape on both sides
PAIRS = (("llm", "vllm-single"), ("epd", "vllm-e-pd"), ("epd_disagg", "vllm-e-p-d"), ("epd_disagg", "vllm-e-p-d-delay"))
REFERENCE = "vllm-single"  # whose answers the others' are compared with
# how ours are driven: the OpenAI endpoint as its own process (python -m frontend.openai), the endpoint in the served
# model's process (frontend.openai.in_process), Triton's gRPC; "openai-in" rows get the "openai" rows' requests
PROTOCOLS = ("openai", "openai-in", "grpc")
REQUEST_SET = {"openai": "openai", "openai-in": "openai", "grpc": "grpc"}
RATIO_METRICS = (("req_per_s", "req/s"), ("ttft_p50_ms", "TTFT p50"), ("ttft_p90_ms", "TTFT p90"),
                 ("tpot_p50_ms", "TPOT p50"), ("cpu_total_ms", "CPU/req"))
_TICK = os.sysconf("SC_CLK_TCK")


def summarise(name: str, protocol: str, samples: list[Sample], errors: int, wall: float, requests: int) -> dict:
    """One row from a timed window's samples (``Sample.index`` set: the request's position in the request set);
    ``wall``: the window's seconds. ``texts``: request index -> answer text, for ``same_text``; ``distinct_texts``: how
    many different answers (equality proves something only where different images gave different answers)."""
    ttft = [s.ttft * 1000 for s in samples]
    tpot = [s.tpot * 1000 for s in samples if s.tpot is not None]
    return {"name": name, "protocol": protocol, "requests": requests, "completed": len(samples), "errors": errors,
            "wall_s": round(wall, 3), "req_per_s": len(samples) / wall if wall > 0 else float("nan"),
            "ttft_p50_ms": percentile(ttft, 50), "ttft_p90_ms": percentile(ttft, 90),
            "tpot_p50_ms": percentile(tpot, 50), "tokens_p50": percentile([s.tokens for s in samples], 50),
            "texts": {s.index: s.text for s in samples if s.index is not None},
            "distinct_texts": len({s.text for s in samples})}


def same_text(texts: dict[int, str], reference: dict[int, str] | None) -> tuple[int, int] | None:
    """(requests whose text equals the reference's, requests compared): every request of ``reference``; one
    missing from ``texts`` (failed) counts as different. None without a reference."""
    if not reference:
        return None
    return sum(texts.get(i) == text for i, text in reference.items()), len(reference)


def add_equality(rows: list[dict], references: dict[tuple[str, int | None], dict[int, str]]) -> None:
    """Set each row's ``same_text`` against ``references[request set, row's concurrency]`` (vLLM single's answers
    to the requests that protocol's rows were sent at that concurrency; ``REQUEST_SET``)."""
    for row in rows:
        key = (REQUEST_SET[row["protocol"]], row.get("concurrency"))
        row["same_text"] = same_text(row.get("texts", {}), references.get(key))


def ratio(ours: float | None, theirs: float | None) -> float | None:
    """ours / theirs; None where either is missing, NaN or theirs is 0."""
    if ours is None or theirs is None or theirs == 0 or math.isnan(ours) or math.isnan(theirs):
        return None
    return ours / theirs


def ratios(rows: list[dict]) -> list[dict]:
    """Per pair of ``PAIRS`` both present (ours through each protocol it ran, against vLLM's row through OpenAI):
    ``{"ours", "protocol", "vllm", <metric>: ours/vLLM}`` for ``RATIO_METRICS``."""
    by_key = {(r["name"], r["protocol"], r.get("concurrency")): r for r in rows}
    levels = list(dict.fromkeys(r.get("concurrency") for r in rows))
    out = []
    for level in levels:
        for ours, theirs in PAIRS:
            base = by_key.get((theirs, "openai", level))
            for protocol in PROTOCOLS:
                mine = by_key.get((ours, protocol, level))
                if base is None or mine is None:
                    continue
                out.append({"ours": ours, "protocol": protocol, "vllm": theirs, "concurrency": level,
                            **{key: ratio(mine.get(key), base.get(key)) for key, _ in RATIO_METRICS}})
    return out


def _cell(value, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.{digits}f}"


def _equality_cell(pair: tuple[int, int] | None) -> str:
    return "-" if pair is None else f"{pair[0]}/{pair[1]}"


def _groups_cell(cpu: dict[str, float]) -> str:
    return ", ".join(f"{name} {ms:.1f}" for name, ms in cpu.items()) or "-"


def results_table(rows: list[dict]) -> str:
    """The markdown table of ``rows``: one line per row, in order."""
    gpu = any("gpu_busy_pct" in r for r in rows)  # a GPU run: each row's GPU busy share (proc_cpu.GpuBusy)
    lines = ["| stack | protocol | c | req/s | TTFT p50 ms | TTFT p90 ms | TPOT p50 ms | CPU ms/req | CPU ms/req by "
             "group | " + ("GPU busy % | " if gpu else "") + "same text as vllm-single | errors |",
             "|" + "---|" * (12 if gpu else 11)]
    for r in sorted(rows, key=lambda r: r.get("concurrency") or 0):  # stable: each level in run order
        busy = f"{'/'.join(map(str, r.get('gpu_busy_pct') or ['-']))} | " if gpu else ""
        lines.append(f"| {r['name']} | {r['protocol']} | {r.get('concurrency') or '-'} | {_cell(r['req_per_s'], 2)} | "
                     f"{_cell(r['ttft_p50_ms'])} | "
                     f"{_cell(r['ttft_p90_ms'])} | {_cell(r['tpot_p50_ms'], 2)} | {_cell(r.get('cpu_total_ms'))} | "
                     f"{_groups_cell(r.get('cpu_ms', {}))} | {busy}{_equality_cell(r.get('same_text'))} | "
                     f"{r['errors']} |")
    return "\n".join(lines)


def process_cpu_table(rows: list[dict]) -> str:
    """One line per row: each process's (``side_profile.label``) CPU ms per request, largest first."""
    lines = ["| stack | protocol | c | CPU ms/req by process |", "|---|---|---|---|"]
    for row in rows:
        per = sorted(((ms, name) for group in row.get("cpu_by_process", {}).values() for name, ms in group.items()),
                     reverse=True)
        lines.append(f"| {row['name']} | {row['protocol']} | {row.get('concurrency') or '-'} | "
                     f"{', '.join(f'{n} {ms:.1f}' for ms, n in per)} |")
    return "\n".join(lines)


def ratios_table(pairs: list[dict]) -> str:
    """The markdown table of ``ratios``: ours / vLLM per pair and metric (x)."""
    lines = ["| ours | protocol | vs vLLM's | c | " + " | ".join(label for _, label in RATIO_METRICS) + " |",
             "|" + "---|" * (4 + len(RATIO_METRICS))]
    for p in pairs:
        cells = " | ".join(_cell(p[key], 2) + ("x" if p[key] is not None else "") for key, _ in RATIO_METRICS)
        lines.append(f"| {p['ours']} | {p['protocol']} | {p['vllm']} | {p.get('concurrency') or '-'} | {cells} |")
    return "\n".join(lines)


# ---- CPU accounting ------------------------------------------------------------------------------------------------

def read_stat(pid: int) -> tuple[int, int, float] | None:
    """(parent pid, start time in clock ticks, CPU seconds user + system) of ``pid`` from /proc; None if gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # fields[0] is the state (field 3 of proc(5))
    if fields[0] == "Z":
        return None
    return int(fields[1]), int(fields[19]), (int(fields[11]) + int(fields[12])) / _TICK


def process_table() -> dict[int, tuple[int, int, float]]:
    """Every live process: pid -> ``read_stat``."""
    table = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (stat := read_stat(int(entry.name))) is not None:
            table[int(entry.name)] = stat
    return table


def group_pids(roots: list[int], parents: dict[int, int], descendants: bool = True) -> set[int]:
    """``roots`` (those alive in ``parents``: pid -> parent pid) and, with ``descendants``, every process below them."""
    members = {pid for pid in roots if pid in parents}
    if not descendants:
        return members
    children: dict[int, list[int]] = {}
    for pid, parent in parents.items():
        children.setdefault(parent, []).append(pid)
    todo = list(members)
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in members:
                members.add(child)
                todo.append(child)
    return members


def cpu_snapshot(groups: dict[str, tuple[list[int], bool]],
                 table: dict[int, tuple[int, int, float]] | None = None) -> dict[str, dict[tuple[int, int], float]]:
    """Group name -> {(pid, start time): CPU seconds} for ``groups``: name -> (root pids, with their descendants)."""
    table = process_table() if table is None else table
    parents = {pid: stat[0] for pid, stat in table.items()}
    return {name: {(pid, table[pid][1]): table[pid][2] for pid in group_pids(roots, parents, descendants)}
            for name, (roots, descendants) in groups.items()}


def cpu_per_request(before: dict[str, dict[tuple[int, int], float]], after: dict[str, dict[tuple[int, int], float]],
                    requests: int) -> dict[str, float]:
    """Group -> ms of CPU per request between the snapshots (see the module's contract), in ``after``'s order."""
    out = {}
    for name, processes in after.items():
        earlier = before.get(name, {})
        seconds = sum(max(0.0, cpu - earlier.get(key, 0.0)) for key, cpu in processes.items())
        out[name] = round(seconds * 1000 / max(requests, 1), 2)
    return out
