"""The seeded generator of differential cases: ``generate(family, seed, index)`` is one request's shape, the same for
the same arguments on any machine (``random.Random`` seeded with a string), so ``--only N`` replays case N alone.

A case is a text-only request, a ``text_input`` prompt with the family's placeholders (or none: the server puts one
per item in front), or a chat (one to three user turns, assistant replies between them, sometimes a system message)
whose media parts take tensor items (``{"type": "image"}``), data URLs (``image_url``, ``video_url``, ``audio_url``)
or base64 data (``input_audio``). Ranges (the issue's): 0-4 images of 28-1,024 px a side, aspect ratios up to 1:20,
PNG/JPEG/WebP/GIF/BMP in RGB, grayscale, RGBA, palette; 0-2 videos of 1-32 frames at 1-30 fps, mp4v or H.264; 0-3
audio clips of 0.1-40 s at 8-48 kHz, mono or stereo. Sizes and lengths are weighted to small ones so a case costs
well under a second on 2 cores. About ``INVALID_SHARE`` of the cases are invalid in one way (``INVALID_KINDS``):
their expected answer is INVALID_ARG naming a field (``tests.differential.requests.expected_field``).
"""
from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field

from tests.differential.families import Family

INVALID_SHARE = 0.15
INVALID_KINDS = ("broken_media", "bad_base64", "unknown_part", "missing_item", "unreferenced_item", "too_many",
                 "placeholder_mismatch", "bad_role", "bad_sampling")
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
IMAGE_MODES = ("RGB", "L", "RGBA", "P", "LA")
AUDIO_RATES = (8_000, 11_025, 16_000, 22_050, 24_000, 32_000, 44_100, 48_000)
WORDS = ("what", "is", "in", "the", "picture", "clip", "describe", "compare", "them", "colour", "sound", "left",
         "right", "count", "objects", "why", "moving", "short", "story", "about", "this", "please", "and", "then")
UNKNOWN_PARTS = ("picture", "image_file", "file", "video_frames", "input_image", "")


@dataclass
class Item:
    """One media item: ``form`` is ``item`` (a tensor, taken by an ``{"type": m}`` part or a placeholder), ``url`` (a
    data URL part) or ``data`` (an ``input_audio`` part); ``broken``: how its bytes are spoilt (``media.broken``), or
    ``bad_base64`` (a data URL / data part whose payload is not base64)."""

    modality: str
    spec: dict
    form: str = "item"
    broken: str | None = None


@dataclass
class Case:
    """One request's shape. ``kind``: ``text``, ``prompt`` or ``chat``. ``turns`` (chat): ``{"role", "parts"}`` with
    parts ``{"text": s}``, ``{"item": k}`` (``items[k]``) or ``{"raw": part}`` (sent as is); ``prompt`` (text,
    prompt): the text, placeholders included; ``extra``: tensor items no part references. ``invalid``: the one
    thing wrong with it (``INVALID_KINDS``) or None."""

    family: str
    seed: int
    index: int
    kind: str
    items: list[Item] = field(default_factory=list)
    turns: list[dict] = field(default_factory=list)
    prompt: str | None = None
    extra: list[Item] = field(default_factory=list)
    stream: bool = True
    sampling: dict = field(default_factory=dict)
    invalid: str | None = None

    def as_dict(self) -> dict:
        return asdict(self)

    def shape(self) -> str:
        """One line a person reads: the kind, each item (size, format, form, breakage), the turns, what is wrong."""
        items = ", ".join(_item_shape(item) for item in self.items + self.extra) or "no media"
        turns = f"{len(self.turns)} messages" if self.kind == "chat" else f"prompt {self.prompt!r:.80}"
        return (f"{self.kind} ({turns}); {items}; stream={self.stream} sampling={self.sampling}"
                f"{'; INVALID: ' + self.invalid if self.invalid else ''}")


def _item_shape(item: Item) -> str:
    s = item.spec
    what = {"image": lambda: f"image {s['w']}x{s['h']} {s['fmt']}/{s['mode']}",
            "video": lambda: f"video {s['w']}x{s['h']} {s['frames']}f@{s['fps']}fps {s['codec']}",
            "audio": lambda: f"audio {s['seconds']}s {s['rate']}Hz x{s['channels']} {s['fmt']}"}[item.modality]()
    return f"{what} as {item.form}" + (f" BROKEN:{item.broken}" if item.broken else "")


def _weighted_size(rng: random.Random) -> int:
    """A longest side in 28..1024 px, mostly small."""
    r = rng.random()
    return rng.randint(28, 192) if r < 0.8 else rng.randint(192, 512) if r < 0.95 else rng.randint(512, 1024)


def image_spec(rng: random.Random) -> dict:
    long = _weighted_size(rng)
    ratio = rng.uniform(4, 20) if rng.random() < 0.15 else rng.uniform(1, 3)
    short = max(28, min(long, round(long / ratio)))
    w, h = (long, short) if rng.random() < 0.5 else (short, long)
    fmt = rng.choice(IMAGE_FORMATS)
    mode = rng.choice(("RGB", "L") if fmt == "JPEG" else ("RGB", "L", "RGBA", "P") if fmt in ("GIF", "BMP")
                      else IMAGE_MODES)
    return {"w": w, "h": h, "fmt": fmt, "mode": mode, "seed": rng.randrange(2**31)}


def video_spec(rng: random.Random) -> dict:
    codec = rng.choice(("mp4v", "h264"))
    w, h = (2 * rng.randint(16, 80) for _ in range(2))  # 32-160 px, even (H.264's yuv420p)
    frames = rng.randint(1, 32) if rng.random() < 0.3 else rng.randint(2, 12)
    return {"w": w, "h": h, "frames": frames, "fps": rng.randint(1, 30), "codec": codec, "seed": rng.randrange(2**31)}


def audio_spec(rng: random.Random) -> dict:
    r = rng.random()
    seconds = rng.uniform(0.1, 3) if r < 0.8 else rng.uniform(3, 12) if r < 0.95 else rng.uniform(12, 40)
    return {"seconds": round(seconds, 2), "rate": rng.choice(AUDIO_RATES), "channels": rng.choice((1, 1, 2)),
            "fmt": rng.choice(("WAV", "WAV", "FLAC")), "seed": rng.randrange(2**31)}


SPECS = {"image": image_spec, "video": video_spec, "audio": audio_spec}


def _text(rng: random.Random, low: int = 2, high: int = 9) -> str:
    words = [rng.choice(WORDS) for _ in range(rng.randint(low, high))]
    return " ".join(words).capitalize() + rng.choice(("?", ".", "!"))


def _media(rng: random.Random, fam: Family) -> list[Item]:
    """The items of a request with media: per modality the family takes, 0..limit of them (0-4 images, 0-2 videos,
    0-3 audio clips), at least one item in all."""
    items: list[Item] = []
    while not items:
        for name in fam.modalities:
            count = rng.choice(range(fam.limits[name] + 1))
            items += [Item(name, SPECS[name](rng)) for _ in range(count)]
    if rng.random() < 0.1:  # the same item twice in one request
        items.append(Item(items[0].modality, dict(items[0].spec)))
    limited = [i for i in items if sum(j.modality == i.modality for j in items) <= fam.limits[i.modality]]
    return limited or items[:1]


def generate(fam: Family, seed: int, index: int) -> Case:
    """Case ``index`` of the run seeded ``seed`` for family ``fam``."""
    rng = random.Random(f"{fam.name}:{seed}:{index}")
    kind = rng.choices(("text", "prompt", "chat"), (0.1, 0.25, 0.65))[0]
    case = Case(fam.name, seed, index, kind, stream=rng.random() < 0.7,
                sampling={"temperature": 0.0, "max_tokens": rng.randint(1, 8)})
    if kind == "text":
        if rng.random() < 0.5:
            case.prompt = _text(rng)
        else:
            case.kind, case.turns = "chat", [{"role": "user", "parts": [{"text": _text(rng)}]}]
    elif kind == "prompt":
        case.items = _media(rng, fam)
        case.prompt = _prompt(rng, fam, case.items)
    else:
        case.items = _media(rng, fam) if rng.random() < 0.9 else []
        for item in case.items:
            wav = item.modality == "audio" and item.spec["fmt"] == "WAV"  # input_audio's formats: wav (and mp3)
            item.form = rng.choice(("item", "url", "data") if wav else ("item", "url"))
        case.turns = _turns(rng, len(case.items))
    if rng.random() < INVALID_SHARE:
        from tests.differential.invalid import spoil

        spoil(case, fam, rng)
    return case


def _prompt(rng: random.Random, fam: Family, items: list[Item]) -> str:
    """A chat-formatted prompt naming every item by the family's placeholder, in a random order per modality mix
    (the server takes each modality's placeholders in order of its items), or, one time in four, naming none."""
    if rng.random() < 0.25:
        return _text(rng)
    marks = [fam.placeholder(item.modality) for item in items]
    rng.shuffle(marks)
    body = "".join(mark + (rng.choice(("", "\n", " and ")) if rng.random() < 0.5 else "") for mark in marks)
    return f"<|im_start|>user\n{body}{_text(rng)}<|im_end|>\n<|im_start|>assistant\n"


def _turns(rng: random.Random, items: int) -> list[dict]:
    """One to three user turns (an assistant reply between two), the items spread over them in order, each user turn
    with a text part somewhere; sometimes a system message first."""
    users = rng.choices((1, 2, 3), (0.6, 0.25, 0.15))[0]
    cuts = sorted(rng.randint(0, items) for _ in range(users - 1))
    bounds = [0, *cuts, items]
    turns = [{"role": "system", "parts": [{"text": "You are a helpful assistant."}], "string": True}] \
        if rng.random() < 0.2 else []
    for u in range(users):
        parts: list[dict] = [{"item": k} for k in range(bounds[u], bounds[u + 1])]
        parts.insert(rng.randint(0, len(parts)), {"text": _text(rng)})
        if u:
            turns.append({"role": "assistant", "parts": [{"text": _text(rng, 1, 6)}], "string": True})
        turns.append({"role": "user", "parts": parts, "string": len(parts) == 1 and rng.random() < 0.5})
    return turns


def generate_all(fam: Family, seed: int, count: int, only: list[int] | None = None) -> list[Case]:
    """Cases ``0..count-1`` (or the ``only`` indices) of the run seeded ``seed``."""
    return [generate(fam, seed, index) for index in (only if only else range(count))]
