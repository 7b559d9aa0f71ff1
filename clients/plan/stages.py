"""The simulated stages: an encoder replica (Triton's dynamic batching over its instances), a vLLM engine (continuous
batching, one step at a time) and the single-threaded processes that relay its tokens (the engine's Triton stub, the
orchestrator, the client). Every piece of work runs on the machine's ``Cores``.
"""
from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass

import simpy

from clients.plan.profile import Profile
from clients.plan.resources import Cores
from clients.plan.workload import Item


class Busy:
    """What runs on the machine's ``cores`` and counts its ``busy`` seconds (the utilisation): a ``Process``, an
    ``Encoder`` replica, an ``Engine``."""

    def __init__(self, env: simpy.Environment, cores: Cores):
        self.env, self.cores = env, cores
        self.busy = 0.0

    def _work(self, ms: float):
        """``ms`` of work on the cores, its time counted busy (``yield from``); called by the subclasses."""
        started = self.env.now
        yield from self.cores.work(ms / 1000.0)
        self.busy += self.env.now - started


class Process(Busy):
    """A single-threaded process (a Triton stub, the orchestrator's loop, the client): one piece of work at a time,
    first come first served, on the machine's cores. ``busy``: seconds it spent working."""

    def __init__(self, env: simpy.Environment, cores: Cores, threads: int = 1):
        super().__init__(env, cores)
        self.slot = simpy.Resource(env, capacity=threads)

    def work(self, ms: float):
        if ms <= 0:
            return
        with self.slot.request() as turn:
            yield turn
            yield from self._work(ms)

    def take(self, take, ms_each: float):
        """Once a thread is free: ``take()`` what is waiting then, and work ``ms_each`` for each; returns what it
        took (``yield from``)."""
        with self.slot.request() as turn:
            yield turn
            taken = take()
            yield from self._work(ms_each * len(taken))
        return taken


class Encoder(Busy):
    """One encoder replica: ``instances`` instances taking batches of up to ``max_batch`` queued items (after
    ``delay_ms``, Triton's ``max_queue_delay``), each batch ``encoder.batch`` plus its items' times: the profile's
    device share of it (``Profile.encoder_device_share_at`` the deployment's requests in flight, ``load()``: the
    simulation sets it) on the replica's one device (a GPU's), which its instances' batches share as a core is shared
    (``resources.Cores`` of one: n batches at once each go at 1/n of the speed, as processes time-slice a GPU), after
    the rest on the machine's ``cores`` (the instance's host work: decode, preprocessing, launches)."""

    def __init__(self, env: simpy.Environment, cores: Cores, profile: Profile, instances: int = 1,
                 max_batch: int = 32, delay_ms: float = 2.0):
        super().__init__(env, cores)
        shared = profile.encoder_device_share or profile.doc.get("encoder_share_by_load")
        self.device = Cores(env, 1) if shared else None
        self.profile = profile
        self.load = lambda: 0.0
        self.queue = simpy.Store(env)
        self.max_batch, self.delay = max_batch, delay_ms / 1000.0
        self.outstanding, self.instances = 0, instances
        for _ in range(instances):
            env.process(self._instance())

    def encode(self, item: Item):
        """Encode one item (``yield from``)."""
        done = self.env.event()
        self.outstanding += 1
        yield self.queue.put((item, done))
        yield done
        self.outstanding -= 1

    def _instance(self):
        while True:
            batch = [(yield self.queue.get())]
            if self.delay and len(self.queue.items) < self.max_batch - 1:
                yield self.env.timeout(self.delay)
            while self.queue.items and len(batch) < self.max_batch:
                batch.append((yield self.queue.get()))
            ms = self.profile.line("encoder.batch").at(len(batch)) + sum(self.profile.encode_ms(i) for i, _ in batch)
            share = self.profile.encoder_device_share_at(self.load()) if self.device is not None else 0.0
            yield from self._work(ms * (1.0 - share))
            if share:
                started = self.env.now
                yield from self.device.work(ms * share / 1000.0)
                self.busy += self.env.now - started
            for _, done in batch:
                done.succeed()


@dataclass(eq=False)
class Sequence:
    """A request in an engine: ``prefill`` prompt tokens to compute, ``output`` tokens to sample, ``context`` tokens
    it holds already (E/P/D's decode: the prompt's KV, pulled; its ``prefill`` 0); ``media_ms``: the baseline
    engine's own encoding of the request's media, done in its prefill step."""

    prefill: int
    output: int
    priority: int
    first: simpy.Event
    done: simpy.Event
    media_ms: float = 0.0
    generated: int = 0
    context: int = 0
    stub: object = None  # the Process of the engine's stub (its per-request work after the end)
    engine: object = None  # the Engine it ran on
    prefill_ms: float = 0.0  # the engine's per-request CPU done in its prefill step (``Profile.by_load``)
    responses: int = 0  # the stub's responses for it so far
    emitted: float = 0.0  # when the engine's step made its first token


class Engine(Busy):
    """A vLLM engine, one thread: each step admits waiting sequences (priority, then arrival) while there is room
    (``max_seqs`` running, ``max_tokens`` tokens in the step), prefills them and decodes one token for every running
    one; the step's tokens then go through ``relays`` (the stub, then the processes between it and the user, each
    with a function giving its milliseconds per response now; a response carries what the stub had for a sequence
    when its thread came to send it) in turn. ``chore``: per-request work the engine's
    thread does between steps (after a request ends), delaying the next step. With the profile's ``by_load`` engine
    row, a step costs its new sequences' ``prefill_ms`` plus the row's ms per token for every token it emits, at the
    requests in flight on this engine (``load``); else ``Profile.step_ms``."""

    def __init__(self, env: simpy.Environment, cores: Cores, profile: Profile, relays: list[tuple[Process, object]],
                 max_seqs: int = 32, max_tokens: int = 8192):
        super().__init__(env, cores)
        self.profile, self.relays = profile, relays
        self.max_seqs, self.max_tokens = max_seqs, max_tokens
        self.waiting: list = []
        self.running: list[Sequence] = []
        self.chores: list[float] = []
        self.outbox: dict[Sequence, int] = {}  # tokens the stub has, not sent yet: sequence -> generated so far
        self.ready = env.event()
        self.load = lambda: self.outstanding  # the requests in flight its by-load costs are read at
        self.order = itertools.count()
        self.wake = env.event()
        self.outstanding, self.steps, self.batched = 0, 0, 0  # batched: sequences over all steps
        env.process(self._loop())
        env.process(self._sender())

    def submit(self, seq: Sequence) -> None:
        heapq.heappush(self.waiting, (seq.priority, next(self.order), seq))
        self._wake()

    def chore(self, ms: float) -> None:
        if ms > 0:
            self.chores.append(ms)
            self._wake()

    def _wake(self) -> None:
        if not self.wake.triggered:
            self.wake.succeed()

    def _admit(self) -> list[Sequence]:
        budget, new = self.max_tokens - len(self.running), []
        while self.waiting and len(self.running) + len(new) < self.max_seqs:
            seq = self.waiting[0][2]
            if new and seq.prefill > budget:
                break
            heapq.heappop(self.waiting)
            new.append(seq)
            budget -= seq.prefill
        return new

    def _loop(self):
        while True:
            if not self.waiting and not self.running and not self.chores:
                self.wake = self.env.event()
                yield self.wake
            if self.chores:
                ms, self.chores = sum(self.chores), []
                yield from self._threads(ms)
            if self.waiting or self.running:
                yield from self._step()

    def _threads(self, ms: float):
        """``ms`` of the engine's CPU: the profile's ``engine_thread_share`` of it on the step's thread (what the next
        step waits for), the rest on the engine's other threads, beside it on the cores."""
        share = self.profile.engine_thread_share
        if share < 1.0:
            self.env.process(self.cores.work((1.0 - share) * ms / 1000.0))
        yield from self._work(share * ms)

    def _step_ms(self, new: list[Sequence]) -> float:
        media = sum(s.media_ms for s in new) + sum(s.prefill_ms for s in new)
        if self.profile.by_load("engine"):
            return media + (len(self.running) + len(new)) * self.profile.cost("engine", self.load()).slope
        decoding = self.running + [s for s in new if not s.prefill]  # a decode engine's new ones: KV pulled
        return media + self.profile.step_ms(sum(s.prefill for s in new), len(decoding),
                                            sum(s.context for s in decoding))

    def _step(self):
        new = self._admit()
        yield from self._threads(self._step_ms(new))
        self.steps += 1
        for seq in new:
            seq.context += seq.prefill
        emitted = self.running + new
        self.batched += len(emitted)
        for seq in emitted:
            seq.generated += 1
            seq.emitted = seq.emitted or self.env.now
            seq.context += 1
        self.running = [s for s in emitted if s.generated < s.output]
        for seq in emitted:  # to the stub
            self.outbox[seq] = seq.generated
        if not self.ready.triggered:
            self.ready.succeed()

    def _sender(self):
        """The stub's responses: whenever its thread is free, every sequence with tokens waiting goes as one response
        (steps a busy stub has not sent yet are merged, as vLLM's DELTA outputs are), the stub's cost per response,
        then through ``relays[1:]`` (each its cost per response); no sooner than the profile's ``send_interval`` at
        its load after its last send."""
        last = -1.0
        while True:
            yield self.ready
            interval = self.profile.send_interval(self.load()) / 1000.0
            if last + interval > self.env.now:
                yield self.env.timeout(last + interval - self.env.now)
            stub, per_response = self.relays[0]
            batch = yield from stub.take(self._outbox, per_response())
            last = self.env.now
            self.env.process(self._deliver(batch))

    def _outbox(self) -> dict[Sequence, int]:
        self.ready = self.env.event()
        batch, self.outbox = self.outbox, {}
        return batch

    def _deliver(self, batch: dict[Sequence, int]):
        for process, per_response in self.relays[1:]:
            yield from process.work(per_response() * len(batch))
        for seq, generated in batch.items():
            seq.responses += 1
            if not seq.first.triggered:
                seq.first.succeed(self.env.now)
            if generated >= seq.output and not seq.done.triggered:
                seq.done.succeed(self.env.now)
