"""The invalid cases: ``spoil(case, family, rng)`` makes one thing wrong with a valid case (``INVALID_KINDS``), the
kinds that apply to its shape only; ``tests.differential.requests.expected_field`` says which field the answer must
name. Every kind is one a client can send by mistake: broken media bytes (truncated, noise after a real header,
empty), a data URL whose payload is not base64, an unknown content part type, an ``{"type": "image"}`` part with no
item left, an item no part takes, one item over the per-request limit, a placeholder count that does not match the
media, an unknown role, a sampling parameter out of range."""
from __future__ import annotations

import random

from tests.differential.cases import SPECS, UNKNOWN_PARTS, Case, Item, _prompt
from tests.differential.families import Family

BAD_SAMPLING = ({"max_tokens": 0}, {"temperature": -0.5}, {"top_p": 1.5}, {"top_k": -5}, {"min_p": 2.0})


def applicable(case: Case) -> list[str]:
    """The invalid kinds that fit ``case``'s shape."""
    kinds = ["bad_sampling", "too_many"]
    if case.items:
        kinds.append("broken_media")
    if case.kind == "chat":
        kinds += ["unknown_part", "missing_item", "bad_role", "unreferenced_item"]
        if case.items:
            kinds.append("bad_base64")
    if case.kind in ("prompt", "text"):
        kinds.append("placeholder_mismatch")
    return kinds


def spoil(case: Case, fam: Family, rng: random.Random) -> None:
    """Make ``case`` invalid in one way that fits it; ``case.invalid`` names the way."""
    kind = rng.choice(applicable(case))
    case.invalid = kind
    SPOILERS[kind](case, fam, rng)
    for item in case.items + case.extra:  # one fault only: vLLM's loaders take no frame of a 1-frame video
        if item.modality == "video" and item.spec["frames"] == 1:
            item.spec["frames"] = 2


def _broken_media(case: Case, fam: Family, rng: random.Random) -> None:
    rng.choice(case.items).broken = rng.choice(("truncated", "garbage", "empty"))


def _bad_base64(case: Case, fam: Family, rng: random.Random) -> None:
    item = rng.choice(case.items)
    if item.form == "item":
        item.form = "url"
    item.broken = "bad_base64"


def _user_turns(case: Case) -> list[dict]:
    return [turn for turn in case.turns if turn["role"] == "user"]


def _unknown_part(case: Case, fam: Family, rng: random.Random) -> None:
    turn = rng.choice(_user_turns(case))
    kind = rng.choice(UNKNOWN_PARTS)
    turn["parts"].insert(rng.randint(0, len(turn["parts"])), {"raw": {"type": kind, kind or "data": {"url": "x"}}})
    turn["string"] = False


def _missing_item(case: Case, fam: Family, rng: random.Random) -> None:
    turn = _user_turns(case)[-1]
    turn["parts"].append({"raw": {"type": rng.choice(fam.modalities)}})
    turn["string"] = False


def _unreferenced_item(case: Case, fam: Family, rng: random.Random) -> None:
    name = rng.choice(fam.modalities)
    if sum(i.modality == name and i.form == "item" for i in case.items) >= fam.limits[name]:
        case.invalid = "bad_sampling"
        _bad_sampling(case, fam, rng)
        return
    case.extra.append(Item(name, SPECS[name](rng)))


def _too_many(case: Case, fam: Family, rng: random.Random) -> None:
    """One item over the limit of a modality, small ones (the request is refused before any is decoded)."""
    name = rng.choice(fam.modalities)
    case.items = [i for i in case.items if i.modality != name]
    small = {"image": {"w": 32, "h": 32, "fmt": "PNG", "mode": "RGB"},
             "video": {"w": 32, "h": 32, "frames": 2, "fps": 2, "codec": "mp4v"},
             "audio": {"seconds": 0.2, "rate": 16_000, "channels": 1, "fmt": "WAV"}}[name]
    for _ in range(fam.limits[name] + 1):
        form = "item" if case.kind != "chat" else rng.choice(("item", "url"))
        case.items.append(Item(name, {**small, "seed": rng.randrange(2**31)}, form))
    if case.kind == "text":
        case.kind = "prompt"
    if case.kind == "prompt":
        case.prompt = _prompt(rng, fam, case.items)
    else:
        from tests.differential.cases import _turns

        case.turns = _turns(rng, len(case.items))


def _placeholder_mismatch(case: Case, fam: Family, rng: random.Random) -> None:
    """``text_input`` naming one item more, or one fewer, of a modality than it has (at least one placeholder in all,
    or the server would put them in front)."""
    name = rng.choice(fam.modalities)
    have = [fam.placeholder(i.modality) for i in case.items]
    mark = fam.placeholder(name)
    if mark in have and rng.random() < 0.5:
        have.remove(mark)
    else:
        have.append(mark)
    if not have:
        have = [mark, mark]
    rng.shuffle(have)
    case.kind = "prompt"
    case.prompt = f"<|im_start|>user\n{''.join(have)}Describe.<|im_end|>\n<|im_start|>assistant\n"


def _bad_role(case: Case, fam: Family, rng: random.Random) -> None:
    rng.choice(case.turns)["role"] = rng.choice(("robot", "User", "tool_output", ""))


def _bad_sampling(case: Case, fam: Family, rng: random.Random) -> None:
    case.sampling = {**case.sampling, **rng.choice(BAD_SAMPLING)}


SPOILERS = {"broken_media": _broken_media, "bad_base64": _bad_base64, "unknown_part": _unknown_part,
            "missing_item": _missing_item, "unreferenced_item": _unreferenced_item, "too_many": _too_many,
            "placeholder_mismatch": _placeholder_mismatch, "bad_role": _bad_role, "bad_sampling": _bad_sampling}
