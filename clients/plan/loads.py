"""CPU per process by load, measured on a running deployment (``deployments.Served``), and the machine's background.

``phase``: one closed loop of requests; read around it: every process's CPU (``clients.bench.proc_cpu``, nanosecond
schedstat), the streamed responses per request, and the whole machine's busy time (``/proc/stat``, idle and iowait
excepted), whose part not spent by the deployment's processes or this one (the load generator) is the background:
other agents' work on the shared machine, sampled by ``WINDOW`` (``Background``), which the simulator replays as
cores the deployment does not get (``Profile.with_background``).

``by_load``: closed loops at each of ``LOADS`` with short and long answers; per process (``LABELS``), CPU per request
``c = R + units x U`` at both lengths gives the process's ms per request ``R`` and per unit ``U`` at that load: the
profile's ``by_load`` rows (``clients.plan.profile``). Units: tokens for the engine, streamed responses for the
stub and the processes after it (vLLM merges the steps a busy stub has not sent yet: fewer responses than tokens
under load). The stub's and the engine's rows are by the requests in flight on one replica (the load over the
replicas). The decode step by batch is the engine's row: ``U`` per token at each load (``decode_line``).
"""
from __future__ import annotations

import os
import statistics
import threading
import time
from pathlib import Path

from clients.bench.load import synthetic_requests
from clients.bench.proc_cpu import per_request, snapshot_of
from clients.bench.report import percentile
from clients.bench import speed
from clients.plan.profile import Line, fit

LOADS = (1, 2, 8, 24)
SHORT, LONG = 16, 80
LABELS = {"load generator": "client", "stub epd": "orchestrator", "tritonserver": "frontend", "stub pd": "stub",
          "EngineCore pd": "engine"}
REPLICA = ("stub", "engine")  # by a replica's share of the load
_TICK = os.sysconf("SC_CLK_TCK")
WINDOW = 0.1  # seconds of a background sample
PROBE_EVERY = 5  # windows between two speed probes (~2-3 ms of this process's CPU each)
CORES = os.cpu_count() or 1


def machine_busy() -> float:
    """Core-seconds the whole machine has been busy (``/proc/stat``'s cpu line less idle and iowait)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / _TICK


def _ticks(pids: list[int]) -> float:
    """CPU seconds so far of ``pids`` at the 10 ms ticks of ``/proc/<pid>/stat`` (cheap enough to read often)."""
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total / _TICK


class Background(threading.Thread):
    """Samples, every ``WINDOW`` seconds, the cores the machine was busy with beyond ``pids`` (and this process), and
    every ``PROBE_EVERY`` windows (and at its start) the cores' speed (``clients.bench.speed``: one pass of its fixed
    work, CPU ms)."""

    def __init__(self, pids: list[int]):
        super().__init__(daemon=True)
        self.pids, self.series, self.halt = [*pids, os.getpid()], [], threading.Event()
        self.probes: list[float] = []

    def run(self) -> None:
        self.probes.append(speed.probe(1))
        last = (time.perf_counter(), machine_busy(), _ticks(self.pids))
        while not self.halt.wait(WINDOW):
            now = (time.perf_counter(), machine_busy(), _ticks(self.pids))
            elapsed = now[0] - last[0]
            self.series.append(min(CORES, max(0.0, (now[1] - last[1] - now[2] + last[2]) / elapsed)))
            if len(self.series) % PROBE_EVERY == 0:
                self.probes.append(speed.probe(1))   # this process's CPU: not counted as the background
            last = now

    def stop(self) -> list[float]:
        self.halt.set()
        self.join()
        return [round(v, 3) for v in self.series]

    def speed_ms(self) -> float:
        """The median of the speed probes taken (CPU ms of ``speed``'s work: more is slower)."""
        return round(statistics.median(self.probes), 3) if self.probes else 0.0


def phase(served, requests: list, concurrency: int) -> dict:
    """``requests`` in a closed loop of ``concurrency``: the samples, errors, wall seconds, CPU ms per request per
    label, the background cores (the machine's busy time not the deployment's, over the wall time) and their series
    by ``WINDOW`` (``Background``), and the cores' speed probe's median (``speed_ms``)."""
    pids = served.pids()
    sampler = Background(pids)
    cpu0, busy0 = snapshot_of(pids), machine_busy()
    sampler.start()
    samples, errors, wall = served.run(requests, concurrency)
    series = sampler.stop()
    cpu1, busy1 = snapshot_of(pids), machine_busy()
    own = sum(seconds - cpu0[pid][1] for pid, (_, seconds) in cpu1.items() if pid in cpu0)
    cpu = per_request(cpu0, cpu1, len(requests))
    if "load generator" in cpu:  # this process: less the speed probes' own CPU, which no request costs
        cpu["load generator"] = round(max(0.0, cpu["load generator"] - sum(sampler.probes) / max(len(requests), 1)), 2)
    return {"samples": samples, "errors": errors, "wall": wall, "cpu": cpu,
            "background": max(0.0, (busy1 - busy0 - own) / wall) if wall > 0 else 0.0, "series": series,
            "responses": responses(samples, requests), "speed_ms": sampler.speed_ms()}


def responses(samples: list, requests: list) -> float:
    """Streamed responses per request (fewer than tokens where the stub merged steps); tokens where not counted."""
    counted = [s.responses for s in samples if getattr(s, "responses", 0)]
    if counted:
        return sum(counted) / len(counted)
    return sum(s.tokens for s in samples) / len(samples) if samples else 0.0


def requests_for(count: int, tokens: int, seed: int, sizes=((64, 64),)) -> list:
    return synthetic_requests(count, 1, list(sizes), tokens, first=seed)


def split(short: float, long: float, units: tuple[float, float] = (SHORT, LONG)) -> tuple[float, float]:
    """(ms per request, ms per unit) from CPU per request at the short and long answers' ``units`` (tokens, or
    responses) per request."""
    more = units[1] - units[0]
    unit = max(0.0, (long - short) / more) if more > 0.5 else 0.0
    return max(0.0, short - units[0] * unit), unit


def rows(phases: dict[int, dict[int, dict]], replicas: int, long: int = LONG) -> dict[str, list[list[float]]]:
    """The ``by_load`` rows from phases by load then tokens (``SHORT`` and ``long``): the engine per token, the stub
    and the processes after it per response (``phase``'s ``responses``)."""
    out: dict[str, list[list[float]]] = {}
    for load, by_tokens in sorted(phases.items()):
        short, full = by_tokens[SHORT], by_tokens[long]
        for label, process in LABELS.items():
            units = (SHORT, long) if process == "engine" else (short["responses"], full["responses"])
            request, token = split(short["cpu"].get(label, 0.0), full["cpu"].get(label, 0.0), units)
            scope = load / replicas if process in REPLICA else load
            out.setdefault(process, []).append([round(scope, 3), round(request, 3), round(token, 4)])
    return out


def decode_line(engine_rows: list[list[float]]) -> Line:
    """The decode step by batch, fitted through (batch, batch x ms per token) of the engine's rows."""
    fitted = fit([(load, load * token) for load, _, token in engine_rows])
    return Line(max(0.0, fitted.base), max(0.0, fitted.slope))


def by_load(served, loads=LOADS, long: int = LONG, seed: int = 500_000) -> dict:
    """Phases at every load and both lengths (``SHORT`` and ``long``; a workload's own answers: the lengths it has
    are read, not extrapolated): ``{"by_load": rows, "light_ttft_ms": TTFT p50 at load 1 (short), "light_tpot_ms":
    its time per output token p50 (long),
    "series": its background, "speed_ms": the cores' speed probe's median over the phases, "merging": per load the long answers' responses per request, requests and background
    (``clients.plan.measure.fit_intervals``), "first_token": per load the short answers' TTFT p50, requests and
    background (``clients.plan.phases.calibrate_engine``), "phases": what each read}``."""
    phases: dict[int, dict[int, dict]] = {}
    for load in loads:
        count = max(32, 6 * load)
        for tokens in (SHORT, long):
            got = phase(served, requests_for(count, tokens, seed), load)
            seed += count
            if got["errors"]:
                raise RuntimeError(f"by_load: {len(got['errors'])} requests failed: {got['errors'][0]}")
            phases.setdefault(load, {})[tokens] = got
            print(f"{served.name} profile load {load} tokens {tokens}: {got['cpu']} bg {got['background']:.2f}",
                  flush=True)
    table = rows(phases, served.replicas, long)
    first = phases[min(loads)][SHORT]
    light = percentile([s.ttft * 1000 for s in first["samples"]], 50)
    summary = {f"{load}/{tokens}": {"cpu": p["cpu"], "background": round(p["background"], 3), "wall": round(p["wall"], 3),
                                    "responses": round(p["responses"], 2), "speed_ms": p["speed_ms"]}
               for load, by_tokens in phases.items() for tokens, p in by_tokens.items()}
    merging = {load: {"responses": by_tokens[long]["responses"], "count": len(by_tokens[long]["samples"]),
                      "series": by_tokens[long]["series"], "step_s": WINDOW} for load, by_tokens in phases.items()}
    first_token = {load: {"ttft_p50_ms": percentile([s.ttft * 1000 for s in by_tokens[SHORT]["samples"]], 50),
                          "count": len(by_tokens[SHORT]["samples"]), "series": by_tokens[SHORT]["series"]}
                   for load, by_tokens in phases.items()}
    light_tpot = percentile([s.tpot * 1000 for s in phases[min(loads)][long]["samples"] if s.tpot], 50)
    probes = [p["speed_ms"] for by_tokens in phases.values() for p in by_tokens.values() if p["speed_ms"]]
    return {"by_load": table, "light_ttft_ms": light, "light_tpot_ms": light_tpot, "phases": summary,
            "series": first["series"], "merging": merging, "first_token": first_token,
            "speed_ms": round(statistics.median(probes), 3) if probes else 0.0}


def thread_share(engine_rows: list[list[float]], light_tpot_ms: float) -> float:
    """The share of the engine's CPU on its step thread: the light load's time per output token (the step, wall)
    over its CPU per token there (the lowest load's row: every thread's), at most 1. vLLM's EngineCore spends CPU
    on other threads too (its input and output sockets' threads), beside the step."""
    per_token = sorted(engine_rows)[0][2]
    return round(min(1.0, light_tpot_ms / per_token), 3) if per_token > 0 and light_tpot_ms > 0 else 1.0
