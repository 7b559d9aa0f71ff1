"""CounterBatch: increments are summed per metric and handed over by one thread, and nothing is lost at close."""
import threading
import time

import pytest

from backend.triton import counter_batch
from backend.triton.counter_batch import CounterBatch

pytestmark = pytest.mark.usefixtures("thawed_heap")  # after_load freezes the heap (tests/conftest.py)


class FakeMetric:
    def __init__(self):
        self.calls: list[float] = []
        self.threads: set[str] = set()

    def increment(self, amount):
        self.calls.append(amount)
        self.threads.add(threading.current_thread().name)

    def set(self, value):
        self.calls.append(("set", value))


@pytest.fixture
def loaded():
    """The model's ``initialize`` has returned (``counter_batch.after_load``); closed again after the test."""
    counter_batch.LOADED.set()
    yield
    counter_batch.LOADED.clear()


def test_nothing_is_handed_over_before_the_model_is_loaded_and_everything_after(monkeypatch):
    """No metric call from the flusher while ``initialize`` runs (it hung the stub's channel to tritonserver 2.51);
    ``after_load`` opens the gate ``LOAD_MARGIN_SECONDS`` after the decorated ``initialize`` returned."""
    monkeypatch.setattr(counter_batch, "LOAD_MARGIN_SECONDS", 0.3)
    counter_batch.LOADED.clear()
    metric, batch = FakeMetric(), CounterBatch()
    seen_in_initialize = []

    @counter_batch.after_load
    class Model:
        def initialize(self, args):
            batch.add(metric, 2)
            time.sleep(4 * CounterBatch.FLUSH_SECONDS)  # a slow start: several flush intervals pass
            seen_in_initialize.append(list(metric.calls))

        def execute(self, requests):
            return []

    try:
        Model().initialize({})
        assert seen_in_initialize == [[]] and not counter_batch.LOADED.is_set()
        deadline = time.monotonic() + 5
        while sum(metric.calls) != 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert counter_batch.LOADED.is_set() and metric.calls == [2] and metric.threads == {"metrics-flush"}
    finally:
        batch.close()
        counter_batch.LOADED.clear()


def test_the_model_s_first_request_opens_the_gate_before_the_margin(monkeypatch):
    """Only a loaded model gets a request: its first ``execute`` opens the gate at once (the margin is long)."""
    monkeypatch.setattr(counter_batch, "LOAD_MARGIN_SECONDS", 60.0)
    counter_batch.LOADED.clear()

    @counter_batch.after_load
    class Model:
        def initialize(self, args):
            pass

        def execute(self, requests):
            return [f"answer to {r}" for r in requests]

    try:
        model = Model()
        model.initialize({})
        assert not counter_batch.LOADED.is_set()
        assert model.execute(["a"]) == ["answer to a"] and counter_batch.LOADED.is_set()
    finally:
        counter_batch.LOADED.clear()


def test_increments_are_summed_and_handed_over_by_the_flusher_thread(loaded):
    a, b = FakeMetric(), FakeMetric()
    batch = CounterBatch()
    try:
        for _ in range(100):
            batch.add(a, 1)
            batch.add(b, 0.5)
        batch.add(a, 0)  # nothing to hand over
        deadline = time.monotonic() + 5
        while (sum(a.calls), sum(b.calls)) != (100, 50) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (sum(a.calls), sum(b.calls)) == (100, 50)
        assert len(a.calls) < 10, a.calls  # a few round trips, not one per add
        assert a.threads == b.threads == {"metrics-flush"}
    finally:
        batch.close()


def test_close_hands_over_what_is_pending_and_stops_the_thread():
    metric = FakeMetric()
    batch = CounterBatch()
    batch.add(metric, 3)
    batch.add(metric, 4)
    batch.close()
    assert sum(metric.calls) == 7
    assert not batch._thread.is_alive()
    batch.flush()  # nothing pending: no call
    assert sum(metric.calls) == 7


def test_concurrent_adds_lose_nothing():
    metric = FakeMetric()
    batch = CounterBatch()

    def add_many():
        for _ in range(2000):
            batch.add(metric, 1)

    threads = [threading.Thread(target=add_many) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    batch.close()
    assert sum(metric.calls) == 8000


def test_a_gauge_gets_the_latest_value_set_before_the_flush():
    gauge = FakeMetric()
    batch = CounterBatch()
    batch.close()  # no flusher thread: flushes happen here
    batch.add_many((), [(gauge, 0.5)])
    batch.add_many((), [(gauge, 0.25)])
    batch.flush()
    batch.flush()  # nothing new: not set again
    batch.add_many((), [(gauge, 0.0)])
    batch.flush()
    assert gauge.calls == [("set", 0.25), ("set", 0.0)]


def test_an_update_is_handed_over_whole_and_in_order():
    """add_many: one flush gets all of an update's figures, in the order given (a flush between two plain adds
    would hand over half of it)."""
    order = []

    class Ordered(FakeMetric):
        def __init__(self, name):
            super().__init__()
            self.name = name

        def increment(self, amount):
            order.append((self.name, amount))

        def set(self, value):
            order.append((self.name, "set", value))

    tokens, count, gauge = Ordered("tokens"), Ordered("count"), Ordered("gauge")
    batch = CounterBatch()
    batch.close()  # no flusher thread: flushes happen here
    batch.add_many([(tokens, 44), (count, 0), (count, 1)], [(gauge, 0.5)])
    batch.flush()
    assert order == [("tokens", 44), ("count", 1), ("gauge", "set", 0.5)]


class FakeHistogram:
    def __init__(self, log):
        self.log = log

    def observe(self, value):
        self.log.append(("observe", value))


def test_observations_are_each_handed_over_before_the_increments_of_their_update():
    log: list = []
    histogram, counter = FakeHistogram(log), FakeMetric()
    counter.increment = lambda amount: log.append(("increment", amount))
    batch = CounterBatch()
    try:
        batch.add_many(((counter, 1),), (), ((histogram, 0.25), (histogram, 0.5)))
        batch.observe(histogram, 2.0)
        batch.flush()
        assert log == [("observe", 0.25), ("observe", 0.5), ("observe", 2.0), ("increment", 1)]
    finally:
        batch.close()


@pytest.mark.parametrize("setting, frozen", [(None, True), ("0", False)])
def test_a_loaded_model_s_heap_is_frozen_out_of_the_collector_unless_asked_not_to(monkeypatch, setting, frozen):
    """What ``initialize`` made is moved out of the cyclic collector's reach once it returned (``gc.freeze``, as
    vLLM's servers do after start); ``EPD_GC_FREEZE=0`` leaves it (the measurement's other arm)."""
    import gc

    if setting is None:
        monkeypatch.delenv(counter_batch.FREEZE_ENV, raising=False)
    else:
        monkeypatch.setenv(counter_batch.FREEZE_ENV, setting)
    monkeypatch.setattr(counter_batch, "LOAD_MARGIN_SECONDS", 60.0)
    made = []

    @counter_batch.after_load
    class Model:
        def initialize(self, args):
            made.extend([[i] for i in range(1000)])  # a thousand tracked objects of the model's

        def execute(self, requests):
            return []

    gc.unfreeze()
    try:
        Model().initialize({})
        assert (gc.get_freeze_count() >= 1000) is frozen
    finally:
        gc.unfreeze()
        counter_batch.LOADED.clear()
