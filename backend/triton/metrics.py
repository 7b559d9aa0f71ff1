"""The Triton models' custom metrics (on the metrics port): per-request counters and latency histograms, the
encoder's pool and cache, vLLM's own engine figures. Increments go through ``CounterBatch``.
"""
from __future__ import annotations

import functools
import logging
import threading

import triton_python_backend_utils as pb_utils

from backend.engine.serving import Outcome
from backend.protocol.layout import TRANSPORTS
from backend.triton.counter_batch import CounterBatch

log = logging.getLogger(__name__)


def metric_labels(model_name: str, instance: str) -> dict[str, str]:
    """Labels of a model instance's custom metrics: ``model`` and, given, ``instance`` (the instance's name,
    ``args["model_instance_name"]``). Each instance is a stub process with counters of its own; instances
    sharing one metric (same labels) overwrote each other's gauges, and each stub deleted the shared metric at
    unload: glibc heap aborts in the stubs at every stop with two encoder instances (docs/results/robustness.md)."""
    return {"model": model_name, **({"instance": instance} if instance else {})}


def _counter(name: str, description: str):
    return pb_utils.MetricFamily(name=name, kind=pb_utils.MetricFamily.COUNTER, description=description)


def _unless_closed(method):
    """A ``RequestMetrics`` observer method that does nothing once its object is closed (its metrics freed)."""
    @functools.wraps(method)
    def observe(self, *args, **kwargs):
        if not self._closed:
            method(self, *args, **kwargs)
    return observe


# Histogram buckets (seconds) of every latency histogram: 100 us (a GPU handoff) to 60 s (a long CPU request).
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                   1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class RequestMetrics:
    """``backend.engine.serving.RequestObserver`` as Triton custom metrics on the metrics port (batched:
    ``CounterBatch``, so they lag by up to its ``FLUSH_SECONDS``; ``close`` in ``finalize``).

    ``epd_requests_total{model,outcome}``: finished requests by outcome (ok, cancelled, error).
    ``epd_generated_tokens_total{model}``: tokens generated, counting those of cancelled requests.
    ``epd_media_decodes_total{model}``: media items decoded in the model's process (0 for ``pd``).
    ``epd_transfer_bytes_total{model}`` / ``epd_transfer_seconds_total{model}``: embedding bytes pulled by the
    model (``pd``, ``prefill``) and the time the pulls took.
    ``epd_transfer_items_total{model,path}``: embedding items pulled, by data path (``backend.transfer.consumer``:
    ``cuda_ipc`` device to device, ``shared_memory`` through host memory, ``nixl``).
    ``epd_retries_total{model,what}``: orchestrator retries: ``encode`` (one item encoded again after its
    encode failed) and ``request`` (items encoded again and the stages asked again after UNAVAILABLE).
    ``epd_demand_skipped_total{model}``: items an orchestrator sent as the consumer's own copy instead of encoding
    them (demand-aware encoding, ``backend.transfer.held``); ``epd_held_hits_total{model}`` /
    ``epd_held_bytes{model}``: items a consumer took from its copies, and the bytes those copies hold now.

    Histograms (``LATENCY_BUCKETS``, seconds), per request, from the request read in ``execute`` (``TritonSink``):
    ``epd_request_ttft_seconds`` (to its first text) and ``epd_request_duration_seconds`` (to its final response);
    from the final response's timings: ``epd_encode_duration_seconds`` (the encode phase of a request with media,
    at an orchestrator) and ``epd_transfer_duration_seconds`` (pulling its embeddings, where that was done or
    relayed). ``epd_loop_lag_seconds`` (orchestrators): every 50 ms, how late the model's event loop woke from its
    sleep (``backend.engine.loop.watch_lag``): the time its other work held the loop, which a request arriving then
    (a refusal's answer too) waited.
    """

    _HISTOGRAMS = {
        "ttft": ("epd_request_ttft_seconds", "Seconds from a request's arrival at the model to its first text"),
        "duration": ("epd_request_duration_seconds", "Seconds from a request's arrival at the model to its final response"),
        "encode": ("epd_encode_duration_seconds", "Seconds a request's media took to encode (orchestrators)"),
        "transfer": ("epd_transfer_duration_seconds", "Seconds a request's embeddings took to pull"),
        "loop_lag": ("epd_loop_lag_seconds", "Orchestrators: seconds the model's event loop woke late from a 50 ms "
                     "sleep (what its requests waited for the loop then)"),
    }
    ADMISSION_OUTCOMES = ("admitted", "shed_budget", "shed_queue", "shed_deadline")

    def __init__(self, model_name: str, batch: CounterBatch | None = None, instance: str = ""):
        requests = _counter("epd_requests_total", "Finished generate requests by outcome")
        tokens = _counter("epd_generated_tokens_total", "Tokens generated, including those of cancelled requests")
        decodes = _counter("epd_media_decodes_total", "Media items decoded (PIL) in the model's process")
        retries = _counter("epd_retries_total", "Orchestrator retries (encode: one item; request: all items and the stages)")
        moved = _counter("epd_transfer_bytes_total", "Embedding bytes pulled from encoders")
        moving = _counter("epd_transfer_seconds_total", "Seconds spent pulling embeddings from encoders")
        paths = _counter("epd_transfer_items_total", "Embedding items pulled from encoders, by data path")
        skipped = _counter("epd_demand_skipped_total", "Items not encoded because the consumer held their embeddings")
        held_hits = _counter("epd_held_hits_total", "Items a consumer took from its own copies instead of pulling them")
        held_bytes = pb_utils.MetricFamily(name="epd_held_bytes", kind=pb_utils.MetricFamily.GAUGE,
                                           description="Bytes of embeddings a consumer holds for later requests")
        admission = _counter("epd_admission_total", "Orchestrators: requests let in to a stage, or refused (shed_budget: "
                             "at arrival, shed_queue: after waiting, shed_deadline: its deadline passed first), by priority")
        waits = pb_utils.MetricFamily(name="epd_admission_wait_seconds", kind=pb_utils.MetricFamily.HISTOGRAM,
                                      description="Orchestrators: seconds a request waited for a stage's budget")
        limits = pb_utils.MetricFamily(name="epd_admission_limit", kind=pb_utils.MetricFamily.GAUGE,
                                       description="Orchestrators: requests a stage's gate lets in at once now, where it "
                                                   "follows a first-token target (admission.first_token_target_ms)")
        labels = metric_labels(model_name, instance)
        self._labels, self._admission_family, self._waits_family = labels, admission, waits
        self._limits_family, self._limits = limits, {}  # stage -> gauge, made when the limit first moves
        self._admission: dict[tuple, object] = {}  # (stage, priority, outcome) -> metric, made when first counted
        self._waits: dict[tuple, object] = {}
        histogram = pb_utils.MetricFamily.HISTOGRAM
        self._histograms = {}
        histogram_families = []
        for key, (name, text) in self._HISTOGRAMS.items():
            family = pb_utils.MetricFamily(name=name, kind=histogram, description=text)
            histogram_families.append(family)
            self._histograms[key] = family.Metric(labels=labels, buckets=list(LATENCY_BUCKETS))
        # a family must outlive its metrics
        self._families = (requests, tokens, decodes, retries, moved, moving, paths, skipped, held_hits, held_bytes,
                          admission, waits, limits, *histogram_families)
        self._skipped, self._held_hits = skipped.Metric(labels=labels), held_hits.Metric(labels=labels)
        self._held_bytes = held_bytes.Metric(labels=labels)
        # a pull's path is its handle's transport
        self._paths = {p: paths.Metric(labels={**labels, "path": p}) for p in TRANSPORTS}
        self._paths_seen: dict[str, int] = {}
        self._moved, self._moving = moved.Metric(labels=labels), moving.Metric(labels=labels)
        self._retries = {w: retries.Metric(labels={**labels, "what": w}) for w in ("encode", "request")}
        self._requests = {o: requests.Metric(labels={**labels, "outcome": o.value}) for o in Outcome}
        self._tokens = tokens.Metric(labels=labels)
        self._decodes = decodes.Metric(labels=labels)
        self._decodes_seen = 0
        self._seen_lock = threading.Lock()
        self._batch = batch or CounterBatch()
        self._own_batch, self._closed = batch is None, False

    @_unless_closed
    def media_decodes(self, total: int) -> None:
        """Report the process's decode counter (``backend.request.media.decode_counter``). Called from ``execute``
        and, with metadata-only off, from the engine loop."""
        with self._seen_lock:
            if total > self._decodes_seen:
                self._batch.add(self._decodes, total - self._decodes_seen)
                self._decodes_seen = total

    @_unless_closed
    def transferred(self, nbytes: int, seconds: float, paths: dict[str, int] | None = None) -> None:
        """A pull of ``nbytes`` that took ``seconds``; ``paths``: the consumer's items per data path so far
        (``EmbeddingConsumer.paths``, a running count: the increase is added)."""
        counts = [(self._moved, nbytes), (self._moving, seconds)]
        with self._seen_lock:
            for path, total in (paths or {}).items():
                if path in self._paths and total > self._paths_seen.get(path, 0):
                    counts.append((self._paths[path], total - self._paths_seen.get(path, 0)))
                    self._paths_seen[path] = total
        self._batch.add_many(counts)

    @_unless_closed
    def request_retried(self, what: str) -> None:
        self._batch.add(self._retries[what], 1)

    @_unless_closed
    def held(self, hits: int, nbytes: int) -> None:
        """A consumer took ``hits`` items of a request from its copies, which now hold ``nbytes``."""
        self._batch.add_many(((self._held_hits, hits),), ((self._held_bytes, nbytes),))

    @_unless_closed
    def admitted(self, stage: str, priority: int, waited_seconds: float) -> None:
        """``orchestrator.admission.AdmissionObserver``: a request let in to ``stage`` after ``waited_seconds``."""
        key = (stage, priority)
        with self._seen_lock:
            if key not in self._waits:
                self._waits[key] = self._waits_family.Metric(
                    labels={**self._labels, "stage": stage, "priority": str(priority)}, buckets=list(LATENCY_BUCKETS))
        self._batch.add_many(((self._admission_metric(stage, priority, "admitted"), 1),), (),
                             ((self._waits[key], waited_seconds),))

    @_unless_closed
    def shed(self, stage: str, priority: int, reason: str) -> None:
        """``orchestrator.admission.AdmissionObserver``: a request refused at ``stage`` (``reason``: budget, queue, deadline)."""
        self._batch.add(self._admission_metric(stage, priority, f"shed_{reason}"), 1)

    @_unless_closed
    def limited(self, stage: str, limit: int) -> None:
        """``orchestrator.admission.AdmissionObserver``: ``stage``'s gate lets in ``limit`` requests at once now."""
        with self._seen_lock:
            if stage not in self._limits:
                self._limits[stage] = self._limits_family.Metric(labels={**self._labels, "stage": stage})
        self._batch.add_many((), ((self._limits[stage], limit),))

    def _admission_metric(self, stage: str, priority: int, outcome: str):
        key = (stage, priority, outcome)
        with self._seen_lock:
            if key not in self._admission:
                self._admission[key] = self._admission_family.Metric(
                    labels={**self._labels, "stage": stage, "priority": str(priority), "outcome": outcome})
            return self._admission[key]

    @_unless_closed
    def request_finished(self, outcome: Outcome, num_output_tokens: int) -> None:
        self._batch.add_many(((self._tokens, num_output_tokens), (self._requests[outcome], 1)))  # count last

    @_unless_closed
    def loop_lag(self, seconds: float) -> None:
        """How late the model's event loop woke (``backend.engine.loop.watch_lag``)."""
        self._batch.observe(self._histograms["loop_lag"], seconds)

    @_unless_closed
    def first_text(self, seconds: float) -> None:
        self._batch.observe(self._histograms["ttft"], seconds)

    @_unless_closed
    def final_response(self, seconds: float, timings: dict | None) -> None:
        """A request's final response, ``seconds`` after it was read, with its timing breakdown (if any)."""
        observations = [(self._histograms["duration"], seconds)]
        if timings and timings.get("held"):
            self._batch.add(self._skipped, timings["held"])
        if timings:
            if timings.get("items") and timings.get("encode_ms") is not None:
                observations.append((self._histograms["encode"], timings["encode_ms"] / 1000))
            if timings.get("transfer_bytes") and timings.get("transfer_ms") is not None:
                observations.append((self._histograms["transfer"], timings["transfer_ms"] / 1000))
        self._batch.add_many((), (), observations)

    def close(self) -> None:
        """Hand over what is pending (and stop the flusher if it is this object's own), then free the Triton metric
        objects, while the stub's shared memory is alive: other objects keep this observer (the orchestrator's
        admission gates, the in-process endpoint), some until the interpreter's end, and a MetricFamily freed
        then segfaulted the stub (core dump of an ``epd`` stub at a server's stop, test_families 2026-12-06:
        ``Metric::SaveToSharedMemory`` <- ``~MetricFamily``, as ``EngineMetrics`` once did). Later calls do nothing."""
        if self._closed:
            return
        if self._own_batch:
            self._batch.close()
        else:
            self._batch.flush()
        self._closed = True
        self._requests, self._retries, self._paths, self._histograms, self._admission, self._waits = ({},) * 6
        self._tokens = self._decodes = self._moved = self._moving = self._skipped = self._held_hits = None
        self._held_bytes = self._admission_family = self._waits_family = None
        self._families = ()


class EncoderMetrics:
    """The ``encoder`` model's work and its embedding pool, as Triton custom metrics (``refresh`` copies
    the service's counters and the pool's stats; the encoder model calls it once a second).

    Labels ``model`` and ``instance`` (each instance is a stub with its own pool: sum over instances).
    ``epd_encoder_items_total{model}``, ``epd_encoder_compute_seconds_total{model}`` (image processor + tower
    forward), ``epd_encoder_cache_hits_total{model}`` (items published from the embedding cache), ``epd_pool_leases{model}`` (open leases), ``epd_pool_used_bytes{model}``,
    ``epd_pool_capacity_bytes{model}``, ``epd_pool_released_total{model}`` (read by their consumer, or
    released), ``epd_pool_expired_total{model}`` (expired before anyone read them). With the shared embedding tier
    configured, ``TIER_FAMILIES`` too (``epd_tier_*``: hits, misses, bad entries by reason, claims, waits, ...).
    ``epd_video_decodes_total{decoder}``: videos decoded by NVDEC (``video_decoder: nvdec``) or on the CPU (the
    default, and an nvdec encoder's fall-backs). ``epd_image_decodes_total{decoder}``: images decoded for
    preprocessing on the GPU (``image_preprocess: gpu`` / ``nvjpeg``) by nvJPEG or on the CPU (0 with the default).
    """

    _FAMILIES = {
        "epd_encoder_items_total": ("COUNTER", "Media items encoded"),
        "epd_encoder_compute_seconds_total": ("COUNTER", "Seconds in the image processor and tower"),
        "epd_encoder_cache_hits_total": ("COUNTER", "Media items served from the encoder's embedding cache"),
        "epd_encoder_deadline_stops_total": ("COUNTER", "Requests refused unencoded: their deadline had passed"),
        "epd_pool_leases": ("GAUGE", "Open embedding leases"),
        "epd_pool_used_bytes": ("GAUGE", "Embedding pool bytes held by open leases"),
        "epd_pool_capacity_bytes": ("GAUGE", "Embedding pool size"),
        "epd_pool_released_total": ("COUNTER", "Leases released (read by their consumer or released)"),
        "epd_pool_expired_total": ("COUNTER", "Leases that expired before anyone read them"),
        "epd_video_decodes_total": ("COUNTER", "Videos decoded, by decoder: nvdec (the GPU, video_decoder nvdec) or cpu",
                                    "decoder"),
        "epd_image_decodes_total": ("COUNTER", "Images decoded for GPU preprocessing (image_preprocess gpu or nvjpeg), "
                                               "by decoder: nvjpeg or cpu", "decoder"),
    }
    VIDEO_DECODERS = ("nvdec", "cpu")
    IMAGE_DECODERS = ("nvjpeg", "cpu")

    def __init__(self, model_name: str, instance: str = "", tier: bool = False):
        """``tier``: the instance has the shared embedding tier configured (``TIER_FAMILIES`` exported too)."""
        families = {**self._FAMILIES, **(TIER_FAMILIES if tier else {})}
        self._families = {name: pb_utils.MetricFamily(name=name, kind=getattr(pb_utils.MetricFamily, kind), description=text)
                          for name, (kind, text, _) in _with_labels(families).items()}
        labels = metric_labels(model_name, instance)
        self._kinds, self._metrics = {}, {}
        label_values = {**(tier_labels() if tier else {}), "epd_video_decodes_total": self.VIDEO_DECODERS,
                        "epd_image_decodes_total": self.IMAGE_DECODERS}
        for name, (kind, _, label) in _with_labels(families).items():
            for value in label_values.get(name, (None,)):
                series = (name, value)
                self._kinds[series] = kind
                self._metrics[series] = self._families[name].Metric(labels={**labels, label: value} if label else labels)
        self._seen = {series: 0.0 for series in self._metrics}
        self._lock = threading.Lock()

    def refresh(self, items: int, compute_seconds: float, stats, cache_hits: int = 0, tier=None,
                tier_hits: int = 0, video_decodes: dict | None = None, image_decodes: dict | None = None,
                deadline_stops: int = 0) -> None:
        """``tier``: the instance's ``EmbeddingTier`` (None: not connected: ``epd_tier_connected`` 0);
        ``video_decodes``: decoder -> videos (``backend.request.video.VIDEO_DECODES``); ``image_decodes``: decoder ->
        images (``backend.request.image.IMAGE_DECODES``)."""
        values = {"epd_encoder_items_total": items, "epd_encoder_compute_seconds_total": compute_seconds,
                  "epd_encoder_cache_hits_total": cache_hits, "epd_encoder_deadline_stops_total": deadline_stops,
                  "epd_pool_leases": stats.open_leases, "epd_pool_used_bytes": stats.used_bytes,
                  "epd_pool_capacity_bytes": stats.capacity_bytes, "epd_pool_released_total": stats.released_total,
                  "epd_pool_expired_total": stats.expired_total}
        values = {(name, None): value for name, value in values.items()}
        values.update({("epd_video_decodes_total", decoder): (video_decodes or {}).get(decoder, 0)
                       for decoder in self.VIDEO_DECODERS})
        values.update({("epd_image_decodes_total", decoder): (image_decodes or {}).get(decoder, 0)
                       for decoder in self.IMAGE_DECODERS})
        if ("epd_tier_connected", None) in self._metrics:
            values.update(tier_values(tier, tier_hits))
        with self._lock:
            for series, value in values.items():
                if self._kinds[series] == "GAUGE":
                    self._metrics[series].set(value)
                elif value > self._seen[series]:
                    self._metrics[series].increment(value - self._seen[series])
                self._seen[series] = value


# The shared embedding tier, per encoder instance (backend.encode.tier.TierStats; docs/tier.md): name -> (kind, text,
# label); tier_labels: a labelled family's label values.
TIER_FAMILIES = {
    "epd_tier_connected": ("GAUGE", "1: the instance reached its embedding tier at load (0: it encodes without one)", ""),
    "epd_tier_hits_total": ("COUNTER", "Media items served from the shared embedding tier (a local cache miss)", ""),
    "epd_tier_misses_total": ("COUNTER", "Tier lookups that found no entry to serve", ""),
    "epd_tier_bytes_read_total": ("COUNTER", "Entry bytes read from the tier", ""),
    "epd_tier_bytes_written_total": ("COUNTER", "Entry bytes written to the tier", ""),
    "epd_tier_dropped_writes_total": ("COUNTER", "Tier writes dropped (write queue full, or the tier down)", ""),
    "epd_tier_errors_total": ("COUNTER", "Tier store calls that failed or timed out (the tier then skipped a while)", ""),
    "epd_tier_skipped_total": ("COUNTER", "Tier calls not made because the tier was down", ""),
    "epd_tier_bad_entries_total": ("COUNTER", "Tier entries dropped as unservable, by reason", "reason"),
    "epd_tier_claims_total": ("COUNTER", "Single-flight claims: won (encoded here) or lost (another instance encodes)",
                              "outcome"),
    "epd_tier_waits_total": ("COUNTER", "Items waited for another instance to publish: served, or expired (encoded here)",
                             "outcome"),
}


def tier_labels() -> dict[str, tuple[str, ...]]:
    """A labelled tier family's label values (imported here only: the tier module brings torch, which not every
    model that imports this module needs)."""
    from backend.encode.tier import BAD_REASONS

    return {"epd_tier_bad_entries_total": BAD_REASONS, "epd_tier_claims_total": ("won", "lost"),
            "epd_tier_waits_total": ("served", "expired")}


def _with_labels(families: dict) -> dict:
    """``EncoderMetrics._FAMILIES`` (kind, text) and ``TIER_FAMILIES`` (kind, text, label) alike."""
    return {name: (spec + ("",))[:3] for name, spec in families.items()}


def tier_values(tier, tier_hits: int) -> dict:
    """The tier's series (name, label value) -> value, from its stats (zeros where not connected)."""
    from backend.encode.tier import BAD_REASONS  # torch, as in tier_labels

    stats = tier.stats if tier is not None else None
    get = (lambda field: getattr(stats, field)) if stats is not None else (lambda field: 0)
    values = {("epd_tier_connected", None): int(tier is not None), ("epd_tier_hits_total", None): tier_hits}
    for field in ("misses", "bytes_read", "bytes_written", "dropped_writes", "errors", "skipped"):
        values[f"epd_tier_{field}_total", None] = get(field)
    for reason in BAD_REASONS:
        values["epd_tier_bad_entries_total", reason] = stats.bad.get(reason, 0) if stats is not None else 0
    values.update({("epd_tier_claims_total", "won"): get("claims_won"), ("epd_tier_claims_total", "lost"): get("claims_lost"),
                   ("epd_tier_waits_total", "served"): get("waits_served"),
                   ("epd_tier_waits_total", "expired"): get("waits_expired")})
    return values


class EngineMetrics:
    """vLLM's own request metrics of an engine-hosting model (``llm``, ``pd``, ``prefill``, ``decode``), as
    Triton custom metrics: a ``backend.engine.stats.StatsObserver`` (see there for what vLLM measures).

    A gauge, ``epd_vllm_kv_cache_usage`` (fraction of KV blocks held by requests), and counters, all labelled
    ``model`` (and ``instance``): ``epd_vllm_prompt_tokens_total``, ``epd_vllm_generation_tokens_total``, the KV
    connector's transfers (``epd_vllm_kv_transfers_total``, ``_kv_transfer_bytes_total``, ``_kv_failed_transfers_total``)
    and the prompt tokens it supplied (``epd_vllm_kv_connector_hit_tokens_total``),
    and a ``_seconds_total`` / ``_count_total`` pair per timing, summary style (mean = rate of the first /
    rate of the second): ``epd_vllm_time_to_first_token``, ``epd_vllm_time_per_output_token`` (between
    consecutive tokens), ``epd_vllm_queue_time``, ``epd_vllm_prefill_time``, ``epd_vllm_decode_time``; and a
    histogram of the queue time, ``epd_vllm_queue_duration_seconds`` (``LATENCY_BUCKETS``).
    """

    _TIMINGS = {
        "ttft": ("epd_vllm_time_to_first_token", "from a request's arrival at the engine to its first token"),
        "inter_token": ("epd_vllm_time_per_output_token", "between two consecutive output tokens of a request"),
        "queue": ("epd_vllm_queue_time", "finished requests waited in the engine's queue (queued to scheduled)"),
        "prefill": ("epd_vllm_prefill_time", "finished requests' time from scheduling to their first token"),
        "decode": ("epd_vllm_decode_time", "finished requests' time from their first token to their last"),
    }

    def __init__(self, model_name: str, batch: CounterBatch | None = None, instance: str = ""):
        """``batch``: the model's ``CounterBatch`` (shared with its ``RequestMetrics``)."""
        self._batch = batch or CounterBatch()
        self._own_batch = batch is None
        counter = pb_utils.MetricFamily.COUNTER
        labels = metric_labels(model_name, instance)
        self._families = [
            pb_utils.MetricFamily(name="epd_vllm_prompt_tokens_total", kind=counter,
                                  description="Prompt tokens of the requests the engine finished"),
            pb_utils.MetricFamily(name="epd_vllm_generation_tokens_total", kind=counter,
                                  description="Tokens the engine generated"),
        ]
        self._prompt, self._generation = (family.Metric(labels=labels) for family in self._families)
        kv = [pb_utils.MetricFamily(name="epd_vllm_kv_transfers_total", kind=counter,
                                    description="KV cache transfers the engine's connector completed (NIXL reads: decode)"),
              pb_utils.MetricFamily(name="epd_vllm_kv_transfer_bytes_total", kind=counter,
                                    description="Bytes of the KV cache transfers the engine's connector completed"),
              pb_utils.MetricFamily(name="epd_vllm_kv_failed_transfers_total", kind=counter,
                                    description="KV cache transfers the engine's connector failed"),
              pb_utils.MetricFamily(name="epd_vllm_kv_connector_hit_tokens_total", kind=counter,
                                    description="Prompt tokens whose KV the engine's connector supplied instead of a "
                                                "prefill (pd, prefill: conversations' kept KV; decode: prefill's)")]
        self._families += kv
        self._kv_counters = tuple(family.Metric(labels=labels) for family in kv)
        usage = pb_utils.MetricFamily(name="epd_vllm_kv_cache_usage", kind=pb_utils.MetricFamily.GAUGE,
                                      description="Fraction of the engine's KV cache blocks held by requests, as of its last step")
        self._families.append(usage)
        self._kv_usage = usage.Metric(labels=labels)
        queue = pb_utils.MetricFamily(name="epd_vllm_queue_duration_seconds", kind=pb_utils.MetricFamily.HISTOGRAM,
                                      description="Seconds finished requests waited in the engine's queue")
        self._families.append(queue)
        self._queue = queue.Metric(labels=labels, buckets=list(LATENCY_BUCKETS))
        self._timings, self._closed = {}, False
        self.kv_cache_usage: float | None = None  # the last step's, for load probes (backend.protocol.generate.LOAD_PARAMETER)
        for key, (name, text) in self._TIMINGS.items():
            seconds = pb_utils.MetricFamily(name=f"{name}_seconds_total", kind=counter, description=f"Seconds {text}")
            count = pb_utils.MetricFamily(name=f"{name}_count_total", kind=counter, description=f"Samples: {text}")
            self._families += [seconds, count]
            self._timings[key] = (seconds.Metric(labels=labels), count.Metric(labels=labels))

    def close(self) -> None:
        """Free the Triton metric objects now, while the stub's shared memory is alive. vLLM's logger keeps
        this observer for as long as the engine object lives, which was seen to be until interpreter exit:
        freeing a MetricFamily then segfaulted the stub (``Metric::SaveToSharedMemory`` in
        ``~MetricFamily``), leaving its /dev/shm region behind. Later stats are ignored."""
        self._closed = True
        if self._own_batch:
            self._batch.close()
        else:
            self._batch.flush()
        self._timings, self._prompt, self._generation, self._kv_usage, self._queue = {}, None, None, None, None
        self._kv_counters = ()
        self._families = []

    def engine_stats(self, delta) -> None:
        if self._closed:
            return
        amounts = [(self._prompt, delta.prompt_tokens), (self._generation, delta.generation_tokens),
                   *zip(self._kv_counters, (delta.kv_transfers, delta.kv_transfer_bytes, delta.kv_failed_transfers,
                                         delta.kv_connector_hit_tokens))]
        for key, (seconds, count) in self._timings.items():
            samples = getattr(delta, key)
            amounts += [(seconds, samples.seconds), (count, samples.count)]
        gauges = () if delta.kv_cache_usage is None else ((self._kv_usage, delta.kv_cache_usage),)
        if delta.kv_cache_usage is not None:
            self.kv_cache_usage = delta.kv_cache_usage
        observations = [(self._queue, value) for value in delta.queue.values]
        self._batch.add_many(amounts, gauges, observations)  # one step's figures in one flush
