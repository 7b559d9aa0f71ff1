"""Admission by budget, per stage, in priority order, within each request's deadline.

Each stage an orchestrator asks has a ``Gate``: a budget of what may be in flight there at once (the encoder: media
items and their bytes; a generator stage: requests), and the requests waiting for it, served by priority (0 first, as
vLLM's ``priority``) then arrival. A request enters the gate before it asks the stage and leaves when the call is done,
so the stage's own queue stays short and the order in which it gets work is the orchestrator's, by priority.

A request is refused before any work when it cannot start in time: at its arrival (``Admission.check``) each gate it
will pass estimates its wait there (the units ahead of it, of its priority or higher, beyond the budget, over the rate
the stage has been letting units through: ``budget / mean time in the stage``; and at least as long as the oldest of
those has waited already); if their sum is longer than the request may wait (until its deadline, and at most
``max_queue_seconds`` of waiting in all gates together: its ``Allowance``), it is answered at once: ``Overloaded``
(429 over OpenAI) with ``retry_after``, the estimate. A gate it reaches later refuses it the same way, at once, when its
estimate there is longer than what is left of the allowance. A request let in to a queue waits for its turn: never
refused after a wait (refusals come at arrival, fast), only answered ``DeadlineExceeded`` if its deadline strikes
while it waits. A gate with no budget admits everything at once.

A request that alone costs more than the budget is let in when nothing else is in flight (the request limits bound
it already). No Triton import: unit-tested (``tests/unit/test_admission.py``).

A generator gate may follow what its stage serves in time (``first_token_target_ms``): its limit of requests in flight
moves between 1 and the budget, cut by a quarter when a request let in under the present limit, with others in flight,
waited longer than the target from entering to its first token, and raised by one after a limit's worth of requests
within it (additive increase, multiplicative decrease, as TCP and the adaptive concurrency limiters of service meshes
do). So the gate lets in what the stage serves within the target on the cores or GPU it has now, not what the budget
allows on a faster day, and the queue (where priority orders requests and ``max_queue_ms`` refuses them at arrival)
takes the rest.
"""
from __future__ import annotations

import asyncio
import contextlib
import contextvars
import heapq
import itertools
import math
import time
from dataclasses import dataclass
from typing import Callable, Protocol

from backend.protocol.errors import DeadlineExceeded, Overloaded
from backend.protocol.generate import PRIORITY_PARAMETER, STAGE_DEADLINE_PARAMETER
from backend.protocol.settings import AdmissionBudgets


@dataclass(frozen=True)
class Urgency:
    """A request's priority (0 first) and deadline (Unix time, None: none), as its stages get them."""

    priority: int = 0
    deadline: float | None = None

    def parameters(self) -> dict:
        """The stage request's parameters (``backend.protocol.generate``): only what differs from the defaults (the
        deadline as text: BLS requests take no float parameters)."""
        return {**({PRIORITY_PARAMETER: self.priority} if self.priority else {}),
                **({STAGE_DEADLINE_PARAMETER: f"{self.deadline:.3f}"} if self.deadline is not None else {})}


# the urgency of the request the current task works for (set by the orchestrator; read by the stage clients, which
# send it with each encode)
URGENCY: contextvars.ContextVar[Urgency] = contextvars.ContextVar("epd_urgency", default=Urgency())


class AdmissionObserver(Protocol):
    def admitted(self, stage: str, priority: int, waited_seconds: float) -> None: ...
    def shed(self, stage: str, priority: int, reason: str) -> None: ...  # reason: "budget", "queue" or "deadline"
    def limited(self, stage: str, limit: int) -> None: ...  # a gate following a first-token target moved its limit


@dataclass(frozen=True)
class Budget:
    """What may be in flight at one stage at once (0: no bound)."""

    units: int = 0  # items (encoder) or requests (generator stages)
    bytes: int = 0  # media bytes (encoder)

    @property
    def bounded(self) -> bool:
        return self.units > 0 or self.bytes > 0


@dataclass(frozen=True)
class Cost:
    units: int = 1
    bytes: int = 0


class _Waiter:
    __slots__ = ("cost", "priority", "future", "since")

    def __init__(self, cost: Cost, priority: int, future: asyncio.Future, since: float):
        self.cost, self.priority, self.future, self.since = cost, priority, future, since


class Allowance:
    """How long one request may still wait for budgets, over all the gates it passes (``max_queue_ms`` at its
    arrival; None: no bound but its deadline). Only waiting spends it: the time a stage works on the request does
    not."""

    def __init__(self, seconds: float | None):
        self.left = seconds
        self.waited: float | None = None  # seconds waited so far over the bounded gates (None: none passed yet)

    def spend(self, seconds: float) -> None:
        self.waited = (self.waited or 0.0) + seconds
        if self.left is not None:
            self.left -= seconds


class Gate:
    """One stage's budget and queue. ``max_queue_seconds``: the longest any request waits here (0: until its
    deadline). ``burst``: the share over the budget the highest priority (0) may use too, so a burst of high-priority
    requests goes in at once where it would wait for the low ones' slots (their engine schedules by priority).
    ``reserve``: the share of the budget only the highest priority (0) may use, so a high-priority request
    finds room without waiting for the low ones in flight to finish. ``clock``: Unix time (deadlines are Unix times, as
    the stages get them)."""

    HOLD_WEIGHT = 0.1  # the mean time in the stage: an exponentially weighted mean over the calls that left

    CUT = 0.75  # the limit after a first token later than the target, of what it was

    def __init__(self, stage: str, budget: Budget, max_queue_seconds: float = 0.0,
                 observer: AdmissionObserver | None = None, clock: Callable[[], float] = time.time,
                 reserve: float = 0.0, first_token_target: float = 0.0, burst: float = 0.0):
        self.stage, self.budget, self.max_queue, self.observer, self.clock = stage, budget, max_queue_seconds, observer, clock
        self.reserve, self.burst = reserve, burst
        self.target = first_token_target if budget.units else 0.0  # seconds (0: the budget is the limit)
        self.limit = float(budget.units)  # requests in flight now allowed (moves with ``first_token`` under a target)
        self._cut_at = -math.inf  # when the limit was last cut
        self.units = self.bytes = 0  # in flight
        self.hold_seconds = 0.0  # mean time a call spends in the stage (0: none left yet)
        self._queue: list[tuple[int, int, _Waiter]] = []
        self._order = itertools.count()

    @property
    def units_limit(self) -> int:
        """The units the gate lets in at once now: the budget, or under a first-token target the limit it follows."""
        return max(1, int(self.limit)) if self.target else self.budget.units

    def first_token(self, admitted: float, seconds: float) -> None:
        """A request let in at ``admitted`` (``clock``) had its first token ``seconds`` after: under a target, the
        limit follows (module docstring); a cut waits for requests let in after the last one (those before it
        were let in under the higher limit)."""
        if not self.target:
            return
        before = self.units_limit
        if seconds <= self.target:
            self.limit = min(float(self.budget.units), self.limit + 1.0 / self.limit)
            self._dispatch()
        elif admitted >= self._cut_at and self.units > 1:
            self.limit, self._cut_at = max(1.0, self.limit * self.CUT), self.clock()
        if self.units_limit != before and self.observer is not None:
            self.observer.limited(self.stage, self.units_limit)

    @property
    def waiting(self) -> int:
        return sum(1 for *_, w in self._queue if not w.future.done())

    def estimate_wait(self, cost: Cost, priority: int) -> float:
        """Seconds a request of ``cost`` and ``priority`` arriving now would wait (0: it enters at once or the stage
        has no rate yet): the units ahead of it beyond the budget over the rate the stage lets them through, and at
        least as long as the oldest of those ahead has waited already (that one still waits: a rate learnt from
        calls that left lags a stage that is slowing down; the age of the queue's head does not)."""
        ahead = [w for p, _, w in self._queue if p <= priority and not w.future.done()]
        head_age = max((self.clock() - w.since for w in ahead), default=0.0)
        if not self.budget.units or not self.hold_seconds:
            return head_age
        limit = self._limit(self.units_limit, priority)
        beyond = self.units + sum(w.cost.units for w in ahead) + cost.units - limit
        return max(0.0, beyond * self.hold_seconds / limit, head_age)

    def _limit(self, budget: int, priority: int) -> int:
        """What of ``budget`` a request of ``priority`` may fill: all of it and the burst over it at priority 0, else
        the budget less the reserve (at least 1)."""
        if not budget:
            return budget
        if priority == 0:
            return budget + math.ceil(budget * self.burst)
        return max(1, budget - math.ceil(budget * self.reserve))

    @contextlib.asynccontextmanager
    async def admit(self, cost: Cost, priority: int, deadline: float | None, allowance: Allowance | None = None):
        """Hold ``cost`` of the budget while the body runs (the stage's call); raises ``Overloaded`` or
        ``DeadlineExceeded`` (module docstring) before any of it is held. ``allowance``: what the request may still
        wait over every gate, spent by the wait here (None: ``max_queue_seconds``). Yields a ``Ticket``: the body
        tells it the stage's first token (``Ticket.first_token``)."""
        if not self.budget.bounded:
            yield Ticket(None, 0.0)
            return
        started = self.clock()
        await self._enter(cost, priority, deadline, started, allowance)
        entered, admitted = time.perf_counter(), self.clock()
        waited = admitted - started
        if allowance is not None:
            allowance.spend(waited)
        if self.observer is not None:
            self.observer.admitted(self.stage, priority, waited)
        try:
            yield Ticket(self, admitted)
        finally:
            held = time.perf_counter() - entered
            self.hold_seconds = held if not self.hold_seconds else \
                self.hold_seconds + self.HOLD_WEIGHT * (held - self.hold_seconds)
            self.units, self.bytes = self.units - cost.units, self.bytes - cost.bytes
            self._dispatch()

    def may_wait(self, deadline: float | None, now: float, allowance: Allowance | None = None) -> float:
        """Seconds a request may wait here from ``now``: until its deadline, and what is left of its ``allowance`` (or
        at most ``max_queue_seconds``)."""
        bound = allowance.left if allowance is not None else (self.max_queue or None)
        return min((s for s in (deadline - now if deadline is not None else None, bound) if s is not None),
                   default=math.inf)

    async def _enter(self, cost: Cost, priority: int, deadline: float | None, now: float,
                     allowance: Allowance | None = None) -> None:
        if not self._queue and self._fits(cost, priority):
            self._take(cost)
            return
        may_wait = self.may_wait(deadline, now, allowance)
        if may_wait <= 0:
            self.refuse(priority, "deadline" if deadline is not None and now >= deadline else "queue", deadline)
        estimate = self.estimate_wait(cost, priority)
        if estimate > may_wait:
            self.refuse(priority, "budget", deadline, estimate, may_wait)
        waiter = _Waiter(cost, priority, asyncio.get_running_loop().create_future(), now)
        heapq.heappush(self._queue, (priority, next(self._order), waiter))
        self._dispatch()
        # let in by the estimate, it waits for its turn until its deadline: a refusal comes at arrival, fast, never
        # after a wait (the age of the queue's head in the estimate keeps the queue short when the stage slows down)
        try:
            async with asyncio.timeout(None if deadline is None else max(0.0, deadline - now)):
                await asyncio.shield(waiter.future)
        except TimeoutError:
            if not self._settle(waiter):  # let in as the deadline struck: it goes on (the stage checks it)
                return
            self.refuse(priority, "deadline", deadline)
        except BaseException:  # cancelled while waiting (its client went away)
            if not self._settle(waiter):
                self.units, self.bytes = self.units - cost.units, self.bytes - cost.bytes
                self._dispatch()
            raise

    def _settle(self, waiter: _Waiter) -> bool:
        """Withdraw a waiter; False if it was let in meanwhile (it then holds its cost)."""
        if waiter.future.done():
            return False
        waiter.future.cancel()
        self._dispatch()  # those behind it may fit now
        return True

    def _fits(self, cost: Cost, priority: int) -> bool:
        if self.units == 0 and self.bytes == 0:
            return True  # alone, whatever it costs
        units, nbytes = self._limit(self.units_limit, priority), self._limit(self.budget.bytes, priority)
        return (not units or self.units + cost.units <= units) and (not nbytes or self.bytes + cost.bytes <= nbytes)

    def _take(self, cost: Cost) -> None:
        self.units, self.bytes = self.units + cost.units, self.bytes + cost.bytes

    def _dispatch(self) -> None:
        """Let in the waiters at the head of the queue while they fit (the head first: none overtakes it)."""
        while self._queue:
            waiter = self._queue[0][2]
            if waiter.future.done():  # withdrawn
                heapq.heappop(self._queue)
                continue
            if not self._fits(waiter.cost, waiter.priority):
                return
            heapq.heappop(self._queue)
            self._take(waiter.cost)
            waiter.future.set_result(None)

    def refuse(self, priority: int, reason: str, deadline: float | None, estimate: float = 0.0,
               may_wait: float = 0.0):
        if self.observer is not None:
            self.observer.shed(self.stage, priority, reason)
        if reason == "deadline":
            raise DeadlineExceeded(f"the deadline passed before stage {self.stage} could start it", "request")
        budget = ", ".join(f"{value} {name}" for name, value in (("in flight", self.budget.units),
                                                                   ("bytes", self.budget.bytes)) if value)
        waited = (f"would wait ~{estimate:.2f} s, longer than it may ({may_wait:.2f} s)" if reason == "budget" else
                  f"waited {may_wait:.2f} s, as long as it may")
        raise Overloaded(f"stage {self.stage} is at its budget ({budget}): the request {waited}",
                         retry_after=max(estimate, 0.001))


class Ticket:
    """A request's passage through a gate, as its body holds it: ``first_token()`` once the stage's first token came
    (``Gate.first_token``; the first call only)."""

    __slots__ = ("gate", "admitted", "told")

    def __init__(self, gate: Gate | None, admitted: float):
        self.gate, self.admitted, self.told = gate, admitted, False

    def first_token(self) -> None:
        if self.gate is not None and not self.told:
            self.told = True
            self.gate.first_token(self.admitted, self.gate.clock() - self.admitted)


class Admission:
    """The gates of one orchestrator: ``encoder``, and one per generator stage, from its settings' budgets."""

    def __init__(self, budgets: AdmissionBudgets = AdmissionBudgets(), observer: AdmissionObserver | None = None,
                 clock: Callable[[], float] = time.time):
        self.max_queue, self.clock = budgets.max_queue_ms / 1000.0, clock

        def gate(stage: str, budget: Budget, target: float = 0.0) -> Gate:
            return Gate(stage, budget, self.max_queue, observer, clock, budgets.high_priority_reserve_percent / 100.0,
                        target, budgets.high_priority_burst_percent / 100.0)
        target = budgets.first_token_target_ms / 1000.0
        self.encoder = gate("encoder", Budget(budgets.encoder_items_in_flight, budgets.encoder_bytes_in_flight))
        self.generators = {"pd": gate("pd", Budget(budgets.generator_requests_in_flight), target),
                           "prefill": gate("prefill", Budget(budgets.generator_requests_in_flight), target),
                           "decode": gate("decode", Budget(budgets.decode_requests_in_flight), target)}

    def generator(self, stage: str) -> Gate:
        return self.generators[stage]

    def check(self, passes: list[tuple[Gate, Cost]], priority: int, deadline: float | None) -> Allowance:
        """At a request's arrival, before any work: what it may wait for budgets over all gates (``max_queue_ms``,
        for ``Gate.admit``); raises ``Overloaded`` (counted at the gate it would wait at longest) when the waits
        estimated at the gates it ``passes`` add up to more than it may wait."""
        now = self.clock()
        allowance = Allowance(self.max_queue or None)
        passes = [(gate, cost) for gate, cost in passes if gate.budget.bounded]
        if not passes:
            return allowance
        may_wait = passes[0][0].may_wait(deadline, now, allowance)
        if may_wait <= 0:
            passes[0][0].refuse(priority, "deadline", deadline)
        waits = [(gate.estimate_wait(cost, priority), gate) for gate, cost in passes]
        total = sum(wait for wait, _ in waits)
        if total > may_wait:
            max(waits, key=lambda pair: pair[0])[1].refuse(priority, "budget", deadline, total, may_wait)
        return allowance


__all__ = ["Admission", "AdmissionObserver", "Allowance", "Budget", "Cost", "Gate", "Ticket", "URGENCY", "Urgency"]
