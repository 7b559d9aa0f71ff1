"""The agent-loop benchmark's bookkeeping (``clients.bench.agent_loop``): one record per conversation turn, one count
per turn from ours' encoder metrics, the per-turn table (markdown) and the targets of issue 41.

A record: ``stack`` (``VLLM`` or ``OURS``), ``turn`` (1-based), ``conversation``, ``images`` (the request's),
``ttft_ms``, ``prompt_tokens``, ``cached_tokens``, ``epd_media`` (ours' usage extension, None on vLLM's server) and
``error``.
A turn's count (``counts[stack][turn]``): ``encoded``, the encoder's ``epd_encoder_items_total`` moved over the turn
(every conversation's turn k runs at once, nothing else runs meanwhile: the movement is theirs), and
``encoder_cache_hits`` (``epd_encoder_cache_hits_total``: items the encoder's own cache served); none for vLLM's
server, which counts no encodes.
"""
from __future__ import annotations

from clients.bench.reuse_parts import ms

VLLM, OURS = "vllm", "ours"
TTFT_RATIO = 0.5  # the issue's target: ours' turn-8 TTFT p90 at most half vLLM's
TARGET_TURN = 8


def record(stack: str, turn: int, conversation: int, answer) -> dict:
    """One turn of one conversation from its ``agent_turns.Answer``."""
    usage = answer.usage or {}
    details = usage.get("prompt_tokens_details") or {}
    return {"stack": stack, "turn": turn, "conversation": conversation, "images": turn,
            "ttft_ms": None if answer.ttft is None else round(answer.ttft * 1000, 1),
            "prompt_tokens": usage.get("prompt_tokens"), "cached_tokens": details.get("cached_tokens"),
            "epd_media": usage.get("epd_media"), "error": answer.error}


def _sum(values) -> int | None:
    values = [v for v in values if v is not None]
    return sum(values) if values else None


def turn_summary(records: list[dict], counts: dict, stack: str, turn: int) -> dict:
    """One stack's turn over its conversations: TTFT p50/p90, tokens, media items, the metrics' encodes."""
    mine = [r for r in records if r["stack"] == stack and r["turn"] == turn]
    ttft = [r["ttft_ms"] / 1000 for r in mine if r["ttft_ms"] is not None]
    media = [r["epd_media"] for r in mine if r["epd_media"]]
    count = counts.get(stack, {}).get(turn, {})
    return {"conversations": len(mine), "errors": sum(bool(r["error"]) for r in mine),
            "ttft_p50_ms": ms(ttft, 50), "ttft_p90_ms": ms(ttft, 90),
            "prompt_tokens": _sum(r["prompt_tokens"] for r in mine),
            "cached_tokens": _sum(r["cached_tokens"] for r in mine),
            "items": sum(r["images"] for r in mine),
            "usage_encoded": _sum(m.get("encoded") for m in media) if media else None,
            "usage_reused": _sum(m.get("reused") for m in media) if media else None,
            "encoded": count.get("encoded"), "encoder_cache_hits": count.get("encoder_cache_hits")}


def turns(records: list[dict], counts: dict) -> list[dict]:
    """Per turn: both stacks' summaries and ours' TTFT p90 over vLLM's."""
    out = []
    for turn in sorted({r["turn"] for r in records}):
        row = {"turn": turn, VLLM: turn_summary(records, counts, VLLM, turn),
               OURS: turn_summary(records, counts, OURS, turn)}
        ratio = _p90_ratio(row)
        row["p90_ratio"] = None if ratio is None else round(ratio, 2)
        out.append(row)
    return out


def _p90_ratio(row: dict) -> float | None:
    """Ours' TTFT p90 over vLLM's on a ``turns`` row (None where either is missing)."""
    theirs, ours = row[VLLM]["ttft_p90_ms"], row[OURS]["ttft_p90_ms"]
    return ours / theirs if theirs and ours is not None else None


def targets(rows: list[dict], turn: int = TARGET_TURN) -> dict:
    """The issue's targets on ``rows`` (``turns``): every turn of ours encoded only its new screenshots (one per
    conversation, by the metrics and by ``usage.epd_media``), and turn ``turn``'s TTFT p90 ratio <= ``TTFT_RATIO``."""
    ours = [row[OURS] for row in rows]
    only_new = bool(ours) and all(t["encoded"] == t["conversations"] and t["usage_encoded"] == t["conversations"]
                                  and not t["errors"] for t in ours)
    at = next((row for row in rows if row["turn"] == turn), None)
    exact = _p90_ratio(at) if at else None  # the target on the ratio itself, not its rounding
    return {"only_new_images_encoded": only_new,
            "encoded_per_turn": [t["encoded"] for t in ours],
            "ttft_turn": turn if at else None, "ttft_p90_ratio": at["p90_ratio"] if at else None,
            "ttft_p90_met": exact is not None and exact <= TTFT_RATIO}


def _num(value) -> str:
    return "—" if value is None else f"{value:g}"


def _pair(a, b) -> str:
    return f"{_num(a)} / {_num(b)}"


def markdown(rows: list[dict], met: dict) -> str:
    """The per-turn table and the targets' lines."""
    lines = ["| turn | images / conv | vLLM TTFT p50 / p90 ms | ours TTFT p50 / p90 ms | p90 ours / vLLM "
             "| ours encoded (metrics) | ours usage encoded / reused | cached tokens vLLM / ours | prompt tokens "
             "| errors vLLM / ours |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        v, o = row[VLLM], row[OURS]
        lines.append(f"| {row['turn']} | {row['turn']} | {_pair(v['ttft_p50_ms'], v['ttft_p90_ms'])} "
                     f"| {_pair(o['ttft_p50_ms'], o['ttft_p90_ms'])} | {_num(row['p90_ratio'])} "
                     f"| {_num(o['encoded'])} "
                     f"| {_pair(o['usage_encoded'], o['usage_reused'])} "
                     f"| {_pair(v['cached_tokens'], o['cached_tokens'])} | {_num(o['prompt_tokens'])} "
                     f"| {v['errors']} / {o['errors']} |")
    only = "met" if met["only_new_images_encoded"] else "NOT met"
    ttft = "met" if met["ttft_p90_met"] else "NOT met"
    lines += ["", f"Target, items encoded per turn = the new images only: **{only}** "
                  f"(encoded per turn, all conversations: {met['encoded_per_turn']}).",
              f"Target, turn-{met['ttft_turn']} TTFT p90 <= {TTFT_RATIO}x vLLM's: **{ttft}** "
              f"(ours / vLLM's = {met['ttft_p90_ratio']})."]
    return "\n".join(lines)
