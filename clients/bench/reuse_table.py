"""The reuse benchmark's one table (``clients.bench.reuse``): its results (the JSON it writes) -> markdown rows, side by
side. Columns: the part, what is measured, *without* (per-instance caches only; for the agent: demand-aware encoding
and retention OFF), *with* (the shared tier; the agent: ON), the change, the issue's target. Pure, unit-tested.
"""
from __future__ import annotations

HEADER = ("part", "measured", "without: per-instance caches / OFF", "with: shared tier / ON", "change", "target")
MISSING = "-"


def num(value, digits: int = 1) -> str:
    if value is None:
        return MISSING
    if isinstance(value, float) and value.is_integer() and digits == 0:
        return str(int(value))
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def change(before, after) -> str:
    """``after`` against ``before``, in percent ("-42%"); "-" where either is missing or ``before`` is 0."""
    if before in (None, 0) or after is None:
        return MISSING
    return f"{(after - before) / before * 100:+.0f}%"


def _get(doc: dict, *path):
    for key in path:
        if not isinstance(doc, dict) or key not in doc:
            return None
        doc = doc[key]
    return doc


def reassignment_rows(results: dict) -> list[tuple]:
    done = results.get("reassignment") or {}
    if not done:
        return []
    s = results["settings"]
    c, t = done.get("caches", {}), done.get("tier", {})
    encodes = lambda d, phase: _get(d, phase, "counts", "epd_encoder_items_total")
    items = s["requests"] * s["images"]
    p2 = [encodes(c, "phase2"), encodes(t, "phase2")]
    rows = [("(a) reassignment", f"phase 1: {s['requests']} requests x {s['images']} new images, encodes",
             num(encodes(c, "phase1"), 0), num(encodes(t, "phase1"), 0), "", str(items)),
            ("(a)", "encoder model reloaded (unload + load: fresh instances), s", num(_get(c, "reload_s")),
             num(_get(t, "reload_s")), "", ""),
            ("(a)", "phase 2, the same requests, every image on an instance that has not seen it: re-encodes",
             num(p2[0], 0), num(p2[1], 0), f"{num(p2[0], 0)} -> {num(p2[1], 0)}", f"{items} -> 0"),
            ("(a)", "phase 2: served from the tier (hits)", num(_get(c, "phase2", "counts", "epd_tier_hits_total"), 0),
             num(_get(t, "phase2", "counts", "epd_tier_hits_total"), 0), "", "")]
    warm = lambda d: f"{num(_get(d, 'after_reload', 'ttft_p50_ms'))} / {num(_get(d, 'after_reload', 'ttft_p90_ms'))}"
    rows.append(("(a)", f"after the reload, {s['concurrency'] * 2} requests of images sent before phase 1 (the fresh "
                 "instances' first work): TTFT p50 / p90, ms", warm(c), warm(t), "", ""))
    for q, target in (("p50", ""), ("p90", ">= 40% lower")):
        before, after = _get(c, "phase2", f"ttft_{q}_ms"), _get(t, "phase2", f"ttft_{q}_ms")
        rows.append(("(a)", f"phase 2 TTFT {q}, ms", num(before), num(after), change(before, after), target))
    before, after = _get(c, "phase2", "encode_p50_ms"), _get(t, "phase2", "encode_p50_ms")
    rows.append(("(a)", "phase 2 encode phase p50 (epd's timings.encode_ms), ms", num(before), num(after),
                 change(before, after), ""))
    rows.append(("(a)", "phase 1 TTFT p50 / p90, ms (both encode everything)",
                 f"{num(_get(c, 'phase1', 'ttft_p50_ms'))} / {num(_get(c, 'phase1', 'ttft_p90_ms'))}",
                 f"{num(_get(t, 'phase1', 'ttft_p50_ms'))} / {num(_get(t, 'phase1', 'ttft_p90_ms'))}", "", ""))
    return rows


def cold_rows(results: dict) -> list[tuple]:
    done = results.get("cold") or {}
    if not done:
        return []
    n = results["settings"]["cold"]
    c, t = done.get("caches", {}), done.get("tier", {})
    enc = [_get(c, "counts", "epd_encoder_items_total"), _get(t, "counts", "epd_encoder_items_total")]
    waits = _get(t, "counts", "epd_tier_waits_total")
    return [("(b) single-flight", f"{n} concurrent cold requests, one new image: encodes", num(enc[0], 0),
             num(enc[1], 0), f"{num(enc[0], 0)} -> {num(enc[1], 0)}", "1"),
            ("(b)", "claims lost (waited for the other instance)", MISSING, num(waits, 0), "", ""),
            ("(b)", "TTFT p50 / p90, ms", f"{num(_get(c, 'ttft_p50_ms'))} / {num(_get(c, 'ttft_p90_ms'))}",
             f"{num(_get(t, 'ttft_p50_ms'))} / {num(_get(t, 'ttft_p90_ms'))}", "", "")]


def _turn(record: dict | None) -> str:
    if record is None:
        return MISSING
    if record.get("error"):
        return f"ERROR {record['error'][0][:60]}"
    to_encoder = record["items"] - record["held"] if record["items"] is not None else None
    return (f"enc {num(record['encodes'], 0)} · E {num(to_encoder, 0)} · held {num(record['held'], 0)} · "
            f"{num(record['ttft_ms'])} ms")


def agent_rows(results: dict) -> list[tuple]:
    done = results.get("agent")
    if not done:
        return []
    if "skipped" in done:
        return [("(c) agent", "skipped", MISSING, MISSING, "", done["skipped"])]
    turns = results["settings"]["turns"]
    rows = []
    for pause, run in done.items():
        off, on = run["off"], run["on"]
        where = f"(c) agent, pause {pause} s"
        rows += [(where, f"turns 2-{turns}: encodes (tower outputs)", num(off["encodes"], 0), num(on["encodes"], 0),
                  f"{num(off['encodes'], 0)} -> {num(on['encodes'], 0)}", f"{turns - 1} (the new screenshots)"),
                 (where, "items sent to the encoder / served from the consumer's copy",
                  f"{off['to_encoder']} / {off['held']}", f"{on['to_encoder']} / {on['held']}", "", ""),
                 (where, "turns that encoded only their new screenshot", f"{off['only_new']} of {off['turns']}",
                  f"{on['only_new']} of {on['turns']}", "", f"{turns - 1} of {turns - 1}"),
                 (where, "TTFT p50 / p90, ms", f"{num(off['ttft_p50_ms'])} / {num(off['ttft_p90_ms'])}",
                  f"{num(on['ttft_p50_ms'])} / {num(on['ttft_p90_ms'])}",
                  change(off["ttft_p50_ms"], on["ttft_p50_ms"]), ""),
                 (where, f"prompt tokens vLLM's prefix cache covered, turns 2-{turns} (timings.cached_tokens)",
                  num(off.get("cached_tokens"), 0), num(on.get("cached_tokens"), 0), "", ""),
                 (where, "demand-aware lookup p50 (timings.lookup_ms), ms", num(off["lookup_p50_ms"]),
                  num(on["lookup_p50_ms"]), "", ""),
                 (where, "mean gap between turns, s (pause + reads + the other's turn)", num(off["gap_s"]),
                  num(on["gap_s"]), "", "")]
        by = {(r["mode"], r["turn"]): r for r in run["turns"]}
        rows += [(f"(c) pause {pause} s", f"turn {k}: encodes · items to E · held · TTFT", _turn(by.get(("off", k))),
                  _turn(by.get(("on", k))), "", "") for k in range(1, turns + 1)]
    return rows


def cost_rows(results: dict) -> list[tuple]:
    done = results.get("cost")
    if not done:
        return []
    look, pool, memory = done["lookup"], done["pool"], done["memory_kib"]
    rows = [("(d) tier cost", f"lookup, {what} ({look['entry_bytes'] // 1024} KiB entry): p50 / p90, ms", MISSING,
             f"{look[key]['p50_ms']:.3f} / {look[key]['p90_ms']:.3f}", "", "")
            for key, what in (("miss", "a miss"), ("hit", "a hit (read + checks)"), ("exists", "is_exist alone"),
                              ("claim", "a claim of a cold item (single-flight)"))]
    mib = lambda b: f"{b / (1 << 20):.1f} MiB"
    rows.append(("(d)", "held in the pool: bytes (keys) of its capacity", MISSING,
                 f"{mib(pool['master_allocated_bytes'])} ({num(pool['master_key_count'], 0)} keys) of "
                 f"{mib(pool['master_total_capacity_bytes'])}", "", ""))
    for who in ("master", "holder"):
        m = memory[who]
        rows.append(("(d)", f"memory of the {who}: RSS / PSS, MiB", MISSING,
                     f"{m['rss'] / 1024:.1f} / {m['pss'] / 1024:.1f}", "", ""))
    return rows


def lookup_rows(results: dict) -> list[tuple]:
    done = results.get("lookup")
    if not done:
        return []
    off, on = done["off"], done["on"]
    return [("(e) a lookup on a cold request", f"{on['requests']} + {off['requests']} cold requests one at a time, "
             "demand-aware off / on alternately: TTFT p50 / p90, ms",
             f"{num(off['ttft_p50_ms'])} / {num(off['ttft_p90_ms'])}", f"{num(on['ttft_p50_ms'])} / {num(on['ttft_p90_ms'])}",
             change(off["ttft_p50_ms"], on["ttft_p50_ms"]), "no more than it saves"),
            ("(e)", "the lookup itself (timings.lookup_ms): p50 / p90, ms; items it found", MISSING,
             f"{num(done['lookup_p50_ms'])} / {num(done['lookup_p90_ms'])}; {done['held']}", "", "")]


def check_rows(results: dict) -> list[tuple]:
    tally = (results.get("checks") or {}).get("tally", {})
    cell = lambda group: (f"{tally[group][0] - tally[group][1]} of {tally[group][0]} equal" +
                          (f", **{tally[group][1]} MISMATCHED/FAILED**" if tally[group][1] else "")
                          if group in tally else MISSING)
    rows = [("checks", "epd answers equal llm's (greedy, token for token): (a), (b)", cell("caches"), cell("tier"),
             "", "all")]
    if "agent on" in tally or "agent off" in tally:
        rows.append(("checks", "epd answers equal llm's: (c)", cell("agent off"), cell("agent on"), "", "all"))
    return rows


def markdown(results: dict) -> str:
    rows = [*reassignment_rows(results), *cold_rows(results), *agent_rows(results), *lookup_rows(results),
            *cost_rows(results), *check_rows(results)]
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    if results.get("failed"):
        lines += ["", f"**The run stopped early**: {results['failed']}"]
    problems = (results.get("checks") or {}).get("problems", [])
    if problems:
        lines += ["", f"{len(problems)} problem(s):", *(f"- {p}" for p in problems[:20])]
    return "\n".join(lines)
