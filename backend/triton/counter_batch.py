"""Batched counter increments (gauge values, histogram observations) for the Triton models' custom metrics (no Triton import: unit-tested with fake
metrics). ``backend.triton.metrics``' ``RequestMetrics`` and ``EngineMetrics`` add to a ``CounterBatch``; its
thread hands the sums to Triton."""
from __future__ import annotations

import gc
import logging
import os
import threading

from backend.triton.load_watch import LoadWatch

log = logging.getLogger(__name__)

# Set once this stub's model is loaded (``after_load``): until then no thread but the one running ``initialize`` talks to
# Triton. Added for a load hang first put down to metric calls from a background thread while ``initialize`` ran
# (``tests/e2e/test_checkpoints.py``, 2 of 6 runs on a loaded machine); the gate did not end it (it happened with the gate
# open 5 s later too). Its cause, found 2026-12-06 (gdb of the hung server): tritonserver 2.51 gave up on a loading stub
# whose health thread missed a one-second window and waited for its exit for good (``backend.triton.load_watch``, which
# ``after_load`` runs every ``initialize`` under). The gate stays: nothing is lost by handing counters over only once the
# model loaded. It opens at the model's first request (only a loaded model gets one) or ``LOAD_MARGIN_SECONDS`` after
# ``initialize`` returned, whichever comes first. One model per stub process, so one gate per process.
LOADED = threading.Event()
LOAD_MARGIN_SECONDS = 0.25  # after ``initialize`` returns, for the stub to hand its answer to the server


def wait_until_loaded(stop: threading.Event, poll: float = 0.05) -> bool:
    """Block until ``LOADED`` (True) or ``stop`` (False), whichever comes first."""
    while not LOADED.wait(poll):
        if stop.is_set():
            return False
    return not stop.is_set()


FREEZE_ENV = "EPD_GC_FREEZE"  # "0": leave the loaded heap to the collector (to measure what freezing buys)


def freeze_the_loaded_heap() -> bool:
    """Once a model is loaded, move everything its process holds (torch, vLLM, transformers, the model's objects:
    ~7e5 tracked objects) out of the cyclic collector's reach, as vLLM's API server and EngineCore do after start
    (``gc.freeze``): the full collections that a request's garbage triggers then walk only what serving made, not
    the whole heap each time. Objects freed later are still freed by reference counting. Only the young generations
    are collected first (~1 ms): in a process that had imported vLLM a full collection took 0.32 s of CPU (at every
    stub's load, several a server start) and found 23 objects of garbage, which freezing keeps. False where
    ``EPD_GC_FREEZE=0``."""
    if os.environ.get(FREEZE_ENV, "1") == "0":
        return False
    gc.collect(1)
    gc.freeze()
    return True


def after_load(cls):
    """Class decorator of a Triton model: its ``initialize`` runs under a ``LoadWatch`` (a stub the server gave up on
    while it loaded leaves: ``backend.triton.load_watch``); at its first ``execute``, or ``LOAD_MARGIN_SECONDS`` after
    its ``initialize`` returned, ``LOADED`` is set and the metric threads (``CounterBatch``, the encoder's reporter)
    start handing values over. On the leaf classes: a subclass's ``initialize`` goes on after its base's."""
    initialize, execute, finalize = cls.initialize, cls.execute, getattr(cls, "finalize", None)

    def initialize_then_open(self, args):
        self._load_watch = watch = LoadWatch.start(args.get("model_instance_name", "") if isinstance(args, dict)
                                                   else "")
        try:
            initialize(self, args)
        except BaseException:
            watch.stop()
            raise
        watch.initialized()
        freeze_the_loaded_heap()
        timer = threading.Timer(LOAD_MARGIN_SECONDS, LOADED.set)
        timer.daemon = True
        timer.start()

    def execute_opening(self, requests):
        if not LOADED.is_set():
            LOADED.set()
        return execute(self, requests)

    def finalize_unwatched(self):  # the server waits for this stub's exit after finalize: not a load given up
        if (watch := getattr(self, "_load_watch", None)) is not None:
            watch.stop()
        if finalize is not None:
            finalize(self)

    cls.initialize, cls.execute, cls.finalize = initialize_then_open, execute_opening, finalize_unwatched
    return cls


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
        if not wait_until_loaded(self._stop):  # values wait, pending, until the model is loaded: then at once
            return
        while True:
            try:
                self.flush()
            except Exception as exc:  # noqa: BLE001 - metrics must not take the model down
                log.warning("metrics flush failed: %s", exc)
            if self._stop.wait(self.FLUSH_SECONDS):
                return
