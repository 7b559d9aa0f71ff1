"""The reuse benchmark's agent conversation (part (c) of ``clients.bench.reuse``): turns that each re-send every earlier
screenshot and add one new one, with pauses between turns in which background traffic (other requests, new images)
churns the caches; demand-aware encoding with retention ON (request parameters ``session_id`` and
``epd_demand_aware: true``) against OFF (neither), side by side.

The two conversations of one pause run in lock-step, each a conversation of its own (its own screenshots):
ON's turn k, the counters read, OFF's turn k, the counters read, then the pause with background traffic. So both see
the same churn, and each turn's encodes are its own: the counters' movement since the last read, less the background
items in between (every background image is new, so each is encoded exactly once). A conversation's gap between turns
is therefore the pause plus the reads and the other conversation's turn (~3 s; reported as ``gap_s``).
Per turn: the request's items (``timings.items``), those served from the consumer's copy (``timings.held``; the others
were sent to the encoder), the demand-aware lookup (``timings.lookup_ms``), encodes (the counters), TTFT. Every answer is checked against ``llm``'s.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from backend.protocol.generate import GenerateInputs
from clients.bench.load import run_concurrency, run_until
from clients.bench.reuse_parts import Checker, moved, ms, references, scrape, settled
from clients.images import image_bytes

ON, OFF = "on", "off"
SESSION_PARAMETER, DEMAND_PARAMETER = "session_id", "epd_demand_aware"
HELD = ("epd_held_hits_total", "epd_demand_skipped_total", "epd_held_bytes")  # the consumer's copies
SEEDS = 5_000_000  # screenshots' seeds: apart from every other part's images
BACKGROUND_SEEDS = 7_000_000


@dataclass
class Conversation:
    """One agent conversation: ``turns`` screenshots of ``size``; ``parameters`` go with every turn."""

    mode: str
    pause: float
    seed: int
    size: tuple[int, int]
    max_tokens: int
    parameters: dict | None = None
    shots: dict[int, bytes] = field(default_factory=dict)

    def screenshot(self, j: int) -> bytes:
        if j not in self.shots:
            self.shots[j] = image_bytes(*self.size, seed=self.seed + j)
        return self.shots[j]

    def request(self, k: int) -> GenerateInputs:
        """Turn ``k`` (1-based): the whole history, screenshots 1..k, each with the agent's question; the agent's
        earlier replies are fixed text (so every turn's request is the same in both modes and for ``llm``)."""
        messages = []
        for j in range(1, k + 1):
            messages.append({"role": "user", "content": [{"type": "image"},
                                                         {"type": "text", "text": f"Screenshot {j}: what next?"}]})
            if j < k:
                messages.append({"role": "assistant", "content": f"Clicked button {j}."})
        return GenerateInputs(messages=messages, images=[self.screenshot(j) for j in range(1, k + 1)],
                              sampling={"temperature": 0.0, "max_tokens": self.max_tokens, "ignore_eos": True},
                              stream=True, parameters=self.parameters)

    def name(self, k: int) -> str:
        return f"agent seed {self.seed} turn {k}"


def conversations(pause: float, index: int, size: tuple[int, int], max_tokens: int) -> tuple[Conversation, Conversation]:
    """ON and OFF for one pause, each with screenshots of its own (no cache holds one for the other)."""
    session = f"reuse-bench-{time.time_ns()}-{index}"
    on = Conversation(ON, pause, SEEDS + index * 2000, size, max_tokens,
                      {SESSION_PARAMETER: session, DEMAND_PARAMETER: True})
    return on, Conversation(OFF, pause, SEEDS + index * 2000 + 1000, size, max_tokens)


@dataclass
class Background:
    """Closed-loop requests of new images (``images`` of ``size`` each, JPEG: cheap to make) during the pauses."""

    concurrency: int
    images: int
    size: tuple[int, int]
    max_tokens: int
    sent: int = 0  # requests made so far (their images' seeds)

    def make(self, _: int) -> GenerateInputs:
        seed = BACKGROUND_SEEDS + self.images * self.sent
        self.sent += 1
        return GenerateInputs(prompt="Describe the picture.", stream=True,
                              images=[image_bytes(*self.size, seed=seed + i, fmt="JPEG") for i in range(self.images)],
                              sampling={"temperature": 0.0, "max_tokens": self.max_tokens, "ignore_eos": True})

    async def run(self, url: str, seconds: float, progress) -> tuple[int, int]:
        """Traffic for ``seconds``: (items of the requests answered, requests failed)."""
        results, _ = await run_until(url, "epd", self.concurrency, self.make, time.monotonic() + seconds, progress)
        return len(results.samples) * self.images, len(results.errors)


async def lockstep(server, pair: tuple[Conversation, Conversation], turns: int, background: Background, progress) -> dict:
    """Both conversations of one pause, turn by turn (module docstring); per turn one record per mode."""
    url, metrics_url, pause = server.grpc_url, server.metrics_url, pair[0].pause
    held_before = scrape(metrics_url, HELD)
    last, background_items, background_errors = await settled(metrics_url), 0, 0
    ended: dict[str, float] = {}
    records, answers = [], []
    for k in range(1, turns + 1):
        for conversation in pair:
            sent = time.monotonic()
            results, _ = await run_concurrency(url, "epd", 1, [conversation.request(k)], progress)
            ended_now = time.monotonic()
            now = await settled(metrics_url)
            encodes = moved(last, now)["epd_encoder_items_total"] - background_items
            last, background_items = now, 0
            timings = results.samples[0].timings if results.samples else {}
            records.append({"mode": conversation.mode, "pause_s": pause, "turn": k, "encodes": encodes,
                            "items": timings.get("items"), "held": timings.get("held", 0) if timings else None,
                            "lookup_ms": timings.get("lookup_ms"), "cached_tokens": timings.get("cached_tokens"),
                            "ttft_ms": round(results.samples[0].ttft * 1000, 1) if results.samples else None,
                            "gap_s": round(sent - ended[conversation.mode], 1) if conversation.mode in ended else None,
                            "background_errors": background_errors, "error": results.errors[:1]})
            ended[conversation.mode] = ended_now
            answers.append((conversation, k, results))
        background_errors = 0
        if k < turns and pause > 0:
            background_items, background_errors = await background.run(url, pause, progress)
    held = moved(held_before, scrape(metrics_url, HELD))
    return {"turns": records, "held_metrics": held, "answers": answers}


def summary(records: list[dict], mode: str) -> dict:
    """One mode's turns after the first (the first has nothing to reuse): totals, TTFT, how many turns encoded only
    their new screenshot."""
    later = [r for r in records if r["mode"] == mode and r["turn"] > 1]
    ttft = [r["ttft_ms"] / 1000 for r in later if r["ttft_ms"] is not None]
    lookups = [r["lookup_ms"] / 1000 for r in later if r.get("lookup_ms") is not None]
    gaps = [r["gap_s"] for r in later if r["gap_s"] is not None]
    items, held = sum(r["items"] or 0 for r in later), sum(r["held"] or 0 for r in later)
    return {"encodes": sum(r["encodes"] for r in later), "items": items, "held": held, "to_encoder": items - held,
            "only_new": sum(r["encodes"] == 1 for r in later), "lookup_p50_ms": ms(lookups, 50),
            "cached_tokens": sum(r.get("cached_tokens") or 0 for r in later),

            "turns": len(later), "ttft_p50_ms": ms(ttft, 50), "ttft_p90_ms": ms(ttft, 90),
            "gap_s": round(sum(gaps) / len(gaps), 1) if gaps else None,
            "errors": sum(bool(r["error"]) for r in later) + sum(r["background_errors"] for r in later)}


async def agent(server, pauses: list[float], turns: int, size: tuple[int, int], background: Background,
                checker: Checker, max_tokens: int, progress) -> dict:
    """Every pause's pair of conversations, then each turn's answer checked against ``llm``'s."""
    out, answers = {}, []
    for index, pause in enumerate(pauses):
        run = await lockstep(server, conversations(pause, index, size, max_tokens), turns, background, progress)
        answers += run.pop("answers")
        out[f"{pause:g}"] = {**run, ON: summary(run["turns"], ON), OFF: summary(run["turns"], OFF)}
    requests = [replace(c.request(k), parameters=None) for c, k, _ in answers]
    names = [c.name(k) for c, k, _ in answers]
    await references(server.grpc_url, 2, requests, names, checker, progress)
    for conversation, k, results in answers:
        for sample in results.samples:
            sample.index = 0
        checker.check(f"agent {conversation.mode} pause {conversation.pause:g} s turn {k}", [conversation.name(k)],
                      results.samples, results.errors, f"agent {conversation.mode}")
    return out
