"""vLLM's own request metrics, taken from its stat-logger interface, for the engine-hosting models.

Who calls it: ``EngineHost.start`` passes ``stat_logger_factory(observer)`` to
``AsyncLLM.from_engine_args(stat_loggers=...)``. vLLM then calls the logger's ``record`` on the engine's
output-handler task (the engine loop thread) once per engine step with that step's ``IterationStats``;
``stats_delta`` turns them into plain totals for that step and the observer adds them to its counters
(``backend.triton.metrics.EngineMetrics`` on the metrics port; a list in unit tests).

What vLLM measures (``vllm/v1/metrics/stats.py``), and what each field of ``StatsDelta`` is:

- ``prompt_tokens`` / ``generation_tokens``: prompt tokens of the requests that finished in this step
  (what clients get as ``num_input_tokens``), and tokens sampled in this step (of every request,
  cancelled ones included);
- ``ttft``: per request, the time from its arrival at the engine (``AsyncLLM.generate``) to its first
  token; one sample per request that got one;
- ``inter_token``: the time between two consecutive tokens of one request (one sample per token after
  the first), vLLM's time per output token;
- ``queue`` / ``prefill`` / ``decode``: per finished request, the time it waited in the engine's queue
  (QUEUED -> SCHEDULED), from scheduling to its first token, and from its first token to its last.
- ``kv_cache_usage``: from the step's scheduler stats, the fraction of the engine's KV cache blocks held
  by requests after the step (blocks kept only as prefix cache count as free); 0 once every request's
  blocks are back, e.g. prefill's after decode read them, decode's after an abort.

No Triton import here: the logger and the conversion are unit-tested with fake stats.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol


@dataclass
class Samples:
    """A sum and a count (Prometheus summary-style, so rates and means come out of two counters), and the
    samples themselves (one step's: for histograms)."""

    seconds: float = 0.0
    count: int = 0
    values: list[float] = field(default_factory=list)

    def add(self, values) -> None:
        for value in values:
            value = max(0.0, float(value))
            self.seconds += value
            self.count += 1
            self.values.append(value)


@dataclass
class StatsDelta:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    ttft: Samples = field(default_factory=Samples)
    inter_token: Samples = field(default_factory=Samples)
    queue: Samples = field(default_factory=Samples)
    prefill: Samples = field(default_factory=Samples)
    decode: Samples = field(default_factory=Samples)
    kv_cache_usage: float | None = None  # fraction of KV cache blocks in use after the step (scheduler stats)
    kv_transfers: int = 0  # KV reads the engine's connector completed (NIXL: the consumer, decode, reads)
    kv_transfer_bytes: int = 0
    kv_failed_transfers: int = 0
    kv_connector_hit_tokens: int = 0  # prompt tokens the KV connector supplied (scheduler: external prefix-cache hits)

    SAMPLED = ("ttft", "inter_token", "queue", "prefill", "decode")


class StatsObserver(Protocol):
    def engine_stats(self, delta: StatsDelta) -> None: ...


def stats_delta(iteration_stats) -> StatsDelta:
    """One engine step's ``IterationStats`` as totals (see the module docstring)."""
    finished = list(getattr(iteration_stats, "finished_requests", ()) or ())
    delta = StatsDelta(prompt_tokens=sum(int(r.num_prompt_tokens) for r in finished),
                       generation_tokens=int(iteration_stats.num_generation_tokens))
    delta.ttft.add(iteration_stats.time_to_first_tokens_iter)
    delta.inter_token.add(iteration_stats.inter_token_latencies_iter)
    delta.queue.add(r.queued_time for r in finished)
    delta.prefill.add(r.prefill_time for r in finished)
    delta.decode.add(r.decode_time for r in finished)
    return delta


def kv_transfer_counts(connector_stats) -> tuple[int, int, int]:
    """(transfers, bytes, failed transfers) of one step's ``SchedulerStats.kv_connector_stats``: the payload of
    vLLM's NixlConnector stats (``NixlKVConnectorStats.data``: a list entry per transfer), None or another
    connector's payload: zeros. Checked on vLLM 0.32 (CPU); on 0.26 (GPU) not checked: a SchedulerStats without the
    field counts nothing (``getattr`` in the logger). Under vLLM's MultiConnector, the connectors' payloads summed."""
    if not isinstance(connector_stats, dict):
        return 0, 0, 0
    if "bytes_transferred" not in connector_stats and "num_failed_transfers" not in connector_stats:
        # vLLM's MultiConnector: a payload per connector, by name (E/P/D's prefill: NIXL's and the session store's)
        counts = [kv_transfer_counts(child) for child in connector_stats.values()]
        return tuple(sum(column) for column in zip((0, 0, 0), *counts))  # type: ignore[return-value]
    sizes = connector_stats.get("bytes_transferred") or ()
    return len(sizes), int(sum(sizes)), len(connector_stats.get("num_failed_transfers") or ())


def connector_hit_tokens(scheduler_stats) -> int:
    """Prompt tokens one step's scheduling took from the engine's KV connector (vLLM's
    ``SchedulerStats.connector_prefix_cache_stats.hits``, new requests and preempted ones; a new object each step):
    a conversation's kept blocks on pd or prefill (``backend.engine.session_kv``), prefill's KV on decode (NIXL).
    0 without a connector or on a vLLM without the field."""
    stats = getattr(scheduler_stats, "connector_prefix_cache_stats", None)
    return int(getattr(stats, "hits", 0) or 0) + int(getattr(stats, "preempted_hits", 0) or 0) if stats else 0


def stat_logger_factory(observer: StatsObserver) -> Callable:
    """A per-engine ``StatLoggerFactory`` for ``AsyncLLM(stat_loggers=[...])`` reporting to ``observer``.

    Passing a logger turns vLLM's stats collection on even with ``disable_log_stats`` (which then only
    keeps vLLM's periodic log line off); vLLM also keeps its own Prometheus logger, in this process's
    registry, which nothing serves."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class TritonStatLogger(StatLoggerBase):
        def __init__(self, vllm_config, engine_index: int = 0):
            self.engine_index = engine_index

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
            if iteration_stats is None and scheduler_stats is None:
                return
            delta = stats_delta(iteration_stats) if iteration_stats is not None else StatsDelta()
            if scheduler_stats is not None:
                delta.kv_cache_usage = float(scheduler_stats.kv_cache_usage)
                delta.kv_transfers, delta.kv_transfer_bytes, delta.kv_failed_transfers = kv_transfer_counts(
                    getattr(scheduler_stats, "kv_connector_stats", None))
                delta.kv_connector_hit_tokens = connector_hit_tokens(scheduler_stats)
            observer.engine_stats(delta)

        def log_engine_initialized(self):
            pass

    return TritonStatLogger
