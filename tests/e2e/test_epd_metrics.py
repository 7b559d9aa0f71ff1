"""E2E: the metrics E+PD and E/P/D move in a real tritonserver (the stage counters, vLLM's own request metrics, the
latency histograms), each by the amount a known set of requests must move it."""
from __future__ import annotations

import time
import urllib.request

import pytest

from backend.triton.counter_batch import CounterBatch
from tests.e2e.conftest import metric, metrics
from tests.e2e.test_epd import CASES, _wait_for, ask

pytestmark = pytest.mark.e2e


def test_stage_metrics_move_by_the_right_amounts(server):
    """Encoder items and pool leases (refreshed once a second) and pd's pulled bytes, after one request."""
    # an item is encoded, or served from an encoder instance's cache (earlier tests sent the same images)
    items = lambda: (metric(server, "epd_encoder_items_total", model="encoder")
                     + metric(server, "epd_encoder_cache_hits_total", model="encoder"))
    released = lambda: metric(server, "epd_pool_released_total", model="encoder")
    leases = lambda: metric(server, "epd_pool_leases", model="encoder")
    moved = lambda: metric(server, "epd_transfer_bytes_total", model="pd")
    settled = None
    while settled != (items(), released()):  # let earlier tests' work reach the metrics first
        settled = (items(), released())
        time.sleep(1.5)
    open_before, moved_before = leases(), moved()
    paths = lambda: {p: metric(server, "epd_transfer_items_total", model="pd", path=p)
                     for p in ("shared_memory", "nixl", "cuda_ipc")}
    paths_before = paths()
    result = ask(server, "epd", **CASES["four_images"])
    assert _wait_for(items, lambda v: v == settled[0] + 4) == settled[0] + 4
    want = moved_before + result.timings["transfer_bytes"]  # counters come in batches (CounterBatch)
    assert _wait_for(moved, lambda v: v >= want) == want > moved_before
    # in the same flush as the bytes: the four items came through host shared memory (same host, CPU)
    assert paths() == {**paths_before, "shared_memory": paths_before["shared_memory"] + 4}
    assert _wait_for(released, lambda v: v >= settled[1] + 4) >= settled[1] + 4  # consumers read every lease
    assert _wait_for(leases, lambda v: v <= open_before) <= open_before
    assert metric(server, "epd_pool_capacity_bytes", model="encoder") > 0
    # images preprocessed on the host (image_preprocess cpu, the default): no image decoded for the GPU path
    text = urllib.request.urlopen(server.metrics_url, timeout=5).read().decode()
    assert 'epd_image_decodes_total{' in text and 'decoder="nvjpeg"' in text
    assert metric(server, "epd_image_decodes_total", model="encoder") == 0
    # each instance has series of its own (metric_labels): two instances of one model never share a metric
    assert metric(server, "epd_transfer_bytes_total", model="pd", instance="pd_0_0") == want
    for model in ("pd", "epd"):
        assert metric(server, "epd_requests_total", model=model, instance=f"{model}_0_0", outcome="ok") >= 1


VLLM_COUNTERS = ("prompt_tokens_total", "generation_tokens_total") + tuple(
    f"{name}_{part}_total" for name in ("time_to_first_token", "time_per_output_token", "queue_time", "prefill_time",
                                        "decode_time") for part in ("seconds", "count"))


KV_COUNTERS = ("epd_vllm_kv_transfers_total", "epd_vllm_kv_transfer_bytes_total", "epd_vllm_kv_failed_transfers_total",
               "epd_vllm_kv_connector_hit_tokens_total")


def _vllm_counters(server, model: str) -> dict[str, float]:
    """One scrape: read one by one, the last counter (what ``_moved`` waits on) could move after the first was read."""
    values = metrics(server, [f"epd_vllm_{name}" for name in VLLM_COUNTERS], model=model)
    return {name: values[f"epd_vllm_{name}"] for name in VLLM_COUNTERS}


def _moved(server, model: str, before: dict, want_requests: int) -> dict[str, float]:
    """The counters' change, once the engine's stat logger has seen ``want_requests`` more requests finish, read
    again two flushes later: a flush hands its observations to Triton one call each, so a scrape during it can see
    a request's decode time without its first-token time (seen once in CI: TTFT count 1 of 2)."""
    _wait_for(lambda: _vllm_counters(server, model),
              lambda c: c["decode_time_count_total"] >= before["decode_time_count_total"] + want_requests)
    time.sleep(2 * CounterBatch.FLUSH_SECONDS)
    after = _vllm_counters(server, model)
    return {name: after[name] - before[name] for name in VLLM_COUNTERS}


def test_vllm_request_metrics_move_by_the_right_amounts(server):
    """vLLM's own metrics of llm, pd, prefill and decode after known requests: token counters move by the
    counts the clients got back, one TTFT / queue / prefill / decode sample per request, one time-per-output-
    token sample per token after the first; and the times are positive and within what the client saw."""
    models = ("llm", "pd", "prefill", "decode")
    time.sleep(2 * CounterBatch.FLUSH_SECONDS)  # earlier tests' figures are in (vLLM records them after the answer)
    before = {model: _vllm_counters(server, model) for model in models}
    kv_before = {model: metrics(server, KV_COUNTERS, model=model) for model in models}
    long = CASES["longer_output"]  # 40 tokens, ignore_eos
    llm_a, llm_b = ask(server, "llm", **long), ask(server, "llm", **CASES["two_images"])
    via_pd = ask(server, "epd", **CASES["four_images"])
    via_pd_decode = ask(server, "epd_disagg", **long)
    moved = {model: _moved(server, model, before[model], 2 if model == "llm" else 1) for model in models}

    llm = moved["llm"]
    assert llm["prompt_tokens_total"] == llm_a.num_input_tokens + llm_b.num_input_tokens
    assert llm["generation_tokens_total"] == llm_a.num_output_tokens + llm_b.num_output_tokens
    assert llm["time_per_output_token_count_total"] == llm_a.num_output_tokens + llm_b.num_output_tokens - 2
    assert llm["time_to_first_token_count_total"] == llm["queue_time_count_total"] == 2
    assert 0 < llm["time_to_first_token_seconds_total"] < llm_a.total + llm_b.total
    assert 0 < llm["time_per_output_token_seconds_total"] and 0 <= llm["queue_time_seconds_total"]
    assert 0 < llm["prefill_time_seconds_total"] and 0 < llm["decode_time_seconds_total"]

    for model, result in (("pd", via_pd), ("decode", via_pd_decode)):
        got = moved[model]
        assert got["prompt_tokens_total"] == result.num_input_tokens, model
        assert got["generation_tokens_total"] == result.num_output_tokens, model
        assert got["time_per_output_token_count_total"] == result.num_output_tokens - 1, model
        assert got["time_to_first_token_count_total"] == 1 and 0 < got["time_to_first_token_seconds_total"] < result.total
    prefill = moved["prefill"]  # prefill runs each request for one token
    assert prefill["prompt_tokens_total"] == via_pd_decode.num_input_tokens
    assert prefill["generation_tokens_total"] == 1 and prefill["time_per_output_token_count_total"] == 0

    # the KV connector's transfers: decode read the one E/P/D request's KV from prefill over NIXL; nobody else read any
    kv = {model: {name: value - kv_before[model][name] for name, value in metrics(server, KV_COUNTERS, model=model).items()}
          for model in models}
    transfers, nbytes, failed, hits = KV_COUNTERS
    assert kv["decode"][transfers] >= 1 and kv["decode"][nbytes] > 0 and kv["decode"][failed] == 0, kv
    assert all(kv[model][transfers] == kv[model][nbytes] == 0 for model in ("llm", "pd", "prefill")), kv
    # decode's prompt came from prefill over NIXL: what decode's own prefix cache did not cover (an earlier test may
    # have sent this prompt), within the prompt (23 of 23 tokens on a cold decode, checked)
    assert 0 < kv["decode"][hits] <= via_pd_decode.num_input_tokens, kv
    assert all(kv[model][hits] == 0 for model in ("llm", "pd", "prefill")), kv  # no conversation's KV kept here


HISTOGRAMS = ("epd_request_ttft_seconds", "epd_request_duration_seconds", "epd_encode_duration_seconds",
              "epd_transfer_duration_seconds", "epd_vllm_queue_duration_seconds")


def _histograms(server) -> dict[tuple[str, str, str], float]:
    """(series, model, le) -> value over every model's instances, ``le`` empty for _sum and _count: one scrape."""
    text = urllib.request.urlopen(server.metrics_url, timeout=5).read().decode()
    out: dict[tuple[str, str, str], float] = {}
    for line in text.splitlines():
        name = line.split("{", 1)[0]
        if not name.startswith(HISTOGRAMS):
            continue
        labels = dict(part.split("=", 1) for part in line.split("{", 1)[1].rsplit("}", 1)[0].split(","))
        key = (name, labels["model"].strip('"'), labels.get("le", "").strip('"'))
        out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def test_latency_histograms_as_clients_see_them(server):
    """Prometheus histograms (Triton 2.51's Python-backend HISTOGRAM kind): one TTFT and one end-to-end sample per
    request at llm, epd and epd_disagg, within what the client measured; encode and transfer samples equal to the
    request's own timings; vLLM's queue time as the summary counter has it; cumulative buckets up to +Inf."""
    time.sleep(2 * CounterBatch.FLUSH_SECONDS)
    before = _histograms(server)
    vllm_before = metrics(server, ["epd_vllm_queue_time_seconds_total"], model="llm")["epd_vllm_queue_time_seconds_total"]
    results = {model: ask(server, model, **CASES["one_image_landscape"]) for model in ("llm", "epd", "epd_disagg")}
    moved = lambda h: {k: v - before.get(k, 0.0) for k, v in h.items()}
    delta = moved(_wait_for(lambda: _histograms(server), lambda h: all(
        moved(h).get(("epd_request_duration_seconds_count", m, ""), 0) >= 1 for m in results)
        and moved(h).get(("epd_vllm_queue_duration_seconds_count", "llm", ""), 0) >= 1))
    for model, result in results.items():
        for name, bound in (("epd_request_ttft_seconds", result.ttft), ("epd_request_duration_seconds", result.total)):
            assert delta[(f"{name}_count", model, "")] == 1, (name, model)
            assert 0 < delta[(f"{name}_sum", model, "")] <= bound, (name, model, bound)
            assert delta[(f"{name}_bucket", model, "+Inf")] == 1
            buckets = sorted((float(le), value) for (series, m, le), value in delta.items()
                             if series == f"{name}_bucket" and m == model and le != "+Inf")
            assert [v for _, v in buckets] == sorted(v for _, v in buckets) and buckets[-1][1] == 1  # cumulative
            first = next(le for le, value in buckets if value == 1)
            assert delta[(f"{name}_sum", model, "")] <= first  # the sample is in the first bucket that counts it
    for model in ("epd", "epd_disagg"):
        timings = results[model].timings
        assert delta[("epd_encode_duration_seconds_count", model, "")] == 1
        assert abs(delta[("epd_encode_duration_seconds_sum", model, "")] - timings["encode_ms"] / 1000) < 1e-6
        assert abs(delta[("epd_transfer_duration_seconds_sum", model, "")] - timings["transfer_ms"] / 1000) < 1e-6
    assert delta[("epd_transfer_duration_seconds_count", "pd", "")] == 1  # pd pulled epd's item
    assert delta.get(("epd_encode_duration_seconds_count", "llm", ""), 0) == 0  # llm has no encoder stage
    vllm_moved = metrics(server, ["epd_vllm_queue_time_seconds_total"], model="llm")["epd_vllm_queue_time_seconds_total"] - vllm_before
    assert delta[("epd_vllm_queue_duration_seconds_count", "llm", "")] == 1
    assert abs(delta[("epd_vllm_queue_duration_seconds_sum", "llm", "")] - vllm_moved) < 1e-6


