"""The E stage's service: the items of the requests Triton batched, decoded, looked up (the instance's cache, the
shared tier), encoded once per distinct item, and published into the pool's leases (``EncoderService``).
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from backend.encode.cache import EmbeddingCache
from backend.encode.encoder import VideoPart, VisionEncoder
from backend.encode.tier import TierExpect
from backend.protocol.errors import InvalidInput
from backend.protocol.generate import PART_PARAMETER, part_range
from backend.protocol.layout import LayoutMetadata, content_key
from backend.protocol.modality import IMAGE, VIDEO, modality
from backend.request.media import decode_counter, handler

LOG = logging.getLogger(__name__)


@dataclass(frozen=True)
class EncodeJob:
    """One media item of one Triton request in a batch."""

    request_index: int
    data: bytes
    content_key: str  # the key the layout carries (the caller's, or computed from ``data``)
    own_key: str = ""  # the key computed in this process from ``data`` (and ``part``), if already done (the cache's key)
    modality: str = IMAGE.name  # what ``data`` is: a registered modality's name
    part: tuple[int, int] | None = None  # part (i, n) of a video (backend.protocol.generate.PART_PARAMETER)
    options: str = ""  # the request's options for its modality (backend.protocol.media_options.MediaOptions.key)


class EncoderService:
    """Decode -> one batched tower forward -> publish, for the items of several requests at once.

    Who calls it: the ``encoder`` model's ``execute`` with every item of the requests Triton batched.
    ``run`` returns, per request index, the layout JSON documents of its items or the exception that
    failed it; a bad item fails only its own request. Items whose embeddings are in the cache
    (``cache_bytes`` > 0; same bytes, processing options and model, and part) are published again without being
    decoded or encoded (``cache_hits``); every item gets its own lease either way. Items of one batch with the same
    bytes are decoded once (two parts of a video Triton batched together), and encoded once. A video part with no
    temporal patches (more parts than the video has) gets no lease: its layout is "" (``PART_PARAMETER``).

    ``tier`` (``backend.encode.tier.EmbeddingTier``, shared by every instance): read on a local cache miss
    (``tier_hits``), written after an encode (asynchronously: the entry may appear after ``run`` returns). Before
    encoding an item the tier does not hold, the service claims it; an item another instance has claimed is waited
    for (up to the tier's ``claim_seconds``, after this batch's own encodes) and encoded here only if it does not
    appear. A tier that fails is skipped (the tier counts it); no request fails for it.
    """

    def __init__(self, encoder: VisionEncoder, pool, limits, processing: str = "", cache_bytes: int = 0, tier=None):
        self.encoder, self.pool, self.limits = encoder, pool, limits
        self.processing = processing
        self.cache = EmbeddingCache(cache_bytes)
        self.tier = tier
        self.items_encoded = 0
        self.cache_hits = 0
        self.tier_hits = 0
        self.encode_seconds = 0.0
        self.batch_retries = 0  # batches whose forward raised and were encoded one item at a time

    def warm_up(self) -> None:
        """A small item of each modality the encoder takes (its handler's ``sample``), decoded as a request's item is
        and encoded, not counted nor published: the decode path's first use (vLLM's video loader and audio modules,
        imported then) costs 2-3 s on 2 cores and 8.7 s on the H200's encoder, which no request should pay."""
        for name in self.encoder.modalities:
            m = modality(name)
            sample = handler(m).sample
            if sample is None:
                continue
            try:
                with decode_counter.uncounted():
                    item = _decode(EncodeJob(0, sample(), "", modality=name), self.limits, self.encoder)
                self.encoder.encode([item])
            except Exception as exc:  # noqa: BLE001 - not warmed (e.g. no PyAV to make the clip): the first item pays
                LOG.warning("encoder warm-up: no %s decoded at load (%s: %s)", name, type(exc).__name__, exc)

    def run(self, jobs: list[EncodeJob], num_requests: int) -> list[list[str] | BaseException]:
        results: list[list[str] | BaseException] = [[] for _ in range(num_requests)]
        looked: list[tuple] = []  # per job: (its cache key, its cached item or None)
        for job in jobs:
            key = (job.own_key or content_key(job.data, self.processing, self.encoder.identity, job.part, job.options)) \
                if self.cache.max_bytes or self.tier is not None else ""
            looked.append((key, self._lookup(key, job.modality)))
        decoded = self._decode_all([job for job, (_, cached) in zip(jobs, looked) if cached is None])
        ready: list[list] = []  # [job, item (cached, or None until encoded), cache key, decoded item], in job order
        for job, (key, cached) in zip(jobs, looked):
            if isinstance(results[job.request_index], BaseException):
                continue
            try:
                if cached is not None:
                    ready.append([job, cached, key, None])
                    continue
                outcome = decoded[_how(job)]
                if isinstance(outcome, BaseException):
                    raise outcome
                item = self._part(job, outcome)
                ready.append([job, EMPTY_PART if item is EMPTY_PART else None, key, item])
            except Exception as exc:
                results[job.request_index] = exc
        # a request with one bad item fails whole; its other items are not encoded
        ready = [r for r in ready if not isinstance(results[r[0].request_index], BaseException)]
        if not ready:
            return results
        self._encode_missing(ready, results)
        ready = [entry for entry in ready if not isinstance(results[entry[0].request_index], BaseException)]
        self._publish(ready, results)
        return results

    def _decode_all(self, jobs: list[EncodeJob]) -> dict[tuple, object]:
        """Each distinct item of ``jobs`` (modality, bytes, options: a video's parts share one) decoded, several at
        once (``DECODE_THREADS``: an instance given a batch of videos would otherwise decode them in turn, which held
        the encode phase of a 16-video batch at seconds on the H200); -> the item, or the exception its decode
        raised."""
        hows = list(dict.fromkeys(_how(job) for job in jobs))
        first = {}
        for job in jobs:
            first.setdefault(_how(job), job)

        def one(how):
            try:
                return _decode(first[how], self.limits, self.encoder)
            except Exception as exc:  # noqa: BLE001 - fails the item's request only (run)
                return exc

        if len(hows) <= 1:
            return {how: one(how) for how in hows}
        return dict(zip(hows, _decode_pool().map(one, hows)))

    def _lookup(self, key: str, modality: str):
        """The item of ``key`` from the local cache, else from the tier (then cached here too); None: encode it."""
        if not key:
            return None
        item = self.cache.get(key)
        if item is not None and item.modality == modality:
            self.cache_hits += 1
            return item
        if self.tier is None:
            return None
        item = self.tier.get(key, self.expect())
        if item is None or item.modality != modality:
            return None
        self.tier_hits += 1
        self.cache.put(key, item)
        return item

    def expect(self):
        """What a tier entry must match to be served here."""
        return TierExpect(self.encoder.identity, self.processing, str(self.encoder.dtype).removeprefix("torch."),
                          int(self.encoder.width))

    def _encode_missing(self, ready: list[list], results: list) -> None:
        """Fill in every ready entry still without an item: one encode per distinct (key, modality), those another
        instance claimed waited for in the tier first."""
        groups: dict[tuple, list[int]] = {}
        for i, entry in enumerate(ready):
            if entry[1] is None:
                groups.setdefault((entry[2], entry[0].modality) if entry[2] else ("", i), []).append(i)
        if not groups:
            return
        mine, theirs = [], []
        for group in groups:
            claimed = self.tier is None or not group[0] or self.tier.claim(group[0])
            (mine if claimed else theirs).append(group)
        self._encode(mine, groups, ready, results)
        if theirs:
            found = self.tier.wait([key for key, _ in theirs], self.expect())
            for group in theirs:
                item = found.get(group[0])
                if item is not None and item.modality == group[1]:
                    self.tier_hits += len(groups[group])
                    self.cache.put(group[0], item)
                    for i in groups[group]:
                        ready[i][1] = item
            self._encode([g for g in theirs if ready[groups[g][0]][1] is None], groups, ready, results)

    def _encode(self, todo: list[tuple], groups: dict, ready: list[list], results: list) -> None:
        """One tower forward for the groups ``todo``; their items cached and written to the tier. A forward that
        raises is tried again one group at a time (``batch_retries``), so an item the encoder cannot take fails its
        own request, not the other requests Triton batched with it."""
        if not todo:
            return
        started = time.perf_counter()
        try:
            encoded = self.encoder.encode([ready[groups[g][0]][3] for g in todo])
        except Exception as exc:
            self.encode_seconds += time.perf_counter() - started
            self._encode_failed(exc, todo, groups, ready, results)
            return
        self.encode_seconds += time.perf_counter() - started
        self.items_encoded += len(encoded)
        for group, item in zip(todo, encoded):
            for i in groups[group]:
                ready[i][1] = item
            if group[0]:
                self.cache.put(group[0], item)
                if self.tier is not None:
                    self.tier.put(group[0], item, self.expect(), release_claim=True)

    def _encode_failed(self, exc: Exception, todo: list[tuple], groups: dict, ready: list[list], results: list) -> None:
        """After the forward of ``todo`` raised ``exc``: several groups are encoded again one at a time; one group's
        requests fail with ``exc``."""
        if len(todo) > 1:
            LOG.warning("encoder: a batch of %d items failed (%s: %s); encoding them one at a time", len(todo),
                        type(exc).__name__, exc)
            self.batch_retries += 1
            for group in todo:
                self._encode([group], groups, ready, results)
            return
        for i in groups[todo[0]]:
            results[ready[i][0].request_index] = exc

    def _publish(self, ready: list[list], results: list) -> None:
        """Each ready item's embeddings into a lease, its layout JSON appended to its request's results (a request
        whose lease cannot be had fails, and the leases it got are released)."""
        leases: dict[int, list[str]] = {}
        # One wait for pool space per batch, not one per item: once the pool stayed full, the batch's
        # other items fail at once instead of each waiting alloc_timeout (requests would pile up behind).
        deadline = time.monotonic() + getattr(self.pool, "alloc_timeout", 0.0)
        for job, item, _, _ in ready:
            if isinstance(results[job.request_index], BaseException):
                continue
            if item is EMPTY_PART:
                results[job.request_index].append("")
                continue
            try:
                handle = self.pool.publish(item.embeddings, timeout=max(0.0, deadline - time.monotonic()))
            except Exception as exc:
                results[job.request_index] = exc
                for lease_id in leases.pop(job.request_index, []):  # the request failed: free what it got
                    self.pool.release(lease_id)
                continue
            leases.setdefault(job.request_index, []).append(handle.lease_id)
            layout = LayoutMetadata(content_key=job.content_key, model=self.encoder.identity,
                                    dtype=str(item.embeddings.dtype).removeprefix("torch."),
                                    shape=tuple(item.embeddings.shape), handle=handle,
                                    media=item.media())
            results[job.request_index].append(layout.to_json())

    def _part(self, job: EncodeJob, decoded):
        """``decoded`` as the item the job asks for: the whole, its ``VideoPart``, or ``EMPTY_PART``."""
        if job.part is None:
            return decoded
        if job.modality != VIDEO.name:
            raise InvalidInput(f"parameters.{PART_PARAMETER}", f"only a video is encoded in parts, not an {job.modality}")
        first, stop = part_range(job.part, self.encoder.temporal_patches(decoded))
        return VideoPart(decoded, job.part) if stop > first else EMPTY_PART


EMPTY_PART = object()  # a video part with no temporal patches: nothing to encode, an empty layout


DECODE_THREADS = min(4, os.cpu_count() or 1)
_POOL: list[ThreadPoolExecutor] = []
_POOL_LOCK = threading.Lock()


def _decode_pool() -> ThreadPoolExecutor:
    """The process's decode threads (an encoder instance is a process of its own), made at the first batch of
    several items."""
    with _POOL_LOCK:
        if not _POOL:
            _POOL.append(ThreadPoolExecutor(DECODE_THREADS, thread_name_prefix="epd-decode"))
        return _POOL[0]


def _how(job: EncodeJob) -> tuple:
    """What a decode depends on: items of a batch equal in it are decoded once."""
    return job.modality, job.data, job.options


def _decode(job: EncodeJob, limits, encoder):
    """The job's item decoded by its modality's request-stage handler (the field: the modality's tensor); a modality
    the encoder does not take is refused first."""
    try:
        m = modality(job.modality)
    except KeyError:
        raise InvalidInput("modality", f"unsupported modality {job.modality!r}") from None
    if m.name not in encoder.modalities:
        raise InvalidInput(m.media_tensor, f"this checkpoint's encoder takes {' and '.join(encoder.modalities)}, "
                                           f"not {m.name}")
    options = json.loads(job.options) if job.options else {}
    return handler(m).decode(job.data, m.media_tensor, limits, **options)
