"""The planner's simulator (clients.plan.simulate) on cases computed by hand: an M/D/1 queue against the
Pollaczek-Khinchine mean wait, a single request walking a pipeline of constant stages, processor sharing of the cores,
admission refusing what cannot start in time, encoder instances sharing one device."""
import math

import pytest
import simpy

from clients.plan.profile import Line, Profile, ProfileError
from clients.plan.resources import Cores
from clients.plan.planner import capacity, demands
from clients.plan.simulate import Layout, Simulation, simulate
from clients.plan.stages import Encoder
from clients.plan.workload import Item, parse


def profile(**lines) -> Profile:
    """Every cost 0 but those given (``name=(base, slope)``); no shared cores."""
    doc = {"name": "test", "cores": 0, "embedding_bytes_per_token": 0, "kv_bytes_per_token": 0,
           "encoder": {"batch": {}, "image": {}}, "tokens": {"image": {"base": 1}}, "transfer": {"shared_memory": {}}}
    for name in ("prefill", "decode", "decode_context", "kv_transfer", "orchestrator", "stub", "client"):
        doc[name] = {}
    for name, (base, slope) in lines.items():
        node = doc
        *parents, last = name.split("__")
        for part in parents:
            node = node[part]
        node[last] = {"base": base, "slope": slope}
    return Profile(doc).check()


def workload(process: str, requests: int, images: int = 0, output: int = 1, prompt: int = 10, **arrivals):
    mix = {"prompt_tokens": prompt, "output_tokens": output}
    if images:
        mix["images"] = {"count": images, "sizes": [[100, 100]]}
    return parse({"arrivals": {"process": process, **arrivals}, "requests": requests, "seed": 7, "mix": [mix]})


@pytest.mark.parametrize("rho", [0.5, 0.8])
def test_an_engine_of_one_sequence_and_constant_steps_is_an_md1_queue(rho):
    # one server, deterministic service D, Poisson arrivals at rate rho/D: mean wait = rho D / (2 (1 - rho))
    service_ms = 10.0
    result = simulate(Layout(split="llm", max_num_seqs=1), profile(prefill=(service_ms, 0.0)),
                      workload("poisson", 40000, rate=rho / (service_ms / 1000)))
    mean_wait = rho * service_ms / (2 * (1 - rho))
    # the p50 of an M/D/1 sojourn is not the mean: compare the mean through the served requests instead
    measured = result["ttft_mean_ms"] - service_ms
    assert measured == pytest.approx(mean_wait, rel=0.08)
    assert result["utilisation"]["llm"] == pytest.approx(rho, rel=0.03)


def test_one_request_through_a_pipeline_of_constant_stages_takes_their_sum():
    costs = dict(client=(1.0, 0.5), orchestrator=(2.0, 0.25), stub=(0.0, 0.125), encoder__batch=(3.0, 0.0),
                 encoder__image=(4.0, 0.0), transfer__shared_memory=(5.0, 0.0), prefill=(6.0, 0.0), decode=(7.0, 0.0))
    result = simulate(Layout(split="E+PD"), profile(**costs), workload("closed", 4, images=1, output=5, concurrency=1))
    relay = 0.5 + 0.25 + 0.125
    ttft = 1 + 2 + 2 + 3 + 4 + 5 + 6 + relay  # client, orchestrator, Triton's 2 ms batch delay, batch, item, pull, prefill
    e2e = ttft + 4 * 7  # four decode steps; their relays overlap the next step
    assert result["ttft_p50_ms"] == pytest.approx(ttft) and result["ttft_p90_ms"] == pytest.approx(ttft)
    assert result["e2e_p50_ms"] == pytest.approx(e2e)
    assert result["tpot_p50_ms"] == pytest.approx(7.0)
    assert result["req_per_s"] == pytest.approx(1000 / e2e)  # closed loop, one client: one request at a time


def test_e_p_d_adds_the_kv_pull_and_decode_step_to_the_first_token():
    costs = dict(prefill=(6.0, 0.0), decode=(7.0, 0.0), kv_transfer=(3.0, 0.0))
    disagg = simulate(Layout(split="E/P/D"), profile(**costs), workload("closed", 2, output=3, concurrency=1))
    joint = simulate(Layout(split="E+PD"), profile(**costs), workload("closed", 2, output=3, concurrency=1))
    assert joint["ttft_p50_ms"] == pytest.approx(6.0)
    # prefill's step, the KV pull (by decode's stub), then decode's first step: a decode step
    assert disagg["ttft_p50_ms"] == pytest.approx(6.0 + 3.0 + 7.0)


def test_cores_are_shared_between_busy_pieces_of_work():
    env = simpy.Environment()
    cores, ends = Cores(env, 1), {}

    def job(name, seconds, start=0.0):
        yield env.timeout(start)
        yield from cores.work(seconds)
        ends[name] = env.now

    env.process(job("a", 1.0))
    env.process(job("b", 2.0))
    env.process(job("c", 1.0, start=3.0))
    env.run()
    # a and b share one core until a is done at 2 s; b's last second alone; c after them, alone
    assert ends == pytest.approx({"a": 2.0, "b": 3.0, "c": 4.0})
    assert cores.busy == pytest.approx(4.0)


def test_two_cores_run_two_pieces_at_full_speed():
    env = simpy.Environment()
    cores, ends = Cores(env, 2), []

    def job():
        yield from cores.work(1.0)
        ends.append(env.now)

    for _ in range(3):
        env.process(job())
    env.run()
    assert ends == pytest.approx([1.5, 1.5, 1.5])  # three on two cores: each at 2/3


def test_admission_refuses_at_arrival_what_cannot_start_in_time():
    layout = Layout(split="llm", max_num_seqs=1)
    slow = profile(prefill=(100.0, 0.0))
    burst = workload("poisson", 200, rate=100.0)
    open_gate = simulate(layout, slow, burst)
    assert open_gate["shed"] == 0 and open_gate["ttft_p90_ms"] > 10_000
    gated = Layout(split="E+PD", max_num_seqs=1, admission={"generator_requests_in_flight": 1, "max_queue_ms": 250})
    sim = Simulation(gated, slow, burst)
    result = sim.run()
    assert result["shed"] > 100 and result["served"] == 200 - result["shed"]
    # once the gate has a rate (the first call's 100 ms), what it lets in waits about the queue bound at most (its
    # estimate: the calls ahead over the budget, 100 ms each); those let in before that wait their turn
    later = [r["first"] - r["sent"] for r in sim.records if "first" in r and r["sent"] > 0.3]
    assert later and max(later) < 0.250 + 0.100


def test_goodput_counts_only_requests_within_the_slo():
    doc = {"arrivals": {"process": "closed", "concurrency": 2}, "requests": 10, "slo": {"ttft_p90_ms": 15},
           "mix": [{"prompt_tokens": 1, "output_tokens": 1}]}
    result = simulate(Layout(split="llm", max_num_seqs=1), profile(prefill=(10.0, 0.0)), parse(doc))
    # two clients, one server of 10 ms: after the first, each request waits for the other client's (TTFT 20 > 15)
    assert result["req_per_s"] == pytest.approx(100.0)
    assert result["goodput"] == pytest.approx(10.0)
    assert not math.isnan(result["ttft_p50_ms"])


def by_load(base: Profile, share: float = 1.0, cores: float = 0, **rows) -> Profile:
    """``base`` with ``by_load`` rows (``process=[[load, ms per request, ms per token], ...]``)."""
    return Profile({**base.doc, "by_load": rows, "before_first_token": share, "cores": cores, "frontend_threads": 1})


def test_costs_by_load_are_read_between_rows_on_a_log_scale_and_held_beyond_the_ends():
    p = by_load(profile(), stub=[[2, 10.0, 1.0], [8, 4.0, 0.5], [1, 12.0, 2.0]])
    assert p.cost("stub", 1).base == pytest.approx(12.0) and p.cost("stub", 0.5).slope == pytest.approx(2.0)
    assert p.cost("stub", 4).base == pytest.approx(7.0)  # halfway from 2 to 8 on a log scale
    assert p.cost("stub", 4).slope == pytest.approx(0.75)
    assert p.cost("stub", 100).base == pytest.approx(4.0)
    assert p.cost("frontend", 3).base == 0.0  # no row, no line: none
    intervals = Profile({**p.doc, "send_interval_by_load": [[1, 2.0], [16, 6.0]]})
    assert intervals.send_interval(4) == pytest.approx(4.0) and p.send_interval(4) == 0.0
    assert by_load(profile(client=(3.0, 0.5))).cost("client", 16) == Line(3.0, 0.5)  # no row: the line


def test_the_engines_per_request_work_after_the_end_is_on_its_thread():
    # all of the engine's 10 ms per request after the end (share 0), on its one thread: four clients are served at
    # 100 requests/s however many wait (off the thread, on devices of their own, they would be served at once)
    p = by_load(profile(), share=0.0, engine=[[1, 10.0, 0.0]])
    result = simulate(Layout(split="E+PD"), p, workload("closed", 200, output=1, concurrency=4))
    assert result["req_per_s"] == pytest.approx(100.0, rel=0.03)
    assert result["utilisation"]["pd"] == pytest.approx(1.0, rel=0.03)


def test_the_frontend_and_the_orchestrator_work_in_parallel():
    # 10 ms of tritonserver's and 10 ms of the orchestrator's per request, each its own thread: a pipeline of two
    # 10 ms stages serves 100 requests/s (one thread doing both: 50)
    p = by_load(profile(), orchestrator=[[1, 10.0, 0.0]], frontend=[[1, 10.0, 0.0]])
    result = simulate(Layout(split="E+PD"), p, workload("closed", 200, output=1, concurrency=8))
    assert result["req_per_s"] == pytest.approx(100.0, rel=0.03)
    assert result["utilisation"]["frontend"] == pytest.approx(1.0, rel=0.03)


def test_background_load_takes_cores_from_the_deployment():
    # one client thread of 10 ms per request: on 2 cores 100 requests/s; with 1.5 cores busy elsewhere, at half speed
    p = by_load(profile(), cores=2, client=[[1, 10.0, 0.0]])
    closed = workload("closed", 50, output=1, concurrency=1)
    assert simulate(Layout(split="E+PD"), p, closed)["req_per_s"] == pytest.approx(100.0, rel=0.01)
    assert simulate(Layout(split="E+PD"), p.with_cores(0.5), closed)["req_per_s"] == pytest.approx(50.0, rel=0.01)


def test_the_background_takes_its_cores_window_by_window():
    env = simpy.Environment()
    cores, ends = Cores(env, 2, (1.0, [1.5, 0.0, 1.9])), {}

    def job(name, seconds, start=0.0):
        yield env.timeout(start)
        yield from cores.work(seconds)
        ends[name] = env.now

    env.process(job("a", 1.0))
    env.process(job("b", 0.25, start=2.0))
    env.run()
    # a: alone with 1.5 threads' worth of other work on 2 cores, at 2 / 2.5 = 0.8 in the first second; then at full
    # speed, its last 0.2 s; b in the third window at 2 / 2.9
    assert ends == pytest.approx({"a": 1.2, "b": 2.0 + 0.25 * 2.9 / 2})
    assert cores.busy == pytest.approx(1.25)


def test_a_busy_stub_merges_the_steps_it_has_not_sent_yet():
    # steps: the prefill 1 ms, then a token every 1.5 ms (t = 1, 2.5, 4, 5.5, 7, 8.5, 10); the stub takes 2.9 ms per
    # response: it sends token 1 at 3.9, then what it has when free: tokens 2 (6.8), 3-4 (9.7), 5-6 (12.6), 7 (15.5)
    costs = dict(prefill=(1.0, 0.0), decode=(1.5, 0.0), stub=(0.0, 2.9))
    result = simulate(Layout(split="E+PD"), profile(**costs), workload("closed", 1, output=7, concurrency=1))
    assert result["ttft_p50_ms"] == pytest.approx(3.9)
    assert result["e2e_p50_ms"] == pytest.approx(15.5)  # one response a token: 1 + 7 x 2.9 = 21.3


def two_items_at_once(doc: dict, load: float = 0.0) -> list[float]:
    """When each of two single items sent at once to an encoder of two instances (batches of one, no delay) is done,
    ms, with ``load`` requests in flight."""
    env = simpy.Environment()
    encoder = Encoder(env, Cores(env, 0), Profile(doc), instances=2, max_batch=1, delay_ms=0.0)
    encoder.load = lambda: load
    done = []

    def one():
        yield from encoder.encode(Item("image", width=100, height=100))
        done.append(env.now * 1000)
    env.process(one())
    env.process(one())
    env.run()
    return done


@pytest.mark.parametrize("shared, expected_ms", [(False, [10.0, 10.0]), (True, [20.0, 20.0])])
def test_encoder_instances_on_one_device_share_it(shared, expected_ms):
    # two instances, two single items at once (no batching delay, batches of one): apart each takes its 10 ms; on one
    # shared device (a GPU's instances, time-sliced) both go at half the speed
    doc = {**profile(encoder__image=(10.0, 0.0)).doc, "encoder_instances_share_device": shared}
    assert two_items_at_once(doc) == pytest.approx(expected_ms)


def test_only_the_device_share_of_a_batch_is_time_sliced():
    # share 0.4 of 10 ms: each instance's 6 ms of host work in parallel, then their 4 ms each on the one device at
    # half the speed while both are there: both end at 6 + 8 = 14 ms
    doc = {**profile(encoder__image=(10.0, 0.0)).doc, "encoder_device_share": 0.4}
    assert two_items_at_once(doc) == pytest.approx([14.0, 14.0])


@pytest.mark.parametrize("load, expected_ms", [(1, [10.0, 10.0]), (4, [20.0, 20.0]), (2, [15.0, 15.0])])
def test_the_device_share_is_read_at_the_requests_in_flight(load, expected_ms):
    # rows: none of the call on the device at 1 in flight, all of it at 4; 2 is between on a log scale: 0.5
    doc = {**profile(encoder__image=(10.0, 0.0)).doc, "encoder_share_by_load": [[1, 0.0], [4, 1.0]]}
    assert two_items_at_once(doc, load) == pytest.approx(expected_ms)
    assert Profile(doc).encoder_device_share == 1.0  # the planner's: at the highest load measured


@pytest.mark.parametrize("field, value, named", [
    ("encoder_device_share", 1.5, "encoder_device_share"), ("encoder_device_share", -0.1, "encoder_device_share"),
    ("encoder_device_share", "most", "encoder_device_share"),
    ("encoder_share_by_load", [[4, 0.5], [8, 2.0]], r"encoder_share_by_load\[1\]"),
    ("encoder_share_by_load", [[4]], "encoder_share_by_load")])
def test_a_device_share_outside_0_to_1_is_named(field, value, named):
    with pytest.raises(ProfileError, match=f"{named}: .* (from 0 to 1|rows)"):
        Profile({**profile().doc, field: value}).check()


def test_the_planners_encoder_demand_counts_the_instances_sharing_a_device():
    doc = profile(encoder__image=(10.0, 0.0)).doc
    load = workload("closed", 10, images=1, concurrency=1)
    apart = demands(Profile(doc), load, 32, encoder_instances=4)
    shared = demands(Profile({**doc, "encoder_instances_share_device": True}), load, 32, encoder_instances=4)
    assert apart["encoder"] == pytest.approx(0.010) and shared["encoder"] == pytest.approx(0.040)
    layout = Layout(split="E+PD", encoders=1, encoder_instances=4)
    # four instances sharing one device serve as one: 100 requests/s, not 400 (pd costs nothing here)
    assert capacity(layout, apart) == pytest.approx(400) and capacity(layout, shared) == pytest.approx(100)
    # a quarter of it on the device: four instances' quarters fill the device as their host parts fill them
    # (max(0.75, 0.25 x 4) = 1 x the line); half: the device limits at 2 x
    quarter = demands(Profile({**doc, "encoder_device_share": 0.25}), load, 32, encoder_instances=4)
    half = demands(Profile({**doc, "encoder_device_share": 0.5}), load, 32, encoder_instances=4)
    assert quarter["encoder"] == pytest.approx(0.010) and half["encoder"] == pytest.approx(0.020)


def test_the_engines_share_before_the_first_token_is_its_own_and_read_by_load():
    # the engine's 10 ms per request: the share in the prefill step (TTFT), the rest between steps after the end,
    # done while the client's next 20 ms run (so no request waits for it): TTFT = 20 + 10 x share
    for share in (0.4, 1.0):
        p = Profile({**by_load(profile(), share=1.0, client=[[1, 20.0, 0.0]], engine=[[1, 10.0, 0.0]]).doc,
                     "engine_first_token_by_load": [[1, share]]})
        result = simulate(Layout(split="E+PD"), p, workload("closed", 20, output=1, concurrency=1))
        assert result["ttft_p50_ms"] == pytest.approx(20.0 + 10.0 * share)
    rows = Profile({**profile().doc, "engine_first_token_by_load": [[2, 0.2], [8, 0.8]]})
    assert rows.engine_before_first(4) == pytest.approx(0.5) and rows.engine_before_first(1) == pytest.approx(0.2)
    assert by_load(profile(), share=0.7).engine_before_first(4) == 0.7  # not fitted: the relays' share


def test_the_engines_share_is_fitted_where_its_per_request_base_is_not_0():
    from clients.plan.phases import calibrate_engine

    p = by_load(profile(), client=[[1, 20.0, 0.0]], engine=[[1, 0.0, 1.0], [2, 10.0, 1.0]])
    doc = {**p.doc, "text_tokens": 10}
    layout = Layout(split="E+PD")
    ttft = lambda share, load: simulate(layout, Profile({**doc, "engine_first_token_by_load": [[load, share]]}),
                                        workload("closed", 24, images=1, output=16, concurrency=load))["ttft_p50_ms"]
    # "measured": what the simulator says at share 0.7 (TTFT 32.5 ms at load 2, against 25 at 0 and 38 at 1)
    measured = {str(load): {"ttft_p50_ms": ttft(0.7, load), "count": 24, "series": []} for load in (1, 2)}
    fitted = calibrate_engine(doc, layout, measured, sizes=((100, 100),))
    [(load, share)] = fitted["engine_first_token_by_load"]  # load 2 only: at 1 the base is 0
    assert load == 2.0 and share == pytest.approx(0.7, abs=0.01)
    assert ttft(share, 2) == pytest.approx(measured["2"]["ttft_p50_ms"], rel=0.02)
    assert calibrate_engine(doc, layout, {"1": measured["1"]}) is doc  # base 0 everywhere measured: nothing fitted
    # two pd replicas (a quicker client, whose queue would hide the share): 2 in flight is 1 on each (base 0, no
    # row); 4 in flight is 2 on each, its row at 2
    quick = {**doc, "by_load": {**doc["by_load"], "client": [[1, 2.0, 0.0]]}}
    on_two = {str(n): {"ttft_p50_ms": 15.0, "count": 24, "series": []} for n in (2, 4)}
    two = calibrate_engine(quick, Layout(split="E+PD", pd=2), on_two, sizes=((100, 100),))
    assert [row[0] for row in two["engine_first_token_by_load"]] == [2.0]


def test_the_engines_cpu_off_its_step_thread_runs_beside_the_step_on_the_cores():
    # 10 ms of engine CPU per token, 0.6 of it on the step's thread: one sequence's 5 tokens take 5 x 6 ms (the
    # steps), and the cores count all 50 ms; on one core the other threads' 4 ms share it with the step (2 x 4 ms at
    # half speed: each step 8 + 2 = 10 ms, every thread's CPU serial again)
    p = Profile({**by_load(profile(), engine=[[1, 0.0, 10.0]]).doc, "engine_thread_share": 0.6})
    result = simulate(Layout(split="E+PD"), p, workload("closed", 1, output=5, concurrency=1))
    assert result["e2e_p50_ms"] == pytest.approx(30.0)
    one_core = simulate(Layout(split="E+PD"), Profile({**p.doc, "cores": 1}), workload("closed", 1, output=5, concurrency=1))
    assert one_core["e2e_p50_ms"] == pytest.approx(50.0)
    assert by_load(profile()).engine_thread_share == 1.0  # not measured: all on the step's thread
