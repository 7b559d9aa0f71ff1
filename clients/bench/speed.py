"""How fast this machine's cores are now: a fixed piece of interpreter and NumPy work, timed in CPU time.

The lent 2-core machines run at one of two speeds ~1.65x apart, switching within seconds with nothing else running
(the probe on the idle machine: 1.84-2.25 or 2.84-3.46 ms, on either core; docs/planning.md, "Run 9"), so a profile
or a baseline measured a minute before can be a third off before anything else is. ``probe()`` times the same work
(dict updates as the stubs' Python does, small NumPy element-wise passes as a CPU engine's) on this thread in CPU time
and gives the median ms (more is slower). While the deployment keeps the cores busy the probe's time counts that
contention too (the hosts rows of run 9), so read it as a window's label rather than a correction.
Users: ``clients.plan.loads.Background`` probes during every planner phase (``clients.plan.validate`` records each
repetition's factor over the profile's and, with ``--speed-probe``, predicts on the profile scaled by it:
``Profile.at_speed``); ``Sampler`` probes on a thread while a benchmark's level runs (the overload bench's
``cores_probe_ms``).
"""
from __future__ import annotations

import statistics
import threading
import time

import numpy as np


def _work() -> float:
    table: dict[int, int] = {}
    for i in range(20_000):
        table[i & 511] = table.get(i & 511, 0) + i
    values = np.arange(4096, dtype=np.float32)
    for _ in range(40):
        values = values * 1.0001 + 1.0
    return float(values[0]) + len(table)


def probe(runs: int = 9) -> float:
    """The median CPU ms of ``runs`` passes of the fixed work (~3-5 ms each here)."""
    times = []
    for _ in range(runs):
        started = time.thread_time()
        _work()
        times.append((time.thread_time() - started) * 1000)
    return statistics.median(times)


def factor(now_ms: float, profile_ms: float | None) -> float:
    """How many times slower the cores are now than when the profile was measured (1 where it has no probe)."""
    return now_ms / profile_ms if profile_ms and now_ms > 0 else 1.0


class Sampler(threading.Thread):
    """Probes the cores' speed (one pass of the fixed work) every ``every`` seconds while it runs, on its own thread
    (each pass holds this process's GIL for ~2-3 ms): ``with Sampler() as s: ...`` then ``s.median_ms()``."""

    def __init__(self, every: float = 1.0):
        super().__init__(daemon=True)
        self.every, self.probes, self.halt = every, [], threading.Event()

    def run(self) -> None:
        self.probes.append(probe(1))
        while not self.halt.wait(self.every):
            self.probes.append(probe(1))

    def __enter__(self) -> "Sampler":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.halt.set()
        self.join()

    def median_ms(self) -> float:
        return round(statistics.median(self.probes), 3) if self.probes else 0.0
