"""The simulator's shared resources, on SimPy: the cores of a machine (processor sharing) and the orchestrator's
admission gates (``orchestrator.admission``'s rules, in simulated time).
"""
from __future__ import annotations

import heapq
import itertools
import math

import simpy


class Cores:
    """A machine's cores shared by every busy process: with ``n`` pieces of work running on ``cores`` cores, each
    runs at ``min(1, cores / n)`` of one core (each piece is one thread). ``cores`` 0: no sharing (each at full
    speed, as stages on devices of their own). ``background``: (seconds, [cores busy elsewhere, ...]): the rest of the
    machine's load in windows of that length from time 0 (repeated past its end), as that many more threads wanting
    the cores (``b`` busy elsewhere: each piece at ``min(1, cores / (n + b))``, as the scheduler shares the cores
    between threads). ``busy``: core-seconds of work done, for the utilisation."""

    def __init__(self, env: simpy.Environment, cores: float, background: tuple[float, list[float]] | None = None):
        self.env, self.cores = env, cores
        self.step, self.series = background if background and background[1] and cores else (0.0, [])
        self.running: list[dict] = []
        self.last = 0.0
        self.busy = 0.0
        self.current = 1.0

    def elsewhere(self) -> float:
        """Threads' worth of the machine's other work now."""
        if not self.series:
            return 0.0
        return self.series[int(self.env.now / self.step + 1e-9) % len(self.series)]

    def rate(self) -> float:
        return 1.0 if not self.cores else min(1.0, self.cores / max(1.0, len(self.running) + self.elsewhere()))

    def _advance(self) -> None:
        elapsed = self.env.now - self.last
        for job in self.running:
            job["left"] -= elapsed * self.current
        self.busy += elapsed * self.current * len(self.running)
        self.last = self.env.now

    def _changed(self) -> None:
        self.current = self.rate()
        for job in self.running:
            if not job["wake"].triggered:
                job["wake"].succeed()

    def _wait(self, left: float) -> tuple[float, bool]:
        """How long a job of ``left`` runs before something changes, and whether it ends then."""
        finish = max(0.0, left) / self.current
        if not self.series:
            return finish, True
        boundary = (int(self.env.now / self.step + 1e-9) + 1) * self.step - self.env.now
        return min(finish, boundary), finish <= boundary

    def work(self, seconds: float):
        """Run ``seconds`` of one core's work (``yield from cores.work(s)``)."""
        if seconds <= 0:
            return
        if not self.cores:
            self.busy += seconds
            yield self.env.timeout(seconds)
            return
        self._advance()
        job = {"left": seconds, "wake": self.env.event()}
        self.running.append(job)
        self._changed()
        while True:
            job["wake"] = self.env.event()
            wait, final = self._wait(job["left"])
            done = self.env.timeout(wait)
            yield done | job["wake"]
            self._advance()
            if (done.processed and final) or job["left"] <= 1e-12:
                self.running.remove(job)
                self._changed()
                return
            if done.processed:  # a window of the background ended: every job's rate changes
                self._changed()


class Gate:
    """One stage's admission budget (``units`` in flight; 0: none), its queue by priority then arrival, and the
    wait estimate a request is refused by at arrival: the units ahead of it beyond the budget over the rate the stage
    lets units through (``budget / mean time in the stage``, an exponentially weighted mean as the real gate keeps)."""

    WEIGHT = 0.1

    def __init__(self, env: simpy.Environment, units: int, reserve: float = 0.0):
        self.env, self.units, self.reserve = env, units, reserve
        self.held = 0
        self.hold = 0.0
        self.queue: list = []
        self.order = itertools.count()

    def limit(self, priority: int) -> int:
        return self.units if priority == 0 else max(1, self.units - math.ceil(self.units * self.reserve))

    def estimate(self, cost: int, priority: int) -> float:
        if not self.units or not self.hold:
            return 0.0
        ahead = sum(c for p, _, c, _ in self.queue if p <= priority)
        beyond = self.held + ahead + cost - self.limit(priority)
        return max(0.0, beyond * self.hold / self.limit(priority))

    def _fits(self, cost: int, priority: int) -> bool:
        return self.held == 0 or self.held + cost <= self.limit(priority)

    def enter(self, cost: int, priority: int):
        """Wait for room (``yield from gate.enter(...)``); returns the time it entered."""
        if self.units and (self.queue or not self._fits(cost, priority)):
            event = self.env.event()
            heapq.heappush(self.queue, (priority, next(self.order), cost, event))
            yield event
        else:
            self.held += cost
        return self.env.now

    def leave(self, cost: int, entered: float) -> None:
        if not self.units:
            return
        held = self.env.now - entered
        self.hold = held if not self.hold else self.hold + self.WEIGHT * (held - self.hold)
        self.held -= cost
        while self.queue and self._fits(self.queue[0][2], self.queue[0][0]):
            _, _, cost, event = heapq.heappop(self.queue)
            self.held += cost
            event.succeed()
