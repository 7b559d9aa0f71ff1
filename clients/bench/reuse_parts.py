"""The reuse benchmark's parts that run against one server (``clients.bench.reuse``): the reassignment experiment, the
16 concurrent cold requests, and what the tier costs; with the helpers every part uses (the encoders' counters from
the metrics endpoint, read once they stopped moving; the encoder model reloaded through Triton's model-control API;
answers checked against the baseline's).

Counts come from the encoders' Prometheus counters as tests/e2e/test_tier.py reads them (``epd_encoder_items_total``:
tower outputs, i.e. encodes; ``epd_tier_*``), summed over the instances. Each instance refreshes them once a second, so
a read waits until two scrapes agree.
"""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from clients.bench.load import run_concurrency
from clients.bench.report import Sample, percentile

COUNTED = ("epd_encoder_items_total", "epd_encoder_cache_hits_total", "epd_tier_hits_total", "epd_tier_misses_total",
           "epd_tier_dropped_writes_total", "epd_tier_errors_total", "epd_tier_claims_total", "epd_tier_waits_total")
ENCODER = "encoder"
SETTLE_SECONDS = 1.3  # an instance refreshes its counters once a second (backend.triton.models.encoder.METRICS_SECONDS)


def scrape(metrics_url: str, names=COUNTED, **labels) -> dict[str, float]:
    """``names`` summed over the series carrying ``labels`` (an instance each), from one scrape; 0 where absent (a
    deployment without the tier exports no ``epd_tier_*``)."""
    want = [f'{k}="{v}"' for k, v in labels.items()]
    with urllib.request.urlopen(metrics_url, timeout=10) as resp:
        lines = resp.read().decode().splitlines()
    out = dict.fromkeys(names, 0.0)
    for line in lines:
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in out and all(w in line for w in want):
            out[name] += float(line.rsplit(" ", 1)[1])
    return out


async def settled(metrics_url: str, names=COUNTED, tries: int = 8) -> dict[str, float]:
    """The encoders' counters once they stopped moving: ``SETTLE_SECONDS`` after the caller's last request, then
    until two scrapes half a second apart agree."""
    await asyncio.sleep(SETTLE_SECONDS)
    last = await asyncio.to_thread(scrape, metrics_url, names, model=ENCODER)
    for _ in range(tries):
        await asyncio.sleep(0.5)
        now = await asyncio.to_thread(scrape, metrics_url, names, model=ENCODER)
        if now == last:
            return now
        last = now
    return last


def moved(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {name: after[name] - before.get(name, 0.0) for name in after}


def reload_model(http_url: str, model: str = ENCODER, timeout: float = 300.0) -> float:
    """Unload ``model``, wait until Triton says it is unloaded, load it again: fresh instances (empty caches, counters
    from 0). Unload first, not a load over the loaded model: Triton would start the new instances beside the old ones,
    and instances of one name share their metrics (backend.triton.metrics.metric_labels). Needs the server started
    with ``--model-control-mode=explicit``. Returns the seconds it took."""
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(http_url, network_timeout=timeout, connection_timeout=timeout)
    started = time.monotonic()
    try:
        client.unload_model(model)
        while next((m.get("state") for m in client.get_model_repository_index() if m["name"] == model),
                   None) != "UNAVAILABLE":
            if time.monotonic() - started > timeout:
                raise TimeoutError(f"{model} still not unloaded after {timeout:.0f} s")
            time.sleep(0.2)
        client.load_model(model)
        if not client.is_model_ready(model):
            raise RuntimeError(f"{model} not ready after its load")
        return time.monotonic() - started
    finally:
        client.close()  # an open HTTP connection holds tritonserver 30 s at its exit


@dataclass
class Checker:
    """Every ``epd`` answer against the baseline's for the same request (greedy): text and token count. A mismatch,
    an error or a missing answer is recorded (``problems``) and shown in the table."""

    references: dict[str, Sample] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    tally: dict[str, list[int]] = field(default_factory=dict)  # group -> [answers checked, problems]

    def add_references(self, names: list[str], samples: list[Sample], errors: list[str]) -> None:
        for sample in samples:
            self.references[names[sample.index]] = sample
        self.problems += [f"llm: {e}" for e in errors]

    def check(self, where: str, names: list[str], samples: list[Sample], errors: list[str], group: str = "") -> int:
        """Problems found in one batch of answers (``names[i]``: request i's reference); recorded too, and tallied
        under ``group`` (a deployment, a mode)."""
        found = [f"{where}: {e}" for e in errors]
        if len(samples) + len(errors) != len(names):
            found.append(f"{where}: {len(names) - len(samples) - len(errors)} requests without an answer")
        for sample in samples:
            want = self.references.get(names[sample.index])
            if want is None:
                found.append(f"{where}: request {names[sample.index]}: no llm answer to compare with")
            elif (sample.text, sample.tokens) != (want.text, want.tokens):
                found.append(f"{where}: request {names[sample.index]}: epd {sample.text!r} ({sample.tokens} tokens) "
                             f"!= llm {want.text!r} ({want.tokens} tokens)")
        self.problems += found
        tally = self.tally.setdefault(group or where, [0, 0])
        tally[0], tally[1] = tally[0] + len(names), tally[1] + len(found)
        return len(found)


def ms(values: list[float], q: float) -> float | None:
    return round(percentile(values, q) * 1000, 1) if values else None


def phase_summary(samples: list[Sample], errors: list[str], wall: float, problems: int) -> dict:
    """TTFT p50/p90 (ms), the encode phase's p50 (``timings.encode_ms``), counts; every request's (index, TTFT ms,
    encode ms) for the JSON."""
    ttft = [s.ttft for s in samples]
    encode = [s.timings["encode_ms"] / 1000 for s in samples if "encode_ms" in s.timings]
    return {"requests": len(samples) + len(errors), "errors": len(errors), "problems": problems, "wall_s": round(wall, 2),
            "ttft_p50_ms": ms(ttft, 50), "ttft_p90_ms": ms(ttft, 90), "encode_p50_ms": ms(encode, 50),
            "samples": sorted([s.index, round(s.ttft * 1000, 1), s.timings.get("encode_ms")] for s in samples)}


async def ask(url: str, concurrency: int, requests: list, names: list[str], checker: Checker, where: str,
              progress, group: str = "") -> dict:
    """``requests`` through ``epd`` at ``concurrency``, checked against the references; the phase's summary."""
    results, wall = await run_concurrency(url, "epd", concurrency, requests, progress)
    problems = checker.check(where, names, results.samples, results.errors, group)
    return phase_summary(results.samples, results.errors, wall, problems)


async def references(url: str, concurrency: int, requests: list, names: list[str], checker: Checker, progress) -> None:
    """The baseline's answers (``llm``) to ``requests`` not asked for yet."""
    todo = [i for i, name in enumerate(names) if name not in checker.references]
    if todo:
        results, _ = await run_concurrency(url, "llm", concurrency, [requests[i] for i in todo], progress)
        checker.add_references([names[i] for i in todo], results.samples, results.errors)


async def reassignment(server, requests: list, names: list[str], warm: list, checker: Checker, deployment: str,
                       concurrency: int, progress) -> dict:
    """Phase 1: ``requests`` (all their images new). The encoder model reloaded: fresh instances, none of which has
    seen an image. Phase 2: the same requests again. Encodes per phase from the counters; phase 2's are re-encodes.
    ``warm`` (requests of other new images) is sent before phase 1 and again after the reload, before phase 2: the
    fresh instances' first requests (the consumer connecting to their pools; with the tier, their store clients'
    first reads of the holder) are paid there, not in phase 2, alike in both deployments; their TTFT is reported."""
    url, metrics_url = server.grpc_url, server.metrics_url
    await run_concurrency(url, "epd", concurrency, warm, progress)
    start = await settled(metrics_url)
    phase1 = await ask(url, concurrency, requests, names, checker, f"reassignment {deployment} phase 1", progress,
                       deployment)
    before_reload = await settled(metrics_url)
    reload_s = await asyncio.to_thread(reload_model, server.http_url)
    results, wall = await run_concurrency(url, "epd", concurrency, warm, progress)
    first = phase_summary(results.samples, results.errors, wall, 0)
    before = await settled(metrics_url)
    phase2 = await ask(url, concurrency, requests, names, checker, f"reassignment {deployment} phase 2", progress,
                       deployment)
    after = await settled(metrics_url)
    return {"phase1": {**phase1, "counts": moved(start, before_reload)}, "reload_s": round(reload_s, 1),
            "after_reload": {**first, "counts": moved(before_reload, before)},
            "phase2": {**phase2, "counts": moved(before, after)}}


async def cold(server, request, name: str, n: int, checker: Checker, deployment: str, progress) -> dict:
    """``n`` concurrent requests carrying one new image: encodes (tower outputs) over both instances."""
    before = await settled(server.metrics_url)
    summary = await ask(server.grpc_url, n, [request] * n, [name] * n, checker, f"cold {deployment}", progress,
                        deployment)
    return {**summary, "counts": moved(before, await settled(server.metrics_url))}


async def lookup_cost(server, requests: list, progress) -> dict:
    """What a demand-aware lookup costs a cold request (every image new, so it finds nothing): ``requests`` one at a
    time, ``epd_demand_aware`` on and off alternately (neighbours see the same machine), TTFT p50/p90 each, and the
    lookups' own time (``timings.lookup_ms``). Not checked against ``llm`` (new images; the other parts check)."""
    from dataclasses import replace

    runs = {}
    for mode, flag in (("on", True), ("off", False)):
        runs[mode] = [replace(r, parameters={**(r.parameters or {}), "epd_demand_aware": flag}) for r in requests]
    samples: dict[str, list] = {"on": [], "off": []}
    for pair in zip(runs["on"], runs["off"]):
        for mode, request in zip(("on", "off"), pair):
            results, _ = await run_concurrency(server.grpc_url, "epd", 1, [request], progress)
            samples[mode] += results.samples
    lookup = [s.timings["lookup_ms"] / 1000 for s in samples["on"] if "lookup_ms" in s.timings]
    return {mode: {"requests": len(got), "ttft_p50_ms": ms([s.ttft for s in got], 50),
                   "ttft_p90_ms": ms([s.ttft for s in got], 90)} for mode, got in samples.items()} | {
        "lookup_p50_ms": ms(lookup, 50), "lookup_p90_ms": ms(lookup, 90),
        "held": sum(s.timings.get("held", 0) for s in samples["on"])}


def memory_kib(pid: int) -> dict[str, int]:
    """RSS and PSS (KiB) of one process, from /proc/<pid>/smaps_rollup."""
    fields = {}
    with open(f"/proc/{pid}/smaps_rollup") as rollup:
        for line in rollup:
            key, _, rest = line.partition(":")
            if key in ("Rss", "Pss"):
                fields[key.lower()] = int(rest.split()[0])
    return fields


def master_gauges(tier) -> dict[str, float]:
    """The Mooncake master's own gauges: bytes allocated (held) in the pool, its capacity, keys."""
    url = f"http://127.0.0.1:{tier.master.metrics_port}/metrics"
    return scrape(url, ("master_allocated_bytes", "master_total_capacity_bytes", "master_key_count"))


def cost(server, checkpoint: Path, lookups: int, workdir: Path) -> dict:
    """What the tier costs: one store client's lookups (``clients.bench.tier_lookup``, a process with Mooncake's
    libraries, as an encoder instance has), what the pool holds, the master's and the holder's memory."""
    tier = server.tier
    config = tier.master.client_config()
    from backend.deploy.tier_service import mooncake_paths

    root = Path(__file__).resolve().parents[2]
    env = tier.env({**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))})
    done = subprocess.run([sys.executable, "-m", "clients.bench.tier_lookup", config["rpc"], config["metadata"],
                           str(mooncake_paths()[0]), str(checkpoint), str(lookups)], env=env, cwd=root,
                          capture_output=True, text=True, timeout=300)
    (workdir / "tier_lookup.log").write_text(done.stdout + done.stderr)
    line = next((l for l in done.stdout.splitlines() if l.startswith("LOOKUP ")), None)
    if line is None:
        raise RuntimeError(f"clients.bench.tier_lookup failed (rc {done.returncode}): {done.stderr[-2000:]}")
    memory = {"master": memory_kib(tier.master.process.pid), "holder": memory_kib(tier.holder.process.pid)}
    return {"lookup": json.loads(line.removeprefix("LOOKUP ")), "pool": master_gauges(tier), "memory_kib": memory}
