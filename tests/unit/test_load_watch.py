"""LoadWatch: a stub whose parent waits for its exit while the model loads leaves; a load the parent accepted, a
finalize, or an initialize that raised ends the watch without a word (backend.triton.load_watch)."""
from __future__ import annotations

import os
import subprocess
import threading
import time

import pytest

from backend.triton import counter_batch
from backend.triton.load_watch import LoadWatch, parent_waits_for

pytestmark = pytest.mark.usefixtures("thawed_heap")  # after_load freezes the heap (tests/conftest.py)


@pytest.fixture
def child():
    """A child process of this one, and a way to block a thread of this process in ``waitpid`` on it."""
    proc = subprocess.Popen(["sleep", "60"])
    waiters = []

    def wait_for_it():
        thread = threading.Thread(target=os.waitpid, args=(proc.pid, 0), daemon=True)
        thread.start()
        waiters.append(thread)

    yield proc, wait_for_it
    proc.kill()
    for thread in waiters:
        thread.join(10)
    if not waiters:
        proc.wait(10)


def until(predicate, seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.02)
    return predicate()


def test_a_thread_blocked_in_waitpid_on_the_child_is_seen_and_no_other(child):
    proc, wait_for_it = child
    assert parent_waits_for(proc.pid, os.getpid()) is False
    wait_for_it()
    assert until(lambda: parent_waits_for(proc.pid, os.getpid()))
    assert parent_waits_for(proc.pid + 100_000, os.getpid()) is False  # waits on another pid: not this one


def watch_of(proc, **kwargs) -> tuple[LoadWatch, list[int]]:
    """A watch as the child's stub would run it: the child's pid, this process as its parent."""
    left: list[int] = []
    watch = LoadWatch("stub_0_0", period=0.02, leave=left.append, **kwargs)
    watch.pid, watch.parent = proc.pid, os.getpid()
    watch._thread.start()
    return watch, left


def test_the_stub_leaves_when_its_parent_waits_for_it_during_the_load(child):
    proc, wait_for_it = child
    watch, left = watch_of(proc)
    time.sleep(0.2)
    assert left == [] and not watch.gave_up  # the parent not waiting: the load goes on
    wait_for_it()  # the parent gave up on the stub (Triton 2.51's health check) and waits for its exit
    assert until(lambda: left == [1]) and watch.gave_up
    watch.join(5)


def test_the_watch_ends_after_the_load_and_at_finalize_or_a_failed_initialize(child):
    proc, wait_for_it = child
    accepted, left = watch_of(proc, after=0.1)
    accepted.initialized()
    accepted.join(5)
    finalizing, left_at_finalize = watch_of(proc)
    finalizing.stop()
    finalizing.join(5)
    assert not accepted._thread.is_alive() and not finalizing._thread.is_alive()
    wait_for_it()  # the server waits for the stub's exit after finalize: no watch left to take it for a give-up
    time.sleep(0.2)
    assert left == [] and left_at_finalize == []


def test_after_load_runs_initialize_under_a_watch_that_finalize_and_a_raise_end(monkeypatch):
    started: list[LoadWatch] = []
    real_start = LoadWatch.start

    def start(name="", **kwargs):
        started.append(real_start(name, **kwargs))
        return started[-1]

    monkeypatch.setattr(LoadWatch, "start", staticmethod(start))
    monkeypatch.setattr(counter_batch, "LOAD_MARGIN_SECONDS", 0.0)  # no gate timer left to fire in a later test
    finalized = []

    @counter_batch.after_load
    class Model:
        def initialize(self, args):
            if args.get("fail"):
                raise RuntimeError("bad config")

        def execute(self, requests):
            return []

        def finalize(self):
            finalized.append(True)

    @counter_batch.after_load
    class NoFinalize:
        def initialize(self, args):
            pass

        def execute(self, requests):
            return []

    try:
        model = Model()
        model.initialize({"model_instance_name": "m_0_0"})
        assert started[0].name == "m_0_0" and started[0]._until is not None and not started[0]._done.is_set()
        model.finalize()
        assert finalized == [True] and started[0]._done.is_set()
        with pytest.raises(RuntimeError, match="bad config"):
            Model().initialize({"fail": True})
        assert started[1]._done.is_set()
        other = NoFinalize()
        other.initialize({})
        other.finalize()  # one is added: it ends the watch
        assert started[2]._done.is_set()
        for watch in started:
            watch.join(5)
            assert not watch._thread.is_alive()
    finally:
        counter_batch.LOADED.clear()
