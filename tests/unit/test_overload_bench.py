"""The overload benchmark's bookkeeping (clients.bench.overload_load, overload_table): a request's fate, the summary
per class, the checks against the issue's targets, and the rendering of the topology with epd_open beside epd."""
from pathlib import Path

from backend.deploy.topology import load
import pytest

from clients.bench.overload import _model_of, _order, deployments, limits_of, parse_variant, render_both
from clients.bench.overload_load import Fate, summary
from clients.bench.overload_table import checks, plot, tables
from clients.bench.report import percentile

ROOT = Path(__file__).resolve().parents[2]


def test_each_fate_has_one_outcome():
    assert [Fate("low", 200, complete=True).outcome, Fate("low", 200).outcome, Fate("low", 429).outcome,
            Fate("low", 503).outcome, Fate("low", None, error="hung").outcome, Fate("low", None, error="reset").outcome,
            Fate("low", 500).outcome] == ["served", "broken", "shed", "expired", "hung", "lost", "error"]


def test_the_summary_counts_goodput_within_the_slo_and_how_fast_sheds_were_answered():
    fates = [Fate("high", 200, 0.1, 1.0, complete=True), Fate("low", 200, 0.6, 2.0, complete=True),
             Fate("low", 429, answered=0.02, retry_after="1"), Fate("low", 429, answered=0.04)]
    every = summary(fates, seconds=2.0, slo=0.5)
    assert (every["sent"], every["served"], every["shed"], every["goodput"]) == (4, 2, 2, 0.5)
    assert every["shed_answer_max_ms"] == 40.0 and every["shed_without_retry_after"] == 1
    assert summary(fates, 2.0, 0.5, "high")["served"] == 1 and summary(fates, 2.0, 0.5, "low")["shed_rate"] == 2 / 3
    fates[1].at, fates[1].late, fates[1].stages = 1.5, 0.03, {"queued_ms": 80.0, "encode_ms": 90.0, "total_ms": 1.0}
    assert summary(fates, 2.0, 0.5, "low")["slowest"] == [{"at_s": 1.5, "ttft_ms": 600.0, "late_ms": 30.0,
                                                           "queued_ms": 80.0, "encode_ms": 90.0, "first_chunk_ms": None}]
    assert summary(fates, 2.0, 0.5)["client_late_p99_ms"] == 29.1  # lateness 0, 0.03, 0, 0: rank 2.97
    fates[3].at, fates[3].late = 1.9, 0.01
    fates[3].client_lag = 0.03
    assert summary(fates, 2.0, 0.5)["slowest_shed"] == [
        {"at_s": 1.9, "answered_ms": 40.0, "late_ms": 10.0, "client_loop_ms": 30.0},
        {"at_s": 0.0, "answered_ms": 20.0, "late_ms": 0.0, "client_loop_ms": 0.0}]


def _run(model, load, goodput, high_p99, shed_max=20.0):
    part = {"goodput": goodput, "ttft_p50_ms": 10.0, "ttft_p99_ms": high_p99, "shed": 1 if shed_max else 0,
            "shed_rate": 0.1, "shed_answer_p99_ms": shed_max, "shed_answer_max_ms": shed_max, "served": 9, "sent": 10,
            "expired": 0, "lost": 0, "hung": 0, "broken": 0, "shed_without_retry_after": 0}
    return {"model": model, "load": load, "rate": load * 10, "rss_mib": 100, "all": part, "high": part, "low": part}


def test_the_checks_read_the_targets_from_the_runs(tmp_path):
    results = {"slo_ms": 500, "light_ttft_p50_ms": 20.0, "capacity_rps": 10.0, "seconds": 10, "high_share": 0.2,
               "runs": [_run("epd", 0.5, 5.0, 100.0), _run("epd", 2.0, 9.5, 140.0, 30.0), _run("epd_open", 1.0, 10.0, 90.0),
                        _run("epd_open", 2.0, 1.0, 900.0), _run("epd_open", 0.5, 5.0, 80.0)]}
    text = checks(results)
    assert "- epd: goodput at 2x / the peak = 0.95" in text and "at 0.5x = 1.40" in text
    assert "slowest shed answer at 2x 30.0 ms" in text and "- epd_open: goodput at 2x / the peak = 0.10" in text
    assert tables(results).count("\n| epd") == 15  # 5 runs x (high, low, all)
    assert "first-token target off (fixed budgets)" in tables(results)
    results["first_token_target_ms"] = 150
    results["runs"][1]["limits"] = {"pd": 7.0}
    assert "first-token target 150 ms" in tables(results) and "| 100 | pd 7 |" in tables(results)
    results["runs"][1]["cores_probe_ms"] = 3.104                      # the level's cores speed probe
    assert "x (" in tables(results) and ", cores probe 3.10 ms |" in tables(results)
    plot(results, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").stat().st_size > 1000
    results["variant"] = {"high_priority_burst_percent": 100}             # a third deployment, epd_b
    results["runs"] += [_run("epd_b", 0.5, 5.0, 100.0), _run("epd_b", 2.0, 8.0, 120.0, 25.0)]
    text = checks(results)
    assert "epd_b (high_priority_burst_percent 100) and epd_open beside them" in text
    assert "- epd_b: goodput at 2x / the peak = 0.80" in text and text.index("- epd:") < text.index("- epd_b:")
    assert "; epd_b: epd with high_priority_burst_percent 100" in tables(results)
    plot(results, tmp_path / "plot.png")


def test_repeats_of_a_level_are_pooled_and_the_memory_read_before_during_and_after_the_load(tmp_path):
    """Two repeats: the high class's p99 at each load is over both repeats' requests (one slow light-load request no
    longer decides the ratio alone), goodput is the repeats' mean, and each repeat's own ratio is listed."""
    def run(load, repeat, goodput, high_ttfts, rss):
        row = _run("epd", load, goodput, max(high_ttfts))
        row["high"] = {**row["high"], "ttfts_ms": high_ttfts, "ttft_p99_ms": percentile(high_ttfts, 99),
                       "slowest": [{"at_s": 1.5 + repeat, "ttft_ms": max(high_ttfts), "late_ms": 2.0,
                                    "queued_ms": 0.5, "encode_ms": 9.0, "first_chunk_ms": None}]}
        row["all"] = {**row["all"], "client_late_p99_ms": 3.0 + repeat,
                      "slowest_shed": [{"at_s": 2.0, "answered_ms": 60.0 + repeat, "late_ms": 30.0}] if repeat else []}
        return {**row, "repeat": repeat, "rss_before_mib": rss[0], "rss_mib": rss[1]}
    light = [20.0] * 99
    results = {"slo_ms": 500, "light_ttft_p50_ms": 20.0, "capacity_rps": 10.0, "seconds": 10, "high_share": 0.2,
               "repeats": 2, "rss_start_mib": 2000, "rss_after_load_mib": 2010, "settle_seconds": 20,
               "runs": [run(0.5, 0, 5.0, light + [200.0], (2000, 2001)), run(2.0, 0, 9.0, [40.0] * 100, (2001, 2050)),
                        run(0.5, 1, 5.0, light + [30.0], (2050, 2040)), run(2.0, 1, 10.0, [50.0] * 100, (2040, 2060))]}
    text = checks(results)
    # pooled: 200 light-load requests, the 200 ms one beyond the p99 (rank 197.01 of 0-199: 20.1 ms)
    assert f"at 0.5x = {50.0 / percentile(light * 2 + [200.0, 30.0], 99):.2f}" in text
    assert f"each repeat: {40.0 / percentile(light + [200.0], 99):.2f}, {50.0 / percentile(light + [30.0], 99):.2f}" in text
    assert "goodput at 2x / the peak = 0.95" in text  # mean 9.5 of the capacity, 10 (the best level's mean: 9.5)
    assert "+49, +20 MiB over each 2x level" in text
    assert ("slowest high-class requests at 2x (arrival s: TTFT ms, client's lateness ms, the server's queued / "
            "encoded / first chunk ms): #1 1.5: 40, 2, 0.5 / 9 / -; #2 2.5: 50, 2, 0.5 / 9 / -; "
            "the client's lateness p99 at 2x 3, 4 ms") in text
    assert "slowest refusals at 2x (arrival s: answered ms, client's lateness ms): #2 2: 61, 30\n" in text
    assert "2000 MiB before the load, 2010 MiB 20 s after it" in text
    results["rss_by_process_mib"] = {"start": {"tritonserver": 100, "stub epd": 90},
                                     "after_load": {"tritonserver": 101, "stub epd": 99, "EngineCore of pd": 5}}
    assert "(by process: stub epd +9, EngineCore of pd +5, tritonserver +1)" in checks(results)
    table = tables(results)
    assert "| 0.5x (5/s) #2 |" in table and "| 2001 -> 2050 |" in table
    plot(results, tmp_path / "plot.png")


def test_epd_open_is_epd_without_budgets_over_the_same_stages(tmp_path):
    render_both(load(ROOT / "topologies" / "cpu-overload.yaml", "cpu"), tmp_path, max_queue_ms=300)
    with_budgets = (tmp_path / "epd" / "config.pbtxt").read_text()
    without = (tmp_path / "epd_open" / "config.pbtxt").read_text()
    assert 'key: "generator_requests_in_flight" value: { string_value: "16" }' in with_budgets
    assert 'key: "max_queue_ms" value: { string_value: "300" }' in with_budgets
    assert 'name: "epd_open"' in without and "in_flight" not in without and "max_queue_ms" not in without
    assert sorted(p.name for p in tmp_path.iterdir()) == ["encoder", "epd", "epd_open", "pd"]


def test_the_e_p_d_run_puts_its_open_orchestrator_beside_it_over_one_prefill_and_decode(tmp_path):
    render_both(load(ROOT / "topologies" / "cpu-overload.yaml", "cpu"), tmp_path, split="E/P/D")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["decode", "encoder", "epd", "epd_open", "prefill"]
    with_budgets, without = ((tmp_path / m / "config.pbtxt").read_text() for m in ("epd", "epd_open"))
    assert 'key: "topology" value: { string_value: "E/P/D" }' in with_budgets and 'name: "epd_open"' in without
    assert 'key: "generator_requests_in_flight"' in with_budgets and "in_flight" not in without


def test_with_the_endpoint_in_process_each_orchestrator_serves_openai_on_a_port_of_its_own(tmp_path):
    render_both(load(ROOT / "topologies" / "cpu-overload.yaml", "cpu"), tmp_path, openai_ports={"epd": 7001, "epd_open": 7002})
    for model, port in (("epd", 7001), ("epd_open", 7002)):
        assert f'key: "openai_port" value: {{ string_value: "{port}" }}' in (tmp_path / model / "config.pbtxt").read_text()
    assert "openai_port" not in (tmp_path / "pd" / "config.pbtxt").read_text()


def test_a_variant_is_epd_with_other_admission_settings_beside_it_on_a_port_of_its_own(tmp_path):
    variant = parse_variant("high_priority_reserve_percent=50, max_queue_ms=120")
    assert variant == {"high_priority_reserve_percent": 50, "max_queue_ms": 120}
    render_both(load(ROOT / "topologies" / "cpu-overload.yaml", "cpu"), tmp_path, max_queue_ms=300,
                openai_ports={"epd": 7001, "epd_open": 7002, "epd_b": 7003}, variant=variant)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["encoder", "epd", "epd_b", "epd_open", "pd"]
    epd, other = ((tmp_path / m / "config.pbtxt").read_text() for m in ("epd", "epd_b"))
    assert 'name: "epd_b"' in other and 'key: "openai_port" value: { string_value: "7003" }' in other
    for text, reserve, queue in ((epd, "25", "300"), (other, "50", "120")):
        assert 'key: "generator_requests_in_flight" value: { string_value: "16" }' in text
        assert f'key: "max_queue_ms" value: {{ string_value: "{queue}" }}' in text
        assert f'key: "high_priority_reserve_percent" value: {{ string_value: "{reserve}" }}' in text
    # each level runs the open deployment first, then epd and epd_b, the two taking turns at going first
    models = deployments(variant)
    assert (_order(models, 0), _order(models, 1)) == (["epd_open", "epd", "epd_b"], ["epd_open", "epd_b", "epd"])
    assert deployments(None) == {"epd_open": False, "epd": True}


@pytest.mark.parametrize("text, named", [("burst", "expected KEY=VALUE"), ("", "no KEY=VALUE"),
                                         ("high_priority_burst_percent=500", "high_priority_burst_percent"),
                                         ("reserve=25", "unknown key(s) reserve"),
                                         ("priority_levels=2.5", "priority_levels")])
def test_a_bad_variant_is_refused_naming_what_is_wrong(text, named):
    with pytest.raises(ValueError, match=named.replace("(", r"\(").replace(")", r"\)")):
        parse_variant(text)


def test_the_gates_limits_are_read_from_the_metrics_by_model_and_stage():
    text = ('# HELP epd_admission_limit ...\n'
            'epd_admission_limit{instance="epd_0",model="epd",stage="pd"} 7\n'
            'epd_admission_limit{instance="epd_0",model="epd",stage="decode"} 12\n'
            'epd_admission_limit{instance="o_0",model="epd_open",stage="pd"} 3\n'
            'epd_admission_total{model="epd",stage="pd"} 5\n')
    assert limits_of(text, "epd") == {"pd": 7.0, "decode": 12.0}
    assert limits_of(text, "epd_disagg") == {}


def test_the_loop_lag_buckets_are_read_from_the_same_scrape_by_model():
    from clients.bench.overload import loop_lag_buckets
    text = ('epd_loop_lag_seconds_bucket{model="epd",le="0.05"} 520\n'
            'epd_loop_lag_seconds_bucket{model="epd",le="+Inf"} 531\n'
            'epd_loop_lag_seconds_bucket{model="epd_open",le="0.05"} 9\n'
            'epd_admission_limit{instance="epd_0",model="epd",stage="pd"} 7\n')
    assert loop_lag_buckets(text, "epd") == {0.05: 520.0, float("inf"): 531.0}
    assert loop_lag_buckets(text, "epd_disagg") == {}


def test_a_stub_is_named_by_its_model():
    assert _model_of(["/x/triton_python_backend_stub", "/tmp/overload-1/epd_open/1/model.py", "shm"]) == "epd_open"
    assert _model_of(["python"]) == "?"


def test_a_level_s_loop_lag_is_read_from_the_histogram_s_buckets_before_and_after():
    import math

    from clients.bench.overload import loop_lag

    before = {0.025: 100.0, 0.05: 110.0, 0.1: 112.0, 0.25: 112.0, math.inf: 112.0}
    after = {0.025: 600.0, 0.05: 630.0, 0.1: 640.0, 0.25: 643.0, math.inf: 643.0}  # 531 wake-ups, 3 at 100-250 ms
    assert loop_lag(before, after) == {"wakeups": 531, "late": 11, "late_over_ms": 50, "worst_within_ms": 250.0}
    assert loop_lag({}, {}) == {}
    results = {"slo_ms": 500, "light_ttft_p50_ms": 20.0, "capacity_rps": 10.0, "seconds": 10, "high_share": 0.2,
               "runs": [_run("epd", 0.5, 5.0, 100.0), {**_run("epd", 2.0, 9.5, 140.0), "loop_lag": loop_lag(before, after)}]}
    assert ("epd's event loop at 2x, woke more than 50 ms late (of its wake-ups every 50 ms): 11 of 531 (the latest "
            "within 250 ms)") in checks(results)


def test_a_refusal_is_told_the_client_loop_s_latest_wake_up_while_it_was_out():
    from clients.bench.overload_load import client_lags

    slow, quick, hung = Fate("low", 429, answered=0.2), Fate("low", 429, answered=0.01), Fate("low", None)
    slow.sent_at, quick.sent_at = 10.0, 11.0
    lags = [(9.9, 0.5), (10.05, 0.01), (10.19, 0.15), (10.3, 0.02), (11.2, 0.3)]  # (perf time woke, seconds late)
    client_lags([slow, quick, hung], lags)
    assert (slow.client_lag, quick.client_lag, hung.client_lag) == (0.15, 0.0, 0.0)  # 10.3 still overlapped it: 0.02
    results = {"slo_ms": 500, "light_ttft_p50_ms": 20.0, "capacity_rps": 10.0, "seconds": 10, "high_share": 0.2,
               "runs": [_run("epd", 0.5, 5.0, 100.0), _run("epd", 2.0, 9.5, 140.0, 30.0)]}
    results["runs"][1]["all"] = {**results["runs"][1]["all"], "slowest_shed": [
        {"at_s": 3.2, "answered_ms": 200.0, "late_ms": 0.5, "client_loop_ms": 150.0}]}
    assert "the client's loop's latest wake-up while it was out ms): #1 3.2: 200, 0.5, 150" in checks(results)
