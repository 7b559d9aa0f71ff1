"""A stage profile: each stage's service time as a function of what it gets, as the simulator reads it (JSON).

Every cost is a line, ``{"base": b, "slope": s}`` (milliseconds, and milliseconds per unit), fitted by
``clients.plan.measure`` against a running deployment (or derived, and labelled so: ``derived``):
- ``encoder.<modality>``: one item's time by its units (image: kilopixels; video: frames x kilopixels; audio: seconds);
  ``encoder.batch``: a batch's own time by its item count (Triton batches the encoder's items);
- ``tokens.<modality>``: an item's prompt tokens by its units;
- ``prefill``: an engine step's time by the prompt tokens it prefills (the step's base included);
- ``decode``: an engine step's time by the sequences it decodes; ``decode_context``: the extra time per 1,000 tokens of
  context those sequences hold (slope only);
- ``transfer.<path>``: one pull of a request's embeddings by its MiB (``shared_memory``: same host; ``nixl``: across
  hosts); ``kv_transfer``: E/P/D's KV pull by its MiB; ``embedding_bytes_per_token``, ``kv_bytes_per_token``;
- ``orchestrator``, ``stub`` (an engine's Triton stub), ``client``: per request (base) and per streamed response (slope)
  of the processes between the engine and the user; ``before_first_token`` (optional): the share of those per-request
  costs spent before the first token, the rest after the last; ``hop`` (optional): latency beyond any CPU work;
  ``engine_after_ms`` (optional; profiles calibrated before the ``by_load`` rows): an engine's CPU per request off the
  tokens' path (on its thread after the request);
  ``send_interval_ms`` or, by a replica's load, ``send_interval_by_load`` (``[load, ms]`` rows; optional): the least
  time between two sends of a stub (steps not sent yet are merged).
``by_load`` (optional, measured: ``clients.plan.loads``): per process (``client``, ``orchestrator``: the epd stub,
``frontend``: tritonserver's threads, ``stub``: an engine's stub, ``engine``: its EngineCore), rows ``[load, ms per
request, ms per token]`` by the requests in flight where it runs (the deployment for the first three, one replica for
the stub and the engine), read between rows on a log scale, held beyond the ends; where present it replaces the
per-request lines above and the engine's prefill and decode lines (``cost``).
``engine_args`` (optional): the vLLM engine arguments its engines ran with (``measure`` records the served
topology's); ``kv_cache_bytes`` (optional): an engine's KV cache; both go into the planned topology (``engine_args``).
``encoder_device_share`` (optional, 0 to 1; measured GPU profiles: fitted by ``clients.plan.measure_gpu``): the
share of an encoder batch's time that is its replica's device's, which time-slices its instances' batches (the encoder
lines are one instance's time alone); the rest is the instance's own host work, done in parallel with the others'.
0 (the default): each instance works in parallel at its line's time (a CPU profile, where the cores are what they
share, or the derived GPU profile, whose line is one instance's time with four busy). The older
``encoder_instances_share_device: true`` reads as a share of 1. ``encoder_share_by_load`` (optional, measured GPU
profiles): rows ``[requests in flight in the deployment, share]``, read between rows as ``by_load`` is, where the
profile has no ``encoder_device_share`` (the device's contention grows with the processes using it faster than one
share explains: docs/planning.md, "The encoder's device share").
``cores``: the CPU cores all processes of one machine share (the simulator runs every piece of work on them, processor
sharing); 0: each stage has its own device (a GPU), none waits for another's. ``background`` (optional): the cores
the machine's other processes keep busy, window by window (``with_background``), which the deployment does not get.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from clients.plan.workload import Item

LINES = ("encoder.batch", "prefill", "decode", "decode_context", "kv_transfer", "orchestrator", "stub", "client")


# the CPU cost lines (ms) a slower or faster machine scales (``Profile.at_speed``): nested where they are groups
SCALED_LINES = ("encoder", "prefill", "decode", "decode_context", "transfer", "kv_transfer", "orchestrator", "stub",
                "client")


def _scaled_lines(node: dict, factor: float) -> dict:
    if "base" in node or "slope" in node:
        return {**node, "base": float(node.get("base", 0.0)) * factor, "slope": float(node.get("slope", 0.0)) * factor}
    return {k: _scaled_lines(v, factor) if isinstance(v, dict) else v for k, v in node.items()}


class ProfileError(ValueError):
    """A profile that cannot be used; the message names the field."""


@dataclass(frozen=True)
class Line:
    base: float = 0.0
    slope: float = 0.0

    def at(self, x: float) -> float:
        return self.base + self.slope * x

    def as_dict(self) -> dict:
        return {"base": round(self.base, 4), "slope": round(self.slope, 6)}


def units(item: Item) -> float:
    """What an item's costs are lines of: kilopixels (image), frames x kilopixels (video), seconds (audio)."""
    return {"image": item.kpixels, "video": item.frames * item.kpixels, "audio": item.seconds}[item.modality]


@dataclass(frozen=True)
class Profile:
    doc: dict

    def line(self, name: str) -> Line:
        node = self.doc
        for part in name.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, dict):
            raise ProfileError(f"{name}: missing from the profile {self.doc.get('name', '')!r}")
        return Line(float(node.get("base", 0.0)), float(node.get("slope", 0.0)))

    @property
    def name(self) -> str:
        return str(self.doc.get("name", "profile"))

    @property
    def cores(self) -> float:
        return float(self.doc.get("cores", 0))

    @property
    def before_first(self) -> float:
        """The share of the client's, orchestrator's and stub's per-request work done before the first token (the
        rest after the last: final response, accounting); 1 where not fitted."""
        return float(self.doc.get("before_first_token", 1.0))

    @property
    def engine_thread_share(self) -> float:
        """The share of the engine's CPU done on its step thread (the rest on its other threads, in parallel):
        ``engine_thread_share``, measured as the light load's time per output token over the engine's CPU per token
        at load 1 (``clients.plan.measure.with_by_load``); 1 where not measured (a GPU profile's engine lines are
        wall times)."""
        return float(self.doc.get("engine_thread_share", 1.0))

    def engine_before_first(self, load: float) -> float:
        """The share of the engine's per-request CPU (its ``by_load`` row's base) done in the request's prefill step,
        with ``load`` requests in flight on the engine: ``engine_first_token_by_load`` (rows ``[load, share]``, fitted
        where the base is not 0: ``clients.plan.phases.calibrate_engine``) where the profile has it, else
        ``before_first_token``'s (the rest is done between steps after the request ends)."""
        if rows := self.doc.get("engine_first_token_by_load"):
            return between(rows, load)[0]
        return self.before_first

    @property
    def encoder_device_share(self) -> float:
        """The share of an encoder batch's time its instances time-slice on their replica's one device
        (``encoder_device_share``; else ``encoder_share_by_load``'s at its highest load; 1 where the profile has
        ``encoder_instances_share_device: true``)."""
        if "encoder_device_share" in self.doc:
            return float(self.doc["encoder_device_share"])
        if rows := self.doc.get("encoder_share_by_load"):
            return float(max(rows)[1])
        return 1.0 if self.doc.get("encoder_instances_share_device") else 0.0

    def encoder_device_share_at(self, load: float) -> float:
        """The device share with ``load`` requests in flight in the deployment: ``encoder_share_by_load``'s where the
        profile has no ``encoder_device_share`` (which holds at every load)."""
        rows = self.doc.get("encoder_share_by_load")
        if rows and "encoder_device_share" not in self.doc:
            return between(rows, load)[0]
        return self.encoder_device_share

    @property
    def frontend_threads(self) -> int:
        """tritonserver's threads that relay requests and responses (C++, in parallel with the Python stubs)."""
        return int(self.doc.get("frontend_threads", max(1, round(self.cores))))

    @property
    def send_interval_ms(self) -> float:
        """The least time between two sends of an engine's stub at every load, where the profile has no
        ``send_interval_by_load`` (``send_interval``); ``clients.plan.measure.fit_interval`` tries it by bisection."""
        return float(self.doc.get("send_interval_ms", 0.0))

    @property
    def engine_args(self) -> dict:
        """The vLLM engine arguments the profile's engines had: its ``engine_args``, over ``kv_cache_bytes`` as
        ``kv_cache_memory_bytes``; what neither names: the topology's defaults
        (``backend.deploy.schema.ENGINE_DEFAULTS``, what a CPU profile's server ran with). The planner writes them into its topology and sizes the engines'
        autoscaler target by their KV (``clients.plan.planner``)."""
        kv = self.doc.get("kv_cache_bytes")
        return {**({"kv_cache_memory_bytes": int(kv)} if kv else {}), **self.doc.get("engine_args", {})}

    def by_load(self, process: str) -> bool:
        return bool(self.doc.get("by_load", {}).get(process))

    def cost(self, process: str, load: float) -> Line:
        """``process``'s CPU ms per request (base) and per streamed token (slope) with ``load`` requests in flight where
        it runs: ``by_load`` read at ``load``, else the process's line (none: 0)."""
        rows = self.doc.get("by_load", {}).get(process)
        if not rows:
            return self.line(process) if isinstance(self.doc.get(process), dict) else Line()
        return Line(*between(rows, load))

    def send_interval(self, load: float) -> float:
        """The least ms between two sends of an engine's stub with ``load`` requests in flight on it
        (``send_interval_by_load``, else ``send_interval_ms``; fitted: ``clients.plan.measure.fit_intervals``)."""
        rows = self.doc.get("send_interval_by_load")
        return between(rows, load)[0] if rows else self.send_interval_ms

    def with_cores(self, cores: float) -> "Profile":
        """The same profile on ``cores`` cores (what other processes of the machine leave to this deployment)."""
        return Profile({**self.doc, "cores": cores})

    def background(self) -> tuple[float, list[float]] | None:
        """(seconds, [cores busy with other work, ...]): the machine's other load in windows (``resources.Cores``)."""
        node = self.doc.get("background")
        return (float(node["step_s"]), [float(v) for v in node["cores"]]) if node else None

    def with_background(self, step_s: float, cores: list[float]) -> "Profile":
        """The same profile on a machine whose other processes keep ``cores[i]`` cores busy in window ``i``."""
        return Profile({**self.doc, "background": {"step_s": step_s, "cores": [round(c, 3) for c in cores]}})

    def at_speed(self, factor: float) -> "Profile":
        """The same profile on cores ``factor`` times slower (``clients.bench.speed``: the machine's speed probe now over
        the profile's): every CPU cost line, ``by_load`` row and send interval scaled; token counts and the ``hop``
        (latency beyond any CPU work) kept. A profile with no ``cores`` (a GPU one: its lines are device time) is
        returned unchanged."""
        if not self.cores or factor == 1.0:
            return self
        doc = dict(self.doc)
        for name in SCALED_LINES:
            node = doc.get(name)
            if isinstance(node, dict):
                doc[name] = _scaled_lines(node, factor)
        doc["by_load"] = {process: [[row[0], *(v * factor for v in row[1:])] for row in rows]
                          for process, rows in doc.get("by_load", {}).items()}
        if "send_interval_by_load" in doc:
            doc["send_interval_by_load"] = [[load, ms * factor] for load, ms in doc["send_interval_by_load"]]
        if "send_interval_ms" in doc:
            doc["send_interval_ms"] = float(doc["send_interval_ms"]) * factor
        doc["speed_factor"] = factor
        return Profile(doc)

    def hop_ms(self) -> float:
        """Latency a request has beyond the CPU work (the gRPC hops), not on the cores; 0 where not fitted."""
        return self.line("hop").base if "hop" in self.doc else 0.0

    def encode_ms(self, item: Item) -> float:
        return max(0.0, self.line(f"encoder.{item.modality}").at(units(item)))

    def tokens(self, item: Item) -> int:
        return max(1, round(self.line(f"tokens.{item.modality}").at(units(item))))

    def transfer_ms(self, tokens: int, path: str) -> float:
        mib = tokens * float(self.doc.get("embedding_bytes_per_token", 0)) / 2**20
        return self.line(f"transfer.{path}").at(mib)

    def kv_transfer_ms(self, tokens: int) -> float:
        return self.line("kv_transfer").at(tokens * float(self.doc.get("kv_bytes_per_token", 0)) / 2**20)

    def step_ms(self, prefill_tokens: int, decoding: int, context_tokens: int) -> float:
        """One engine step: its prefills' tokens, the sequences it decodes and the context they hold."""
        prefill, decode = self.line("prefill"), self.line("decode")
        base = max(prefill.base if prefill_tokens else 0.0, decode.base if decoding else 0.0)
        return (base + prefill.slope * prefill_tokens + decode.slope * decoding
                + self.line("decode_context").slope * context_tokens / 1000.0)

    def check(self) -> "Profile":
        """Every line the simulator reads is there (``ProfileError`` naming the first that is not)."""
        for name in LINES:
            self.line(name)
        for modality in self.doc.get("encoder", {}):
            if modality != "batch":
                self.line(f"tokens.{modality}")
        rows = self.doc.get("encoder_share_by_load", [])
        shares = [(key, self.doc[key]) for key in ("encoder_device_share",) if key in self.doc]
        if not isinstance(rows, list) or not all(isinstance(r, list) and len(r) == 2 for r in rows):
            raise ProfileError(f"encoder_share_by_load: {rows!r} is not a list of [load, share] rows "
                               f"(profile {self.name!r})")
        shares += [(f"encoder_share_by_load[{i}]", row[1]) for i, row in enumerate(rows)]
        for field, value in shares:
            try:
                share = float(value)
            except (TypeError, ValueError):
                share = math.nan
            if not 0.0 <= share <= 1.0:
                raise ProfileError(f"{field}: {value!r} is not a number from 0 to 1 (profile {self.name!r})")
        return self


def fit(points: list[tuple[float, float]]) -> Line:
    """Least-squares line through ``points`` (one point: a constant)."""
    if len({x for x, _ in points}) < 2:
        return Line(sum(y for _, y in points) / len(points), 0.0)
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    return Line(my - slope * mx, slope)


def between(rows: list[list[float]], load: float) -> list[float]:
    """Rows ``[load, value, ...]`` read at ``load``: between two rows on a log scale of the load, held beyond the
    ends."""
    rows = sorted(rows)
    x = math.log(max(load, 1e-9))
    points = [(math.log(r[0]), r[1:]) for r in rows]
    if x <= points[0][0] or len(points) == 1:
        return list(points[0][1])
    for (x0, v0), (x1, v1) in zip(points, points[1:]):
        if x <= x1:
            t = (x - x0) / (x1 - x0) if x1 > x0 else 1.0
            return [a + t * (b - a) for a, b in zip(v0, v1)]
    return list(points[-1][1])


def load(path: Path) -> Profile:
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ProfileError(f"{path}: cannot read the profile: {exc}") from None
    return Profile(doc).check()


def save(profile: Profile, path: Path) -> None:
    Path(path).write_text(json.dumps(profile.doc, indent=1) + "\n")
