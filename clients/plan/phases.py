"""The phases a stage profile is measured from (``clients.plan.measure``: CPU lines; ``clients.plan.measure_gpu``:
wall-time lines of a GPU deployment), what both fit from them alike, and the calibration on the light load.

A phase: requests one at a time (or at a concurrency), fresh images each, against a running deployment
(``deployments.Served``); read around it: every process's CPU per request (``clients.bench.proc_cpu``), how much each
of vLLM's counters of the pd engine grew (its prompt tokens, its own timings), the client's samples (with the
orchestrator's ``timings``).
"""
from __future__ import annotations

import time
import urllib.request

from clients.bench.load import synthetic_requests, synthetic_video_requests
from clients.bench.proc_cpu import per_request, snapshot_of
from clients.bench.report import parse_metrics, percentile
from clients.plan.deployments import Served
from clients.plan.profile import Line, Profile, fit

SHORT, LONG = 16, 80  # greedy tokens of the phases, and of the longer answers
ENGINE_SHARE_SENSITIVITY = 0.05  # calibrate_engine: the least TTFT move, over the measured TTFT, a share must make


class Session:
    """The server under measurement (a ``deployments.Served`` with its ``metrics`` URL) and the first seed of the
    next phase's requests."""

    def __init__(self, served: Served):
        self.served, self.seed = served, 1000

    def _counters(self) -> dict[str, float]:
        """vLLM's counters of the pd engine (``epd_vllm_*``, summed over its instances) by name."""
        text = urllib.request.urlopen(self.served.metrics, timeout=10).read().decode()
        return {name: value for (name, model), value in parse_metrics(text, "epd_vllm_").items() if model == "pd"}

    def phase(self, make, count: int, concurrency: int = 1) -> dict:
        """``count`` requests ``make(count, first_seed)``: CPU ms per request per process, prompt tokens per request,
        how much each of vLLM's counters grew (``vllm``), the samples."""
        requests = make(count, self.seed)
        self.seed += count * 10
        cpu0, counters0 = snapshot_of(self.served.pids()), self._counters()
        samples, errors, wall = self.served.run(requests, concurrency)
        time.sleep(1.5)  # the counters are handed to Triton every 0.25 s
        if errors:
            raise RuntimeError(f"measure: {len(errors)} requests failed: {errors[0]}")
        cpu, counters = per_request(cpu0, snapshot_of(self.served.pids()), count), self._counters()
        grown = {name: value - counters0.get(name, 0.0) for name, value in counters.items()}
        return {"cpu": cpu, "prompt_tokens": grown.get("epd_vllm_prompt_tokens_total", 0.0) / count, "vllm": grown,
                "samples": samples, "wall": wall, "count": count}


def cpu_of(phase: dict, *labels: str) -> float:
    return sum(phase["cpu"].get(label, 0.0) for label in labels)


def _mean(phase: dict, key: str) -> float:
    values = [s.timings.get(key, 0.0) for s in phase["samples"]]
    return sum(values) / len(values)


def images(size: int | tuple[int, ...], count: int = 1, tokens: int = SHORT):
    """Requests of ``count`` images of ``size`` px a side (sizes in turn, given several)."""
    sides = size if isinstance(size, tuple) else (size,)
    return lambda n, seed: synthetic_requests(n, count, [(side, side) for side in sides], tokens, first=seed)


def video_phase(session: Session, size: int, repeat: int, frames: int = 8) -> dict:
    """One ``frames``-frame video of ``size`` pixels a side a request; ``units``: its frames x kilopixels."""
    phase = session.phase(lambda n, seed: synthetic_video_requests(n, 1, (size, size), frames, 4.0, SHORT, seed), repeat)
    return {**phase, "units": frames * kpixels(size)}


RELAYS = {"stub": ("stub pd",), "orchestrator": ("stub epd", "tritonserver"), "client": ("load generator",)}


def kpixels(size: int) -> float:
    return size * size / 1000


def encoder_lines(one: dict[int, float], four: float, size: int, video: float, video_units: float) -> dict:
    """The encoder's lines from its ms for one image at each size of ``one`` (pixels a side), for four images of
    ``size`` in one request (the batch's own time: what four cost beyond one) and for one video of ``video_units``."""
    single = fit([(kpixels(s), ms) for s, ms in one.items()])
    item = (four - single.at(kpixels(size))) / 3
    batch = Line(max(0.0, single.at(kpixels(size)) - item), 0.0)
    image = Line(item - single.slope * kpixels(size), single.slope)
    return {"batch": batch.as_dict(), "image": image.as_dict(),
            "video": Line(0.0, max(0.0, video - batch.base) / video_units).as_dict()}


def shared_lines(phases: dict, sizes: tuple[int, ...], short: str) -> dict:
    """What every profile reads alike from its phases: media tokens (vLLM's prompt tokens beyond the text's), the
    same-host pull (the orchestrator's ``timings``), and the relaying processes' CPU per request and per streamed
    token (the ``long`` phase against ``short``, the one-image phase of the same requests with ``SHORT`` tokens)."""
    text_tokens = phases["text"]["prompt_tokens"]
    per_token = {name: (cpu_of(phases["long"], *labels) - cpu_of(phases[short], *labels)) / (LONG - SHORT)
                 for name, labels in RELAYS.items()}
    transfer = fit([(s.timings.get("transfer_bytes", 0) / 2**20, s.timings.get("transfer_ms", 0.0))
                    for name, p in phases.items() if name.startswith("image") for s in p["samples"]])
    media = [(kpixels(s), phases[f"image{s}"]["prompt_tokens"] - text_tokens) for s in sizes]
    pulled = sum(_mean(phases[f"image{s}"], "transfer_ms") for s in sizes) / len(sizes)

    def per_request(name: str, less: float = 0.0) -> dict:
        base = cpu_of(phases[short], *RELAYS[name]) - SHORT * per_token[name] - less
        return Line(max(0.0, base), max(0.0, per_token[name])).as_dict()

    video_units = phases["video"]["units"]
    middle = sizes[len(sizes) // 2]
    media_tokens = phases[f"image{middle}"]["prompt_tokens"] - text_tokens
    return {"tokens": {"image": fit(media).as_dict(),
                       "video": Line(0.0, (phases["video"]["prompt_tokens"] - text_tokens) / video_units).as_dict()},
            "transfer": {"shared_memory": Line(max(0.0, transfer.base), max(0.0, transfer.slope)).as_dict()},
            "embedding_bytes_per_token": round(_mean(phases[f"image{middle}"], "transfer_bytes") / max(media_tokens, 1), 1),
            "stub": per_request("stub", pulled), "orchestrator": per_request("orchestrator"),
            "client": per_request("client"), "text_tokens": text_tokens,
            "light_tpot_ms": percentile([s.tpot * 1000 for s in phases["long"]["samples"] if s.tpot], 50),
            "cpu_ms_per_request": {name: p["cpu"] for name, p in phases.items()}}


def calibrate(doc: dict, layout, sizes=((64, 64),)) -> dict:
    """Fit the light load (simulated at concurrency 1, one image of ``sizes``, on ``layout``) against ``light_ttft_ms``: the
    share of the per-request work done before the first token (``before_first_token``), and ``hop``, what TTFT has
    beyond all of it (0 where the share is below 1). Called by ``measure.with_by_load`` and ``measure_gpu.measure``."""
    from clients.plan.simulate import simulate
    from clients.plan.workload import closed

    workload = closed(1, 20, round(doc["text_tokens"]), SHORT, sizes)

    def ttft(share: float) -> float:
        trial = {**doc, "before_first_token": share, "hop": Line().as_dict()}
        return simulate(layout, Profile(trial), workload)["ttft_p50_ms"]

    low, high, measured = ttft(0.0), ttft(1.0), doc["light_ttft_ms"]
    share = 1.0 if high <= low else min(1.0, max(0.0, (measured - low) / (high - low)))
    return {**doc, "before_first_token": round(share, 3), "hop": Line(max(0.0, measured - high), 0.0).as_dict()}


def calibrate_engine(doc: dict, layout, first_token: dict, sizes=((64, 64),)) -> dict:
    """``doc`` with ``engine_first_token_by_load``: at each measured load where the engine's ``by_load`` row has a
    per-request base (at load 1 it is 0: ``calibrate``'s light load says nothing of it), the share of that base
    done in the request's prefill step (the rest between steps after it ends) whose simulated TTFT p50 (that
    phase's closed loop, on its background) is the measured one (``first_token``: ``clients.plan.loads.by_load``'s).
    A load whose TTFT moves by less than ``ENGINE_SHARE_SENSITIVITY`` of the measured one between the two ends
    (queueing hides the prefill) gives no row; none at all: ``doc`` unchanged."""
    from clients.plan.simulate import simulate
    from clients.plan.workload import closed

    rows, replicas = [], next(iter(layout.engines().values()))  # the first token's engines (E/P/D: prefill's)
    for load, got in sorted(first_token.items(), key=lambda kv: float(kv[0])):
        scope = float(load) / replicas  # the engine's rows are by the requests in flight on one replica
        if Profile(doc).cost("engine", scope).base <= 0:
            continue
        workload = closed(int(load), got["count"], round(doc["text_tokens"]), SHORT, sizes)
        background = {"step_s": doc.get("light_background", {}).get("step_s", 0.1), "cores": got["series"]}

        def ttft(share: float) -> float:
            trial = {**doc, "engine_first_token_by_load": [[scope, share]], "background": background}
            return simulate(layout, Profile(trial), workload)["ttft_p50_ms"]

        low, high, measured = ttft(0.0), ttft(1.0), got["ttft_p50_ms"]
        if high - low < ENGINE_SHARE_SENSITIVITY * measured:
            continue
        lo, hi = 0.0, 1.0  # TTFT grows with the share: bisect for the measured one
        for _ in range(8):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if ttft(mid) < measured else (lo, mid)
        rows.append([round(scope, 3), round((lo + hi) / 2, 3)])
    return {**doc, "engine_first_token_by_load": rows} if rows else doc
