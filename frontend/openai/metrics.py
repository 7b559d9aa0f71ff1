"""The OpenAI endpoint's own metrics (Triton's stay on Triton's metrics port): requests by model and HTTP status,
the time to the response's start (for a stream: its headers; the tokens' timing is Triton's), and what the endpoint
adds to a request (``Clock``)."""
from __future__ import annotations

import time

# what the endpoint adds is meant to stay under 1 ms (issue 19): fine buckets below and around it
ADDED_BUCKETS = (0.0001, 0.00025, 0.0005, 0.00075, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5)


class Clock:
    """One request's time in the endpoint, from its handler's start: the waits on tritonserver's responses
    (``waiting()`` / ``answered()`` around each), and two figures of what the endpoint adds:
    ``own()``: everything but the waits (parsing, translating, each SSE chunk, the event loop's other requests),
    mostly spent while tritonserver generates the next token; ``added()``: what lies on the request's path, before
    its request went to tritonserver and after its last response came. A client driving Triton's gRPC endpoint
    directly pays neither, beyond the HTTP hop."""

    def __init__(self):
        self.started, self.waited = time.perf_counter(), 0.0
        self.first_wait = self.last_response = None

    def waiting(self) -> float:
        now = time.perf_counter()
        if self.first_wait is None:
            self.first_wait = now
        return now

    def responded(self, since: float) -> None:
        self.last_response = time.perf_counter()
        self.waited += self.last_response - since

    def own(self) -> float:
        return time.perf_counter() - self.started - self.waited

    def added(self) -> float:
        now = time.perf_counter()
        return (self.first_wait or now) - self.started + now - (self.last_response or now)


class Metrics:
    def __init__(self):
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = CollectorRegistry()
        self.requests = Counter("openai_requests", "requests answered, by model and HTTP status",
                                ["model", "status"], registry=self.registry)
        self.latency = Histogram("openai_response_seconds", "seconds to the response (a stream's: its start)",
                                 ["model"], registry=self.registry)
        self.own_seconds = Histogram("openai_own_seconds", "seconds a request spent in the endpoint other than "
                                     "waiting on tritonserver (answered requests, to their last byte)", ["model"],
                                     buckets=ADDED_BUCKETS, registry=self.registry)
        self.added_seconds = Histogram("openai_added_seconds", "seconds on a request's path in the endpoint: "
                                       "before it went to tritonserver, and from its last response to its last "
                                       "byte (answered requests)", ["model"], buckets=ADDED_BUCKETS,
                                       registry=self.registry)

    def done(self, model: str, status: int, started: float) -> None:
        self.requests.labels(model, str(status)).inc()
        self.latency.labels(model).observe(time.perf_counter() - started)

    def answered(self, model: str, clock: Clock) -> None:
        self.own_seconds.labels(model).observe(clock.own())
        self.added_seconds.labels(model).observe(clock.added())

    def render(self) -> str:
        from prometheus_client import generate_latest

        return generate_latest(self.registry).decode()
