"""Open-loop load for the overload benchmark (``clients.bench.overload``): Poisson arrivals over the OpenAI protocol,
two priority classes, every request's fate (served, shed with 429, past its deadline with 503, another error, or no
answer at all) and the summary per class.

A request is one streaming chat completion (one random-pixel image, its own, and a short text; greedy, ``max_tokens``
with ``ignore_eos``), class ``high`` (vLLM's ``priority`` 0) with probability ``high_share``, else ``low`` (1).
``priorities=False`` sends no priority (the deployment without admission and priorities). A request that gets no
final answer within ``timeout`` seconds is counted hung; a connection that breaks, lost.
"""
from __future__ import annotations

import asyncio
import math
import random
import time
from dataclasses import dataclass

from backend.engine.loop import LAG_INTERVAL_SECONDS, watch_lag
from clients.bench.report import percentile
from clients.bench.side_client import Request, chat_body, first_token_event, parse_sse_line, request_set

CLASSES = {"high": 0, "low": 1}  # class -> priority


@dataclass
class Fate:
    cls: str
    status: int | None = None  # HTTP status; None: no answer (hung) or the connection broke (lost)
    ttft: float | None = None  # seconds to the first text (served requests)
    answered: float | None = None  # seconds to the final answer (the last byte, or the error)
    retry_after: str | None = None
    error: str = ""
    complete: bool = False  # a served stream that ended with [DONE]
    at: float = 0.0  # its arrival, seconds into the level (open loop)
    late: float = 0.0  # seconds the client's loop sent it after its arrival (the load generator's own delay)
    stages: dict | None = None  # the server's stage times (``usage.epd_timings``: queued_ms, encode_ms, first_chunk_ms)
    sent_at: float = 0.0  # time.perf_counter() at its send
    client_lag: float = 0.0  # the client's own event loop: its latest wake-up while the request was out (open_loop)

    @property
    def outcome(self) -> str:
        if self.status == 200:
            return "served" if self.complete else "broken"
        if self.status == 429:
            return "shed"
        if self.status == 503:
            return "expired"
        if self.status is None:
            return "hung" if self.error == "hung" else "lost"
        return "error"


async def _one(session, url: str, body: dict, fate: Fate, timeout: float) -> None:
    import aiohttp

    started = fate.sent_at = time.perf_counter()
    try:
        async with asyncio.timeout(timeout):
            async with session.post(url, json=body) as resp:
                fate.status = resp.status
                fate.retry_after = resp.headers.get("Retry-After")
                if resp.status != 200:
                    fate.error = (await resp.text())[:200]
                    return
                async for line in resp.content:
                    event = parse_sse_line(line)
                    if event == "[DONE]":
                        fate.complete = True
                        break
                    if isinstance(event, dict):
                        if "error" in event:
                            fate.error = str(event["error"])[:200]
                            break
                        if fate.ttft is None and first_token_event(event):
                            fate.ttft = time.perf_counter() - started
                        if event.get("usage"):
                            fate.stages = event["usage"].get("epd_timings")
    except TimeoutError:
        fate.status, fate.error = None, "hung"
    except (aiohttp.ClientError, ConnectionError) as exc:
        fate.status, fate.error = None, f"{type(exc).__name__}: {exc}"[:200]
    finally:
        fate.answered = time.perf_counter() - started


async def _sent(session, url: str, body: dict, fate: Fate, timeout: float, due: float) -> None:
    fate.late = asyncio.get_running_loop().time() - due
    await _one(session, url, body, fate, timeout)


async def open_loop(base_url: str, model: str, rate: float, seconds: float, high_share: float, max_tokens: int,
                    image_size: int, seed: int, priorities: bool = True, deadline_ms: float | None = None,
                    timeout: float = 120.0) -> list[Fate]:
    """Requests arriving at ``rate`` per second (Poisson) for ``seconds``; each one's fate, in arrival order."""
    import aiohttp

    rng = random.Random(seed)
    arrivals, t = [], rng.expovariate(rate)
    while t < seconds:
        arrivals.append((t, "high" if rng.random() < high_share else "low"))
        t += rng.expovariate(rate)
    requests: list[Request] = request_set(seed * 100_000, len(arrivals), image_size)
    url, fates, tasks, lags = f"{base_url}/v1/chat/completions", [], [], []
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        loop = asyncio.get_running_loop()
        watcher = asyncio.create_task(watch_lag(lambda lag: lags.append((time.perf_counter(), lag))))
        start = loop.time()
        for (at, cls), request in zip(arrivals, requests):
            await asyncio.sleep(max(0.0, start + at - loop.time()))
            body = chat_body(model, request, max_tokens)
            if priorities:
                body["priority"] = CLASSES[cls]
            if deadline_ms:
                body["deadline_ms"] = deadline_ms
            fates.append(Fate(cls, at=at))
            tasks.append(asyncio.create_task(_sent(session, url, body, fates[-1], timeout, start + at)))
        await asyncio.gather(*tasks)
        watcher.cancel()
    client_lags(fates, lags)
    return fates


def client_lags(fates: list[Fate], lags: list[tuple[float, float]]) -> None:
    """Each fate's ``client_lag``: the latest of the client loop's wake-ups (``(time.perf_counter(), seconds
    late)``) that ended while it was out (a wake-up ends after its lateness: one ending within ``LAG_INTERVAL``
    of the answer overlapped it). A refusal that took long while the client's loop lagged as long was slow here,
    not at the server."""
    for fate in fates:
        if fate.answered is None:
            continue
        end = fate.sent_at + fate.answered + LAG_INTERVAL_SECONDS
        fate.client_lag = max((lag for at, lag in lags if fate.sent_at <= at <= end), default=0.0)


async def closed_loop_rate(base_url: str, model: str, concurrency: int, count: int, max_tokens: int,
                           image_size: int, seed: int) -> tuple[float, list[Fate]]:
    """Requests per second that ``concurrency`` closed-loop clients get served (the capacity), and the fates."""
    import aiohttp

    requests = request_set(seed * 100_000, count, image_size)
    url, fates = f"{base_url}/v1/chat/completions", []
    queue = list(requests)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        async def client():
            while queue:
                fate = Fate("low")
                fates.append(fate)
                await _one(session, url, chat_body(model, queue.pop(), max_tokens), fate, 120.0)
        started = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        wall = time.perf_counter() - started
    served = sum(1 for f in fates if f.outcome == "served")
    return served / wall, fates


def summary(fates: list[Fate], seconds: float, slo: float, cls: str | None = None) -> dict:
    """Per class (None: all): counts by outcome, goodput (served within the TTFT SLO, per second), TTFT p50/p99 of
    the served, and how fast a shed request was answered (p50/p99/max ms) and whether each had Retry-After."""
    mine = [f for f in fates if cls is None or f.cls == cls]
    by = {o: [f for f in mine if f.outcome == o] for o in ("served", "shed", "expired", "error", "broken", "hung", "lost")}
    ttfts = [f.ttft for f in by["served"] if f.ttft is not None]
    shed_ms = [f.answered * 1000 for f in by["shed"]]
    return {"sent": len(mine), **{o: len(v) for o, v in by.items()},
            "goodput": sum(1 for t in ttfts if t <= slo) / seconds,
            "ttft_p50_ms": _ms(percentile(ttfts, 50)), "ttft_p99_ms": _ms(percentile(ttfts, 99)),
            "shed_rate": len(by["shed"]) / len(mine) if mine else 0.0,
            "shed_answer_p50_ms": _round(percentile(shed_ms, 50)), "shed_answer_p99_ms": _round(percentile(shed_ms, 99)),
            "shed_answer_max_ms": _round(max(shed_ms, default=float("nan"))),
            "shed_without_retry_after": sum(1 for f in by["shed"] if not f.retry_after),
            "errors": sorted({f.error for f in mine if f.outcome in ("error", "broken", "lost")})[:3],
            # each served request's, per class (repeats pool them: overload_table.checks)
            **({"ttfts_ms": [_ms(t) for t in ttfts]} if cls is not None else {}),
            "client_late_p99_ms": _ms(percentile([f.late for f in mine], 99)),
            # the slowest served requests: when they arrived, their TTFT, how late the client sent them
            "slowest": [{"at_s": round(f.at, 2), "ttft_ms": _ms(f.ttft), "late_ms": _ms(f.late),
                         **{key: (f.stages or {}).get(key) for key in STAGE_TIMES}} for f in
                        sorted((f for f in by["served"] if f.ttft is not None), key=lambda f: -f.ttft)[:5]],
            # the slowest refusals: when they arrived, how long their answer took, how late the client sent them
            "slowest_shed": [{"at_s": round(f.at, 2), "answered_ms": _ms(f.answered), "late_ms": _ms(f.late),
                              "client_loop_ms": _ms(f.client_lag)}
                             for f in sorted(by["shed"], key=lambda f: -(f.answered or 0.0))[:5]]}


# of a slow request, where its server time went (usage.epd_timings): waited at the gates, encoded (from the
# orchestrator's start), its first chunk (from the same start)
STAGE_TIMES = ("queued_ms", "encode_ms", "first_chunk_ms")


def _ms(seconds: float) -> float:
    return _round(seconds * 1000)


def _round(value: float) -> float:
    return value if math.isnan(value) else round(value, 1)
