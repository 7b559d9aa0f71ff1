"""The OpenAI endpoint's own metrics (Triton's stay on Triton's metrics port): requests by model and HTTP status,
and the time to the response's start (for a stream: its headers; the tokens' timing is Triton's)."""
from __future__ import annotations

import time


class Metrics:
    def __init__(self):
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = CollectorRegistry()
        self.requests = Counter("openai_requests", "requests answered, by model and HTTP status",
                                ["model", "status"], registry=self.registry)
        self.latency = Histogram("openai_response_seconds", "seconds to the response (a stream's: its start)",
                                 ["model"], registry=self.registry)

    def done(self, model: str, status: int, started: float) -> None:
        self.requests.labels(model, str(status)).inc()
        self.latency.labels(model).observe(time.perf_counter() - started)

    def render(self) -> str:
        from prometheus_client import generate_latest

        return generate_latest(self.registry).decode()
