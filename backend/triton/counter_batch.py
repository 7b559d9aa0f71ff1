"""Batched counter increments (gauge values, histogram observations) for the Triton models' custom metrics (no Triton import: unit-tested with fake
metrics). ``backend.triton.metrics``' ``RequestMetrics`` and ``EngineMetrics`` add to a ``CounterBatch``; its
thread hands the sums to Triton."""
from __future__ import annotations

import logging
import threading

log = logging.getLogger(__name__)


class CounterBatch:
    """Counter increments added up in memory and handed to Triton by one thread every ``FLUSH_SECONDS``.

    Each ``Metric.increment`` is a round trip from the stub to the server process (a message through the
    stub's shared memory, answered by the server), and the engine models made more than a dozen per request (request
    outcome, tokens, transfer, and vLLM's per-step and per-request stats), on the engine loop's thread.
    Batched, they cost a few round trips per flush whatever the load, and one thread does every increment
    (concurrent increments of one counter were followed by a server crash: docs/results/epd.md).
    Counters lag by up to ``FLUSH_SECONDS``; ``flush`` hands over what is pending at once.
    """

    FLUSH_SECONDS = 0.25

    def __init__(self):
        self._pending: dict[int, list] = {}  # id(metric) -> [metric, amount]
        self._gauges: dict[int, list] = {}   # id(gauge) -> [gauge, latest value]
        self._observations: list[tuple] = []  # (histogram metric, value), in order
        self._lock = threading.Lock()      # guards _pending
        self._flushing = threading.Lock()  # one thread talks to Triton at a time
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="metrics-flush", daemon=True)
        self._thread.start()

    def add(self, metric, amount: float) -> None:
        self.add_many(((metric, amount),))

    def add_many(self, amounts, gauges=(), observations=()) -> None:
        """Increments (``(metric, amount)`` pairs), gauge values (``(gauge, value)``; the latest before a flush
        is handed over) and histogram observations (``(histogram, value)``, each one handed over) of one update, in
        one flush together and in this order: a reader that sees the last of them moved sees the others too
        (added one by one, a flush between two of them handed over half an update)."""
        with self._lock:
            for metric, amount in amounts:
                if not amount:
                    continue
                entry = self._pending.get(id(metric))
                if entry is None:
                    self._pending[id(metric)] = [metric, amount]
                else:
                    entry[1] += amount
            for gauge, value in gauges:
                self._gauges[id(gauge)] = [gauge, value]
            self._observations.extend(observations)

    def observe(self, histogram, value: float) -> None:
        self.add_many((), (), ((histogram, value),))

    def flush(self) -> None:
        with self._flushing:
            with self._lock:
                pending, self._pending = self._pending, {}
                gauges, self._gauges = self._gauges, {}
                observations, self._observations = self._observations, []
            for histogram, value in observations:
                histogram.observe(value)
            for metric, amount in pending.values():
                metric.increment(amount)
            for gauge, value in gauges.values():
                gauge.set(value)

    def close(self) -> None:
        """Stop the thread and flush; call while the stub's shared memory is alive (``finalize``)."""
        self._stop.set()
        self._thread.join(timeout=5)
        self.flush()

    def _run(self) -> None:
        while not self._stop.wait(self.FLUSH_SECONDS):
            try:
                self.flush()
            except Exception as exc:  # noqa: BLE001 - metrics must not take the model down
                log.warning("metrics flush failed: %s", exc)
