"""Admission by budget (orchestrator.admission), priorities and deadlines through the orchestrator and an engine stage."""
import asyncio
import time

import pytest

from backend.engine.serving import Outcome, stream_generation
from backend.protocol.errors import DeadlineExceeded, InvalidInput, Overloaded, decode, encode
from backend.protocol.generate import parse_deadline, parse_priority
from backend.protocol.settings import AdmissionBudgets
from backend.request.generate import GenerateRequest, RawGenerateInputs, RequestLimits, parse_generate_request
from orchestrator.admission import URGENCY, Admission, Budget, Cost, Gate, Urgency
from orchestrator.core import Identity, Orchestrator
from tests.fakes import FakeEngine, FakeLayoutResolver, FakeSink, FakeStages, RecordingObserver

IDENTITY = Identity("m", "p")


class Observer:
    def __init__(self):
        self.admissions, self.sheds, self.limits = [], [], []

    def admitted(self, stage, priority, waited_seconds):
        self.admissions.append((stage, priority, waited_seconds))

    def shed(self, stage, priority, reason):
        self.sheds.append((stage, priority, reason))

    def limited(self, stage, limit):
        self.limits.append((stage, limit))


async def hold(gate: Gate, seconds: float, priority: int = 0, deadline=None, order=None, name=None, cost=Cost()):
    async with gate.admit(cost, priority, deadline):
        if order is not None:
            order.append(name)
        await asyncio.sleep(seconds)


def test_a_gate_without_a_budget_lets_everything_in_at_once():
    async def main():
        gate = Gate("encoder", Budget())
        started = time.perf_counter()
        await asyncio.gather(*(hold(gate, 0.05) for _ in range(20)))
        return time.perf_counter() - started
    assert asyncio.run(main()) < 0.5


def test_waiters_are_let_in_by_priority_then_arrival_and_the_budget_holds():
    async def main():
        gate, order = Gate("pd", Budget(units=1)), []
        first = asyncio.create_task(hold(gate, 0.05, order=order, name="first"))
        await asyncio.sleep(0.01)
        tasks = [asyncio.create_task(hold(gate, 0.01, p, order=order, name=name))
                 for p, name in ((2, "low"), (1, "mid-a"), (0, "high"), (1, "mid-b"))]
        await asyncio.sleep(0)
        assert gate.units == 1 and gate.waiting == 4
        await asyncio.gather(first, *tasks)
        return order, gate.units
    order, left = asyncio.run(main())
    assert order == ["first", "high", "mid-a", "mid-b", "low"] and left == 0


def test_a_request_that_cannot_start_before_its_deadline_is_refused_at_once_with_a_retry_hint():
    async def main():
        observer = Observer()
        gate = Gate("encoder", Budget(units=1), observer=observer)
        await hold(gate, 0.1)  # the gate learns the stage's time: 0.1 s a call
        busy = asyncio.create_task(hold(gate, 0.3))
        await asyncio.sleep(0.01)
        waiting = asyncio.create_task(hold(gate, 0.01))  # queued: 1 ahead of the next
        await asyncio.sleep(0.01)
        started = time.perf_counter()
        with pytest.raises(Overloaded) as refused:
            await hold(gate, 0.01, deadline=time.time() + 0.05)
        answered = time.perf_counter() - started
        await asyncio.gather(busy, waiting)
        return refused.value, answered, observer
    error, answered, observer = asyncio.run(main())
    assert answered < 0.05 and error.retry_after > 0.05
    assert "stage encoder is at its budget (1 in flight)" in str(error) and error.code.value == "UNAVAILABLE"
    assert observer.sheds == [("encoder", 0, "budget")]
    # the retry hint travels in the envelope, so the OpenAI endpoint can say Retry-After
    again = decode(encode(error))
    assert isinstance(again, Overloaded) and again.retry_after == error.retry_after


def test_a_waiter_let_in_waits_its_turn_and_only_its_deadline_stops_it_and_frees_its_place():
    """No rate known yet and no one waiting: let in to the queue, a request waits past its 0.05 s bound for its turn
    (never refused after a wait); one whose deadline strikes while it waits gets DeadlineExceeded; one past its
    deadline already is refused before it waits."""
    async def main():
        observer = Observer()
        gate = Gate("pd", Budget(units=1), max_queue_seconds=0.05, observer=observer)
        busy = asyncio.create_task(hold(gate, 0.3))
        await asyncio.sleep(0.01)
        with pytest.raises(DeadlineExceeded):
            await hold(gate, 0.01, deadline=time.time() - 1)  # past already: refused before it waits
        late = asyncio.create_task(hold(gate, 0.01, deadline=time.time() + 0.05))
        await asyncio.sleep(0)
        started = time.perf_counter()
        await hold(gate, 0.01)  # waits ~0.29 s for busy, then is served
        waited = time.perf_counter() - started
        with pytest.raises(DeadlineExceeded):
            await late
        await busy
        return observer.sheds, waited, gate.waiting, gate.units
    sheds, waited, waiting, units = asyncio.run(main())
    assert sheds == [("pd", 0, "deadline"), ("pd", 0, "deadline")] and 0.2 < waited < 0.6
    assert waiting == 0 and units == 0


def test_a_waiter_cancelled_by_its_client_takes_nothing_with_it():
    async def main():
        gate = Gate("pd", Budget(units=1))
        busy = asyncio.create_task(hold(gate, 0.05))
        await asyncio.sleep(0.01)
        gone = asyncio.create_task(hold(gate, 1.0))
        await asyncio.sleep(0.01)
        gone.cancel()
        await busy
        with pytest.raises(asyncio.CancelledError):
            await gone
        await asyncio.wait_for(hold(gate, 0.01), 1.0)  # not blocked by the cancelled one
        return gate.units, gate.waiting
    assert asyncio.run(main()) == (0, 0)


def test_a_request_larger_than_the_budget_goes_in_alone():
    async def main():
        gate, order = Gate("encoder", Budget(units=2, bytes=100)), []
        big = asyncio.create_task(hold(gate, 0.03, order=order, name="big", cost=Cost(5, 1000)))
        await asyncio.sleep(0.005)
        small = asyncio.create_task(hold(gate, 0.01, order=order, name="small", cost=Cost(1, 10)))
        await asyncio.sleep(0.01)
        assert order == ["big"]  # the small one waits for the big one
        await asyncio.gather(big, small)
        return order
    assert asyncio.run(main()) == ["big", "small"]


def run(orchestrator, raw, sink=None):
    sink = sink or FakeSink()
    return asyncio.run(orchestrator.run(raw, sink)), sink


def test_the_orchestrator_sends_priority_and_deadline_to_its_stages():
    seen = []

    class Stages(FakeStages):
        async def encode(self, item, key, part=None):
            seen.append(("encode", URGENCY.get()))
            return await super().encode(item, key, part)

        async def generate(self, inputs, stage=None):
            seen.append(("generate", Urgency(inputs.priority, inputs.deadline)))
            async for chunk in super().generate(inputs, stage):
                yield chunk

    orchestrator = Orchestrator(Stages(), IDENTITY, RequestLimits(), deadline=10)
    before = time.time()
    outcome, sink = run(orchestrator, RawGenerateInputs(prompt="x", images=(b"a",), priority=2,
                                                         deadline=before + 5))
    assert outcome is Outcome.OK
    assert [what for what, _ in seen] == ["encode", "generate"]
    assert all(u.priority == 2 and u.deadline == before + 5 for _, u in seen)  # the request's: sooner than 10 s


def test_a_request_past_its_deadline_costs_no_stage_any_work():
    stages = FakeStages()
    outcome, sink = run(Orchestrator(stages, IDENTITY, RequestLimits()),
                        RawGenerateInputs(prompt="x", images=(b"a",), deadline=time.time() - 0.001))
    assert outcome is Outcome.EXPIRED and stages.encoded == [] and stages.generated == []
    assert isinstance(sink.errors[0], DeadlineExceeded)


def test_a_priority_out_of_the_deployment_s_range_is_invalid_naming_it():
    stages = FakeStages()
    outcome, sink = run(Orchestrator(stages, IDENTITY, RequestLimits(priority_levels=2)),
                        RawGenerateInputs(prompt="x", priority=2))
    assert outcome is Outcome.ERROR and stages.generated == []
    [error] = sink.errors
    assert isinstance(error, InvalidInput) and error.field == "parameters.epd_priority" and "0 .. 1" in str(error)


@pytest.mark.parametrize("value", ["1", -1, 1.5, True, [0]])
def test_a_priority_that_is_no_integer_from_zero_is_invalid(value):
    with pytest.raises(InvalidInput, match=r"^parameters\.epd_priority: expected an integer >= 0"):
        parse_priority(value)


@pytest.mark.parametrize("value", ["soon", -5, 0, float("inf"), float("nan"), True, 86_400_001])
def test_a_deadline_that_is_no_number_of_ms_in_range_is_invalid(value):
    with pytest.raises(InvalidInput, match=r"^parameters\.deadline_ms: expected a number of milliseconds"):
        parse_deadline({"deadline_ms": value}, 0.0)


def test_deadlines_parse_as_absolute_times():
    assert parse_deadline({"deadline_ms": 250}, 100.0) == 100.25
    assert parse_deadline({"deadline_ms": "250"}, 100.0) == 100.25  # clients that send strings only
    assert parse_deadline({"epd_deadline": "123.5", "deadline_ms": 1}, 100.0) == 123.5  # an orchestrator's wins
    assert parse_deadline({}, 100.0) is None
    assert Urgency(1, 123.5).parameters() == {"epd_priority": 1, "epd_deadline": "123.500"}
    assert Urgency().parameters() == {}


def test_the_budgets_of_an_orchestrator_come_from_its_settings():
    admission = Admission(AdmissionBudgets(encoder_items_in_flight=3, encoder_bytes_in_flight=10,
                                           generator_requests_in_flight=4, decode_requests_in_flight=5,
                                           max_queue_ms=250, first_token_target_ms=150))
    assert admission.encoder.budget == Budget(3, 10) and admission.encoder.max_queue == 0.25
    assert [admission.generator(s).budget.units for s in ("pd", "prefill", "decode")] == [4, 4, 5]
    assert [admission.generator(s).target for s in ("pd", "prefill", "decode")] == [0.15] * 3
    assert admission.encoder.target == 0  # the encoder's budget stays fixed
    assert not Admission().encoder.budget.bounded


def engine_request(**kwargs) -> GenerateRequest:
    defaults = dict(prompt="Q: ", conversation=None, items=(), sampling={}, stream=True)
    return GenerateRequest(**{**defaults, **kwargs})


def test_an_engine_stage_stops_a_request_when_its_deadline_passes_and_spends_no_step_after():
    engine, sink, observer = FakeEngine(pieces=["t"] * 100, step_delay=0.01), FakeSink(), RecordingObserver()
    outcome = asyncio.run(stream_generation(engine, engine_request(deadline=time.time() + 0.1), sink, observer,
                                            request_id="r1"))
    steps = engine.steps_run
    assert outcome is Outcome.EXPIRED and engine.aborted == ["r1"] and 3 <= steps < 100
    assert isinstance(sink.errors[0], DeadlineExceeded) and observer.finished[0][0] is Outcome.EXPIRED
    time.sleep(0.05)
    assert engine.steps_run == steps  # aborted: no step after the deadline


def test_an_engine_stage_refuses_a_request_whose_deadline_passed_before_it_started():
    engine, sink = FakeEngine(), FakeSink()
    outcome = asyncio.run(stream_generation(engine, engine_request(deadline=time.time() - 0.01), sink,
                                            request_id="r1"))
    assert outcome is Outcome.EXPIRED and engine.steps_run == 0 and "before this stage started it" in str(sink.errors[0])


def test_parsed_requests_carry_their_priority_and_deadline():
    raw = RawGenerateInputs(prompt="x", priority=1, deadline=123.0)
    parsed = parse_generate_request(raw, FakeLayoutResolver(), RequestLimits())
    assert (parsed.priority, parsed.deadline) == (1, 123.0)
    assert parse_generate_request(RawGenerateInputs(prompt="x"), FakeLayoutResolver()).priority == 0


def test_the_arrival_check_adds_up_the_waits_of_every_gate_and_refuses_before_any_work():
    observer = Observer()
    admission = Admission(AdmissionBudgets(encoder_items_in_flight=1, generator_requests_in_flight=1, max_queue_ms=300),
                          observer)
    encoder, pd = admission.encoder, admission.generator("pd")
    for gate in (encoder, pd):  # each full, each stage 0.2 s a call: 0.2 s of wait at each
        gate.hold_seconds, gate.units = 0.2, 1
    assert admission.check([(encoder, Cost(1)), ], 0, None).left == 0.3  # 0.2 s: in time; it may wait 0.3 s in all
    with pytest.raises(Overloaded) as refused:
        admission.check([(encoder, Cost(1)), (pd, Cost())], 0, None)  # 0.4 s in all: more than the 0.3 s it may wait
    assert refused.value.retry_after == pytest.approx(0.4) and observer.sheds == [("encoder", 0, "budget")]
    with pytest.raises(DeadlineExceeded):
        admission.check([(pd, Cost())], 0, time.time() - 1)
    assert Admission().check([(Admission().encoder, Cost(3))], 0, None).left is None  # no budgets: no bound


def test_a_reserve_keeps_room_for_the_highest_priority():
    async def main():
        gate, order = Gate("pd", Budget(units=4), reserve=0.25), []  # low ones fill 3 of 4
        lows = [asyncio.create_task(hold(gate, 0.1, 1, order=order, name=f"low{i}")) for i in range(4)]
        await asyncio.sleep(0.01)
        assert gate.units == 3 and gate.waiting == 1
        high = asyncio.create_task(hold(gate, 0.01, 0, order=order, name="high"))
        await asyncio.sleep(0.03)
        assert order[-1] == "high" and "low3" not in order  # in at once, on the reserved place
        await asyncio.gather(high, *lows)
        return gate._limit(4, 1), gate._limit(1, 1), gate._limit(4, 0)
    assert asyncio.run(main()) == (3, 1, 4)


def test_a_burst_lets_high_priority_requests_in_over_a_full_budget_and_never_the_low_ones():
    """The overload bench's slowest high-class requests waited at pd's gate for the low ones' slots (a burst of high
    arrivals, docs/benchmarks.md): with ``burst`` 0.5, priority 0 may have 6 of a budget of 4 in flight."""
    async def main():
        gate, order = Gate("pd", Budget(units=4), burst=0.5), []
        lows = [asyncio.create_task(hold(gate, 0.1, 1, order=order, name=f"low{i}")) for i in range(5)]
        await asyncio.sleep(0.01)
        assert gate.units == 4 and gate.waiting == 1  # the low ones fill the budget, not the burst
        highs = [asyncio.create_task(hold(gate, 0.05, 0, order=order, name=f"high{i}")) for i in range(3)]
        await asyncio.sleep(0.02)
        assert gate.units == 6 and gate.waiting == 2, order  # two highs in at once, over the budget; one waits
        await asyncio.gather(*highs, *lows)
        return order, gate._limit(4, 0), gate._limit(4, 1), gate.units
    order, high, low, left = asyncio.run(main())
    assert (high, low, left) == (6, 4, 0)
    assert order.index("high2") < order.index("low4")  # the waiting high one before the waiting low one


def test_a_queue_whose_head_has_waited_longer_than_a_request_may_refuses_it_at_arrival():
    """The rate learnt from calls that left says ~0 s, but the oldest waiter has waited 0.2 s already: an arrival that
    may wait 0.1 s is refused at once, not after waiting."""
    async def main():
        observer = Observer()
        gate = Gate("pd", Budget(units=1), max_queue_seconds=0.1, observer=observer)
        gate.hold_seconds = 0.001  # learnt when the stage was fast
        busy = asyncio.create_task(hold(gate, 0.3))
        await asyncio.sleep(0.01)
        head = asyncio.create_task(hold(gate, 0.01))  # waits behind busy (up to 4 x 0.1 s: it is let in at 0.3 s)
        await asyncio.sleep(0.2)
        age = gate.estimate_wait(Cost(), 0)
        started = time.perf_counter()
        with pytest.raises(Overloaded) as refused:
            await hold(gate, 0.01)
        answered = time.perf_counter() - started
        await asyncio.gather(busy, head)
        return age, answered, str(refused.value), observer.sheds
    age, answered, message, sheds = asyncio.run(main())
    assert 0.19 <= age < 0.3 and answered < 0.02 and sheds == [("pd", 0, "budget")]
    assert "would wait ~0.2" in message


def test_time_in_a_stage_does_not_count_against_the_wait_allowed_at_the_next_gate():
    """max_queue_ms bounds the waits for budgets over all gates: a request that spent 0.3 s being encoded may still
    wait its 0.2 s at pd's gate (before: refused there as past its 'deadline'), and each wait spends the allowance."""
    async def main():
        admission = Admission(AdmissionBudgets(encoder_items_in_flight=1, generator_requests_in_flight=1, max_queue_ms=200))
        encoder, pd = admission.encoder, admission.generator("pd")
        allowance = admission.check([(encoder, Cost(1)), (pd, Cost())], 1, None)
        async with encoder.admit(Cost(1), 1, None, allowance):
            await asyncio.sleep(0.3)  # the stage's work
        busy = asyncio.create_task(hold(pd, 0.1))
        await asyncio.sleep(0.01)
        async with pd.admit(Cost(), 1, None, allowance):  # waits ~0.09 s for busy
            pass
        await busy
        return allowance.left, allowance.waited
    left, waited = asyncio.run(main())
    assert 0.05 < left < 0.12 and 0.08 < waited < 0.15  # only the wait at pd's gate spent it


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def adaptive(budget: int = 8, target: float = 0.1, observer=None) -> tuple[Gate, Clock]:
    clock = Clock()
    return Gate("pd", Budget(units=budget), clock=clock, first_token_target=target, observer=observer), clock


def test_a_late_first_token_cuts_the_limit_once_per_round_and_never_below_one():
    observer = Observer()
    gate, clock = adaptive(observer=observer)
    gate.units = 4  # others in flight
    assert gate.units_limit == 8
    gate.first_token(admitted=clock.now - 0.5, seconds=0.5)  # late: 8 -> 6
    assert gate.units_limit == 6 and observer.limits == [("pd", 6)]  # the gauge's value
    gate.first_token(admitted=clock.now - 0.4, seconds=0.4)  # let in before the cut, under the old limit: no cut
    assert gate.units_limit == 6
    clock.now += 1
    for _ in range(20):  # each let in after the last cut
        clock.now += 0.01
        gate.first_token(admitted=clock.now - 0.001, seconds=0.3)
    assert gate.units_limit == 1 and gate.limit == 1.0


def test_a_late_first_token_alone_in_the_stage_does_not_cut():
    gate, clock = adaptive()
    gate.units = 1  # itself: the limit is not why it was late
    gate.first_token(admitted=clock.now, seconds=5.0)
    assert gate.units_limit == 8


def test_timely_first_tokens_raise_the_limit_by_one_per_limits_worth_up_to_the_budget():
    gate, clock = adaptive(budget=8)
    gate.limit = 4.0
    for _ in range(4):
        gate.first_token(admitted=clock.now, seconds=0.05)
    assert gate.units_limit == 4 and gate.limit == pytest.approx(4.0 + 1 / 4 + 1 / 4.25 + 1 / 4.485 + 1 / 4.708, rel=1e-3)
    for _ in range(200):
        gate.first_token(admitted=clock.now, seconds=0.05)
    assert gate.units_limit == 8 and gate.limit == 8.0


def test_without_a_target_the_budget_is_the_limit():
    gate = Gate("pd", Budget(units=8))
    gate.units = 4
    gate.first_token(admitted=0.0, seconds=100.0)
    assert gate.units_limit == 8


def test_the_gate_lets_in_what_its_limit_allows_and_the_waiters_when_it_grows():
    async def main():
        gate, clock = adaptive(budget=4)
        gate.limit = 1.0
        holders = [asyncio.create_task(hold(gate, 0.05)) for _ in range(3)]
        await asyncio.sleep(0.01)
        first = gate.units, gate.waiting  # one in, two waiting
        gate.first_token(admitted=clock.now, seconds=0.01)  # timely: 1 -> 2, one more let in at once
        second = gate.units, gate.waiting
        await asyncio.gather(*holders)
        return first, second
    assert asyncio.run(main()) == ((1, 2), (2, 1))


def test_the_orchestrators_generator_gate_hears_each_requests_first_token():
    class Slow(FakeStages):
        async def generate(self, inputs, stage=None):
            await asyncio.sleep(0.05)  # a first token later than the target
            async for chunk in super().generate(inputs, stage):
                yield chunk

    async def main():
        admission = Admission(AdmissionBudgets(generator_requests_in_flight=8, first_token_target_ms=20))
        orchestrator = Orchestrator(Slow(), IDENTITY, RequestLimits(), admission=admission)
        outcomes = await asyncio.gather(*(orchestrator.run(RawGenerateInputs(prompt="x"), FakeSink())
                                          for _ in range(4)))
        return outcomes, admission.generator("pd")
    outcomes, gate = asyncio.run(main())
    assert outcomes == [Outcome.OK] * 4
    assert gate.units_limit == 6 and gate.units == 0  # one cut: the four were let in under the first limit


def test_a_request_s_timings_say_how_long_it_waited_at_the_gates():
    """``queued_ms`` (docs/interface.md; over OpenAI ``usage.epd_timings``): the second of two requests for a budget
    of one waits for the first's stream; the first was let in at once; without budgets there is no ``queued_ms``."""
    class Slow(FakeStages):
        async def generate(self, inputs, stage=None):
            await asyncio.sleep(0.1)
            async for chunk in super().generate(inputs, stage):
                yield chunk

    async def main():
        orchestrator = Orchestrator(Slow(), IDENTITY, RequestLimits(),
                                    admission=Admission(AdmissionBudgets(generator_requests_in_flight=1)))
        sinks = [FakeSink(), FakeSink()]
        first = asyncio.create_task(orchestrator.run(RawGenerateInputs(prompt="x"), sinks[0]))
        await asyncio.sleep(0.01)
        await orchestrator.run(RawGenerateInputs(prompt="x"), sinks[1])
        await first
        return [sink.chunks[-1][0].timings for sink in sinks]
    first, second = asyncio.run(main())
    assert first["queued_ms"] < 5 and 60 < second["queued_ms"] < 200, (first, second)
    outcome, sink = run(Orchestrator(FakeStages(), IDENTITY, RequestLimits()), RawGenerateInputs(prompt="x"))
    assert outcome is Outcome.OK and "queued_ms" not in sink.chunks[-1][0].timings
