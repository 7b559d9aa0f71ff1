"""A workload: the request mix and the arrival process the simulator and the planner take (YAML or JSON).

    name: image-chat
    arrivals: {process: poisson, rate: 4.0}    # or {process: closed, concurrency: 16}, or {process: trace, file: t.csv}
    requests: 400                              # how many (a trace: its rows, at most this many)
    seed: 0
    high_priority_share: 0.0                   # share of requests sent with priority 0 (the rest: 1)
    slo: {ttft_p90_ms: 500, tpot_p90_ms: 100}  # what the planner holds and goodput counts
    mix:                                       # request classes, drawn by share
      - share: 0.8
        prompt_tokens: 16                      # text tokens (media tokens come from the profile)
        output_tokens: 64
        images: {count: 1, sizes: [[64, 48], [112, 112]]}   # one size per item, drawn
      - share: 0.2
        videos: {count: 1, size: [64, 64], frames: 8}
        audios: {count: 1, seconds: 2.0}

A trace file has one arrival per line, ``t`` (seconds from the start) and optionally ``class`` (an index into ``mix``;
drawn by share when absent): CSV with a header (``t,class``) or JSON lines (``{"t": 0.12, "class": 0}``). Every bad
field is a ``WorkloadError`` naming it (``mix[1].images.count: expected an integer >= 0, got 'two'``).
"""
from __future__ import annotations

import csv
import json
import random
from dataclasses import dataclass, field
from pathlib import Path

import yaml

PROCESSES = ("poisson", "closed", "trace")


class WorkloadError(ValueError):
    """A workload file that cannot be used; the message names the field."""


@dataclass(frozen=True)
class Item:
    """One media item: an image (``width`` x ``height``), a video (also ``frames``) or an audio clip (``seconds``)."""

    modality: str
    width: int = 0
    height: int = 0
    frames: int = 1
    seconds: float = 0.0

    @property
    def kpixels(self) -> float:
        return self.width * self.height / 1000.0


@dataclass(frozen=True)
class RequestClass:
    share: float
    prompt_tokens: int
    output_tokens: int
    images: tuple[int, tuple[tuple[int, int], ...]] = (0, ())  # (count, sizes)
    videos: tuple[int, tuple[int, int], int] = (0, (0, 0), 0)  # (count, size, frames)
    audios: tuple[int, float] = (0, 0.0)  # (count, seconds)

    def items(self, rng: random.Random) -> tuple[Item, ...]:
        count, sizes = self.images
        out = [Item("image", *rng.choice(sizes)) for _ in range(count)]
        count, (w, h), frames = self.videos
        out += [Item("video", w, h, frames) for _ in range(count)]
        out += [Item("audio", seconds=self.audios[1]) for _ in range(self.audios[0])]
        return tuple(out)


@dataclass(frozen=True)
class Request:
    index: int
    at: float  # arrival (open loop; closed loop: unused)
    items: tuple[Item, ...]
    prompt_tokens: int
    output_tokens: int
    priority: int = 1


@dataclass(frozen=True)
class Workload:
    name: str
    process: str
    rate: float = 0.0
    concurrency: int = 0
    trace: tuple[tuple[float, int | None], ...] = ()
    requests: int = 200
    seed: int = 0
    high_priority_share: float = 0.0
    slo_ttft_ms: float = 0.0  # 0: none
    slo_tpot_ms: float = 0.0
    mix: tuple[RequestClass, ...] = field(default_factory=tuple)

    def draw(self) -> list[Request]:
        """The requests, seeded: arrival times (Poisson gaps, the trace's, or 0 for a closed loop), class by share
        (or the trace's), items by the class's sizes."""
        rng = random.Random(self.seed)
        if self.process == "trace":
            arrivals = list(self.trace[: self.requests])
        elif self.process == "poisson":
            at, arrivals = 0.0, []
            for _ in range(self.requests):
                arrivals.append((at, None))
                at += rng.expovariate(self.rate)
        else:
            arrivals = [(0.0, None)] * self.requests
        shares = [c.share for c in self.mix]
        out = []
        for i, (at, cls) in enumerate(arrivals):
            chosen = self.mix[cls] if cls is not None else rng.choices(self.mix, weights=shares)[0]
            priority = 0 if rng.random() < self.high_priority_share else 1
            out.append(Request(i, at, chosen.items(rng), chosen.prompt_tokens, chosen.output_tokens, priority))
        return out

    def with_load(self, **changes) -> "Workload":
        """The same mix at another load (``rate``, ``concurrency``, ``process``, ``requests``)."""
        from dataclasses import replace

        return replace(self, **changes)


# -- parsing: each helper names the field it reads --------------------------------------------------------------------

def _number(doc: dict, key: str, where: str, default=None, integer: bool = False, minimum: float = 0.0):
    value = doc.get(key, default)
    ok = isinstance(value, int if integer else (int, float)) and not isinstance(value, bool) and value >= minimum
    if not ok:
        kind = "an integer" if integer else "a number"
        raise WorkloadError(f"{where}{key}: expected {kind} >= {minimum:g}, got {value!r}")
    return value


def _mapping(doc, where: str) -> dict:
    if not isinstance(doc, dict):
        raise WorkloadError(f"{where}: expected a mapping, got {type(doc).__name__}")
    return doc


def _unknown(doc: dict, allowed: set[str], where: str) -> None:
    extra = sorted(set(doc) - allowed)
    if extra:
        raise WorkloadError(f"{where}{extra[0]}: unknown field (allowed: {', '.join(sorted(allowed))})")


def _size(value, where: str) -> tuple[int, int]:
    if (not isinstance(value, (list, tuple)) or len(value) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in value)):
        raise WorkloadError(f"{where}: expected [width, height], positive integers, got {value!r}")
    return int(value[0]), int(value[1])


def _class(doc, where: str) -> RequestClass:
    doc = _mapping(doc, where)
    _unknown(doc, {"share", "prompt_tokens", "output_tokens", "images", "videos", "audios"}, f"{where}.")
    w = f"{where}."
    images = videos = audios = None
    if "images" in doc:
        d = _mapping(doc["images"], f"{w}images")
        _unknown(d, {"count", "sizes"}, f"{w}images.")
        sizes = d.get("sizes")
        if not isinstance(sizes, list) or not sizes:
            raise WorkloadError(f"{w}images.sizes: expected a list of [width, height], got {sizes!r}")
        images = (_number(d, "count", f"{w}images.", integer=True),
                  tuple(_size(s, f"{w}images.sizes[{i}]") for i, s in enumerate(sizes)))
    if "videos" in doc:
        d = _mapping(doc["videos"], f"{w}videos")
        _unknown(d, {"count", "size", "frames"}, f"{w}videos.")
        videos = (_number(d, "count", f"{w}videos.", integer=True), _size(d.get("size"), f"{w}videos.size"),
                  _number(d, "frames", f"{w}videos.", integer=True, minimum=1))
    if "audios" in doc:
        d = _mapping(doc["audios"], f"{w}audios")
        _unknown(d, {"count", "seconds"}, f"{w}audios.")
        audios = (_number(d, "count", f"{w}audios.", integer=True), float(_number(d, "seconds", f"{w}audios.")))
    return RequestClass(share=float(_number(doc, "share", w, default=1.0)),
                        prompt_tokens=_number(doc, "prompt_tokens", w, default=16, integer=True),
                        output_tokens=_number(doc, "output_tokens", w, default=64, integer=True, minimum=1),
                        **{k: v for k, v in (("images", images), ("videos", videos), ("audios", audios)) if v})


def read_trace(path: Path, classes: int) -> tuple[tuple[float, int | None], ...]:
    """A trace file's arrivals, in time order (module docstring)."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise WorkloadError(f"arrivals.file: cannot read {path}: {exc.strerror}") from None
    lines = [line for line in text.splitlines() if line.strip()]
    rows = [json.loads(line) for line in lines] if lines and lines[0].lstrip().startswith("{") else \
        list(csv.DictReader(lines))
    out = []
    for i, row in enumerate(rows):
        where = f"arrivals.file: {path.name} row {i + 1}: "
        try:
            at = float(row["t"])
            cls = None if row.get("class") in (None, "") else int(row["class"])
        except (KeyError, TypeError, ValueError):
            raise WorkloadError(f"{where}t: expected a time in seconds and an optional integer class, got {row!r}") from None
        if at < 0 or (cls is not None and not 0 <= cls < classes):
            raise WorkloadError(f"{where}{'t' if at < 0 else 'class'}: out of range in {row!r} ({classes} classes)")
        out.append((at, cls))
    if not out:
        raise WorkloadError(f"arrivals.file: {path.name} has no arrivals")
    return tuple(sorted(out))


def parse(doc, source: Path | None = None) -> Workload:
    """A workload from its document (``source``: the file, for a trace's relative path)."""
    doc = _mapping(doc, "workload")
    _unknown(doc, {"name", "arrivals", "requests", "seed", "high_priority_share", "slo", "mix"}, "")
    arrivals = _mapping(doc.get("arrivals"), "arrivals")
    process = arrivals.get("process")
    if process not in PROCESSES:
        raise WorkloadError(f"arrivals.process: expected one of {', '.join(PROCESSES)}, got {process!r}")
    _unknown(arrivals, {"process", {"poisson": "rate", "closed": "concurrency", "trace": "file"}[process]}, "arrivals.")
    mix = doc.get("mix")
    if not isinstance(mix, list) or not mix:
        raise WorkloadError(f"mix: expected a list of request classes, got {mix!r}")
    classes = tuple(_class(c, f"mix[{i}]") for i, c in enumerate(mix))
    if sum(c.share for c in classes) <= 0:
        raise WorkloadError("mix: the shares add up to 0")
    slo = _mapping(doc.get("slo", {}), "slo")
    _unknown(slo, {"ttft_p90_ms", "tpot_p90_ms"}, "slo.")
    share = _number(doc, "high_priority_share", "", default=0.0)
    if share > 1:
        raise WorkloadError(f"high_priority_share: expected a share from 0 to 1, got {share!r}")
    common = dict(name=str(doc.get("name", source.stem if source else "workload")), process=process,
                  requests=_number(doc, "requests", "", default=200, integer=True, minimum=1),
                  seed=_number(doc, "seed", "", default=0, integer=True), high_priority_share=float(share),
                  slo_ttft_ms=float(_number(slo, "ttft_p90_ms", "slo.", default=0)),
                  slo_tpot_ms=float(_number(slo, "tpot_p90_ms", "slo.", default=0)), mix=classes)
    if process == "poisson":
        return Workload(rate=float(_number(arrivals, "rate", "arrivals.", minimum=1e-9)), **common)
    if process == "closed":
        return Workload(concurrency=_number(arrivals, "concurrency", "arrivals.", integer=True, minimum=1), **common)
    file = arrivals.get("file")
    if not isinstance(file, str) or not file:
        raise WorkloadError(f"arrivals.file: expected a path, got {file!r}")
    path = Path(file) if source is None or Path(file).is_absolute() else source.parent / file
    return Workload(trace=read_trace(path, len(classes)), **common)


def closed(concurrency: int, requests: int, prompt_tokens: int, output_tokens: int,
           sizes=((64, 64),)) -> Workload:
    """``requests`` one-image requests (a size of ``sizes`` drawn for each) from a closed loop of ``concurrency``, as
    the measured phases send them: the workload ``clients.plan.measure`` calibrates and fits the send intervals on,
    and each level of ``clients.plan.validate``."""
    return parse({"arrivals": {"process": "closed", "concurrency": concurrency}, "requests": requests,
                  "mix": [{"prompt_tokens": prompt_tokens, "output_tokens": output_tokens,
                           "images": {"count": 1, "sizes": [list(s) for s in sizes]}}]})


def load(path: Path) -> Workload:
    """A workload file (YAML or JSON); ``WorkloadError`` naming the file and the field when it cannot be used."""
    path = Path(path)
    try:
        doc = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise WorkloadError(f"{path}: cannot read: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise WorkloadError(f"{path}: not YAML/JSON: {exc}") from None
    try:
        return parse(doc, path)
    except WorkloadError as exc:
        raise WorkloadError(f"{path}: {exc}") from None
