"""The shared embedding tier: embeddings every encoder instance (and host) reads on a local cache miss and writes after
an encode, in a store made for it (Mooncake Store, docs/tier.md), beside the per-instance ``EmbeddingCache``.

An entry is one blob under the item's content key: ``MAGIC``, a 4-byte header length, a JSON header (the key, model
identity, processing options digest, dtype, shape, the item's layout members, the payload's blake2b) and the raw
tensor bytes. ``EmbeddingTier.get`` checks all of it against what the reader expects (``TierExpect``), so a stale,
wrong-model, wrong-options, truncated or corrupted entry is never served: it is dropped (removed from the store) and
counted by reason. The tier is an optimisation only: when the store raises, times out or is not installed, the
encoder encodes as without it (``TierStats.errors``, one log line per outage) and no request fails.

Writes are asynchronous (one writer thread, a bounded queue; a full queue drops the write, counted), so an encode
returns before its entry is published. Single-flight across instances is a claim: ``claim(key)`` writes a claim
entry with a token of its own; the store keeps the first value put under a key, so reading the token back says who
won. The winner encodes and puts the entry; the others ``wait`` for the entry (polling) until ``claim_seconds``, then
encode themselves. A claim older than ``claim_seconds`` (its owner died) is taken over.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field

import torch

from backend.encode.encoder import EncodedItem

LOG = logging.getLogger("epd.tier")
MAGIC = b"EPDT\x01"
CLAIM_PREFIX = "claim:"
# why an entry was dropped (TierStats.bad's keys; BadEntry.reason)
BAD_REASONS = ("format", "key", "model", "processing", "dtype", "shape", "truncated", "integrity")


class TierUnavailable(RuntimeError):
    """The store cannot be used (not installed, not reachable, an error code): encode as without it."""


@dataclass(frozen=True)
class TierExpect:
    """What the reader's encoder gives: an entry must match all of it to be served."""

    model: str
    processing: str  # the processing options (canonical JSON); entries carry its digest
    dtype: str       # torch dtype name, e.g. "float32"
    width: int       # the embeddings' last dimension

    def digest(self) -> str:
        return hashlib.blake2b(self.processing.encode(), digest_size=16).hexdigest()


@dataclass
class TierStats:
    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    puts: int = 0
    bytes_written: int = 0
    dropped_writes: int = 0   # the write queue was full, or the tier down
    errors: int = 0           # store calls that raised or timed out
    skipped: int = 0          # calls not made because the tier was down
    bad: dict = field(default_factory=dict)  # reason -> entries dropped
    claims_won: int = 0
    claims_lost: int = 0
    waits_served: int = 0     # items another instance encoded while this one waited
    waits_expired: int = 0    # items waited for in vain, then encoded here


class BadEntry(ValueError):
    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


def encode_entry(key: str, item: EncodedItem, expect: TierExpect) -> bytes:
    """The blob stored for ``item`` under ``key``."""
    tensor = item.embeddings.detach().to("cpu").contiguous()
    payload = tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
    header = {"key": key, "model": expect.model, "processing": expect.digest(),
              "dtype": str(tensor.dtype).removeprefix("torch."), "shape": list(tensor.shape),
              "modality": item.modality, "grid_thw": list(item.image_grid_thw),
              "part": list(item.part) if item.part is not None else None,
              "timing": [[name, value] for name, value in item.timing],
              "blake2b": hashlib.blake2b(payload, digest_size=16).hexdigest()}
    raw = json.dumps(header, separators=(",", ":")).encode()
    return MAGIC + struct.pack(">I", len(raw)) + raw + payload


def decode_entry(blob: bytes, key: str, expect: TierExpect) -> EncodedItem:
    """The item of an entry, or ``BadEntry`` naming why it cannot be served."""
    if not blob.startswith(MAGIC) or len(blob) < len(MAGIC) + 4:
        raise BadEntry("format", "no entry header")
    (size,), start = struct.unpack(">I", blob[len(MAGIC):len(MAGIC) + 4]), len(MAGIC) + 4
    try:
        header = json.loads(blob[start:start + size])
    except ValueError:
        raise BadEntry("format", "unreadable header") from None
    payload = blob[start + size:]
    for name, want in (("key", key), ("model", expect.model), ("processing", expect.digest()),
                       ("dtype", expect.dtype)):
        if header.get(name) != want:
            raise BadEntry(name, f"entry has {header.get(name)!r}, expected {want!r}")
    shape = header.get("shape")
    if not (isinstance(shape, list) and len(shape) == 2 and shape[1] == expect.width):
        raise BadEntry("shape", f"entry has {shape}, expected [tokens, {expect.width}]")
    dtype = getattr(torch, expect.dtype)
    if len(payload) != shape[0] * shape[1] * torch.empty((), dtype=dtype).element_size():
        raise BadEntry("truncated", f"{len(payload)} payload bytes for shape {shape}")
    if hashlib.blake2b(payload, digest_size=16).hexdigest() != header.get("blake2b"):
        raise BadEntry("integrity", "payload digest differs")
    tensor = torch.frombuffer(bytearray(payload), dtype=dtype).reshape(shape) if payload else torch.empty(shape, dtype=dtype)
    timing = tuple((name, tuple(value) if isinstance(value, list) else value) for name, value in header["timing"])
    part = tuple(header["part"]) if header.get("part") is not None else None
    return EncodedItem(tensor, tuple(header["grid_thw"]), header["modality"], part, timing)


class EmbeddingTier:
    """The tier over a byte store (``get_bytes(key) -> bytes | None``, ``put_bytes(key, blob)`` keeping the first
    value of a key, ``remove(key)``): contract checks, stats, asynchronous writes, claims, and a breaker: after a
    failed or slow (``call_timeout``) store call the tier is skipped for ``retry_seconds``, then tried again."""

    CLAIM_READS = 20  # reads of a claim that is not there yet (an in-flight put of another instance), poll_seconds apart

    def __init__(self, store, call_timeout: float = 1.0, retry_seconds: float = 10.0, queue_size: int = 64,
                 claim_seconds: float = 5.0, poll_seconds: float = 0.01):
        self.store, self.call_timeout, self.retry_seconds = store, call_timeout, retry_seconds
        self.claim_seconds, self.poll_seconds = claim_seconds, poll_seconds
        self.stats = TierStats()
        self._down_until = 0.0
        self._lock = threading.Lock()
        self._reads = ThreadPoolExecutor(max_workers=2, thread_name_prefix="epd-tier-read")
        self._writes: queue.Queue = queue.Queue(queue_size)
        self._writer = threading.Thread(target=self._write_loop, name="epd-tier-write", daemon=True)
        self._writer.start()

    # -- the breaker ------------------------------------------------------------------------------------------
    def available(self) -> bool:
        return time.monotonic() >= self._down_until

    def _failed(self, what: str, exc: BaseException) -> None:
        with self._lock:
            self.stats.errors += 1
            was_up = self.available()
            self._down_until = time.monotonic() + self.retry_seconds
        if was_up:
            LOG.warning("embedding tier unavailable (%s: %s); encoding without it, next try in %.0f s",
                        what, exc, self.retry_seconds)

    def _call(self, what: str, fn, *args, default=None):
        """``fn(*args)`` on a reader thread within ``call_timeout``; ``default`` when the tier is down or fails."""
        if not self.available():
            self.stats.skipped += 1
            return default
        try:
            return self._reads.submit(fn, *args).result(timeout=self.call_timeout)
        except FutureTimeout:
            self._failed(what, TimeoutError(f"no answer in {self.call_timeout} s"))
        except Exception as exc:
            self._failed(what, exc)
        return default

    # -- entries ----------------------------------------------------------------------------------------------
    def get(self, key: str, expect: TierExpect) -> EncodedItem | None:
        """The entry of ``key`` if the tier holds one that meets ``expect``; None otherwise (a bad one is dropped)."""
        blob = self._call("get", self.store.get_bytes, key)
        if not blob:
            self.stats.misses += 1
            return None
        try:
            item = decode_entry(blob, key, expect)
        except BadEntry as exc:
            self.stats.bad[exc.reason] = self.stats.bad.get(exc.reason, 0) + 1
            self.stats.misses += 1
            LOG.warning("embedding tier entry %s dropped: %s", key, exc)
            self._call("remove", self.store.remove, key)
            return None
        self.stats.hits += 1
        self.stats.bytes_read += len(blob)
        return item

    def put(self, key: str, item: EncodedItem, expect: TierExpect, release_claim: bool = False) -> None:
        """Publish ``item`` under ``key`` (asynchronously; then the claim on ``key`` is released where asked)."""
        if not self.available():
            self.stats.dropped_writes += 1
            return
        try:
            self._writes.put_nowait((key, encode_entry(key, item, expect), release_claim))
        except queue.Full:
            self.stats.dropped_writes += 1

    def _write_loop(self) -> None:
        while True:
            job = self._writes.get()
            if job is None:
                return
            key, blob, release = job
            try:
                if self.available():
                    self.store.put_bytes(key, blob)
                    self.stats.puts += 1
                    self.stats.bytes_written += len(blob)
                else:
                    self.stats.dropped_writes += 1
                if release:
                    self.store.remove(CLAIM_PREFIX + key)
            except Exception as exc:
                self._failed("put", exc)
            finally:
                self._writes.task_done()

    def flush(self) -> None:
        """Wait until every queued write is done (tests, shutdown)."""
        self._writes.join()

    # -- single-flight ----------------------------------------------------------------------------------------
    def claim(self, key: str) -> bool:
        """True: this caller encodes ``key`` (it won the claim, the claim had expired, or the tier is down);
        False: another instance holds a live claim, ``wait`` for its entry."""
        token = f"{os.getpid()}-{threading.get_ident()}-{time.time_ns()}"
        claim_key = CLAIM_PREFIX + key
        for _ in range(2):
            self._call("claim", self.store.put_bytes, claim_key, f"{token} {time.time()}".encode())
            held = self._read_claim(claim_key, key)
            if not self.available():
                return True  # the tier is down: encode
            owner, _, since = (held or b"").decode(errors="replace").partition(" ")
            if not held or owner == token:
                if self._call("is_exist", self.store.exists, key, default=False):
                    # the entry appeared since this caller's lookup (its encoder published it, then released the
                    # claim, maybe while our put of the claim found the rival's still there): no encode; ``wait``
                    # reads it at once
                    if held:
                        self._call("claim", self.store.remove, claim_key)
                    self.stats.claims_lost += 1
                    return False
                if not held:
                    continue  # the rival's claim went without an entry (its encode failed): claim again
                self.stats.claims_won += 1
                return True
            if time.time() - float(since or 0) < self.claim_seconds:
                self.stats.claims_lost += 1
                return False
            self._call("claim", self.store.remove, claim_key)  # its owner died: take it over
        return True

    def _read_claim(self, claim_key: str, key: str) -> bytes | None:
        """The claim's value once it reads back. Another instance's put of the same claim may still be in flight:
        Mooncake then keeps the key for that put (ours changes nothing) and answers a read with nothing until it
        completes, so an empty read is read again (``CLAIM_READS`` times, ``poll_seconds`` apart) while the tier is
        up; taken at once for "tier down", both instances encoded (2 of 16 cold requests, docs/benchmarks.md). An
        empty read is also the rival's claim released after its entry was published: reading stops once ``key``
        exists."""
        held = self._call("claim", self.store.get_bytes, claim_key)
        for _ in range(self.CLAIM_READS):
            if held or not self.available() or self._call("is_exist", self.store.exists, key, default=False):
                break
            time.sleep(self.poll_seconds)
            held = self._call("claim", self.store.get_bytes, claim_key)
        return held

    def wait(self, keys: list[str], expect: TierExpect) -> dict[str, EncodedItem]:
        """The entries of ``keys`` that appear within ``claim_seconds`` (the others: encode them here)."""
        found: dict[str, EncodedItem] = {}
        deadline = time.monotonic() + self.claim_seconds
        pending = list(dict.fromkeys(keys))
        while pending and time.monotonic() < deadline and self.available():
            for key in list(pending):
                if self._call("is_exist", self.store.exists, key, default=False):
                    item = self.get(key, expect)
                    if item is not None:
                        found[key] = item
                    pending.remove(key)
            if pending:
                time.sleep(self.poll_seconds)
        self.stats.waits_served += len(found)
        self.stats.waits_expired += len(dict.fromkeys(keys)) - len(found)
        return found

    def close(self) -> None:
        self._writes.put(None)
        self._writer.join(timeout=5)
        self._reads.shutdown(wait=False, cancel_futures=True)
        close = getattr(self.store, "close", None)
        if close is not None:
            close()
