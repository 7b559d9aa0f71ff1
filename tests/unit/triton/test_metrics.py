"""``backend.triton.metrics`` over the fake pb_utils: which families each model registers (kind, labels, buckets), and
what reaches Triton's metrics once the ``CounterBatch`` is flushed."""
from types import SimpleNamespace

import pytest

from backend.engine.serving import Outcome, ResponseChunk
from backend.engine.stats import StatsDelta
from backend.triton.io import TritonSink
from backend.triton.metrics import LATENCY_BUCKETS, EncoderMetrics, EngineMetrics, RequestMetrics
from tests.unit.triton.inputs import generate_request

LABELS = {"model": "pd", "instance": "pd_0"}


@pytest.fixture
def request_metrics():
    metrics = RequestMetrics("pd", instance="pd_0")
    yield metrics
    metrics.close()


def test_request_metrics_register_their_families(pb, request_metrics):
    assert pb.families["epd_requests_total"] == pb.MetricFamily.COUNTER
    assert pb.families["epd_held_bytes"] == pb.MetricFamily.GAUGE
    assert pb.families["epd_request_ttft_seconds"] == pb.MetricFamily.HISTOGRAM
    assert pb.series("epd_request_ttft_seconds", **LABELS).buckets == LATENCY_BUCKETS
    assert sorted(labels["outcome"] for labels in pb.labelled("epd_requests_total")) == [
        "cancelled", "deadline", "error", "ok", "shed"]


def test_an_instance_label_only_where_given(pb):
    metrics = RequestMetrics("llm")
    metrics.close()
    assert pb.labelled("epd_generated_tokens_total") == [{"model": "llm"}]


def test_finished_requests_are_counted_by_outcome(pb, request_metrics):
    request_metrics.request_finished(Outcome.OK, 5)
    request_metrics.request_finished(Outcome.OK, 2)
    request_metrics.request_finished(Outcome.CANCELLED, 1)
    request_metrics.close()
    assert pb.series("epd_requests_total", **LABELS, outcome="ok").value == 2
    assert pb.series("epd_requests_total", **LABELS, outcome="cancelled").value == 1
    assert pb.series("epd_requests_total", **LABELS, outcome="error").value == 0
    assert pb.series("epd_generated_tokens_total", **LABELS).value == 8


def test_running_totals_are_added_once(pb, request_metrics):
    request_metrics.media_decodes(3)
    request_metrics.media_decodes(3)  # the process's counter, unchanged: nothing new
    request_metrics.media_decodes(4)
    request_metrics.transferred(100, 0.5, {"cuda_ipc": 2})
    request_metrics.transferred(50, 0.25, {"cuda_ipc": 3, "no such path": 9})
    request_metrics.close()
    assert pb.series("epd_media_decodes_total", **LABELS).value == 4
    assert pb.series("epd_transfer_bytes_total", **LABELS).value == 150
    assert pb.series("epd_transfer_seconds_total", **LABELS).value == 0.75
    assert pb.series("epd_transfer_items_total", **LABELS, path="cuda_ipc").value == 3


def test_final_response_timings_are_observed(pb, request_metrics):
    request_metrics.final_response(0.3, {"items": 2, "encode_ms": 40.0, "transfer_bytes": 10, "transfer_ms": 5.0,
                                         "held": 1})
    request_metrics.final_response(0.1, None)
    request_metrics.held(1, 4096)
    request_metrics.close()
    assert pb.series("epd_request_duration_seconds", **LABELS).observations == [0.3, 0.1]
    assert pb.series("epd_encode_duration_seconds", **LABELS).observations == [0.04]
    assert pb.series("epd_transfer_duration_seconds", **LABELS).observations == [0.005]
    assert pb.series("epd_demand_skipped_total", **LABELS).value == 1
    assert pb.series("epd_held_bytes", **LABELS).value == 4096


def test_admission_counts_and_the_gates_limit_reach_triton(pb, request_metrics):
    request_metrics.admitted("pd", 0, 0.02)
    request_metrics.shed("pd", 1, "budget")
    request_metrics.limited("pd", 12)
    request_metrics.limited("pd", 9)  # a gauge: the last
    request_metrics.close()
    assert pb.series("epd_admission_total", **LABELS, stage="pd", priority="0", outcome="admitted").value == 1
    assert pb.series("epd_admission_total", **LABELS, stage="pd", priority="1", outcome="shed_budget").value == 1
    assert pb.series("epd_admission_wait_seconds", **LABELS, stage="pd", priority="0").observations == [0.02]
    assert pb.families["epd_admission_limit"] == pb.MetricFamily.GAUGE
    assert pb.series("epd_admission_limit", **LABELS, stage="pd").value == 9


def test_the_sink_times_first_text_and_final_response(pb, request_metrics):
    sink = TritonSink(generate_request().get_response_sender(), timer=request_metrics)
    sink.send(ResponseChunk(""), final=False)  # no text yet: not the first text
    sink.send(ResponseChunk("a"), final=False)
    sink.send(ResponseChunk("b", "stop"), final=True)
    request_metrics.close()
    assert len(pb.series("epd_request_ttft_seconds", **LABELS).observations) == 1
    assert len(pb.series("epd_request_duration_seconds", **LABELS).observations) == 1


def pool(used=0, leases=0, released=0):
    return SimpleNamespace(open_leases=leases, used_bytes=used, capacity_bytes=1 << 20, released_total=released,
                           expired_total=0)


def test_encoder_metrics_copy_counters_as_increments_and_gauges_as_values(pb):
    metrics = EncoderMetrics("encoder", "encoder_0")
    labels = {"model": "encoder", "instance": "encoder_0"}
    metrics.refresh(3, 0.5, pool(used=100, leases=2), video_decodes={"cpu": 1})
    metrics.refresh(5, 0.75, pool(used=40, leases=1, released=1), video_decodes={"cpu": 1})
    assert pb.series("epd_encoder_items_total", **labels).value == 5
    assert pb.series("epd_pool_used_bytes", **labels).value == 40
    assert pb.series("epd_pool_leases", **labels).value == 1
    assert pb.series("epd_video_decodes_total", **labels, decoder="cpu").value == 1
    assert pb.series("epd_video_decodes_total", **labels, decoder="nvdec").value == 0
    assert "epd_tier_connected" not in pb.families  # no tier configured


def test_engine_metrics_report_a_step_and_nothing_after_close(pb):
    metrics = EngineMetrics("decode")
    delta = StatsDelta(prompt_tokens=7, generation_tokens=3, kv_cache_usage=0.25, kv_transfers=1,
                       kv_connector_hit_tokens=6)
    delta.queue.add([0.01, 0.02])
    metrics.engine_stats(delta)
    metrics.close()
    labels = {"model": "decode"}
    assert pb.series("epd_vllm_prompt_tokens_total", **labels).value == 7
    assert pb.series("epd_vllm_kv_transfers_total", **labels).value == 1
    assert pb.series("epd_vllm_kv_connector_hit_tokens_total", **labels).value == 6
    assert pb.series("epd_vllm_kv_cache_usage", **labels).value == 0.25 and metrics.kv_cache_usage == 0.25
    assert pb.series("epd_vllm_queue_duration_seconds", **labels).observations == [0.01, 0.02]
    assert pb.series("epd_vllm_queue_time_count_total", **labels).value == 2
    metrics.engine_stats(StatsDelta(prompt_tokens=100))
    assert pb.series("epd_vllm_prompt_tokens_total", **labels).value == 7


def test_request_metrics_free_their_metrics_at_close_and_count_nothing_after(pb):
    """Closed in ``finalize``, while the stub's shared memory is alive: the admission gates and the in-process
    endpoint keep the observer, some until the interpreter's end, when freeing a Triton metric family segfaulted."""
    import gc
    import weakref

    metrics = RequestMetrics("epd", instance="epd_0")
    metrics.request_finished(Outcome.OK, 4)
    metrics.admitted("pd", 0, 0.01)
    family = weakref.ref(metrics._families[0])
    metrics.close()
    gc.collect()
    assert family() is None  # the observer, still referenced, holds no family
    labels = {"model": "epd", "instance": "epd_0"}
    assert pb.series("epd_requests_total", **labels, outcome="ok").value == 1
    metrics.request_finished(Outcome.OK, 4)
    metrics.admitted("pd", 0, 0.01)
    metrics.shed("pd", 0, "budget")
    metrics.first_text(0.1)
    metrics.close()
    assert pb.series("epd_requests_total", **labels, outcome="ok").value == 1


def test_the_loop_s_lag_is_observed_as_late_as_a_callback_held_it(pb, request_metrics):
    """``watch_lag`` on a loop one callback blocks for 0.3 s: one wake-up at least 0.25 s late, the others on time
    (a 2-core machine: within 40 ms), into ``epd_loop_lag_seconds``; cancelled, it ends."""
    import asyncio
    import time

    from backend.engine.loop import watch_lag

    async def run():
        watcher = asyncio.ensure_future(watch_lag(request_metrics.loop_lag, interval=0.02))
        await asyncio.sleep(0.1)
        time.sleep(0.3)  # a callback holding the loop
        await asyncio.sleep(0.1)
        watcher.cancel()
        with pytest.raises(asyncio.CancelledError):
            await watcher

    asyncio.run(run())
    request_metrics.close()
    lags = pb.series("epd_loop_lag_seconds", **LABELS).observations
    assert len(lags) >= 5 and max(lags) >= 0.25
    assert sorted(lags)[-2] < 0.04, lags
