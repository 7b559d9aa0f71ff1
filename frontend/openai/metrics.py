"""The OpenAI endpoint's own metrics (Triton's stay on Triton's metrics port): requests by model and HTTP status,
the time to the response's start (for a stream: its headers; the tokens' timing is Triton's), and what the endpoint
adds to a request: its time in the endpoint less the time it waited on tritonserver (``Clock``)."""
from __future__ import annotations

import time

# what the endpoint adds is meant to stay under 1 ms (issue 19): fine buckets below and around it
ADDED_BUCKETS = (0.0001, 0.00025, 0.0005, 0.00075, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5)


class Clock:
    """One request's time in the endpoint, from its handler's start, and the part of it spent waiting on
    tritonserver's responses (``wait`` adds to it): the rest (``added``) is the endpoint's own (parsing, translating,
    SSE chunks, the event loop's other requests), what a client driving Triton's gRPC endpoint directly does not pay
    beyond the HTTP hop."""

    def __init__(self):
        self.started, self.waited = time.perf_counter(), 0.0

    def added(self) -> float:
        return time.perf_counter() - self.started - self.waited


class Metrics:
    def __init__(self):
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = CollectorRegistry()
        self.requests = Counter("openai_requests", "requests answered, by model and HTTP status",
                                ["model", "status"], registry=self.registry)
        self.latency = Histogram("openai_response_seconds", "seconds to the response (a stream's: its start)",
                                 ["model"], registry=self.registry)
        self.added_seconds = Histogram("openai_added_seconds", "seconds a request spent in the endpoint other than "
                                       "waiting on tritonserver (answered requests, to their last byte)", ["model"],
                                       buckets=ADDED_BUCKETS, registry=self.registry)

    def done(self, model: str, status: int, started: float) -> None:
        self.requests.labels(model, str(status)).inc()
        self.latency.labels(model).observe(time.perf_counter() - started)

    def added(self, model: str, clock: Clock) -> None:
        self.added_seconds.labels(model).observe(clock.added())

    def render(self) -> str:
        from prometheus_client import generate_latest

        return generate_latest(self.registry).decode()
