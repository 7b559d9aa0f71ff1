"""CPU by load (clients.plan.loads) on cases computed by hand: per request and per token from two answer lengths,
the rows' scope (a replica's stub and engine), the decode step by batch, and a phase's CPU read at a fine clock."""
import time

import pytest

from clients.plan import loads
from clients.plan.deployments import Served


def cpu(per_request: float, per_token: float) -> dict:
    """Phases at both lengths: the stub's CPU by tokens, the client's by responses (half the tokens)."""
    return {tokens: {"cpu": {"stub pd": per_request + tokens * per_token, "load generator": 2 * per_request + tokens},
                     "responses": tokens / 2} for tokens in (loads.SHORT, loads.LONG)}


def test_two_answer_lengths_give_the_cost_per_request_and_per_token():
    assert loads.split(4 + 16 * 1.0, 4 + 80 * 1.0) == pytest.approx((4.0, 1.0))
    assert loads.split(20.0, 10.0) == pytest.approx((20.0, 0.0))  # fewer for more tokens: noise, no negative cost
    assert loads.split(5.0, 7.0, (1.0, 1.0)) == pytest.approx((5.0, 0.0))  # as many units: no cost per unit


def test_rows_of_a_replicas_processes_are_by_its_share_of_the_load():
    rows = loads.rows({1: cpu(10.0, 0.5), 8: cpu(4.0, 0.25)}, replicas=2)
    assert rows["stub"] == [[0.5, 10.0, 1.0], [4.0, 4.0, 0.5]]  # per response: two tokens' cost
    assert rows["client"] == [[1, 20.0, 2.0], [8, 8.0, 2.0]]  # per response
    assert rows["engine"] == [[0.5, 0.0, 0.0], [4.0, 0.0, 0.0]]


def test_the_decode_step_by_batch_is_fitted_through_the_engines_rows():
    # a step of 0.5 ms + 0.5 ms per sequence: per token 1.0 at batch 1, 0.75 at 2, 0.5625 at 8
    line = loads.decode_line([[1, 9.0, 1.0], [2, 9.0, 0.75], [8, 9.0, 0.5625]])
    assert (line.base, line.slope) == pytest.approx((0.5, 0.5))


def test_a_phase_reads_cpu_per_request_of_a_fraction_of_a_tick():
    def run(requests, concurrency):  # 3 ms of this process's CPU per request: the load generator's
        started = time.perf_counter()
        for _ in requests:
            end = time.thread_time() + 0.003  # this thread's: the background sampler's thread spends more
            while time.thread_time() < end:
                pass
        return [], [], time.perf_counter() - started

    got = loads.phase(Served("fake", run, lambda: []), list(range(20)), 1)
    # 3 ms and what else this process spends meanwhile: a 10 ms tick would read 0 or 10
    assert 2.9 <= got["cpu"]["load generator"] <= 4.5
    assert got["background"] >= 0.0


def test_a_phase_s_speed_probes_are_not_charged_to_the_requests(monkeypatch):
    def burn(runs=1):  # a probe of 20 ms of CPU (the real one: ~3 ms), every 0.5 s of the phase
        end = time.thread_time() + 0.02
        while time.thread_time() < end:
            pass
        return 20.0

    def run(requests, concurrency):  # the requests themselves cost this process nothing
        started = time.perf_counter()
        time.sleep(0.12 * len(requests))
        return [], [], time.perf_counter() - started

    monkeypatch.setattr(loads.speed, "probe", burn)
    got = loads.phase(Served("fake", run, lambda: []), list(range(10)), 1)
    assert got["speed_ms"] == 20.0
    # ~3 probes of 20 ms over 10 requests would read ~6 ms a request; the sampler's own /proc reads stay
    assert got["cpu"].get("load generator", 0.0) < 2.5


def test_the_engines_step_thread_share_is_the_light_time_per_token_over_its_cpu_per_token():
    from clients.plan.loads import thread_share

    rows = [[2, 10.0, 2.0], [1, 0.0, 3.5]]  # at load 1: 3.5 ms of CPU per token, on every thread of the engine
    assert thread_share(rows, 2.8) == 0.8  # a token every 2.8 ms: 0.8 of it on the step's thread
    assert thread_share(rows, 4.0) == 1.0  # slower than its CPU (waits for the cores): all on the step's thread
    assert thread_share([[1, 0.0, 0.0]], 2.8) == 1.0 and thread_share(rows, 0.0) == 1.0  # nothing to read: 1


def test_a_profile_at_a_slower_speed_scales_its_cpu_costs_and_keeps_counts_and_the_hop():
    from clients.plan.profile import Profile

    doc = {"name": "p", "cores": 2, "encoder": {"batch": {"base": 2.0}, "image": {"base": 1.0, "slope": 0.5}},
           "tokens": {"image": {"base": 4.0, "slope": 0.25}}, "prefill": {"base": 10.0}, "decode": {"base": 2.0, "slope": 0.2},
           "transfer": {"shared_memory": {"base": 0.5, "slope": 8.0}}, "hop": {"base": 3.0},
           "by_load": {"engine": [[1, 5.0, 2.0], [8, 4.0, 0.5]]}, "send_interval_by_load": [[1, 2.0], [8, 4.0]]}
    slow = Profile(doc).at_speed(1.5)
    assert slow.line("encoder.image").as_dict() == {"base": 1.5, "slope": 0.75}
    assert slow.line("encoder.batch").base == 3.0 and slow.line("prefill").base == 15.0
    assert slow.line("decode").slope == pytest.approx(0.3) and slow.line("transfer.shared_memory").slope == 12.0
    assert slow.doc["by_load"]["engine"] == [[1, 7.5, 3.0], [8, 6.0, 0.75]]
    assert slow.send_interval(8) == 6.0 and slow.doc["speed_factor"] == 1.5
    assert slow.line("tokens.image").as_dict() == {"base": 4.0, "slope": 0.25} and slow.hop_ms() == 3.0
    assert Profile(doc).doc["by_load"]["engine"][0] == [1, 5.0, 2.0]          # the original untouched
    gpu = Profile({**doc, "cores": 0})
    assert gpu.at_speed(1.5) is gpu                                          # device times: not the host's speed


def test_the_speed_probe_times_its_work_and_the_background_sampler_probes_while_it_runs():
    import time

    from clients.bench import speed
    from clients.plan.loads import PROBE_EVERY, WINDOW, Background

    assert speed.probe(3) > 0 and speed.factor(3.0, 2.0) == 1.5 and speed.factor(3.0, None) == 1.0
    sampler = Background([])
    sampler.start()
    time.sleep(WINDOW * PROBE_EVERY * 2 + 0.25)
    sampler.stop()
    assert len(sampler.probes) >= 2 and sampler.speed_ms() > 0
    with speed.Sampler(every=0.1) as cores:     # a benchmark's level (the overload bench's cores_probe_ms)
        time.sleep(0.35)
    assert len(cores.probes) >= 3 and cores.median_ms() > 0 and not cores.is_alive()
