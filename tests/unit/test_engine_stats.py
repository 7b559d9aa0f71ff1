"""vLLM's stat-logger stats -> ``StatsDelta`` (the engine-hosting models' vLLM metrics), with vLLM's own
stats classes, so a change of their fields in a vLLM upgrade fails here."""
import pytest

from backend.engine.stats import StatsDelta, stat_logger_factory, stats_delta

stats = pytest.importorskip("vllm.v1.metrics.stats")  # absent on the GPU machine only


def _finished(prompt: int, queued: float, prefill: float, decode: float):
    return stats.FinishedRequestStats(finish_reason=None, num_prompt_tokens=prompt, queued_time=queued,
                                      prefill_time=prefill, decode_time=decode)


def test_one_step_becomes_totals():
    it = stats.IterationStats()
    it.num_generation_tokens = 5
    it.time_to_first_tokens_iter = [0.25, 0.5]
    it.inter_token_latencies_iter = [0.01, 0.02, 0.03]
    it.finished_requests = [_finished(40, 0.1, 0.2, 0.3), _finished(2, 0.0, 0.05, 0.0)]
    delta = stats_delta(it)
    assert (delta.prompt_tokens, delta.generation_tokens) == (42, 5)
    assert (delta.ttft.count, delta.ttft.seconds) == (2, 0.75)
    assert delta.inter_token.count == 3 and delta.inter_token.seconds == pytest.approx(0.06)
    assert (delta.queue.count, delta.queue.seconds) == (2, pytest.approx(0.1))
    assert delta.prefill.seconds == pytest.approx(0.25) and delta.decode.seconds == pytest.approx(0.3)


def test_an_idle_step_is_empty_and_negative_clock_skew_counts_as_zero():
    assert stats_delta(stats.IterationStats()) == StatsDelta()
    it = stats.IterationStats()
    it.finished_requests = [_finished(3, -0.001, 0.1, 0.0)]
    assert stats_delta(it).queue.seconds == 0.0 and stats_delta(it).queue.count == 1


def test_the_logger_reports_each_step_to_the_observer():
    seen = []

    class Observer:
        def engine_stats(self, delta):
            seen.append(delta)

    logger = stat_logger_factory(Observer())(None, 0)
    it = stats.IterationStats()
    it.num_generation_tokens = 1
    logger.record(None, it)
    logger.record(None, None)  # nothing to report
    logger.record(stats.SchedulerStats(kv_cache_usage=0.25), None)  # a scheduler-only update: the KV usage
    logger.record(stats.SchedulerStats(kv_cache_usage=0.0), it)
    assert [(d.generation_tokens, d.kv_cache_usage) for d in seen] == [(1, None), (0, 0.25), (1, 0.0)]


def test_nixl_s_transfer_stats_become_kv_transfer_counts():
    """vLLM's own NixlKVConnectorStats, as the scheduler hands them to the logger (``to_dict()``): each completed
    READ counts with its bytes, failures apart; another connector's payload or none counts nothing."""
    from types import SimpleNamespace

    from backend.engine.stats import kv_transfer_counts

    nixl = pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats")
    connector = nixl.NixlKVConnectorStats()
    for size in (4096, 12288):
        connector.record_transfer(SimpleNamespace(xferDuration=1500, postDuration=20, totalBytes=size, descCount=2))
    connector.record_failed_transfer()
    assert kv_transfer_counts(connector.to_dict()) == (2, 16384, 1)
    assert kv_transfer_counts(None) == kv_transfer_counts({"other": 1}) == (0, 0, 0)
    # under MultiConnector (E/P/D's prefill with the conversations' store): a payload per connector
    assert kv_transfer_counts({"NixlConnector": connector.to_dict(), "SessionKVConnector": {}}) == (2, 16384, 1)

    seen = []

    class Observer:
        def engine_stats(self, delta):
            seen.append(delta)

    logger = stat_logger_factory(Observer())(None, 0)
    logger.record(stats.SchedulerStats(kv_cache_usage=0.5, kv_connector_stats=connector.to_dict()), None)
    logger.record(stats.SchedulerStats(kv_cache_usage=0.5), None)
    assert [(d.kv_transfers, d.kv_transfer_bytes, d.kv_failed_transfers) for d in seen] == [(2, 16384, 1), (0, 0, 0)]


def test_the_connector_s_prefix_cache_hits_become_hit_tokens():
    """vLLM's ``connector_prefix_cache_stats`` of a step (the tokens a KV connector supplied at scheduling: a
    conversation's kept blocks, prefill's KV on decode) -> ``kv_connector_hit_tokens``; none: 0."""
    seen = []

    class Observer:
        def engine_stats(self, delta):
            seen.append(delta)

    hits = stats.PrefixCacheStats()
    hits.record(num_tokens=1119, num_hits=1024, preempted=False)
    hits.record(num_tokens=300, num_hits=128, preempted=True)
    logger = stat_logger_factory(Observer())(None, 0)
    logger.record(stats.SchedulerStats(kv_cache_usage=0.5, connector_prefix_cache_stats=hits), None)
    logger.record(stats.SchedulerStats(kv_cache_usage=0.5), None)
    assert [d.kv_connector_hit_tokens for d in seen] == [1152, 0]
