"""``EPD_ENGINE_NICE`` (an engine model's ``engine_nice``): the project's vLLM plugin lowers the CPU priority of a
spawned EngineCore (every thread, those made before and after), never of the stub that set the variable."""
from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import threading

from backend.engine.patches import NICE_ENV


def _niceness() -> dict[int, int]:
    return {int(t): os.getpriority(os.PRIO_PROCESS, int(t)) for t in os.listdir("/proc/self/task")}


def _engine_core(out) -> None:
    from backend.engine.patches import register

    stop = threading.Event()
    before = threading.Thread(target=stop.wait, daemon=True)
    before.start()
    register()
    after = threading.Thread(target=stop.wait, daemon=True)
    after.start()
    out.put((sorted(set(_niceness().values())), len(_niceness())))
    stop.set()


def test_a_spawned_engine_core_runs_every_thread_at_the_niceness(monkeypatch):
    monkeypatch.setenv(NICE_ENV, "7")
    context = multiprocessing.get_context("spawn")  # as vLLM's CPU platform starts its EngineCore
    out = context.Queue()
    child = context.Process(target=_engine_core, args=(out,))
    child.start()
    try:
        values, threads = out.get(timeout=60)
        assert values == [7] and threads >= 3  # the main thread, the one made before, the one made after (+ the queue's)
    finally:
        child.join(timeout=30)
    assert os.getpriority(os.PRIO_PROCESS, 0) == 0  # the test process is not touched


def test_the_stub_that_sets_the_variable_keeps_its_priority():
    script = ("import os; from backend.engine.patches import register; register(); "
              "print(os.getpriority(os.PRIO_PROCESS, 0))")
    env = {**os.environ, NICE_ENV: "7"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "0"
