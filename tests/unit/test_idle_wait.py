"""``backend.engine.patches.patch_idle_wait``: an EngineCore step that ran no model while requests wait on the KV
connector is followed by a wait on the input queue that new input ends at once (vLLM's own loop: 1 ms sleep,
step again). The patched ``EngineCoreProc._process_engine_step`` (vLLM's, wrapped) on a stand-in engine, for the
timings; on a real EngineCore holding a finished KV-producer request: tests/component/test_patches.py."""
from __future__ import annotations

import queue
import threading
import time

import pytest

from backend.engine.patches import patch_idle_wait

WAIT = 0.2


class Engine:
    """What ``_process_engine_step`` touches: a step that ran no model, a scheduler still holding requests."""

    def __init__(self, holding: bool = True):
        self.input_queue: queue.Queue = queue.Queue()
        self.output_queue: queue.Queue = queue.Queue()
        self.handled: list[tuple] = []
        self.holding = holding
        self.scheduler = self

    def has_requests(self) -> bool:
        return self.holding

    def step_fn(self):
        return {}, False

    def post_step(self, model_executed: bool) -> None:
        pass

    def _handle_client_request(self, *request) -> None:
        self.handled.append(request)


@pytest.fixture
def patched():
    core = pytest.importorskip("vllm.v1.engine.core")  # absent on the GPU machine
    real = core.EngineCoreProc._process_engine_step
    patch_idle_wait(WAIT)
    patch_idle_wait(WAIT / 2)  # idempotent: the first wait stays
    yield core.EngineCoreProc._process_engine_step
    core.EngineCoreProc._process_engine_step = real


def test_an_idle_step_waits_for_input_instead_of_stepping_again(patched):
    engine = Engine()
    started = time.monotonic()
    assert patched(engine) is False
    assert WAIT <= time.monotonic() - started < WAIT + 0.15
    assert engine.handled == []


def test_new_input_ends_the_wait_and_is_handled(patched):
    engine = Engine()
    threading.Timer(0.02, engine.input_queue.put, args=(("ADD", "request-1"),)).start()
    started = time.monotonic()
    patched(engine)
    assert time.monotonic() - started < WAIT / 2
    assert engine.handled == [("ADD", "request-1")]


def test_no_wait_when_the_scheduler_holds_nothing(patched):
    engine = Engine(holding=False)
    started = time.monotonic()
    patched(engine)
    assert time.monotonic() - started < WAIT / 2
